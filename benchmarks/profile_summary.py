"""Where a compiled step's time goes on an accelerator: a `jax.profiler` trace of a few
steps, its device kernels summed by kind.

    python benchmarks/profile_summary.py TRACE.json.gz     # a perfetto trace jax wrote

`accelerator.py --profile DIR` calls `trace_steps` after timing the first length. Kernels
are grouped by what their names say (cuBLAS/cuDNN GEMMs, cuDNN flash attention, XLA's
fusions by their root op, collectives, copies); each group's share of the device's busy
time and the idle time between kernels are what a step is made of.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

KINDS = (  # (kind, pattern on the kernel name), first match wins
    ("attention (cuDNN flash)", r"fmha|flash|cudnn.*attention|sdpa"),
    ("matmul (cuBLAS/cutlass gemm)", r"gemm|cublas|cutlass|sm90_xmma|nvjet|matmul|dot"),
    ("collective", r"nccl|all_reduce|all-reduce|reduce_scatter|all_gather|all-to-all"),
    ("copy / transpose", r"memcpy|memset|copy|transpose"),
    ("reduction fusion", r"reduce|softmax|norm"),
    ("elementwise / loop fusion", r"fusion|loop|input_|wrapped|convert|multiply|add"),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, lowered):
            return kind
    return "other"


def device_events(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The complete ('X') events of the device's streams (GPU kernels), host ones left out."""
    names = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e.get("pid")] = str(e.get("args", {}).get("name", ""))
    device_pids = {pid for pid, n in names.items() if re.search(r"/device:(GPU|TPU)", n)}
    return [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("pid") in device_pids and e.get("dur", 0) > 0
    ]


def summarize(trace: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """Per-step milliseconds by kernel kind, the busy and idle time, and the top kernels."""
    events = device_events(trace)
    if not events:
        return {"error": "no device kernels in the trace"}
    by_kind: dict[str, float] = collections.Counter()
    by_name: dict[str, float] = collections.Counter()
    for e in events:
        by_kind[kind_of(e["name"])] += e["dur"]
        by_name[e["name"][:90]] += e["dur"]
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    busy = sum(by_kind.values())
    per_step = lambda us: us / steps / 1e3  # noqa: E731  (microseconds -> ms per step)
    return {
        "span_ms_per_step": per_step(end - start),
        "busy_ms_per_step": per_step(busy),
        "kernels_per_step": len(events) / steps,
        "by_kind_ms_per_step": {k: per_step(v) for k, v in by_kind.most_common()},
        "top_kernels_ms_per_step": {k: per_step(v) for k, v in by_name.most_common(15)},
    }


def print_summary(summary: Mapping[str, Any]) -> None:
    if "error" in summary:
        print(f"  profile: {summary['error']}")
        return
    span, busy = summary["span_ms_per_step"], summary["busy_ms_per_step"]
    print(
        f"  profile: {span:.1f} ms/step on the device's clock, {busy:.1f} ms of kernels "
        f"({summary['kernels_per_step']:.0f} a step), {max(span - busy, 0):.1f} ms between"
    )
    for kind, ms in summary["by_kind_ms_per_step"].items():
        print(f"    {kind:32s} {ms:8.1f} ms  {ms / busy:6.1%}")
    print("    top kernels:")
    for name, ms in summary["top_kernels_ms_per_step"].items():
        print(f"      {ms:8.2f} ms  {name}")


def trace_steps(run: Callable[[int], float], out_dir: str, steps: int = 2) -> dict[str, Any]:
    """Runs `run(steps)` under `jax.profiler.trace` into `out_dir` and returns (and prints)
    the summary of the perfetto trace it wrote."""
    import jax

    os.makedirs(out_dir, exist_ok=True)
    start = time.time()
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        run(steps)
    traces = [
        p
        for p in glob.glob(os.path.join(out_dir, "**", "*.trace.json.gz"), recursive=True)
        if os.path.getmtime(p) >= start - 1
    ]
    if not traces:
        return {"error": f"jax.profiler wrote no perfetto trace under {out_dir}"}
    with gzip.open(max(traces, key=os.path.getmtime), "rt") as f:
        summary = summarize(json.load(f), steps)
    print_summary(summary)
    return summary


if __name__ == "__main__":
    with gzip.open(sys.argv[1], "rt") as f:
        print_summary(summarize(json.load(f), int(sys.argv[2]) if len(sys.argv) > 2 else 1))
