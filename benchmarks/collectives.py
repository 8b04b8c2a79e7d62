"""Bytes moved by collectives in flaxlm's train step, read from the compiled HLO, vs theory.

flaxlm's own train step (`make_train_step` partitioned by `Setup.partition_train_step`) for a
small GPT-J is lowered and compiled on abstract inputs on 8 devices under dp, fsdp and tp
(gin/partitioning/*.gin); `compiled.as_text()` is parsed for all-gather, reduce-scatter,
all-reduce (and all-to-all, collective-permute), each op counted as many times as the
while loops around it run (`known_trip_count`, e.g. the scanned layers).

Two units per op, n = devices in its group, R = bytes of its result on one device:
- array bytes: the size of the whole array the collective is about (all-gather: R;
  reduce-scatter: its input, n x R; all-reduce: R);
- ring bytes: what one device sends in a ring implementation (all-gather (n-1)/n x R,
  reduce-scatter (n-1) x R, all-reduce 2 (n-1)/n x R); the ratio to theory uses these.

Theory (P = bytes of a param, A = bytes of a [batch, length, embed] activation):
- DP: one all-reduce of every gradient.
- FSDP: each sharded param all-gathered in forward and again in backward, its gradient
  reduce-scattered; params left whole (axes not mapped to fsdp) have their gradient
  all-reduced.
- TP (Megatron): per layer two all-reduces of A in forward and two in backward, plus the
  vocab-split embedding (forward) and head (backward) one each.
- Ring attention (`--sequence S`, fsdp only: mesh (1, n/S, S, 1)): FSDP's, plus per layer
  and device S - 1 sends of its K and V shards in forward, in backward S - 1 of K and V and
  S of their float32 gradients (which come home at the end).

Target: measured <= 1.1 x theory (and, under `--sequence`, the collective-permutes alone).

    python benchmarks/collectives.py --json /tmp/collectives.json
    python benchmarks/collectives.py --partitionings fsdp --sequence 8
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402

bench_common.force_host_devices(8)

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from flaxlm.models.base import DecoderOnlyModel  # noqa: E402
from flaxlm.models.gptj import GPTJConfig  # noqa: E402

TARGET = 1.1
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
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


def group_size(attrs: str, num_devices: int) -> int:
    """Devices per replica group, from `replica_groups=` in any of XLA's spellings."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = {k.strip("' "): int(v) for k, v in re.findall(r"'?([\w]+)'?=(\d+)", m.group(1))}
        names = [n.strip("' ") for n in m.group(2).split(",") if n.strip()]
        return math.prod(sizes[n] for n in names)
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    return num_devices  # `replica_groups={}`: all devices


@dataclasses.dataclass
class Op:
    kind: str
    result_bytes: int
    group: int
    phase: str  # forward, backward or other (from the op's metadata)
    channel: int | None = None  # XLA's channel_id: the pieces of one async op share it
    fused: bool = False  # inside a fusion (where TPU puts those pieces)

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


def _instructions(lines: Sequence[str]) -> Iterator[tuple[str, bool, tuple[str, str, str]]]:
    """`(name, is_root, (type, opcode, rest))` of each instruction of a computation."""
    for line in lines:
        m = INSTRUCTION_RE.match(line)
        if m:
            yield m.group(1), line.lstrip().startswith("ROOT"), split_type(m.group(2))


def _operands(rest: str) -> list[str]:
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
    for name, is_root, parsed in _instructions(cond):
        cond_defs[name] = parsed
        if is_root:
            root = parsed

    def constant(name: str, table: dict[str, tuple[str, str, str]]) -> int | None:
        while name in table and table[name][1] in ("copy", "bitcast", "convert"):
            name = _operands(table[name][2])[0]
        if name in table and table[name][1] == "constant":
            m = re.match(r"constant\((-?\d+)\)", table[name][2])
            return int(m.group(1)) if m else None
        return None

    if root is None or root[1] != "compare" or "direction=LT" not in root[2]:
        return None
    counter, bound = (_operands(root[2]) + [None, None])[:2]
    limit = constant(bound, cond_defs) if bound else None
    gte = cond_defs.get(counter)
    if limit is None or gte is None or gte[1] != "get-tuple-element":
        return None
    index = int(re.search(r"index=(\d+)", gte[2]).group(1))
    tuple_def = defs.get(init)
    if tuple_def is None or tuple_def[1] != "tuple":
        return None
    start = constant(_operands(tuple_def[2])[index], defs)
    return None if start is None else limit - start


