"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2) and its latent KV cache.

Keys and values come from one low-rank latent per token: `kv_a_proj_with_mqa` projects the
input to `kv_lora_rank` latent features (RMS-normalised, `kv_a_layernorm`) and one rotary
key of `qk_rope_head_dim` features that every head shares; `kv_b_proj` expands the latent
into each head's key part without position (`qk_nope_head_dim`) and its value
(`v_head_dim`). Queries come from the input directly (`q_proj`) or through their own latent
(`q_a_proj`, `q_a_layernorm`, `q_b_proj`, with `q_lora_rank`), each head's split into a part
without position and a rotary part. Rotary pairs are interleaved (`rope_interleave`, the
original checkpoints' layout) or half-split.

The decoding cache holds what a token contributes before the expansion: the normalised
latent and the rotated shared key, `kv_lora_rank + qk_rope_head_dim` values per token and
layer (DeepSeek-V3: 576, against 128 heads x (192 + 128) = 40,960 for full keys and values;
`mla_cache='full'` keeps those instead, for comparison). A step of one query token attends
over it with the up-projection absorbed, as DeepSeek's inference does: the query's
position-free part is taken into latent space through `kv_b_proj`'s key half, scores are
dot products with the cached latents (plus the rotary parts'), and the probability-weighted
latent goes out through the value half. That costs heads x (2 x kv_lora_rank +
qk_rope_head_dim) multiply-adds per cached token, where re-expanding the cache each step
would cost kv_lora_rank x heads x (qk_nope_head_dim + v_head_dim) per cached token (DeepSeek-V3:
140k against 16.8M). Training, scoring and prefill (many queries) expand the latents into
keys and values once and use `attention.dot_product_attention` (any implementation,
context parallelism); the values are zero-padded to the key width there, since its kernels
take one head width.

Follows HuggingFace's `DeepseekV3Attention` (softmax scale `(qk_nope_head_dim +
qk_rope_head_dim) ** -0.5`, times YaRN's mscale(factor, mscale_all_dim) squared).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from flaxlm.models import attention, layers, masks, paged_attention

Array = jax.Array

MLA_CACHES = ("latent", "full")
# The latent dims of a projection's input (`q_b_proj`, `kv_b_proj`) are named `embed`, so
# FSDP splits those kernels as it splits the others (heads alone would leave them whole
# without tensor parallelism); an output latent dim is never split.
LATENT_IN = "embed"
LATENT_CACHE_AXES = ("batch", "length", None, None)  # [batch, slots, 1, width]
# `q_a_layernorm` and `kv_a_layernorm` are HF's RMSNorms at their default epsilon, whatever
# the config's `rms_norm_eps` (DeepseekV3Attention, Mistral4Attention build them so).
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: Any) -> float:
    """HF's scale of the scores: `qk_head_dim ** -0.5`, times `mscale(factor,
    rope_mscale_all_dim) ** 2` under YaRN scaling with `rope_mscale_all_dim` set."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    factor, m_all = cfg.rope_scaling_factor, cfg.rope_mscale_all_dim
    if cfg.rope_scaling_type is not None and m_all and factor > 1:
        mscale = 0.1 * m_all * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def cache_values_per_token(cfg: Any) -> int:
    """Values one token adds to one layer's decoding cache (`mla_cache`'s choice)."""
    if cfg.mla_cache == "latent":
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return cfg.num_heads * (qk + cfg.v_head_dim)


class LatentUp(layers.DenseGeneral):
    """`kv_b_proj`: a `DenseGeneral` from the latent to `(heads, qk_nope_head_dim +
    v_head_dim)` whose kernel the absorbed attention also reads whole."""

    def kernel_with_lora(self, width: int) -> Array:
        """The kernel `[width, heads, features]` in the compute dtype, plus its low-rank
        update when the params hold LoRA adapters for it (`adapt`'s, without dropout:
        decoding)."""
        kernel, _ = self.weights((width,))
        dtype = layers.as_dtype(self.dtype)
        if self.has_variable("params", "lora_a"):
            a = self.get_variable("params", "lora_a").astype(jnp.float32)
            b = self.get_variable("params", "lora_b").astype(jnp.float32)
            kernel = kernel.astype(jnp.float32) + jnp.einsum("cr,rhf->chf", a, b)
        return kernel.astype(dtype)


class MultiHeadLatentAttention(nn.Module):
    """`[batch, length, embed]` -> `[batch, length, embed]`, tagged `attn_out` for remat.

    Called `(h, sin, cos, mask, decoding, query_scale=None)` with sin/cos of the rotary
    width (`qk_rope_head_dim // 2`; None: nothing rotated, Kimi Linear's NoPE);
    `query_scale` `[batch, length]` multiplies each query (Mistral 4's scale by position; HF
    scales the queries after rotary). Params (HF's
    names): `q_proj` or `q_a_proj`, `q_a_layernorm`, `q_b_proj`; `kv_a_proj_with_mqa`,
    `kv_a_layernorm`, `kv_b_proj`, `o_proj`. The decoding cache: `cache/latent` `[batch,
    slots, 1, kv_lora_rank]` and `cache/rope_key` `[batch, slots, 1, qk_rope_head_dim]`
    (`mla_cache='full'`: `cache/key` and `cache/value` per head).
    """

    config: Any  # a DeepseekV3Config or Mistral4Config (the MLA fields, ComputeOptions)

    @nn.compact
    def __call__(
        self,
        h: Array,
        sin: Array | None,
        cos: Array | None,
        mask: masks.Mask | Array,
        decoding: masks.Decoding | None,
        query_scale: Array | None = None,
    ) -> Array:
        return self.attend(h, sin, cos, mask, decoding, query_scale)[0]

    def attend(
        self,
        h: Array,
        sin: Array | None,
        cos: Array | None,
        mask: masks.Mask | Array,
        decoding: masks.Decoding | None,
        query_scale: Array | None = None,
        chosen: Any = None,
    ) -> tuple[Array, Any]:
        """`__call__`'s output and what `narrow` chose (None here), called inside a compact
        `__call__` (this one, or a subclass's: DeepSeek Sparse Attention's, which hands
        `chosen` keys from an earlier layer to `narrow`)."""
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        norm = dict(epsilon=LATENT_NORM_EPS, axes=(None,), **dense)
        heads, nope, rope_dim = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        rank, v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        head_axes = ("embed", "heads", "head_dim")
        q_latent = None  # [batch, length, q_lora_rank] with a query latent
        if cfg.q_lora_rank is None:
            q = layers.DenseGeneral((heads, nope + rope_dim), head_axes, name="q_proj", **dense)(h)
        else:
            q = layers.DenseGeneral(
                cfg.q_lora_rank, ("embed", None), use_bias=cfg.attention_bias,
                name="q_a_proj", **dense,
            )(h)  # fmt: skip
            q_latent = layers.RMSNorm(name="q_a_layernorm", **norm)(q)
            up = (LATENT_IN, "heads", "head_dim")
            q_b = layers.DenseGeneral((heads, nope + rope_dim), up, name="q_b_proj", **dense)
            q = q_b(q_latent)
        q = layers.constrain(q, layers.HEAD_AXES)  # [batch, length, heads, qk_head_dim]
        q_nope, q_rope = q[..., :nope], q[..., nope:]

        latent = layers.DenseGeneral(
            rank + rope_dim, ("embed", None), use_bias=cfg.attention_bias,
            name="kv_a_proj_with_mqa", **dense,
        )(h)  # fmt: skip
        c_kv = layers.RMSNorm(name="kv_a_layernorm", **norm)(latent[..., :rank])
        k_rope = latent[..., None, rank:]  # [batch, length, 1, rope]: one key for all heads
        if sin is not None:  # None: no rotary (Kimi Linear's latent attention, NoPE)
            rotate = dict(interleaved=cfg.rope_interleave)
            q_rope = attention.apply_rotary(q_rope, sin, cos, **rotate)
            k_rope = attention.apply_rotary(k_rope, sin, cos, **rotate)
        if query_scale is not None:
            # As HF: the scale in the queries' dtype, both parts (so also the absorbed path).
            q_scale = query_scale[:, :, None, None].astype(q.dtype)
            q_nope, q_rope = q_nope * q_scale, q_rope * q_scale
        kv_b = LatentUp(
            (heads, nope + v_dim), (LATENT_IN, "heads", "head_dim"), name="kv_b_proj", **dense
        )
        scale = softmax_scale(cfg)
        mask, chosen = self.narrow(mask, h, q_latent, sin, cos, decoding, chosen)

        out = None
        if decoding is not None and cfg.mla_cache == "latent":
            step = h.shape[1] == 1  # a decoding step: the up-projection absorbed
            # Sparse attention's step reads the latents of its chosen slots alone.
            picked = chosen[:, 0] if step and chosen is not None else None  # [batch, n]
            cached, k_rope = DecodingCache(("latent", "rope_key"), LATENT_CACHE_AXES, name="cache")(
                (c_kv[:, :, None], k_rope), decoding, picked
            )
            c_kv = cached[:, :, 0]  # [batch, slots (or n), rank]
            if picked is not None:  # the narrowed mask at the chosen slots: [batch, 1, 1, n]
                mask = jnp.take_along_axis(mask[:, :, 0], picked[:, None], axis=-1)[:, :, None]
            if step:
                w = kv_b.kernel_with_lora(rank)  # [rank, heads, nope + v]
                out = absorbed_attention(
                    q_nope, q_rope, c_kv, k_rope[:, :, 0], w[..., :nope], w[..., nope:],
                    mask, scale, cfg.dtype,
                )  # fmt: skip
        if out is None:  # training, scoring, prefill: keys and values expanded
            k, v = expand(kv_b, c_kv, k_rope, nope)
            if decoding is not None and cfg.mla_cache == "full":
                cache = DecodingCache(("key", "value"), layers.HEAD_AXES, name="cache")
                k, v = cache((k, v), decoding)
            q = jnp.concatenate([q_nope, q_rope], -1)
            out = padded_attention(q, k, v, mask, scale, cfg)
        out = layers.DenseGeneral(
            cfg.hidden_size, ("heads", "head_dim", "embed"), axis=(-2, -1),
            use_bias=cfg.attention_bias, name="o_proj", **dense,
        )(out)  # fmt: skip
        return checkpoint_name(out, "attn_out"), chosen

    def narrow(
        self,
        mask: masks.Mask | Array,
        h: Array,
        q_latent: Array | None,
        sin: Array,
        cos: Array,
        decoding: masks.Decoding | None,
        chosen: Any,
    ) -> tuple[masks.Mask | Array, Any]:
        """The keys each query attends to, and what chose them: `mask` as it is here (every
        visible key). DeepSeek Sparse Attention narrows it to an indexer's top-k
        (`sparse_attention.py`) from the input `h`, the normalised query latent and the
        rotary tables; called inside `attend`, before the cache is read."""
        del h, q_latent, sin, cos, decoding
        return mask, chosen


class DecodingCache(nn.Module):
    """What each decoded token leaves for later ones (Flax collection `cache`): named arrays
    `[batch, q_len, X, width]` of any widths (`attention.KVCache` keeps one shape for its
    key and value), written at `decoding.index` into `[batch, X, slots, width]` (a "value":
    `[batch, X, width, slots]`) and returned whole as `[batch, slots, X, width]`
    (`attention.write_cache`); paged (the serving
    engine), written into their pages of a pool `[X, num_pages, page_size, width]` and
    returned gathered in each row's slot order (`paged_attention`). With `slots` (int32
    `[batch, n]`) only those slots of each row are returned, `[batch, n, X, width]`, read from
    the pages they lie on alone (sparse attention's decoding step)."""

    names: tuple[str, ...]
    axes: tuple[str | None, ...]  # logical axes of `[batch, slots, X, width]`

    @nn.compact
    def __call__(
        self, arrays: tuple[Array, ...], decoding: masks.Decoding, slots: Array | None = None
    ) -> tuple[Array, ...]:
        out = []
        for name, x in zip(self.names, arrays, strict=True):
            if decoding.paged:  # as `attention.KVCache`'s paged mode
                pool = paged_attention.write_pages(self, name, x, decoding, self.axes)
                if slots is None:
                    out.append(paged_attention.gather_pages(pool, decoding, self.axes))
                else:
                    out.append(paged_attention.gather_slots(pool, decoding, slots, self.axes))
                continue
            whole = attention.write_cache(self, name, x, decoding, self.axes)
            if slots is not None:
                whole = jnp.take_along_axis(whole, slots[:, :, None, None], axis=1)
            out.append(whole)
        return tuple(out)


def expand(kv_b: LatentUp, c_kv: Array, k_rope: Array, nope: int) -> tuple[Array, Array]:
    """Keys `[batch, slots, heads, nope + rope]` (the shared rotary key beside each head's
    own part) and values `[batch, slots, heads, v_head_dim]` from the latents `[batch,
    slots, rank]` and rotary keys `[batch, slots, 1, rope]`."""
    kv = kv_b(c_kv)  # [batch, slots, heads, nope + v]
    k_nope, v = kv[..., :nope], kv[..., nope:]
    shared = jnp.broadcast_to(k_rope.astype(k_nope.dtype), (*k_nope.shape[:3], k_rope.shape[-1]))
    k = layers.constrain(jnp.concatenate([k_nope, shared], -1), layers.HEAD_AXES)
    return k, layers.constrain(v, layers.HEAD_AXES)


def padded_attention(q: Array, k: Array, v: Array, mask: Any, scale: float, cfg: Any) -> Array:
    """`dot_product_attention` of queries and keys `qk_head_dim` wide and values `v_head_dim`
    wide: the narrower side zero-padded to one width (zero features add nothing to the
    scores, and padded value features come out zero and are dropped)."""
    width = max(q.shape[-1], v.shape[-1])

    def pad(x: Array) -> Array:
        return jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])

    out = attention.dot_product_attention(
        pad(q), pad(k), pad(v), mask, scale=scale, dtype=cfg.dtype,
        implementation=cfg.attention, chunk_size=cfg.attention_chunk_size,
        context_parallel=cfg.context_parallel,
    )  # fmt: skip
    return out[..., : v.shape[-1]]


