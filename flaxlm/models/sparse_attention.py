"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2, GLM-5): a lightning indexer picks the
`index_topk` keys each query attends to, and multi-head latent attention (`mla.py`) runs over
those alone.

The indexer is a small attention of its own beside MLA's (HF's `self_attn.indexer`):
`index_n_heads` query heads of `index_head_dim` features from the attention's normalised
query latent (`wq_b` of `q_a_layernorm`'s output), one key per token from the layer's input
(`wk`, then a LayerNorm with bias, `k_norm`), both rotated over their first
`qk_rope_head_dim` features with the attention's sin/cos tables (DeepSeek-V3.2 pairs them
half-split, GLM-5 interleaved: `indexer_rope_interleave`), and a weight per query and head
(`weights_proj` of the input, in float32, over sqrt(index_n_heads)). Key t's score for query
s is `sum_h w[s, h] relu(q[s, h] . k[t] / sqrt(index_head_dim))`; of the keys the mask lets
the query see, it attends to the `index_topk` best (all of them where there are fewer), and
the rest are masked. Where the `index_topk`-th best score ties with keys left out (the
ReLU makes a score exactly 0 wherever every head's dot product is negative, which is common
with few `index_n_heads`), `jax.lax.top_k` keeps the earliest positions; torch's `topk`
order among equal values is unspecified (its partial sort's), so such a config can choose
other keys than HF's model does and its logits differ there. No Hadamard rotation and no FP8
scoring: HF's bf16/fp32 equivalent of DeepSeek's kernels, which this follows
(`DeepseekV32Indexer`, `GlmMoeDsaIndexer`).

Where the keys are no more than `index_topk` (a short sequence, a small cache: a static
shape) every visible key is chosen, so the layer is dense MLA exactly and the indexer's
scores are not computed; its projections still run, so its params exist and its keys reach
the decoding cache for later steps.

A decoding step (one query a row) reads the latents of its chosen slots alone
(`mla.DecodingCache`'s `slots`: from the contiguous cache, or from the engine's pool the pages
they lie on) and attends over those `index_topk`; the indexer's keys (`indexer/cache/key`,
`[batch, slots, 1, index_head_dim]`, a quarter of a latent's width or less) are all read, as
the choice needs them. Training, scoring and prefill narrow the mask instead: the attention
still scores every key (XLA's einsums, any `attention` implementation given a dense bool
mask), as dense MLA costs, since a gather of `index_topk` keys for each of many queries
would hold more than the dense scores; DeepSeek's FlashMLA sparse kernels are not here.

As in HF (`torch.no_grad`), the indexer takes no gradient: the choice is integer top-k, and
nothing of the language-model loss reaches its params (DeepSeek trains it with a KL term to
the dense attention's distribution, which HF does not have, nor does flaxlm).

GLM-5's layers may share a choice (`indexer_types`): a 'shared' layer has no indexer and
attends to the keys the last 'full' layer chose, carried from block to block (`chosen`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models import attention, layers, masks, mla

Array = jax.Array

# HF's `k_norm` is `nn.LayerNorm(index_head_dim, eps=1e-6)` whatever the config's epsilon.
INDEXER_NORM_EPS = 1e-6
INDEX_CACHE_AXES = mla.LATENT_CACHE_AXES  # [batch, slots, 1, index_head_dim]


def dense_mask(mask: masks.Mask | Array) -> Array:
    """bool `[batch, 1, q_len, kv_len]` of a `Mask` or an already dense (paged) mask."""
    return mask.dense() if isinstance(mask, masks.Mask) else mask


def index_scores(q: Array, k: Array, weights: Array, scale: float) -> Array:
    """float32 `[batch, q_len, kv_len]`: `sum_h weights[b, s, h] relu(scale q[b, s, h] .
    k[b, t])` of queries `[batch, q_len, heads, dim]`, keys `[batch, kv_len, dim]` and
    weights `[batch, q_len, heads]`, in float32 as HF's."""
    f32 = jnp.float32
    dots = jnp.einsum("bshd,btd->bsht", q.astype(f32), k.astype(f32)) * scale
    return jnp.einsum("bsh,bsht->bst", weights.astype(f32), jax.nn.relu(dots))


def chosen_mask(mask: masks.Mask | Array, chosen: Array) -> Array:
    """bool `[batch, 1, q_len, kv_len]`: `mask` and each query's `chosen` key slots, int32
    `[batch, q_len, k]` (slots the mask hides stay hidden)."""
    keep = dense_mask(mask)
    batch, q_len, _ = chosen.shape
    rows = jnp.arange(batch)[:, None, None]
    queries = jnp.arange(q_len)[None, :, None]
    picked = jnp.zeros((batch, q_len, keep.shape[-1]), bool).at[rows, queries, chosen].set(True)
    return keep & picked[:, None]


class Indexer(nn.Module):
    """The lightning indexer: `(h, q_latent, sin, cos, mask, decoding)` -> int32 `[batch,
    length, index_topk]`, the key slots each query attends to, or None where the keys are no
    more than `index_topk` (every visible one). Params (HF's names): `wq_b`, `wk`, `k_norm`
    (scale and bias), `weights_proj`; while decoding its keys are cached (`cache/key`)."""

    config: Any  # a DeepseekV32Config (the index_* fields, indexer_rope_interleave)

    @nn.compact
    def __call__(
        self,
        h: Array,
        q_latent: Array,
        sin: Array,
        cos: Array,
        mask: masks.Mask | Array,
        decoding: masks.Decoding | None,
    ) -> Array | None:
        cfg = self.config
        heads, dim = cfg.index_n_heads, cfg.index_head_dim
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        # HF's indexer runs under torch.no_grad; the choice is integer anyway.
        h, q_latent = jax.lax.stop_gradient(h), jax.lax.stop_gradient(q_latent)
        q = layers.DenseGeneral(
            (heads, dim), (mla.LATENT_IN, "heads", "head_dim"), name="wq_b", **dense
        )(q_latent)  # [batch, length, heads, dim]
        k = layers.DenseGeneral(dim, ("embed", "head_dim"), name="wk", **dense)(h)
        k = layers.LayerNorm(INDEXER_NORM_EPS, axes=("head_dim",), name="k_norm", **dense)(k)
        rotate = dict(interleaved=cfg.indexer_rope_interleave)
        q = attention.apply_rotary(q, sin, cos, **rotate)
        k = attention.apply_rotary(k[:, :, None], sin, cos, **rotate)  # [batch, length, 1, dim]
        # HF keeps weights_proj in float32 (`_keep_in_fp32_modules`) and feeds it float32.
        weights = layers.DenseGeneral(
            heads, ("embed", "heads"), dtype=jnp.float32, param_dtype=cfg.param_dtype,
            name="weights_proj",
        )(h.astype(jnp.float32))  # fmt: skip
        if decoding is not None:
            (k,) = mla.DecodingCache(("key",), INDEX_CACHE_AXES, name="cache")((k,), decoding)
        if k.shape[1] <= cfg.index_topk:
            return None
        scores = index_scores(q, k[:, :, 0], weights * heads**-0.5, dim**-0.5)
        scores = jnp.where(dense_mask(mask)[:, 0], scores, -jnp.inf)
        return jax.lax.top_k(scores, cfg.index_topk)[1]


class SparseLatentAttention(mla.MultiHeadLatentAttention):
    """Multi-head latent attention over each query's chosen keys: `(h, sin, cos, mask,
    decoding, chosen=None)` -> (`[batch, length, embed]`, the chosen key slots or None). Its
    own `Indexer` (`indexer`) chooses, or, `shared` (a GLM-5 'shared' layer, no indexer),
    the `chosen` an earlier layer's did."""

    shared: bool = False

    @nn.compact
    def __call__(
        self,
        h: Array,
        sin: Array,
        cos: Array,
        mask: masks.Mask | Array,
        decoding: masks.Decoding | None,
        chosen: Array | None = None,
    ) -> tuple[Array, Array | None]:
        return self.attend(h, sin, cos, mask, decoding, chosen=chosen)

    def narrow(
        self,
        mask: masks.Mask | Array,
        h: Array,
        q_latent: Array | None,
        sin: Array,
        cos: Array,
        decoding: masks.Decoding | None,
        chosen: Array | None,
    ) -> tuple[masks.Mask | Array, Array | None]:
        if not self.shared:
            chosen = Indexer(self.config, name="indexer")(h, q_latent, sin, cos, mask, decoding)
        return (mask if chosen is None else chosen_mask(mask, chosen)), chosen
