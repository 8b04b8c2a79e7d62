"""Attention: positions (rotary, ALiBi), masks (causal, window, segments, FCM), the KV
cache, `dot_product_attention` (xla / jax / chunked) and the rotary self-attention block.

Nothing here knows a mesh: activations carry logical axis names only.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from flaxlm.models.layers import (
    HEAD_AXES,
    DenseGeneral,
    Dtype,
    RMSNorm,
    as_dtype,
    constrain,
    parallel_dense,
)

Array = jax.Array


# ---------------------------------------------------------------------------- positions


def default_positions(tokens: Array, positions: Array | None) -> Array:
    """`positions`, or `0 .. length - 1` in every row of `tokens` [batch, length] if None."""
    if positions is not None:
        return positions
    batch, length = tokens.shape
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


# ---------------------------------------------------------------------------- rotary


def rotary_inv_freq(dim: int, theta: float = 10000.0) -> np.ndarray:
    """float32 inverse frequencies `[dim // 2]` of rotary embeddings over `dim` features."""
    return (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(np.float32)


def rotary_sin_cos(positions: Array, inv_freq: np.ndarray) -> tuple[Array, Array]:
    """sin/cos tables `[batch, length, len(inv_freq)]` in float32 for integer positions."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.sin(angles), jnp.cos(angles)


