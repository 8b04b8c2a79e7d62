"""The matrix products of a compiled program, read from its HLO text: what the planner
charges a step's compute with where XLA's cost analysis is empty (XLA:GPU's programs
compiled ahead of time) or leaves out library calls (cuBLAS, cuDNN, Mosaic GPU kernels).

Loops: XLA's `cost_analysis` counts a while loop's body once, whatever its trip count. The
planner prices the two outer loops of a train step (the microbatches', the scanned layers':
named `layers.MICROBATCH_LOOP` and `layers.LAYER_LOOP`) from calibration compiles, so their
bodies count once here too; any other loop (a chunked scan inside a layer: the delta rules'
chunks, 'chunked' attention's blocks, a chunked loss's) counts as many times as it runs
(`inner_loops=True`), which XLA's figure leaves out (`aot.CompiledStep.cost` adds it).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable

from flaxlm.models.attention import CUDNN_STAND_IN
from flaxlm.models.grouped_matmul import SCOPE as GROUPED_SCOPE  # its kernels' named scope
from flaxlm.models.layers import LAYER_LOOP, MICROBATCH_LOOP
from flaxlm.plan import hlo

CALIBRATED_LOOP_RE = re.compile(rf"\b({MICROBATCH_LOOP}|{LAYER_LOOP})\)*/while$")
CALLEES_RE = re.compile(r"\b(?:calls|to_apply|true_computation|false_computation)=%([^\s,}]+)")
FIELDS = ("dot_flops", "custom_flops", "custom_bytes", "custom_calls")


def loop_runs(rest: str, computations: dict[str, list[str]], defs: dict) -> int:
    """How many times one run of a while loop (its instruction's `rest`) runs its body for
    the planner: once for the microbatches' and the scanned layers' loops (calibrated), else
    its trip count (`hlo.loop_trips`; once where it cannot be read)."""
    if CALIBRATED_LOOP_RE.search(hlo.op_name(rest)):
        return 1
    return hlo.loop_trips(rest, computations, defs) or 1


def kernel_loop_runs(rest: str, computations: dict[str, list[str]], defs: dict) -> int:
    """`loop_runs` for the bytes a loop's kernels move (`traffic.program_bytes`), but once for
    the loops of the 'chunked' attention that stands in for cuDNN's in a program compiled
    for a GPU from a host without one (`attention.CUDNN_STAND_IN`): cuDNN's one kernel keeps
    its blocks of scores on chip, where XLA's kernels for the stand-in's blocks would write
    them to memory and read them back at every trip."""
    if CUDNN_STAND_IN in hlo.op_name(rest):
        return 1
    return loop_runs(rest, computations, defs)


def matmul_costs(text: str, inner_loops: bool = True) -> dict[str, float]:
    """The matrix products of a compiled module, each computation counted as often as the
    program runs it: a loop's body its `loop_runs` where `inner_loops`, once where not (as
    XLA's `cost_analysis` counts it); each branch of a conditional once (an upper bound).

    - `dot_flops`: its `dot` instructions (fused ones too), which `cost_analysis` counts.
    - `custom_flops`, `custom_bytes`, `custom_calls`: the library calls an NVIDIA GPU's
      module makes instead, cuBLAS gemms (`__cublas$gemm`, `__cublas$lt$matmul...`) and cuDNN
      flash attention (`__cudnn$fmha...`, forward 2 products, backward 5: the scores again,
      then dP, dV, dQ, dK; halved under a causal mask, whose hidden blocks cuDNN skips); the
      bytes are their operands' and results' (a workspace not); the dropless experts' grouped
      matmuls, Mosaic GPU kernels (`grouped_matmul`, under its named scope), 2 x m x k x n
      for the m rows of their buffer (the kernels skip rows past the groups: an upper
      bound where a buffer is not full). XLA's generic cost analysis
      charges a custom call -1 FLOPs and -1 bytes (jax-ml/jax#22249: a 73x256 dense layer
      counted 511 FLOPs), so `with_library_calls` adds these where it did.
    """
    module = hlo.parse_module(text)

    @functools.cache
    def costs(comp: str) -> tuple[float, ...]:
        total = [0.0] * len(FIELDS)
        for own, called in _terms(module, comp):
            for callee, runs in called:
                n = runs() if runs is not None and inner_loops else 1
                own = [a + n * b for a, b in zip(own, costs(callee))]
            total = [a + b for a, b in zip(total, own)]
        return tuple(total)

    return dict(zip(FIELDS, costs(module.entry)))


_Term = tuple[list[float], list[tuple[str, Callable[[], int] | None]]]


def _terms(module: hlo.Module, comp: str) -> list[_Term]:
    """Each instruction of `comp`: its own costs (`_instruction`) and the computations it
    calls, each with its runs (a while loop's body: `loop_runs`, read once when first
    asked; None: once). Kept in the module's memo for each `matmul_costs` of it."""
    key = ("flops.terms", comp)
    if key in module.memo:
        return module.memo[key]
    out: list[_Term] = []
    defs: dict[str, tuple[str, str, str]] = {}
    for name, _, parsed in module.instructions(comp):
        defs[name] = parsed
        type_str, opcode, rest = parsed
        own = _instruction(type_str, opcode, rest, module.types)
        called: list[tuple[str, Callable[[], int] | None]] = [
            (c, None) for c in CALLEES_RE.findall(rest)
        ]
        if opcode == "while":
            # the computation's instructions so far, as the loop's runs are read from them
            runs = functools.partial(loop_runs, rest, module.computations, dict(defs))
            called = [(re.search(r"body=%([^\s,]+)", rest).group(1), functools.cache(runs))]
        branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
        if branches:
            called = [(c, None) for c in re.findall(r"%([^\s,]+)", branches.group(1))]
        out.append((own, called))
    module.memo[key] = out
    return out


def _instruction(type_str: str, opcode: str, rest: str, types: dict[str, str]) -> list[float]:
    """(dot FLOPs, library FLOPs, library bytes, library calls) of one instruction."""
    if opcode not in ("dot", "custom-call"):
        return [0.0] * len(FIELDS)
    operands = [types.get(o, "") for o in hlo.operand_names(rest)]
    if opcode == "dot":
        lhs = hlo.first_dims(operands[0]) if operands else []
        m = re.search(r"lhs_contracting_dims=\{([^}]*)\}", rest)
        contracted = _contracted(lhs, hlo.ints(m and m.group(1)))
        return [2.0 * math.prod(hlo.first_dims(type_str)) * contracted, 0.0, 0.0, 0.0]
    target = re.search(r'custom_call_target="([^"]*)"', rest)
    target = target.group(1) if target else ""
    if target.startswith("__cublas$"):
        m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
        lhs = hlo.first_dims(operands[0]) if operands else []
        k = _contracted(lhs, hlo.ints(m and m.group(1)))
        work = 2.0 * math.prod(hlo.first_dims(type_str)) * k
    elif target.startswith("mosaic_gpu") and GROUPED_SCOPE in hlo.op_name(rest):
        work = _grouped_flops([type_str, *operands])
    elif target.startswith("__cudnn$fmha"):
        m = re.search(r'"intermediate_tensor_shape":\{[^{}]*?"dimensions":\[([^\]]*)\]', rest)
        scores = math.prod(hlo.ints(m and m.group(1)))  # batch x heads x q_len x kv_len
        head_dim = (hlo.first_dims(operands[0]) or [0])[-1]
        work = (10.0 if "Backward" in target else 4.0) * scores * head_dim
        if re.search(r'"mask_type":"[A-Z_]*CAUSAL"', rest):
            work /= 2
    else:
        return [0.0, 0.0, 0.0, 1.0]  # a call whose work is unknown: its -1 undone only
    data = [t for t in [*operands, *_tuple_elements(type_str)] if not t.startswith("s8[")]
    return [0.0, work, float(sum(hlo.type_bytes(t) for t in data)), 1.0]


def _grouped_flops(types: list[str]) -> float:
    """2 x m x k x n of a grouped matmul's rows [m, .] and per-group [g, k, n] types."""
    dims = [hlo.first_dims(t) for t in types if not t.startswith("s32")]
    rows = max(d[0] for d in dims if len(d) == 2)
    return 2.0 * rows * math.prod(next(d for d in dims if len(d) == 3)[1:])


def _contracted(lhs: list[int], dims: list[int]) -> int:
    return math.prod(lhs[d] for d in dims if d < len(lhs))


def _tuple_elements(type_str: str) -> list[str]:
    return [m.group(0) for m in hlo.SHAPE_RE.finditer(type_str)]


def with_library_calls(cost: dict[str, float], matmuls: dict[str, float]) -> dict[str, float]:
    """XLA's `cost_analysis` (`flops`, `bytes accessed`) with the library calls of
    `matmul_costs` (`inner_loops=False`, as XLA counts) added, when it left them out: when
    its FLOPs fall short of its module's products (`dot_flops` + half of `custom_flops`;
    elementwise work is a few percent of a train step's), each known call is added and each
    call's -1 undone."""
    if not matmuls["custom_calls"] or cost["flops"] >= (
        matmuls["dot_flops"] + matmuls["custom_flops"] / 2
    ):
        return dict(cost)
    calls = matmuls["custom_calls"]
    return {
        **cost,
        "flops": cost["flops"] + matmuls["custom_flops"] + calls,
        "bytes accessed": cost["bytes accessed"] + matmuls["custom_bytes"] + calls,
    }
