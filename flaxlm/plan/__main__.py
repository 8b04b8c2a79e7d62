"""`python -m flaxlm.plan --gin_file=RUN.gin [--topology=T] [--max_candidates=N]
[--budget_s=S] [--json=PATH] [--measure=K] [--gin.X=Y ...]`

The same as `python -m flaxlm.main --gin_file=RUN.gin --gin_file=runs/plan.gin
--gin.PLAN_TOPOLOGY="'T'" ...`: the run's Gin files describe what to train, gin/runs/plan.gin
rebinds the run function to the planner. For `--topology=cpu:N` this process asks XLA for N
CPU devices before JAX starts.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys

from flaxlm.parallel import platforms


def translate(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(flaxlm.main's arguments, environment changes) for the planner's command line."""
    p = argparse.ArgumentParser(prog="python -m flaxlm.plan", description=__doc__.split("\n\n")[1])
    p.add_argument(
        "--topology",
        default="this",
        help="compile for: " + platforms.TOPOLOGY_HELP + " (TPU: libtpu, GPU: the CUDA "
        "plugin, neither attached)",
    )
    p.add_argument("--max_candidates", type=int, default=24, help="compile at most this many")
    p.add_argument("--budget_s", type=float, default=900.0, help="stop compiling after this")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument(
        "--measure",
        type=int,
        default=0,
        metavar="K",
        help="run the K best candidates on this host's devices, alternating, and report "
        "their measured step times and the rank correlation with the prediction",
    )
    args, rest = p.parse_known_args(argv)
    bindings = [
        f"--gin.PLAN_TOPOLOGY={args.topology!r}",
        f"--gin.PLAN_MAX_CANDIDATES={args.max_candidates}",
        f"--gin.PLAN_BUDGET_S={args.budget_s}",
        f"--gin.PLAN_JSON={args.json!r}",
        f"--gin.PLAN_MEASURE={args.measure}",
    ]
    env = {}
    m = re.fullmatch(r"cpu:(\d+)", args.topology)
    if m:
        env["XLA_FLAGS"] = platforms.host_device_flags(int(m.group(1)))
    if platforms.GPU_TOPOLOGY_RE.fullmatch(args.topology):
        # compiled for, not run: JAX starts on the CPU (the CUDA plugin compiles all the same;
        # started as a backend on a host without a GPU it fails and takes the compiler with it)
        env["JAX_PLATFORMS"] = "cpu"
    return [*rest, "--gin_file=runs/plan.gin", *bindings], env


def check_topology(topology: str) -> str | None:
    """What is wrong with `--topology`, if anything, said before JAX starts (XLA refuses 0
    CPU devices with a traceback)."""
    m = re.fullmatch(r"cpu:(\d+)", topology)
    if m and int(m.group(1)) < 1:
        return f"--topology={topology!r}: cpu:N compiles for N >= 1 CPU devices, e.g. cpu:8."
    named = (platforms.TPU_TOPOLOGY_RE, platforms.GPU_TOPOLOGY_RE)
    if not m and topology != "this" and not any(r.fullmatch(topology) for r in named):
        return f"--topology={topology!r}: expected {platforms.TOPOLOGY_HELP}."
    return None


def console_main() -> None:
    args, env = translate(sys.argv[1:])
    topology = next(a for a in args if a.startswith("--gin.PLAN_TOPOLOGY="))
    problem = check_topology(ast.literal_eval(topology.partition("=")[2]))
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
    os.environ.update(env)
    os.execv(sys.executable, [sys.executable, "-m", "flaxlm.main", *args])


if __name__ == "__main__":
    console_main()
