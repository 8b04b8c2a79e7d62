"""Mixture-of-experts steps: `dropless` against `dense` (CPU time, compiled FLOPs) and the
memory and collectives of expert parallelism ahead of time.

Three parts, each a subcommand:

- `time`: flaxlm's train step on one CPU device for a tiny Qwen3-MoE (qwen3_moe_tiny.gin cut
  to `--layers`) at E=8/k=2 and E=64/k=8, `moe_impl='dense'` (every expert over every token)
  against `'dropless'` (one `ragged_dot` per projection), in alternating rounds so load on a
  shared machine falls on both; the ratio of the medians.
- `flops`: `compiled.cost_analysis()` FLOPs of one device's step, dropless / dense, for the
  same shapes on this host's devices or, with `--tpu-topology`, on a TPU slice ahead of time
  (libtpu, no TPU attached); beside it the ratio if the experts cost k/E of dense (the rest
  of the step unchanged): a backend that runs `ragged_dot` natively lands there, one that
  expands it densely lands near 1.
- `memory`: Qwen3-30B-A3B and Mixtral 8x7B (or `--models`: any gin/models/ MoE, e.g.
  gpt_oss_120b, deepseek_v3), cut to `--layers` (DeepSeek-V3's dense first layers: to
  `--first-dense`, by default all but one of `--layers`, unrolled before the scan), on 8
  devices (`--tpu-topology v5p:2x2x2`) under fsdp and fsdp + expert (`--expert`): params +
  optimizer per device against total / 8 (target <= 1.05x), and the bytes the MoE layers'
  collectives move per step over the ring (the ops inside the expert-parallel `shard_map`:
  all-gather of the tokens over `expert` and of the experts' weights over fsdp,
  reduce-scatter of their outputs and of the weights' gradient, all-reduce where a psum is
  left; all-to-all where a backend has it) against the all-to-all's 2 x k x d x bytes x
  tokens x MoE layers per device, x2 with the backward. `--dispatch all_to_all` compiles
  the capacity-bounded all-to-all dispatch instead of the all-gather one, `--dispatch
  ragged` the `ragged_all_to_all` one (its ragged-all-to-all counted as an all-to-all of
  its whole receive buffer); moe_dispatch.py times and costs the dispatches against each
  other.

    python benchmarks/moe.py time --json /tmp/moe_time.json
    python benchmarks/moe.py flops                           # this host (CPU)
    python benchmarks/moe.py flops --tpu-topology v5e:2x4    # TPU, ahead of time
    python benchmarks/moe.py memory --tpu-topology v5p:2x2x2 --layers 2
    python benchmarks/moe.py memory --tpu-topology v5p:2x2x2 --layers 2 \
      --models gpt_oss_120b deepseek_v3           # DeepSeek: 1 dense + 1 MoE layer
    python benchmarks/moe.py memory --tpu-topology v5p:4x4x4 --layers 2 --expert 64 \
      --batch-size 64 --expert-only --models deepseek_v3 --dispatch all_to_all
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402

bench_common.force_host_devices(8)

import argparse  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from flaxlm.models.expert_parallel import DISPATCHES  # noqa: E402
from flaxlm.parallel.partitioning import Partitioner  # noqa: E402
from flaxlm.plan import hlo  # noqa: E402
from flaxlm.training import steps  # noqa: E402

GIB = 2**30
SHAPES = {"E8k2": (8, 2), "E64k8": (64, 8)}  # name: (num_experts, num_experts_per_tok)
MEMORY_MODELS = ("qwen3_moe_30b_a3b", "mixtral_8x7b")
TARGET = 1.05


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="part", required=True)
    timing = sub.add_parser("time", help="CPU step time, dropless vs dense, alternating")
    flops = sub.add_parser("flops", help="compiled FLOPs, dropless / dense")
    memory = sub.add_parser("memory", help="fsdp vs fsdp + expert, ahead of time")
    for q in (timing, flops):
        q.add_argument("--layers", type=int, default=2)
        q.add_argument("--batch-size", type=int, default=8)
        q.add_argument("--seq-len", type=int, default=128)
    timing.add_argument("--rounds", type=int, default=5)
    timing.add_argument("--steps", type=int, default=3, help="steps per timed call")
    memory.add_argument(
        "--models",
        nargs="+",
        default=list(MEMORY_MODELS),
        choices=bench_common.gin_model_names(),
        metavar="MODEL",
        help="gin/models/ files with experts (e.g. gpt_oss_120b deepseek_v3)",
    )
    memory.add_argument("--layers", type=int, default=2, help="layers kept of each model")
    memory.add_argument(
        "--first-dense",
        type=int,
        default=None,
        metavar="K",
        help="of a model with dense first layers (DeepSeek-V3's 3), keep K (default: its "
        "own, at most --layers - 1: one MoE layer at least), unrolled before the scan",
    )
    memory.add_argument("--batch-size", type=int, default=8)
    memory.add_argument("--seq-len", type=int, default=2048)
    bench_common.add_expert_arg(memory)
    memory.set_defaults(expert=8)
    memory.add_argument(
        "--dispatch",
        choices=DISPATCHES,
        default="all_gather",
        help="moe_dispatch: how the tokens reach their experts' devices under --expert",
    )
    memory.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="capacity_factor (the all_to_all dispatch's buffers); default: the model's",
    )
    memory.add_argument(
        "--ragged-buffer-factor",
        type=float,
        default=None,
        help="ragged_buffer_factor (the ragged dispatch's receive buffers); default: the model's",
    )
    memory.add_argument(
        "--expert-only",
        action="store_true",
        help="compile only the fsdp + expert row (on a large slice the fsdp row, every "
        "expert's weights gathered onto every device, costs as long again)",
    )
    for q in (flops, memory):
        bench_common.add_target_args(q)
    for q in (timing, flops, memory):
        q.add_argument("--json", metavar="PATH", help="also write the numbers as JSON here")
    return p.parse_args(argv)


def tiny_model(shape: str, impl: str, layers: int, **changes: Any) -> Any:
    """qwen3_moe_tiny.gin at `shape`'s experts, `layers` layers, `impl` (and `changes` to
    its config)."""
    experts, k = SHAPES[shape]
    return bench_common.gin_model(
        "qwen3_moe_tiny",
        num_layers=layers,
        num_experts=experts,
        num_experts_per_tok=k,
        moe_impl=impl,
        **changes,
    )


def random_batch(batch_size: int, length: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    targets = rng.integers(3, 259, size=(batch_size, length), dtype=np.int32)
    inputs = np.concatenate([np.zeros((batch_size, 1), np.int32), targets[:, :-1]], axis=1)
    return {
        "decoder_input_tokens": inputs,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": np.ones_like(targets),
    }


class Side:
    """One model's partitioned train step and state (on one device unless `partitioner`
    says otherwise), `n` steps at a time; `metrics` holds each step's since the last `run`."""

    def __init__(
        self, model: Any, args: argparse.Namespace, partitioner: Partitioner | None = None
    ) -> None:
        if partitioner is None:
            partitioner = Partitioner(mesh_shape=(1, 1, 1), devices=jax.devices()[:1])
        batch = random_batch(args.batch_size, args.seq_len)
        lengths = {k: v.shape[1] for k, v in batch.items()}
        setup = steps.Setup(model, partitioner, _optimizer(), lengths)
        self.step = setup.partition_train_step(steps.make_train_step(model, partitioner, 1e-3))
        self.state = setup.init_state()
        self.batch = {
            k: jax.device_put(v, partitioner.batch_sharding(v.ndim)) for k, v in batch.items()
        }
        self.loss = float("nan")
        self.metrics: list[dict[str, jax.Array]] = []

    def run(self, n: int) -> float:
        start = time.perf_counter()
        state, self.metrics = self.state, []
        for _ in range(n):
            state, metrics = self.step(state, self.batch)
            self.metrics.append(metrics)
        jax.block_until_ready(state)
        elapsed = time.perf_counter() - start
        self.state, self.loss = state, float(metrics["loss"])
        return elapsed / n