def apply_rotary(x: Array, sin: Array, cos: Array, *, interleaved: bool) -> Array:
    """Rotates the first `2 * sin.shape[-1]` features of each head of `x`.

    x: [batch, length, heads, head_dim]; sin, cos: [batch, length, rot_dim // 2].
    `interleaved` pairs features (0,1), (2,3), ... (GPT-J); otherwise (i, i + rot_dim/2)
    (GPT-NeoX / Llama).
    """
    rot_dim = 2 * sin.shape[-1]
    x_rot, x_pass = x[..., :rot_dim].astype(jnp.float32), x[..., rot_dim:]
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        out = out.reshape(x_rot.shape)
    else:
        x1, x2 = jnp.split(x_rot, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([out.astype(x.dtype), x_pass], axis=-1)


# ---------------------------------------------------------------------------- ALiBi


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's per-head slopes: 2^(-8/n), 2^(-16/n), ... for the largest power of two n
    <= num_heads, then every other slope of 2n for the remaining heads (Press et al.)."""

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    power = 2 ** int(np.floor(np.log2(num_heads)))
    slopes = geometric(power)
    if power < num_heads:
        slopes += geometric(2 * power)[0::2][: num_heads - power]
    return np.asarray(slopes, np.float32)


def alibi_bias(q_positions: Array, k_positions: Array, num_heads: int) -> Array:
    """float32 `[batch, heads, q_len, kv_len]`: -slope * (query position - key position)
    (keys after the query, masked anyway, get a positive distance's mirror image)."""
    distance = jnp.abs(q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)
    slopes = jnp.asarray(alibi_slopes(num_heads))
    return -slopes[None, :, None, None] * distance[:, None]


# ---------------------------------------------------------------------------- attention


@flax.struct.dataclass
class Mask:
    """Which keys each query may attend to, computed on demand for any block of queries and
    keys (`block`) or whole (`dense`, bool `[batch, 1, q_len, kv_len]`); the blockwise
    attention never holds the whole mask.

    Queries sit at slots `q_offset + i`, keys at slots `j`. `causal`: a key at a later slot
    is hidden; `sliding_window` W: only the W latest slots (the query's own included) are
    seen; `kv_start` (per row): keys before it are padding (left-padded decoding). Segment
    ids keep packed examples apart: with `cross` (keys are another sequence) a query sees
    keys of its own segment and never segment 0 (padding); otherwise queries and keys share
    `q_segment_ids`.
    """

    q_segment_ids: Array | None
    kv_segment_ids: Array | None
    kv_start: Array | None
    q_offset: Array | int
    kv_keep: Array | None = None  # bool [batch, kv_len]: False hides a key from every query
    # A layer's own sliding window (int32 scalar, may be traced: `layer_window`), on top of
    # `sliding_window`; NO_WINDOW sees everything.
    window: Array | None = None
    batch: int = flax.struct.field(pytree_node=False, default=1)
    q_len: int = flax.struct.field(pytree_node=False, default=1)
    kv_len: int = flax.struct.field(pytree_node=False, default=1)
    causal: bool = flax.struct.field(pytree_node=False, default=True)
    sliding_window: int | None = flax.struct.field(pytree_node=False, default=None)
    cross: bool = flax.struct.field(pytree_node=False, default=False)

    def block(self, q_start: Array | int, q_size: int, k_start: Array | int, k_size: int) -> Array:
        """bool `[batch, 1, q_size, k_size]` for queries q_start.. and keys k_start.. (either
        start may be traced; rows and columns past the ends are False)."""
        q_idx = q_start + jnp.arange(q_size)
        k_idx = k_start + jnp.arange(k_size)
        q_slot = (self.q_offset + q_idx)[:, None]
        k_slot = k_idx[None, :]
        mask = (q_idx < self.q_len)[:, None] & (k_idx < self.kv_len)[None, :]
        if self.causal:
            mask = mask & (k_slot <= q_slot)
        if self.sliding_window is not None:
            mask = mask & (q_slot - k_slot < self.sliding_window)
        if self.window is not None:
            mask = mask & (q_slot - k_slot < self.window)
        mask = jnp.broadcast_to(mask[None], (self.batch, q_size, k_size))
        if self.kv_start is not None:
            mask = mask & (k_slot[None] >= self.kv_start[:, None, None])
        if self.kv_keep is not None:
            keep = jnp.pad(self.kv_keep, ((0, 0), (0, k_size)))
            keep = jax.lax.dynamic_slice_in_dim(keep, k_start, k_size, axis=1)
            mask = mask & keep[:, None, :]

        def take(ids: Array, start: Array | int, size: int, length: int) -> Array:
            padded = jnp.pad(ids, ((0, 0), (0, size)))  # reads past the end see segment 0
            return jax.lax.dynamic_slice_in_dim(padded, start, size, axis=1)

        if self.cross:
            if self.q_segment_ids is None:
                q_seg = jnp.ones((self.batch, q_size), jnp.int32)
            else:
                q_seg = take(self.q_segment_ids, q_start, q_size, self.q_len)
            k_seg = take(self.kv_segment_ids, k_start, k_size, self.kv_len)
            mask = mask & (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg > 0)[:, None, :]
        elif self.q_segment_ids is not None:
            q_seg = take(self.q_segment_ids, q_start, q_size, self.q_len)
            k_seg = take(self.q_segment_ids, k_start, k_size, self.q_len)
            mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])
        return mask[:, None]

    def dense(self) -> Array:
        return self.block(0, self.q_len, 0, self.kv_len)

    def within(self, window: Array | None) -> Mask:
        """This mask narrowed to a layer's sliding `window` (None: unchanged)."""
        return self if window is None else self.replace(window=window)


NO_WINDOW = 2**30  # a window longer than any sequence


def layer_window(windows: tuple[int | None, ...], index: Array) -> Array | None:
    """The sliding window of layer `index` (traced when layers are scanned) given every
    layer's (None: global attention), or None when no layer has one."""
    if all(w is None for w in windows):
        return None
    table = jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32)
    return table[index]


def attention_mask(
    segment_ids: Array | None,
    batch: int,
    length: int,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    kv_segment_ids: Array | None = None,
    kv_length: int | None = None,
) -> Mask:
    """Causal (optionally), and never across packed segments.

    `sliding_window` W lets a query see only the W most recent positions (itself included,
    Mistral). `kv_segment_ids` / `kv_length` describe keys that are not the queries
    (cross-attention); then segment ids pair queries with keys of the same segment, and
    padding (segment 0) is never attended.
    """
    return Mask(
        q_segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids,
        kv_start=None,
        q_offset=0,
        batch=batch,
        q_len=length,
        kv_len=length if kv_length is None else kv_length,
        causal=causal,
        sliding_window=sliding_window,
        cross=kv_segment_ids is not None,
    )


