"""The paged KV cache's pages: written, gathered, or read in place by a kernel.

The serving engine keeps every sequence's keys and values in one pool of fixed-size pages
(`masks.Decoding`'s paged mode, `inference/pages.py`). A pool is held head-major, `[X,
num_pages, page_size, width]` (X: key/value heads), one array per cached name: what JAX's
Pallas paged-attention kernel reads, and what a gathered row's attention contracts per head.

Two ways to attend over it, `PAGED_ATTENTION`:

- 'gather' (every platform, every attention): each row's pages are copied out of the pool in
  slot order (`gather_pages`) and the ordinary attention runs over them. On a GPU that copy
  is a read and a write of every row's keys and values before the attention reads them
  again: 3x the KV traffic of a step (`benchmarks/decode_hlo.py`).
- 'pallas' (a decode step's one query per row, rotary attention without a sliding window or
  sinks): JAX's Pallas paged-attention kernel (`jax.experimental.pallas.ops.gpu.
  paged_attention`, Triton on an NVIDIA GPU) reads each row's pages in place. In a program
  compiled for another platform it runs interpreted (slow: for tests). A prefill chunk, and a
  layer it cannot take, gathers.
"""

from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models.layers import constrain
from flaxlm.models.masks import Decoding

Array = jax.Array
PAGED_ATTENTION = ("gather", "pallas")
KERNEL_BLOCK_H = 16  # query heads per kernel block (the kernel's minimum; more are padded)