def _optimizer() -> Any:
    from flaxlm.training import optimizers

    return optimizers.create_optimizer(learning_rate=1e-3)


def run_time(args: argparse.Namespace) -> dict[str, Any]:
    sides = {}
    for shape in SHAPES:
        for impl in ("dense", "dropless"):
            print(f"compiling {shape} {impl} ...", flush=True)
            sides[shape, impl] = side = Side(tiny_model(shape, impl, args.layers), args)
            side.run(1)  # compile and warm up
    times: dict[tuple[str, str], list[float]] = {key: [] for key in sides}
    for r in range(args.rounds):
        for key, side in sides.items():
            times[key].append(side.run(args.steps))
        print(f"round {r}: " + ", ".join(f"{k[0]} {k[1]} {v[-1]:.3f}s" for k, v in times.items()))
    rows = []
    for shape in SHAPES:
        dense, dropless = (statistics.median(times[shape, i]) for i in ("dense", "dropless"))
        experts, k = SHAPES[shape]
        rows.append(
            {
                "shape": shape,
                "dense_s": dense,
                "dropless_s": dropless,
                "dropless_over_dense": dropless / dense,
                "k_over_E": k / experts,
                "losses": {i: sides[shape, i].loss for i in ("dense", "dropless")},
                "times": {i: times[shape, i] for i in ("dense", "dropless")},
            }
        )
    print(
        f"\n{args.layers} layers, batch {args.batch_size} x {args.seq_len}, one CPU device; "
        f"{bench_common.machine_description(jax.devices()[:1])}\n"
    )
    bench_common.print_table(
        ["shape", "dense s/step", "dropless s/step", "dropless / dense", "k / E"],
        [
            [
                r["shape"],
                f"{r['dense_s']:.3f}",
                f"{r['dropless_s']:.3f}",
                f"{r['dropless_over_dense']:.3f}",
                f"{r['k_over_E']:.3f}",
            ]
            for r in rows
        ],
    )
    return {"rows": rows, "conditions": bench_common.conditions()}


