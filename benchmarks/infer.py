"""`infer` over a file: fixed batches (`generation.generate_ids`) against the paged engine
(`infer.paged_generate_ids`: the serving engine's scheduler, every prompt queued at once),
alternating in one process on the same checkpoint and prompts.

The checkpoint is a trained flaxlm MODEL_DIR (byte vocabulary), e.g. the default run's:

    python -m flaxlm.main --gin_file=gin/gptj_pretrain.gin --gin.TRAIN_STEPS=8 \\
      --gin.MODEL_DIR="'/tmp/infer_bench_ckpt'"
    python benchmarks/infer.py --checkpoint /tmp/infer_bench_ckpt --json /tmp/infer.json

The prompts are `--examples` slices of flaxlm's own source of `--min-len` to `--max-len`
bytes (seeded), read as `infer` reads a JSONL file (`--write-jsonl` writes that file for the
command line). Each side decodes `--new` tokens after every prompt, greedily and sampled
(`--temperature`, seed 0), `--batch-size` rows at a time; `--stop-newline` adds the newline
to the EOS ids, so completions end at their line's end (mixed lengths, as a stop string
would make them). The first call of each side (compiling) is reported apart; then
`--repeats` rounds, each in the reverse order of the one before. Reported per decoding: each
side's median wall seconds and generated tokens/s (EOS included), paged / batch (> 1: the
engine is faster) with the min-max of the per-round ratios, and whether greedy outputs are
token-identical.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common  # noqa: E402 - puts the repository on the path
import numpy as np  # noqa: E402


def source_prompts(
    count: int, min_len: int, max_len: int, seed: int, long: tuple[int, int] = (0, 0)
) -> list[str]:
    """`count` slices of flaxlm's source, each `min_len` to `max_len` ASCII bytes, but
    `long[0]` of them (spread evenly) `long[1]` bytes."""
    files = sorted(
        glob.glob(os.path.join(bench_common.REPO, "flaxlm", "**", "*.py"), recursive=True)
    )
    text = "".join(open(f).read() for f in files).encode("ascii", "ignore").decode()
    rng = np.random.default_rng(seed)
    prompts = []
    every = count // long[0] if long[0] else 0
    for i in range(count):
        n = int(rng.integers(min_len, max_len + 1))
        if every and i % every == every // 2 and i // every < long[0]:
            n = long[1]
        start = int(rng.integers(0, len(text) - n))
        prompts.append(text[start : start + n])
    return prompts


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="/tmp/infer_bench_ckpt")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=120)
    parser.add_argument(
        "--long",
        type=int,
        nargs=2,
        default=(0, 0),
        metavar=("COUNT", "LENGTH"),
        help="COUNT of the prompts are LENGTH bytes long (a file with a few long prompts)",
    )
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--stop-newline", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decodings", nargs="+", default=["greedy", "sampled"])
    parser.add_argument("--decode-steps", type=int, help="the engine's (default infer's)")
    parser.add_argument("--prefill-rows", type=int, help="the engine's (default infer's)")
    parser.add_argument("--prefill-chunk", type=int, help="the engine's (default infer's)")
    parser.add_argument("--page-size", type=int, help="the engine's (default infer's)")
    parser.add_argument("--write-jsonl", help="also write the prompts as infer's JSONL here")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    import jax

    # As `flaxlm.main` runs: the persistent compilation cache on, every program cached. A
    # side's first call compiles (an infer run on a new machine); the later ones read its
    # programs back (every infer run after it).
    cache_dir = tempfile.mkdtemp(prefix="infer_bench_cache_")
    atexit.register(shutil.rmtree, cache_dir, True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    from flaxlm.checkpoints import run_dir
    from flaxlm.inference import generation
    from flaxlm.parallel.partitioning import Partitioner
    from flaxlm.runs import infer

    partitioner = Partitioner()
    model, params, step, row_start = run_dir.load_model_and_params(args.checkpoint, partitioner)
    texts = source_prompts(args.examples, args.min_len, args.max_len, 0, tuple(args.long))
    if args.write_jsonl:
        with open(args.write_jsonl, "w") as f:
            f.writelines(json.dumps({"in_text": t}) + "\n" for t in texts)
    examples, vocab, _ = infer.read_examples_from_texts(
        texts, model, row_start, run_dir.checkpoint_vocabulary(args.checkpoint)
    )
    if args.stop_newline:
        model.eos_ids = (*model.eos_ids, *vocab.encode("\n"))
    prompts = [e.input_ids for e in examples]
    engine_knobs = {
        k: v
        for k, v in (
            ("decode_steps", args.decode_steps),
            ("prefill_rows", args.prefill_rows),
            ("prefill_chunk", args.prefill_chunk),
            ("page_size", args.page_size),
        )
        if v is not None
    }
    settings = {
        "greedy": generation.GenerationSettings(max_new_tokens=args.new),
        "sampled": generation.GenerationSettings(
            max_new_tokens=args.new, temperature=args.temperature, seed=0
        ),
    }

    def run(side: str, decoding: str) -> tuple[float, list[list[int]]]:
        # A new model object: `generate` traces its program again (its compiled decoders are
        # kept per model), as the engine's new scheduler traces its own: each call costs
        # what an infer run's generation does.
        fresh = copy.copy(model)
        start = time.perf_counter()
        if side == "batch":
            ids = generation.generate_ids(
                fresh,
                params,
                prompts,
                partitioner,
                settings[decoding],
                batch_size=args.batch_size,
            )
        else:
            ids = infer.paged_generate_ids(
                fresh,
                params,
                prompts,
                partitioner,
                settings[decoding],
                max_rows=args.batch_size,
                **engine_knobs,
            )
        return time.perf_counter() - start, ids

    def tokens(ids: list[list[int]]) -> int:
        return sum(len(i) + (len(i) < args.new) for i in ids)  # EOS counted

    results: dict[str, Any] = {}
    for decoding in args.decodings:
        sides = ["batch", "paged"]
        cold, outputs = {}, {}
        for side in sides:
            cold[side], outputs[side] = run(side, decoding)
        times: dict[str, list[float]] = {side: [] for side in sides}
        for r in range(args.repeats):
            for side in sides if r % 2 == 0 else sides[::-1]:
                seconds, ids = run(side, decoding)
                assert ids == outputs[side], f"{side} {decoding}: outputs changed between runs"
                times[side].append(seconds)
        rate = {s: tokens(outputs[s]) / statistics.median(times[s]) for s in sides}
        ratios = [b / p for b, p in zip(times["batch"], times["paged"])]
        results[decoding] = {
            "cold_seconds": cold,
            "seconds": {s: statistics.median(times[s]) for s in sides},
            "tokens": {s: tokens(outputs[s]) for s in sides},
            "tokens_per_second": rate,
            "paged_over_batch": statistics.median(times["batch"])
            / statistics.median(times["paged"]),
            "ratio_range": [min(ratios), max(ratios)],
            "identical_outputs": outputs["batch"] == outputs["paged"],
            "ended_by_eos": sum(len(i) < args.new for i in outputs["paged"]),
        }
        r = results[decoding]
        for side in sides:
            print(
                f"{decoding:7s} {side:5s}: cold {cold[side]:6.2f} s, "
                f"warm {r['seconds'][side]:6.2f} s (median of {args.repeats}), "
                f"{rate[side]:7.1f} tokens/s",
                flush=True,
            )
        print(
            f"{decoding:7s} paged / batch = {r['paged_over_batch']:.2f}x "
            f"({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}); identical outputs: "
            f"{r['identical_outputs']}; {r['ended_by_eos']}/{len(prompts)} ended by EOS",
            flush=True,
        )
    lengths = [len(p) for p in prompts]
    config = (
        f"{type(model.config).__name__} step {step}, {len(prompts)} prompts of "
        f"{min(lengths)}-{max(lengths)} tokens, {args.new} new"
        + (" (stop at newline)" if args.stop_newline else "")
        + f", batch {args.batch_size}, padding ratio "
        + f"{infer.padding_ratio(lengths, args.new):.2f}"
    )
    print()
    bench_common.print_table(
        ["decoding", "batch s (tok/s)", "paged s (tok/s)", "paged / batch", "cold batch / paged s"],
        [
            [
                d,
                f"{r['seconds']['batch']:.2f} ({r['tokens_per_second']['batch']:.0f})",
                f"{r['seconds']['paged']:.2f} ({r['tokens_per_second']['paged']:.0f})",
                "{:.2f} ({:.2f}-{:.2f})".format(r["paged_over_batch"], *r["ratio_range"]),
                f"{r['cold_seconds']['batch']:.1f} / {r['cold_seconds']['paged']:.1f}",
            ]
            for d, r in results.items()
        ],
    )
    print(config)
    record = bench_common.run_record("infer.py", args, argv, config=config, results=results)
    bench_common.write_json(record, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
