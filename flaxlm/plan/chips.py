"""Per-chip roofline numbers: peak FLOP/s by dtype, memory and interconnect bandwidth.

The planner (`flaxlm.plan`) turns a compiled step's FLOPs, bytes and collectives into a
predicted step time with these, and MFU divides by `peak_flops`. Figures are the vendors'
dense (no sparsity) peaks per chip:

- TPU v5e: 197 TFLOP/s bf16, 16 GB HBM at 819 GB/s, 400 GB/s bidirectional ICI per chip
  (cloud.google.com/tpu/docs/v5e, "System architecture").
- TPU v5p: 459 TFLOP/s bf16, 95 GB HBM at 2765 GB/s, 1200 GB/s bidirectional ICI per chip
  (cloud.google.com/tpu/docs/v5p).
- TPU v6e (Trillium): 918 TFLOP/s bf16, 32 GB HBM at 1638 GB/s, 800 GB/s bidirectional ICI
  per chip (cloud.google.com/tpu/docs/v6e).
- NVIDIA H100 SXM: 989 TFLOP/s bf16 and 495 TFLOP/s TF32 tensor core (the datasheet's 1979
  and 989 are with 2:4 sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s bidirectional
  (NVIDIA H100 Tensor Core GPU datasheet).
- NVIDIA H200 SXM: the H100's compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s (NVIDIA
  H200 datasheet).
- NVIDIA A100 SXM 80GB: 312 TFLOP/s bf16, 156 TFLOP/s TF32, 2.039 TB/s, NVLink 600 GB/s
  (NVIDIA A100 datasheet).

A GPU cluster's hosts (8 GPUs each) are joined by one 400 Gb/s InfiniBand NDR adapter a GPU
for the H100 and H200 (NVIDIA DGX H100/H200 user guides: eight ConnectX-7 ports), 200 Gb/s
HDR for the A100 (DGX A100): 50 and 25 GB/s a GPU each way.

On TPU, float32 matmuls at JAX's default precision run as bf16 passes (the bf16 peak); on
NVIDIA GPUs JAX's default precision multiplies float32 in TF32. A ring collective's bytes
are charged at half the bidirectional link bandwidth (what one direction carries); on a GPU
cluster, a collective whose groups span hosts is charged all its bytes at the network's
rate (`host_link_bytes_per_s`: NCCL's rings cross it however many GPUs a host holds). A TPU
slice is one torus across its hosts: every collective at the ICI rate.

CPU has no vendor peak that XLA:CPU reaches: `measure_cpu` times a matmul, a copy and a
small all-reduce on this host's devices and splits the host between them (simulated
devices share its cores).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

TERA = 1e12
GIGA = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator's roofline. `flops` maps a compute dtype name to peak FLOP/s."""

    name: str
    flops: dict[str, float]
    memory_bytes_per_s: float
    link_bytes_per_s: float  # one direction of a ring collective
    memory_bytes: float | None  # per device (None: not limited by the planner)
    collective_latency_s: float = 0.0  # per collective op
    source: str = ""
    # The network between hosts (a GPU cluster's), one direction a device; None: one network
    host_link_bytes_per_s: float | None = None

    def peak_flops(self, dtype: str) -> float:
        return self.flops[dtype] if dtype in self.flops else max(self.flops.values())


def _tpu(name: str, tflops: float, hbm_gib: float, hbm_gbps: float, ici_gbps: float) -> Chip:
    peak = tflops * TERA
    return Chip(
        name=name,
        flops={"bfloat16": peak, "float32": peak},  # default precision: bf16 passes
        memory_bytes_per_s=hbm_gbps * GIGA,
        link_bytes_per_s=ici_gbps * GIGA / 2,
        memory_bytes=hbm_gib * 2**30,  # the TPU compiler itself decides what fits
        source=f"cloud.google.com/tpu/docs/{name}",
    )


def _gpu(
    name: str, bf16: float, tf32: float, hbm_gb: float, hbm_tb: float, nvlink: float, nic: float
) -> Chip:
    return Chip(
        name=name,
        flops={"bfloat16": bf16 * TERA, "float16": bf16 * TERA, "float32": tf32 * TERA},
        memory_bytes_per_s=hbm_tb * TERA,
        link_bytes_per_s=nvlink * GIGA / 2,
        memory_bytes=hbm_gb * GIGA,
        source=f"NVIDIA {name} datasheet (dense)",
        host_link_bytes_per_s=nic * GIGA / 8,  # Gb/s a GPU, one direction
    )


CHIPS: dict[str, Chip] = {
    "v5e": _tpu("v5e", 197, 16, 819, 400),
    "v5p": _tpu("v5p", 459, 95, 2765, 1200),
    "v6e": _tpu("v6e", 918, 32, 1638, 800),
    "h100": _gpu("h100", 989, 495, 80, 3.35, 900, 400),
    "h200": _gpu("h200", 989, 495, 141, 4.8, 900, 400),
    "a100": _gpu("a100", 312, 156, 80, 2.039, 600, 200),
}

