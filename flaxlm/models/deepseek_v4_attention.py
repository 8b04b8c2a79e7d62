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

Decoding (`deepseek_v4.DeepseekV4LM`, a contiguous cache): rows are right-padded (each row's
tokens from position 0, `masks.Decoding.slots` their positions), so that the compressors'
windows count from each row's first token, and each layer keeps in the `cache` collection
what the next token reads, each leaf `[batch, 1, slots, width]` (rows in axis `ndim - 4`,
where `decoding.gather_rows` reorders them for beam search): `sliding_kv` the keys (= values) of the
`sliding_window` latest positions, a ring (position p in slot p % sliding_window); per
compressor (and CSA's indexer) `window_kv` / `window_gate` the projections of the open
window's tokens (CSA: and of the window before it, whose first series the next entry pools:
a ring of 2 x rate slots) and `entries` the compressed entries, entry w in slot w. A prompt
is read whole (the sequence's own attention) and fills the caches; a step of one token
writes its key and projections, pools its window's entry again (read only once the window
is whole), and attends over the ring and the entries: O(sliding_window + entries) a step,
what HF's `DeepseekV4HCACache` / `DeepseekV4CSACache` keep.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models import attention, layers, masks, mla, rope, sparse_attention

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


CACHE_AXES = ("batch", None, None, None)  # every cache leaf: [batch, 1, slots, width]


def ring_positions(last: Array, size: int) -> Array:
    """int32 `[batch, size]`: the position each slot of a ring of `size` slots holds once the
    positions up to `last` int32 `[batch]` are written (position p in slot p % size;
    negative: none yet)."""
    last = last[:, None]
    return last - (last - jnp.arange(size, dtype=jnp.int32)) % size


def cache_variable(
    module: nn.Module, name: str, shape: tuple[int, ...], dtype: Any, decoding: masks.Decoding
) -> Any:
    """`module`'s decoding-cache variable `name` (`[batch, 1, slots, width]`), zeros when
    the prompt's reading makes it (`decoding.length`: the positions it covers)."""
    if decoding.length < 1 and not module.has_variable("cache", name):
        raise ValueError(
            f"{module.name} has no cached {name!r}: a decoding step follows the prefill that "
            "makes the cache (DeepseekV4LM.prefill)."
        )
    return module.variable("cache", name, jnp.zeros, shape, layers.as_dtype(dtype))


def store(variable: Any, value: Array) -> Array:
    """`value` written as the cache `variable`'s (its dtype, rows over the batch axes)."""
    variable.value = layers.constrain(value.astype(variable.value.dtype), CACHE_AXES)
    return variable.value


def read_prompt(
    module: nn.Module, name: str, x: Array, size: int, decoding: masks.Decoding
) -> None:
    """Keeps in `module`'s ring `name` `[batch, 1, size, width]` the `size` latest of the
    prompt's `x` `[batch, length, width]` (each row's end: its largest `decoding.slots`)."""
    last = jnp.max(decoding.slots, axis=1)
    take = jnp.maximum(ring_positions(last, size), 0)[..., None]
    ring = cache_variable(module, name, (x.shape[0], 1, size, x.shape[-1]), x.dtype, decoding)
    store(ring, jnp.take_along_axis(x, take, axis=1)[:, None])


def write_step(
    module: nn.Module, name: str, x: Array, position: Array, size: int, decoding: masks.Decoding
) -> Array:
    """Writes a step's `x` `[batch, 1, width]` at `position` int32 `[batch]` of `module`'s
    ring `name`: the ring `[batch, size, width]`."""
    shape = (x.shape[0], 1, size, x.shape[-1])
    ring = cache_variable(module, name, shape, x.dtype, decoding)
    at = (jnp.arange(x.shape[0]), 0, position % size)
    return store(ring, ring.value.at[at].set(x[:, 0].astype(ring.value.dtype)))[:, 0]


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


