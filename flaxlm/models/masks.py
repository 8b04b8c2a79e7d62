"""Attention masks: which keys each query sees (causal, sliding windows, packed segments,
FCM) computed blockwise on demand, the decoding state they read while the KV cache fills,
and the token positions they go with (default, and while decoding).

Nothing here knows a mesh or a model; `attention.py` re-exports these names.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array


@flax.struct.dataclass
class Mask:
    """Which keys each query may attend to, computed on demand for any block of queries and
    keys (`block`) or whole (`dense`, bool `[batch, 1, q_len, kv_len]`); the blockwise
    attention never holds the whole mask.

    Queries sit at slots `q_offset + i` (None: slot `i`), keys at slots `j`. `causal`: a key
    at a later slot is hidden; `sliding_window` W: only the W latest slots (the query's own
    included) are seen; `kv_start` (per row): keys before it are padding (left-padded
    decoding). Segment ids keep packed examples apart: with `cross` (keys are another
    sequence) a query sees keys of its own segment and never segment 0 (padding); otherwise
    queries and keys share `q_segment_ids`.
    """

    q_segment_ids: Array | None
    kv_segment_ids: Array | None
    kv_start: Array | None
    # None, not 0, where there is no offset: a None leaf stays None through `nn.remat` and
    # `nn.scan`, which trace every leaf, so a remat'd layer still knows its self-attention
    # covers the whole sequence (`whole_self_attention`, `plain_causal`: cuDNN, context
    # parallelism).
    q_offset: Array | int | None
    kv_keep: Array | None = None  # bool [batch, kv_len]: False hides a key from every query
    # A layer's own sliding window (int32 scalar, may be traced: `layer_window`), on top of
    # `sliding_window`; NO_WINDOW sees everything.
    window: Array | None = None
    # int32 [q_len]: the slot of each position of a reordered self-attention sequence (the
    # load-balanced order of context parallelism); None: position i is slot q_offset + i.
    slots: Array | None = None
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
        if self.slots is None:
            q_slot = q_idx if self.q_offset is None else self.q_offset + q_idx
            k_slot = k_idx
        else:
            padded = jnp.pad(self.slots, (0, max(q_size, k_size)))
            q_slot = jax.lax.dynamic_slice_in_dim(padded, q_start, q_size)
            k_slot = jax.lax.dynamic_slice_in_dim(padded, k_start, k_size)
        mask = (q_idx < self.q_len)[:, None] & (k_idx < self.kv_len)[None, :]
        mask = mask & visible(q_slot, k_slot, causal=self.causal, window=self.combined_window())
        k_slot = k_slot[None, :]
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

    def combined_window(self) -> Array | int | None:
        """The narrower of `sliding_window` and this layer's `window` (None: neither)."""
        if self.window is None:
            return self.sliding_window
        if self.sliding_window is None:
            return self.window
        return jnp.minimum(self.window, self.sliding_window)

    def dense(self) -> Array:
        return self.block(0, self.q_len, 0, self.kv_len)

    def within(self, window: Array | None) -> Mask:
        """This mask narrowed to a layer's sliding `window` (None: unchanged)."""
        return self if window is None else self.replace(window=window)


NO_WINDOW = 2**30  # a window longer than any sequence


def whole_self_attention(mask: Mask | Array | None) -> bool:
    """Whether `mask` is a `Mask` for self-attention over a whole sequence (training,
    scoring), whatever its segments, padding, windows and order (`slots`): not
    cross-attention, and not decoding (no query offset or cache start)."""
    return (
        isinstance(mask, Mask)
        and not mask.cross
        and mask.q_len == mask.kv_len
        and mask.q_offset is None
        and mask.kv_start is None
    )


def plain_causal(mask: Mask | Array | None) -> bool:
    """Whether `mask` is plain causal self-attention (a sliding window allowed): no
    segments, padding, offsets or reordered slots, which cuDNN takes as `is_causal`."""
    if not whole_self_attention(mask) or not mask.causal:
        return False
    plain = (mask.q_segment_ids, mask.kv_segment_ids, mask.kv_keep, mask.window, mask.slots)
    return all(x is None for x in plain)


def visible(q_slot: Array, k_slot: Array, *, causal: bool, window: Array | int | None) -> Array:
    """bool `[len(q_slot), len(k_slot)]`: which keys at slots `k_slot` causality and a sliding
    `window` (None: none) let the queries at slots `q_slot` see (no segments, no padding)."""
    distance = q_slot[:, None] - k_slot[None, :]
    mask = distance >= 0 if causal else jnp.ones(distance.shape, bool)
    return mask if window is None else mask & (distance < window)


def default_positions(tokens: Array, positions: Array | None) -> Array:
    """`positions`, or `0 .. length - 1` in every row of `tokens` [batch, length] if None."""
    if positions is not None:
        return positions
    batch, length = tokens.shape
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


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
        q_offset=None,
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
    every row writes the same slot), and the cache size (`length`, static).

    Paged (the serving engine, `inference/pages.py`), when `page_table` is set: the cache is
    a pool of `num_pages` pages of `page_size` slots shared by all rows; row b's slot s
    lives in page `page_table[b, s // page_size]` at offset `s % page_size`, and `slots`
    says the slot (the position) of each query token, -1 for padding (written to page 0,
    which no row reads). Rows are not padded on the left (a row's real tokens come first):
    `index` is 0, `start` zeros and `length` the slots a row's page table covers.
    `paged_attention` says how a decode step's attention reads the pages
    (`paged_attention.PAGED_ATTENTION`). A linear-attention layer's recurrent state lives in
    pools of `num_state_slots` state slots (`state_slots.py`): row b's is slot
    `state_slots[b]`, slot 0 the padding rows' scratch. DeepSeek-V4's own contiguous cache
    (`deepseek_v4_attention`) lays rows out as the paged ones do, `slots` set and no
    `page_table`: its compressors' windows count from each row's first token."""

    index: Array  # int32 scalar
    start: Array  # int32 [batch]
    length: int = flax.struct.field(pytree_node=False, default=0)
    page_table: Array | None = None  # int32 [batch, pages]
    slots: Array | None = None  # int32 [batch, q_len]
    num_pages: int = flax.struct.field(pytree_node=False, default=0)
    page_size: int = flax.struct.field(pytree_node=False, default=0)
    paged_attention: str = flax.struct.field(pytree_node=False, default="gather")
    state_slots: Array | None = None  # int32 [batch]
    num_state_slots: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def paged(self) -> bool:
        return self.page_table is not None


def paged_mask(decoding: Decoding, window: Array | int | None = None) -> Array:
    """bool `[batch, 1, q_len, length]` of a paged `decoding`: each query sees the slots up
    to its own, within `window` (None: all). A padding query sees slot 0 (its output is
    dropped; a row that sees nothing would divide by zero)."""
    q_slot = jnp.maximum(decoding.slots, 0)[:, :, None]
    k_slot = jnp.arange(decoding.length, dtype=jnp.int32)[None, None, :]
    keep = k_slot <= q_slot
    if window is not None:
        keep = keep & (q_slot - k_slot < window)
    return keep[:, None]


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
    if decoding.paged:
        return paged_mask(decoding, sliding_window)
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
