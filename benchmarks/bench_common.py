"""Helpers shared by the compile-only benchmarks (memory, collectives, compile time).

They build flaxlm's own train step (`trainer.Setup`, `trainer.make_train_step`,
`Partitioner.partition`) and lower and compile it on abstract inputs: the train state is
`Setup.abstract_state` (ShapeDtypeStructs carrying their shardings), the batch is abstract
too, so nothing is allocated at full size.

Import this module before JAX when simulated devices are wanted (`force_host_devices`).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# The partitionings of gin/partitioning/*.gin: (mesh_shape, optimizer_sharding).
PARTITIONINGS: dict[str, tuple[tuple[int, ...], str]] = {
    "dp": ((-1, 1, 1), "params"),
    "zero1": ((-1, 1, 1), "zero1"),
    "fsdp": ((1, -1, 1), "params"),
    "tp": ((1, 1, -1), "params"),
    "fsdp_tp": ((1, -1, 2), "params"),
}


def force_host_devices(count: int = 8) -> None:
    """Simulate `count` CPU devices (as tests/conftest.py does); only before JAX starts."""
    if "jax" in sys.modules:
        return  # already started (e.g. under pytest, which sets 8 itself)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before flaxlm, which would choose
    from flaxlm.parallel import platforms as flaxlm_platforms

    os.environ["XLA_FLAGS"] = flaxlm_platforms.host_device_flags(count)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(devices: Sequence[Any] | None = None, topology: str | None = None) -> str:
    """This host, and the devices compiled for (all of `jax.devices()` unless given)."""
    import jax

    devices = jax.devices() if devices is None else devices
    host = f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"
    targets = f"{len(devices)}x {devices[0].device_kind} ({devices[0].platform})"
    if topology:
        return f"{host}; compiled ahead of time for {targets}, topology {topology}, none attached"
    return f"{host}; {targets}"


def matmul_probe(size: int = 512, bursts: int = 5, burst_seconds: float = 0.2) -> float:
    """GFLOP/s of a `size` x `size` float32 numpy matmul (numpy's BLAS, its own threads),
    the median of `bursts` bursts: a yardstick for this machine right now, so runs on other
    days (or other CPUs of a shared VM) can be compared through it."""
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((size, size), dtype=np.float32) for _ in range(2))
    for _ in range(3):
        a @ b
    rates = []
    for _ in range(bursts):
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < burst_seconds:
            a @ b
            n += 1
        rates.append(2 * size**3 * n / elapsed / 1e9)
    return sorted(rates)[len(rates) // 2]


CONDITION_ENV = ("XLA_FLAGS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")
# The vector and matrix extensions a CPU matmul (and a bfloat16 one) is fast with.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_flags() -> list[str]:
    """Which of `CPU_FLAGS` this CPU has (from /proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in CPU_FLAGS if flag in have]
    except OSError:
        pass
    return []


def conditions() -> dict[str, Any]:
    """What a CPU timing depends on beyond the code: the CPU and its extensions, its cores,
    the load average (1, 5, 15 min), the thread-related environment and the matmul probe."""
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg": list(os.getloadavg()),
        "env": {k: os.environ[k] for k in CONDITION_ENV if k in os.environ},
        "matmul_gflops": matmul_probe(),
    }


def add_target_args(parser: Any) -> None:
    """`--tpu-topology` and `--matmul-precision` (see `target_devices`)."""
    parser.add_argument(
        "--tpu-topology",
        metavar="NAME",
        help="compile for this TPU slice (e.g. v5e:2x4) with libtpu, ahead of time, instead "
        "of for this host's devices; no TPU needed",
    )
    parser.add_argument(
        "--matmul-precision",
        choices=("default", "high", "highest"),
        help="jax_default_matmul_precision while compiling; on TPU `default` multiplies "
        "float32 in bf16 passes (so e.g. FSDP gathers float32 params as bf16), `highest` "
        "keeps float32",
    )


def target_devices(args: Any) -> list[Any]:
    """The devices to compile for: the `--tpu-topology` slice's, else `jax.devices()`."""
    import jax

    if getattr(args, "tpu_topology", None):
        return topology_devices(args.tpu_topology)
    return list(jax.devices())


