"""Decode throughput against the HBM roofline, for the batch path and the serving engine.

    python benchmarks/decode_roofline.py --model llama3_2_1b --batches 1 16 64 --context 1024

Every decode step reads every parameter and each sequence's keys and values once, so on an
accelerator a step takes at least `(parameter bytes + KV bytes) / memory bandwidth`: at batch B
the roofline is `B` tokens per that time. For each batch this times

- `generate`: `inference.generation.generate` (one contiguous KV cache, the decode loop on the
  device), a prompt of `--context` random tokens then `--new` tokens; the prefill (the same
  call with one new token) is subtracted, so the rate is of the decode steps alone;
- `paged`: the serving engine's scheduler (`inference.scheduler`: paged KV cache, continuous
  batching, `--decode-steps` tokens per dispatch), the same prompts submitted together, timed
  from the first decode dispatch after every prompt is prefilled to the last token, each
  row's pages gathered for the attention (`paged_attention='gather'`);
- `pallas`: the same with `paged_attention='pallas'` (JAX's Pallas kernel reads the pages in
  place: a GPU's path; on CPU it runs interpreted, slowly),
- `sampled`: `paged` with every row sampled as a chat request may ask (`SAMPLED`:
  temperature, top-k, top-p; `inference/sampling.py`), and `penalized` with the presence,
  frequency and repetition penalties besides (`PENALIZED`): what the per-row settings and
  each dispatch's token histories cost against greedy rows,

and reports tokens/s, the share of the roofline (the chip's datasheet bandwidth,
`flaxlm.plan.chips`; on CPU there is none) and, for the engine, the host's own time a
dispatch (a full run's wall time less the time `step` waited for tokens,
`Scheduler.read_wait_s`, over its dispatches: the host work the device may wait on).
Parameters are cast to `--dtype` as an inference server holds them. One process, the paths
alternating per batch size.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import statistics
import time
from collections.abc import Sequence
from typing import Any

import bench_common  # a sibling script; puts the repository on sys.path
import numpy as np
import profile_summary  # a sibling script


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama3_2_1b", help="a gin/models/ name")
    p.add_argument("--layers", type=int, help="the model cut to its first N layers")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=1024, help="prompt tokens")
    p.add_argument("--new", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--paths",
        nargs="+",
        choices=("generate", "paged", "pallas", "sampled", "penalized"),
        default=["generate", "paged"],
    )
    p.add_argument("--decode-steps", type=int, default=16, help="the engine's tokens per dispatch")
    p.add_argument(
        "--scan",
        action=argparse.BooleanOptionalAction,
        help="the layers scanned (one stacked KV cache) or unrolled; default: the gin's",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="trace each path's decode at the largest batch into DIR (the engine's into "
        "DIR/paged and DIR/pallas) and print where a step's time goes (profile_summary.py; "
        "the engine's per dispatch of --decode-steps tokens, its prefill included)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    return p.parse_args(argv)


# What the `sampled` and `penalized` paths' rows ask for (a chat request's sampling, then with
# every penalty).
SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=50)
PENALIZED = dict(SAMPLED, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)


@dataclasses.dataclass(eq=False)
class Job:
    """What the scheduler reads of a request (`inference.jobs.Job`)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Any  # inference.sampling.Sampling
    seed: int = 0
    events: Any = dataclasses.field(default_factory=queue.SimpleQueue)


def model_and_init(args: argparse.Namespace) -> tuple[Any, Any]:
    """The `--model` (cut to `--layers`, `--scan` where given) and a function making its
    params as trained, cast to `--dtype` as an inference server holds them (both decode paths
    lay them out for decoding themselves)."""
    import jax
    import jax.numpy as jnp

    changes = {"dtype": args.dtype}
    if getattr(args, "scan", None) is not None:
        changes["scan_layers"] = args.scan
    if args.layers:
        changes["num_layers"] = args.layers
    model = bench_common.gin_model(args.model, **changes)
    dtype = jnp.dtype(args.dtype)

    def init() -> Any:
        return jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            model.init_params(jax.random.PRNGKey(0), model.example_batch_shapes()),
        )

    return model, init


def parameter_bytes(params: Any) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def kv_bytes_per_token(model: Any, dtype: Any) -> int:
    """Bytes of keys and values one cached token holds over all layers."""
    import numpy as np

    config = model.config
    head_dim = config.dim_per_head
    layers = config.num_layers
    return 2 * layers * config.kv_heads * head_dim * np.dtype(dtype).itemsize


def roofline(model: Any, params: Any, batch: int, args: argparse.Namespace, chip: Any) -> float:
    """Tokens/s at the memory roofline: batch tokens per read of the params and the KV of
    the average context during the decode steps."""
    if chip is None:
        return float("nan")
    context = args.context + args.new / 2
    step_bytes = parameter_bytes(params) + batch * context * kv_bytes_per_token(model, args.dtype)
    return batch * chip.memory_bytes_per_s / step_bytes


