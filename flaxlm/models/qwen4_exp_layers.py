"""Qwen4-Exp's own layers (`qwen4_exp.py`'s family): the hyper-connections' gated residual,
the QSA indexer that picks each query's keys, and the Gated DeltaNet whose output gate may
be a sigmoid.

Follows transformers' `Qwen4ExpTextGatedResidual`, `Qwen4ExpTextQSAIndexer` and
`Qwen4ExpTextRMSNormGated` (`output_gate_type`).

The indexer, for each query, splits the tokens it sees (its own segment, up to itself) into
blocks of `indexer_compress_ratio` consecutive tokens from the segment's start; each complete
block's key is the mean of its raw index keys, normalised (`k_layernorm`, (1 + w)) and
rotated at the block's first position; the query's index heads (normalised, rotated) score
it by the sum over heads of relu(q . k) / sqrt(dim); the top `indexer_budget /
indexer_compress_ratio` complete blocks and the incomplete tail block are the keys its
attention sees (a dense bool mask `[batch, 1, length, length]`). Where complete blocks tie
at the k-th score (every head's relu at 0 for several blocks), torch's `topk` picks among
them in no specified order and flaxlm the earliest: that query's attention may then differ
from HF's.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models import attention, gated_deltanet, layers, masks, paged_attention, rope
from flaxlm.models.qwen4_exp_ple import GroupNorm

Array = jax.Array


class SigmoidGatedRMSNorm(gated_deltanet.GatedRMSNorm):
    """`GatedRMSNorm` gated by `sigmoid(gate)` (HF's `output_gate_type` 'sigmoid')."""

    def gated(self, y: Array, scale: Array, gate: Array) -> Array:
        dtype = layers.as_dtype(self.dtype)
        y = (scale.astype(dtype) * y.astype(dtype)).astype(jnp.float32)
        return (y * jax.nn.sigmoid(gate)).astype(dtype)


class SigmoidGatedDeltaNet(gated_deltanet.GatedDeltaNet):
    """`GatedDeltaNet` whose output gate is a sigmoid."""

    norm_cls = SigmoidGatedRMSNorm


class GatedResidual(nn.Module):
    """`streams` `[batch, length, hc * hidden]` -> (the sublayer's input `[batch, length,
    hidden]`, its injection weight per stream `[batch, length, hc]`; None without
    `combine`: the final mixer). Params (HF's names): `hc_norm` (per stream, (1 + w)),
    `input_mix_weight_down`, `input_mix_weight_up`, `block_inject_weight`."""

    config: Any
    combine: bool = True

    @nn.compact
    def __call__(self, streams: Array) -> tuple[Array, Array | None]:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        hc, width = cfg.hc_count, cfg.hidden_size
        normed = GroupNorm(width, cfg.rms_norm_eps, name="hc_norm", **dense)(streams)

        def proj(features: int, name: str, x: Array) -> Array:
            kernel = layers.DenseGeneral(features, ("embed", None), name=name, **dense)
            return kernel(x).astype(jnp.float32)

        mix = jax.nn.silu(proj(cfg.hc_lowrank, "input_mix_weight_down", normed) / hc)
        mix = jax.nn.sigmoid(proj(hc * width, "input_mix_weight_up", mix))
        split = (*streams.shape[:-1], hc, width)
        mixed = jnp.mean(mix.reshape(split) * normed.reshape(split).astype(jnp.float32), -2)
        mixed = mixed.astype(streams.dtype)
        if not self.combine:
            return mixed, None
        inject = 2 * jax.nn.sigmoid(proj(hc, "block_inject_weight", normed) / hc)
        return mixed, inject


def inject(streams: Array, out: Array, weights: Array) -> Array:
    """The streams after a sublayer: each stream plus its weight times the output."""
    added = out.astype(jnp.float32)[..., None, :] * weights[..., None]
    return (streams.astype(jnp.float32) + added.reshape(streams.shape)).astype(streams.dtype)


def segment_positions(segment_ids: Array | None, batch: int, length: int) -> Array:
    """int32 `[batch, length]`: each token's index within its run (packed segment)."""
    idx = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    if segment_ids is None:
        return idx
    changed = jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)))
    start = jax.lax.cummax(jnp.where(changed, idx, 0), axis=1)
    return idx - start