def parse_hlo(text: str, num_devices: int) -> dict[str, Any]:
    """Collectives per train step: each op with the product of its enclosing trip counts.

    Besides the plain ops, TPU's compiled reduce-scatter is read: a custom fusion calling
    `%all-reduce-scatter...` (an all-reduce whose result is cut in the same kernel) counts
    as one reduce-scatter whose result is the fusion's."""
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

    unparsed: list[str] = []
    memo: dict[str, list[tuple[Op, int]]] = {}

    def phase_of(rest: str) -> str:
        op_name = re.search(r'op_name="([^"]*)"', rest)
        op_name = op_name.group(1) if op_name else ""
        if "transpose(" in op_name:
            return "backward"
        return "forward" if "jvp(" in op_name else "other"

    def channel_of(attrs: str) -> int | None:
        m = re.search(r"channel_id=(\d+)", attrs)
        return int(m.group(1)) if m else None

    def one_per_channel(ops: list[tuple[Op, int]]) -> list[tuple[Op, int]]:
        """TPU splits an async collective into a start, continuation fusions overlapping
        compute and a done, each holding the op with one channel_id: count it once (as the
        reduce-scatter where one of them is). Other ops are distinct whatever their
        channel_id (every collective-permute has channel 1)."""
        first: dict[int, int] = {}
        out: list[tuple[Op, int]] = []
        for op, count in ops:
            if op.channel is None or not (op.fused or op.kind == "reduce-scatter"):
                out.append((op, count))
            elif op.channel not in first:
                first[op.channel] = len(out)
                out.append((op, count))
            elif op.kind == "reduce-scatter":
                out[first[op.channel]] = (op, count)
        return out

    def ops_of(name: str) -> list[tuple[Op, int]]:
        if name in memo:
            return memo[name]
        memo[name] = []  # guards against cycles
        out: list[tuple[Op, int]] = []
        defs: dict[str, tuple[str, str, str]] = {}
        for instruction, _, parsed in _instructions(computations.get(name, [])):
            type_str, opcode, rest = defs[instruction] = parsed
            callees = re.findall(r"(?:calls|branch_computations)=\{?%([^\s,}]+)", rest)
            if opcode in (*COLLECTIVES, "collective-permute-start"):
                # TPU's async permute is typed (operand, result, context): one array's bytes
                start = opcode.endswith("-start")
                nbytes = type_bytes(SHAPE_RE.search(type_str).group(0) if start else type_str)
                group = group_size(rest, num_devices)
                kind = opcode.removesuffix("-start")
                out.append((Op(kind, nbytes, group, phase_of(rest), channel_of(rest)), 1))
            elif opcode == "fusion" and callees and callees[0].startswith("all-reduce-scatter"):
                inner = " ".join(computations.get(callees[0], []))
                group = group_size(inner, num_devices)
                op = Op("reduce-scatter", type_bytes(type_str), group, phase_of(rest))
                out.append((dataclasses.replace(op, channel=channel_of(inner)), 1))
            elif any(opcode == c + "-start" for c in COLLECTIVES):
                unparsed.append(instruction)
            elif opcode == "while":
                body = re.search(r"body=%([^\s,]+)", rest).group(1)
                trip = re.search(r'known_trip_count"?:\{"n":"(\d+)"', rest)
                count = int(trip.group(1)) if trip else None
                if count is None:
                    cond = re.search(r"condition=%([^\s,]+)", rest).group(1)
                    count = _trip_count(computations.get(cond, []), _operands(rest)[0], defs)
                if count is None:
                    unparsed.append(
                        f"{instruction} (while without a known trip count: counted once)"
                    )
                    count = 1
                out += [(op, c * count) for op, c in ops_of(body)]
            else:
                for o, c in (x for callee in callees for x in ops_of(callee)):
                    out.append((dataclasses.replace(o, fused=o.fused or opcode == "fusion"), c))
        memo[name] = out = one_per_channel(out)
        return out

    ops = ops_of(entry)
    totals: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: {"count": 0, "array_bytes": 0, "ring_bytes": 0.0}
    )
    for op, count in ops:
        for key in (op.kind, f"{op.kind}/{op.phase}"):
            totals[key]["count"] += count
            totals[key]["array_bytes"] += count * op.array_bytes
            totals[key]["ring_bytes"] += count * op.ring_bytes
    return {
        "by_kind": dict(totals),
        "array_bytes": sum(c * op.array_bytes for op, c in ops),
        "ring_bytes": sum(c * op.ring_bytes for op, c in ops),
        "unparsed": unparsed,
    }


