"""What the planner plans and what it finds: the training run the Gin files describe (`Run`,
read from `train.train`'s bindings), one candidate configuration (`Knobs`) and its verdict
(`Result`)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import gin

from flaxlm.data.input_process import load_pipeline
from flaxlm.models import batch_shapes, expert_parallel, moe


@dataclasses.dataclass(frozen=True)
class Knobs:
    """One candidate configuration."""

    mesh_shape: tuple[int, ...]
    optimizer_sharding: str
    remat_policy: str
    num_microbatches: int
    scan_layers: bool
    # How a model with experts sends tokens to their experts' devices (MoEOptions.moe_dispatch:
    # expert_parallel.DISPATCHES); None for a model without experts.
    moe_dispatch: str | None = None
    # The experts split over (expert, fsdp) rather than their embed dim over fsdp
    # (Partitioner.experts_over_fsdp).
    experts_over_fsdp: bool = False


@dataclasses.dataclass
class Result:
    """One candidate's verdict: what its compile says of memory, FLOPs and bytes, and the
    roofline's prediction (`Planner.evaluate`); `measured_s` when `--measure` ran it."""

    knobs: Knobs
    status: str  # fits | does not fit | rejected | failed
    reason: str = ""
    device_bytes: int | None = None
    state_bytes: int | None = None  # of device_bytes, the training state's (params, optimizer)
    flops: float | None = None
    bytes_accessed: float | None = None
    collective_bytes: float = 0.0
    collective_ops: int = 0
    host_collective_bytes: float = 0.0  # of collective_bytes, over a GPU cluster's network
    # A model with experts: bytes and ops by kind of the collectives inside its MoE layers'
    # shard_map (the dispatch; hlo.shard_map_collectives), or None.
    moe_collectives: dict[str, dict[str, float]] | None = None
    predicted_s: float | None = None
    mfu: float | None = None
    compile_s: float = 0.0
    measured_s: float | None = None
    at_least: bool = False  # device_bytes is the state's alone (not compiled): a lower bound
    step: Any = dataclasses.field(default=None, repr=False)  # aot.CompiledStep


@dataclasses.dataclass
class Run:
    """The training run to plan, read from Gin's `train.train` bindings."""

    model: Any
    batch_size: int
    lengths: dict[str, int]
    num_microbatches: int
    optimizer: Any
    learning_rate: Any
    lora: Any
    objective: Any
    axis_names: tuple[str, ...]
    base: Knobs
    partitioner_kwargs: dict[str, Any]


def plain_run(
    model: Any, batch_size: int, lengths: dict[str, int], axis_names: tuple[str, ...], base: Knobs
) -> Run:
    """A run of `model` with no Gin behind it: one microbatch, the default optimizer, no LoRA
    or objective (what the benchmarks price one step of)."""
    return Run(
        model=model,
        batch_size=batch_size,
        lengths=lengths,
        num_microbatches=1,
        optimizer=None,
        learning_rate=1e-3,
        lora=None,
        objective=None,
        axis_names=axis_names,
        base=base,
        partitioner_kwargs={},
    )


def _resolve(value: Any) -> Any:
    if isinstance(value, gin.config.ConfigurableReference):
        fn = value.scoped_configurable_fn
        return fn() if value.evaluate else fn
    return value


def run_from_gin() -> Run:
    """The run the parsed Gin files describe (its `train.train` bindings)."""
    b = gin.get_bindings("train.train", resolve_references=False)
    missing = [k for k in ("model", "train_dataset_cfg") if k not in b]
    if missing:
        raise ValueError(f"no train.train.{missing[0]} bound: give the Gin file of a training run.")
    model = _resolve(b["model"])
    cfg = _resolve(b["train_dataset_cfg"])
    learning_rate = _resolve(b.get("learning_rate", 1e-3))
    factory = _resolve(b.get("optimizer_factory"))
    optimizer = factory(learning_rate=learning_rate) if factory else None
    mb = int(_resolve(b.get("num_microbatches", 1)))
    model.check_lengths(cfg.task_feature_lengths)
    converter = batch_shapes.converter_reference(model) or model.FEATURE_CONVERTER_CLS
    lengths = batch_shapes.model_feature_lengths(converter, cfg.task_feature_lengths, cfg.pack)
    if lengths is None:  # (only the converter knows: seqio's, loaded as a run loads it)
        load_pipeline()
        converter = cfg.feature_converter or model.FEATURE_CONVERTER_CLS
        lengths = batch_shapes.model_feature_lengths(converter, cfg.task_feature_lengths, cfg.pack)
    p = gin.get_bindings("partitioning.Partitioner")
    axis_names = tuple(p.get("mesh_axis_names", ("data", "fsdp", "tensor")))
    mesh_shape = tuple(p.get("mesh_shape", (1, -1, 1)))
    if moe.has_experts(model.config) and "logical_axis_rules" not in p:
        axis_names, mesh_shape = with_expert_axis(axis_names, mesh_shape)
    base = Knobs(
        mesh_shape,
        p.get("optimizer_sharding", "params"),
        getattr(model.config, "remat_policy", "none"),
        mb,
        bool(getattr(model.config, "scan_layers", False)),
        model.config.moe_dispatch if moe.has_experts(model.config) else None,
        bool(p.get("experts_over_fsdp", False)),
    )
    kwargs = {k: p[k] for k in ("logical_axis_rules", "dcn_mesh_shape") if k in p}
    return Run(
        model=model,
        batch_size=cfg.batch_size,
        lengths=lengths,
        num_microbatches=mb,
        optimizer=optimizer,
        learning_rate=learning_rate,
        lora=_resolve(b.get("lora")),
        objective=_resolve(b.get("objective")),
        axis_names=axis_names,
        base=base,
        partitioner_kwargs=kwargs,
    )


def with_expert_axis(
    axis_names: tuple[str, ...], mesh_shape: tuple[int, ...]
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The mesh with an `expert` axis of size 1 before `tensor` (or last) if it has none, so
    the planner enumerates expert parallelism for a model with experts (the standard rules
    split the experts, the batch and the params over it, as gin/partitioning/fsdp_ep.gin)."""
    if expert_parallel.EXPERT_AXIS in axis_names:
        return axis_names, mesh_shape
    at = axis_names.index("tensor") if "tensor" in axis_names else len(axis_names)
    return (
        (*axis_names[:at], expert_parallel.EXPERT_AXIS, *axis_names[at:]),
        (*mesh_shape[:at], 1, *mesh_shape[at:]),
    )


def with_config(model: Any, **changes: Any) -> Any:
    """A copy of `model` whose config has `changes` (the module rebuilt from it)."""
    new = copy.copy(model)
    new.config = dataclasses.replace(model.config, **changes)
    new.module = new.config.make_module()
    return new


def pairs(run: Run) -> bool:
    """Whether each example is two rows (a preference objective's chosen and rejected)."""
    return getattr(run.objective, "rows_per_example", 1) == 2
