"""The expert-parallel dispatches of a mixture-of-experts layer against each other
(`moe_dispatch`, flaxlm/models/expert_parallel.py): `all_gather` (each device's tokens
all-gathered over `expert`, every device runs its experts over the whole group's
assignments, outputs reduce-scattered; never drops) and `all_to_all` (each assignment sent
to its expert's device in a buffer of `capacity_factor` x the fair share per destination,
run there and sent back; drops past the capacity); `cost` also compiles `ragged`
(`jax.lax.ragged_all_to_all` into a receive buffer of `ragged_buffer_factor` x the fair
share; XLA:CPU, which `time` runs on, has not the op).

Two parts, each a subcommand:

- `time`: flaxlm's train step on this host's 8 CPU devices for the tiny Qwen3-MoE of
  `moe.py time` (qwen3_moe_tiny.gin cut to `--layers`, dropless) at E=8/k=2 and E=64/k=8,
  on meshes `(1, 8 / e, e, 1)` over ('data', 'fsdp', 'expert', 'tensor') for each `--expert`
  e, the two dispatches in alternating rounds (each round in the reverse order of the one
  before: ABBA; a fast shape's calls take more steps, `--call-seconds`, both dispatches
  alike), the medians and their ratio. The all-to-all's capacity is by default the
  least at which no routing can drop an assignment (`no_drop_capacity_factor`: a
  random-init router is far from balanced, and 3x the fair share still drops at E=8/k=2),
  checked on every step (the run stops if one drops), so both compute the same step: their
  first step's losses agree to float rounding (later ones drift apart as rounding
  differences grow over steps on the one repeated batch).
- `cost`: ahead of time (`--tpu-topology`, libtpu, no TPU attached) a gin/models/ MoE
  (Qwen3-30B-A3B) cut to `--layers`, unscanned (a scan's body is counted once by
  `cost_analysis`), on fsdp + expert, both dispatches through the planner (`flaxlm.plan`'s
  `Planner.evaluate`: one compile each): `cost_analysis()` FLOPs and bytes accessed per
  device, the collectives' ring bytes (the whole step's and the MoE `shard_map`'s, as
  `moe.py memory` parses them), temporaries, and the planner's roofline step time.

    python benchmarks/moe_dispatch.py time --json /tmp/dispatch_time.json
    python benchmarks/moe_dispatch.py cost --tpu-topology v5p:2x2x2 --json /tmp/dispatch.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402

bench_common.force_host_devices(8)

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import moe  # noqa: E402

from flaxlm.models import experts  # noqa: E402
from flaxlm.models.expert_parallel import DISPATCHES  # noqa: E402
from flaxlm.parallel.partitioning import Partitioner  # noqa: E402
from flaxlm.plan import aot, chips, hlo  # noqa: E402
from flaxlm.plan.planner import Planner  # noqa: E402
from flaxlm.plan.run import Knobs, plain_run, with_config  # noqa: E402

GIB = 2**30
AXES = ("data", "fsdp", "expert", "tensor")
# What `time` runs against each other (`cost` compiles any of DISPATCHES, `ragged` too).
TIMED = ("all_gather", "all_to_all")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="part", required=True)
    timing = sub.add_parser("time", help="CPU step time, all_gather vs all_to_all, ABBA")
    cost = sub.add_parser("cost", help="compiled cost and the planner's step time, ahead of time")
    timing.add_argument("--shapes", nargs="+", choices=list(moe.SHAPES), default=list(moe.SHAPES))
    timing.add_argument("--layers", type=int, default=2)
    timing.add_argument("--batch-size", type=int, default=8)
    timing.add_argument("--seq-len", type=int, default=128)
    timing.add_argument("--rounds", type=int, default=6)
    timing.add_argument("--steps", type=int, default=2, help="least steps per timed call")
    timing.add_argument(
        "--call-seconds",
        type=float,
        default=2.0,
        help="more steps per call for a fast shape, to about this long (both dispatches alike)",
    )
    timing.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="the all_to_all dispatch's capacity_factor (default: the least at which no "
        "assignment can drop, min(expert, E / k)); the run stops if one drops",
    )
    cost.add_argument(
        "--model",
        default="qwen3_moe_30b_a3b",
        choices=bench_common.gin_model_names(),
        metavar="MODEL",
        help="a gin/models/ file with experts",
    )
    cost.add_argument("--layers", type=int, default=2, help="layers kept of the model")
    cost.add_argument("--batch-size", type=int, default=8)
    cost.add_argument("--seq-len", type=int, default=2048)
    cost.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="the all_to_all dispatch's capacity_factor; default: the model's",
    )
    cost.add_argument(
        "--dispatches",
        nargs="+",
        choices=DISPATCHES,
        default=list(DISPATCHES),
        help="which to compile (e.g. all_to_all alone at another --capacity-factor)",
    )
    bench_common.add_target_args(cost)
    for q, default in ((timing, [8, 4]), (cost, [8])):
        q.add_argument(
            "--expert",
            type=int,
            nargs="+",
            default=default,
            metavar="E",
            help="expert axis sizes: mesh (1, devices / E, E, 1), fsdp taking the rest",
        )
        q.add_argument("--json", metavar="PATH", help="also write the numbers as JSON here")
    return p.parse_args(argv)


def mesh_shape(devices: int, expert: int) -> tuple[int, int, int, int]:
    """(data, fsdp, expert, tensor): `expert` devices on the expert axis, fsdp the rest."""
    if expert < 2 or devices % expert:
        raise ValueError(f"--expert {expert}: expected a divisor of {devices} devices above 1.")
    return (1, devices // expert, expert, 1)


def dropped_fraction(side: moe.Side) -> float:
    """The largest `moe_dropped_fraction` of the steps of `side`'s last `run`."""
    return max(float(m["moe_dropped_fraction"]) for m in side.metrics)


