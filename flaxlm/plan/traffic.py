"""The memory traffic of one iteration of a compiled loop (or of a whole program), kernel by
kernel, from its HLO.

A decode step on an accelerator is bound by memory bandwidth: its time is at least the bytes
its kernels read and write over the bandwidth. `loop_kernels` lists the kernels one
iteration of a compiled program's loop runs (a fusion, a library call such as cuBLAS's, a
copy) with the bytes each moves, so what a step moves beyond the parameters and the KV cache
it must read (a copy of the cache, a gathered one) shows up by name before any device runs
it: compile for the device ahead of time (`aot.gpu_devices`, `aot.topology_devices`) and read
the result here.

Each kernel is charged its operands' and its result's bytes, except where the kernel touches
part of an array: a gather or dynamic slice (inside a fusion too) reads the slices it
takes, and an update in place (a dynamic-update-slice or scatter at a fusion's root, whose
result shares the buffer of the array it updates) writes only its update. A kernel reading
one operand twice (XLA does not cache it) or a fusion recomputing a value is not seen: the
figure is a lower bound of what the kernels move, and an upper bound where a cache such as
the GPU's L2 holds an operand between two kernels.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Sequence

from flaxlm.plan import flops, hlo

FREE = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
}
PARTIAL_READS = ("gather", "dynamic-slice")
IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode -> operand index of the update


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a loop iteration: `kind` is the opcode (`fusion:<what it does>` for a
    fusion, as `_fusion_bytes` names it; `custom-call:<target>` for a library call),
    `nbytes` what it reads and writes, `branch` the conditional branch it runs in
    (`<conditional>:<branch index>`; None: every iteration), `count` how many times an
    iteration runs it (inner loops' trip counts)."""

    name: str
    kind: str
    nbytes: int
    shape: str
    branch: str | None = None
    count: int = 1


def _callee(rest: str, key: str) -> str | None:
    m = re.search(key + r"=%([^\s,}]+)", rest)
    return m.group(1) if m else None


def _fusion_bytes(
    instructions: Sequence[tuple[str, bool, tuple[str, str, str]]], operand_bytes: Sequence[int]
) -> tuple[int, str]:
    """Bytes a fusion (its computation's `hlo.instructions`) moves (see the module's
    docstring), and what it does: `dot`, `gather`, `scatter` or `sort` where it holds one,
    else its root's opcode."""
    defs = {}
    params: dict[str, int] = {}
    root = None
    for name, is_root, (type_str, opcode, rest) in instructions:
        defs[name] = (type_str, opcode, rest)
        if opcode == "parameter":
            params[name] = int(re.match(r"parameter\((\d+)\)", rest).group(1))
        if is_root:
            root = name

    def source(name: str) -> str:
        while defs.get(name, ("", ""))[1] == "bitcast":
            name = hlo.operand_names(defs[name][2])[0]
        return name

    users: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for name, (_, opcode, rest) in defs.items():
        if opcode != "bitcast":
            for i, operand in enumerate(hlo.operand_names(rest)):
                users[source(operand)].append((name, i))

    roots = [root]
    if defs[root][1] == "tuple":
        roots = [source(r) for r in hlo.operand_names(defs[root][2])]
    aliased: set[str] = set()
    written = 0
    for r in roots:
        type_str, opcode, rest = defs[r]
        operands = hlo.operand_names(rest)
        if opcode in IN_PLACE and source(operands[0]) in params:
            aliased.add(source(operands[0]))
            written += hlo.type_bytes(defs[source(operands[IN_PLACE[opcode]])][0])
        else:
            written += hlo.type_bytes(type_str)
    read = 0
    for name, index in params.items():
        if name in aliased:
            continue
        uses = users.get(name, [])
        if uses and all(defs[u][1] in PARTIAL_READS and i == 0 for u, i in uses):
            read += sum(hlo.type_bytes(defs[u][0]) for u, _ in uses)
        else:
            read += operand_bytes[index] if index < len(operand_bytes) else 0
    opcodes = {opcode for _, opcode, _ in defs.values()}
    kind = next((op for op in ("dot", "gather", "scatter", "sort") if op in opcodes), None)
    return read + written, kind or defs[root][1]


def loop_kernels(text: str, loop: int = -1) -> list[Kernel]:
    """The kernels of one iteration of the `loop`-th while loop of the ENTRY computation of
    the compiled module `text` (the last by default: a decode loop follows its prefill),
    inner loops' kernels counted their trip count times, each conditional branch's kernels
    listed with its name."""
    module = hlo.parse_module(text)
    loops = [rest for _, _, (_, op, rest) in module.instructions(module.entry) if op == "while"]
    if not loops:
        raise ValueError("The ENTRY computation has no while loop.")
    return _kernels(module, _callee(loops[loop], "body"), _trips)


def _trips(rest: str, computations: dict[str, list[str]], defs: dict) -> int:
    return hlo.loop_trips(rest, computations, defs) or 1