@flax.struct.dataclass
class Decoding:
    """Where incremental decoding is: the cache slot of the first query token (`index`), the
    first slot of each row that holds a real token (`start`; prompts are left-padded so
    every row writes the same slot), and the cache size (`length`, static)."""

    index: Array  # int32 scalar
    start: Array  # int32 [batch]
    length: int = flax.struct.field(pytree_node=False, default=0)


def forgetful_causal_mask(
    mask: Mask, rng: Array, positions: Array, min_ratio: float, max_ratio: float
) -> Mask:
    """Forgetful Causal Masking (Liu et al. 2022, as EasyLM trains GPT-J): each row draws a
    ratio in [min_ratio, max_ratio] and hides that fraction of its keys from every query;
    the first token of each sequence (position 0) always stays visible."""
    ratio_rng, keep_rng = jax.random.split(rng)
    batch, length = positions.shape
    ratio = jax.random.uniform(ratio_rng, (batch, 1), minval=min_ratio, maxval=max_ratio)
    keep = (jax.random.uniform(keep_rng, (batch, length)) >= ratio) | (positions == 0)
    return mask.replace(kv_keep=keep)


def causal_mask(
    segment_ids: Array | None,
    batch: int,
    length: int,
    decoding: Decoding | None = None,
    *,
    sliding_window: int | None = None,
) -> Mask:
    """A decoder's self-attention mask: `attention_mask` over the sequence itself, or while
    decoding over the cache: slots written so far, at or after the row's `start`, within
    the sliding window."""
    if decoding is None:
        return attention_mask(
            segment_ids, batch, length, causal=True, sliding_window=sliding_window
        )
    return Mask(
        q_segment_ids=None,
        kv_segment_ids=None,
        kv_start=decoding.start,
        q_offset=decoding.index,
        batch=batch,
        q_len=length,
        kv_len=decoding.length,
        causal=True,
        sliding_window=sliding_window,
    )


def decoding_positions(decoding: Decoding, batch: int, length: int) -> Array:
    """int32 `[batch, length]` positions of the query tokens while decoding (a left-padded
    row counts from its first real token)."""
    slots = decoding.index + jnp.arange(length, dtype=jnp.int32)[None, :]
    return jnp.broadcast_to(jnp.maximum(slots - decoding.start[:, None], 0), (batch, length))


class KVCache(nn.Module):
    """Keys and values of the tokens decoded so far (Flax collection `cache`).

    Outside decoding it returns its inputs. While decoding it writes the new keys and
    values at `decoding.index` and returns the whole cache `[batch, cache_len, heads,
    head_dim]` (what `causal_mask` masks).
    """

    axes: tuple[str | None, ...] = HEAD_AXES

    @nn.compact
    def __call__(self, key: Array, value: Array, decoding: Decoding | None) -> tuple[Array, Array]:
        if decoding is None:
            return key, value
        shape = (key.shape[0], decoding.length, *key.shape[2:])
        cached = {
            name: self.variable("cache", name, jnp.zeros, shape, x.dtype)
            for name, x in (("key", key), ("value", value))
        }
        out = []
        for name, x in (("key", key), ("value", value)):
            var = cached[name]
            updated = jax.lax.dynamic_update_slice(
                var.value, x.astype(var.value.dtype), (0, decoding.index, 0, 0)
            )
            var.value = constrain(updated, self.axes)
            out.append(var.value)
        return out[0], out[1]