def no_drop_capacity_factor(expert: int, num_experts: int, k: int) -> float:
    """The all_to_all capacity factor at which no assignment can drop on an expert axis of
    `expert` devices: a destination holds E / n experts and a token is routed to each expert
    at most once, so a device sends it at most min(k, E / n) x tokens assignments, which is
    min(n, E / k) times the fair share k x tokens / n."""
    return min(expert, num_experts / k)


def run_time(args: argparse.Namespace) -> dict[str, Any]:
    devices = jax.devices()
    before = bench_common.conditions()
    sides: dict[tuple[int, str, str], moe.Side] = {}
    dropped: dict[tuple[int, str, str], float] = {}
    factors: dict[tuple[int, str], float] = {}
    first_loss: dict[tuple[int, str, str], float] = {}

    def check(key: tuple[int, str, str]) -> None:
        dropped[key] = max(dropped.get(key, 0.0), dropped_fraction(sides[key]))
        if dropped[key] > 0:
            raise SystemExit(
                f"error: {key}: the all_to_all dispatch dropped {dropped[key]:.4f} of its "
                f"assignments at capacity factor {factors[key[:2]]:g}; raise "
                "--capacity-factor (or leave it out) so both dispatches compute the same step."
            )

    for expert in args.expert:
        shape = mesh_shape(len(devices), expert)
        partitioner = Partitioner(mesh_shape=shape, mesh_axis_names=AXES, devices=devices)
        for name in args.shapes:
            factor = args.capacity_factor or no_drop_capacity_factor(expert, *moe.SHAPES[name])
            factors[expert, name] = factor
            for dispatch in TIMED:
                print(f"compiling {shape} {name} {dispatch} ...", flush=True)
                model = moe.tiny_model(
                    name, "dropless", args.layers, moe_dispatch=dispatch, capacity_factor=factor
                )
                key = (expert, name, dispatch)
                sides[key] = moe.Side(model, args, partitioner)
                sides[key].run(1)  # compile and warm up
                check(key)
                first_loss[key] = float(sides[key].metrics[0]["loss"])
    keys = list(sides)
    steps = {}  # per (expert, shape): the same for both dispatches
    for expert, name, _ in keys[::2]:
        once = min(sides[expert, name, d].run(1) for d in TIMED)
        steps[expert, name] = max(args.steps, math.ceil(args.call_seconds / once))
    times: dict[tuple[int, str, str], list[float]] = {key: [] for key in keys}
    for r in range(args.rounds):
        for key in keys if r % 2 == 0 else keys[::-1]:
            times[key].append(sides[key].run(steps[key[:2]]))
            check(key)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()))
    tokens = args.batch_size * args.seq_len // len(devices)
    rows = []
    for expert in args.expert:
        for name in args.shapes:
            ag, a2a = (times[expert, name, d] for d in TIMED)
            num_experts, k = moe.SHAPES[name]
            capacity = experts.expert_capacity(tokens, k, expert, factors[expert, name])
            last = sides[expert, name, "all_gather"].metrics[-1]
            rows.append(
                {
                    "mesh": mesh_shape(len(devices), expert),
                    "shape": name,
                    "capacity_factor": factors[expert, name],
                    "steps_per_call": steps[expert, name],
                    "all_gather_s": statistics.median(ag),
                    "all_to_all_s": statistics.median(a2a),
                    "all_to_all_over_all_gather": statistics.median(a2a) / statistics.median(ag),
                    "round_ratios": [b / a for a, b in zip(ag, a2a)],
                    # the rows each device sorts and runs through its experts
                    "expert_rows": {
                        "all_gather": expert * tokens * k,
                        "all_to_all": expert * capacity,
                    },
                    "max_load": float(last["moe_max_load"]),
                    "dropped_fraction": max(dropped[expert, name, d] for d in TIMED),
                    "first_losses": {d: first_loss[expert, name, d] for d in TIMED},
                    "losses": {d: sides[expert, name, d].loss for d in TIMED},
                    "times": {d: times[expert, name, d] for d in TIMED},
                }
            )
    print(
        f"\n{args.layers} layers, batch {args.batch_size} x {args.seq_len} over "
        f"{len(devices)} devices; {bench_common.machine_description(devices)}\n"
    )
    bench_common.print_table(
        [
            "mesh (data, fsdp, expert, tensor)",
            "shape",
            "all_gather s/step",
            "all_to_all s/step",
            "all_to_all / all_gather (rounds min-max)",
            "a2a capacity x",
            "expert rows/dev (ag / a2a)",
            "busiest expert / mean",
            "dropped",
            "first step's loss ag / a2a",
        ],
        [
            [
                str(r["mesh"]),
                r["shape"],
                f"{r['all_gather_s']:.3f}",
                f"{r['all_to_all_s']:.3f}",
                f"{r['all_to_all_over_all_gather']:.3f} "
                f"({min(r['round_ratios']):.2f}-{max(r['round_ratios']):.2f})",
                f"{r['capacity_factor']:g}",
                f"{r['expert_rows']['all_gather']} / {r['expert_rows']['all_to_all']}",
                f"{r['max_load']:.2f}",
                f"{r['dropped_fraction']:g}",
                " / ".join(f"{r['first_losses'][d]:.6f}" for d in TIMED),
            ]
            for r in rows
        ],
    )
    return {
        "rows": rows,
        "conditions_before": before,
        "conditions": bench_common.conditions(),
    }


