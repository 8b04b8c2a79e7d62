"""Context parallelism: self-attention over a sequence split across the mesh's `sequence` axis.

Under a mesh with a `sequence` axis the Partitioner's rules split every activation's `length`
over it, so each device holds a shard of each row. Attention needs every key of the row:
`ring` passes the key/value shards around the ring of `sequence` devices, one step per shard,
combining the blocks with an online softmax (the backward pass is a second ring, where each
shard's key/value gradients travel with it and come home at the end); `all_gather` gathers
the keys and values of the row at once (simpler, more memory). Both compute in blocks of
`chunk_size` queries and keys, skip the block pairs the mask hides entirely, and never hold a
`[length, length]` score matrix; the backward recomputes the scores from the saved
log-normalisers (flash attention's custom VJP).

A causal mask gives a contiguous split uneven work: the device holding the end of the row
sees every key, the first only its own. `balanced_order` cuts a row into `2n` chunks and
gives device i chunks i and 2n-1-i, so every device has the same share of the triangle;
`DecoderOnlyModel` puts a training batch in that order (a loss is a sum over positions and
does not care) and the mask carries each position's slot (`Mask.slots`), so causality,
windows and segments follow the original order.

The mesh comes from JAX's context (`jax.sharding.get_abstract_mesh`, set while a
partitioned function traces) and the logical-to-mesh mapping from Flax's axis rules: this
module never sees a Partitioner. Decoding, cross-attention and attention with a bias (T5's
relative positions, ALiBi) keep the plain kernels, which XLA partitions by itself.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from flaxlm.models.masks import (
    NO_WINDOW,
    Mask,
    default_positions,
    visible,
    whole_self_attention,
)

Array = jax.Array

SEQUENCE_AXIS = "sequence"
STRATEGIES = ("ring", "all_gather")
_NEG = float(np.finfo(np.float32).min)


def sequence_shards() -> int:
    """Into how many shards the mesh in JAX's context splits a sequence (1: no `sequence`
    axis, or no mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or SEQUENCE_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[SEQUENCE_AXIS])


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"context_parallel {strategy!r}: expected one of {STRATEGIES}.")


def balanced_order(length: int, shards: int) -> np.ndarray:
    """int32 `[length]`: the slot each position holds in the load-balanced layout (`x[:,
    order]` reorders a row; `order` is also `Mask.slots`). Shard i of `shards` gets chunks i
    and `2 * shards - 1 - i` of `length / (2 * shards)` slots."""
    if length % (2 * shards):
        raise ValueError(
            f"The load-balanced context-parallel layout splits each sequence into 2 x "
            f"{shards} (the mesh's 'sequence' axis) chunks, but the length {length} is not a "
            f"multiple of {2 * shards}: change the length, or set "
            "context_parallel_balance=False on the model's config."
        )
    chunks = np.arange(length, dtype=np.int32).reshape(2 * shards, -1)
    order = [c for i in range(shards) for c in (i, 2 * shards - 1 - i)]
    return chunks[order].reshape(-1)


def balanced_batch(batch: Mapping[str, Array], tokens: str, positions: str, slots: str) -> dict:
    """A batch of rows `batch[tokens]` `[batch, length]` in the load-balanced order, if the
    context's mesh splits sequences: every `[batch, length]` feature reordered, the
    positions made explicit first (`batch[positions]`, 0.. if absent) and each position's
    slot added as `batch[slots]` (for `Mask.slots`). Otherwise `batch` itself."""
    shards = sequence_shards()
    if shards == 1:
        return batch
    rows, length = batch[tokens].shape
    order = balanced_order(length, shards)
    batch = dict(batch)
    batch[positions] = default_positions(batch[tokens], batch.get(positions))
    batch = {
        k: v[:, order] if v.ndim >= 2 and v.shape[:2] == (rows, length) else v
        for k, v in batch.items()
    }
    batch[slots] = jnp.asarray(order)
    return batch


def whole_sequence(mask: Mask | Array | None, bias: Array | None) -> bool:
    """Whether `attention` can compute this attention: self-attention over a whole sequence
    under a `Mask` (not decoding or cross-attention, no bias)."""
    return bias is None and whole_self_attention(mask)