def write_pages(module: nn.Module, name: str, x: Array, decoding: Decoding, axes: tuple) -> Array:
    """`x` `[batch, q_len, X, width]` written into `module`'s cache variable `name`, a pool
    `[X, num_pages, page_size, width]`: row b's slot s goes to page `page_table[b, s //
    page_size]` at offset `s % page_size`, padding (slot -1) to page 0, which no row reads.
    `axes`: the logical axes of `[batch, slots, X, width]`. Returns the pool."""
    size = decoding.page_size
    slots = jnp.maximum(decoding.slots, 0)  # [batch, q_len]
    page = jnp.take_along_axis(decoding.page_table, slots // size, axis=1)
    page = jnp.where(decoding.slots >= 0, page, 0)
    shape = (x.shape[2], decoding.num_pages, size, x.shape[3])
    var = module.variable("cache", name, jnp.zeros, shape, x.dtype)
    new = jnp.moveaxis(x, 2, 0).astype(var.value.dtype)  # [X, batch, q_len, width]
    var.value = constrain(var.value.at[:, page, slots % size].set(new), pool_axes(axes))
    return var.value


def pool_axes(axes: tuple) -> tuple:
    """Logical axes of a pool, from those of `[batch, slots, X, width]`."""
    return (axes[2], None, None, axes[3])


def gather_pages(pool: Array, decoding: Decoding, axes: tuple) -> Array:
    """Every row's pages of `pool` in slot order: `[batch, length, X, width]` (what
    `masks.paged_mask` masks), `axes` its logical axes."""
    rows = pool[:, decoding.page_table]  # [X, batch, pages, page_size, width]
    heads, batch, width = pool.shape[0], decoding.page_table.shape[0], pool.shape[-1]
    rows = rows.reshape(heads, batch, -1, width)
    return constrain(jnp.moveaxis(rows, 0, 2), axes)


def gather_slots(pool: Array, decoding: Decoding, slots: Array, axes: tuple) -> Array:
    """Row b's slots `slots[b]` (int32 `[batch, n]`) of `pool`, read from the pages they lie
    on alone: `[batch, n, X, width]`, `axes` its logical axes (as `gather_pages`')."""
    size = decoding.page_size
    page = jnp.take_along_axis(decoding.page_table, slots // size, axis=1)  # [batch, n]
    rows = pool[:, page, slots % size]  # [X, batch, n, width]
    return constrain(jnp.moveaxis(rows, 0, 2), axes)


# Why the kernel was passed over for a decode step it was asked for, each said once.
_DECLINED: set[str] = set()


def use_kernel(
    decoding: Decoding | None,
    query: Array,
    *,
    window: Array | int | None = None,
    sinks: bool = False,
    value_dim: int | None = None,
) -> bool:
    """Whether this attention runs the 'pallas' kernel: asked for, one query per row (a
    prefill chunk gathers), no sliding window or sinks, a head width Triton's blocks take
    (a power of two >= 16), values as wide as the keys (`value_dim`: their width, None: the
    same). A decode step asked for it that it cannot take gathers, and says why once (on
    stderr)."""
    if decoding is None or not decoding.paged or decoding.paged_attention != "pallas":
        return False
    if query.shape[1] != 1:
        return False
    head_dim = query.shape[-1]
    reason = None
    if window is not None or sinks:
        reason = "a layer with a sliding window or attention sinks"
    elif head_dim < 16 or head_dim & (head_dim - 1):
        reason = f"head_dim {head_dim} (Triton's blocks: a power of two >= 16)"
    elif value_dim is not None and value_dim != head_dim:
        reason = f"values {value_dim} wide beside keys {head_dim} wide (one width a pool pair)"
    if reason is not None and reason not in _DECLINED and jax.process_index() == 0:
        _DECLINED.add(reason)
        print(f"paged_attention='pallas': {reason} gathers its pages.", file=sys.stderr)
    return reason is None


def check_paged_attention(value: str, setting: str = "paged_attention") -> None:
    """A ValueError naming `setting` unless `value` is one of `PAGED_ATTENTION`."""
    if value not in PAGED_ATTENTION:
        raise ValueError(f"{setting}={value!r}: expected one of {PAGED_ATTENTION}.")


def check_page_size(page_size: int) -> None:
    """A ValueError unless the kernel can read pages of `page_size` slots."""
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(
            f"paged_attention='pallas' reads pages of a power of two >= 16 slots "
            f"(Triton's blocks); page_size is {page_size}."
        )


def kernel_attention(
    query: Array,
    key_pool: Array,
    value_pool: Array,
    decoding: Decoding,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    dtype: jnp.dtype = jnp.float32,
) -> Array:
    """Each row's one query `[batch, 1, heads, head_dim]` attending over its slots up to its
    own (`decoding.slots`), read from the pools `[kv_heads, num_pages, page_size, head_dim]`
    in place by JAX's Pallas paged-attention kernel; `[batch, 1, heads, head_dim]` in `dtype`.
    The scores are scaled (`scale`, default head_dim**-0.5) before the soft cap, as
    `dot_product_attention`'s; a padding row (slot -1) sees slot 0."""
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged

    head_dim = query.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale
    q = (query[:, 0].astype(jnp.float32) * scale).astype(key_pool.dtype)
    lengths = jnp.maximum(decoding.slots[:, 0] + 1, 1).astype(jnp.int32)
    width = decoding.page_table.shape[1]
    per_block = 1  # pages a kernel step reads: the largest power of two <= 8 dividing width
    while per_block < 8 and width % (2 * per_block) == 0:
        per_block *= 2

    def kernel(interpret: bool) -> Array:
        return pallas_paged.paged_attention(
            q,
            key_pool,
            value_pool,
            decoding.page_table,
            lengths,
            block_h=KERNEL_BLOCK_H,
            pages_per_compute_block=per_block,
            k_splits=width // per_block,
            interpret=interpret,
            attn_logits_soft_cap=softcap,
        )

    # Triton where the program is compiled for an NVIDIA GPU (ahead of time too), else the
    # kernel's interpretation: chosen as the program is lowered, not by the default backend.
    out = jax.lax.platform_dependent(cuda=lambda: kernel(False), default=lambda: kernel(True))
    return out[:, None].astype(dtype)
