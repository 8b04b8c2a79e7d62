"""What a compiled XLA program does per step, read from its HLO text.

`parse_hlo` counts the collectives (all-gather, reduce-scatter, all-reduce, all-to-all and
its ragged form, collective-permute) of a compiled step, each op as many times as the while
loops around it run (`known_trip_count`, or read from the loop's condition as TPU's compiled
HLO needs), in two units (array bytes and ring bytes, see `Op`). Shared by the planner
(`flaxlm.plan`) and benchmarks/collectives.py.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

# A ragged-all-to-all (the MoE layer's `ragged` dispatch) counts as an all-to-all of its
# whole output buffer: what the most it can receive would move, not what it does.
COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
DTYPE_BYTES = dict(pred=1, s8=1, u8=1, s16=2, u16=2, f16=2, bf16=2, s32=4, u32=4, f32=4)
DTYPE_BYTES.update(s64=8, u64=8, f64=8, c64=8, c128=16)
SHAPE_RE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
COMPUTATION_RE = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{$")
INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")


def type_bytes(type_str: str) -> int:
    """Bytes of an HLO type (a shape or a tuple of shapes)."""
    total = 0
    for dtype, dims in SHAPE_RE.findall(type_str):
        total += math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dtype]
    return total


def split_type(rhs: str) -> tuple[str, str, str]:
    """`TYPE opcode(operands), attrs` -> (type, opcode, rest)."""
    if rhs.startswith("("):
        depth = 0
        i = 0
        for i, ch in enumerate(rhs):  # noqa: B007
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        type_str, rest = rhs[: i + 1], rhs[i + 1 :].lstrip()
    else:
        type_str, _, rest = rhs.partition(" ")
    return type_str, rest.split("(", 1)[0], rest


def shard_map_collectives(
    text: str, num_devices: int, hosts: Sequence[int] | None = None
) -> dict[str, dict[str, float]]:
    """`parse_hlo`'s per-kind totals of the collectives inside a `shard_map` (their op_name
    holds `shard_map`: the MoE layers' dispatch under an `expert` axis), the others left out:
    the parser passes over every other collective as over an op of another kind."""
    return _collectives(parse_module(text), num_devices, hosts, shard_map_only=True)["by_kind"]


def group_size(attrs: str, num_devices: int) -> int:
    """Devices per replica group, from `replica_groups=` in any of XLA's spellings."""
    groups = replica_groups(attrs, num_devices)
    if groups is not None:
        return len(groups[0])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)
    if m:  # an axis spelling `replica_groups` does not read (a sub-axis): the sizes alone
        sizes = {k.strip("' "): int(v) for k, v in re.findall(r"'?([\w]+)'?=(\d+)", m.group(1))}
        names = [re.sub(r"[^\w].*", "", n.strip("' ")) for n in m.group(2).split(",")]
        return math.prod(sizes.get(n, 1) for n in names if n)
    return num_devices


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    """XLA's iota tile assignment `[dims]T(perm)`: arange reshaped to `dims`, transposed."""
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def replica_groups(attrs: str, num_devices: int) -> list[list[int]] | None:
    """The replica groups of a collective, each a list of device ids (positions in the
    program's device assignment), from `replica_groups=` in XLA's spellings: explicit
    (`{{0,1},{2,3}}`, `{}`: all devices), iota (`[2,4]<=[4,2]T(1,0)`) or mesh axes
    (`mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}`); for a collective-permute its
    source-target pairs. None where the spelling is not one of these."""
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if m:
        pairs = [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
        return pairs or None
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\]"
        r"(?:,\s*device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]*)\))?\))?\s*\{([^}]*)\}",
        attrs,
    )
    if m:
        axes = re.findall(r"'?(\w+)'?=(\d+)", m.group(1))
        names = [n.strip().strip("'") for n in m.group(4).split(",") if n.strip()]
        if not all(re.fullmatch(r"\w+", n) for n in names):
            return None  # sub-axes ('a':(1)2)
        order = [a for a, _ in axes]
        sizes = [int(n) for _, n in axes]
        if m.group(2):
            ids = _iota(ints(m.group(2)), ints(m.group(3)) or None).reshape(-1)
        else:
            ids = np.arange(math.prod(sizes))
        grid = ids.reshape(sizes)
        inner = [order.index(n) for n in names]
        outer = [i for i in range(len(order)) if i not in inner]
        width = math.prod(sizes[i] for i in inner)
        return grid.transpose(outer + inner).reshape(-1, width).tolist()
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]*)\))?", attrs)
    if m:
        shape = ints(m.group(1))
        return _iota(ints(m.group(2)), ints(m.group(3)) or None).reshape(shape).tolist()
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if m:
        groups = [ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
        return groups or [list(range(num_devices))]
    return None


def spans_hosts(groups: list[list[int]] | None, hosts: Sequence[int] | None) -> bool:
    """Whether a collective over `groups` crosses hosts, `hosts[i]` device i's host (None:
    one host; unknown groups cross as soon as there are several hosts)."""
    if hosts is None or len(set(hosts)) == 1:
        return False
    if groups is None:
        return True
    return any(len({hosts[i] for i in g if i < len(hosts)}) > 1 for g in groups)


@dataclasses.dataclass
class Op:
    kind: str
    result_bytes: int
    group: int
    phase: str  # forward, backward or other (from the op's metadata)
    channel: int | None = None  # XLA's channel_id: the pieces of one async op share it
    fused: bool = False  # inside a fusion (where TPU puts those pieces)
    crosses: bool = False  # a group spans hosts (`parse_hlo`'s `hosts`)

    @property
    def array_bytes(self) -> int:
        return self.result_bytes * (self.group if self.kind == "reduce-scatter" else 1)

    @property
    def ring_bytes(self) -> float:
        n, r = self.group, self.result_bytes
        if n <= 1:
            return 0.0
        if self.kind == "all-reduce":
            return 2 * (n - 1) / n * r
        if self.kind == "reduce-scatter":
            return float((n - 1) * r)
        if self.kind == "collective-permute":
            return float(r)
        return (n - 1) / n * r


def instructions(lines: Sequence[str]) -> Iterator[tuple[str, bool, tuple[str, str, str]]]:
    """`(name, is_root, (type, opcode, rest))` of each instruction of a computation."""
    for line in lines:
        m = INSTRUCTION_RE.match(line)
        if m:
            yield m.group(1), line.lstrip().startswith("ROOT"), split_type(m.group(2))


def operand_names(rest: str) -> list[str]:
    """Names of an instruction's operands (`opcode(%a, %b), attrs` -> [a, b])."""
    inner = rest.split("(", 1)[1].split(")", 1)[0] if "(" in rest else ""
    return re.findall(r"%([^\s,()]+)", inner)


def _trip_count(cond: list[str], init: str, defs: dict[str, tuple[str, str, str]]) -> int | None:
    """Trip count of a while loop without `known_trip_count` (TPU's compiled HLO): its
    condition is `ROOT compare(get-tuple-element(param, index=i), constant(N)),
    direction=LT` and element i of its init tuple is a constant k (through copies), so it
    runs N - k times (JAX's loops step their counter by one)."""
    cond_defs = {}
    root = None
    for name, is_root, parsed in instructions(cond):
        cond_defs[name] = parsed
        if is_root:
            root = parsed

    def constant(name: str, table: dict[str, tuple[str, str, str]]) -> int | None:
        while name in table and table[name][1] in ("copy", "bitcast", "convert"):
            name = operand_names(table[name][2])[0]
        if name in table and table[name][1] == "constant":
            m = re.match(r"constant\((-?\d+)\)", table[name][2])
            return int(m.group(1)) if m else None
        return None

    if root is None or root[1] != "compare" or "direction=LT" not in root[2]:
        return None
    counter, bound = (operand_names(root[2]) + [None, None])[:2]
    limit = constant(bound, cond_defs) if bound else None
    gte = cond_defs.get(counter)
    if limit is None or gte is None or gte[1] != "get-tuple-element":
        return None
    index = int(re.search(r"index=(\d+)", gte[2]).group(1))
    tuple_def = defs.get(init)
    if tuple_def is None or tuple_def[1] != "tuple":
        return None
    start = constant(operand_names(tuple_def[2])[index], defs)
    return None if start is None else limit - start


def loop_trips(
    rest: str, computations: dict[str, list[str]], defs: dict[str, tuple[str, str, str]]
) -> int | None:
    """How many times a while loop (its instruction's `rest`, `defs` its computation's
    instructions so far) runs its body: `known_trip_count`, else read from its condition
    (`_trip_count`); None when neither says."""
    trip = re.search(r'known_trip_count"?:\{"n":"(\d+)"', rest)
    if trip:
        return int(trip.group(1))
    cond = re.search(r"condition=%([^\s,]+)", rest).group(1)
    return _trip_count(computations.get(cond, []), operand_names(rest)[0], defs)


def module_computations(text: str) -> tuple[dict[str, list[str]], str]:
    """The module's computations (name -> instruction lines) and the ENTRY's name."""
    computations: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        m = COMPUTATION_RE.match(line)
        if m:
            current = m.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            computations[current].append(line)
    if entry is None:
        raise ValueError("No ENTRY computation in the HLO text.")
    return computations, entry


class Module:
    """A compiled module's HLO text parsed once, for the readers that share it (`parse_hlo`,
    `flops.matmul_costs`, `traffic.program_bytes`): its computations' lines and ENTRY
    (`module_computations`), each computation's `instructions` parsed on first use, every
    instruction's type by name, and `memo`, where a reader keeps what it derives from them."""

    def __init__(self, text: str) -> None:
        self.computations, self.entry = module_computations(text)
        self._instructions: dict[str | None, list[tuple[str, bool, tuple[str, str, str]]]] = {}
        self.memo: dict[Any, Any] = {}

    def instructions(self, comp: str | None) -> list[tuple[str, bool, tuple[str, str, str]]]:
        """`instructions` of computation `comp` (none where the module has no such one)."""
        parsed = self._instructions.get(comp)
        if parsed is None:
            parsed = list(instructions(self.computations.get(comp, [])))
            self._instructions[comp] = parsed
        return parsed

    @functools.cached_property
    def types(self) -> dict[str, str]:
        """Every instruction's type, by name."""
        return {
            name: parsed[0]
            for comp in self.computations
            for name, _, parsed in self.instructions(comp)
        }


@functools.lru_cache(maxsize=4)
def parse_module(text: str) -> Module:
    """`text` parsed (`Module`), once for the few modules read last: a planner's compiled
    step is read for its collectives, its products and its bytes, each from the same text."""
    return Module(text)


def first_dims(type_str: str) -> list[int]:
    """The dims of a type's first array (a tuple's first element)."""
    m = SHAPE_RE.search(type_str)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def ints(text: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text or "")]


