"""Tokens/s the input pipeline delivers per host, beside the tokens/s the train step consumes.

Two sources at the same shapes as the step that would consume them:
- `stdlib_py` (the default task, byte vocabulary, packed `targets` of `--seq-len`);
- a JSONL task of in_text/out_text pairs (consecutive chunks of the standard library's
  sources) through an HF tokenizer (a BPE trained here, nothing downloaded), packed prefix-LM
  rows of `--seq-len // 2` input + `--seq-len // 2` target tokens.

For each, the CPU seconds (all threads) to build the pipeline (`pipeline.host_input`: seqio's
graph building, AutoGraph) and to its first batch (the shuffle buffer filled), then the
pipeline side times `--batches` host batches out of `pipeline.host_input` (after
warm-up) as numpy, the step side times `--steps` partitioned train steps of the tiny GPT-J on
one such batch. Tokens are row positions (batch x length); the non-padding share is reported.

    python benchmarks/input_pipeline.py
    python benchmarks/input_pipeline.py --batches 5 --steps 2 --json out.json

The pipeline keeps up when its tokens/s is above the step's (ratio > 1).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import jax  # noqa: E402
import seqio  # noqa: E402
from absl import logging  # noqa: E402
from bench_common import machine_description  # noqa: E402  (puts the repository on sys.path)

import tasks  # noqa: E402, F401
from flaxlm.data import pipeline  # noqa: E402
from flaxlm.data.config import DatasetConfig
from flaxlm.data.vocabularies import HuggingFaceVocabulary  # noqa: E402
from flaxlm.models.base import DecoderOnlyModel  # noqa: E402
from flaxlm.models.batch_shapes import model_feature_lengths  # noqa: E402
from flaxlm.models.gptj import GPTJConfig  # noqa: E402
from flaxlm.parallel.partitioning import Partitioner  # noqa: E402
from flaxlm.training import (
    optimizers,  # noqa: E402
)
from flaxlm.training import (
    steps as train_steps,  # noqa: E402
)
from tasks.jsonl import register_jsonl_task  # noqa: E402
from tasks.stdlib import stdlib_files  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256, help="model length of a row")
    p.add_argument("--batches", type=int, default=20, help="timed pipeline batches")
    p.add_argument("--steps", type=int, default=5, help="timed train steps (0: the pipeline alone)")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds of both")
    p.add_argument(
        "--input-shards",
        type=int,
        default=None,
        help="logical input shards this host reads (DatasetConfig.num_input_shards; default 1)",
    )
    p.add_argument("--hf-vocab-size", type=int, default=2048)
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def build_tokenizer(texts: list[str], vocab_size: int, path: str) -> str:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    special = ["<pad>", "</s>", "<unk>"]
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special)
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(path)
    return path


def jsonl_task(root: str, vocab_size: int) -> tuple[str, int]:
    """A JSONL task of consecutive 20-line chunks of stdlib sources; (name, vocab size)."""
    texts = [
        open(f, encoding="utf-8", errors="replace").read() for f in stdlib_files("train")[:200]
    ]
    vocab = HuggingFaceVocabulary(build_tokenizer(texts, vocab_size, os.path.join(root, "tok")))
    path = os.path.join(root, "train.jsonl")
    with open(path, "w") as f:
        for text in texts:
            lines = text.splitlines(keepends=True)
            for i in range(0, len(lines) - 40, 40):
                pair = {
                    "in_text": "".join(lines[i : i + 20]),
                    "out_text": "".join(lines[i + 20 : i + 40]),
                }
                f.write(json.dumps(pair) + "\n")
    name = register_jsonl_task(name="bench_jsonl", split_files={"train": path}, vocabulary=vocab)
    return name, vocab.vocab_size


def time_pipeline(iterator, batches: int) -> tuple[float, float]:
    """(seconds for `batches` host batches, non-padding share of their positions)."""
    start = time.perf_counter()
    real = total = 0
    for _ in range(batches):
        batch = iterator.next_numpy()
        real += int((batch["decoder_segment_ids"] > 0).sum())
        total += batch["decoder_segment_ids"].size
    return time.perf_counter() - start, real / total


def measure(name: str, lengths: dict, vocab_size: int, args: argparse.Namespace) -> dict:
    partitioner = Partitioner()
    cfg = DatasetConfig(
        mixture_or_task_name=name,
        task_feature_lengths=lengths,
        batch_size=args.batch_size,
        num_input_shards=args.input_shards,
    )
    converter = seqio.DecoderFeatureConverter
    layout = partitioner.data_layout(cfg.batch_size)
    cpu = time.process_time()  # all the process's threads: tf.data's too
    source = pipeline.host_input(cfg, layout, converter)
    build_cpu = time.process_time() - cpu
    iterator = pipeline.DataIterator(source, partitioner, layout)
    cpu = time.process_time()
    iterator.next_numpy()
    first_batch_cpu = time.process_time() - cpu
    feature_lengths = model_feature_lengths(converter, cfg.task_feature_lengths, cfg.pack)
    time_pipeline(iterator, 3)  # warm-up: tf.data threads, shuffle buffer
    pipe, real = [], []
    positions = layout.per_host_batch_size * feature_lengths["decoder_target_tokens"]
    # The pipeline rounds first, back to back: a round timed right after train steps would
    # find batches that the prefetch buffer filled while the steps ran.
    for _ in range(args.repeats):
        seconds, share = time_pipeline(iterator, args.batches)
        pipe.append(args.batches * positions / seconds)
        real.append(share)
    steps = [float("nan")]
    if args.steps:
        steps = train_step_rates(partitioner, iterator, feature_lengths, vocab_size, args)
    result = {
        "task": name,
        "task_feature_lengths": lengths,
        "pipeline_tokens_per_second_per_host": statistics.median(pipe),
        "train_step_tokens_per_second": statistics.median(steps),
        "non_padding_share": statistics.median(real),
        "build_cpu_seconds": build_cpu,
        "first_batch_cpu_seconds": first_batch_cpu,
        "rounds": {"pipeline": pipe, "train_step": steps},
    }
    result["ratio"] = (
        result["pipeline_tokens_per_second_per_host"] / result["train_step_tokens_per_second"]
    )
    return result


def train_step_rates(partitioner, iterator, feature_lengths, vocab_size, args) -> list[float]:
    """Tokens/s of `--repeats` rounds of `--steps` train steps of the tiny GPT-J."""
    model = DecoderOnlyModel(
        GPTJConfig(
            vocab_size=-(-vocab_size // 128) * 128,
            hidden_size=256,
            num_layers=4,
            num_heads=4,
            rotary_dim=32,
            max_position_embeddings=2048,
        )
    )
    tx = optimizers.create_optimizer(learning_rate=1e-3)
    setup = train_steps.Setup(model, partitioner, tx, feature_lengths)
    step = setup.partition_train_step(train_steps.make_train_step(model, partitioner, 1e-3))
    state = setup.init_state()
    batch = iterator.to_global(iterator.next_numpy())
    for _ in range(2):  # compile
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    steps = []
    global_positions = args.batch_size * feature_lengths["decoder_target_tokens"]
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.steps):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        steps.append(args.steps * global_positions / (time.perf_counter() - start))
    return steps


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.set_verbosity(logging.ERROR)
    pipeline.configure_tensorflow()
    half = args.seq_len // 2
    with tempfile.TemporaryDirectory() as root:
        jsonl_name, jsonl_vocab = jsonl_task(root, args.hf_vocab_size)
        runs = [
            measure("stdlib_py", {"targets": args.seq_len}, 259, args),
            measure(jsonl_name, {"inputs": half, "targets": half}, jsonl_vocab, args),
        ]
    machine = machine_description()
    shards = args.input_shards or 1
    print(
        f"machine: {machine}; B{args.batch_size}xL{args.seq_len}, "
        f"{shards} input shard(s), GPT-J 4x256"
    )
    print(
        "| task | pipeline tok/s/host | train step tok/s | ratio | non-padding "
        "| build CPU s | first batch CPU s |"
    )
    for r in runs:
        print(
            f"| {r['task']} {r['task_feature_lengths']} | "
            f"{r['pipeline_tokens_per_second_per_host']:,.0f} | "
            f"{r['train_step_tokens_per_second']:,.0f} | {r['ratio']:.1f} | "
            f"{r['non_padding_share']:.2f} | {r['build_cpu_seconds']:.2f} | "
            f"{r['first_batch_cpu_seconds']:.2f} |"
        )
    results = {"command": " ".join(["python", *sys.argv]), "machine": machine, "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