# `device_kind` strings as JAX reports them -> CHIPS keys.
_KINDS = (
    ("v5 lite", "v5e"),
    ("v5e", "v5e"),
    ("v5p", "v5p"),
    ("v5", "v5p"),
    ("v6", "v6e"),
    ("h100", "h100"),
    ("h200", "h200"),
    ("a100", "a100"),
)


GPUS = ("h100", "h200", "a100")


def chip_for(device: Any) -> Chip | None:
    """The roofline of a JAX device (None for CPU, and for a chip not in `CHIPS`). Its memory
    limit is what the runtime lets the device hold where it says (an attached GPU or TPU);
    for a GPU compiled for but not attached, what JAX will let a run hold there
    (`gpu_memory_fraction` of its HBM)."""
    kind = str(getattr(device, "device_kind", "")).lower()
    for key, name in _KINDS:
        if key in kind:
            chip = CHIPS[name]
            limit = _memory_limit(device)
            if limit is None and name in GPUS:
                limit = chip.memory_bytes * gpu_memory_fraction()
            return chip if limit is None else dataclasses.replace(chip, memory_bytes=limit)
    return None


def gpu_memory_fraction() -> float:
    """The share of a GPU's memory JAX's allocator takes, as the run will have it:
    `XLA_CLIENT_MEM_FRACTION` (or the deprecated `XLA_PYTHON_CLIENT_MEM_FRACTION`; JAX refuses
    both at once), 0.75 unless set; a ValueError for a value that is not a fraction."""
    current = os.environ.get("XLA_CLIENT_MEM_FRACTION", "")
    deprecated = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    if current and deprecated:
        raise ValueError(
            "XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are both set (JAX "
            "refuses that): unset the latter, which is deprecated."
        )
    name = (
        "XLA_CLIENT_MEM_FRACTION" if current or not deprecated else "XLA_PYTHON_CLIENT_MEM_FRACTION"
    )
    text = current or deprecated or "0.75"
    try:
        fraction = float(text)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise ValueError(f"{name}={text!r}: expected a fraction in (0, 1], e.g. 0.9.")
    return fraction


def _memory_limit(device: Any) -> float | None:
    """What the runtime lets one device hold (an attached GPU/TPU), if it says."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - compile-only devices have no runtime
        return None
    return float(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def _best_seconds(fn: Any, repeats: int = 5) -> float:
    fn()  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu(devices: Sequence[Any], host_memory_bytes: float | None = None) -> Chip:
    """A roofline for `devices` (CPU devices of this process) measured on this host.

    Matmul FLOP/s and copy bandwidth are timed on one device and split evenly between the
    devices (XLA:CPU runs every device's program on the same cores); an all-reduce of 4 bytes
    and of 4 MiB across all of them gives the per-op latency and the link bandwidth.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    one = devices[0]
    a = jax.device_put(jnp.ones((1024, 1024), jnp.float32), one)
    matmul = jax.jit(lambda x: x @ x)
    seconds = _best_seconds(lambda: matmul(a).block_until_ready())
    flops = 2 * 1024**3 / seconds / n
    big = jax.device_put(jnp.ones((32 * 2**20 // 4,), jnp.float32), one)
    copy = jax.jit(lambda x: x + 1.0)
    seconds = _best_seconds(lambda: copy(big).block_until_ready())
    memory = 2 * big.nbytes / seconds / n  # read + write

    mesh = jax.sharding.Mesh(np.asarray(devices), ("d",))

    def all_reduce_seconds(elements: int) -> float:
        x = jax.device_put(jnp.ones((n, elements), jnp.float32), NamedSharding(mesh, P("d", None)))
        f = jax.jit(
            jax.shard_map(
                lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")
            )
        )
        return _best_seconds(lambda: f(x).block_until_ready())

    latency = all_reduce_seconds(1)
    large = 2**20
    ring = 2 * (n - 1) / n * large * 4 if n > 1 else 0.0
    transfer = max(all_reduce_seconds(large) - latency, 1e-9)
    link = ring / transfer if ring else float("inf")
    return Chip(
        name=f"cpu:{n}",
        flops={"bfloat16": flops, "float32": flops},
        memory_bytes_per_s=memory,
        link_bytes_per_s=link,
        memory_bytes=host_memory_bytes / n if host_memory_bytes else None,
        collective_latency_s=latency if n > 1 else 0.0,
        source=f"measured on this host ({n} devices sharing it)",
    )


def host_memory_bytes() -> float | None:
    """This host's RAM (Linux), which simulated CPU devices share."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def for_devices(topology: str, devices: Sequence[Any]) -> Chip:
    """The roofline of `devices`: the table's for an accelerator, measured for CPU; a
    ValueError for an accelerator the table does not know."""
    if devices[0].platform == "cpu":
        return measure_cpu(devices, host_memory_bytes())
    chip = chip_for(devices[0])
    if chip is None:
        raise ValueError(
            f"topology {topology}: no roofline for {devices[0].device_kind!r} (known: "
            f"{', '.join(sorted(CHIPS))}); add it to flaxlm/chips.py."
        )
    return chip