def topology_devices(name: str) -> list[Any]:
    """Compile-only devices of a TPU slice (`flaxlm.plan.aot.topology_devices`)."""
    from flaxlm.plan import aot

    return aot.topology_devices(name)


GIN_MODELS = os.path.join(REPO, "gin", "models")


def gin_model_names() -> list[str]:
    """The names of gin/models/*.gin."""
    return sorted(f[: -len(".gin")] for f in os.listdir(GIN_MODELS) if f.endswith(".gin"))


def gin_model(name: str, bindings: Sequence[str] = (), **changes: Any) -> Any:
    """The model `gin/models/<name>.gin` binds to MODEL (with Gin `bindings` added, as
    `--gin.` flags would), its config changed by `changes` (the module rebuilt from it);
    Gin's config is cleared before and after."""
    import gin

    from flaxlm.plan.run import with_config

    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings([os.path.join(GIN_MODELS, f"{name}.gin")], bindings)
        model = gin.query_parameter("%MODEL").scoped_configurable_fn()
    finally:
        gin.clear_config()
    return with_config(model, **changes) if changes else model


def reduce_layers(model: Any, layers: int, first_dense: int | None = None) -> Any:
    """`model` cut to its first `layers` layers, a mixture of experts with dense first layers
    (DeepSeek-V3's `first_k_dense_replace`, `mlp_only_layers` = (0, ..., k - 1)) keeping
    `first_dense` of them (default: its own k, at most `layers` - 1, so at least one MoE layer
    is left), unrolled before the scanned MoE layers where the model scans (measured
    unscanned until 2026-12-06, when such a mix could not scan). Per-layer
    attention kinds (`layer_types`: sliding or full) are those of the first `layers`.
    `model.config.sparse_layers` tells what was kept."""
    from flaxlm.plan.run import with_config

    c = model.config
    changes: dict[str, Any] = {"num_layers": layers}
    if getattr(c, "layer_types", None) is not None:  # gpt-oss, Qwen: the first layers' kinds
        changes["layer_types"] = tuple(c.layer_types[:layers])
    dense = tuple(getattr(c, "mlp_only_layers", ()))
    if dense and dense == tuple(range(len(dense))):
        keep = min(len(dense), layers - 1) if first_dense is None else first_dense
        if not 0 <= keep <= min(len(dense), layers - 1):
            raise ValueError(
                f"--first-dense {first_dense}: {len(dense)} dense first layers in the model, "
                f"and at least one of --layers {layers} must be a MoE layer."
            )
        changes["mlp_only_layers"] = tuple(range(keep))
    elif first_dense:
        raise ValueError("--first-dense: this model has no dense first layers (mlp_only_layers).")
    return with_config(model, **changes)


def make_partitioner(
    name: str, devices: Sequence[Any] | None = None, sequence: int = 1, expert: int = 1
) -> Any:
    """The Partitioner of `gin/partitioning/<name>.gin`; with `sequence` > 1 a `sequence` mesh
    axis of that size (context parallelism, as gin/partitioning/fsdp_cp.gin) is added before
    `tensor`, its devices taken from the -1 axis (fsdp: `(1, -1, sequence, 1)`); `expert` > 1
    likewise adds an `expert` axis (expert parallelism, as gin/partitioning/fsdp_ep.gin)."""
    from flaxlm.parallel.partitioning import EXPERT_AXIS, MESH_AXES, SEQUENCE_AXIS, Partitioner

    if name not in PARTITIONINGS:
        raise ValueError(f"partitioning {name!r}: expected one of {sorted(PARTITIONINGS)}.")
    mesh_shape, optimizer_sharding = PARTITIONINGS[name]
    axes: tuple[str, ...] = MESH_AXES
    if sequence > 1:
        mesh_shape = (*mesh_shape[:2], sequence, mesh_shape[2])
        axes = (*MESH_AXES[:2], SEQUENCE_AXIS, MESH_AXES[2])
    if expert > 1:
        mesh_shape = (*mesh_shape[:-1], expert, mesh_shape[-1])
        axes = (*axes[:-1], EXPERT_AXIS, axes[-1])
    return Partitioner(
        mesh_shape=mesh_shape,
        mesh_axis_names=axes,
        optimizer_sharding=optimizer_sharding,
        devices=devices,
    )


