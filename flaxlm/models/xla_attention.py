"""The 'xla' implementation of `attention.dot_product_attention`: einsums over the whole
sequence in float32 scores, with a hand-written backward (flash attention's): autodiff's ran
XLA:CPU's training step 4-7% slower and kept the mask's and bias's broadcasts
(benchmarks/HISTORY.md).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def _einsum_specs(grouped: bool) -> tuple[str, str, str]:
    """Subscripts of (queries and outputs, keys and values, scores): grouped, queries
    [batch, q_len, kv_heads, groups, head_dim] and scores [batch, kv_heads, groups, q_len,
    kv_len]; else one query head per key head and scores [batch, heads, q_len, kv_len]."""
    return ("bqhgd", "bkhd", "bhgqk") if grouped else ("bqhd", "bkhd", "bhqk")


def _as_scores(x: Array, scores_shape: tuple[int, ...]) -> Array:
    """`x` (broadcastable to [batch, heads, q_len, kv_len]) in the scores' shape."""
    b, *heads, q_len, kv_len = scores_shape
    full = jnp.broadcast_to(x, (b, int(np.prod(heads)), q_len, kv_len))
    return full.reshape(scores_shape)


def _sum_to(x: Array, shape: tuple[int, ...]) -> Array:
    """The gradient of `broadcast_to(y, x.shape)` for a `y` of `shape`: `x` summed over the
    axes the broadcast added or stretched."""
    lead = x.ndim - len(shape)
    stretched = tuple(i + lead for i, n in enumerate(shape) if n == 1 and x.shape[i + lead] != 1)
    x = jnp.sum(x, axis=tuple(range(lead)) + stretched, keepdims=True)
    return x.reshape(shape)


def _grouped(query: Array, key: Array) -> Array:
    """`query` as [batch, q_len, kv_heads, groups, head_dim]."""
    b, q_len, heads, head_dim = query.shape
    return query.reshape(b, q_len, key.shape[2], heads // key.shape[2], head_dim)


def _sink_logits(sinks: Array, scores_shape: tuple[int, ...]) -> Array:
    """float32 per-head `sinks` [heads] broadcastable to the scores' shape, last axis 1."""
    _, *heads, _, _ = scores_shape
    return sinks.astype(jnp.float32).reshape(1, *heads, 1, 1)


def _xla_forward(query, key, value, mask, bias, scale, softcap, dtype, grouped, sinks):
    """Outputs, probabilities (in `dtype`, in `_einsum_specs(grouped)`'s scores layout),
    under a soft cap `tanh(scores / cap)`, and with `sinks` each row's float32 sink
    probability (the scores' layout without the keys)."""
    qs, ks, ss = _einsum_specs(grouped)
    q = _grouped(query, key) if grouped else query
    scores = jnp.einsum(f"{qs},{ks}->{ss}", q, key, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32) * scale
    tanh = None
    if softcap is not None:  # capped(scores, softcap), keeping tanh for the backward
        tanh = jnp.tanh(scores / softcap)
        scores = tanh * softcap
    if bias is not None:
        scores = scores + _as_scores(bias.astype(jnp.float32), scores.shape)
    if mask is not None:
        scores = jnp.where(_as_scores(mask, scores.shape), scores, jnp.finfo(jnp.float32).min)
    sink_probs = None
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # a softmax over the keys and the sink, whose column is then dropped
        sink = _sink_logits(sinks, scores.shape)
        top = jax.lax.stop_gradient(jnp.maximum(scores.max(-1, keepdims=True), sink))
        weights, sink_weight = jnp.exp(scores - top), jnp.exp(sink - top)
        total = weights.sum(-1, keepdims=True) + sink_weight
        probs, sink_probs = weights / total, (sink_weight / total)[..., 0]
    probs = probs.astype(dtype)
    out = jnp.einsum(f"{ss},{ks}->{qs}", probs, value.astype(dtype))
    return out.reshape(query.shape), probs, tanh, sink_probs


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def xla_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Array | None,
    bias: Array | None,
    scale: float,
    softcap: float | None,
    dtype: Any,
    sinks: Array | None = None,
) -> Array:
    """Softmax attention of `query` [batch, q_len, heads, head_dim] over `key` and `value`
    [batch, kv_len, kv_heads, head_dim]: bool `mask` and float `bias` broadcastable to
    [batch, heads, q_len, kv_len], scores scaled by `scale` then soft-capped by `softcap`;
    `sinks` float [heads]: a logit per head that joins every row's softmax and takes no value
    (gpt-oss's attention sinks: a row may give the keys less than all of its weight);
    probabilities and outputs in `dtype`.

    Not differentiated (inference, eval), it computes grouped scores [batch, kv_heads,
    groups, q_len, kv_len] whatever the groups. Differentiated, one query head per key
    head computes [batch, heads, q_len, kv_len] scores instead, and the backward is flash
    attention's: the softmax's row sums are `sum(d_out * out)` over head_dim, not
    `sum(d_probs * probs)` over the keys, and it keeps the probabilities and outputs and
    the compact mask and bias, not their broadcasts. On XLA:CPU that made training steps
    4-7% faster and cut the attention gradient's temporaries by 30-46%; the 4-D forward
    alone ran 1.6x slower (YNNPACK fused the softmax into the second matmul), hence the
    grouped one when not differentiated (benchmarks/HISTORY.md)."""
    return _xla_forward(query, key, value, mask, bias, scale, softcap, dtype, True, sinks)[0]