def applies(mask: Mask | Array | None, bias: Array | None) -> bool:
    """Whether `dot_product_attention` must hand this attention to `attention`: a
    `whole_sequence` one that the context's mesh splits (a length its `sequence` axis
    divides; anything else is left to XLA, e.g. the short rows that build params)."""
    shards = sequence_shards()
    return shards > 1 and whole_sequence(mask, bias) and mask.q_len % shards == 0


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    softcap: float | None
    causal: bool
    chunk: int
    shards: int  # the ring's length (1: the keys are all here)
    dtype: jnp.dtype


def attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Mask,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    dtype: jnp.dtype = jnp.float32,
    chunk_size: int = 512,
    strategy: str = "ring",
    sinks: Array | None = None,
) -> Array:
    """`attention.dot_product_attention` of a sequence split over the `sequence` mesh axis,
    or, without one, of the whole sequence on each device (`attention='chunked'`): blocks of
    `chunk_size` with the custom VJP either way, so training memory is linear in the length.

    query: [batch, length, heads, head_dim]; key, value: [batch, length, kv_heads,
    head_dim], split on `length` (and as the rules say on batch and heads); mask: the
    self-attention `Mask` (segments, causality, windows, FCM's `kv_keep`, `slots`); sinks:
    float [heads], gpt-oss's per-head logit in every row's softmax (each query's running
    state starts from it; its gradient is summed on each device and over the mesh by the
    shard_map's transpose). Returns [batch, length, heads, head_dim] in `dtype`, split like `query`.
    """
    check_strategy(strategy)
    shards = sequence_shards()
    batch, length, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    slots = jnp.arange(length, dtype=jnp.int32) if mask.slots is None else mask.slots
    segments = mask.q_segment_ids
    segments = jnp.ones((batch, length), jnp.int32) if segments is None else segments
    segments = segments.astype(jnp.int32)
    keep = mask.kv_keep
    if keep is None:
        keep = jnp.ones((batch, length), bool)
    window = mask.combined_window()
    window = jnp.asarray(NO_WINDOW if window is None else window, jnp.int32)

    cfg = _Config(
        scale=head_dim**-0.5 if scale is None else float(scale),
        softcap=softcap,
        causal=mask.causal,
        chunk=chunk_size,
        shards=shards if strategy == "ring" else 1,
        dtype=jnp.dtype(dtype),
    )
    if shards == 1:
        q_meta, k_meta = (slots, segments), (slots, segments, keep)
        return _attend(cfg, query, key, value, q_meta, k_meta, window, sinks)

    mesh = jax.sharding.get_abstract_mesh()
    rule = functools.partial(mesh_axis, mesh)
    batch_axes, heads_axes = rule("batch", batch), rule("heads", heads)
    kv_axes = rule("kv_heads", kv_heads) if kv_heads > 1 else None
    if kv_heads > 1 and kv_axes != heads_axes:
        # Each device's query heads must find their key/value heads on it.
        heads_axes = kv_axes = None
    q_spec = P(batch_axes, SEQUENCE_AXIS, heads_axes, None)
    kv_spec = P(batch_axes, SEQUENCE_AXIS, kv_axes, None)
    row_spec = P(batch_axes, SEQUENCE_AXIS)

    def local(q, k, v, slot, seg, kkeep, win, *sink):
        if strategy == "all_gather":
            k, v, kslot, kseg, kkeep = (
                jax.lax.all_gather(x, SEQUENCE_AXIS, axis=1 if x.ndim > 1 else 0, tiled=True)
                for x in (k, v, slot, seg, kkeep)
            )
        else:
            kslot, kseg = slot, seg
        return _attend(cfg, q, k, v, (slot, seg), (kslot, kseg, kkeep), win, *sink)

    sink_args = () if sinks is None else (sinks,)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, P(SEQUENCE_AXIS), row_spec, row_spec, P())
        + (P(heads_axes),) * len(sink_args),
        out_specs=q_spec,
        check_vma=False,
    )(query, key, value, slots, segments, keep, window, *sink_args)


