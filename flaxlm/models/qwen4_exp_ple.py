"""Qwen4-Exp's Per-Layer Embeddings (PLE, `qwen4_exp.py`'s family): hashed token n-grams
looked up in a per-layer table, gated into every hyper-connection stream, then a dilated
depthwise short convolution.

Follows transformers' `Qwen4ExpTextNGramEmbedding` and `Qwen4ExpTextPLELayer`. For each
order n in 2..`ngram_size` and each of its `heads_per_ngram` heads, a token's id is the
XOR of `token[t - s] * multiplier[s]` over s < n (64-bit integers, wrapping), modulo the
head's prime vocabulary size, plus the head's offset in the layer's table; a token whose
n-gram would reach past the last EOS before it (or the start of its segment) reads EOS in
those places. HF computes in int64; JAX here runs without x64, so the products, XORs and
remainders are computed exactly on 16-bit limbs held in uint32 (`hash_ids`): the head
vocabulary sizes must stay below 2**28 (refused otherwise, naming `ngram_vocab_size_base`).

The constants (multipliers from splitmix64 of `seed`, each head's prime size and offset) are
Python integers computed from the config (`NGramTables`), as HF's `_init_weights` builds its
buffers; the export writes those buffers (`buffers`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.models import layers, state_slots

Array = jax.Array

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_PRIME_1 = 10007
MAX_HEAD_VOCAB = 1 << 28  # `_mod`'s 4-bit Horner steps stay inside uint32 below it


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


@functools.cache
def _primes_after(start: int, count: int) -> tuple[int, ...]:
    """The first `count` primes greater than `start`."""
    out, value = [], start
    while len(out) < count:
        value += 1
        if _is_prime(value):
            out.append(value)
    return tuple(out)


class NGramTables(NamedTuple):
    """One PLE layer's constants (HF's buffers): `multipliers` (one per n-gram position),
    each head's prime `sizes` and `offsets` in the table, the table's padded `rows`."""

    multipliers: tuple[int, ...]
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    rows: int


def ngram_tables(cfg: Any, ple_index: int) -> NGramTables:
    """The constants of the `ple_index`-th PLE layer (its place in `ple_layer_ids`)."""
    heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    bound = max(1, ((1 << 63) - 1) // max(cfg.vocab_size_for_ple, 1) // 2)
    seed = cfg.seed + _PRIME_1 * ple_index
    multipliers = tuple(
        2 * (_splitmix64((seed + _GAMMA * (s + 1)) & _MASK64) % bound) + 1
        for s in range(cfg.ngram_size)
    )
    primes = _primes_after(cfg.ngram_vocab_size_base - 1, (ple_index + 1) * heads)
    sizes = primes[ple_index * heads :]
    offsets = tuple(int(x) for x in np.cumsum((0, *sizes[:-1])))
    div = cfg.make_ngram_vocab_size_divisible_by
    rows = -(-sum(sizes) // div) * div
    return NGramTables(multipliers, sizes, offsets, rows)


def shard_rows(rows: int, parts: int) -> list[int]:
    """The rows of each of the Hub's shards of a table (`torch.chunk`'s: ceil-sized chunks,
    perhaps fewer than `parts`)."""
    chunk = -(-rows // parts)
    return [min(chunk, rows - start) for start in range(0, rows, chunk)]


def buffers(cfg: Any, prefix: str) -> dict[str, np.ndarray]:
    """HF's persistent buffers of every PLE layer (under `prefix` with `{i}`), for export."""
    out = {}
    for index, layer in enumerate(cfg.ple_layers):
        tables = ngram_tables(cfg, index)
        name = prefix.format(i=layer) + ".ple.ple_embedding."
        out[name + "layer_multipliers"] = np.array(tables.multipliers, np.int64)
        out[name + "ngram_heads_vocab_sizes"] = np.array(tables.sizes, np.int64)
        out[name + "ngram_heads_offsets"] = np.array(tables.offsets, np.int64)
    return out