def add_sequence_arg(parser: Any) -> None:
    """`--sequence N` (see `make_partitioner`)."""
    parser.add_argument(
        "--sequence",
        type=int,
        default=1,
        metavar="N",
        help="context parallelism: split each sequence over a 'sequence' mesh axis of N "
        "devices (taken from the partitioning's -1 axis; ring attention); lengths must be "
        "a multiple of 2 N",
    )


def add_expert_arg(parser: Any) -> None:
    """`--expert N` (see `make_partitioner`)."""
    parser.add_argument(
        "--expert",
        type=int,
        default=1,
        metavar="N",
        help="expert parallelism: split each MoE layer's experts over an 'expert' mesh axis "
        "of N devices (taken from the partitioning's -1 axis; the batch and the other params "
        "split over it too); the models' expert counts must be multiples of N",
    )


def feature_lengths(model: Any, seq_len: int) -> dict[str, int]:
    """Model-feature lengths for `seq_len`-long task features."""
    from flaxlm.plan import aot

    return aot.feature_lengths(model, seq_len)


def CompiledStep(  # noqa: N802 - what the scripts have always called
    model: Any,
    partitioner: Any,
    batch_size: int,
    seq_len: int,
    learning_rate: float = 1e-3,
    matmul_precision: str | None = None,
    out_of_memory_ok: bool = False,
    preference_loss: str | None = None,
    lora_rank: int | None = None,
) -> Any:
    """`flaxlm.plan.aot.CompiledStep` of flaxlm's default AdamW at `seq_len`; `preference_loss`
    ('dpo', ...): that loss's step on `batch_size` pairs; `lora_rank`: LoRA adapters of that
    rank on every attention and MLP kernel."""
    from flaxlm.plan import aot
    from flaxlm.posttrain import preference
    from flaxlm.training import lora

    lora_cfg = None
    if lora_rank is not None:
        kernels = r"(q|k|v|o|out|gate|up|down)_proj/kernel$|fc_(in|out)/kernel$"
        lora_cfg = lora.LoraConfig(rules=((kernels, lora_rank),))
    objective = None if preference_loss is None else preference.PreferenceConfig(preference_loss)
    return aot.CompiledStep(
        model,
        partitioner,
        batch_size,
        aot.feature_lengths(model, seq_len),
        learning_rate=learning_rate,
        lora=lora_cfg,
        objective=objective,
        matmul_precision=matmul_precision,
        out_of_memory_ok=out_of_memory_ok,
    )


def per_device_bytes(abstract_tree: Any) -> int:
    from flaxlm.plan import aot

    return aot.per_device_bytes(abstract_tree)


def total_bytes(abstract_tree: Any) -> int:
    from flaxlm.plan import aot

    return aot.total_bytes(abstract_tree)


def unsharded_leaves(abstract_tree: Any, min_bytes: int = 0) -> list[tuple[str, tuple, str]]:
    """(path, shape, spec) of leaves held whole on every device (for diagnosing targets)."""
    import jax
    import numpy as np

    from flaxlm.parallel.pytrees import path_name

    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_tree)[0]:
        nbytes = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        if tuple(leaf.sharding.shard_shape(leaf.shape)) == tuple(leaf.shape):
            if nbytes >= min_bytes and leaf.shape:
                out.append((path_name(path), tuple(leaf.shape), str(leaf.sharding.spec)))
    return out


def run_record(
    script: str,
    args: Any,
    argv: Sequence[str] | None,
    devices: Sequence[Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """What every benchmark's JSON starts with: date, the command that reproduces the run
    (`script` with `argv`), machine, JAX version and devices (all of `jax.devices()` unless
    given), the arguments; then `fields`."""
    import datetime
    import shlex

    import jax

    devices = jax.devices() if devices is None else devices
    return {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", f"benchmarks/{script}", *(argv or sys.argv[1:])]),
        "machine": machine_description(devices, getattr(args, "tpu_topology", None)),
        "jax_version": jax.__version__,
        "devices": len(devices),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        **fields,
    }


def write_json(results: Mapping[str, Any], path: str | None) -> None:
    import json

    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nWrote {path}")


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A markdown table (pasteable into RESULTS.md)."""
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" for _ in header) + " |")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