ATTENTION_IMPLEMENTATIONS = ("xla", "jax", "chunked")


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Mask | Array | None = None,
    *,
    bias: Array | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    dtype: Dtype = jnp.float32,
    implementation: str = "xla",
    chunk_size: int = 512,
) -> Array:
    """Softmax attention in float32; grouped-query when key has fewer heads than query.

    query: [batch, q_len, heads, head_dim]; key, value: [batch, kv_len, kv_heads, head_dim];
    mask: a `Mask` or bool broadcastable to [batch, heads, q_len, kv_len]; bias: added to
    the scaled scores, broadcastable to [batch, heads, q_len, kv_len] (T5's relative
    positions); scale: default head_dim**-0.5 (T5 uses 1.0); softcap: scaled scores become
    `softcap * tanh(scores / softcap)` (Gemma 2). Returns [batch, q_len, heads, head_dim] in
    `dtype`.

    implementation: 'xla' (einsums, the default), 'jax' (`jax.nn.dot_product_attention`:
    cuDNN flash attention on GPU where it applies, XLA elsewhere) or 'chunked' (blocks of
    `chunk_size` queries and keys with an online softmax: memory linear in the length).
    """
    check_implementation(implementation, softcap)
    if implementation == "chunked":
        return _chunked_attention(query, key, value, mask, bias, scale, softcap, dtype, chunk_size)
    if isinstance(mask, Mask):
        mask = mask.dense()
    if implementation == "jax":
        return _jax_attention(query, key, value, mask, bias, scale, dtype)
    b, q_len, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    groups = heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    q = query.reshape(b, q_len, kv_heads, groups, head_dim)
    # [batch, kv_heads, groups, q_len, kv_len]
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, key, preferred_element_type=jnp.float32)
    scores = capped(scores.astype(jnp.float32) * scale, softcap)
    if bias is not None:
        bias = jnp.broadcast_to(bias.astype(jnp.float32), (b, heads, q_len, key.shape[1]))
        scores = scores + bias.reshape(b, kv_heads, groups, q_len, key.shape[1])
    if mask is not None:
        mask = jnp.broadcast_to(mask, (b, heads, q_len, key.shape[1]))
        mask = mask.reshape(b, kv_heads, groups, q_len, key.shape[1])
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(as_dtype(dtype))
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, value.astype(as_dtype(dtype)))
    return out.reshape(b, q_len, heads, head_dim)


def check_implementation(implementation: str, softcap: float | None = None) -> None:
    """A ValueError naming what to change when `implementation` cannot compute the
    attention asked for (a config calls this when it is built)."""
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {implementation!r}: expected one of "
            f"{ATTENTION_IMPLEMENTATIONS}."
        )
    if softcap is not None and implementation == "jax":
        raise ValueError(
            "attention='jax' (jax.nn.dot_product_attention, cuDNN) cannot soft-cap the "
            "attention scores this model needs: choose attention='xla' or 'chunked'."
        )


def capped(scores: Array, softcap: float | None) -> Array:
    """`softcap * tanh(scores / softcap)` (Gemma 2's logit soft-capping), or `scores`."""
    if softcap is None:
        return scores
    return jnp.tanh(scores / softcap) * softcap


def _jax_attention(query, key, value, mask, bias, scale, dtype) -> Array:
    dtype = as_dtype(dtype)
    b, q_len, heads, _ = query.shape
    kv_len = key.shape[1]
    if mask is not None:
        mask = jnp.broadcast_to(mask, (b, heads, q_len, kv_len))
    if bias is not None:
        bias = jnp.broadcast_to(bias, (b, heads, q_len, kv_len)).astype(dtype)
    return jax.nn.dot_product_attention(
        query.astype(dtype),
        key.astype(dtype),
        value.astype(dtype),
        bias=bias,
        mask=mask,
        scale=scale,
    )


def _chunked_attention(query, key, value, mask, bias, scale, softcap, dtype, chunk_size) -> Array:
    """Flash-attention-style blocks: for each block of queries, scan over blocks of keys
    keeping the running max, normaliser and weighted sum in float32."""
    dtype = as_dtype(dtype)
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
            s = capped(s.astype(jnp.float32) * scale, softcap)
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

        init = (
            jnp.full((b, kv_heads, groups, qc), neg, jnp.float32),
            jnp.zeros((b, kv_heads, groups, qc), jnp.float32),
            jnp.zeros((b, kv_heads, groups, qc, head_dim), jnp.float32),
        )
        (_, norm, acc), _ = jax.lax.scan(key_block, init, jnp.arange(k_blocks))
        out = acc / norm[..., None]  # [b, kv_heads, groups, qc, head_dim]
        return out.transpose(0, 3, 1, 2, 4).reshape(b, qc, heads, head_dim)

    blocks = jax.lax.map(query_block, jnp.arange(q_blocks))  # [q_blocks, b, qc, heads, hd]
    out = blocks.transpose(1, 0, 2, 3, 4).reshape(b, q_blocks * qc, heads, head_dim)
    return out[:, :q_len].astype(dtype)


