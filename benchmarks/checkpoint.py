"""Checkpoint save/restore time and size, sync vs async, and how long a save stalls training.

Two shapes, each saved through `flaxlm.checkpoints.checkpointer.Checkpointer` (orbax) with
`async_save=False` and `async_save=True`:

- **tiny**: the default run's GPT-J (gin/models/gptj_tiny.gin: 4 layers x 256, vocab 384), the
  whole TrainState (params + AdamW moments), as training saves it.
- **1B**: a GPT-J of about 1.0B params (16 layers x 2048, vocab 50432, float32), params only,
  filled with random normals (not zeros, which would compress to nothing). Params only keeps
  it feasible on a 24 GiB machine: the AdamW moments would triple it.

For each: `save_call_s` is how long `save()` blocks the caller (the train loop's stall),
`commit_s` how long until the checkpoint is committed on disk, `restore_s` a restore onto the
same shardings, `MiB` the bytes on disk; medians over `--repeats` (tiny) and
`--big-repeats` (1B) runs, the modes alternating. For tiny, the loop stall is also measured
directly: N real train steps with one save in the middle, minus the same N steps without.

    python benchmarks/checkpoint.py                  # both shapes (~7 min, 2-core CPU)
    python benchmarks/checkpoint.py --skip-1b        # tiny only (~1 min)
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import logging  # noqa: E402

from flaxlm.checkpoints import checkpointer  # noqa: E402
from flaxlm.models.base import DecoderOnlyModel  # noqa: E402
from flaxlm.models.batch_shapes import batch_shapes_from  # noqa: E402
from flaxlm.models.gptj import GPTJConfig  # noqa: E402
from flaxlm.parallel.partitioning import Partitioner  # noqa: E402
from flaxlm.training import (
    optimizers,  # noqa: E402
)
from flaxlm.training import (
    steps as train_steps,  # noqa: E402
)

SEQ_LEN = 64
BATCH = 8
FEATURES = (
    "decoder_input_tokens",
    "decoder_target_tokens",
    "decoder_loss_weights",
    "decoder_segment_ids",
    "decoder_positions",
)


def tiny_model() -> DecoderOnlyModel:
    return DecoderOnlyModel(
        GPTJConfig(
            vocab_size=384,
            hidden_size=256,
            num_layers=4,
            num_heads=4,
            rotary_dim=32,
            max_position_embeddings=2048,
        )
    )


def big_model(hidden_size: int, num_layers: int) -> DecoderOnlyModel:
    return DecoderOnlyModel(
        GPTJConfig(
            vocab_size=50432,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=hidden_size // 128,
            rotary_dim=64,
            max_position_embeddings=2048,
        )
    )


def dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def fixed_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 259, size=(BATCH, SEQ_LEN), dtype=np.int32)
    return {
        "decoder_input_tokens": tokens,
        "decoder_target_tokens": tokens,
        "decoder_loss_weights": np.ones_like(tokens),
        "decoder_segment_ids": np.ones_like(tokens),
        "decoder_positions": np.broadcast_to(np.arange(SEQ_LEN, dtype=np.int32), tokens.shape),
    }


def time_save_restore(state: Any, abstract: Any, async_save: bool, params_only: bool) -> dict:
    """One save (blocking part, then commit), its size, and one restore."""
    root = tempfile.mkdtemp(prefix="flaxlm_ckpt_bench_")
    try:
        ckpt = checkpointer.Checkpointer(root, keep=None, async_save=async_save)
        start = time.perf_counter()
        if params_only:
            ckpt.save_params(1, state)
        else:
            ckpt.save(1, state, None, "config")
        save_call = time.perf_counter() - start
        ckpt.wait()
        commit = time.perf_counter() - start
        ckpt.close()
        size = dir_bytes(os.path.join(root, "checkpoints", "1"))
        reader = checkpointer.Checkpointer(root)
        start = time.perf_counter()
        if params_only:
            restored = reader.restore_params(1, abstract)
        else:
            restored = reader.restore(1, abstract)
        jax.block_until_ready(restored)
        restore = time.perf_counter() - start
        first, again = jax.tree.leaves(state)[-1], jax.tree.leaves(restored)[-1]
        assert np.array_equal(np.asarray(first), np.asarray(again)), "restore differs"
        del restored
        reader.close()
        return {"save_call_s": save_call, "commit_s": commit, "restore_s": restore, "bytes": size}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def loop_stall(setup: train_steps.Setup, steps: int, async_save: bool, repeats: int) -> dict:
    """Median extra loop time from one save in the middle of `steps` train steps."""
    step_fn = setup.partition_train_step(
        train_steps.make_train_step(setup.model, setup.partitioner, 1e-3)
    )
    batch = fixed_batch()
    state = setup.init_state()
    state, _ = step_fn(state, batch)  # compile
    jax.block_until_ready(state)

    def run(save: bool) -> float:
        nonlocal state
        root = tempfile.mkdtemp(prefix="flaxlm_ckpt_bench_")
        ckpt = checkpointer.Checkpointer(root, keep=None, async_save=async_save)
        start = time.perf_counter()
        for i in range(steps):
            state, metrics = step_fn(state, batch)
            float(metrics["loss"])  # the loop logs every step here: a host sync per step
            if save and i == steps // 2:
                ckpt.save(i, state, None, "config")
        elapsed = time.perf_counter() - start
        ckpt.close()
        shutil.rmtree(root, ignore_errors=True)
        return elapsed

    plain, saving = [], []
    for _ in range(repeats):
        plain.append(run(False))
        saving.append(run(True))
    base = statistics.median(plain)
    return {
        "loop_s": base,
        "loop_with_save_s": statistics.median(saving),
        "stall_s": statistics.median(s - p for s, p in zip(saving, plain, strict=True)),
        "step_ms": 1000 * base / steps,
    }


def random_params(model: DecoderOnlyModel, partitioner: Partitioner) -> tuple[Any, Any]:
    """Random-normal params of `model`'s shape on their shardings, and the abstract tree."""
    shapes = batch_shapes_from(dict.fromkeys(FEATURES, SEQ_LEN), 1)
    abstract = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0), shapes))
    shardings = partitioner.sharding(model.params_axes(shapes))
    leaves, treedef = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
    values = []
    for key, leaf, sharding in zip(keys, leaves, jax.tree.leaves(shardings), strict=True):
        fill = jax.jit(
            lambda k, shape=leaf.shape, dtype=leaf.dtype: 0.02 * jax.random.normal(k, shape, dtype),
            out_shardings=sharding,
        )
        values.append(fill(key))
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    return jax.tree.unflatten(treedef, values), abstract


