"""flaxlm's train step against a hand-written `jax.jit` step, and the loop's input wait.

Both sides train the same GPT-J module with the same optax optimizer on the same batch: the
flaxlm side through `Setup` / `make_train_step` / `Partitioner.partition`, the plain side as
a `jax.jit` of `jax.value_and_grad` of a cross-entropy written here (no partitioner, no
pipeline). They run alternately in one process, R rounds of N steps each, and the report
gives each side's median time per step and ratio = plain / flaxlm (>= 1: flaxlm is as fast).

Then the real loop shape (the `stdlib_py` pipeline through `DataIterator` feeding the
partitioned step) runs K steps and the report gives the fraction of loop time spent waiting
on input (`DataIterator.wait_seconds`).

    python benchmarks/train_step.py                       # the recorded configuration
    python benchmarks/train_step.py --steps 2 --repeats 2 --input-steps 5 --json out.json

Targets: ratio >= 0.97, input wait < 2%.
"""

from __future__ import annotations

import os

# TensorFlow is only the input pipeline here; keep its C++ start-up chatter out of the output.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Mapping, Sequence  # noqa: E402
from functools import partial  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import logging  # noqa: E402
from bench_common import machine_description  # noqa: E402  (a sibling script)

import tasks  # noqa: E402, F401  (registers stdlib_py)
from flaxlm import data, optimizers, trainer  # noqa: E402
from flaxlm.models.base import DecoderOnlyModel  # noqa: E402
from flaxlm.models.features import batch_shapes_from  # noqa: E402
from flaxlm.models.gptj import GPTJConfig  # noqa: E402
from flaxlm.partitioning import Partitioner  # noqa: E402

