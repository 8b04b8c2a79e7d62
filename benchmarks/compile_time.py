"""Train-step compile time against depth, with and without `scan_layers`.

flaxlm's own train step (`make_train_step` partitioned by `Setup.partition_train_step`) for a
tiny GPT-J is lowered and compiled (`.lower(abstract state, abstract batch).compile()`,
wall clock, nothing executed) for each layer count, with the blocks unrolled and with
`nn.scan` over them, on 8 devices under fsdp. Each configuration is timed `--repeats` times
(a fresh model and jit each time, so nothing is cached) and the median is reported.

Target: with scan_layers, 24 layers compile in <= 1.5 x the time of 2 layers. Given several
`--seq-len`s (e.g. with `--sequence 8`, context parallelism), also the longest length against
the shortest at the most layers: <= 1.5 x too.

    python benchmarks/compile_time.py --json /tmp/compile_time.json
    python benchmarks/compile_time.py --layers 4 --modes scan --sequence 8 --batch-size 1 \
      --seq-len 4096 131072
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402

bench_common.force_host_devices(8)

import argparse  # noqa: E402
import statistics  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import jax  # noqa: E402

from flaxlm.models.base import DecoderOnlyModel  # noqa: E402
from flaxlm.models.gptj import GPTJConfig  # noqa: E402

TARGET = 1.5


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 24])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, nargs="+", default=[64])
    p.add_argument("--partitioning", default="fsdp", choices=tuple(bench_common.PARTITIONINGS))
    bench_common.add_sequence_arg(p)
    p.add_argument("--repeats", type=int, default=1, help="compiles per configuration (median)")
    p.add_argument(
        "--modes",
        nargs="+",
        choices=("scan", "unrolled"),
        default=["scan", "unrolled"],
    )
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON here")
    args = p.parse_args(argv)
    if min(args.layers) < 1 or args.repeats < 1 or args.hidden % args.heads:
        p.error("--layers and --repeats must be at least 1; --hidden a multiple of --heads.")
    if min(args.seq_len) < 1 or any(n % (2 * args.sequence) for n in args.seq_len):
        p.error("--seq-len: positive, and multiples of 2 x --sequence.")
    return args


def compile_seconds(
    layers: int, scan: bool, seq_len: int, args: argparse.Namespace
) -> dict[str, float]:
    head_dim = args.hidden // args.heads
    model = DecoderOnlyModel(
        GPTJConfig(
            vocab_size=384,
            hidden_size=args.hidden,
            num_layers=layers,
            num_heads=args.heads,
            rotary_dim=min(32, head_dim - head_dim % 2),
            dtype="float32",
            param_dtype="float32",
            remat_policy="none",
            scan_layers=scan,
        )
    )
    partitioner = bench_common.make_partitioner(args.partitioning, sequence=args.sequence)
    step = bench_common.CompiledStep(model, partitioner, args.batch_size, seq_len)
    return {
        "lower_seconds": step.lower_seconds,
        "compile_seconds": step.compile_seconds,
        "total_seconds": step.lower_seconds + step.compile_seconds,
    }


def uncached_compile_seconds(
    layers: int, scan: bool, seq_len: int, args: argparse.Namespace
) -> dict[str, float]:
    """`compile_seconds` with JAX's persistent compilation cache off (one set by
    JAX_COMPILATION_CACHE_DIR, as the tests set, would time reading an entry back)."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        return compile_seconds(layers, scan, seq_len, args)
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    rows = []
    # Alternate the modes, layer counts and lengths inside each repeat, so that a burst of
    # load on the machine does not fall on one configuration only.
    runs: dict[tuple[str, int, int], list[dict[str, float]]] = {}
    for r in range(args.repeats):
        for layers in args.layers:
            for seq_len in args.seq_len:
                for mode in args.modes:
                    t = uncached_compile_seconds(layers, mode == "scan", seq_len, args)
                    runs.setdefault((mode, layers, seq_len), []).append(t)
                    print(
                        f"  repeat {r + 1}: {mode:8s} {layers:3d} layers, length {seq_len}: "
                        f"lower {t['lower_seconds']:.2f}s + compile {t['compile_seconds']:.2f}s",
                        flush=True,
                    )
    for (mode, layers, seq_len), ts in runs.items():
        rows.append(
            {
                "mode": mode,
                "layers": layers,
                "seq_len": seq_len,
                **{k: statistics.median(t[k] for t in ts) for k in ts[0]},
                "total_seconds_all": [t["total_seconds"] for t in ts],
            }
        )
    rows.sort(key=lambda r: (r["mode"], r["seq_len"], r["layers"]))
    fewest, most = min(args.layers), max(args.layers)
    shortest, longest = min(args.seq_len), max(args.seq_len)
    base = {(r["mode"], r["seq_len"]): r["total_seconds"] for r in rows if r["layers"] == fewest}
    for r in rows:
        r["vs_fewest_layers"] = r["total_seconds"] / base[r["mode"], r["seq_len"]]
    table = [
        [
            r["mode"],
            r["layers"],
            r["seq_len"],
            f"{r['lower_seconds']:.2f}",
            f"{r['compile_seconds']:.2f}",
            f"{r['total_seconds']:.2f}",
            f"{r['vs_fewest_layers']:.2f}",
        ]
        for r in rows
    ]
    print(
        f"\nGPT-J width {args.hidden}, batch {args.batch_size}, {args.partitioning} "
        f"(sequence={args.sequence}) on {jax.device_count()} devices, median of {args.repeats}\n"
    )
    header = ["mode", "layers", "length", "lower s", "compile s", "total s"]
    bench_common.print_table([*header, f"x of {fewest} layers"], table)
    results = bench_common.run_record("compile_time.py", args, argv, rows=rows)
    scan = {(r["layers"], r["seq_len"]): r["total_seconds"] for r in rows if r["mode"] == "scan"}
    verdicts = []
    for key, more, less, what in (
        ("scan_ratio", (most, shortest), (fewest, shortest), "layers"),
        ("length_ratio", (most, longest), (most, shortest), "length"),
    ):
        if more in scan and more != less:
            ratio = scan[more] / scan[less]
            results[key] = ratio
            verdicts.append(ratio <= TARGET)
            print(
                f"\nscan, {what}: {more[0]} layers x length {more[1]} / {less[0]} layers x "
                f"length {less[1]} = {ratio:.2f} (target <= {TARGET}: "
                f"{'PASS' if ratio <= TARGET else 'FAIL'})"
            )
    if verdicts:
        results["pass"] = all(verdicts)
    bench_common.write_json(results, args.json)
    return results


if __name__ == "__main__":
    main()
