"""DeepSeek-V4's decoding cache (`deepseek_v4.DeepseekV4LM`'s, the serving engine's state
slots): what each attention layer (`deepseek_v4_attention`) keeps for the tokens after, and
how a read of any number of tokens continues it.

Rows are right-padded (each row's tokens from position 0, `masks.Decoding.slots` their
positions, -1 for padding after a row's real tokens), so that the compressors' windows count
from each row's first token. Each leaf is `[batch, 1, slots, width]` (rows in axis `ndim - 4`,
where `decoding.gather_rows` reorders them for beam search):

- `sliding_kv`: the keys (= values) of the `sliding_window` latest positions, a ring
  (position p in slot p % sliding_window);
- per compressor (and CSA's indexer) `window_kv` / `window_gate`: the projections of the open
  window's tokens (CSA: and of the window before it, whose first series the next entry
  pools), a ring of the rate's slots (CSA: twice the rate); `entries`: the compressed
  entries, entry w in slot w (a window's is rewritten until the window is whole, and read
  only then).

Two reads write it. A prompt from position 0 (`Decoding.length` > 0: the positions the cache
covers, its leaves made zeros) is read as a whole sequence and leaves its latest positions in
the rings (`read_prompt`) and its whole windows' entries. Any other read
(`Decoding.length` 0: the cache exists) continues each row from its first slot
(`chunk_bounds`): a decoding step of one token, a chunk of the serving engine's prompt that
resumes a sequence, a row at 0 over zeros, all in one pass. Its queries read the ring's keys
before the chunk's own (`sliding_keys`: causal, within the window); each compressor lays the
open window's held projections (CSA: and the window's before) before the chunk's
(`window_series`), pools every window they reach, rotated at its first position
(`deepseek_v4_attention.pooled_windows`), writes their entries (`write_entries`) and keeps
the new open window; each query reads the entries of windows whole at its position. A row of
padding only (slot -1) leaves its cache as it was. O(sliding_window + chunk + entries) a
query, what HF's `DeepseekV4HCACache` / `DeepseekV4CSACache` keep.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models import layers, masks

Array = jax.Array

CACHE_AXES = ("batch", None, None, None)  # every cache leaf: [batch, 1, slots, width]


def ring_positions(last: Array, size: int) -> Array:
    """int32 `[batch, size]`: the position each slot of a ring of `size` slots holds once the
    positions up to `last` int32 `[batch]` are written (position p in slot p % size;
    negative: none yet)."""
    last = last[:, None]
    return last - (last - jnp.arange(size, dtype=jnp.int32)) % size


def chunk_bounds(decoding: masks.Decoding) -> tuple[Array, Array]:
    """int32 `[batch]` each row's first position (0 in a row of padding) and its last real
    one (-1 where none), from `decoding.slots` (real tokens first, then -1s)."""
    return jnp.maximum(decoding.slots[:, 0], 0), jnp.max(decoding.slots, axis=1)


def cache_variable(
    module: nn.Module, name: str, shape: tuple[int, ...], dtype: Any, decoding: masks.Decoding
) -> Any:
    """`module`'s decoding-cache variable `name` (`[batch, 1, slots, width]`), zeros when
    the prompt's reading makes it (`decoding.length`: the positions it covers)."""
    if decoding.length < 1 and not module.has_variable("cache", name):
        raise ValueError(
            f"{module.name} has no cached {name!r}: a read that continues the cache follows "
            "the prompt's that makes it (DeepseekV4LM.prefill, paged_cache)."
        )
    return module.variable("cache", name, jnp.zeros, shape, layers.as_dtype(dtype))


def store(variable: Any, value: Array) -> Array:
    """`value` written as the cache `variable`'s (its dtype, rows over the batch axes)."""
    variable.value = layers.constrain(value.astype(variable.value.dtype), CACHE_AXES)
    return variable.value