class Indexer(nn.Module):
    """`(h, sin, cos, visible, segment_ids, decoding)` -> bool `[batch, 1, length, keys]`:
    the keys each query's attention reads (the module docstring). Params (HF's names):
    `index_qk_proj` (the index heads' queries, then the one key), `q_layernorm`,
    `k_layernorm`. Cache (while decoding): `index_key`, the raw index keys of the slots
    written so far (over the paged cache, in pages beside the keys and values)."""

    config: Any

    @nn.compact
    def __call__(
        self,
        h: Array,
        sin: Array,
        cos: Array,
        visible: Array,
        segment_ids: Array | None,
        decoding: masks.Decoding | None,
    ) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        heads, dim, ratio = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
        batch, length, _ = h.shape
        qk = layers.DenseGeneral(
            (heads + 1, dim), ("embed", None, None), name="index_qk_proj", **dense
        )(h)
        norm = dict(epsilon=cfg.rms_norm_eps, scale_plus_one=True, axes=("head_dim",), **dense)
        q = layers.RMSNorm(name="q_layernorm", **norm)(qk[:, :, :heads])
        q = attention.apply_rotary(q, sin, cos, interleaved=False).astype(jnp.float32)
        raw = qk[:, :, heads:]  # [batch, length, 1, dim]
        q_slot = jnp.broadcast_to(jnp.arange(length), (batch, length))
        if decoding is None:
            place = segment_positions(segment_ids, batch, length)
            k_sin, k_cos = sin, cos
        elif decoding.paged:  # a row's slots are its positions
            axes = ("batch", "length", None, "head_dim")
            pool = paged_attention.write_pages(self, "index_key", raw, decoding, axes)
            raw = paged_attention.gather_pages(pool, decoding, axes)
            place = jnp.broadcast_to(jnp.arange(raw.shape[1], dtype=jnp.int32), raw.shape[:2])
            q_slot = jnp.maximum(decoding.slots, 0)
            k_sin, k_cos = rope.sin_cos(place, cfg, dim=cfg.rotary_dim)
        else:  # every slot's key: its place and position from the row's first real token
            axes = ("batch", "length", None, "head_dim")
            raw = attention.write_cache(self, "index_key", raw, decoding, axes)
            slots = jnp.arange(raw.shape[1], dtype=jnp.int32)
            place = slots[None, :] - decoding.start[:, None]
            q_slot = decoding.index + q_slot
            k_sin, k_cos = rope.sin_cos(jnp.maximum(place, 0), cfg, dim=cfg.rotary_dim)
        raw = raw[:, :, 0].astype(jnp.float32)
        keys_len = raw.shape[1]
        # Each slot's block as if it started one: the mean of it and the ratio - 1 after it.
        padded = jnp.pad(raw, ((0, 0), (0, ratio - 1), (0, 0)))
        pooled = sum(padded[:, s : s + keys_len] for s in range(ratio)) / ratio
        pooled = layers.RMSNorm(name="k_layernorm", **norm)(pooled.astype(h.dtype)[:, :, None])
        keys = attention.apply_rotary(pooled, k_sin, k_cos, interleaved=False)[:, :, 0]
        scores = jnp.einsum("bqhd,bkd->bqhk", q, keys.astype(jnp.float32))
        scores = jnp.sum(jax.nn.relu(scores), axis=2) / math.sqrt(dim)  # [batch, q, k]

        idx = jnp.arange(keys_len)
        offset = jnp.mod(place, ratio)
        complete = (idx + ratio - 1) <= q_slot[..., None]  # [b, q, k]: its block complete
        valid = visible & (offset == 0)[:, None, :] & complete
        top = min(cfg.indexer_budget // ratio, keys_len)
        values, chosen = jax.lax.top_k(jnp.where(valid, scores, -jnp.inf), top)
        picked = jax.nn.one_hot(chosen, keys_len, dtype=jnp.bool_)
        picked = jnp.any(picked & (values > -jnp.inf)[..., None], axis=2)  # [b, q, block start]
        start = jnp.broadcast_to(idx[None, :] - offset, (batch, keys_len))
        index = jnp.broadcast_to(jnp.maximum(start, 0)[:, None], picked.shape)
        by_block = jnp.take_along_axis(picked, index, 2)
        tail = (start[:, None, :] + ratio - 1) > q_slot[..., None]
        return (visible & (by_block | tail))[:, None]
