"""flaxlm's train step against a plain `jax.jit` step and HF's PyTorch GPT-J, on CPU.

Three sides train the same GPT-J shape on the same unpacked random batch (the same tokens,
every position weighted) with the same optimizer: AdamW b1 0.9, b2 0.95, eps 1e-8, lr 1e-3,
weight decay 0.1 on every param but biases and norm scales, global-norm clip 1.0
(flaxlm's `optimizers.create_optimizer` defaults).

  flaxlm  its own train step: `Setup`, `make_train_step`, `Partitioner.partition`
          (`--devices`, default 1: XLA:CPU uses every core from one device, like torch)
  plain   a `jax.jit` of `jax.value_and_grad` of a cross-entropy written here, the same
          module and optax optimizer, no partitioner: what flaxlm's own cost is measured by
  torch   HF transformers' `GPTJForCausalLM` with `torch.optim.AdamW` in param groups,
          CPU torch (benchmarks/torch_side.py); `--no-torch` leaves it out

After a compiling warm-up they alternate in one process, R rounds (`--repeats`) of N steps
(`--steps`), each round in the reverse order of the last (flaxlm, plain, torch; torch, plain,
flaxlm; ...), so that the machine's drift falls on every side alike. Per shape: each side's
median ms/step and tokens/s, torch / flaxlm (> 1: flaxlm faster) and plain / flaxlm (1.0: no
overhead), each with its spread (min-max over rounds). Then the real loop (the packed
`stdlib_py` pipeline through `DataIterator` into flaxlm's step) runs K steps and the report
gives the fraction of loop time spent waiting on input (`DataIterator.wait_seconds`).

Shapes (`--shapes`, default `baby gptj`):

  baby    nanoGPT's "baby GPT" (4 layers, 4 heads, width 128, block 64, batch 12) as a GPT-J
          with flaxlm's byte vocabulary padded to 384 (nanoGPT's shakespeare_char has 65)
  gptj    gin/models/gptj_tiny.gin (4 layers, 4 heads, width 256, vocab 384) at batch 16 x
          length 256, as gin/gptj_pretrain.gin
  custom  gptj's sizes with --hidden-size, --num-layers, --num-heads, --batch-size, --seq-len
          (a size flag given without --shapes selects it)

Conditions, in the JSON and the report: CPU model, cores, load average, thread settings,
XLA_FLAGS, torch's threads, and a 512 x 512 float32 numpy matmul probe (GFLOP/s) before and
after the run: CPU time on a shared VM moves by tens of percent from day to day, so compare
only sides of one run, and runs of different days through the probe.

Knobs, each recorded: --dtype (compute dtype of every side: flaxlm's `dtype`, torch's CPU
autocast), --remat (flaxlm's remat policy; torch: HF gradient checkpointing), --attention
(the JAX sides'; HF's GPT-J has only its eager one), --loss-chunk-size (flaxlm only),
--xla-flags="..." (set before JAX starts; note the =), --torch-threads, --torch-adamw.

    python benchmarks/train_step.py --json /tmp/ts.json    # the recorded configuration
    python benchmarks/train_step.py --shapes baby --steps 2 --repeats 2 --input-steps 0

Targets: plain / flaxlm >= 0.97, input wait < 2%.
"""

from __future__ import annotations

import os

# TensorFlow is only the input pipeline here; keep its C++ start-up chatter out of the output.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import datetime  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Mapping, Sequence  # noqa: E402
from functools import partial  # noqa: E402
from typing import Any  # noqa: E402

import bench_common  # noqa: E402  (a sibling script; puts the repository on sys.path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch_side  # noqa: E402  (a sibling script)
import train_step_report as report  # noqa: E402  (a sibling script)
from absl import logging  # noqa: E402