def kv_heads_axis(num_kv_heads: int) -> str | None:
    """Logical name of the key/value heads axis; one shared head (MQA) is never split."""
    return "kv_heads" if num_kv_heads > 1 else None


QK_NORMS = ("rms", "rms_plus_one")


def rotary_self_attention(
    h: Array,
    sin: Array,
    cos: Array,
    mask: Mask | Array,
    decoding: Decoding | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    qkv_bias: bool,
    out_bias: bool,
    attention: str,
    chunk_size: int,
    dtype: Dtype,
    param_dtype: Dtype,
    qk_norm: str | None = None,
    norm_eps: float = 1e-6,
    scale: float | None = None,
    softcap: float | None = None,
    window: Array | None = None,
) -> Array:
    """Llama-style attention, built inside the calling block's scope (`q_proj`, `k_proj`,
    `v_proj`, `o_proj`, `cache`): rotary (half-split) queries and keys, grouped-query heads;
    `qkv_bias` / `out_bias`: biases on the q, k, v / o projections. A `sin`/`cos` narrower
    than `head_dim / 2` rotates the first features of each head only (partial rotary).

    qk_norm: 'rms' (Qwen3) or 'rms_plus_one' (Gemma 3) normalises each query and key head
    (`q_norm`, `k_norm`, eps `norm_eps`) before rotary. scale: of the scores (default
    head_dim**-0.5); softcap: of the scaled scores (Gemma 2); window: this layer's sliding
    window (`layer_window`).

    h: [batch, length, embed] -> [batch, length, embed], tagged `attn_out` for remat.
    """
    dense = dict(dtype=dtype, param_dtype=param_dtype, use_bias=qkv_bias)
    kv_axis = kv_heads_axis(num_kv_heads)
    q, k, v = parallel_dense(
        h,
        [
            DenseGeneral(
                (num_heads, head_dim), ("embed", "heads", "head_dim"), name="q_proj", **dense
            ),
            *(
                DenseGeneral(
                    (num_kv_heads, head_dim), ("embed", kv_axis, "head_dim"), name=n, **dense
                )
                for n in ("k_proj", "v_proj")
            ),
        ],
    )
    kv_axes = ("batch", "length", kv_axis, "head_dim")
    if qk_norm is not None:
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {qk_norm!r}: expected None or one of {QK_NORMS}.")
        norm = dict(
            epsilon=norm_eps,
            scale_plus_one=qk_norm == "rms_plus_one",
            axes=("head_dim",),
            dtype=dtype,
            param_dtype=param_dtype,
        )
        q = RMSNorm(name="q_norm", **norm)(q)
        k = RMSNorm(name="k_norm", **norm)(k)
    q = constrain(apply_rotary(q, sin, cos, interleaved=False), HEAD_AXES)
    k = constrain(apply_rotary(k, sin, cos, interleaved=False), kv_axes)
    k, v = KVCache(kv_axes, name="cache")(k, v, decoding)
    if isinstance(mask, Mask):
        mask = mask.within(window)
    attn = dot_product_attention(
        q,
        k,
        v,
        mask,
        scale=scale,
        softcap=softcap,
        dtype=dtype,
        implementation=attention,
        chunk_size=chunk_size,
    )
    attn = DenseGeneral(
        hidden_size,
        ("heads", "head_dim", "embed"),
        axis=(-2, -1),
        use_bias=out_bias,
        name="o_proj",
        dtype=dtype,
        param_dtype=param_dtype,
    )(attn)
    return checkpoint_name(attn, "attn_out")