def roofline_terms(result: Any, chip: chips.Chip, dtype: str) -> dict[str, float]:
    """The three terms the planner's roofline (`Planner.predict`) takes the step time from:
    compute, memory and collective seconds, to say which one binds."""
    return {
        "compute_s": result.flops / chip.peak_flops(dtype),
        "memory_s": result.bytes_accessed / chip.memory_bytes_per_s,
        "collective_s": result.collective_bytes / chip.link_bytes_per_s
        + result.collective_ops * chip.collective_latency_s,
    }


def run_cost(args: argparse.Namespace) -> dict[str, Any]:
    devices = bench_common.target_devices(args)
    n = len(devices)
    chip = chips.for_devices(args.tpu_topology or "this", devices)
    base = bench_common.reduce_layers(bench_common.gin_model(args.model), args.layers)
    lengths = aot.feature_lengths(base, args.seq_len)
    rows = []
    for expert in args.expert:
        shape = mesh_shape(n, expert)
        for dispatch in args.dispatches:
            changes: dict[str, Any] = {"moe_dispatch": dispatch, "scan_layers": False}
            if args.capacity_factor is not None:
                changes["capacity_factor"] = args.capacity_factor
            model = with_config(base, **changes)
            c = model.config
            knobs = Knobs(shape, "params", c.remat_policy, 1, False)
            run = plain_run(model, args.batch_size, lengths, AXES, knobs)
            print(f"compiling {args.model} ({c.num_layers} layers) {shape} {dispatch} ...")
            with jax.default_matmul_precision(args.matmul_precision):
                result = Planner(run, devices, chip).evaluate(knobs)
            row: dict[str, Any] = {
                "model": args.model,
                "layers": c.num_layers,
                "mesh": shape,
                "dispatch": dispatch,
                "capacity_factor": c.capacity_factor if dispatch == "all_to_all" else None,
                "status": result.status,
                "reason": result.reason,
                "compile_s": result.compile_s,
            }
            step = result.step
            if result.status == "fits" or (step is not None and step.compiled is not None):
                text = step.hlo_text()
                row.update(
                    flops=result.flops,
                    bytes_accessed=result.bytes_accessed,
                    device_bytes=result.device_bytes,
                    temp_bytes=int(step.compiled.memory_analysis().temp_size_in_bytes),
                    collective_ring_bytes=result.collective_bytes,
                    collective_ops=result.collective_ops,
                    all_collectives=hlo.parse_hlo(text, n)["by_kind"],
                    moe_collectives=moe.moe_collectives(text, n),
                    predicted_s=result.predicted_s,
                    mfu=result.mfu,
                    **roofline_terms(result, chip, str(c.dtype)),
                )
            rows.append(row)
            del result, step  # a large model's compiled program and HLO text
    print(
        f"\n{args.model} cut to {args.layers} layers (unscanned), batch {args.batch_size} x "
        f"{args.seq_len}; {bench_common.machine_description(devices, args.tpu_topology)}; "
        f"roofline: {chip.name}\n"
    )

    def moe_ring(r: dict[str, Any], kind: str) -> str:
        return f"{r['moe_collectives'].get(kind, {}).get('ring_bytes', 0) / GIB:.3f}"

    bench_common.print_table(
        [
            "mesh",
            "dispatch",
            "GFLOP/dev",
            "GB accessed/dev",
            "temp GiB/dev",
            "ring GiB/dev (all)",
            "MoE all-gather / reduce-scatter / all-reduce / all-to-all GiB",
            "compute / memory / collective ms",
            "planner ms/step",
        ],
        [
            [str(r["mesh"]), r["dispatch"], r["status"], r["reason"][:60], "", "", "", "", ""]
            if "flops" not in r
            else [
                str(r["mesh"]),
                r["dispatch"]
                + (f" x{r['capacity_factor']:g}" if r["capacity_factor"] is not None else ""),
                f"{r['flops'] / 1e9:.1f}",
                f"{r['bytes_accessed'] / 1e9:.2f}",
                f"{r['temp_bytes'] / GIB:.2f}",
                f"{r['collective_ring_bytes'] / GIB:.3f}",
                " / ".join(
                    moe_ring(r, k)
                    for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
                ),
                " / ".join(f"{r[k] * 1e3:.1f}" for k in ("compute_s", "memory_s", "collective_s")),
                f"{r['predicted_s'] * 1e3:.1f}",
            ]
            for r in rows
        ],
    )
    return {"rows": rows, "chip": chip.name}


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    fields = {"time": run_time, "cost": run_cost}[args.part](args)
    devices = jax.devices() if args.part == "time" else bench_common.target_devices(args)
    results = bench_common.run_record("moe_dispatch.py", args, argv, devices, **fields)
    bench_common.write_json(results, args.json)
    return results


if __name__ == "__main__":
    main()