# ---------------------------------------------------------------------------- exact hashing


def _limbs(value: int) -> np.ndarray:
    """A 64-bit integer as four 16-bit limbs (low first), uint32."""
    return np.array([(value >> (16 * k)) & 0xFFFF for k in range(4)], np.uint32)


def _times(tokens: Array, multiplier: int) -> list[Array]:
    """`tokens * multiplier` modulo 2**64 (int64 wrap-around), as four 16-bit limbs."""
    t = tokens.astype(jnp.uint32)
    t_limbs = (t & 0xFFFF, t >> 16)
    m = _limbs(multiplier)
    columns = [jnp.zeros_like(t) for _ in range(5)]
    for i, ti in enumerate(t_limbs):
        for j in range(4 - i):
            product = ti * jnp.uint32(m[j])  # < 2**32
            columns[i + j] = columns[i + j] + (product & 0xFFFF)
            columns[i + j + 1] = columns[i + j + 1] + (product >> 16)
    out, carry = [], jnp.zeros_like(t)
    for k in range(4):
        total = columns[k] + carry
        out.append(total & 0xFFFF)
        carry = total >> 16
    return out


def _mod(limbs: list[Array], sizes: tuple[int, ...]) -> Array:
    """`torch.remainder` of the signed int64 of `limbs` by each of `sizes` (a last axis)."""
    p = jnp.asarray(np.array(sizes, np.uint32))
    rest = jnp.zeros((*limbs[0].shape, len(sizes)), jnp.uint32)
    for limb in reversed(limbs):
        for shift in (12, 8, 4, 0):
            digit = ((limb >> shift) & 0xF)[..., None]
            rest = (rest * 16 + digit) % p
    # A negative int64 (top bit set) is 2**64 less: its floor remainder is that much less.
    wrap = jnp.asarray(np.array([(1 << 64) % s for s in sizes], np.uint32))
    negative = (limbs[3] >> 15)[..., None] == 1
    return jnp.where(negative, (rest + p - wrap) % p, rest)


def shifted_tokens(tokens: Array, starts: Array, eos: int, shift: int) -> Array:
    """`tokens` shifted right by `shift` within each run (EOS where it would reach past the
    last EOS before a token or past its run's start: `starts`, bool, True at a run's first
    token)."""
    if shift == 0:
        return tokens
    length = tokens.shape[1]
    idx = jnp.arange(length)
    after_eos = jnp.where(tokens == eos, idx, -1)
    after_eos = jnp.pad(jax.lax.cummax(after_eos, axis=1), ((0, 0), (1, 0)), constant_values=-1)
    boundary = jnp.maximum(after_eos[:, :-1], jax.lax.cummax(jnp.where(starts, idx - 1, -1), 1))
    source = jnp.pad(tokens, ((0, 0), (shift, 0)), constant_values=eos)[:, :length]
    return jnp.where(idx - boundary - 1 >= shift, source, eos)


def hash_ids(cfg: Any, tables: NGramTables, tokens: Array, starts: Array) -> Array:
    """int32 rows of the layer's table `[batch, length, heads]` for `tokens` (HF's
    `Qwen4ExpTextNGramEmbedding` ids)."""
    eos = cfg.ple_eos_id
    shifted = [shifted_tokens(tokens, starts, eos, s) for s in range(cfg.ngram_size)]
    products = [_times(t, m) for t, m in zip(shifted, tables.multipliers, strict=True)]
    blocks, per = [], cfg.heads_per_ngram
    for n in range(2, cfg.ngram_size + 1):
        mixed = products[0]
        for s in range(1, n):
            mixed = [a ^ b for a, b in zip(mixed, products[s], strict=True)]
        heads = slice((n - 2) * per, (n - 1) * per)
        rest = _mod(mixed, tables.sizes[heads])
        offsets = jnp.asarray(np.array(tables.offsets[heads], np.int32))
        blocks.append(rest.astype(jnp.int32) + offsets)
    return jnp.concatenate(blocks, axis=-1)


