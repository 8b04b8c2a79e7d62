"""Bytes moved by collectives in flaxlm's train step, read from the compiled HLO, vs theory.

flaxlm's own train step (`make_train_step` partitioned by `Setup.partition_train_step`) for a
small GPT-J is lowered and compiled on abstract inputs on 8 devices under dp, fsdp and tp
(gin/partitioning/*.gin); `compiled.as_text()` is parsed for all-gather, reduce-scatter,
all-reduce (and all-to-all, collective-permute), each op counted as many times as the
while loops around it run (`known_trip_count`, e.g. the scanned layers).

Two units per op, n = devices in its group, R = bytes of its result on one device:
- array bytes: the size of the whole array the collective is about (all-gather: R;
  reduce-scatter: its input, n x R; all-reduce: R);
- ring bytes: what one device sends in a ring implementation (all-gather (n-1)/n x R,
  reduce-scatter (n-1) x R, all-reduce 2 (n-1)/n x R); the ratio to theory uses these.

Theory (P = bytes of a param, A = bytes of a [batch, length, embed] activation):
- DP: one all-reduce of every gradient.
- FSDP: each sharded param all-gathered in forward and again in backward, its gradient
  reduce-scattered; params left whole (axes not mapped to fsdp) have their gradient
  all-reduced.
- TP (Megatron): per layer two all-reduces of A in forward and two in backward, plus the
  vocab-split embedding (forward) and head (backward) one each.
- Ring attention (`--sequence S`, fsdp only: mesh (1, n/S, S, 1)): FSDP's, plus per layer
  and device S - 1 sends of its K and V shards in forward, in backward S - 1 of K and V and
  S of their float32 gradients (which come home at the end).

Target: measured <= 1.1 x theory (and, under `--sequence`, the collective-permutes alone).

    python benchmarks/collectives.py --json /tmp/collectives.json
    python benchmarks/collectives.py --partitionings fsdp --sequence 8
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402

bench_common.force_host_devices(8)

import argparse  # noqa: E402
import math  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from flaxlm.models.base import DecoderOnlyModel  # noqa: E402
from flaxlm.models.gptj import GPTJConfig  # noqa: E402
from flaxlm.plan.hlo import parse_hlo  # noqa: E402

TARGET = 1.1

# ---------------------------------------------------------------------------- theory


def theory(
    name: str, setup: Any, config: GPTJConfig, batch_size: int, seq_len: int, n: int
) -> dict[str, Any]:
    """Theoretical array and ring bytes per device per step (see the module docstring)."""
    mesh = dict(zip(setup.partitioner.mesh_axis_names, setup.partitioner.mesh_shape))
    params = setup.abstract_state.params
    leaves = jax.tree.leaves(params)
    whole = sum(
        math.prod(x.shape) * np.dtype(x.dtype).itemsize
        for x in leaves
        if tuple(x.sharding.shard_shape(x.shape)) == tuple(x.shape)
    )
    split = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves) - whole
    ring = (n - 1) / n
    if name == "dp":
        parts = {"all-reduce gradients": (whole + split, 2 * ring * (whole + split))}
    elif name == "fsdp":
        parts = {
            "all-gather params forward": (split, ring * split),
            "all-gather params backward": (split, ring * split),
            "reduce-scatter gradients": (split, ring * split),
            "all-reduce gradients of whole params": (whole, 2 * ring * whole),
        }
    elif name == "tp":
        act = batch_size * seq_len * config.hidden_size * np.dtype(config.dtype).itemsize
        count = 4 * config.num_layers + 2
        parts = {
            f"all-reduce activations ({count} = 4 x {config.num_layers} layers + 2)": (
                count * act,
                2 * ring * count * act,
            )
        }
    else:
        raise ValueError(f"No theory for partitioning {name!r}; expected dp, fsdp or tp.")
    s = mesh.get("sequence", 1)
    if s > 1:  # K and V (GPT-J: as many k/v heads as q) of one device's rows and positions
        kv = 2 * batch_size // (n // s) * seq_len // s * config.hidden_size
        kv *= np.dtype(config.dtype).itemsize
        fwd, bwd = (s - 1) * kv, (s - 1) * kv + s * kv * 4 // np.dtype(config.dtype).itemsize
        layers = config.num_layers
        parts[f"ring K, V forward ({s - 1} x {layers} layers)"] = (layers * fwd,) * 2
        parts[f"ring K, V ({s - 1} x), f32 dK, dV ({s} x) backward"] = (layers * bwd,) * 2
    return {
        "parts": {k: {"array_bytes": a, "ring_bytes": r} for k, (a, r) in parts.items()},
        "array_bytes": sum(a for a, _ in parts.values()),
        "ring_bytes": sum(r for _, r in parts.values()),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--partitionings", nargs="+", choices=("dp", "fsdp", "tp"), default=["dp", "fsdp", "tp"]
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    bench_common.add_sequence_arg(p)
    bench_common.add_target_args(p)
    p.add_argument("--dump-hlo", metavar="DIR", help="also write each compiled HLO text here")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON here")
    args = p.parse_args(argv)
    for k in ("layers", "hidden", "heads", "vocab", "batch_size", "seq_len"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be at least 1.")
    if args.sequence > 1 and (args.partitionings != ["fsdp"] or args.seq_len % (2 * args.sequence)):
        p.error("--sequence: only with --partitionings fsdp, and a multiple of 2 x it as length.")
    return args


def check_divisible(args: argparse.Namespace, n: int) -> None:
    rows = n // args.sequence  # the data-parallel degree
    if args.heads % n or args.vocab % n or args.hidden % n or args.batch_size % rows:
        raise SystemExit(
            f"--heads, --vocab, --hidden and --batch-size must be multiples of {n} (devices)."
        )


def mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    head_dim = args.hidden // args.heads
    config = GPTJConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        rotary_dim=min(32, head_dim - head_dim % 2),
        dtype="float32",
        param_dtype="float32",
        remat_policy="none",
        scan_layers=args.scan_layers,
    )
    model = DecoderOnlyModel(config)
    devices = bench_common.target_devices(args)
    n = len(devices)
    check_divisible(args, n)
    rows = []
    for name in args.partitionings:
        print(f"compiling {name} ...", flush=True)
        partitioner = bench_common.make_partitioner(name, devices, args.sequence)
        step = bench_common.CompiledStep(
            model,
            partitioner,
            args.batch_size,
            args.seq_len,
            matmul_precision=args.matmul_precision,
        )
        text = step.compiled.as_text()
        if args.dump_hlo:
            os.makedirs(args.dump_hlo, exist_ok=True)
            with open(os.path.join(args.dump_hlo, f"{name}.hlo.txt"), "w") as f:
                f.write(text)
        measured = parse_hlo(text, n)
        expected = theory(name, step.setup, config, args.batch_size, args.seq_len, n)
        ratio = measured["ring_bytes"] / expected["ring_bytes"]
        ring = {k: v for k, v in expected["parts"].items() if k.startswith("ring")}
        rows.append(
            {
                "partitioning": name,
                "mesh": dict(zip(partitioner.mesh_axis_names, partitioner.mesh_shape)),
                "measured": measured,
                "theory": expected,
                "ratio": ratio,
                "array_ratio": measured["array_bytes"] / expected["array_bytes"],
                "pass": ratio <= TARGET,
            }
        )
        if ring:  # the ring's collective-permutes alone, against their theory
            permutes = measured["by_kind"].get("collective-permute", {"ring_bytes": 0.0})
            ring_ratio = permutes["ring_bytes"] / sum(t["ring_bytes"] for t in ring.values())
            rows[-1].update(ring_ratio=ring_ratio, ring_pass=1 / TARGET <= ring_ratio <= TARGET)

    print(
        f"\nGPT-J {args.layers}x{args.hidden} ({args.heads} heads, vocab {args.vocab}), "
        f"B{args.batch_size}xL{args.seq_len}, float32, scan_layers={args.scan_layers}, "
        f"sequence={args.sequence}, "
        f"{bench_common.machine_description(devices, args.tpu_topology)}, matmul precision "
        f"{args.matmul_precision or 'default'}; MiB per device per step\n"
    )
    header = ["partitioning", "collective", "count", "array MiB", "ring MiB"]
    table = []
    for r in rows:
        for kind, t in sorted(r["measured"]["by_kind"].items()):
            table.append(
                [r["partitioning"], kind, t["count"], mib(t["array_bytes"]), mib(t["ring_bytes"])]
            )
        for part, t in r["theory"]["parts"].items():
            row = [r["partitioning"], f"theory: {part}", "", mib(t["array_bytes"])]
            table.append([*row, mib(t["ring_bytes"])])
    bench_common.print_table(header, table)
    print()
    summary = []
    for r in rows:
        summary.append(
            [
                r["partitioning"],
                mib(r["measured"]["ring_bytes"]),
                mib(r["theory"]["ring_bytes"]),
                f"{r['ratio']:.3f}",
                f"{r['array_ratio']:.3f}",
                f"{'PASS' if r['pass'] else 'FAIL'} (<= {TARGET})",
            ]
        )
        for u in r["measured"]["unparsed"]:
            print(f"  note {r['partitioning']}: {u}")
    bench_common.print_table(
        [
            "partitioning",
            "measured ring MiB",
            "theory ring MiB",
            "ratio",
            "array-bytes ratio",
            "target",
        ],
        summary,
    )
    for r in (r for r in rows if "ring_ratio" in r):
        verdict = f"{'PASS' if r['ring_pass'] else 'FAIL'} (within {TARGET}x)"
        print(f"\nring (collective-permutes) / theory: {r['ring_ratio']:.3f} {verdict}")
    results = bench_common.run_record("collectives.py", args, argv, devices, rows=rows)
    bench_common.write_json(results, args.json)
    return results


if __name__ == "__main__":
    main()