def op_name(rest: str) -> str:
    """An instruction's `op_name` metadata (JAX's named scopes), or ''."""
    return next(iter(re.findall(r'op_name="([^"]*)"', rest)), "")


def async_result_bytes(kind: str, type_str: str) -> int:
    """The result's bytes of an async collective's start (XLA:GPU's, TPU's permute): an
    all-reduce's type is its result; a permute's (operand, result, context) holds one array;
    the others' are (operands, results), each an array or a tuple (several when combined; a
    ragged all-to-all's operands are its input, output and four offset arrays)."""
    if kind == "all-reduce":
        return type_bytes(type_str)
    if kind == "collective-permute":
        return type_bytes(SHAPE_RE.search(type_str).group(0))
    elements = _top_level(type_str)
    return type_bytes(elements[1] if len(elements) > 1 else type_str)


def _top_level(type_str: str) -> list[str]:
    """The elements of a tuple type (`(a, (b, c))` -> [a, (b, c)]); [type_str] if not one."""
    text = re.sub(r"/\*[^*]*\*/", "", type_str.strip())
    if not text.startswith("("):
        return [text]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        depth += ch in "({["
        depth -= ch in ")}]"
        if (ch == "," and depth == 1) or (depth == 0 and i > 0):
            out.append(text[start:i].strip())
            start = i + 1
        if depth == 0 and i > 0:
            break
    return out