def time_generate(model: Any, params: Any, prompts: np.ndarray, args: argparse.Namespace) -> dict:
    import jax

    from flaxlm.inference import generation

    def run(new: int) -> float:
        start = time.perf_counter()
        out = generation.generate(
            model, params, {"inputs": prompts}, max_new_tokens=new, eos_id=None
        )
        jax.block_until_ready(out)
        return time.perf_counter() - start

    run(1), run(args.new)  # compiles both
    prefill = statistics.median(run(1) for _ in range(args.repeats))
    full = statistics.median(run(args.new) for _ in range(args.repeats))
    decode = max(full - prefill, 1e-9)
    out = {"tokens_per_second": prompts.shape[0] * (args.new - 1) / decode, "prefill_s": prefill}
    if args.profile and prompts.shape[0] == max(args.batches):
        out["profile"] = profile_summary.trace_steps(
            lambda n: run(args.new), args.profile, args.new
        )
    return out


def time_paged(
    model: Any,
    params: Any,
    prompts: np.ndarray,
    args: argparse.Namespace,
    paged_attention: str = "gather",
    settings: dict | None = None,
    name: str = "paged",
) -> dict:
    """The engine's decode rate: the time of a run to `--new` tokens less that of a run to
    one (prefill and the first token), fresh prompts each run (the prefix cache would
    otherwise skip their prefill); each row sampled by `settings` (`Sampling`'s; greedy);
    `name`: the path's, for its profile's directory."""
    from flaxlm.inference.sampling import Sampling
    from flaxlm.inference.scheduler import Scheduler
    from flaxlm.parallel.partitioning import Partitioner

    batch, context = prompts.shape
    scheduler = Scheduler(
        model,
        params,
        Partitioner(mesh_shape=(1, 1, 1)),
        max_rows=batch,
        page_size=args.page_size,
        max_seq_len=context + args.new,
        decode_steps=args.decode_steps,
        prefill_chunk=min(context, 512),
        prefill_rows=batch,
        paged_attention=paged_attention,
    )
    rng = np.random.default_rng(batch)

    host = []  # per full run: the host's own seconds a dispatch (waits for tokens excluded)

    def run(new: int) -> float:
        fresh = rng.integers(3, model.config.vocab_size, (batch, context), np.int32)
        waited, dispatches = scheduler.read_wait_s, scheduler_dispatches(scheduler)
        start = time.perf_counter()
        for i, row in enumerate(fresh):
            scheduler.add(Job(row.tolist(), new, Sampling(**(settings or {})), seed=i))
        while scheduler.busy:
            scheduler.step()
        elapsed = time.perf_counter() - start
        if new == args.new:
            own = elapsed - (scheduler.read_wait_s - waited)
            host.append(own / max(scheduler_dispatches(scheduler) - dispatches, 1))
        return elapsed

    run(1), run(args.new)  # compiles
    host.clear()
    first = statistics.median(run(1) for _ in range(args.repeats))
    full = statistics.median(run(args.new) for _ in range(args.repeats))
    out = {
        "tokens_per_second": batch * (args.new - 1) / max(full - first, 1e-9),
        "host_ms_per_dispatch": 1e3 * statistics.median(host),
    }
    if args.profile and batch == max(args.batches):
        dispatches = -(-args.new // args.decode_steps)
        out["profile"] = profile_summary.trace_steps(
            lambda n: run(args.new),
            os.path.join(args.profile, name),
            dispatches,
        )
    return out


def scheduler_dispatches(scheduler: Any) -> int:
    """The prefill and decode dispatches a scheduler has run."""
    return scheduler.prefill_dispatches + scheduler.decode_dispatches


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    import jax

    from flaxlm.plan import chips

    device = jax.devices()[0]
    chip = chips.chip_for(device)
    model, init = model_and_init(args)
    params = jax.jit(init)()
    rng = np.random.default_rng(0)
    rows = []
    print(
        f"{args.model} on {bench_common.machine_description([device])}: "
        f"{parameter_bytes(params) / 1e9:.2f} GB of params, "
        f"{kv_bytes_per_token(model, args.dtype)} KV bytes per token"
    )
    for batch in args.batches:
        prompts = rng.integers(3, model.config.vocab_size, (batch, args.context), np.int32)
        roof = roofline(model, params, batch, args, chip)
        for path in args.paths:
            try:
                if path == "generate":
                    timed = time_generate(model, params, prompts, args)
                else:
                    attention = "pallas" if path == "pallas" else "gather"
                    settings = {"sampled": SAMPLED, "penalized": PENALIZED}.get(path)
                    timed = time_paged(model, params, prompts, args, attention, settings, path)
                row = {"batch": batch, "path": path, **timed}
            except Exception as e:  # noqa: BLE001 - one failing path must not cost the rest
                row = {"batch": batch, "path": path, "failed": f"{type(e).__name__}: {e}"[:300]}
            row["roofline_tokens_per_second"] = roof
            if "tokens_per_second" in row:
                row["of_roofline"] = row["tokens_per_second"] / roof
            rows.append(row)
            print(row, flush=True)
    bench_common.print_table(
        ["batch", "path", "tokens/s", "roofline tokens/s", "of roofline", "host ms/dispatch"],
        [
            [
                r["batch"],
                r["path"],
                f"{r['tokens_per_second']:,.0f}" if "tokens_per_second" in r else r["failed"],
                f"{r['roofline_tokens_per_second']:,.0f}",
                f"{r.get('of_roofline', float('nan')):.1%}",
                f"{r['host_ms_per_dispatch']:.2f}" if "host_ms_per_dispatch" in r else "-",
            ]
            for r in rows
        ],
    )
    bench_common.write_json({"rows": rows, "args": vars(args)}, args.json)
    return rows


if __name__ == "__main__":
    main()
