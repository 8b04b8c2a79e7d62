"""Ahead-of-time compilation of flaxlm's train step, for devices that need not be attached.

The train state is `steps.Setup.abstract_state` (ShapeDtypeStructs carrying their
shardings) and the batch is abstract too, so nothing is allocated at full size: the step is
flaxlm's own (`make_train_step` partitioned by `Setup.partition_train_step`), lowered and
compiled. The targets (`target_devices`): a TPU slice by name (libtpu compiles for it on
any host, as MaxText's train_compile.py does), `cpu:N` (this process's CPU devices), or
`this` (whatever JAX runs on here), or a cluster of NVIDIA GPUs (`gpu_devices`: XLA:GPU
compiles for them with no GPU attached, from a description of the chip, hosts of 8 as
`h100:16x8`). Shared by the planner and the compile-only benchmarks. XLA's cost analysis of
a compile-only GPU program is empty: `CompiledStep.cost` reads its FLOPs and bytes off the
HLO instead (`flops.matmul_costs`, `traffic.program_bytes`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flaxlm.models.batch_shapes import batch_shapes_from
from flaxlm.parallel import platforms, pytrees
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.plan import flops, traffic
from flaxlm.training import lora as lora_lib
from flaxlm.training import objective as objective_lib
from flaxlm.training import optimizers, steps

LIBTPU_HINT = (
    "compiling for a TPU topology needs libtpu, the TPU compiler: pip install 'flaxlm[tpu]' "
    "(jax[tpu] of the pinned jax), or point TPU_LIBRARY_PATH at a libtpu.so"
)


class MissingCompilerError(ValueError):
    """The compiler for the named target is not installed (what to install is said)."""


CUDA_HINT = (
    "compiling for an NVIDIA GPU needs XLA:GPU, JAX's CUDA plugin: pip install "
    "'flaxlm[gpu-compile]' (jax-cuda12-plugin and jax-cuda12-pjrt of the pinned jax; no CUDA "
    "libraries or driver needed to compile)"
)


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """What XLA:GPU needs to know of a GPU to compile for it without one attached (its
    `GpuTargetConfigProto`): NVIDIA's published figures for the SXM parts (the H100
    architecture whitepaper: 132 SMs, 228 KB of shared memory per SM of which 227 KB to one
    block, 64K registers per SM, 50 MB of L2, a 1.98 GHz boost clock; bandwidth and memory
    size as `chips.CHIPS`). XLA uses them for its fusion and tiling choices and its cost
    model; the cuDNN version says which fused attention it may call."""

    name: str  # the device name a real one reports
    chip: str  # its `chips.CHIPS` entry
    sm_major: int = 9
    sm_minor: int = 0
    sm_count: int = 132
    shared_memory_per_sm: int = 228 * 1024
    shared_memory_per_block_optin: int = 227 * 1024
    l2_bytes: int = 50 * 1024 * 1024
    clock_ghz: float = 1.98
    cudnn: tuple[int, int, int] = (9, 8, 0)

    def config_text(self) -> str:
        from flaxlm.plan import chips

        chip = chips.CHIPS[self.chip]
        major, minor, patch = self.cudnn
        info = {
            "threads_per_block_limit": 1024,
            "threads_per_warp": 32,
            "shared_memory_per_block": 48 * 1024,
            "shared_memory_per_core": self.shared_memory_per_sm,
            "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
            "threads_per_core_limit": 2048,
            "core_count": self.sm_count,
            "fpus_per_core": 128,
            "block_dim_limit_x": 2**31 - 1,
            "block_dim_limit_y": 65535,
            "block_dim_limit_z": 65535,
            "memory_bandwidth": int(chip.memory_bytes_per_s),
            "l2_cache_size": self.l2_bytes,
            "clock_rate_ghz": self.clock_ghz,
            "device_memory_size": int(chip.memory_bytes),
            "registers_per_core_limit": 65536,
            "registers_per_block_limit": 65536,
        }
        fields = "".join(f"  {k}: {v}\n" for k, v in info.items())
        return (
            f"gpu_device_info {{\n{fields}"
            f"  cuda_compute_capability {{ major: {self.sm_major} minor: {self.sm_minor} }}\n}}\n"
            f'platform_name: "CUDA"\n'
            f"dnn_version_info {{ major: {major} minor: {minor} patch: {patch} }}\n"
            f'device_description_str: "{self.name}"\n'
        )


GPU_TARGETS: dict[str, GpuTarget] = {
    "h100": GpuTarget("NVIDIA H100 80GB HBM3", "h100"),
    "h200": GpuTarget("NVIDIA H200", "h200"),
}


def gpu_devices(name: str, count: int = 1, hosts: int = 1) -> list[Any]:
    """Compile-only devices of `hosts` hosts of `count` GPUs each, of a `GPU_TARGETS` kind
    (device i on host i // count, its `process_index`): XLA:GPU compiles for them here with
    no GPU, driver or CUDA library (the kernels are generated, not run; autotuning, which
    needs the device, is left out: XLA's defaults stand in). The collectives between hosts
    are NCCL's as on the cluster; which links they cross is for the caller to price."""
    from jax.experimental import topologies

    if name not in GPU_TARGETS:
        raise ValueError(f"GPU {name!r}: expected one of {sorted(GPU_TARGETS)}.")
    try:
        topology = topologies.get_topology_desc(
            platform="cuda",
            topology=f"1x{hosts}x{count}",
            target_config=GPU_TARGETS[name].config_text(),
        )
    except (KeyError, NotImplementedError) as e:  # no CUDA plugin: no topology factory
        if importlib.util.find_spec("jax_plugins.xla_cuda12") is not None:
            # the plugin is there, but started as a backend on a host without a GPU it fails
            raise MissingCompilerError(
                f"{name}:{hosts}x{count}: JAX's CUDA plugin could not start here; compile "
                "with JAX_PLATFORMS=cpu (python -m flaxlm.plan sets it)."
            ) from e
        raise MissingCompilerError(f"{name}:{hosts}x{count}: {CUDA_HINT}.") from e
    return list(topology.devices)


def topology_devices(name: str) -> list[Any]:
    """Compile-only devices of a TPU slice named as `v5e:2x4` or `v4:2x2x2`.

    The TPU compiler (libtpu) compiles for them on this host with no TPU attached, so the
    compiled HLO and memory analysis are the TPU's. Other processes holding libtpu's lockfile
    on this host do not stop it.
    """
    from jax.experimental import topologies

    platforms.prepare_tpu_compile_only()
    try:
        return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
    except RuntimeError as e:
        if "TPU support not installed" in str(e):
            raise MissingCompilerError(f"topology {name}: {LIBTPU_HINT}.") from e
        raise ValueError(
            f"topology {name}: libtpu does not know this topology ({e}); "
            "name one as <generation>:<chips per dimension>, e.g. v5e:2x4 or v4:2x2x2."
        ) from e


def target_devices(topology: str) -> list[Any]:
    """The devices `topology` names (`platforms.TOPOLOGY_HELP`); a ValueError names a bad one."""
    if topology == "this":
        return list(jax.devices())
    m = re.fullmatch(r"cpu:(\d+)", topology)
    if m:
        n = int(m.group(1))
        have = jax.devices("cpu")
        if n < 1 or len(have) < n:
            raise ValueError(
                f"topology {topology}: this process has {len(have)} CPU devices; start it "
                f"with XLA_FLAGS=--xla_force_host_platform_device_count={max(n, 1)} (python -m "
                "flaxlm.plan does this itself for --topology=cpu:N)."
            )
        return list(have[:n])
    m = platforms.GPU_TOPOLOGY_RE.fullmatch(topology)
    if m:
        hosts, per_host = (int(m.group(2)), int(m.group(3))) if m.group(3) else (1, int(m.group(2)))
        return gpu_devices(m.group(1), per_host, hosts)
    if not platforms.TPU_TOPOLOGY_RE.fullmatch(topology):
        raise ValueError(f"--topology={topology!r}: expected {platforms.TOPOLOGY_HELP}.")
    return topology_devices(topology)


def feature_lengths(model: Any, seq_len: int) -> dict[str, int]:
    """Model-feature lengths for `seq_len`-long task features."""
    return {k: v[1] for k, v in model.example_batch_shapes(seq_len, 1).items()}


class CompiledStep:
    """flaxlm's partitioned train step, lowered and compiled on abstract inputs.

    `lengths`: the model features' lengths (`feature_lengths`). `optimizer`: the run's optax
    transformation (flaxlm's default AdamW if None). With a `preference.PreferenceConfig`
    objective the batch is `batch_size` pairs (`[pairs, 2, length]`, unpacked); with `lora`
    the state holds the adapters. The frozen params (a LoRA base, a reference copy) are
    `abstract_frozen`. `out_of_memory_ok`: a compile that runs out of device memory leaves
    `compiled` None and the compiler's message in `out_of_memory` instead of raising.
    `state_limit`: where one device's share of the training state (params, optimizer state,
    frozen params: `state_bytes`) alone exceeds these bytes, nothing is lowered or compiled
    (`lowered` and `compiled` None) and `out_of_memory` says so.
    """

    def __init__(
        self,
        model: Any,
        partitioner: Partitioner,
        batch_size: int,
        lengths: Mapping[str, int],
        *,
        optimizer: optax.GradientTransformation | None = None,
        learning_rate: optax.ScalarOrSchedule = 1e-3,
        num_microbatches: int = 1,
        lora: lora_lib.LoraConfig | None = None,
        objective: objective_lib.Objective | None = None,
        matmul_precision: str | None = None,
        out_of_memory_ok: bool = False,
        state_limit: float | None = None,
    ) -> None:
        self.out_of_memory: str | None = None
        self._hlo_text: str | None = None
        pairs = getattr(objective, "rows_per_example", 1) == 2
        if pairs:
            drop = ("decoder_segment_ids", "decoder_positions")
            lengths = {k: n for k, n in lengths.items() if k not in drop}
        if optimizer is None:
            optimizer = optimizers.create_optimizer(learning_rate=learning_rate)
        reference = objective is not None and objective.needs_reference
        self.setup = setup = steps.Setup(
            model, partitioner, optimizer, lengths, lora=lora, frozen_reference=reference
        )
        step = setup.partition_train_step(
            steps.make_train_step(
                model,
                partitioner,
                learning_rate,
                num_microbatches=num_microbatches,
                lora=lora,
                objective=objective,
            )
        )
        rows = (batch_size, 2) if pairs else (batch_size,)
        sharding = partitioner.batch_sharding(len(rows) + 1)
        self.abstract_batch = {
            k: jax.ShapeDtypeStruct((*rows, n), jnp.int32, sharding=sharding)
            for k, n in lengths.items()
        }
        self.abstract_frozen = None
        if lora is not None:
            shapes = batch_shapes_from(lengths, 1)
            base = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0), shapes))
            self.abstract_frozen = pytrees.with_shardings(base, setup.base_shardings)
        elif reference:
            self.abstract_frozen = setup.abstract_state.params
        frozen = () if self.abstract_frozen is None else (self.abstract_frozen,)
        self.state_bytes = per_device_bytes((setup.abstract_state, *frozen))
        self.lowered = self.compiled = None
        self.lower_seconds = self.compile_seconds = 0.0
        if state_limit is not None and self.state_bytes > state_limit:
            self.out_of_memory = (
                f"the training state alone needs {self.state_bytes / 2**30:.2f} GiB of "
                f"{state_limit / 2**30:.2f} per device (not compiled)"
            )
            return
        with jax.default_matmul_precision(matmul_precision):
            start = time.perf_counter()
            self.lowered = step.lower(setup.abstract_state, self.abstract_batch, *frozen)
            self.lower_seconds = time.perf_counter() - start
            start = time.perf_counter()
            try:
                self.compiled = self.lowered.compile()
            except jax.errors.JaxRuntimeError as e:
                # A TPU compile fails when the step's buffers exceed the chip's HBM.
                if not (out_of_memory_ok and "RESOURCE_EXHAUSTED" in str(e)):
                    raise
                self.compiled = None
                self.out_of_memory = str(e).split("\n")[0]
            self.compile_seconds = time.perf_counter() - start

    def device_bytes(self) -> int | None:
        """Bytes one device holds while the step runs (None when it did not compile).

        For a TPU, libtpu's own peak (`peak_memory_in_bytes`): the most its heap holds at
        once, the figure it checks against the chip's HBM (a step whose sum below exceeds
        the HBM compiles when its peak does not: temporaries and arguments are not all live
        at once). Elsewhere the sum of its arguments, outputs not aliased to them and
        temporaries: XLA:CPU reports only the arguments as its peak, and XLA:GPU's peak is
        that sum."""
        if self.compiled is None:
            return None
        mem = self.compiled.memory_analysis()
        if self.platform == "tpu":
            return int(mem.peak_memory_in_bytes)
        return int(
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
        )

    @property
    def platform(self) -> str:
        """The platform compiled for ('tpu', 'gpu', 'cpu')."""
        return self.setup.partitioner.mesh.devices.flat[0].platform

    def hlo_text(self) -> str:
        """The compiled program's HLO text, made once (megabytes for a large model; the
        planner reads it for collectives and for library calls)."""
        if self._hlo_text is None:
            self._hlo_text = self.compiled.as_text()
        return self._hlo_text

    def cost(self) -> dict[str, float]:
        """One device's program's `flops` and `bytes accessed`: XLA's cost analysis (a
        loop's body counted once), the cuBLAS and cuDNN calls of an NVIDIA GPU's program
        added where XLA left them out (`flops.with_library_calls`), and what the later trips
        of the loops inside a layer add (`flops.loop_runs`: the microbatches' and scanned
        layers' loops still count once, the planner calibrates them). Where the analysis is
        empty (XLA:GPU's compile-only programs), both are read off the HLO: the matrix
        products' FLOPs (`flops.matmul_costs`; elementwise work, a few percent of a train
        step's, left out) and the kernels' bytes (`traffic.program_bytes`)."""
        analysis = self.compiled.cost_analysis()
        if isinstance(analysis, Sequence):
            analysis = analysis[0] if analysis else None
        text = self.hlo_text()
        inner = flops.matmul_costs(text)
        products = inner["dot_flops"] + inner["custom_flops"]
        if not analysis:
            return {"flops": products, "bytes accessed": float(traffic.program_bytes(text))}
        cost = {k: float(analysis.get(k, 0.0)) for k in ("flops", "bytes accessed")}
        once = flops.matmul_costs(text, inner_loops=False)
        if 'custom_call_target="__cu' in text:
            cost = flops.with_library_calls(cost, once)
        cost["flops"] += products - once["dot_flops"] - once["custom_flops"]
        if " while(" in text:
            inner_bytes = traffic.program_bytes(text)
            cost["bytes accessed"] += inner_bytes - traffic.program_bytes(text, inner_loops=False)
        return cost


def per_device_bytes(abstract_tree: Any) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest
    shard, i.e. device 0's for even splits)."""
    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def total_bytes(abstract_tree: Any) -> int:
    """Bytes of a tree of ShapeDtypeStructs, unsharded."""
    return sum(
        int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        for leaf in jax.tree.leaves(abstract_tree)
    )