def parse_hlo(text: str, num_devices: int, hosts: Sequence[int] | None = None) -> dict[str, Any]:
    """Collectives per train step: each op with the product of its enclosing trip counts.

    Besides the plain ops, TPU's compiled reduce-scatter is read: a custom fusion calling
    `%all-reduce-scatter...` (an all-reduce whose result is cut in the same kernel) counts
    as one reduce-scatter whose result is the fusion's. `hosts[i]`: the host of device i
    (its position in the program's device assignment); `host_ring_bytes` are the ring bytes
    of the ops whose groups span hosts (over the slower network), of `ring_bytes`."""
    return _collectives(parse_module(text), num_devices, hosts)


def _collectives(
    module: Module, num_devices: int, hosts: Sequence[int] | None, shard_map_only: bool = False
) -> dict[str, Any]:
    """`parse_hlo` of a parsed module; with `shard_map_only`, a collective whose line holds
    neither `shard_map` nor `ragged-all-to-all` (XLA:GPU prints its ragged all-to-all
    without metadata: flaxlm's is the MoE's) is read as an op of no collective kind."""
    computations, entry = module.computations, module.entry
    unparsed: list[str] = []
    memo: dict[str, list[tuple[Op, int]]] = {}

    def phase_of(rest: str) -> str:
        name = op_name(rest)
        if "transpose(" in name:
            return "backward"
        return "forward" if "jvp(" in name else "other"

    def channel_of(attrs: str) -> int | None:
        m = re.search(r"channel_id=(\d+)", attrs)
        return int(m.group(1)) if m else None

    def groups_of(attrs: str) -> tuple[int, bool]:
        """A collective's devices per group and whether a group spans hosts (its groups
        read once)."""
        groups = replica_groups(attrs, num_devices)
        size = len(groups[0]) if groups is not None else group_size(attrs, num_devices)
        return size, spans_hosts(groups, hosts)

    def one_per_channel(ops: list[tuple[Op, int]]) -> list[tuple[Op, int]]:
        """TPU splits an async collective into a start, continuation fusions overlapping
        compute and a done, each holding the op (its kind and shape) with one channel_id:
        count it once (as the reduce-scatter where one of them is, in place of the
        all-reduce of the whole it cuts). Ops of another kind or size are distinct whatever
        their channel_id: every collective a `shard_map` emits has channel 1, as has every
        collective-permute; unfused ops are all distinct."""
        first: dict[tuple[int, str, int], int] = {}
        out: list[tuple[Op, int]] = []
        for op, count in ops:
            if op.channel is None or not (op.fused or op.kind == "reduce-scatter"):
                out.append((op, count))
                continue
            key = (op.channel, op.kind, op.result_bytes)
            whole = (op.channel, "all-reduce", op.array_bytes)
            if key in first:
                continue
            if op.kind == "reduce-scatter" and whole in first:
                out[first[whole]] = (op, count)
                first[key] = first[whole]
                continue
            first[key] = len(out)
            if op.kind == "reduce-scatter":  # its all-reduce pieces, if any come later
                first[whole] = len(out)
            out.append((op, count))
        return out

    def ops_of(name: str) -> list[tuple[Op, int]]:
        if name in memo:
            return memo[name]
        memo[name] = []  # guards against cycles
        out: list[tuple[Op, int]] = []
        defs: dict[str, tuple[str, str, str]] = {}
        for instruction, _, parsed in module.instructions(name):
            type_str, opcode, rest = defs[instruction] = parsed
            callees = re.findall(r"(?:calls|branch_computations)=\{?%([^\s,}]+)", rest)
            collective = opcode.removesuffix("-start") in COLLECTIVES
            if collective and shard_map_only:
                line = (instruction, type_str, rest)
                collective = any("shard_map" in x or "ragged-all-to-all" in x for x in line)
            if collective:
                kind = opcode.removesuffix("-start")
                nbytes = type_bytes(type_str)
                if opcode.endswith("-start"):
                    nbytes = async_result_bytes(kind, type_str)
                group, crosses = groups_of(rest)
                op = Op(kind, nbytes, group, phase_of(rest), channel_of(rest), crosses=crosses)
                out.append((op, 1))
            elif opcode == "fusion" and callees and callees[0].startswith("all-reduce-scatter"):
                inner = " ".join(computations.get(callees[0], []))
                group, crosses = groups_of(inner)
                op = Op("reduce-scatter", type_bytes(type_str), group, phase_of(rest))
                op = dataclasses.replace(op, channel=channel_of(inner), crosses=crosses)
                out.append((op, 1))
            elif opcode == "while":
                body = re.search(r"body=%([^\s,]+)", rest).group(1)
                count = loop_trips(rest, computations, defs)
                if count is None:
                    unparsed.append(
                        f"{instruction} (while without a known trip count: counted once)"
                    )
                    count = 1
                out += [(op, c * count) for op, c in ops_of(body)]
            else:
                for o, c in (x for callee in callees for x in ops_of(callee)):
                    if opcode == "fusion" and not o.fused:  # (else the op as it is: equal)
                        o = dataclasses.replace(o, fused=True)
                    out.append((o, c))
        memo[name] = out = one_per_channel(out)
        return out

    ops = ops_of(entry)
    totals: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: {"count": 0, "array_bytes": 0, "ring_bytes": 0.0, "host_ring_bytes": 0.0}
    )
    for op, count in ops:
        for key in (op.kind, f"{op.kind}/{op.phase}"):
            totals[key]["count"] += count
            totals[key]["array_bytes"] += count * op.array_bytes
            totals[key]["ring_bytes"] += count * op.ring_bytes
            totals[key]["host_ring_bytes"] += count * op.ring_bytes * op.crosses
    return {
        "by_kind": dict(totals),
        "array_bytes": sum(c * op.array_bytes for op, c in ops),
        "ring_bytes": sum(c * op.ring_bytes for op, c in ops),
        "host_ring_bytes": sum(c * op.ring_bytes for op, c in ops if op.crosses),
        "unparsed": unparsed,
    }
