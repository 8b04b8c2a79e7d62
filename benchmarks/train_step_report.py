"""train_step.py's printed report and its rows for benchmarks/RESULTS.md."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import bench_common

TARGET_RATIO = 0.97  # plain / flaxlm
TARGET_INPUT_WAIT = 0.02
RESULTS_HEADER = (
    "| date | command | machine | shape | flaxlm ms/step (tok/s) | plain ms/step | "
    "torch ms/step (tok/s) | torch / flaxlm (rounds) | plain / flaxlm (rounds) | "
    "probe GFLOP/s before, after | load before, after | input wait | note |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def ratio_text(ratio: Mapping[str, Any]) -> str:
    low, high = ratio["spread"]
    return f"{ratio['ratio']:.3f} ({low:.2f}-{high:.2f})"


def print_shape(name: str, result: Mapping[str, Any]) -> None:
    print(f"\n{name}: {result['config']}")
    rows = []
    for side, s in result["sides"].items():
        low, high = s["step_seconds_spread"]
        first, last = result["first_loss"][side], result["last_loss"][side]
        rows.append(
            [side, ms(s["step_seconds"]), f"{ms(low)}-{ms(high)}"]
            + [f"{s['tokens_per_second']:.0f}", f"{first:.4f} -> {last:.4f}"]
        )
    bench_common.print_table(
        ["side", "ms/step (median)", "rounds min-max", "tokens/s", "loss first -> last"], rows
    )
    ratios = result["ratios"]
    if "torch/flaxlm" in ratios:
        print(f"  torch / flaxlm = {ratio_text(ratios['torch/flaxlm'])}  (> 1: flaxlm faster)")
    plain = ratios["plain/flaxlm"]
    verdict = "ok" if plain["ratio"] >= TARGET_RATIO else "MISSED"
    print(f"  plain / flaxlm = {ratio_text(plain)}  target >= {TARGET_RATIO}: {verdict}")
    if "input" in result:
        loop = result["input"]
        wait = loop["input_wait_fraction"]
        verdict = "ok" if wait < TARGET_INPUT_WAIT else "MISSED"
        print(
            f"  loop with input {ms(loop['loop_step_seconds'])} ms/step, input wait {wait:.2%} "
            f"(target < {TARGET_INPUT_WAIT:.0%}: {verdict}), with to_global "
            f"{loop['input_total_fraction']:.2%}"
        )


def print_conditions(results: Mapping[str, Any]) -> None:
    before, after = results["before"], results["after"]
    print(f"\nMachine: {results['machine']}")
    print(
        f"  matmul probe {before['matmul_gflops']:.1f} GFLOP/s before, "
        f"{after['matmul_gflops']:.1f} after; load average "
        + ", ".join(" ".join(f"{x:.2f}" for x in c["loadavg"]) for c in (before, after))
        + " (1 5 15 min, before, after)"
    )
    env = ", ".join(f"{k}={v}" for k, v in before["env"].items()) or "none"
    print(f"  cores {before['cores']} (usable {before['cores_usable']}); thread env: {env}")
    print(f"  CPU extensions: {' '.join(before['cpu_flags']) or 'none listed'}")
    print(f"  torch threads {results['torch_threads']}; jax {results['jax_version']}")


def markdown_rows(results: Mapping[str, Any], note: str = "") -> list[str]:
    before, after = results["before"], results["after"]
    rows = []
    for name, r in results["shapes"].items():
        sides, ratios = r["sides"], r["ratios"]
        torch = sides.get("torch")
        cells = [
            results["date"],
            f"`{results['command']}`",
            results["machine"],
            f"{name}: {r['config']}",
            f"{ms(sides['flaxlm']['step_seconds'])} ({sides['flaxlm']['tokens_per_second']:.0f})",
            ms(sides["plain"]["step_seconds"]),
            f"{ms(torch['step_seconds'])} ({torch['tokens_per_second']:.0f})" if torch else "-",
            ratio_text(ratios["torch/flaxlm"]) if torch else "-",
            ratio_text(ratios["plain/flaxlm"]),
            f"{before['matmul_gflops']:.0f}, {after['matmul_gflops']:.0f}",
            f"{before['loadavg'][0]:.2f}, {after['loadavg'][0]:.2f}",
            f"{r['input']['input_wait_fraction']:.2%}" if "input" in r else "-",
            note,
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def print_report(results: Mapping[str, Any]) -> None:
    """Every shape's table and ratios, the conditions, then the RESULTS.md rows."""
    for name, result in results["shapes"].items():
        print_shape(name, result)
    print_conditions(results)
    print("\nRows for benchmarks/RESULTS.md:\n")
    print(RESULTS_HEADER)
    print("\n".join(results["markdown_rows"]))