def program_bytes(text: str, inner_loops: bool = True) -> int:
    """Bytes the kernels of the compiled module `text` move in one run, of each conditional
    the branch that moves the most, a loop's body counted its `flops.kernel_loop_runs`
    where `inner_loops` (the microbatches' and scanned layers' once), else once: what XLA's
    `cost_analysis` calls `bytes accessed`, for a program whose cost analysis is empty
    (XLA:GPU's compiled ahead of time, `aot.gpu_devices`)."""
    module = hlo.parse_module(text)
    runs = flops.kernel_loop_runs if inner_loops else (lambda *_: 1)
    return iteration_bytes(_kernels(module, module.entry, runs), max)


# What `_kernels` reads of an instruction: ("while", rest, body), ("conditional", name,
# branches), ("call", callee) or ("kernel", name, kind, bytes, shape).
_Step = tuple


def _steps(module: hlo.Module, comp: str | None) -> tuple[list[_Step], dict]:
    """What `_kernels` reads of each instruction of `comp` (none of a free one or a done,
    which waits on its start's bytes), and the computation's instructions by name: kept in
    the module's memo, the same for every walk of it."""
    key = ("traffic.steps", comp)
    if key in module.memo:
        return module.memo[key]
    parsed = [(n, p) for n, _, p in module.instructions(comp)]
    types = {n: p[0] for n, p in parsed}
    steps: list[_Step] = []
    for name, (type_str, opcode, rest) in parsed:
        if opcode in FREE or opcode.endswith("-done"):
            continue
        if opcode == "while":
            steps.append(("while", rest, _callee(rest, "body")))
            continue
        if opcode == "conditional":
            m = re.search(r"branch_computations=\{([^}]*)\}", rest)
            names = (
                re.findall(r"%([^\s,]+)", m.group(1))
                if m
                else [_callee(rest, "true_computation"), _callee(rest, "false_computation")]
            )
            steps.append(("conditional", name, names))
            continue
        if opcode == "call":
            steps.append(("call", _callee(rest, "to_apply")))
            continue
        operands = [hlo.type_bytes(types.get(o, "")) for o in hlo.operand_names(rest)]
        result = hlo.type_bytes(type_str)
        kind = opcode
        if opcode == "fusion":
            callee = _callee(rest, "calls")
            nbytes, root = _fusion_bytes(module.instructions(callee), operands)
            kind = f"fusion:{root}"
        elif opcode in IN_PLACE:
            nbytes = 2 * operands[IN_PLACE[opcode]]
        elif opcode in PARTIAL_READS:
            nbytes = 2 * result
        elif opcode.endswith("-start") and opcode.removesuffix("-start") in hlo.COLLECTIVES:
            # typed (operands, results): each once
            collective = opcode.removesuffix("-start")
            nbytes = sum(operands) + hlo.async_result_bytes(collective, type_str)
        else:
            nbytes = sum(operands) + result
            if opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', rest)
                kind = f"custom-call:{target.group(1) if target else '?'}"
        steps.append(("kernel", name, kind, nbytes, type_str[:120]))
    module.memo[key] = out = (steps, dict(parsed))
    return out


def _kernels(module: hlo.Module, top: str | None, runs: Callable[..., int]) -> list[Kernel]:
    """The kernels computation `top` runs (see `Kernel`): an inner loop's counted `runs(rest,
    computations, defs)` times (its instruction's text, its computation's instructions)."""
    kernels: list[Kernel] = []

    def walk(comp: str | None, branch: str | None, count: int) -> None:
        steps, defs = _steps(module, comp)
        for step in steps:
            if step[0] == "while":
                _, rest, body = step
                walk(body, branch, count * runs(rest, module.computations, defs))
            elif step[0] == "conditional":
                for i, callee in enumerate(step[2]):
                    walk(callee, f"{step[1]}:{i}", count)
            elif step[0] == "call":
                walk(step[1], branch, count)
            else:
                _, name, kind, nbytes, shape = step
                kernels.append(Kernel(name, kind, nbytes, shape, branch, count))

    walk(top, None, 1)
    return kernels


def iteration_bytes(kernels: Sequence[Kernel], pick: Callable[..., int] = min) -> int:
    """Bytes one iteration moves: its unconditional kernels' and, of each conditional, the
    branch `pick` chooses by bytes (`min`: a greedy decode skips the sampler's sort)."""
    branches: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total = 0
    for k in kernels:
        if k.branch is None:
            total += k.nbytes * k.count
        else:
            conditional, index = k.branch.rsplit(":", 1)
            branches[conditional][index] += k.nbytes * k.count
    return total + sum(pick(b.values()) for b in branches.values())


def by_kind(kernels: Sequence[Kernel]) -> list[tuple[str, int]]:
    """(kind, bytes) over the unconditional kernels, the largest first."""
    totals: collections.Counter[str] = collections.Counter()
    for k in kernels:
        if k.branch is None:
            totals[k.kind] += k.nbytes * k.count
    return totals.most_common()