def mesh_axis(mesh, logical: str, size: int) -> str | tuple[str, ...] | None:
    """The mesh axes Flax's rules in force give the logical axis `logical`, without the
    sequence axis and axes this mesh lacks; None if they do not divide `size` (that dim is
    then whole on every device)."""
    (axes,) = nn.logical_to_mesh_axes((logical,))
    if axes is None:
        return None
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    names = tuple(a for a in names if a != SEQUENCE_AXIS and a in mesh.axis_names)
    if not names or size % int(np.prod([mesh.shape[a] for a in names])):
        return None
    return names[0] if len(names) == 1 else names


# ------------------------------------------------------------------ the kernel (one device)
#
# Inside shard_map. Queries are [b, Lq, K, G, d] (G query heads per key/value head), keys and
# values [b, Lk, K, d]; both are cut into chunks of C positions and laid out chunk-major
# ([n, b, C, ...]) so that lax.map/scan walk them. The running softmax state of each query is
# (m: max score, norm: normaliser, acc: weighted sum of values) in float32, [.., K, G, C(, d)].


def _chunks(x: Array, chunk: int, axis: int, fill) -> Array:
    """`x` padded on `axis` to a multiple of `chunk` with `fill`, then chunk-major."""
    size = x.shape[axis]
    pad = -size % chunk
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = jnp.pad(x, widths, constant_values=fill)
    x = x.reshape(*x.shape[:axis], -1, chunk, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _unchunk(x: Array, axis: int, size: int) -> Array:
    x = jnp.moveaxis(x, 0, axis)
    x = x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])
    return jax.lax.slice_in_dim(x, 0, size, axis=axis)


def _visible(cfg: _Config, q_meta, k_meta, window: Array) -> Array:
    """bool [b, 1, 1, Cq, Ck]: which keys of a chunk each query of a chunk sees."""
    q_slot, q_seg = q_meta
    k_slot, k_seg, k_keep = k_meta
    ok = visible(q_slot, k_slot, causal=cfg.causal, window=window)
    ok = ok[None] & (q_seg[:, :, None] == k_seg[:, None, :]) & k_keep[:, None, :]
    return ok[:, None, None]


def _scores(cfg: _Config, q: Array, k: Array) -> tuple[Array, Array]:
    """float32 scaled scores [b, K, G, Cq, Ck] before and after soft-capping."""
    raw = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32)
    raw = raw.astype(jnp.float32) * cfg.scale
    if cfg.softcap is None:
        return raw, raw
    return raw, jnp.tanh(raw / cfg.softcap) * cfg.softcap


def _forward_block(cfg: _Config, q, q_meta, k, v, k_meta, window, state):
    """The softmax state of every local query after also attending to the keys `k`, `v`
    (chunk-major)."""

    def per_query_chunk(args):
        q_c, q_meta_c, m, norm, acc = args

        def per_key_chunk(carry, xs):
            k_c, v_c, k_meta_c = xs
            seen = _visible(cfg, q_meta_c, k_meta_c, window)

            def update(carry):
                m, norm, acc = carry
                s = jnp.where(seen, _scores(cfg, q_c, k_c)[1], _NEG)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)
                correction = jnp.exp(m - m_new)
                norm = norm * correction + p.sum(-1)
                acc = acc * correction[..., None] + jnp.einsum(
                    "bhgqk,bkhd->bhgqd",
                    p.astype(cfg.dtype),
                    v_c.astype(cfg.dtype),
                    preferred_element_type=jnp.float32,
                )
                return m_new, norm, acc

            return jax.lax.cond(jnp.any(seen), update, lambda c: c, carry), None

        out, _ = jax.lax.scan(per_key_chunk, (m, norm, acc), (k, v, k_meta))
        return out

    return jax.lax.map(per_query_chunk, (q, q_meta, *state))