def _xla_attention_fwd(query, key, value, mask, bias, scale, softcap, dtype, sinks):
    grouped = query.shape[2] != key.shape[2]
    out, probs, tanh, sink_probs = _xla_forward(
        query, key, value, mask, bias, scale, softcap, dtype, grouped, sinks
    )
    return out, (query, key, value, mask, bias, probs, tanh, out, sinks, sink_probs)


def _xla_attention_bwd(scale, softcap, dtype, residuals, d_out):
    query, key, value, mask, bias, probs, tanh, out, sinks, sink_probs = residuals
    grouped = probs.ndim == 5
    qs, ks, ss = _einsum_specs(grouped)
    q, d_out, out = (_grouped(x, key) if grouped else x for x in (query, d_out, out))
    d_value = jnp.einsum(f"{ss},{qs}->{ks}", probs, d_out.astype(dtype))
    d_probs = jnp.einsum(
        f"{qs},{ks}->{ss}", d_out, value.astype(dtype), preferred_element_type=jnp.float32
    )
    # sum over keys of probs * d_probs, which is sum over head_dim of out * d_out.
    rows = jnp.einsum(f"{qs},{qs}->{ss[:-1]}", d_out.astype(jnp.float32), out.astype(jnp.float32))
    d_scores = probs.astype(jnp.float32) * (d_probs.astype(jnp.float32) - rows[..., None])
    d_sinks = None
    if sinks is not None:  # the sink's column: its probability times (0 - rows)
        per_head = -jnp.sum(sink_probs * rows, axis=(0, rows.ndim - 1))
        d_sinks = per_head.reshape(sinks.shape).astype(sinks.dtype)
    if mask is not None:  # a row with every key hidden has uniform probs and no gradient
        d_scores = jnp.where(_as_scores(mask, d_scores.shape), d_scores, 0.0)
    d_bias = None
    if bias is not None:
        b, q_len, heads, _ = query.shape
        full = d_scores.reshape(b, heads, q_len, key.shape[1])
        d_bias = _sum_to(full, bias.shape).astype(bias.dtype)
    if tanh is not None:
        d_scores = d_scores * (1.0 - tanh * tanh)
    d_scores = (d_scores * scale).astype(query.dtype)
    d_query = jnp.einsum(f"{ss},{ks}->{qs}", d_scores, key.astype(query.dtype))
    d_key = jnp.einsum(f"{ss},{qs}->{ks}", d_scores, q)
    return (
        d_query.reshape(query.shape).astype(query.dtype),
        d_key.astype(key.dtype),
        d_value.astype(value.dtype),
        None,
        d_bias,
        d_sinks,
    )


xla_attention.defvjp(_xla_attention_fwd, _xla_attention_bwd)
