"""Training tokens/s: flaxlm against HF transformers' GPTJForCausalLM on CPU PyTorch.

The same small GPT-J shape (the model of benchmarks/train_step.py, `build_model`) on the
same random batch, with the same optimizer hyper-parameters on both sides: AdamW
(b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1, learning rate 1e-3) after global-norm
clipping at 1.0, i.e. flaxlm's `optimizers.create_optimizer` defaults, mirrored with
`torch.optim.AdamW` + `clip_grad_norm_` (train_step.py's `TorchSide`; torch decays every
param while flaxlm skips biases and norm scales, which costs the same). flaxlm's side is
its own train step (`trainer.Setup`, `make_train_step`, `Partitioner.partition`) on
`--devices` devices (default 1: XLA:CPU, like torch, uses every core from one device).

After a compiling warm-up the two alternate: R rounds (`--repeats`) of N steps (`--steps`)
each, every flaxlm block ending in `block_until_ready`. Reported: median tokens/s of each
side (batch x length / step time) and the ratio flaxlm / torch.

    python benchmarks/vs_pytorch.py --json /tmp/vs_pytorch.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402  (puts the repository on sys.path)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import datetime  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
from train_step import (  # noqa: E402
    LEARNING_RATE,
    TorchSide,
    build_model,
    random_batch,
    timing_parser,
)

from flaxlm import optimizers, trainer  # noqa: E402
from flaxlm.partitioning import Partitioner  # noqa: E402

# flaxlm's optimizer defaults (optimizers.create_optimizer), given to torch too.
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = timing_parser(__doc__.split("\n\n")[0], "flaxlm, torch")
    p.add_argument("--devices", type=int, default=1, help="devices flaxlm's mesh uses")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON here")
    args = p.parse_args(argv)
    for name in ("steps", "repeats", "warmup", "batch_size", "seq_len", "devices"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1.")
    if args.devices > jax.device_count():
        p.error(f"--devices {args.devices}: only {jax.device_count()} devices are visible.")
    if args.batch_size % args.devices:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --devices.")
    return args


class FlaxlmSide:
    """flaxlm's partitioned train step and its state, advanced `n` steps at a time."""

    def __init__(self, args: argparse.Namespace, batch: dict[str, Any]) -> None:
        model = build_model(args)
        self.partitioner = Partitioner(mesh_shape=(1, -1, 1), devices=jax.devices()[: args.devices])
        tx = optimizers.create_optimizer(
            learning_rate=LEARNING_RATE,
            b1=BETAS[0],
            b2=BETAS[1],
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            clip_norm=CLIP_NORM,
        )
        lengths = bench_common.feature_lengths(model, args.seq_len)
        setup = trainer.Setup(model, self.partitioner, tx, lengths)
        self.step = setup.partition_train_step(
            trainer.make_train_step(model, self.partitioner, LEARNING_RATE)
        )
        self.state = setup.init_state()
        # Unpacked rows: the model takes no positions / segment ids (the same as all-ones
        # segments and 0..L-1 positions, which is what the torch side sees).
        self.batch = {
            k: jax.device_put(batch[k], self.partitioner.batch_sharding(batch[k].ndim))
            for k in lengths
        }
        self.loss = float("nan")

    def run(self, n: int) -> float:
        start = time.perf_counter()
        state = self.state
        for _ in range(n):
            state, metrics = self.step(state, self.batch)
        jax.block_until_ready(state)
        elapsed = time.perf_counter() - start
        self.state, self.loss = state, float(metrics["loss"])
        return elapsed


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    batch = random_batch(args.batch_size, args.seq_len)
    tokens = args.batch_size * args.seq_len
    flaxlm_side = FlaxlmSide(args, batch)
    torch_side = TorchSide(
        args, batch, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, clip_norm=CLIP_NORM
    )
    config = (
        f"GPT-J {args.num_layers}x{args.hidden_size}, B{args.batch_size}xL{args.seq_len}, "
        f"N{args.steps}xR{args.repeats}"
    )
    print(f"{config}; flaxlm on {flaxlm_side.partitioner}", flush=True)
    start = time.perf_counter()
    flaxlm_side.run(args.warmup)
    first_losses = {"flaxlm": flaxlm_side.loss}
    torch_side.run(args.warmup)
    first_losses["torch"] = torch_side.loss
    print(f"  warmed up (flaxlm compiled) in {time.perf_counter() - start:.1f}s", flush=True)
    flaxlm_tps, torch_tps = [], []
    for r in range(args.repeats):
        flaxlm_tps.append(tokens * args.steps / flaxlm_side.run(args.steps))
        torch_tps.append(tokens * args.steps / torch_side.run(args.steps))
        print(
            f"  round {r + 1}/{args.repeats}: flaxlm {flaxlm_tps[-1]:.0f} tok/s, "
            f"torch {torch_tps[-1]:.0f} tok/s",
            flush=True,
        )
    flaxlm_median, torch_median = statistics.median(flaxlm_tps), statistics.median(torch_tps)
    results = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/vs_pytorch.py", *(argv or sys.argv[1:])]),
        "machine": bench_common.machine_description(),
        "config": config,
        "jax_version": jax.__version__,
        "torch_version": torch_side.torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "flaxlm_tokens_per_second": flaxlm_median,
        "torch_tokens_per_second": torch_median,
        "ratio": flaxlm_median / torch_median,
        "flaxlm_tokens_per_second_per_round": flaxlm_tps,
        "torch_tokens_per_second_per_round": torch_tps,
        "ratio_per_round": [f / t for f, t in zip(flaxlm_tps, torch_tps, strict=True)],
        "warmup_losses": first_losses,
        "last_losses": {"flaxlm": flaxlm_side.loss, "torch": torch_side.loss},
    }
    print()
    bench_common.print_table(
        ["side", "tokens/s (median)", "ms/step", "last loss"],
        [
            [
                "flaxlm",
                f"{flaxlm_median:.0f}",
                f"{tokens / flaxlm_median * 1e3:.1f}",
                f"{flaxlm_side.loss:.4f}",
            ],
            [
                "torch (HF GPTJForCausalLM)",
                f"{torch_median:.0f}",
                f"{tokens / torch_median * 1e3:.1f}",
                f"{torch_side.loss:.4f}",
            ],
        ],
    )
    print(
        f"\nflaxlm / torch = {results['ratio']:.3f} (per round: "
        + ", ".join(f"{x:.3f}" for x in results["ratio_per_round"])
        + ")"
    )
    bench_common.write_json(results, args.json)
    return results


if __name__ == "__main__":
    main()