def _backward_block(cfg: _Config, q, q_meta, k, v, k_meta, window, lse, delta, dout, dq, dk, dv):
    """Adds the gradients of attending to the keys `k`, `v` (chunk-major): to the queries'
    `dq` and to these keys' `dk`, `dv` (float32)."""

    def per_key_chunk(dq, xs):
        k_c, v_c, k_meta_c, dk_c, dv_c = xs

        def per_query_chunk(carry, ys):
            dk_c, dv_c = carry
            q_c, q_meta_c, lse_c, delta_c, dout_c, dq_c = ys
            seen = _visible(cfg, q_meta_c, k_meta_c, window)

            def update(args):
                dk_c, dv_c, dq_c = args
                raw, s = _scores(cfg, q_c, k_c)
                p = jnp.where(seen, jnp.exp(s - lse_c[..., None]), 0.0)
                dv_c = dv_c + jnp.einsum(
                    "bhgqk,bqhgd->bkhd",
                    p.astype(cfg.dtype),
                    dout_c,
                    preferred_element_type=jnp.float32,
                )
                dp = jnp.einsum(
                    "bqhgd,bkhd->bhgqk",
                    dout_c,
                    v_c.astype(cfg.dtype),
                    preferred_element_type=jnp.float32,
                )
                ds = p * (dp - delta_c[..., None])
                if cfg.softcap is not None:
                    ds = ds * (1.0 - jnp.square(jnp.tanh(raw / cfg.softcap)))
                ds = ds * cfg.scale
                dq_c = dq_c + jnp.einsum(
                    "bhgqk,bkhd->bqhgd",
                    ds.astype(q_c.dtype),
                    k_c,
                    preferred_element_type=jnp.float32,
                )
                dk_c = dk_c + jnp.einsum(
                    "bhgqk,bqhgd->bkhd",
                    ds.astype(q_c.dtype),
                    q_c,
                    preferred_element_type=jnp.float32,
                )
                return dk_c, dv_c, dq_c

            dk_c, dv_c, dq_c = jax.lax.cond(jnp.any(seen), update, lambda a: a, (dk_c, dv_c, dq_c))
            return (dk_c, dv_c), dq_c

        (dk_c, dv_c), dq = jax.lax.scan(
            per_query_chunk, (dk_c, dv_c), (q, q_meta, lse, delta, dout, dq)
        )
        return dq, (dk_c, dv_c)

    dq, (dk, dv) = jax.lax.scan(per_key_chunk, dq, (k, v, k_meta, dk, dv))
    return dq, dk, dv


def _pass_on(cfg: _Config, tree):
    """Each device's `tree` to the next device of the ring."""
    perm = [(i, (i + 1) % cfg.shards) for i in range(cfg.shards)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, SEQUENCE_AXIS, perm), tree)


