"""DeepSeek-V4's attention (HF's `DeepseekV4Attention`): shared-key-value multi-query
attention over a sliding window, plus, by the layer's kind, entries compressed from windows of
the sequence.

Every kind (`layer_types`): queries through a latent (`q_a_proj`, `q_a_norm`, `q_b_proj`, then
each head RMS-normalised without a scale), one key per token that is also its value
(`kv_proj`, `kv_norm`), the last `qk_rope_head_dim` features of both rotated with interleaved
pairs, a learned sink logit per head (`attention.AttentionSinks`), the output's rotated
features rotated back to the query's position, and a grouped low-rank output (`o_a_proj`: each
of `o_groups` groups of heads to `o_lora_rank` features; `o_b_proj`: all of them to the
width). Keys are the `sliding_window` latest tokens; a compressing kind adds compressed
entries (`Compressor`), each query seeing those whose windows it has read whole:

- 'heavily_compressed_attention' (HCA): one entry per `hca_compress_rate` tokens, their keys
  (`kv_proj`) pooled by a softmax over the window of per-feature gates (`gate_proj` plus a
  learned `position_bias` per slot), RMS-normalised and rotated at the window's first
  position, with the 'compress' rotary (`compress_rope_theta`, YaRN where configured);
- 'compressed_sparse_attention' (CSA): windows of `csa_compress_rate` tokens projected to two
  series, entry w pooling window w's second with window w - 1's first (overlapping windows of
  twice the rate), and a lightning indexer (`Indexer`: the same compression at
  `index_head_dim`, `index_n_heads` queries from the query latent, DeepSeek-V3.2's scores,
  `sparse_attention.index_scores`) keeping each query's `index_topk` best entries.

Sliding-window layers use the 'main' rotary (`rope_theta`, no scaling), compressing ones the
'compress' rotary for everything. Packed rows: a query sees no entry whose window holds
another segment's tokens, but windows count from the row's start, so a packed example is not
compressed as it would be alone.

Decoding (`deepseek_v4.DeepseekV4LM`, a contiguous cache of its own: `deepseek_v4_cache`):
a prompt from position 0 is read whole (the sequence's own attention) and fills the caches;
any other read (a step, a chunk that resumes a sequence) continues them from each row's
position, its queries over the ring's keys and the chunk's, and over every cached entry
whose window is whole at the query.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models import attention, layers, masks, mla, rope, sparse_attention
from flaxlm.models import deepseek_v4_cache as cache

Array = jax.Array
RopeTables = tuple[Array, Array]  # float32 (sin, cos) [batch, length, qk_rope_head_dim // 2]

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
LAYER_TYPES = (SLIDING, CSA, HCA)


def unit_rms(x: Array, eps: float) -> Array:
    """`x` over the RMS of its last axis, in float32, no scale (HF's unweighted RMSNorm)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)).astype(x.dtype)


def rotate_tail(x: Array, sin: Array, cos: Array) -> Array:
    """`x` `[batch, length, heads, dim]` with its last `2 * sin.shape[-1]` features rotated
    in interleaved pairs (HF's V4 `apply_rotary_pos_emb`: heads laid out [nope | rope])."""
    width = 2 * sin.shape[-1]
    rotated = attention.apply_rotary(x[..., -width:], sin, cos, interleaved=True)
    return jnp.concatenate([x[..., : x.shape[-1] - width], rotated], axis=-1)


def main_sin_cos(positions: Array, cfg: Any) -> RopeTables:
    """The 'main' rotary's tables (sliding-window layers): `rope_theta`, never scaled."""
    inv_freq = attention.rotary_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)
    return attention.rotary_sin_cos(positions, inv_freq)