import tasks  # noqa: E402, F401  (registers stdlib_py)
from flaxlm.data import pipeline  # noqa: E402
from flaxlm.data.config import DatasetConfig
from flaxlm.models import attention, layers, row_start  # noqa: E402
from flaxlm.models.base import DecoderOnlyModel  # noqa: E402
from flaxlm.models.batch_shapes import batch_shapes_from, model_feature_lengths  # noqa: E402
from flaxlm.models.gptj import GPTJConfig  # noqa: E402
from flaxlm.parallel.partitioning import Partitioner  # noqa: E402
from flaxlm.training import (
    optimizers,  # noqa: E402
)
from flaxlm.training import (
    steps as train_steps,  # noqa: E402
)

LEARNING_RATE = torch_side.LEARNING_RATE
VOCAB_SIZE = 384  # ByteVocabulary's 259 ids padded to a multiple of 128, as gptj_tiny.gin
SIZES = ("num_layers", "num_heads", "hidden_size", "seq_len", "batch_size")
# Each shape's sizes and default N (steps per timed block: blocks of about 0.3-3 s here).
SHAPES: dict[str, dict[str, int]] = {
    "baby": dict(num_layers=4, num_heads=4, hidden_size=128, seq_len=64, batch_size=12, steps=20),
    "gptj": dict(num_layers=4, num_heads=4, hidden_size=256, seq_len=256, batch_size=16, steps=5),
}

Batch = Mapping[str, Any]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", nargs="+", choices=(*SHAPES, "custom"), help="default: baby gptj")
    for size in SIZES:
        p.add_argument(f"--{size.replace('_', '-')}", type=int, help="custom shape's")
    p.add_argument("--steps", type=int, help="N per block (default: baby 20, else 5)")
    p.add_argument("--repeats", type=int, default=6, help="R: rounds, default 6 (keep it even)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side, default 2")
    p.add_argument("--input-steps", type=int, default=20, help="K loop steps, default 20; 0 skips")
    p.add_argument("--input-warmup", type=int, default=3, help="untimed loop steps, default 3")
    p.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--devices", type=int, default=1, help="devices flaxlm's mesh uses, default 1")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--remat", choices=sorted(layers.REMAT_POLICIES), default="none")
    p.add_argument("--attention", choices=attention.ATTENTION_IMPLEMENTATIONS, default="xla")
    p.add_argument("--loss-chunk-size", type=int, help="flaxlm's loss_chunk_size")
    p.add_argument("--xla-flags", default="", help='added to XLA_FLAGS: --xla-flags="--xla_.."')
    p.add_argument("--torch-threads", type=int, help="default: every core")
    p.add_argument("--torch-adamw", choices=torch_side.ADAMW_IMPLEMENTATIONS, default="default")
    p.add_argument("--note", default="", help="free text for the RESULTS.md rows")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON here")
    args = p.parse_args(argv)
    custom = [s for s in SIZES if getattr(args, s) is not None]
    if args.shapes is None:
        args.shapes = ["custom"] if custom else list(SHAPES)
    elif custom and "custom" not in args.shapes:
        p.error("--" + custom[0].replace("_", "-") + " sizes the custom shape: add it to --shapes.")
    for name in (*custom, "steps", "repeats", "warmup", "devices"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1.")
    if args.input_steps < 0 or args.input_warmup < 0:
        p.error("--input-steps and --input-warmup must be at least 0.")
    return args


def shape_of(name: str, args: argparse.Namespace) -> dict[str, int]:
    """The sizes and N of shape `name` (custom: gptj's, overridden by the size flags)."""
    shape = dict(SHAPES.get(name, SHAPES["gptj"]))
    if name == "custom":
        shape.update({s: getattr(args, s) for s in SIZES if getattr(args, s) is not None})
    if args.steps is not None:
        shape["steps"] = args.steps
    return shape


def apply_xla_flags(flags: str) -> None:
    """Append `flags` to XLA_FLAGS; XLA reads them when JAX's backends start, so only before."""
    if not flags:
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("--xla-flags: JAX has started already; pass them on the command line.")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


# ---------------------------------------------------------------------------- setup


def build_model(shape: Mapping[str, int], args: argparse.Namespace) -> DecoderOnlyModel:
    return DecoderOnlyModel(
        GPTJConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=shape["hidden_size"],
            num_layers=shape["num_layers"],
            num_heads=shape["num_heads"],
            rotary_dim=torch_side.rotary_dim(shape["hidden_size"], shape["num_heads"]),
            max_position_embeddings=max(2048, shape["seq_len"]),
            dtype=args.dtype,
            remat_policy=args.remat,
            attention=args.attention,
        ),
        loss_chunk_size=args.loss_chunk_size,
    )


