"""What the planner (`flaxlm.plan`) prints and writes: the progress bar, the ranked table,
the best candidate's `--gin.` overrides, the measured check and the JSON."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any, TextIO

import jax
import numpy as np

from flaxlm.models import layers
from flaxlm.plan import chips

GIB = 2**30


def describe(run: Any, topology: str, devices: Sequence[Any], chip: Any) -> str:
    model = run.model
    length = max(run.lengths.values())
    limit = "no memory limit"
    if chip.memory_bytes is not None:
        limit = f"{chip.memory_bytes / GIB:.2f} GiB"
        if chip.name in chips.GPUS and chip.memory_bytes < chips.CHIPS[chip.name].memory_bytes:
            limit += " (XLA_CLIENT_MEM_FRACTION of its HBM)"
    hosts = len({d.process_index for d in devices})
    network = ""
    if chip.host_link_bytes_per_s is not None and hosts > 1:
        network = f" ({hosts} hosts: {chip.host_link_bytes_per_s / 1e9:.3g} GB/s between them)"
    stand_in = ""
    if layers.gpu_without_one(devices[0]):  # `attention.auto_choice`'s stand-in
        stand_in = (
            "\nAttention: where 'auto' would run cuDNN's flash attention, which cannot be "
            "built without a GPU here, 'chunked' attention's blocks stand in for it (the "
            "memory cuDNN's holds; the blocks a causal mask hides counted as computed)."
        )
    return (
        f"Planning {type(model.config).__name__} ({model.config.dtype} compute), batch "
        f"{run.batch_size} x length {length}, on {topology}: {len(devices)} x "
        f"{devices[0].device_kind}.\nRoofline per device: "
        f"{chip.peak_flops(str(model.config.dtype)) / 1e12:.3g} TFLOP/s, memory "
        f"{chip.memory_bytes_per_s / 1e9:.3g} GB/s, collectives "
        f"{chip.link_bytes_per_s / 1e9:.3g} GB/s{network} + "
        f"{chip.collective_latency_s * 1e6:.0f} us/op, "
        f"{limit} ({chip.source}).{stand_in}"
    )


class Progress:
    """A one-line progress bar on a terminal, a line per candidate elsewhere."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.tty = stream.isatty()
        self.start = time.perf_counter()

    def __call__(self, done: int, total: int, knobs: Any) -> None:
        width = 24
        filled = int(width * min(done, total) / total)
        bar = "#" * filled + "-" * (width - filled)
        elapsed = time.perf_counter() - self.start
        what = "done" if knobs is None else f"compiling {knobs_text(knobs)}"
        line = f"[{bar}] {done}/{total} {elapsed:.0f}s {what}"
        if self.tty:
            self.stream.write("\r" + line[:160].ljust(160) + ("\n" if knobs is None else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def knobs_text(k: Any) -> str:
    dispatch = "" if k.moe_dispatch is None else f" dispatch={k.moe_dispatch}"
    dispatch += " experts_over_fsdp" if k.experts_over_fsdp else ""
    return (
        f"mesh {k.mesh_shape} {k.optimizer_sharding}{dispatch} remat={k.remat_policy} "
        f"mb={k.num_microbatches} scan={k.scan_layers}"
    )


def mesh_text(run: Any, k: Any) -> str:
    mesh = ",".join(f"{a}={n}" for a, n in zip(run.axis_names, k.mesh_shape))
    return mesh + (" (experts over fsdp)" if k.experts_over_fsdp else "")


def overrides(run: Any, k: Any) -> list[str]:
    """The `--gin.` flags that make `train.train` use `k`."""
    config = type(run.model.config).__name__
    out = [
        f'--gin.Partitioner.mesh_shape="{tuple(k.mesh_shape)}"',
        f"--gin.Partitioner.optimizer_sharding=\"'{k.optimizer_sharding}'\"",
        f"--gin.{config}.remat_policy=\"'{k.remat_policy}'\"",
        f"--gin.{config}.scan_layers={k.scan_layers}",
        f"--gin.train.num_microbatches={k.num_microbatches}",
    ]
    if k.moe_dispatch is not None:
        out.insert(3, f"--gin.{config}.moe_dispatch=\"'{k.moe_dispatch}'\"")
    if k.experts_over_fsdp:
        out.insert(2, "--gin.Partitioner.experts_over_fsdp=True")
    if "expert" in run.axis_names:  # the planner may have added it (run.with_expert_axis)
        out.insert(0, f'--gin.Partitioner.mesh_axis_names="{tuple(run.axis_names)}"')
    return out


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table_rows(results: Sequence[Any], run: Any) -> list[list[str]]:
    rows = []
    experts = run.base.moe_dispatch is not None
    for i, r in enumerate(results, 1):
        k = r.knobs
        rows.append(
            [
                str(i) if r.status in ("fits", "does not fit") else "",
                mesh_text(run, k),
                k.optimizer_sharding,
                *([k.moe_dispatch] if experts else []),
                k.remat_policy,
                str(k.num_microbatches),
                str(k.scan_layers),
                {"fits": "yes", "does not fit": "no"}.get(r.status, r.status),
                _cell(
                    None if r.device_bytes is None else r.device_bytes / GIB,
                    ">{:.2f}" if r.at_least else "{:.2f}",
                ),
                *(
                    [
                        _cell(None if r.state_bytes is None else r.state_bytes / GIB, "{:.2f}"),
                        _cell(moe_ring_bytes(r), "{:.3f}"),
                    ]
                    if experts
                    else []
                ),
                _cell(None if r.predicted_s is None else r.predicted_s * 1e3, "{:.1f}"),
                _cell(None if r.mfu is None else r.mfu * 100, "{:.1f}%"),
                f"{r.compile_s:.1f}" if r.status != "rejected" else "-",
            ]
        )
    return rows


HEADER = [
    "#",
    "mesh",
    "optimizer",
    "remat",
    "microbatches",
    "scan",
    "fits",
    "GiB/device",
    "predicted ms/step",
    "MFU",
    "compile s",
]


def moe_ring_bytes(r: Any) -> float | None:
    """GiB a device moves a step over the ring in the MoE layers' collectives (None where
    they were not read)."""
    if r.moe_collectives is None:
        return None
    return sum(v["ring_bytes"] for k, v in r.moe_collectives.items() if "/" not in k) / GIB


def header(run: Any) -> list[str]:
    """The table's columns; for a model with experts also its dispatch, of the GiB a device
    holds the training state's (the rest: temporaries and outputs), and the GiB its MoE
    layers' collectives move (the dispatch, the ring's bytes)."""
    if run.base.moe_dispatch is None:
        return HEADER
    at = HEADER.index("GiB/device") + 1
    extra = ["of which state", "MoE collectives GiB"]
    return [*HEADER[:3], "dispatch", *HEADER[3:at], *extra, *HEADER[at:]]


def print_table(results: Sequence[Any], run: Any) -> None:
    shown = [r for r in results if r.status != "rejected"]
    columns = header(run)
    print()
    print("| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---" for _ in columns) + " |")
    for row in table_rows(shown, run):
        print("| " + " | ".join(row) + " |")
    for r in shown:
        if r.reason:
            print(f"  {knobs_text(r.knobs)}: {r.status}: {r.reason}")
    rejected = [r for r in results if r.status == "rejected"]
    if rejected:
        print(f"\nRejected before compiling ({len(rejected)}):")
        by_reason: dict[str, list[Any]] = {}
        for r in rejected:
            by_reason.setdefault(r.reason, []).append(r.knobs)
        for reason, knobs in by_reason.items():
            first = f"{mesh_text(run, knobs[0])} {knobs[0].optimizer_sharding}"
            more = f" and {len(knobs) - 1} more" if len(knobs) > 1 else ""
            print(f"  {first}{more}: {reason}")
    fitting = [r for r in results if r.status == "fits"]
    if fitting:
        best = fitting[0]
        print(f"\nBest: {knobs_text(best.knobs)}, {best.predicted_s * 1e3:.1f} ms/step predicted.")
        print("  " + " \\\n  ".join(overrides(run, best.knobs)))
        return
    sized = [r for r in results if r.device_bytes is not None]
    if sized:
        smallest = min(sized, key=lambda r: r.device_bytes)
        need = f"{smallest.device_bytes / GIB:.2f} GiB/device"
        if smallest.at_least:
            need = f"more than {need} (its training state alone)"
        print(
            f"\nNothing fits: the smallest candidate ({knobs_text(smallest.knobs)}) needs {need}."
        )
    else:
        print("\nNothing fits: no candidate compiled (see the reasons above).")


def random_batch(run: Any, step: Any, seed: int = 0) -> dict[str, jax.Array]:
    """A batch of `step`'s shapes and shardings: random tokens, one segment, positions."""
    rng = np.random.default_rng(seed)
    vocab = int(getattr(run.model.config, "vocab_size", 256))
    out = {}
    for name, spec in step.abstract_batch.items():
        if "segment_ids" in name or "loss_weights" in name:
            x = np.ones(spec.shape, np.int32)
        elif "positions" in name:
            x = np.broadcast_to(np.arange(spec.shape[-1], dtype=np.int32), spec.shape).copy()
        else:
            x = rng.integers(1, vocab, spec.shape, dtype=np.int32)
        out[name] = jax.device_put(x, spec.sharding)
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""

    def ranks(x: Sequence[float]) -> np.ndarray:
        x = np.asarray(x, float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def measure(results: Sequence[Any], run: Any, count: int, steps: int, rounds: int) -> float:
    """Runs the `count` best fitting candidates on their devices, alternating: `rounds`
    rounds of `steps` steps each after two warm-up steps; fills `measured_s` (median of
    the rounds' per-step times) and returns Spearman(predicted, measured)."""
    chosen = [r for r in results if r.status == "fits" and r.predicted_s is not None][:count]
    if len(chosen) < 2:
        raise ValueError("PLAN_MEASURE needs at least two candidates that fit.")
    live = []
    for r in chosen:
        setup = r.step.setup
        state = setup.init_state()
        frozen = ()  # a LoRA base, or a preference loss's reference params
        if r.step.abstract_frozen is not None:
            lora = setup.lora is not None
            frozen = (setup.init_base() if lora else setup.copy_params(state.params),)
        batch = (random_batch(run, r.step), *frozen)
        for _ in range(2):
            state, metrics = r.step.compiled(state, *batch)
        jax.block_until_ready(metrics)
        live.append([r, state, batch, []])
    for i in range(rounds):
        order = live if i % 2 == 0 else live[::-1]
        for entry in order:
            r, state, batch, times = entry
            start = time.perf_counter()
            for _ in range(steps):
                state, metrics = r.step.compiled(state, *batch)
            jax.block_until_ready(metrics)
            times.append((time.perf_counter() - start) / steps)
            entry[1] = state
    for r, _, _, times in live:
        r.measured_s = statistics.median(times)
    rho = spearman([r.predicted_s for r in chosen], [r.measured_s for r in chosen])
    print(f"\nMeasured on this host ({rounds} rounds x {steps} steps, alternating):")
    print("| # | mesh | optimizer | remat | microbatches | scan | predicted ms | measured ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(chosen, 1):
        k = r.knobs
        print(
            f"| {i} | {mesh_text(run, k)} | {k.optimizer_sharding} | {k.remat_policy} | "
            f"{k.num_microbatches} | {k.scan_layers} | {r.predicted_s * 1e3:.1f} | "
            f"{r.measured_s * 1e3:.1f} |"
        )
    print(f"Spearman rank correlation (predicted vs measured, {len(chosen)} candidates): {rho:.2f}")
    return rho


def write_json(
    results: Sequence[Any], run: Any, topology: str, chip: Any, path: str | None
) -> None:
    if not path:
        return
    rows = []
    for r in results:
        row = {k: v for k, v in vars(r).items() if k not in ("step", "knobs")}
        row.update(vars(r.knobs))
        row["mesh_shape"] = list(r.knobs.mesh_shape)
        row["overrides"] = overrides(run, r.knobs) if r.status == "fits" else None
        rows.append(row)
    out = {
        "topology": topology,
        "chip": {k: v for k, v in vars(chip).items()},
        "batch_size": run.batch_size,
        "lengths": run.lengths,
        "axis_names": list(run.axis_names),
        "candidates": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2, default=str)
    print(f"Wrote {path}")