def compress_sin_cos(positions: Array, cfg: Any) -> RopeTables:
    """The 'compress' rotary's tables: `compress_rope_theta` and the config's rope scaling."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(rope.RopeScaling)}
    view = types.SimpleNamespace(
        **fields, rope_theta=cfg.compress_rope_theta, dim_per_head=cfg.qk_rope_head_dim
    )
    return rope.sin_cos(positions, view)


class GroupedLinear(nn.Module):
    """HF's `DeepseekV4GroupedLinear`: `[..., groups, in]` -> `[..., groups, features]`, each
    group through its own kernel (`kernel` `[groups, in, features]`)."""

    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        groups, width = x.shape[-2:]
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), ("heads", None, None)),
            (groups, width, self.features),
            layers.as_dtype(self.param_dtype),
        )
        dtype = layers.as_dtype(self.dtype)
        return jnp.einsum("...gi,gio->...go", x.astype(dtype), kernel.astype(dtype))


def pool(kv: Array, gate: Array, norm: nn.Module, starts: Array, cfg: Any) -> Array:
    """Entries `[batch, n, dim]` of the windows `kv` `[batch, n, span, dim]`, weighted by a
    float32 softmax of `gate` (position bias added; -inf: not pooled) over each window,
    RMS-normalised and rotated at their first positions `starts` int32 `[batch, n]`."""
    probs = jax.nn.softmax(gate, axis=2).astype(kv.dtype)
    pooled = norm((kv * probs).sum(axis=2))
    sin, cos = compress_sin_cos(starts, cfg)
    return rotate_tail(pooled[:, :, None], sin, cos)[:, :, 0]


def overlapped(
    kv: Array, gate: Array, earlier_kv: Array, earlier_gate: Array, dim: int
) -> tuple[Array, Array]:
    """CSA's windows of twice the rate `[batch, n, 2 x rate, dim]`: the earlier window's
    first series, then this window's second."""
    return (
        jnp.concatenate([earlier_kv[..., :dim], kv[..., dim:]], axis=2),
        jnp.concatenate([earlier_gate[..., :dim], gate[..., dim:]], axis=2),
    )


def pool_series(
    kv: Array, gate: Array, bias: Array, norm: nn.Module, first: Array, overlap: bool, cfg: Any
) -> tuple[Array, Array]:
    """The entries `[batch, m, dim]` of consecutive windows `kv`, `gate` `[batch, n, ratio,
    width]` (the position bias added to `gate`), window `first` int32 `[batch]` the first
    (a negative window pools nothing), and int32 `[batch, m]` the windows they are: each
    window's (m = n), or with `overlap` each entry pooling the window before it too (m = n - 1,
    the first window read only so)."""
    ratio = kv.shape[2]
    windows = first[:, None] + jnp.arange(kv.shape[1], dtype=jnp.int32)
    gate = jnp.where((windows >= 0)[..., None, None], gate.astype(jnp.float32) + bias, -jnp.inf)
    if overlap:  # [batch, n - 1, 2 x ratio, dim]: window w - 1's first series, then w's second
        dim = kv.shape[-1] // 2
        kv, gate = overlapped(kv[:, 1:], gate[:, 1:], kv[:, :-1], gate[:, :-1], dim)
        windows = windows[:, 1:]
    return pool(kv, gate, norm, windows * ratio, cfg), windows