def count(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.system()}; {jax.device_count()}x {jax.devices()[0].platform}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-1b", action="store_true", help="only the tiny model")
    parser.add_argument("--big-hidden-size", type=int, default=2048)
    parser.add_argument("--big-num-layers", type=int, default=16)
    parser.add_argument("--loop-steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--big-repeats", type=int, default=2)
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    logging.set_verbosity(logging.ERROR)
    partitioner = Partitioner(mesh_shape=(1, -1, 1))
    rows = []

    tiny = train_steps.Setup(
        tiny_model(),
        partitioner,
        optimizers.create_optimizer(learning_rate=1e-3),
        dict.fromkeys(FEATURES, SEQ_LEN),
    )
    state = tiny.init_state()
    for async_save in (False, True):
        row = {"model": "tiny", "what": "TrainState", "params": count(state.params)}
        row["mode"] = "async" if async_save else "sync"
        times = [
            time_save_restore(state, tiny.abstract_state, async_save, False)
            for _ in range(args.repeats)
        ]
        row.update({k: statistics.median(t[k] for t in times) for k in times[0]})
        row.update(loop_stall(tiny, args.loop_steps, async_save, args.repeats))
        rows.append(row)
        print(json.dumps(row), flush=True)
    del state

    if not args.skip_1b:
        model = big_model(args.big_hidden_size, args.big_num_layers)
        params, abstract = random_params(model, partitioner)
        jax.block_until_ready(params)
        # Alternate the modes so that neither always goes first (cold disk cache, new files).
        times = {False: [], True: []}
        for _ in range(args.big_repeats):
            for async_save in (False, True):
                times[async_save].append(time_save_restore(params, abstract, async_save, True))
                print(json.dumps(times[async_save][-1]), flush=True)
        for async_save in (False, True):
            row = {"model": "1B", "what": "params (float32)", "params": count(params)}
            row["mode"] = "async" if async_save else "sync"
            row.update(
                {k: statistics.median(t[k] for t in times[async_save]) for k in times[True][0]}
            )
            rows.append(row)

    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    today = datetime.date.today().isoformat()
    print()
    print(
        "| date | command | machine | model | saved | mode | save() blocks s | committed s "
        "| restore s | MiB | loop stall s (step ms) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        stall = f"{r['stall_s']:.3f} ({r['step_ms']:.0f})" if "stall_s" in r else "-"
        print(
            f"| {today} | `{command}` | {machine()} | {r['model']} ({r['params'] / 1e6:.1f}M) | "
            f"{r['what']} | {r['mode']} | {r['save_call_s']:.3f} | {r['commit_s']:.3f} | "
            f"{r['restore_s']:.3f} | {r['bytes'] / 2**20:.1f} | {stall} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