def pooled_windows(
    module: nn.Module,
    h: Array,
    dim: int,
    ratio: int,
    overlap: bool,
    eps: float,
    cfg: Any,
    decoding: masks.Decoding | None = None,
    positions: Array | None = None,
) -> Array | None:
    """float32-pooled compressed entries `[batch, windows, dim]` of `h` `[batch, length,
    embed]`, with their params (`kv_proj`, `gate_proj`, `position_bias`, `kv_norm`) in
    `module`'s scope, rotated at each window's first position; None when the sequence holds
    no whole window. `overlap`: two series per token, entry w pooling window w's second and
    window w - 1's first (CSA). While `decoding` (module docstring), a prompt also keeps its
    open window's projections and its entries in `module`'s cache, and a step of one token
    (at `positions` `[batch, 1]`) gives every cached entry (`[batch, slots, dim]`, the
    unclosed ones to be hidden: `visible_entries`)."""
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
        entries = cache_variable(module, "entries", (batch, 1, slots, dim), cfg.dtype, decoding)
        if length == 1:
            projected = (kv, gate, bias, norm)
            return step_entries(module, projected, entries, ratio, overlap, positions, decoding)
        read_prompt(module, "window_kv", kv, span, decoding)
        read_prompt(module, "window_gate", gate, span, decoding)
    if n == 0:
        if module.is_initializing():  # its params exist whatever the length
            norm(jnp.zeros((1, 1, dim), jnp.float32))
        return None
    kv = kv[:, : n * ratio].reshape(batch, n, ratio, width)
    gate = gate[:, : n * ratio].reshape(batch, n, ratio, width).astype(jnp.float32) + bias
    if overlap:  # [batch, n, 2 * ratio, dim]: window w - 1's first series, then w's second
        before = ((0, 0), (1, 0), (0, 0), (0, 0))
        earlier_gate = jnp.pad(gate[:, :-1], before, constant_values=-jnp.inf)
        kv, gate = overlapped(kv, gate, jnp.pad(kv[:, :-1], before), earlier_gate, dim)
    starts = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) * ratio, (batch, n))
    pooled = pool(kv, gate, norm, starts, cfg)
    if decoding is not None:  # windows past a row's end are rewritten before they are read
        store(entries, entries.value.at[:, 0, :n].set(pooled.astype(entries.value.dtype)))
    return pooled


def step_entries(
    module: nn.Module,
    projected: tuple[Array, Array, Array, nn.Module],
    entries: Any,
    ratio: int,
    overlap: bool,
    positions: Array,
    decoding: masks.Decoding,
) -> Array:
    """A step's cached `entries` (the variable `[batch, 1, slots, dim]`) `[batch, slots,
    dim]`: its token's `projected` (kv, gate `[batch, 1, width]`, the position bias and the
    norm) written into the open window, whose entry is pooled again (whole once the step
    closes it)."""
    kv, gate, bias, norm = projected
    dim = entries.value.shape[-1]
    position = positions[:, 0]
    span = 2 * ratio if overlap else ratio
    kv_ring = write_step(module, "window_kv", kv, position, span, decoding)
    gate_ring = write_step(module, "window_gate", gate, position, span, decoding)
    window = position // ratio

    def read(ring: Array, w: Array) -> Array:  # [batch, 1, ratio, width]: window w's tokens
        slots = (w % (span // ratio) * ratio)[:, None] + jnp.arange(ratio)
        return jnp.take_along_axis(ring, slots[..., None], axis=1)[:, None]

    kv, gate = read(kv_ring, window), read(gate_ring, window).astype(jnp.float32) + bias
    if overlap:  # the first window pools nothing before it
        earlier_gate = read(gate_ring, window + 1).astype(jnp.float32) + bias
        earlier_gate = jnp.where((window > 0)[:, None, None, None], earlier_gate, -jnp.inf)
        kv, gate = overlapped(kv, gate, read(kv_ring, window + 1), earlier_gate, dim)
    entry = pool(kv, gate, norm, (window * ratio)[:, None], module.config)
    at = (jnp.arange(kv.shape[0]), 0, window)
    return store(entries, entries.value.at[at].set(entry[:, 0].astype(entries.value.dtype)))[:, 0]


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
        keys = pooled_windows(self, h, dim, rate, True, cfg.rms_norm_eps, cfg, decoding, positions)
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
    `[batch, length, windows]` the entries each query reads); a decoding step's are every
    cached entry, those of windows not yet whole hidden."""

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
        entries = pooled_windows(
            self, h, cfg.head_dim, ratio, csa, cfg.rms_norm_eps, cfg, decoding, positions
        )
        n = 0 if entries is None else entries.shape[1]
        visible = visible_entries(positions, segment_ids, n, ratio, csa)
        if csa:
            visible = Indexer(cfg, name="indexer")(h, q_latent, positions, visible, decoding)
        return (None, None) if entries is None else (entries, visible)


class DeepseekV4Attention(nn.Module):
    """`(h, mask, main, compress, positions, decoding)` -> `[batch, length, embed]`: the
    layer's `kind` of attention (module docstring), `main` and `compress` the two rotaries'
    tables at the tokens' positions; `decoding` (None: a whole sequence) reads or fills the
    cache (module docstring). Params are HF's names (`q_a_proj`, `q_a_norm`, `q_b_proj`,
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
        step = decoding is not None and h.shape[1] == 1
        if step:  # the window's keys from the ring, the new one written
            window = cfg.sliding_window
            kv = write_step(self, "sliding_kv", kv[:, :, 0], positions[:, 0], window, decoding)[
                :, :, None
            ]
            keep = (ring_positions(positions[:, 0], window) >= 0)[:, None, None]
        else:  # [batch, 1, length, length]
            keep = mask.dense()
            if decoding is not None:
                read_prompt(self, "sliding_kv", kv[:, :, 0], cfg.sliding_window, decoding)
        if self.kind != SLIDING:  # a step's row is one sequence: no segments
            segment_ids = None if step else mask.q_segment_ids
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