def pooled_windows(
    module: nn.Module,
    h: Array,
    dim: int,
    ratio: int,
    overlap: bool,
    eps: float,
    cfg: Any,
    decoding: masks.Decoding | None = None,
) -> Array | None:
    """float32-pooled compressed entries `[batch, windows, dim]` of `h` `[batch, length,
    embed]`, with their params (`kv_proj`, `gate_proj`, `position_bias`, `kv_norm`) in
    `module`'s scope, rotated at each window's first position; None when the sequence holds
    no whole window. `overlap`: two series per token, entry w pooling window w's second and
    window w - 1's first (CSA). While `decoding` (`deepseek_v4_cache`), a prompt also keeps
    its open window's projections and its entries in `module`'s cache, and a read that
    continues the cache gives every cached entry (`[batch, slots, dim]`, those of windows
    not yet whole to be hidden: `visible_entries`)."""
    batch, length, _ = h.shape
    n = length // ratio
    width = 2 * dim if overlap else dim
    dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    kv = layers.DenseGeneral(width, ("embed", None), name="kv_proj", **dense)(h)
    gate = layers.DenseGeneral(width, ("embed", None), name="gate_proj", **dense)(h)
    bias = module.param(
        "position_bias",
        nn.with_logical_partitioning(nn.initializers.zeros, (None, None)),
        (ratio, width),
        jnp.float32,
    )
    norm = layers.RMSNorm(eps, axes=(None,), name="kv_norm", **dense)
    if decoding is not None:
        span = 2 * ratio if overlap else ratio  # the open window (CSA: and the one before)
        slots = -(-decoding.length // ratio)  # entry w in slot w
        entries = cache.cache_variable(
            module, "entries", (batch, 1, slots, dim), cfg.dtype, decoding
        )
        if decoding.length == 0:  # continue the cache from each row's start
            kv = cache.window_series(module, "window_kv", kv, ratio, span, decoding)
            gate = cache.window_series(module, "window_gate", gate, ratio, span, decoding)
            start, last = cache.chunk_bounds(decoding)
            first = start // ratio - (span // ratio - 1)
            pooled, windows = pool_series(kv, gate, bias, norm, first, overlap, cfg)
            return cache.write_entries(entries, pooled, windows, last >= start)
        cache.read_prompt(module, "window_kv", kv, span, decoding)
        cache.read_prompt(module, "window_gate", gate, span, decoding)
    if n == 0:
        if module.is_initializing():  # its params exist whatever the length
            norm(jnp.zeros((1, 1, dim), jnp.float32))
        return None
    kv = kv[:, : n * ratio].reshape(batch, n, ratio, width)
    gate = gate[:, : n * ratio].reshape(batch, n, ratio, width)
    first = jnp.zeros((batch,), jnp.int32)
    if overlap:  # a window -1 before the first, pooled from nothing
        before = ((0, 0), (1, 0), (0, 0), (0, 0))
        kv, gate, first = jnp.pad(kv, before), jnp.pad(gate, before), first - 1
    pooled, windows = pool_series(kv, gate, bias, norm, first, overlap, cfg)
    if decoding is not None:  # windows past a row's end are rewritten before they are read
        cache.write_entries(entries, pooled, windows, jnp.ones((batch,), bool))
    return pooled


def visible_entries(
    positions: Array, segment_ids: Array | None, n: int, ratio: int, overlap: bool
) -> Array:
    """bool `[batch, length, n]`: the entries each query may read: windows it has read whole
    (HF: entry w < (position + 1) // ratio) that hold its own segment's tokens only."""
    entries = jnp.arange(n)
    keep = entries[None, None, :] < ((positions + 1) // ratio)[:, :, None]
    if segment_ids is None or n == 0:
        return keep
    windows = segment_ids[:, : n * ratio].reshape(-1, n, ratio)
    last = windows[..., -1]  # [batch, n]
    whole = jnp.all(windows == last[..., None], axis=-1)
    if overlap:  # the previous window's tokens are pooled in too
        prev_whole = jnp.pad(whole[:, :-1], ((0, 0), (1, 0)), constant_values=True)
        prev_last = jnp.pad(last[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
        whole &= prev_whole & ((entries[None] == 0) | (prev_last == last))
    own = (last[:, None, :] == segment_ids[:, :, None]) & whole[:, None, :]
    return keep & own


class Indexer(nn.Module):
    """CSA's lightning indexer (HF's `compressor.indexer`): `(h, q_latent, positions,
    visible, decoding)` -> bool `[batch, length, windows]`, the `index_topk` visible entries
    each query scores best (all of them where fewer). Params: the compression's, `q_b_proj`,
    and `scorer/weights_proj`; while decoding, its compression's cache (`pooled_windows`)."""

    config: Any

    @nn.compact
    def __call__(
        self,
        h: Array,
        q_latent: Array,
        positions: Array,
        visible: Array,
        decoding: masks.Decoding | None = None,
    ) -> Array:
        cfg = self.config
        heads, dim, rate = cfg.index_n_heads, cfg.index_head_dim, cfg.csa_compress_rate
        keys = pooled_windows(self, h, dim, rate, True, cfg.rms_norm_eps, cfg, decoding)
        q = layers.DenseGeneral(
            (heads, dim), (mla.LATENT_IN, "heads", "head_dim"), name="q_b_proj",
            dtype=cfg.dtype, param_dtype=cfg.param_dtype,
        )(q_latent)  # fmt: skip
        q = rotate_tail(q, *compress_sin_cos(positions, cfg))
        # HF keeps weights_proj in float32 (`_keep_in_fp32_modules`).
        weights = IndexerScorer(heads, cfg.param_dtype, name="scorer")(h)
        if keys is None:  # no whole window yet (params made all the same)
            return visible
        scores = sparse_attention.index_scores(q, keys, weights * heads**-0.5, dim**-0.5)
        scores = jnp.where(visible, scores, -jnp.inf)
        top = jax.lax.top_k(scores, min(cfg.index_topk, scores.shape[-1]))[1]
        chosen = jax.nn.one_hot(top, scores.shape[-1], dtype=jnp.int32).sum(-2) > 0
        return chosen & visible


class IndexerScorer(nn.Module):
    """The indexer's per-head query weights (HF's `scorer.weights_proj`), float32."""

    heads: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, h: Array) -> Array:
        return layers.DenseGeneral(
            self.heads, ("embed", "heads"), dtype=jnp.float32, param_dtype=self.param_dtype,
            name="weights_proj",
        )(h.astype(jnp.float32))  # fmt: skip


class Compressor(nn.Module):
    """A compressing layer's entries (HF's `self_attn.compressor`): `(h, q_latent,
    positions, segment_ids, decoding)` -> (entries `[batch, windows, head_dim]` or None, bool
    `[batch, length, windows]` the entries each query reads); a read that continues the
    cache gets every cached entry, those of windows not yet whole hidden."""

    config: Any
    kind: str  # CSA or HCA

    @nn.compact
    def __call__(
        self,
        h: Array,
        q_latent: Array,
        positions: Array,
        segment_ids: Array | None,
        decoding: masks.Decoding | None = None,
    ) -> tuple[Array | None, Array | None]:
        cfg = self.config
        csa = self.kind == CSA
        ratio = cfg.csa_compress_rate if csa else cfg.hca_compress_rate
        entries = pooled_windows(self, h, cfg.head_dim, ratio, csa, cfg.rms_norm_eps, cfg, decoding)
        n = 0 if entries is None else entries.shape[1]
        visible = visible_entries(positions, segment_ids, n, ratio, csa)
        if csa:
            visible = Indexer(cfg, name="indexer")(h, q_latent, positions, visible, decoding)
        return (None, None) if entries is None else (entries, visible)


class DeepseekV4Attention(nn.Module):
    """`(h, mask, main, compress, positions, decoding)` -> `[batch, length, embed]`: the
    layer's `kind` of attention (module docstring), `main` and `compress` the two rotaries'
    tables at the tokens' positions; `decoding` (None: a whole sequence) fills or continues
    the cache (`deepseek_v4_cache`). Params are HF's names (`q_a_proj`, `q_a_norm`, `q_b_proj`,
    `kv_proj`, `kv_norm`, `sinks`, `o_a_proj`, `o_b_proj`, `compressor`)."""

    config: Any
    kind: str

    @nn.compact
    def __call__(
        self,
        h: Array,
        mask: masks.Mask,
        main: RopeTables,
        compress: RopeTables,
        positions: Array,
        decoding: masks.Decoding | None = None,
    ) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        heads, dim, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
        sin, cos = main if self.kind == SLIDING else compress
        q_latent = layers.DenseGeneral(cfg.q_lora_rank, ("embed", None), name="q_a_proj", **dense)(
            h
        )
        q_latent = layers.RMSNorm(eps, axes=(None,), name="q_a_norm", **dense)(q_latent)
        q = layers.DenseGeneral(
            (heads, dim), (mla.LATENT_IN, "heads", "head_dim"), name="q_b_proj", **dense
        )(q_latent)
        q = rotate_tail(unit_rms(q, eps), sin, cos)  # [batch, length, heads, dim]
        kv = layers.DenseGeneral(dim, ("embed", "head_dim"), name="kv_proj", **dense)(h)
        kv = layers.RMSNorm(eps, axes=("head_dim",), name="kv_norm", **dense)(kv)
        kv = rotate_tail(kv[:, :, None], sin, cos)  # [batch, length, 1, dim]: key = value
        resume = decoding is not None and decoding.length == 0  # continues the cache
        if resume:  # the ring's keys, then the chunk's: [batch, 1, length, window + length]
            window = cfg.sliding_window
            kv, keep = cache.sliding_keys(self, kv[:, :, 0], positions, window, decoding)
        else:  # [batch, 1, length, length]
            keep = mask.dense()
            if decoding is not None:
                cache.read_prompt(self, "sliding_kv", kv[:, :, 0], cfg.sliding_window, decoding)
        if self.kind != SLIDING:  # a continuing read's row is one sequence: no segments
            segment_ids = None if resume else mask.q_segment_ids
            entries, visible = Compressor(cfg, self.kind, name="compressor")(
                h, q_latent, positions, segment_ids, decoding
            )
            if entries is not None:
                kv = jnp.concatenate([kv, entries[:, :, None].astype(kv.dtype)], axis=1)
                keep = jnp.concatenate([keep, visible[:, None]], axis=-1)
        sinks = attention.AttentionSinks(heads, cfg.param_dtype, name="sinks")()
        out = attention.dot_product_attention(
            q, kv, kv, keep, scale=dim**-0.5, dtype=cfg.dtype, implementation="xla",
            sinks=sinks,
        )  # fmt: skip
        # Values carry their keys' rotation: undo it at the query's position.
        out = rotate_tail(out, -sin, cos)
        batch, length = h.shape[:2]
        grouped = out.reshape(batch, length, cfg.o_groups, heads * dim // cfg.o_groups)
        grouped = GroupedLinear(cfg.o_lora_rank, name="o_a_proj", **dense)(grouped)
        return layers.DenseGeneral(cfg.hidden_size, ("mlp", "embed"), name="o_b_proj", **dense)(
            grouped.reshape(batch, length, -1)
        )
