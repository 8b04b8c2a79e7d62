"""The parallelism planner: which mesh, optimizer sharding, remat policy, microbatching and
layer scan to train with, found by compiling the run ahead of time for the target.

    python -m flaxlm.plan --gin_file=gin/gptj_pretrain.gin --topology=cpu:8
    python -m flaxlm.plan --gin_file=gin/gptj_pretrain.gin \
      --gin_file=models/gptj_6b.gin --topology=v5e:2x4 --gin.BATCH_SIZE=8 \
      --gin.TASK_FEATURE_LENGTHS="{'targets': 2048}"

The run is the one the Gin files bind to `train.train` (model, batch, lengths, optimizer, LoRA,
objective); `gin/runs/plan.gin` binds `run.fn = @plan.plan` after it. Candidates: every mesh
shape over the bound Partitioner's axes, `optimizer_sharding` (zero1 where the `data` axis is
split) and, for a model with experts on a mesh whose `expert` axis is split, the MoE dispatch
(`moe_dispatch`: all-gather, capacity all-to-all, ragged all-to-all) and, where fsdp is split
too, the experts over (expert, fsdp) or not (`experts_over_fsdp`), then, for the best of
these, every remat policy, microbatch count and `scan_layers`. What cannot divide (batch over
the batch axes, a param over its mesh axes) is rejected before compiling; the rest is compiled
for the target (`aot.target_devices`) and read: memory per device (`memory_analysis`), FLOPs
and bytes (`cost_analysis`), collectives (`hlo.parse_hlo`); for a model with experts also those
of its MoE layers apart (`hlo.shard_map_collectives`). The step time is a roofline (`chips`):
on accelerators max(compute, memory, collectives), which assumes XLA overlaps them; on CPU
compute-or-memory plus collectives, which it does not. `cost_analysis` counts a loop's body
once, so a candidate with loops (scanned layers, microbatches) takes its FLOPs and bytes from
two extra compiles of 1 and 2 unscanned layers: body = c2 - c1, step = c1 + (L - 1) body, then
x microbatches (the optimizer's bytes once).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gin
import jax

from flaxlm.models import expert_parallel, layers, moe
from flaxlm.parallel import pytrees
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.plan import aot, chips, hlo
from flaxlm.plan import report as plan_report
from flaxlm.plan.run import Knobs, Result, Run, pairs, run_from_gin, with_config

GIB = 2**30
TOP_MESHES = 3  # meshes whose remat / microbatch / scan variants are compiled


def mesh_shapes(num_devices: int, num_axes: int) -> list[tuple[int, ...]]:
    """Every way to split `num_devices` into `num_axes` ordered factors."""
    if num_axes == 1:
        return [(num_devices,)]
    out = []
    for first in range(1, num_devices + 1):
        if num_devices % first == 0:
            out += [(first, *rest) for rest in mesh_shapes(num_devices // first, num_axes - 1)]
    return out


class Planner:
    """Enumerates, rejects, compiles and predicts (see the module docstring)."""

    def __init__(
        self,
        run: Run,
        devices: Sequence[Any],
        chip: chips.Chip,
        meshes: Sequence[Sequence[int]] | None = None,
    ):
        if run.base.moe_dispatch is None and moe.has_experts(run.model.config):
            # (a Run not read from Gin, as the benchmarks build: the config's dispatch)
            base = dataclasses.replace(run.base, moe_dispatch=run.model.config.moe_dispatch)
            run = dataclasses.replace(run, base=base)
        self.run = run
        # Only these mesh shapes (over run.axis_names) in the first stage; None: every one.
        self.meshes = None if meshes is None else [tuple(int(n) for n in m) for m in meshes]
        self.devices = list(devices)
        self.chip = chip
        # The per-device memory the planner itself holds candidates to: none on TPU, whose
        # compiler enforces HBM and says so in its own words.
        self.limit = None if self.devices[0].platform == "tpu" else chip.memory_bytes
        self.num_layers = getattr(run.model.config, "num_layers", None)
        # The unrolled layers a scanned step keeps before its stack (DeepSeek-V3's dense ones).
        self.first_scanned = getattr(run.model.config, "first_scanned_layer", 0)
        # The layers of the scan's body, a cycle of kinds (Qwen3.5's 3 linear + 1 full: 4).
        self.period = getattr(run.model.config, "scan_period", 1)
        # The unrolled layers after the stack (a last cycle cut short: Kimi Linear's 2).
        self.tail = getattr(run.model.config, "scan_tail", 0)
        self._costs: dict[tuple, tuple[dict[str, float], float] | None] = {}
        self._param_shapes = None

    def partitioner(self, knobs: Knobs) -> Partitioner:
        return Partitioner(
            mesh_shape=knobs.mesh_shape,
            mesh_axis_names=self.run.axis_names,
            optimizer_sharding=knobs.optimizer_sharding,
            devices=self.devices,
            experts_over_fsdp=knobs.experts_over_fsdp,
            **self.run.partitioner_kwargs,
        )

    def model(self, knobs: Knobs, **changes: Any) -> Any:
        config = self.run.model.config
        fields = {f.name for f in dataclasses.fields(config)}
        wanted = dict(remat_policy=knobs.remat_policy, scan_layers=knobs.scan_layers)
        if knobs.moe_dispatch is not None:
            wanted["moe_dispatch"] = knobs.moe_dispatch
        if "num_layers" in changes:  # a cut: each layer's kind (`layer_types`, ...) follows
            n = changes["num_layers"]
            for name in (f for f in fields if f.endswith("layer_types")):
                if getattr(config, name) is not None:
                    wanted[name] = self._cut(tuple(getattr(config, name)), n)
            if getattr(config, "num_kv_shared_layers", 0):  # Gemma 4's: the same sources
                wanted["num_kv_shared_layers"] = max(0, n - self.first_scanned)
        wanted.update(changes)
        return with_config(self.run.model, **{k: v for k, v in wanted.items() if k in fields})

    def _cut(self, kinds: tuple[Any, ...], n: int) -> tuple[Any, ...]:
        """The layers' `kinds` cut to `n`: the first `n - tail`, the scan's cycle repeated
        past the stack's last (a calibration cut of two cycles of a model that has one), then
        the unrolled tail's."""
        s, p, t = self.first_scanned, self.period, self.tail
        stop = len(kinds) - t
        head = (kinds[i] if i < stop else kinds[s + (i - s) % p] for i in range(n - t))
        return (*head, *kinds[stop:])

    # ------------------------------------------------------------------ rejection

    def reject_reason(self, knobs: Knobs) -> str | None:
        """Why `knobs` cannot run, found without compiling (None if nothing is found)."""
        sizes = dict(zip(self.run.axis_names, knobs.mesh_shape))
        if knobs.optimizer_sharding == "zero1" and sizes.get("data", 1) == 1:
            return "zero1 needs a data axis > 1 (with data = 1 it is optimizer_sharding=params)"
        partitioner = self.partitioner(knobs)
        degree = partitioner.data_parallel_degree()
        if self.run.batch_size % (degree * knobs.num_microbatches):
            return (
                f"batch {self.run.batch_size} does not split into {knobs.num_microbatches} "
                f"microbatch(es) over the data-parallel degree {degree}"
            )
        sequence = sizes.get("sequence", 1)
        for name, n in self.run.lengths.items():
            if sequence > 1 and n % (2 * sequence):
                return f"{name} length {n} is not a multiple of 2 x sequence={sequence}"
        if self._param_shapes is None:
            shapes = {k: (1, n) for k, n in self.run.lengths.items()}
            model = self.run.model
            abstract = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0), shapes))
            self._param_shapes = (abstract, model.params_axes(shapes))
        abstract, axes = self._param_shapes
        specs = jax.tree.map(
            partitioner.mesh_axes, axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
        )
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
            spec = _leaf_at(specs, path)
            for dim, entry in zip(leaf.shape, spec or ()):
                names = () if entry is None else (entry,) if isinstance(entry, str) else entry
                split = math.prod(sizes[a] for a in names)
                if dim % split:
                    where = " x ".join(f"{a}={sizes[a]}" for a in names)
                    name = pytrees.path_name(path)
                    return f"{name} {tuple(leaf.shape)}: {dim} is not divisible by {where}"
        return None

    # ------------------------------------------------------------------ compile + predict

    def compile(self, knobs: Knobs, **changes: Any) -> aot.CompiledStep:
        return aot.CompiledStep(
            self.model(knobs, **changes),
            self.partitioner(knobs),
            self.run.batch_size,
            self.run.lengths,
            optimizer=self.run.optimizer,
            learning_rate=self.run.learning_rate,
            num_microbatches=knobs.num_microbatches,
            lora=self.run.lora,
            objective=self.run.objective,
            out_of_memory_ok=True,
            state_limit=self.limit,
        )

    def evaluate(self, knobs: Knobs) -> Result:
        """Compiles `knobs` (which `reject_reason` passed) and reads and predicts it."""
        start = time.perf_counter()
        try:
            step = self.compile(knobs)
        except Exception as e:  # noqa: BLE001 - one candidate's failure is a table row
            return Result(knobs, "failed", _first_line(e), compile_s=time.perf_counter() - start)
        result = Result(knobs, "fits", step=step, state_bytes=step.state_bytes)
        if step.compiled is None:
            result.status, result.reason = "does not fit", step.out_of_memory or ""
            # libtpu's "... the total memory required for HLO temporaries (19.95G) exceeds
            # available HBM ...": its would-be peak, the arguments (the state) included
            need = re.search(r"temporaries \(([\d.]+)G\)", result.reason)
            if need:
                result.device_bytes = int(float(need.group(1)) * GIB)
            elif step.lowered is None:  # the state alone exceeds the limit: not compiled
                result.device_bytes, result.at_least = step.state_bytes, True
            result.compile_s = time.perf_counter() - start
            return result
        result.device_bytes = step.device_bytes()
        limit = self.limit
        if limit is not None and result.device_bytes > limit:
            result.status = "does not fit"
            result.reason = f"needs {result.device_bytes / GIB:.2f} GiB of {limit / GIB:.2f}"
        hosts = self.hosts(step)
        collectives = hlo.parse_hlo(step.hlo_text(), len(self.devices), hosts)
        result.collective_bytes = collectives["ring_bytes"]
        result.host_collective_bytes = collectives["host_ring_bytes"]
        result.collective_ops = int(
            sum(v["count"] for k, v in collectives["by_kind"].items() if "/" not in k)
        )
        if knobs.moe_dispatch is not None:
            result.moe_collectives = hlo.shard_map_collectives(
                step.hlo_text(), len(self.devices), hosts
            )
        cost = self.step_cost(knobs, step)
        result.compile_s = time.perf_counter() - start
        if cost is not None:
            result.flops, result.bytes_accessed = cost["flops"], cost["bytes accessed"]
            self.predict(result)
        return result

    def hosts(self, step: aot.CompiledStep) -> list[int] | None:
        """The host of each device of `step`'s program, in the order its collectives number
        them (the mesh's devices, row-major), where the chip has a network between hosts of
        its own (a GPU cluster); else None (a TPU slice is one torus across its hosts)."""
        if self.chip.host_link_bytes_per_s is None:
            return None
        return [d.process_index for d in step.setup.partitioner.mesh.devices.flat]

    def step_cost(self, knobs: Knobs, step: aot.CompiledStep) -> dict[str, float]:
        """FLOPs and bytes of one device's step with every loop counted.

        O is the optimizer update, outside the microbatch loop (its bytes: read gradients,
        params and moments, write params and moments; its FLOPs neglected). An unscanned
        step's own cost counts the microbatch loop's body once: step = O + mb (own - O). A
        scanned one (its stack's layers alike, from layer s = `first_scanned_layer` on; the
        unrolled ones before it, DeepSeek-V3's dense layers, and the t = `scan_tail` after it
        differ) is priced from the unscanned compiles cut to s + p + t and s + 2p + t layers
        (p the scan's cycle, `scan_period`: 1, or Qwen3.5's 4): X = 2 c1 - c2 is everything
        but the stack (the microbatch loop's body once), a stacked cycle is c2 - c1;
        step = O + mb (X - O + (L - s - t) / p cycle).
        (Unscanned steps are not calibrated so: their cuts would hold
        DeepSeek-V3's dense first layers alone.) On an accelerator a
        scanned step is predicted as its unrolled twin: the scan body's own cost analysis charges
        each dynamic-update-slice the whole stacked buffer (2.4x the unrolled bytes on v5e
        for Llama 2 7B), which the loop does not move. XLA:CPU does run a scanned layer
        slower (1.18x the unrolled step, measured; benchmarks/HISTORY.md), so on CPU a layer
        is the scan body's own cost, X subtracted (2.1x the bytes: it overstates, but
        orders scanned steps after their twins, as measured).
        """
        if not knobs.scan_layers and knobs.num_microbatches == 1:
            return step.cost()
        state = step.setup.abstract_state
        params, opt = aot.per_device_bytes(state.params), aot.per_device_bytes(state.opt_state)
        optimizer = {"flops": 0.0, "bytes accessed": 3.0 * params + 2.0 * opt}
        mb = knobs.num_microbatches
        if not knobs.scan_layers:
            own = step.cost()
            return {k: (o := min(optimizer[k], v)) + mb * (v - o) for k, v in own.items()}
        key = (
            knobs.mesh_shape,
            knobs.optimizer_sharding,
            knobs.remat_policy,
            knobs.num_microbatches,
            knobs.moe_dispatch,
            knobs.experts_over_fsdp,
        )
        if key not in self._costs:
            self._costs[key] = self._calibrate(knobs)
        if self._costs[key] is None:
            return step.cost()  # a model without num_layers: loops counted once
        c1, c2 = self._costs[key]
        own = step.cost() if self.devices[0].platform == "cpu" else None
        out = {}
        for k in c1:
            outside = 2 * c1[k] - c2[k]
            layer = c2[k] - c1[k]
            if own is not None and own[k] - outside > layer:
                layer = own[k] - outside
            o = min(optimizer[k], outside)
            cycles = (self.num_layers - self.first_scanned - self.tail) // self.period
            out[k] = o + mb * (outside - o + cycles * layer)
        return out

    def _calibrate(self, knobs: Knobs) -> tuple[dict[str, float], dict[str, float]] | None:
        if not self.num_layers:
            return None
        flat = dataclasses.replace(knobs, scan_layers=False)
        s, p, t = self.first_scanned, self.period, self.tail
        c1, c2 = (self.compile(flat, num_layers=n).cost() for n in (s + p + t, s + 2 * p + t))
        return c1, c2

    def predict(self, result: Result) -> None:
        chip, run = self.chip, self.run
        dtype = str(getattr(run.model.config, "dtype", "float32"))
        compute = result.flops / chip.peak_flops(dtype)
        memory = result.bytes_accessed / chip.memory_bytes_per_s
        network = result.host_collective_bytes
        comm = (
            (result.collective_bytes - network) / chip.link_bytes_per_s
            + (network / chip.host_link_bytes_per_s if network else 0.0)
            + result.collective_ops * chip.collective_latency_s
        )
        if self.devices[0].platform == "cpu":
            result.predicted_s = max(compute, memory) + comm
        else:
            result.predicted_s = max(compute, memory, comm)
        length = max(run.lengths.values())
        rows = run.batch_size * (2 if pairs(run) else 1)
        model_flops = run.model.flops_per_token(length) * rows * length
        result.mfu = model_flops / (result.predicted_s * chip.peak_flops(dtype) * len(self.devices))

    # ------------------------------------------------------------------ search

    def dispatches(self, mesh_shape: Sequence[int]) -> tuple[str | None, ...]:
        """The MoE dispatches worth compiling on `mesh_shape`: every one (the bound one first)
        for a model with experts whose `expert` axis is split, else the bound one alone (None
        for a model without experts): with `expert` = 1 every dispatch is the same program."""
        bound = self.run.base.moe_dispatch
        sizes = dict(zip(self.run.axis_names, mesh_shape))
        if bound is None or sizes.get(expert_parallel.EXPERT_AXIS, 1) == 1:
            return (bound,)
        return (bound, *(d for d in expert_parallel.DISPATCHES if d != bound))

    def first_stage(self) -> list[Knobs]:
        out = []
        shapes = self.meshes or mesh_shapes(len(self.devices), len(self.run.axis_names))
        for shape in shapes:
            if len(shape) != len(self.run.axis_names) or math.prod(shape) != len(self.devices):
                raise ValueError(
                    f"mesh {shape} is not a shape over {self.run.axis_names} of "
                    f"{len(self.devices)} devices"
                )
            over = self.experts_over_fsdp(shape)
            for sharding, dispatch, split in itertools.product(
                ("params", "zero1"), self.dispatches(shape), over
            ):
                out.append(
                    dataclasses.replace(
                        self.run.base,
                        mesh_shape=shape,
                        optimizer_sharding=sharding,
                        moe_dispatch=dispatch,
                        experts_over_fsdp=split,
                    )
                )
        return out

    def experts_over_fsdp(self, mesh_shape: Sequence[int]) -> tuple[bool, ...]:
        """Whether to split the experts over (expert, fsdp), the bound choice first: both
        where a model with experts splits `expert` and `fsdp`, else False alone."""
        sizes = dict(zip(self.run.axis_names, mesh_shape))
        both = min(sizes.get(expert_parallel.EXPERT_AXIS, 1), sizes.get("fsdp", 1)) > 1
        bound = self.run.base.experts_over_fsdp
        return (bound, not bound) if both and self.run.base.moe_dispatch else (False,)

    def second_stage(self, ranked: Sequence[Result]) -> list[Knobs]:
        """Remat, microbatch and scan variants of the best meshes: fewest changes first; when
        nothing fits, what saves most memory first (the strongest remat, the fewest rows a
        device holds at once, then no gradient accumulator: fewer microbatches)."""
        base = self.run.base
        compiled = [r for r in ranked if r.status in ("fits", "does not fit")]
        best = [r.knobs for r in compiled[:TOP_MESHES]]
        nothing_fits = not any(r.status == "fits" for r in compiled)
        saving = ("full", "minimal", "dots_with_no_batch_dims_saveable", "dots_saveable")
        micro = [m for m in (1, 2, 4, 8, 16) if self.run.batch_size % m == 0]
        variants = []
        for order, knobs in enumerate(best):
            degree = self.partitioner(knobs).data_parallel_degree()
            for remat, mb, scan in itertools.product(
                layers.REMAT_POLICIES, micro, (base.scan_layers, not base.scan_layers)
            ):
                changed = (
                    (remat != base.remat_policy)
                    + (mb != base.num_microbatches)
                    + (scan != base.scan_layers)
                )
                if changed == 0:
                    continue
                rows = self.run.batch_size / (degree * mb)
                if nothing_fits:
                    key = (_index(saving, remat), rows if rows >= 1 else math.inf, mb, changed)
                else:
                    key = (changed, order)
                new = dataclasses.replace(
                    knobs, remat_policy=remat, num_microbatches=mb, scan_layers=scan
                )
                variants.append((key, order, new))
        variants.sort(key=lambda v: (v[0], v[1]))
        return [v[2] for v in variants]

    def search(
        self,
        max_candidates: int,
        budget_s: float,
        progress: Callable[..., None],
        workers: int | None = None,
    ) -> list[Result]:
        """Both stages within `max_candidates` compiles and `budget_s` seconds, compiling
        `workers` candidates at a time (default: half this host's cores, at most 8)."""
        workers = workers or max(1, min(8, (os.cpu_count() or 1) // 2))
        deadline = time.perf_counter() + budget_s
        results: list[Result] = []

        def go(candidates: Sequence[Knobs], pool: ThreadPoolExecutor) -> None:
            todo = []
            for knobs in candidates:
                if any(r.knobs == knobs for r in results) or knobs in todo:
                    continue
                reason = self.reject_reason(knobs)
                if reason:
                    results.append(Result(knobs, "rejected", reason))
                else:
                    todo.append(knobs)
            while todo:
                compiled = sum(r.status != "rejected" for r in results)
                room = max_candidates - compiled
                if room <= 0 or time.perf_counter() > deadline:
                    return
                chunk, todo = todo[: min(workers, room)], todo[min(workers, room) :]
                progress(compiled, max_candidates, chunk[0])
                results.extend(pool.map(self.evaluate, chunk))

        with ThreadPoolExecutor(workers) as pool:
            go(self.first_stage(), pool)
            go(self.second_stage(rank(results)), pool)
        progress(sum(r.status != "rejected" for r in results), max_candidates, None)
        return rank(results)


def rank(results: Sequence[Result]) -> list[Result]:
    """Fitting candidates by predicted time, then those that do not fit by memory, then the
    rest (failed, rejected) in their order."""

    def key(r: Result) -> tuple:
        if r.status == "fits":  # ties (a scanned step and its unrolled twin): less memory
            predicted = r.predicted_s if r.predicted_s is not None else math.inf
            return (0, round(predicted, 6), r.device_bytes or 0)
        if r.status == "does not fit":
            return (1, r.device_bytes if r.device_bytes is not None else math.inf, 0)
        return (2, 0, 0)

    return sorted(results, key=key)


def _index(options: Sequence[str], value: str) -> int:
    return options.index(value) if value in options else len(options)


def _leaf_at(tree: Any, path: Sequence[Any]) -> Any:
    for entry in path:
        key = getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", None)))
        tree = tree[key]
    return tree


def _first_line(e: BaseException) -> str:
    return (str(e).strip().split("\n") or [type(e).__name__])[0][:300]


@gin.configurable
def plan(
    topology: str = "this",
    max_candidates: int = 24,
    budget_s: float = 900.0,
    json_path: str | None = None,
    measure: int = 0,
    measure_steps: int = 3,
    measure_rounds: int = 3,
    meshes: Sequence[Sequence[int]] | None = None,
) -> list[Result]:
    """Plans the training run the Gin files bind (see the module docstring); prints the
    ranked table and the best candidate's `--gin.` overrides. `measure` > 0 (CPU or `this`
    only) also runs that many of the best candidates, alternating, and reports their
    measured step times and the rank correlation with the prediction. `meshes` (shapes over
    the run's mesh axes, the `expert` axis included for a model with experts) limits the
    first stage to those meshes (a large slice's many shapes cost minutes a compile)."""
    if max_candidates < 1 or budget_s <= 0:
        raise ValueError("PLAN_MAX_CANDIDATES must be >= 1 and PLAN_BUDGET_S > 0.")
    devices = aot.target_devices(topology)
    run = run_from_gin()
    chip = chips.for_devices(topology, devices)
    planner = Planner(run, devices, chip, meshes)
    run = planner.run  # (its base knobs as the planner holds them: the dispatch included)
    print(plan_report.describe(run, topology, devices, chip), flush=True)
    results = planner.search(max_candidates, budget_s, plan_report.Progress(sys.stderr))
    plan_report.print_table(results, run)
    if measure:
        if topology not in ("this",) and not topology.startswith("cpu:"):
            raise ValueError("PLAN_MEASURE needs devices of this host: --topology=cpu:N or this.")
        plan_report.measure(results, run, measure, measure_steps, measure_rounds)
    plan_report.write_json(results, run, topology, chip, json_path)
    return results