LEARNING_RATE = 1e-3
VOCAB_SIZE = 384  # ByteVocabulary's 259 ids padded to a multiple of 128, as gptj_tiny.gin
TARGET_RATIO = 0.97
TARGET_INPUT_WAIT = 0.02
RESULTS_HEADER = (
    "| date | command | machine | config | flaxlm ms/step | plain ms/step | ratio | "
    "torch ms/step | input wait | note |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)

Batch = Mapping[str, Any]


def timing_parser(description: str, sides: str) -> argparse.ArgumentParser:
    """The model, batch and round arguments shared with vs_pytorch.py (`sides`: what
    alternates in a round)."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256, help="task feature length of targets")
    p.add_argument("--steps", type=int, default=5, help="N: steps per timed block")
    p.add_argument("--repeats", type=int, default=5, help=f"R: rounds of ({sides}) blocks")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side (compile)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = timing_parser(__doc__.split("\n\n")[0], "flaxlm, plain")
    p.add_argument(
        "--input-steps", type=int, default=20, help="K: loop steps for input wait; 0 skips"
    )
    p.add_argument("--input-warmup", type=int, default=3, help="untimed loop steps before the K")
    p.add_argument(
        "--batch-source",
        choices=("stdlib", "random"),
        default="stdlib",
        help="the fixed batch: the first stdlib_py batch, or random tokens",
    )
    p.add_argument(
        "--torch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time HF's PyTorch GPTJForCausalLM with torch.optim.AdamW in each round",
    )
    p.add_argument("--note", default="", help="free text for the RESULTS.md row")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON here")
    args = p.parse_args(argv)
    for name in ("steps", "repeats", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1.")
    if args.input_steps < 0 or args.input_warmup < 0 or args.warmup < 1:
        p.error("--input-steps and --input-warmup must be at least 0, --warmup at least 1.")
    return args


# ---------------------------------------------------------------------------- setup


def build_model(args: argparse.Namespace) -> DecoderOnlyModel:
    head_dim = args.hidden_size // args.num_heads
    return DecoderOnlyModel(
        GPTJConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            rotary_dim=min(32, head_dim - head_dim % 2),
            max_position_embeddings=max(2048, args.seq_len),
        )
    )


def dataset_config(args: argparse.Namespace) -> data.DatasetConfig:
    return data.DatasetConfig(
        mixture_or_task_name="stdlib_py",
        task_feature_lengths={"targets": args.seq_len},
        batch_size=args.batch_size,
    )


def random_batch(batch_size: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One unpacked segment per row of random byte tokens, every position weighted."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(3, 259, size=(batch_size, length), dtype=np.int32)
    inputs = np.concatenate([np.zeros((batch_size, 1), np.int32), targets[:, :-1]], axis=1)
    return {
        "decoder_input_tokens": inputs,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": np.ones_like(targets),
        "decoder_segment_ids": np.ones_like(targets),
        "decoder_positions": np.broadcast_to(
            np.arange(length, dtype=np.int32), targets.shape
        ).copy(),
    }


# ---------------------------------------------------------------------------- plain side


def plain_loss(module: Any, params: Any, batch: Batch) -> jax.Array:
    """Mean token cross-entropy over the weighted positions, straight from the module."""
    logits = module.apply(
        {"params": params},
        batch["decoder_input_tokens"],
        batch["decoder_positions"],
        batch["decoder_segment_ids"],
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


# ---------------------------------------------------------------------------- torch side


class TorchSide:
    """HF's PyTorch GPT-J of the same shape, trained with AdamW on the same tokens.

    The reference point of the ground rules (a plain JAX step on these CPUs runs about 2x
    slower than PyTorch). Its init differs from ours, so only its time is compared.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        batch: Batch,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        clip_norm: float | None = None,
    ) -> None:
        """The optimizer arguments default to `torch.optim.AdamW`'s own; `clip_norm` clips
        the global gradient norm before each update (as flaxlm's optimizer does)."""
        import torch
        import transformers

        torch.manual_seed(0)
        torch.set_num_threads(os.cpu_count() or 1)
        head_dim = args.hidden_size // args.num_heads
        config = transformers.GPTJConfig(
            vocab_size=VOCAB_SIZE,
            n_positions=max(2048, args.seq_len),
            n_embd=args.hidden_size,
            n_layer=args.num_layers,
            n_head=args.num_heads,
            rotary_dim=min(32, head_dim - head_dim % 2),
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=False,
        )
        self.torch = torch
        self.model = transformers.GPTJForCausalLM(config).train()
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=LEARNING_RATE,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
        )
        self.clip_norm = clip_norm
        self.inputs = torch.from_numpy(np.asarray(batch["decoder_input_tokens"], np.int64))
        self.labels = torch.from_numpy(np.asarray(batch["decoder_target_tokens"], np.int64))
        self.loss = float("nan")

    def step(self) -> float:
        logits = self.model(input_ids=self.inputs).logits
        loss = self.torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), self.labels.flatten()
        )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip_norm:
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        self.opt.step()
        return float(loss.detach())

    def run(self, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            self.loss = self.step()
        return time.perf_counter() - start


# ---------------------------------------------------------------------------- measurement


class Sides:
    """Both train steps with their states, each advanced `n` steps at a time."""

    def __init__(
        self, model: DecoderOnlyModel, partitioner: Partitioner, feature_lengths: dict[str, int]
    ) -> None:
        tx = optimizers.create_optimizer(learning_rate=LEARNING_RATE)
        self.setup = trainer.Setup(model, partitioner, tx, feature_lengths)
        self.flaxlm_step = self.setup.partition_train_step(
            trainer.make_train_step(model, partitioner, LEARNING_RATE)
        )
        self.state = self.setup.init_state()
        # The same init as Setup's (seed 0, batch of 1), so the first losses must agree.
        shapes = batch_shapes_from(feature_lengths, 1)
        self.params = model.init_params(jax.random.PRNGKey(0), shapes)
        self.opt_state = tx.init(self.params)
        self.plain_step = make_plain_step(model.module, tx)
        self.flaxlm_loss = self.plain_loss = float("nan")

    def run_flaxlm(self, batch: Batch, n: int) -> float:
        start = time.perf_counter()
        state = self.state
        for _ in range(n):
            state, metrics = self.flaxlm_step(state, batch)
        jax.block_until_ready(state)
        elapsed = time.perf_counter() - start
        self.state, self.flaxlm_loss = state, float(metrics["loss"])
        return elapsed

    def run_plain(self, batch: Batch, n: int) -> float:
        start = time.perf_counter()
        params, opt_state = self.params, self.opt_state
        for _ in range(n):
            params, opt_state, loss = self.plain_step(params, opt_state, batch)
        jax.block_until_ready((params, opt_state))
        elapsed = time.perf_counter() - start
        self.params, self.opt_state, self.plain_loss = params, opt_state, float(loss)
        return elapsed


def measure_ratio(
    sides: Sides,
    flaxlm_batch: Batch,
    plain_batch: Batch,
    args: argparse.Namespace,
    torch_side: TorchSide | None = None,
) -> dict:
    """Warm-up (compile), then R rounds of N flaxlm steps, N plain steps (and N torch ones)."""
    start = time.perf_counter()
    sides.run_flaxlm(flaxlm_batch, 1)
    sides.run_plain(plain_batch, 1)
    first_losses = (sides.flaxlm_loss, sides.plain_loss)
    if args.warmup > 1:
        sides.run_flaxlm(flaxlm_batch, args.warmup - 1)
        sides.run_plain(plain_batch, args.warmup - 1)
    if torch_side is not None:
        torch_side.run(args.warmup)
    print(f"  compiled and warmed up every step in {time.perf_counter() - start:.1f}s", flush=True)
    flaxlm_times, plain_times, torch_times = [], [], []
    for r in range(args.repeats):
        flaxlm_times.append(sides.run_flaxlm(flaxlm_batch, args.steps) / args.steps)
        plain_times.append(sides.run_plain(plain_batch, args.steps) / args.steps)
        line = (
            f"  round {r + 1}/{args.repeats}: flaxlm {flaxlm_times[-1] * 1e3:.1f} ms/step, "
            f"plain {plain_times[-1] * 1e3:.1f} ms/step"
        )
        if torch_side is not None:
            torch_times.append(torch_side.run(args.steps) / args.steps)
            line += f", torch {torch_times[-1] * 1e3:.1f} ms/step"
        print(line, flush=True)
    flaxlm_median = statistics.median(flaxlm_times)
    plain_median = statistics.median(plain_times)
    torch_result = {}
    if torch_times:
        torch_result = {
            "torch_step_seconds": statistics.median(torch_times),
            "torch_step_seconds_per_round": torch_times,
            "torch_last_loss": torch_side.loss,
        }
    return {
        **torch_result,
        "flaxlm_step_seconds": flaxlm_median,
        "plain_step_seconds": plain_median,
        "ratio": plain_median / flaxlm_median,
        "flaxlm_step_seconds_per_round": flaxlm_times,
        "plain_step_seconds_per_round": plain_times,
        "ratio_per_round": [p / f for p, f in zip(plain_times, flaxlm_times, strict=True)],
        # Same init, batch and optimizer: the two runs must follow the same trajectory.
        "first_loss": {"flaxlm": first_losses[0], "plain": first_losses[1]},
        "last_loss": {"flaxlm": sides.flaxlm_loss, "plain": sides.plain_loss},
    }


def measure_input_wait(sides: Sides, iterator: data.DataIterator, args: argparse.Namespace) -> dict:
    """The training loop's shape: `state = step(state, next(iterator))`, K times."""
    state = sides.state
    for _ in range(args.input_warmup):
        state, _ = sides.flaxlm_step(state, next(iterator))
    jax.block_until_ready(state)
    wait_before = iterator.wait_seconds
    input_seconds = 0.0
    start = time.perf_counter()
    for _ in range(args.input_steps):
        fetch = time.perf_counter()
        batch = next(iterator)
        input_seconds += time.perf_counter() - fetch
        state, _ = sides.flaxlm_step(state, batch)
    jax.block_until_ready(state)
    loop_seconds = time.perf_counter() - start
    sides.state = state
    wait = iterator.wait_seconds - wait_before
    return {
        "loop_steps": args.input_steps,
        "loop_seconds": loop_seconds,
        "loop_step_seconds": loop_seconds / args.input_steps,
        "input_wait_seconds": wait,
        "input_wait_fraction": wait / loop_seconds,
        # wait plus the host-to-device assembly of the global batch (`to_global`)
        "input_total_fraction": input_seconds / loop_seconds,
    }


# ---------------------------------------------------------------------------- report


def config_description(args: argparse.Namespace) -> str:
    return (
        f"GPT-J {args.num_layers}x{args.hidden_size}, B{args.batch_size}xL{args.seq_len}, "
        f"N{args.steps}xR{args.repeats}, K{args.input_steps}"
    )


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def print_report(results: dict) -> None:
    ratio, loop = results["ratio"], results.get("input")
    ok = lambda good: "ok" if good else "MISSED"
    rows = [
        ("flaxlm train step", f"{ms(results['ratio']['flaxlm_step_seconds'])} ms/step", ""),
        ("plain jax.jit step", f"{ms(results['ratio']['plain_step_seconds'])} ms/step", ""),
        (
            "ratio plain / flaxlm",
            f"{ratio['ratio']:.3f}",
            f"target >= {TARGET_RATIO}: {ok(ratio['ratio'] >= TARGET_RATIO)}",
        ),
    ]
    if "torch_step_seconds" in ratio:
        torch_s = ratio["torch_step_seconds"]
        rows.append(
            (
                "PyTorch (HF GPTJ) step",
                f"{ms(torch_s)} ms/step",
                f"torch / flaxlm = {torch_s / ratio['flaxlm_step_seconds']:.3f}",
            )
        )
    if loop:
        rows += [
            ("loop with input", f"{ms(loop['loop_step_seconds'])} ms/step", ""),
            (
                "input wait",
                f"{loop['input_wait_fraction']:.2%}",
                f"target < {TARGET_INPUT_WAIT:.0%}: "
                f"{ok(loop['input_wait_fraction'] < TARGET_INPUT_WAIT)}",
            ),
            ("input wait + to_global", f"{loop['input_total_fraction']:.2%}", ""),
        ]
    first, last = ratio["first_loss"], ratio["last_loss"]
    rows.append(
        (
            "loss flaxlm / plain",
            f"{first['flaxlm']:.5f} / {first['plain']:.5f} first, "
            f"{last['flaxlm']:.5f} / {last['plain']:.5f} last",
            "",
        )
    )
    width = max(len(r[0]) for r in rows)
    print()
    for name, value, target in rows:
        print(f"  {name:<{width}}  {value:<16} {target}".rstrip())
    print(f"\n  per-round ratios: {', '.join(f'{r:.3f}' for r in ratio['ratio_per_round'])}")
    print("\nRow for benchmarks/RESULTS.md:\n")
    print(RESULTS_HEADER)
    print(results["markdown_row"])


def markdown_row(results: dict, args: argparse.Namespace) -> str:
    loop = results.get("input")
    wait = f"{loop['input_wait_fraction']:.2%}" if loop else "-"
    cells = [
        results["date"],
        f"`{results['command']}`",
        results["machine"],
        results["config"],
        ms(results["ratio"]["flaxlm_step_seconds"]),
        ms(results["ratio"]["plain_step_seconds"]),
        f"{results['ratio']['ratio']:.3f}",
        ms(results["ratio"]["torch_step_seconds"])
        if "torch_step_seconds" in results["ratio"]
        else "-",
        wait,
        args.note,
    ]
    return "| " + " | ".join(cells) + " |"


# ---------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    # seqio warns that the stdlib task is uncached; irrelevant to a timing run.
    logging.set_verbosity(logging.ERROR)
    model = build_model(args)
    partitioner = Partitioner(mesh_shape=(1, -1, 1))
    cfg = dataset_config(args)
    model.check_lengths(cfg.task_feature_lengths)
    feature_lengths = data.model_feature_lengths(cfg, data.converter_for(cfg, model))
    print(f"{config_description(args)} on {partitioner}", flush=True)
    if jax.device_count() > 1:
        print(
            f"  note: flaxlm runs on all {jax.device_count()} devices, the plain step on one.",
            flush=True,
        )

    iterator, batch = None, random_batch(args.batch_size, args.seq_len)
    if args.batch_source == "stdlib" or args.input_steps > 0:
        start = time.perf_counter()
        layout = partitioner.data_layout(args.batch_size)
        ds = data.host_input(cfg, layout, data.converter_for(cfg, model))
        iterator = data.DataIterator(ds, partitioner, layout)
        first = iterator.next_numpy()
        print(f"  first stdlib_py batch in {time.perf_counter() - start:.1f}s", flush=True)
        if args.batch_source == "stdlib":
            batch = first

    sides = Sides(model, partitioner, feature_lengths)
    # Each side gets its own device copy, placed as its loop would place it.
    flaxlm_batch = {
        k: jax.device_put(v, partitioner.batch_sharding(v.ndim)) for k, v in batch.items()
    }
    plain_batch = jax.device_put(batch, jax.devices()[0])

    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/train_step.py", *(argv or sys.argv[1:])]),
        "machine": machine_description(),
        "config": config_description(args),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "jax_version": jax.__version__,
        "devices": jax.device_count(),
    }
    torch_side = TorchSide(args, batch) if args.torch else None
    print(
        "Alternating flaxlm, plain" + (" and torch" if args.torch else "") + " steps:", flush=True
    )
    results["ratio"] = measure_ratio(sides, flaxlm_batch, plain_batch, args, torch_side)
    if args.input_steps > 0:
        print(f"Training loop over stdlib_py for {args.input_steps} steps:", flush=True)
        results["input"] = measure_input_wait(sides, iterator, args)
    results["markdown_row"] = markdown_row(results, args)
    print_report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nWrote {args.json}")
    return results


if __name__ == "__main__":
    main()