# ---------------------------------------------------------------------------- the modules


class GroupNorm(nn.Module):
    """HF's `Qwen4ExpTextRMSNorm` with `group_size`: each `group` features RMS-normalised
    in float32, times (1 + `scale`) (`scale` over all features, initialised at zero)."""

    group: int
    epsilon: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.with_logical_partitioning(nn.initializers.zeros, (None,))
        scale = self.param("scale", init, (x.shape[-1],), layers.as_dtype(self.param_dtype))
        x32 = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, self.group)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        y = y.reshape(x.shape) * (1.0 + scale.astype(jnp.float32))
        return y.astype(layers.as_dtype(self.dtype))


def run_starts(segment_ids: Array | None, batch: int, length: int) -> Array:
    """bool `[batch, length]`: True at each run's first token (a packed segment's, or 0)."""
    first = jnp.zeros((batch, length), bool).at[:, 0].set(True)
    if segment_ids is None:
        return first
    changed = jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)))
    return first | changed


def dilated_conv(x: Array, kernel: Array, dilation: int, starts: Array) -> Array:
    """Causal depthwise convolution of `x` `[batch, length, channels]` by `kernel`
    `[taps, channels]` (the last tap on the token itself, each earlier one `dilation`
    tokens back), never reaching past a run's start."""
    taps, length = kernel.shape[0], x.shape[1]
    run = jnp.cumsum(starts.astype(jnp.int32), axis=1)
    out = jnp.zeros(x.shape, jnp.float32)
    for tap in range(taps):
        back = (taps - 1 - tap) * dilation
        if back >= length:
            continue
        src = jnp.pad(x, ((0, 0), (back, 0), (0, 0)))[:, :length].astype(jnp.float32)
        same = jnp.pad(run, ((0, 0), (back, 0)), constant_values=-1)[:, :length] == run
        out = out + jnp.where(same[..., None], src, 0.0) * kernel[tap].astype(jnp.float32)
    return out


def carried(
    module: nn.Module, name: str, x: Array, width: int, decoding: Any, real: Array
) -> Array:
    """`x` `[rows, length, a, b]` after the `width` inputs before it that `module`'s cache
    `name` holds (zeros at first), which then holds the last `width` of them (4-D, as the
    engine's copies of state slots take a pool `[slots, width, a, b]`): a contiguous
    cache's rows (their padding before their tokens) or, over the paged cache, each row's
    state slot (`state_slots`: zeros where the row starts; its `real` tokens first)."""
    shape = (width, *x.shape[2:])
    if decoding.paged:
        var = state_slots.pool(module, name, shape, x.dtype, decoding)
        joined = jnp.concatenate([state_slots.gather(var.value, decoding), x], axis=1)
        index = real.sum(axis=1)[:, None] + jnp.arange(width)  # after the real inputs
        index = index.reshape(*index.shape, *(1,) * (x.ndim - 2))
        var.value = state_slots.scatter(var.value, decoding, jnp.take_along_axis(joined, index, 1))
        return joined
    var = module.variable("cache", name, jnp.zeros, (x.shape[0], *shape), x.dtype)
    joined = jnp.concatenate([var.value, x], axis=1)
    var.value = joined[:, joined.shape[1] - width :]
    return joined