# ---------------------------------------------------------------------------- theory


def theory(
    name: str, setup: Any, config: GPTJConfig, batch_size: int, seq_len: int, n: int
) -> dict[str, Any]:
    """Theoretical array and ring bytes per device per step (see the module docstring)."""
    mesh = dict(zip(setup.partitioner.mesh_axis_names, setup.partitioner.mesh_shape))
    params = setup.abstract_state.params
    leaves = jax.tree.leaves(params)
    whole = sum(
        math.prod(x.shape) * np.dtype(x.dtype).itemsize
        for x in leaves
        if tuple(x.sharding.shard_shape(x.shape)) == tuple(x.shape)
    )
    split = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves) - whole
    ring = (n - 1) / n
    if name == "dp":
        parts = {"all-reduce gradients": (whole + split, 2 * ring * (whole + split))}
    elif name == "fsdp":
        parts = {
            "all-gather params forward": (split, ring * split),
            "all-gather params backward": (split, ring * split),
            "reduce-scatter gradients": (split, ring * split),
            "all-reduce gradients of whole params": (whole, 2 * ring * whole),
        }
    elif name == "tp":
        act = batch_size * seq_len * config.hidden_size * np.dtype(config.dtype).itemsize
        count = 4 * config.num_layers + 2
        parts = {
            f"all-reduce activations ({count} = 4 x {config.num_layers} layers + 2)": (
                count * act,
                2 * ring * count * act,
            )
        }
    else:
        raise ValueError(f"No theory for partitioning {name!r}; expected dp, fsdp or tp.")
    s = mesh.get("sequence", 1)
    if s > 1:  # K and V (GPT-J: as many k/v heads as q) of one device's rows and positions
        kv = 2 * batch_size // (n // s) * seq_len // s * config.hidden_size
        kv *= np.dtype(config.dtype).itemsize
        fwd, bwd = (s - 1) * kv, (s - 1) * kv + s * kv * 4 // np.dtype(config.dtype).itemsize
        layers = config.num_layers
        parts[f"ring K, V forward ({s - 1} x {layers} layers)"] = (layers * fwd,) * 2
        parts[f"ring K, V ({s - 1} x), f32 dK, dV ({s} x) backward"] = (layers * bwd,) * 2
    return {
        "parts": {k: {"array_bytes": a, "ring_bytes": r} for k, (a, r) in parts.items()},
        "array_bytes": sum(a for a, _ in parts.values()),
        "ring_bytes": sum(r for _, r in parts.values()),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--partitionings", nargs="+", choices=("dp", "fsdp", "tp"), default=["dp", "fsdp", "tp"]
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    bench_common.add_sequence_arg(p)
    bench_common.add_target_args(p)
    p.add_argument("--dump-hlo", metavar="DIR", help="also write each compiled HLO text here")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON here")
    args = p.parse_args(argv)
    for k in ("layers", "hidden", "heads", "vocab", "batch_size", "seq_len"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be at least 1.")
    if args.sequence > 1 and (args.partitionings != ["fsdp"] or args.seq_len % (2 * args.sequence)):
        p.error("--sequence: only with --partitionings fsdp, and a multiple of 2 x it as length.")
    return args


def check_divisible(args: argparse.Namespace, n: int) -> None:
    rows = n // args.sequence  # the data-parallel degree
    if args.heads % n or args.vocab % n or args.hidden % n or args.batch_size % rows:
        raise SystemExit(
            f"--heads, --vocab, --hidden and --batch-size must be multiples of {n} (devices)."
        )


def mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    head_dim = args.hidden // args.heads
    config = GPTJConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        rotary_dim=min(32, head_dim - head_dim % 2),
        dtype="float32",
        param_dtype="float32",
        remat_policy="none",
        scan_layers=args.scan_layers,
    )
    model = DecoderOnlyModel(config)
    devices = bench_common.target_devices(args)
    n = len(devices)
    check_divisible(args, n)
    rows = []
    for name in args.partitionings:
        print(f"compiling {name} ...", flush=True)
        partitioner = bench_common.make_partitioner(name, devices, args.sequence)
        step = bench_common.CompiledStep(
            model,
            partitioner,
            args.batch_size,
            args.seq_len,
            matmul_precision=args.matmul_precision,
        )
        text = step.compiled.as_text()
        if args.dump_hlo:
            os.makedirs(args.dump_hlo, exist_ok=True)
            with open(os.path.join(args.dump_hlo, f"{name}.hlo.txt"), "w") as f:
                f.write(text)
        measured = parse_hlo(text, n)
        expected = theory(name, step.setup, config, args.batch_size, args.seq_len, n)
        ratio = measured["ring_bytes"] / expected["ring_bytes"]
        ring = {k: v for k, v in expected["parts"].items() if k.startswith("ring")}
        rows.append(
            {
                "partitioning": name,
                "mesh": dict(zip(partitioner.mesh_axis_names, partitioner.mesh_shape)),
                "measured": measured,
                "theory": expected,
                "ratio": ratio,
                "array_ratio": measured["array_bytes"] / expected["array_bytes"],
                "pass": ratio <= TARGET,
            }
        )
        if ring:  # the ring's collective-permutes alone, against their theory
            permutes = measured["by_kind"].get("collective-permute", {"ring_bytes": 0.0})
            ring_ratio = permutes["ring_bytes"] / sum(t["ring_bytes"] for t in ring.values())
            rows[-1].update(ring_ratio=ring_ratio, ring_pass=1 / TARGET <= ring_ratio <= TARGET)

    print(
        f"\nGPT-J {args.layers}x{args.hidden} ({args.heads} heads, vocab {args.vocab}), "
        f"B{args.batch_size}xL{args.seq_len}, float32, scan_layers={args.scan_layers}, "
        f"sequence={args.sequence}, "
        f"{bench_common.machine_description(devices, args.tpu_topology)}, matmul precision "
        f"{args.matmul_precision or 'default'}; MiB per device per step\n"
    )
    header = ["partitioning", "collective", "count", "array MiB", "ring MiB"]
    table = []
    for r in rows:
        for kind, t in sorted(r["measured"]["by_kind"].items()):
            table.append(
                [r["partitioning"], kind, t["count"], mib(t["array_bytes"]), mib(t["ring_bytes"])]
            )
        for part, t in r["theory"]["parts"].items():
            row = [r["partitioning"], f"theory: {part}", "", mib(t["array_bytes"])]
            table.append([*row, mib(t["ring_bytes"])])
    bench_common.print_table(header, table)
    print()
    summary = []
    for r in rows:
        summary.append(
            [
                r["partitioning"],
                mib(r["measured"]["ring_bytes"]),
                mib(r["theory"]["ring_bytes"]),
                f"{r['ratio']:.3f}",
                f"{r['array_ratio']:.3f}",
                f"{'PASS' if r['pass'] else 'FAIL'} (<= {TARGET})",
            ]
        )
        for u in r["measured"]["unparsed"]:
            print(f"  note {r['partitioning']}: {u}")
    bench_common.print_table(
        [
            "partitioning",
            "measured ring MiB",
            "theory ring MiB",
            "ratio",
            "array-bytes ratio",
            "target",
        ],
        summary,
    )
    for r in (r for r in rows if "ring_ratio" in r):
        verdict = f"{'PASS' if r['ring_pass'] else 'FAIL'} (within {TARGET}x)"
        print(f"\nring (collective-permutes) / theory: {r['ring_ratio']:.3f} {verdict}")
    results = bench_common.run_record("collectives.py", args, argv, devices, rows=rows)
    bench_common.write_json(results, args.json)
    return results


if __name__ == "__main__":
    main()