def expert_flops(model: Any, tokens_per_device: float) -> float:
    """Train-step FLOPs of the experts' matmuls per device if every expert ran on every
    token (dense): 3 matmuls (gate, up, down) of d x f, x 2 FLOPs x 3 (forward + backward)."""
    c = model.config
    sparse = sum(c.sparse_layers(c.num_layers))
    d, f = c.hidden_size, c.moe_intermediate_size
    return 3 * 3 * 2 * d * f * c.num_experts * tokens_per_device * sparse


def ragged_dot_costs(device: Any, m: int = 8192, e: int = 64, d: int = 128, f: int = 96) -> dict:
    """Compiled FLOPs of `ragged_dot` alone ([m, d] rows in e groups times [e, d, f]), its
    forward and the gradients of its rows (dx) and of its weights (dw), in multiples of the
    native grouped matmul's 2 m d f: 1 where the backend runs it natively, ~e where it
    expands it into a dense matmul per group."""
    s = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((m, d), jnp.float32, sharding=s)
    w = jax.ShapeDtypeStruct((e, d, f), jnp.float32, sharding=s)
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32, sharding=s)

    def forward(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(x, w, sizes).sum()

    programs = {"forward": forward, "dx": jax.grad(forward, 0), "dw": jax.grad(forward, 1)}
    costs = {}
    for name, fn in programs.items():
        analysis = jax.jit(fn).lower(x, w, sizes).compile().cost_analysis()
        analysis = analysis[0] if isinstance(analysis, Sequence) else analysis
        costs[name] = float(analysis["flops"]) / (2 * m * d * f)
    return costs


def run_flops(args: argparse.Namespace) -> dict[str, Any]:
    devices = bench_common.target_devices(args)
    n = len(devices)
    ragged = ragged_dot_costs(devices[0])
    print(
        "ragged_dot alone (64 groups), FLOPs / native: "
        + ", ".join(f"{k} {v:.2f}" for k, v in ragged.items())
    )
    rows = []
    for shape in SHAPES:
        cost = {}
        for impl in ("dense", "dropless"):
            print(f"compiling {shape} {impl} for {n} devices ...", flush=True)
            model = tiny_model(shape, impl, args.layers)
            step = bench_common.CompiledStep(
                model,
                bench_common.make_partitioner("fsdp", devices),
                args.batch_size,
                args.seq_len,
                matmul_precision=args.matmul_precision,
            )
            cost[impl] = step.cost()["flops"]
            text = step.hlo_text()
            ragged = len(re.findall(r"ragged-dot|ragged_dot", text))
            cost[f"{impl}_ragged_ops"] = ragged
        experts, k = SHAPES[shape]
        x = expert_flops(model, args.batch_size * args.seq_len / n)
        native = (cost["dense"] - x * (1 - k / experts)) / cost["dense"]
        rows.append(
            {
                "shape": shape,
                **cost,
                "dropless_over_dense": cost["dropless"] / cost["dense"],
                "expert_share_of_dense": x / cost["dense"],
                "if_native": native,
                "k_over_E": k / experts,
            }
        )
    print(
        f"\n{args.layers} layers, batch {args.batch_size} x {args.seq_len}, fsdp on {n} "
        f"devices; {bench_common.machine_description(devices, args.tpu_topology)}\n"
    )
    bench_common.print_table(
        [
            "shape",
            "dense GFLOP/dev",
            "dropless GFLOP/dev",
            "dropless / dense",
            "if ragged_dot native",
            "k / E",
            "ragged ops left in HLO",
        ],
        [
            [
                r["shape"],
                f"{r['dense'] / 1e9:.2f}",
                f"{r['dropless'] / 1e9:.2f}",
                f"{r['dropless_over_dense']:.3f}",
                f"{r['if_native']:.3f}",
                f"{r['k_over_E']:.3f}",
                r["dropless_ragged_ops"],
            ]
            for r in rows
        ],
    )
    return {"rows": rows, "ragged_dot_flops_over_native": ragged}


def moe_collectives(text: str, n: int) -> dict[str, dict[str, float]]:
    """`hlo.parse_hlo`'s per-kind totals of the collectives inside the MoE layers'
    `shard_map` (their op_name holds `shard_map`), keeping the other ops out: the HLO with
    every other collective's opcode renamed so the parser passes over it."""
    kinds = "|".join(re.escape(k) for k in hlo.COLLECTIVES)
    pattern = re.compile(rf"\b({kinds})(-start)?\(")

    def keep(line: str) -> str:
        if "shard_map" in line or not pattern.search(line):
            return line
        return pattern.sub(lambda m: f"custom-call-{m.group(1)}{m.group(2) or ''}(", line)

    return hlo.parse_hlo("\n".join(keep(x) for x in text.splitlines()), n)["by_kind"]


def layer_description(layers: int, moe_layers: int) -> str:
    """'2 layers' where all are MoE layers, else '1 dense + 1 MoE layers'."""
    if moe_layers == layers:
        return f"{layers} layers"
    return f"{layers - moe_layers} dense + {moe_layers} MoE layers"


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    devices = bench_common.target_devices(args)
    n = len(devices)
    rows = []
    for name in args.models:
        changes: dict[str, Any] = {"moe_dispatch": args.dispatch}
        if args.capacity_factor is not None:
            changes["capacity_factor"] = args.capacity_factor
        if args.ragged_buffer_factor is not None:
            changes["ragged_buffer_factor"] = args.ragged_buffer_factor
        model = bench_common.reduce_layers(
            bench_common.gin_model(name, **changes), args.layers, args.first_dense
        )
        c = model.config
        sparse = sum(c.sparse_layers(c.num_layers))
        kept = layer_description(c.num_layers, sparse)
        for expert in (args.expert,) if args.expert_only else (1, args.expert):
            label = "fsdp" if expert == 1 else f"fsdp + expert {expert}"
            if expert > 1 and args.dispatch == "all_to_all":
                label += f" (all_to_all, capacity x{c.capacity_factor:g})"
            elif expert > 1 and args.dispatch == "ragged":
                label += f" (ragged, buffer x{c.ragged_buffer_factor:g})"
            print(f"compiling {name} ({kept}) / {label} ...", flush=True)
            partitioner = bench_common.make_partitioner("fsdp", devices, expert=expert)
            step = bench_common.CompiledStep(
                model,
                partitioner,
                args.batch_size,
                args.seq_len,
                matmul_precision=args.matmul_precision,
                out_of_memory_ok=True,
            )
            state = step.setup.abstract_state
            total = bench_common.total_bytes(state.params) + bench_common.total_bytes(
                state.opt_state
            )
            per_device = bench_common.per_device_bytes(
                state.params
            ) + bench_common.per_device_bytes(state.opt_state)
            row = {
                "model": name,
                "layers": args.layers,
                "moe_layers": sparse,
                "scan_layers": c.scan_layers,
                "partitioning": label,
                "moe_dispatch": c.moe_dispatch,
                "capacity_factor": c.capacity_factor,
                "ragged_buffer_factor": c.ragged_buffer_factor,
                "num_params": sum(x.size for x in jax.tree.leaves(state.params)),
                "state_total_bytes": total,
                "state_bytes": per_device,
                "ratio": per_device / (total / n),
            }
            if step.compiled is None:
                row["out_of_memory"] = step.out_of_memory
            else:
                row["temp_bytes"] = int(step.compiled.memory_analysis().temp_size_in_bytes)
                text = step.hlo_text()
                row["all_collectives"] = hlo.parse_hlo(text, n)["by_kind"]
                row["moe_collectives"] = moe_collectives(text, n)
                tokens = args.batch_size * args.seq_len / n
                itemsize = np.dtype(c.dtype).itemsize
                forward = 2 * c.num_experts_per_tok * c.hidden_size * itemsize * tokens * sparse
                row["all_to_all_theory_bytes"] = 2 * forward
            rows.append(row)
    print(
        f"\nbatch {args.batch_size} x {args.seq_len}; "
        f"{bench_common.machine_description(devices, args.tpu_topology)}\n"
    )
    table = []
    for r in rows:
        moe = r.get("moe_collectives", {})

        def moved(kind: str, moe: dict = moe) -> str:
            return f"{moe.get(kind, {}).get('ring_bytes', 0) / GIB:.3f}"

        theory = r.get("all_to_all_theory_bytes")
        ring = sum(v["ring_bytes"] for k, v in moe.items() if "/" not in k)
        table.append(
            [
                f"{r['model']} ({layer_description(r['layers'], r['moe_layers'])})",
                r["partitioning"],
                f"{r['state_bytes'] / GIB:.2f}",
                f"{r['state_total_bytes'] / n / GIB:.2f}",
                f"{r['ratio']:.3f} {'PASS' if r['ratio'] <= TARGET else 'FAIL'}",
                f"{r['temp_bytes'] / GIB:.2f}" if "temp_bytes" in r else "does not fit",
                moved("all-gather"),
                moved("reduce-scatter"),
                moved("all-reduce"),
                f"{float(moved('all-to-all')) + float(moved('ragged-all-to-all')):.3f}",
                "-" if theory is None else f"{theory / GIB:.3f}",
                "-" if not theory or not ring else f"{ring / theory:.2f}",
            ]
        )
    bench_common.print_table(
        [
            "model",
            "partitioning",
            "params+opt GiB/dev",
            f"total/{n} GiB",
            f"ratio (<= {TARGET})",
            "temp GiB/dev",
            "MoE all-gather GiB",
            "MoE reduce-scatter GiB",
            "MoE all-reduce GiB",
            "MoE all-to-all GiB",
            "all-to-all theory GiB",
            "MoE / theory",
        ],
        table,
    )
    return {"rows": rows}


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    part = {"time": run_time, "flops": run_flops, "memory": run_memory}[args.part]
    fields = part(args)
    devices = jax.devices()[:1] if args.part == "time" else bench_common.target_devices(args)
    results = bench_common.run_record("moe.py", args, argv, devices, **fields)
    bench_common.write_json(results, args.json)
    return results


if __name__ == "__main__":
    main()