def random_batch(batch_size: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One unpacked row per example of random byte tokens, every position weighted: the
    model features of an unpacked decoder batch (no segment ids, no positions)."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(3, 259, size=(batch_size, length), dtype=np.int32)
    inputs = np.concatenate([np.zeros((batch_size, 1), np.int32), targets[:, :-1]], axis=1)
    return {
        "decoder_input_tokens": inputs,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": np.ones_like(targets),
    }


def make_optimizer() -> optax.GradientTransformation:
    return optimizers.create_optimizer(
        learning_rate=LEARNING_RATE,
        b1=torch_side.BETAS[0],
        b2=torch_side.BETAS[1],
        eps=torch_side.EPS,
        weight_decay=torch_side.WEIGHT_DECAY,
        clip_norm=torch_side.CLIP_NORM,
    )


# ---------------------------------------------------------------------------- JAX sides


def plain_loss(module: Any, params: Any, batch: Batch) -> jax.Array:
    """Mean token cross-entropy over the weighted positions, straight from the module."""
    logits = module.apply(
        {"params": params},
        batch["decoder_input_tokens"],
        batch.get("decoder_positions"),
        batch.get("decoder_segment_ids"),
        deterministic=True,
    )
    xent = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["decoder_target_tokens"]
    )
    weights = batch["decoder_loss_weights"].astype(jnp.float32)
    return jnp.sum(xent * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def make_plain_step(
    module: Any, tx: optax.GradientTransformation
) -> Callable[[Any, Any, Batch], tuple[Any, Any, jax.Array]]:
    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params: Any, opt_state: Any, batch: Batch) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(partial(plain_loss, module))(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


class JaxSides:
    """flaxlm's step and the plain one with their states, each advanced `n` steps at a time."""

    def __init__(self, model: DecoderOnlyModel, partitioner: Partitioner, batch: Batch) -> None:
        self.tx = tx = make_optimizer()
        lengths = {k: v.shape[1] for k, v in batch.items()}
        self.setup = train_steps.Setup(model, partitioner, tx, lengths)
        self.flaxlm_step = self.setup.partition_train_step(
            train_steps.make_train_step(model, partitioner, LEARNING_RATE)
        )
        self.state = self.setup.init_state()
        # The same init as Setup's (seed 0, batch of 1), so the first losses must agree.
        # Committed to the device, as the step's outputs are: no second compile on call 2.
        params = model.init_params(jax.random.PRNGKey(0), batch_shapes_from(lengths, 1))
        self.params = jax.device_put(params, jax.devices()[0])
        self.opt_state = jax.device_put(tx.init(self.params), jax.devices()[0])
        self.plain_step = make_plain_step(model.module, tx)
        # Each side its own device copy of the batch, placed as its loop would place it.
        self.flaxlm_batch = {
            k: jax.device_put(v, partitioner.batch_sharding(v.ndim)) for k, v in batch.items()
        }
        self.plain_batch = jax.device_put(dict(batch), jax.devices()[0])
        self.flaxlm_loss = self.plain_loss = float("nan")

    def run_flaxlm(self, n: int) -> float:
        start = time.perf_counter()
        state = self.state
        for _ in range(n):
            state, metrics = self.flaxlm_step(state, self.flaxlm_batch)
        jax.block_until_ready(state)
        elapsed = time.perf_counter() - start
        self.state, self.flaxlm_loss = state, float(metrics["loss"])
        return elapsed

    def run_plain(self, n: int) -> float:
        start = time.perf_counter()
        params, opt_state = self.params, self.opt_state
        for _ in range(n):
            params, opt_state, loss = self.plain_step(params, opt_state, self.plain_batch)
        jax.block_until_ready((params, opt_state))
        elapsed = time.perf_counter() - start
        self.params, self.opt_state, self.plain_loss = params, opt_state, float(loss)
        return elapsed


# ---------------------------------------------------------------------------- measurement


def spread(values: Sequence[float]) -> list[float]:
    return [min(values), max(values)]


def measure_sides(
    runners: Mapping[str, Callable[[int], float]],
    losses: Callable[[], dict[str, float]],
    shape: Mapping[str, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Warm-up (compile), then R rounds of N steps of every side, in ABBA order."""
    start = time.perf_counter()
    first_losses = {}
    for name, run in runners.items():
        run(1)
        first_losses[name] = losses()[name]
        if args.warmup > 1:
            run(args.warmup - 1)
    print(f"  compiled and warmed up every side in {time.perf_counter() - start:.1f}s", flush=True)
    n, names = shape["steps"], list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(runners[name](n) / n)
        line = ", ".join(f"{name} {report.ms(times[name][-1])}" for name in order)
        print(f"  round {r + 1}/{args.repeats}: {line} ms/step", flush=True)
    tokens = shape["batch_size"] * shape["seq_len"]
    sides = {}
    for name in names:
        median = statistics.median(times[name])
        sides[name] = {
            "step_seconds": median,
            "tokens_per_second": tokens / median,
            "step_seconds_per_round": times[name],
            "step_seconds_spread": spread(times[name]),
        }
    ratios = {}
    for name in names[1:]:
        per_round = [t / f for t, f in zip(times[name], times["flaxlm"], strict=True)]
        ratios[f"{name}/flaxlm"] = {
            "ratio": sides[name]["step_seconds"] / sides["flaxlm"]["step_seconds"],
            "per_round": per_round,
            "spread": spread(per_round),
        }
    # flaxlm and plain share init, batch and optimizer: the same trajectory. torch's init
    # differs; it starts near ln(vocab) too.
    return {
        "sides": sides,
        "ratios": ratios,
        "first_loss": first_losses,
        "last_loss": losses(),
    }


def measure_input_wait(
    model: DecoderOnlyModel,
    partitioner: Partitioner,
    jax_sides: JaxSides,
    shape: Mapping[str, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The training loop's shape, `state = step(state, next(iterator))`, K times over the
    packed stdlib_py pipeline (its own compile of flaxlm's step: packed batches carry segment
    ids and positions)."""
    start = time.perf_counter()
    cfg = DatasetConfig(
        mixture_or_task_name="stdlib_py",
        task_feature_lengths={"targets": shape["seq_len"]},
        batch_size=shape["batch_size"],
    )
    converter = pipeline.converter_for(cfg, model, row_start.SEQIO_START)
    # The same optimizer object: it is part of the state's tree structure.
    lengths = model_feature_lengths(converter, cfg.task_feature_lengths, cfg.pack)
    setup = train_steps.Setup(model, partitioner, jax_sides.tx, lengths)
    step = setup.partition_train_step(
        train_steps.make_train_step(model, partitioner, LEARNING_RATE)
    )
    layout = partitioner.data_layout(shape["batch_size"])
    iterator = pipeline.DataIterator(
        pipeline.host_input(cfg, layout, converter), partitioner, layout
    )
    state = jax_sides.state
    for _ in range(args.input_warmup):
        state, _ = step(state, next(iterator))
    jax.block_until_ready(state)
    print(f"  pipeline started, step compiled in {time.perf_counter() - start:.1f}s", flush=True)
    wait_before = iterator.wait_seconds
    input_seconds = 0.0
    start = time.perf_counter()
    for _ in range(args.input_steps):
        fetch = time.perf_counter()
        batch = next(iterator)
        input_seconds += time.perf_counter() - fetch
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    loop_seconds = time.perf_counter() - start
    jax_sides.state = state
    wait = iterator.wait_seconds - wait_before
    return {
        "loop_steps": args.input_steps,
        "loop_step_seconds": loop_seconds / args.input_steps,
        "input_wait_fraction": wait / loop_seconds,
        # wait plus the host-to-device assembly of the global batch (`to_global`)
        "input_total_fraction": input_seconds / loop_seconds,
    }


def shape_description(shape: Mapping[str, int], args: argparse.Namespace) -> str:
    knobs = [f"{args.dtype}"] + [f"remat {args.remat}"] * (args.remat != "none")
    knobs += [f"attention {args.attention}"] * (args.attention != "xla")
    knobs += [f"loss chunk {args.loss_chunk_size}"] * (args.loss_chunk_size is not None)
    return (
        f"GPT-J {shape['num_layers']}x{shape['hidden_size']} ({shape['num_heads']} heads), "
        f"B{shape['batch_size']}xL{shape['seq_len']}, N{shape['steps']}xR{args.repeats}, "
        + ", ".join(knobs)
    )


def run_shape(name: str, args: argparse.Namespace) -> dict[str, Any]:
    shape = shape_of(name, args)
    model = build_model(shape, args)
    partitioner = Partitioner(mesh_shape=(1, -1, 1), devices=jax.devices()[: args.devices])
    batch = random_batch(shape["batch_size"], shape["seq_len"])
    print(f"\n{name}: {shape_description(shape, args)}; flaxlm on {partitioner}", flush=True)
    jax_sides = JaxSides(model, partitioner, batch)
    runners = {"flaxlm": jax_sides.run_flaxlm, "plain": jax_sides.run_plain}
    torch_runner = None
    if args.torch:
        torch_runner = torch_side.TorchSide(
            torch_side.gptj(shape, VOCAB_SIZE),
            batch,
            threads=args.torch_threads,
            adamw=args.torch_adamw,
            dtype=args.dtype,
            remat=args.remat != "none",
        )
        runners["torch"] = torch_runner.run

    def losses() -> dict[str, float]:
        out = {"flaxlm": jax_sides.flaxlm_loss, "plain": jax_sides.plain_loss}
        return out if torch_runner is None else {**out, "torch": torch_runner.loss}

    result = {"shape": shape, "config": shape_description(shape, args)}
    if torch_runner is not None:
        result["torch"] = torch_runner.description
    result.update(measure_sides(runners, losses, shape, args))
    if args.input_steps > 0:
        print(f"  training loop over stdlib_py for {args.input_steps} steps:", flush=True)
        result["input"] = measure_input_wait(model, partitioner, jax_sides, shape, args)
    return result


# ---------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    apply_xla_flags(args.xla_flags)
    if args.devices > jax.device_count():
        raise SystemExit(f"--devices {args.devices}: {jax.device_count()} devices are visible.")
    # seqio warns that the stdlib task is uncached; irrelevant to a timing run.
    logging.set_verbosity(logging.ERROR)
    print("Conditions before (matmul probe) ...", flush=True)
    before = bench_common.conditions()
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/train_step.py", *(argv or sys.argv[1:])]),
        "machine": bench_common.machine_description(jax.devices()[: args.devices]),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "jax_version": jax.__version__,
        "before": before,
        "shapes": {},
    }
    for name in args.shapes:
        results["shapes"][name] = run_shape(name, args)
    results["torch_threads"] = None
    if args.torch:
        import torch

        results["torch_threads"] = torch.get_num_threads()
    results["after"] = bench_common.conditions()
    results["markdown_rows"] = report.markdown_rows(results, args.note)
    report.print_report(results)
    bench_common.write_json(results, args.json)
    return results


if __name__ == "__main__":
    main()
