"""The Partitioner: a device mesh per platform, logical axis rules, and partitioned jit.

Model code names its dimensions with logical axes (`batch`, `embed`, `mlp`, ...). The
Partitioner owns the mapping from those names to mesh axes `('data', 'fsdp', 'tensor')` (and
`'sequence'` for context parallelism, `'expert'` for expert parallelism), the mesh itself,
and this host's share of the global batch. It knows no model.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import gin
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]
MESH_AXES = ("data", "fsdp", "tensor")
SEQUENCE_AXIS = "sequence"  # context parallelism: `length` split over this mesh axis
EXPERT_AXIS = "expert"  # expert parallelism: the experts (and the batch) split over this axis


def standard_logical_axis_rules(
    mesh_axis_names: Sequence[str] = MESH_AXES, experts_over_fsdp: bool = False
) -> tuple[tuple[str, Any], ...]:
    """The rules of DESIGN.md: batch over (data, fsdp), embed over fsdp, widths over tensor.

    Rules are matched in order and a mesh axis is used at most once per array, so an
    activation `[batch, length, embed]` shards only its batch (fsdp is taken by `batch`),
    while a kernel `[embed, mlp]` is split over both fsdp and tensor. A logical name with
    several rules takes the first whose mesh axes are all still free.

    With a `sequence` axis among `mesh_axis_names` (context parallelism), `length` is split
    over it, and so is `embed` next to fsdp: the params are not copied on every device of a
    sequence-split replica (as MaxText shards them over its `sequence`/`context` axes).

    With an `expert` axis (expert parallelism), the experts' weights are split over it by
    their logical axis `expert` (replicated without one), and outside the MoE layers it
    splits the batch (as MaxText and torchtitan do) and `embed` next to fsdp, so the other
    params stay sharded over every device as under fsdp; an expert's own `embed` dim, whose
    `expert` axis is taken, falls back to fsdp. With `experts_over_fsdp` the experts are
    split over (expert, fsdp) instead and their `embed` dim whole: a device's experts are
    then gathered over fsdp on their major dim, where XLA:GPU transposes gathers and
    reduce-scatters on `embed` (benchmarks/HISTORY.md, "Experts split over fsdp"); the
    number of experts must divide by expert x fsdp.
    """
    names = tuple(mesh_axis_names)
    sequence = SEQUENCE_AXIS in names
    expert = EXPERT_AXIS in names
    fsdp = ("fsdp", SEQUENCE_AXIS) if sequence else ("fsdp",)
    embed = fsdp if sequence else "fsdp"
    embed_with_expert = (("embed", (*fsdp, EXPERT_AXIS)),) if expert else ()
    return (
        ("batch", ("data", "fsdp", EXPERT_AXIS) if expert else ("data", "fsdp")),
        (
            "expert",
            ((EXPERT_AXIS, *fsdp) if experts_over_fsdp else EXPERT_AXIS) if expert else None,
        ),
        ("vocab", "tensor"),
        ("mlp", "tensor"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        *embed_with_expert,
        ("embed", embed),
        ("length", SEQUENCE_AXIS if sequence else None),
        ("head_dim", None),
        ("kv", None),
        ("layers", None),
    )


def resolve_mesh_shape(mesh_shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Replaces a single -1 with the remaining devices; errors name the shape and the count."""
    shape = tuple(int(s) for s in mesh_shape)
    if sum(s == -1 for s in shape) > 1:
        raise ValueError(f"mesh_shape {shape} may contain at most one -1.")
    if any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh_shape {shape} must hold positive sizes (and at most one -1).")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(
                f"mesh_shape {shape} does not divide the {num_devices} devices: "
                f"{num_devices} is not a multiple of {known}."
            )
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ValueError(
            f"mesh_shape {tuple(mesh_shape)} needs {math.prod(shape)} devices, "
            f"but there are {num_devices} devices."
        )
    return shape