class PLELayer(nn.Module):
    """`(streams, tokens, starts, real)` -> what PLE adds to the streams `[batch, length,
    hc_count * hidden]` (HF's `Qwen4ExpTextPLELayer`). Params (HF's names): the table's
    Hub shards `ngram_shard_{k}`, `key_proj`, `value_proj`, `norm_key`,
    `norm_query`, `norm_conv` and the depthwise `conv1d` `[taps, channels]`. Cache (while
    decoding, its rows' padding read as EOS and zeros as HF's; over the paged cache, pools
    of state slots, `carried`):
    `ple_context` (the last `ngram_size - 1` tokens) and `ple_conv` (the convolution's
    last inputs)."""

    config: Any
    ple_index: int

    @nn.compact
    def __call__(
        self, streams: Array, tokens: Array, starts: Array, real: Array, decoding: Any = None
    ) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        hc, width = cfg.hc_count, cfg.hidden_size
        tables = ngram_tables(cfg, self.ple_index)
        heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
        dim = cfg.ple_embed_dim // heads
        init = nn.with_logical_partitioning(nn.initializers.normal(1.0), (None, None))
        shards = [
            self.param(f"ngram_shard_{k}", init, (rows, dim), layers.as_dtype(cfg.param_dtype))
            for k, rows in enumerate(shard_rows(tables.rows, cfg.split_ngram_parts))
        ]
        table = jnp.concatenate(shards, axis=0) if len(shards) > 1 else shards[0]
        ids = self.context_ids(tables, tokens, starts, decoding, real)
        emb = table[ids].reshape(*tokens.shape, -1).astype(layers.as_dtype(cfg.dtype))

        def proj(features: int, name: str, x: Array) -> Array:
            return layers.DenseGeneral(features, ("embed", None), name=name, **dense)(x)

        def norm(name: str, x: Array) -> Array:
            return GroupNorm(width, cfg.rms_norm_eps, name=name, **dense)(x)

        key = norm("norm_key", proj(hc * width, "key_proj", emb)).reshape(*emb.shape[:2], hc, -1)
        value = proj(width, "value_proj", emb)
        query = norm("norm_query", streams).reshape(*emb.shape[:2], hc, -1)
        gate = jnp.sum(key.astype(jnp.float32) * query, -1, keepdims=True) / math.sqrt(width)
        gate = jnp.sqrt(jnp.maximum(jnp.abs(gate), 1e-6)) * jnp.sign(gate)
        gated = (jax.nn.sigmoid(gate) * value[:, :, None, :]).reshape(streams.shape)
        normed = norm("norm_conv", gated)
        keep = real[..., None].astype(gated.dtype)
        gated, normed = gated * keep, normed * keep
        conv_init = nn.with_logical_partitioning(nn.initializers.zeros, (None, None))
        kernel = self.param(
            "conv1d",
            conv_init,
            (cfg.ple_conv_kernel_size, hc * width),
            layers.as_dtype(cfg.param_dtype),
        )
        if decoding is None:
            conv = dilated_conv(normed, kernel, cfg.ngram_size, starts)
        else:  # after the last (taps - 1) * dilation inputs (zeros at first)
            back = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size
            four = normed.reshape(*normed.shape[:2], hc, width)
            joined = carried(self, "ple_conv", four, back, decoding, real)
            joined = joined.reshape(*joined.shape[:2], -1)
            none = jnp.zeros(joined.shape[:2], bool)
            conv = dilated_conv(joined, kernel, cfg.ngram_size, none)[:, back:]
        return (gated + jax.nn.silu(conv)).astype(streams.dtype)

    def context_ids(
        self, tables: NGramTables, tokens: Array, starts: Array, decoding: Any, real: Array
    ) -> Array:
        """The table's rows of `tokens`; while decoding after the cache's last `ngram_size - 1`
        tokens (EOS at first: held as their difference from EOS, the cache's zeros)."""
        cfg = self.config
        if decoding is None:
            return hash_ids(cfg, tables, tokens, starts)
        eos, back = cfg.ple_eos_id, cfg.ngram_size - 1
        ids = (tokens.astype(jnp.int32) - eos)[..., None, None]
        joined = carried(self, "ple_context", ids, back, decoding, real)[..., 0, 0] + eos
        none = jnp.zeros(joined.shape, bool)
        return hash_ids(cfg, tables, joined, none)[:, back:]
