"""The 'chunked' implementation of `attention.dot_product_attention` for the attention
`context_parallel.attention` does not take (a dense mask, a bias, decoding, cross-attention):
blocks of queries, each scanning blocks of keys with an online softmax (flash attention's
forward), memory linear in the length; the backward is JAX's autodiff of the scan.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from flaxlm.models.masks import Mask

Array = jax.Array


def chunked_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Mask | Array | None,
    bias: Array | None,
    scale: float | None,
    softcap: float | None,
    dtype: Any,
    chunk_size: int,
    sinks: Array | None = None,
) -> Array:
    """Softmax attention of `query` [batch, q_len, heads, head_dim] over `key`, `value`
    [batch, kv_len, kv_heads, head_dim] in blocks of `chunk_size` queries and keys, keeping
    each query's running max, normaliser and weighted sum in float32.

    mask: a `Mask` (computed block by block) or bool broadcastable to [batch, heads, q_len,
    kv_len]; bias: float added to the scaled (and soft-capped) scores; sinks: float
    `[heads]`, a logit per head that joins every row's softmax and takes no value (gpt-oss):
    the running state starts from it instead of from nothing. Returns [batch, q_len, heads,
    head_dim] in `dtype`."""
    b, q_len, heads, head_dim = query.shape
    kv_len, kv_heads = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    qc, kc = min(chunk_size, q_len), min(chunk_size, kv_len)
    q_blocks, k_blocks = -(-q_len // qc), -(-kv_len // kc)

    def pad(x: Array, size: int, axis: int) -> Array:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, size - x.shape[axis])
        return jnp.pad(x, widths)

    q = pad(query, q_blocks * qc, 1).reshape(b, q_blocks * qc, kv_heads, groups, head_dim)
    k = pad(key, k_blocks * kc, 1)
    v = pad(value.astype(dtype), k_blocks * kc, 1)
    if bias is not None:
        bias = jnp.broadcast_to(bias.astype(jnp.float32), (b, heads, q_len, kv_len))
        bias = pad(pad(bias, q_blocks * qc, 2), k_blocks * kc, 3)
    dense_mask = None
    if mask is not None and not isinstance(mask, Mask):
        dense_mask = jnp.broadcast_to(mask, (b, heads, q_len, kv_len))
        dense_mask = pad(pad(dense_mask, q_blocks * qc, 2), k_blocks * kc, 3)
    neg = jnp.finfo(jnp.float32).min

    def query_block(qi: Array) -> Array:
        q_blk = jax.lax.dynamic_slice_in_dim(q, qi * qc, qc, axis=1)

        def key_block(carry, ki):
            m, norm, acc = carry
            k_blk = jax.lax.dynamic_slice_in_dim(k, ki * kc, kc, axis=1)
            v_blk = jax.lax.dynamic_slice_in_dim(v, ki * kc, kc, axis=1)
            s = jnp.einsum("bqhgd,bkhd->bhgqk", q_blk, k_blk, preferred_element_type=jnp.float32)
            s = s.astype(jnp.float32) * scale
            if softcap is not None:
                s = jnp.tanh(s / softcap) * softcap
            if bias is not None:
                blk = jax.lax.dynamic_slice(bias, (0, 0, qi * qc, ki * kc), (b, heads, qc, kc))
                s = s + blk.reshape(b, kv_heads, groups, qc, kc)
            if isinstance(mask, Mask):
                keep = jnp.broadcast_to(mask.block(qi * qc, qc, ki * kc, kc), (b, heads, qc, kc))
            elif dense_mask is not None:
                keep = jax.lax.dynamic_slice(
                    dense_mask, (0, 0, qi * qc, ki * kc), (b, heads, qc, kc)
                )
            else:
                keep = jnp.broadcast_to((ki * kc + jnp.arange(kc)) < kv_len, (b, heads, qc, kc))
            keep = keep.reshape(b, kv_heads, groups, qc, kc)
            s = jnp.where(keep, s, neg)
            m_new = jnp.maximum(m, s.max(-1))
            correction = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            norm_new = norm * correction + p.sum(-1)
            acc = acc * correction[..., None] + jnp.einsum(
                "bhgqk,bkhd->bhgqd", p.astype(dtype), v_blk, preferred_element_type=jnp.float32
            )
            return (m_new, norm_new, acc), None

        stats = (b, kv_heads, groups, qc)
        if sinks is None:
            m, norm = jnp.full(stats, neg, jnp.float32), jnp.zeros(stats, jnp.float32)
        else:  # the sink is the first column seen: max = sink, normaliser = exp(0)
            sink = sinks.astype(jnp.float32).reshape(1, kv_heads, groups, 1)
            m, norm = jnp.broadcast_to(sink, stats), jnp.ones(stats, jnp.float32)
        init = (m, norm, jnp.zeros((*stats, head_dim), jnp.float32))
        (_, norm, acc), _ = jax.lax.scan(key_block, init, jnp.arange(k_blocks))
        out = acc / norm[..., None]  # [b, kv_heads, groups, qc, head_dim]
        return out.transpose(0, 3, 1, 2, 4).reshape(b, qc, heads, head_dim)

    blocks = jax.lax.map(query_block, jnp.arange(q_blocks))  # [q_blocks, b, qc, heads, hd]
    out = blocks.transpose(1, 0, 2, 3, 4).reshape(b, q_blocks * qc, heads, head_dim)
    return out[:, :q_len].astype(dtype)