def absorbed_attention(
    q_nope: Array,
    q_rope: Array,
    c_kv: Array,
    k_rope: Array,
    w_k: Array,
    w_v: Array,
    mask: masks.Mask | Array,
    scale: float,
    dtype: Any,
) -> Array:
    """Softmax attention over cached latents with `kv_b_proj` absorbed: q_nope `[batch, q,
    heads, nope]`, q_rope `[batch, q, heads, rope]`, c_kv `[batch, slots, rank]`, k_rope
    `[batch, slots, rope]`, w_k `[rank, heads, nope]`, w_v `[rank, heads, v]`, mask (a
    `Mask` or bool) broadcastable to `[batch, heads, q, slots]` -> `[batch, q, heads, v]`.
    Scores and softmax in float32, as `dot_product_attention`'s."""
    dtype = layers.as_dtype(dtype)
    f32 = dict(preferred_element_type=jnp.float32)
    q_latent = jnp.einsum("bqhn,chn->bqhc", q_nope.astype(dtype), w_k, **f32).astype(dtype)
    scores = jnp.einsum("bqhc,bsc->bhqs", q_latent, c_kv.astype(dtype), **f32)
    scores = scores + jnp.einsum(
        "bqhr,bsr->bhqs", q_rope.astype(dtype), k_rope.astype(dtype), **f32
    )
    scores = scores.astype(jnp.float32) * scale
    keep = mask.dense() if isinstance(mask, masks.Mask) else mask
    scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out_latent = jnp.einsum("bhqs,bsc->bqhc", probs, c_kv.astype(dtype), **f32).astype(dtype)
    return jnp.einsum("bqhc,chv->bqhv", out_latent, w_v, **f32).astype(dtype)