def write_ring(
    module: nn.Module,
    name: str,
    x: Array,
    start: Array,
    last: Array,
    size: int,
    decoding: masks.Decoding,
) -> Array:
    """Writes into `module`'s ring `name` `[batch, 1, size, width]` the tokens `x` `[batch,
    length, width]` at positions `start` int32 `[batch]` on, those up to `last` int32
    `[batch]`: the ring as it was `[batch, size, width]` (the positions before `start`)."""
    shape = (x.shape[0], 1, size, x.shape[-1])
    ring = cache_variable(module, name, shape, x.dtype, decoding)
    held = ring.value[:, 0]
    offset = ring_positions(last, size) - start[:, None]  # [batch, size]: in x, or before
    new = jnp.take_along_axis(x, jnp.clip(offset, 0, x.shape[1] - 1)[..., None], axis=1)
    store(ring, jnp.where((offset >= 0)[..., None], new.astype(held.dtype), held)[:, None])
    return held


def read_prompt(
    module: nn.Module, name: str, x: Array, size: int, decoding: masks.Decoding
) -> None:
    """Keeps in `module`'s ring `name` `[batch, 1, size, width]` the `size` latest of the
    prompt's `x` `[batch, length, width]` (each row's end: its largest `decoding.slots`)."""
    start = jnp.zeros((x.shape[0],), jnp.int32)
    write_ring(module, name, x, start, jnp.max(decoding.slots, axis=1), size, decoding)


def sliding_keys(
    module: nn.Module, kv: Array, positions: Array, window: int, decoding: masks.Decoding
) -> tuple[Array, Array]:
    """A continuing read's keys `[batch, window + length, 1, dim]`, the ring's (positions
    before each row's start) then the chunk's `kv` `[batch, length, dim]` at `positions`
    int32 `[batch, length]`, and bool `[batch, 1, length, window + length]`: those each query
    reads (causal, the `window` latest). The ring then holds the chunk's latest."""
    start, last = chunk_bounds(decoding)
    held = write_ring(module, "sliding_kv", kv, start, last, window, decoding)
    keys = jnp.concatenate([held.astype(kv.dtype), kv], axis=1)
    at = jnp.concatenate([ring_positions(start - 1, window), positions], axis=1)
    query, key = positions[:, :, None], at[:, None, :]
    keep = (key >= 0) & (key <= query) & (query - key < window)
    return keys[:, :, None], keep[:, None]


def window_series(
    module: nn.Module,
    name: str,
    x: Array,
    ratio: int,
    span: int,
    decoding: masks.Decoding,
) -> Array:
    """A continuing read's windows of `ratio` positions `[batch, n, ratio, width]`, from the
    open window at each row's start (`span` > `ratio`: from the window before it) through
    the chunk's end: each position's projection from `module`'s ring `name` (`span` slots)
    before the start, from the chunk's `x` `[batch, length, width]` after (past the last
    real token: any). The ring then holds the chunk's latest."""
    start, last = chunk_bounds(decoding)
    held = write_ring(module, name, x, start, last, span, decoding)
    batch, length, _ = x.shape
    before = span // ratio - 1
    n = before + 1 + (length + ratio - 2) // ratio  # the last reaches start + length - 1
    positions = ((start // ratio - before) * ratio)[:, None] + jnp.arange(n * ratio)
    offset = positions - start[:, None]
    index = jnp.where(offset < 0, positions % span, span + jnp.clip(offset, 0, length - 1))
    series = jnp.concatenate([held.astype(x.dtype), x], axis=1)
    return jnp.take_along_axis(series, index[..., None], axis=1).reshape(batch, n, ratio, -1)


def write_entries(entries: Any, pooled: Array, windows: Array, written: Array) -> Array:
    """Writes `pooled` `[batch, n, dim]`, the entries of `windows` int32 `[batch, n]`, into
    the cache variable `entries` (`[batch, 1, slots, dim]`; windows past its slots dropped),
    in the rows `written` bool `[batch]` only: all its entries `[batch, slots, dim]`."""
    at = jnp.where(written[:, None], windows, entries.value.shape[2])
    rows = jnp.arange(pooled.shape[0])[:, None]
    value = pooled.astype(entries.value.dtype)
    return store(entries, entries.value.at[rows, 0, at].set(value, mode="drop"))[:, 0]