def _granules(devices: Sequence[Any]) -> tuple[str, int]:
    """The slower network's unit: TPU slices when there are several, else processes."""
    slices = {getattr(d, "slice_index", 0) for d in devices}
    if len(slices) > 1:
        return "slice_index", len(slices)
    return "process_index", len({d.process_index for d in devices})


def split_dcn_shape(mesh_shape: Sequence[int], num_granules: int) -> tuple[int, ...]:
    """How many granules (hosts or slices) each mesh axis spans.

    Granules are spread over the leading axes first (`data`, then `fsdp`); `tensor`, the
    last axis, crosses granules only when nothing else can take them.
    """
    remaining = num_granules
    dcn = []
    for size in mesh_shape:
        g = math.gcd(remaining, size)
        dcn.append(g)
        remaining //= g
    if remaining != 1:
        raise ValueError(
            f"mesh_shape {tuple(mesh_shape)} cannot be split over {num_granules} hosts/slices."
        )
    return tuple(dcn)


def build_device_mesh(
    mesh_shape: Sequence[int],
    devices: Sequence[Any],
    dcn_mesh_shape: Sequence[int] | None = None,
) -> np.ndarray:
    """An array of devices shaped `mesh_shape` that follows the platform's topology.

    Each host's devices stay one block of the mesh (in row-major order) whenever the shape
    allows, so that each host feeds one contiguous range of the batch (`data_layout`).
    """
    platform = devices[0].platform
    if platform == "cpu":
        return np.asarray(devices, dtype=object).reshape(mesh_shape)

    def hosts_in_blocks(mesh: np.ndarray) -> bool:
        hosts = [d.process_index for d in mesh.flat]
        runs = [h for i, h in enumerate(hosts) if i == 0 or h != hosts[i - 1]]
        return len(runs) == len(set(runs))

    def hybrid(dcn: Sequence[int], attr: str) -> np.ndarray:
        dcn = tuple(dcn)
        if len(dcn) != len(mesh_shape) or any(m % d for m, d in zip(mesh_shape, dcn, strict=True)):
            raise ValueError(
                f"dcn_mesh_shape {dcn} must divide mesh_shape {tuple(mesh_shape)} axis by axis."
            )
        ici_shape = tuple(m // d for m, d in zip(mesh_shape, dcn, strict=True))
        return mesh_utils.create_hybrid_device_mesh(
            ici_shape,
            dcn,
            devices,
            process_is_granule=attr == "process_index",
            allow_split_physical_axes=True,
        )

    attr, num_granules = _granules(devices)
    if dcn_mesh_shape is not None:
        return hybrid(dcn_mesh_shape, attr)
    num_hosts = len({d.process_index for d in devices})
    if num_granules == 1 or (platform == "tpu" and attr == "process_index"):
        # One TPU slice is one torus even across hosts: follow its coordinates (splitting a
        # physical axis if the shape needs it), unless that interleaves the hosts.
        mesh = mesh_utils.create_device_mesh(mesh_shape, devices, allow_split_physical_axes=True)
        if hosts_in_blocks(mesh):
            return mesh
        return hybrid(split_dcn_shape(mesh_shape, num_hosts), "process_index")
    mesh = hybrid(split_dcn_shape(mesh_shape, num_granules), attr)
    if attr == "slice_index" and not hosts_in_blocks(mesh):
        # Slices of several hosts each: hosts as the granules keep both blocks.
        return hybrid(split_dcn_shape(mesh_shape, num_hosts), "process_index")
    return mesh


@dataclasses.dataclass(frozen=True)
class DataLayout:
    """This host's share of the global batch: rows `[row_start, row_start + per_host_batch_size)`.

    The global batch is split into `data_parallel_degree` equal row blocks, one per distinct
    slice of the batch over the mesh's batch axes; a host's rows are a whole number of blocks.
    Hosts whose devices hold the same rows (a model replica spanning hosts) get the same
    `shard_index` (of `num_shards` distinct host spans), and so read identical examples.
    """

    global_batch_size: int
    per_host_batch_size: int
    shard_index: int
    num_shards: int
    row_start: int = 0
    data_parallel_degree: int = 1

    @property
    def row_stop(self) -> int:
        return self.row_start + self.per_host_batch_size


def _is_spec(x: Any) -> bool:
    return isinstance(x, P) or x is None


@gin.configurable
class Partitioner:
    """Builds the mesh and maps logical axis names onto it."""

    def __init__(
        self,
        mesh_shape: Sequence[int] = (1, -1, 1),
        mesh_axis_names: Sequence[str] = MESH_AXES,
        logical_axis_rules: LogicalRules | None = None,
        optimizer_sharding: str = "params",
        dcn_mesh_shape: Sequence[int] | None = None,
        devices: Sequence[Any] | None = None,
        experts_over_fsdp: bool = False,
    ):
        """
        Args:
          mesh_shape: size of each mesh axis; one -1 takes the remaining devices.
          mesh_axis_names: names of the mesh axes, outermost (slowest network) first;
            `('data', 'fsdp', 'sequence', 'tensor')` adds context parallelism (activations
            split on their length, attention by `models.context_parallel`);
            `('data', 'fsdp', 'expert', 'tensor')` expert parallelism (the experts split,
            tokens dispatched by `models.moe`).
          logical_axis_rules: (logical name, mesh axes) pairs; the standard rules if None.
          optimizer_sharding: "params" (optimizer state sharded like the params) or
            "zero1" (optimizer state also split over `data` while params are replicated).
          dcn_mesh_shape: how many hosts/slices each axis spans; derived if None.
          devices: the devices to use; all of `jax.devices()` if None.
          experts_over_fsdp: under the standard rules with an `expert` axis, split the
            experts over (expert, fsdp) rather than their `embed` dim over fsdp
            (`standard_logical_axis_rules`); an error without an `expert` axis.
        """
        if optimizer_sharding not in ("params", "zero1"):
            raise ValueError(
                f"optimizer_sharding={optimizer_sharding!r}: expected 'params' or 'zero1'."
            )
        if len(mesh_shape) != len(mesh_axis_names):
            raise ValueError(
                f"mesh_shape {tuple(mesh_shape)} has {len(mesh_shape)} axes but "
                f"mesh_axis_names {tuple(mesh_axis_names)} has {len(mesh_axis_names)}."
            )
        devices = list(jax.devices() if devices is None else devices)
        self.mesh_shape = resolve_mesh_shape(mesh_shape, len(devices))
        self.mesh_axis_names = tuple(mesh_axis_names)
        if experts_over_fsdp and (EXPERT_AXIS not in self.mesh_axis_names or logical_axis_rules):
            raise ValueError(
                "experts_over_fsdp=True changes the standard rules of a mesh with an 'expert' "
                f"axis; mesh_axis_names {self.mesh_axis_names} with "
                f"{'its own' if logical_axis_rules else 'the standard'} logical_axis_rules: "
                "add an 'expert' axis (gin/partitioning/fsdp_ep.gin) or drop the setting."
            )
        self.logical_axis_rules = tuple(
            standard_logical_axis_rules(self.mesh_axis_names, experts_over_fsdp)
            if logical_axis_rules is None
            else logical_axis_rules
        )
        self.optimizer_sharding = optimizer_sharding
        device_array = build_device_mesh(self.mesh_shape, devices, dcn_mesh_shape)
        self.mesh = Mesh(device_array, self.mesh_axis_names)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.mesh_axis_names, self.mesh_shape))
        return f"Partitioner({axes}, optimizer_sharding={self.optimizer_sharding!r})"

    # ------------------------------------------------------------------ logical -> mesh

    def mesh_axes(self, logical_axes: P | Sequence[str | None] | None) -> P:
        """The mesh PartitionSpec for one array's logical axes."""
        if logical_axes is None:
            return P()
        known = {name for name, _ in self.logical_axis_rules}
        unknown = [a for a in logical_axes if a is not None and a not in known]
        if unknown:
            raise ValueError(
                f"Logical axes {unknown} (of {tuple(logical_axes)}) have no rule in "
                "Partitioner.logical_axis_rules; add one, e.g. (name, None) to replicate."
            )
        return nn.logical_to_mesh_axes(tuple(logical_axes), self.logical_axis_rules)

    def sharding(self, logical_axes_tree: Any) -> Any:
        """Tree of PartitionSpecs of logical names -> tree of NamedShardings."""
        return jax.tree.map(
            lambda a: NamedSharding(self.mesh, self.mesh_axes(a)),
            logical_axes_tree,
            is_leaf=_is_spec,
        )

    def opt_state_sharding(self, logical_axes_tree: Any, shapes_tree: Any) -> Any:
        """Shardings for optimizer state: like `sharding`, plus `data` under ZeRO-1.

        Under ZeRO-1 each array's first dimension that is not yet split and that the `data`
        degree divides is split over `data`; params keep their own (replicated) sharding.
        """
        if self.optimizer_sharding != "zero1":
            return self.sharding(logical_axes_tree)
        sizes = dict(zip(self.mesh_axis_names, self.mesh_shape))
        data_size = sizes["data"]

        def one(axes: P | None, shape: Any) -> NamedSharding:
            spec = list(self.mesh_axes(axes))
            dims = tuple(shape.shape)
            spec += [None] * (len(dims) - len(spec))
            used = {a for s in spec if s for a in ((s,) if isinstance(s, str) else s)}
            if data_size > 1 and "data" not in used:
                for i, (s, d) in enumerate(zip(spec, dims)):
                    names = () if s is None else (s,) if isinstance(s, str) else tuple(s)
                    # A dim not split yet (its mesh axes, if any, all have size 1).
                    if math.prod(sizes[a] for a in names) == 1 and d % data_size == 0:
                        spec[i] = (*names, "data") if names else "data"
                        break
            return NamedSharding(self.mesh, P(*spec))

        return jax.tree.map(one, logical_axes_tree, shapes_tree, is_leaf=_is_spec)

    def constrain(self, x: Any, logical_axes: Any) -> Any:
        """with_sharding_constraint by logical names (inside a partitioned function)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(logical_axes))

    def replicated(self) -> NamedSharding:
        """Every device holds the whole array."""
        return NamedSharding(self.mesh, P())

    def global_array(self, x: np.ndarray) -> jax.Array:
        """The same host array on every process -> one global array, its rows split over the
        batch axes when they divide them (replicated otherwise). The one place that puts
        host data other than training batches on the mesh (those: `data.DataIterator`)."""
        split = x.shape[0] % self.data_parallel_degree() == 0
        axes = ("batch" if split else None,) + (None,) * (x.ndim - 1)
        sharding = NamedSharding(self.mesh, self.mesh_axes(axes))
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    # ------------------------------------------------------------------ data

    def data_layout(self, global_batch_size: int, process_index: int | None = None) -> DataLayout:
        """Which rows of the global batch a host feeds (this host's unless `process_index`)."""
        batch_axes = self.batch_mesh_axes()
        data_degree = self.data_parallel_degree()
        if global_batch_size % data_degree:
            raise ValueError(
                f"Batch size {global_batch_size} is not divisible by the data-parallel degree "
                f"{data_degree} (mesh axes {batch_axes} of mesh {self.mesh_shape})."
            )
        sharding = NamedSharding(self.mesh, P(batch_axes or None))
        index_map = sharding.devices_indices_map((global_batch_size,))
        rows_by_process: dict[int, set[tuple[int, int]]] = collections.defaultdict(set)
        for device, (rows,) in index_map.items():
            start, stop, _ = rows.indices(global_batch_size)
            rows_by_process[device.process_index].add((start, stop))
        spans = {}
        for process, rows in rows_by_process.items():
            starts, stops = zip(*sorted(rows))
            if any(a != b for a, b in zip(stops[:-1], starts[1:])):
                raise ValueError(
                    f"Process {process} holds non-contiguous rows {sorted(rows)} of the batch; "
                    "choose a mesh whose data axes follow the process order."
                )
            spans[process] = (starts[0], stops[-1])
        distinct = sorted(set(spans.values()))
        process = jax.process_index() if process_index is None else process_index
        if process not in spans:
            raise ValueError(f"Process {process} holds no device of mesh {self.mesh_shape}.")
        my_span = spans[process]
        return DataLayout(
            global_batch_size=global_batch_size,
            per_host_batch_size=my_span[1] - my_span[0],
            shard_index=distinct.index(my_span),
            num_shards=len(distinct),
            row_start=my_span[0],
            data_parallel_degree=data_degree,
        )

    def batch_mesh_axes(self) -> tuple[str, ...]:
        """The mesh axes that split the `batch` logical axis."""
        spec = self.mesh_axes(("batch",))
        axes = spec[0] if len(spec) else None
        if axes is None:
            return ()
        return (axes,) if isinstance(axes, str) else tuple(axes)

    def data_parallel_degree(self) -> int:
        """Into how many parts the global batch is split."""
        sizes = dict(zip(self.mesh_axis_names, self.mesh_shape))
        return math.prod(sizes[a] for a in self.batch_mesh_axes())

    def batch_sharding(self, ndim: int = 2) -> NamedSharding:
        """Sharding of a `[batch, length, ...]` input array."""
        return NamedSharding(self.mesh, self.mesh_axes(("batch",) + (None,) * (ndim - 1)))

    # ------------------------------------------------------------------ compute

    def partition(
        self,
        fn: Callable[..., Any],
        in_axes: Any,
        out_axes: Any,
        donate_argnums: Sequence[int] = (),
    ) -> Callable[..., Any]:
        """`jax.jit` of `fn` with shardings given as logical axes, traced under the rules.

        `in_axes`/`out_axes` may hold PartitionSpecs of logical names or ready shardings.
        """

        def to_sharding(tree: Any) -> Any:
            return jax.tree.map(
                lambda a: (
                    a
                    if isinstance(a, NamedSharding)
                    else NamedSharding(self.mesh, self.mesh_axes(a))
                ),
                tree,
                is_leaf=lambda x: _is_spec(x) or isinstance(x, NamedSharding),
            )

        jitted = jax.jit(
            fn,
            in_shardings=to_sharding(in_axes),
            out_shardings=to_sharding(out_axes),
            donate_argnums=tuple(donate_argnums),
        )
        return PartitionedFunction(jitted, self)

    def context(self) -> Any:
        """The mesh and logical rules in force while tracing model code."""
        return _Context(self)


class _Context:
    def __init__(self, partitioner: Partitioner):
        self._partitioner = partitioner
        self._stack: list[Any] = []

    def __enter__(self) -> _Context:
        for cm in (
            jax.set_mesh(self._partitioner.mesh),
            nn.logical_axis_rules(self._partitioner.logical_axis_rules),
        ):
            cm.__enter__()
            self._stack.append(cm)
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._stack:
            self._stack.pop().__exit__(*exc)


class PartitionedFunction:
    """A jitted function that traces and runs under its Partitioner's mesh and rules."""

    def __init__(self, jitted: Any, partitioner: Partitioner):
        self._jitted = jitted
        self._partitioner = partitioner

    def __call__(self, *args: Any) -> Any:
        with self._partitioner.context():
            return self._jitted(*args)

    def lower(self, *args: Any) -> Any:
        with self._partitioner.context():
            return self._jitted.lower(*args)