def _layout(cfg: _Config, q, k, v, q_meta, k_meta):
    """Chunk-major queries [nq, b, C, K, G, d], keys and values [nk, b, C, K, d] and their
    slots, segments and kept flags (padding: slot -1 queries in segment -1, keys never
    kept)."""
    b, length, heads, d = q.shape
    kv_heads = k.shape[2]
    chunk = min(cfg.chunk, length, k.shape[1])
    q = _chunks(q.reshape(b, length, kv_heads, heads // kv_heads, d), chunk, 1, 0)
    k, v = (_chunks(x, chunk, 1, 0) for x in (k, v))
    q_slot, q_seg = q_meta
    k_slot, k_seg, k_keep = k_meta
    q_meta = (_chunks(q_slot, chunk, 0, -1), _chunks(q_seg, chunk, 1, -1))
    k_meta = (
        _chunks(k_slot, chunk, 0, -1),
        _chunks(k_seg, chunk, 1, -2),
        _chunks(k_keep, chunk, 1, False),
    )
    return chunk, q, k, v, q_meta, k_meta


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(cfg: _Config, q, k, v, q_meta, k_meta, window, sinks=None):
    return _attend_fwd(cfg, q, k, v, q_meta, k_meta, window, sinks)[0]


def _attend_fwd(cfg: _Config, q, k, v, q_meta, k_meta, window, sinks=None):
    # Differentiating a scan over layers (`scan_layers`), JAX evaluates ahead of the loop all
    # that depends on its constants alone, such as every block pair's mask from the slots
    # and segments, and keeps it for every block pair at once (quadratic in the length).
    # Tied to the queries, the masks are computed block by block inside the loop.
    q, q_meta, k_meta, window = jax.lax.optimization_barrier((q, q_meta, k_meta, window))
    b, length, heads, d = q.shape
    kv_heads = k.shape[2]
    chunk, qc, kc, vc, q_meta_c, k_meta_c = _layout(cfg, q, k, v, q_meta, k_meta)
    stats = (qc.shape[0], b, kv_heads, heads // kv_heads, chunk)
    if sinks is None:
        m, norm = jnp.full(stats, _NEG, jnp.float32), jnp.zeros(stats, jnp.float32)
    else:  # the sink is the first column seen: max = sink, normaliser = exp(0)
        m, norm = (
            jnp.broadcast_to(_sink_logits(sinks, kv_heads), stats),
            jnp.ones(stats, jnp.float32),
        )
    state = (m, norm, jnp.zeros((*stats, d), jnp.float32))
    keys = (kc, vc, k_meta_c)

    def step(carry, _):
        state, keys = carry
        state = _forward_block(cfg, qc, q_meta_c, *keys, window, state)
        return (state, _pass_on(cfg, keys)), None

    if cfg.shards > 1:
        (state, keys), _ = jax.lax.scan(step, (state, keys), None, length=cfg.shards - 1)
    m, norm, acc = _forward_block(cfg, qc, q_meta_c, *keys, window, state)
    out = acc / jnp.where(norm > 0, norm, 1.0)[..., None]  # [nq, b, K, G, C, d]
    lse = jnp.where(norm > 0, m + jnp.log(jnp.where(norm > 0, norm, 1.0)), jnp.inf)
    out = _unchunk(jnp.moveaxis(out, 4, 2), 1, length).reshape(b, length, heads, d)
    out = out.astype(cfg.dtype)
    return out, (q, k, v, q_meta, k_meta, window, out, lse, sinks)


def _sink_logits(sinks: Array, kv_heads: int) -> Array:
    """float32 `sinks` [heads] as [1, 1, kv_heads, groups, 1] (the softmax state's layout)."""
    return sinks.astype(jnp.float32).reshape(1, 1, kv_heads, -1, 1)


def _attend_bwd(cfg: _Config, residuals, dout):
    q, k, v, q_meta, k_meta, window, out, lse, sinks = residuals
    b, length, heads, d = q.shape
    kv_heads = k.shape[2]
    chunk, qc, kc, vc, q_meta_c, k_meta_c = _layout(cfg, q, k, v, q_meta, k_meta)
    dout = dout.astype(cfg.dtype)
    # delta = rowsum(dout * out): [b, L, K, G] -> chunk-major [nq, b, K, G, C]
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = jnp.moveaxis(_chunks(delta.reshape(b, length, kv_heads, -1), chunk, 1, 0), 2, 4)
    dout_c = _chunks(dout.reshape(b, length, kv_heads, heads // kv_heads, d), chunk, 1, 0)
    dq = jnp.zeros(qc.shape, jnp.float32)
    grads = (jnp.zeros(kc.shape, jnp.float32), jnp.zeros(vc.shape, jnp.float32))
    keys = (kc, vc, k_meta_c)

    def step(carry, _):
        dq, keys, grads = carry
        dq, *grads = _backward_block(
            cfg, qc, q_meta_c, *keys, window, lse, delta, dout_c, dq, *grads
        )
        return (dq, _pass_on(cfg, keys), _pass_on(cfg, tuple(grads))), None

    if cfg.shards > 1:
        (dq, keys, grads), _ = jax.lax.scan(step, (dq, keys, grads), None, length=cfg.shards - 1)
    dq, *grads = _backward_block(cfg, qc, q_meta_c, *keys, window, lse, delta, dout_c, dq, *grads)
    if cfg.shards > 1:
        grads = _pass_on(cfg, tuple(grads))  # each shard's gradients back on its device
    dq = _unchunk(dq, 1, length).reshape(q.shape).astype(q.dtype)
    dk, dv = (_unchunk(g, 1, k.shape[1]).astype(x.dtype) for g, x in zip(grads, (k, v)))
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), (q_meta, k_meta, window))
    d_sinks = None
    if sinks is not None:  # the sink's column: its probability times (0 - delta)
        sink_probs = jnp.exp(_sink_logits(sinks, kv_heads) - lse)  # [nq, b, K, G, C]
        d_sinks = -jnp.sum(sink_probs * delta, axis=(0, 1, 4)).reshape(sinks.shape)
        d_sinks = d_sinks.astype(sinks.dtype)
    return dq, dk, dv, *zeros, d_sinks


_attend.defvjp(_attend_fwd, _attend_bwd)
