"""The grouped matmul of the dropless experts (`experts.grouped_experts`): rows sorted by
expert, each group of rows times its expert's weights, `x [m, k] . w[g] [k, n]` for the rows
of group g, with its gradients.

Two ways to run it (`MoEOptions.grouped_matmul`):

- 'xla': `jax.lax.ragged_dot`, differentiated by JAX. XLA:CPU runs it densely (every row
  against every group's weights), libtpu natively forward (not its weights' gradient), and
  XLA:GPU (jax 0.11.2) lowers it to a dense masked batched dot that does not fit at
  Qwen3-30B-A3B's shape (benchmarks/HISTORY.md, "Fourth session");
- 'mosaic_gpu': JAX's own Pallas Mosaic GPU kernels for Hopper
  (`jax.experimental.pallas.ops.gpu`: `ragged_dot_mgpu` forward and for the rows' gradient,
  `transposed_ragged_dot_mgpu` for the weights' gradient, where the groups are the
  contracted dimension), wired into one `jax.custom_vjp`; bfloat16 or float16 only.

'auto' takes 'mosaic_gpu' on an NVIDIA GPU of compute capability 9.x (H100, H200) for
bfloat16/float16 operands whose widths the kernels' tiles divide, 'xla' otherwise. Which GPU
is the one compiled for (`hopper`): the mesh's in JAX's context, so that a cluster compiled
ahead of time from a host without a GPU (the planner's `h100:16x8`) gets the kernels it
would run, not XLA's dense fallback (whose buffers, every local expert over every row, made
the planner's MoE figures for GPUs tens of GiB too large until 2026-12-06).

Rows past the groups (`sum(sizes) < m`: the assignments of experts on other devices under
expert parallelism) come out zero both ways: the kernels leave them unwritten, so the
custom VJP masks them (`_zero_past`), forward and in the rows' gradient, unless the caller
says every row is grouped (`all_grouped`: one device's experts are all the experts).
Measured on an H200 (benchmarks/HISTORY.md, "Sixteenth session"): Qwen3-30B-A3B cut to 8
layers trains at 32.7% MFU through the kernels, `capacity` experts at 27.7%.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import types
from collections.abc import Callable
from typing import Any, NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp

from flaxlm.models import layers

Array = jax.Array

GROUPED_MATMULS = ("auto", "xla", "mosaic_gpu")
# The kernels run under this named scope: the planner counts their FLOPs by it
# (`plan.flops.matmul_costs`), as XLA's cost analysis counts none of a custom call's.
SCOPE = "grouped_matmul"
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)


class Kernels(NamedTuple):
    """The three grouped products a custom VJP needs (rows past the groups: any value).

    forward(x [m, k], w [g, k, n], sizes [g]) -> [m, n];
    rows_grad(dy [m, n], w [g, k, n], sizes) -> [m, k]: each group's rows times w[g].T;
    weights_grad(x [m, k], dy [m, n], sizes) -> [g, k, n]: x[rows of g].T . dy[rows of g].
    """

    forward: Callable[[Array, Array, Array], Array]
    rows_grad: Callable[[Array, Array, Array], Array]
    weights_grad: Callable[[Array, Array, Array], Array]


def varying(x: Array) -> frozenset:
    """The manual mesh axes `x` varies over inside a `shard_map` (empty outside one)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10
    if manual is not None:
        return frozenset(getattr(manual, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def vary(x: Array, axes: frozenset) -> Array:
    """`x` typed as varying over `axes` too (a cast: no data moves). A Pallas kernel's
    output inside a `shard_map` comes out typed as varying over none, where its operands'
    values vary: its custom VJP must give each cotangent its primal's type."""
    missing = tuple(sorted(axes - varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _zero_past(out: Array, sizes: Array) -> Array:
    """`out` with its rows past the groups zeroed."""
    grouped = jnp.arange(out.shape[0])[:, None] < jnp.sum(sizes)
    return jnp.where(grouped, out, jnp.zeros((), out.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def kernel_ragged_dot(
    x: Array, w: Array, sizes: Array, kernels: Kernels, all_grouped: bool = False
) -> Array:
    """`jax.lax.ragged_dot(x, w, sizes)` through `kernels`, differentiable in x and w (all
    three typed as varying over the same mesh axes inside a `shard_map`: `ragged_dot`).
    `all_grouped`: the sizes sum to every row, so none is past the groups to zero."""
    out = vary(kernels.forward(x, w, sizes), varying(x))
    return out if all_grouped else _zero_past(out, sizes)


def _forward(
    x: Array, w: Array, sizes: Array, kernels: Kernels, all_grouped: bool
) -> tuple[Array, tuple]:
    return kernel_ragged_dot(x, w, sizes, kernels, all_grouped), (x, w, sizes)


def _backward(kernels: Kernels, all_grouped: bool, residuals: tuple, dy: Array) -> tuple:
    x, w, sizes = residuals
    dy = dy.astype(x.dtype)
    dx = vary(kernels.rows_grad(dy, w, sizes), varying(x))
    dx = dx if all_grouped else _zero_past(dx, sizes)
    dw = vary(kernels.weights_grad(x, dy, sizes), varying(w))
    return dx.astype(x.dtype), dw.astype(w.dtype), None


kernel_ragged_dot.defvjp(_forward, _backward)


# ------------------------------------------------------------------ Mosaic GPU (Hopper)


# The kernels' tiles: `ragged_dot_mgpu.ragged_dot`'s (the forward and the rows' gradient)
# and `transposed_ragged_dot_mgpu.transposed_ragged_dot`'s (the weights' gradient) keyword
# arguments. A block that does not divide its width falls back to 64 (`_fit`);
# benchmarks/grouped_matmul.py --tune measures others on a GPU (HISTORY.md).
TILES: dict[str, dict[str, int]] = {
    "ragged": dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=6, grid_block_n=2),
    "transposed": dict(
        block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1
    ),
}


def _fit(block: int, width: int) -> int | None:
    """`block` if it divides `width`, else the largest of 128 and 64 that does (None: neither)."""
    return block if width % block == 0 else next((t for t in (128, 64) if width % t == 0), None)


def _accepted(fn: Callable, **kwargs: object) -> dict:
    """`kwargs` less those `fn` does not take (the kernels' signatures move between jax
    releases)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _grid_block_n(tiles: dict[str, int], width: int) -> int:
    """The tiles' `grid_block_n` where the output's column blocks divide into it, else 1."""
    g = tiles["grid_block_n"]
    return g if width % (g * tiles["block_n"]) == 0 else 1


@functools.cache
def mosaic_gpu_kernels() -> Kernels:
    """JAX's Pallas Mosaic GPU grouped matmuls for Hopper, with `TILES` fitted to each
    shape."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    def ragged(lhs: Array, rhs: Array, sizes: Array, transpose_rhs: bool = False) -> Array:
        fn = ragged_dot_mgpu.ragged_dot
        if transpose_rhs and "transpose_rhs" not in inspect.signature(fn).parameters:
            rhs, transpose_rhs = jnp.swapaxes(rhs, 1, 2), False
        out = rhs.shape[1] if transpose_rhs else rhs.shape[2]
        tiles = dict(TILES["ragged"])
        tiles["block_n"] = _fit(tiles["block_n"], out)
        tiles["block_k"] = _fit(tiles["block_k"], lhs.shape[1])
        tiles["grid_block_n"] = _grid_block_n(tiles, out)
        if transpose_rhs:
            tiles["transpose_rhs"] = True
        with jax.named_scope(SCOPE):
            return fn(lhs, rhs, group_sizes=sizes, **_accepted(fn, **tiles))

    def weights_grad(x: Array, dy: Array, sizes: Array) -> Array:
        fn = transposed_ragged_dot_mgpu.transposed_ragged_dot
        tiles = dict(TILES["transposed"])
        tiles["block_m"] = _fit(tiles["block_m"], x.shape[1])
        tiles["block_n"] = _fit(tiles["block_n"], dy.shape[1])
        tiles["grid_block_n"] = _grid_block_n(tiles, dy.shape[1])
        with _sm_count_of_target(transposed_ragged_dot_mgpu), jax.named_scope(SCOPE):
            return fn(x, dy, group_sizes=sizes, **_accepted(fn, **tiles))

    return Kernels(
        forward=ragged,
        rows_grad=functools.partial(ragged, transpose_rhs=True),
        weights_grad=weights_grad,
    )


# NVIDIA's names of its compute capability 9.x chips, as devices report them ("NVIDIA H100
# 80GB HBM3", "NVIDIA H200", "NVIDIA GH200 480GB"): what an abstract device (a mesh's, no
# GPU attached) tells of the chip.
HOPPER_KIND = re.compile(r"\bG?H(100|200|800|20)\b")


def hopper() -> bool:
    """Whether the device compiled for (`layers.target_device`) is an NVIDIA GPU of compute
    capability 9.x: an attached GPU by its compute capability, an abstract one by its kind."""
    device = layers.target_device()
    if not layers.nvidia_gpu(device):
        return False
    capability = getattr(device, "compute_capability", None)
    if capability is None and jax.default_backend() == "gpu":
        kinds = {d.device_kind: d for d in jax.devices()}
        capability = getattr(kinds.get(device.device_kind), "compute_capability", None)
    if capability is None:
        return bool(HOPPER_KIND.search(device.device_kind))
    return str(capability).split(".")[0] == "9"


@contextlib.contextmanager
def _sm_count_of_target(module: Any) -> Any:
    """JAX's `transposed_ragged_dot` sizes its grid by `jax.devices()[0].core_count`, the
    SMs of a GPU attached here. Compiled ahead of time from a host without one (the
    planner), the module sees a `jax` whose `devices()` is the target's abstract device,
    its SM count as `core_count`, while the kernel is traced; with a GPU attached, nothing
    changes."""
    device = layers.target_device()
    cores = getattr(device, "num_cores", None)  # an abstract device's SMs (a GPU target's)
    if jax.default_backend() == "gpu" or cores is None:
        yield
        return
    target = types.SimpleNamespace(core_count=cores, device_kind=device.device_kind)
    with mock.patch.object(module, "jax", _JaxOf(target)):
        yield


class _JaxOf:
    """`jax` as a module sees it, but for `devices()`: `[target]`."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)

    def devices(self, *args: Any, **kwargs: Any) -> list[Any]:
        return [self._target]


def kernels_fit(x: Array, w: Array) -> str | None:
    """Why the Mosaic GPU kernels cannot take x `[m, k]` and w `[g, k, n]` (None: they can)."""
    dtypes = {jnp.dtype(d) for d in KERNEL_DTYPES}
    if jnp.dtype(x.dtype) not in dtypes or x.dtype != w.dtype:
        return f"operands {x.dtype} and {w.dtype} (the kernels take bfloat16 or float16)"
    k, n = w.shape[1], w.shape[2]
    if k % 64 or n % 64:
        return f"widths {k} and {n} (the kernels take multiples of 64)"
    return None


def choose(impl: str, x: Array, w: Array) -> str:
    """What `impl` runs for these operands: 'xla' or 'mosaic_gpu' (a ValueError naming the
    setting where 'mosaic_gpu' cannot)."""
    if impl not in GROUPED_MATMULS:
        raise ValueError(f"grouped_matmul {impl!r}: expected one of {GROUPED_MATMULS}.")
    if impl == "xla":
        return "xla"
    if impl == "auto":
        return "mosaic_gpu" if hopper() and kernels_fit(x, w) is None else "xla"
    if not hopper():
        raise ValueError(
            f"grouped_matmul='mosaic_gpu' needs an NVIDIA Hopper GPU (H100, H200); this "
            f"step is compiled for {layers.target_device().device_kind}: choose 'auto' or 'xla'."
        )
    why = kernels_fit(x, w)
    if why is not None:
        raise ValueError(f"grouped_matmul='mosaic_gpu' cannot take {why}: choose 'auto' or 'xla'.")
    return "mosaic_gpu"


def ragged_dot(
    x: Array, w: Array, sizes: Array, impl: str = "auto", all_grouped: bool = False
) -> Array:
    """Rows of x `[m, k]` in groups of `sizes` `[g]` (in order; rows past them: zero), each
    group times its w `[g, k, n]` -> `[m, n]`, by `impl` (the module's docstring).
    `all_grouped`: the caller knows the sizes sum to m (the kernels then skip zeroing)."""
    if choose(impl, x, w) == "xla":
        return jax.lax.ragged_dot(x, w, sizes)
    # One type for all three inside a shard_map: the casts' transposes then sum the
    # gradient of an operand that was the same on every device (JAX's own, outside the VJP).
    axes = varying(x) | varying(w) | varying(sizes)
    x, w, sizes = (vary(a, axes) for a in (x, w, sizes.astype(jnp.int32)))
    return kernel_ragged_dot(x, w, sizes, mosaic_gpu_kernels(), all_grouped)
