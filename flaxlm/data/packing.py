"""Packing without AutoGraph, and in memory linear in the length: seqio's greedy packing.

seqio's `trim_and_pack_dataset` gathers `L` examples (L: the longest feature length) into one
padded batch, each padded to the longest of them, and packs each batch in a `for` loop over a
tensor, which tf.data hands to AutoGraph to rewrite (~1 CPU s of every process's first
dataset: AutoGraph parses seqio/utils.py's source for its lambdas). `trim_and_pack` makes the
same rows, token for token (the same greedy rule, the same flush of the row being filled after
every `L` examples and at the end, the same positions and segment ids), from graph code that
needs no rewriting (this module is in `pipeline.NOT_AUTOGRAPHED`):

- below `LINEAR_FROM` tokens, `pack_batches`: seqio's padded batch of `L` examples, the rows'
  boundaries computed from the examples' lengths alone (a scan over scalars), then each
  feature's tokens scattered to their places in one op (the default dataset's build 1.1 ->
  0.5 CPU s, its tokens/s unchanged: benchmarks/HISTORY.md);
- from `LINEAR_FROM`, `pack_linear`: a `tf.data` scan that holds one row at a time (seqio's
  batch there is `L x L` per feature: 4 GiB at 32k tokens and 64 GiB at 128k).

`use_linear_packing()` has seqio's feature converters call `trim_and_pack`; flaxlm's input
pipelines do so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import seqio
import tensorflow as tf

_SEQIO_TRIM_AND_PACK = seqio.utils.trim_and_pack_dataset
LINEAR_FROM = 8192  # seqio's padded batch there: 8192 x 8192 int32, 256 MiB a feature


def trim_and_pack(
    dataset: tf.data.Dataset, feature_lengths: Mapping[str, int], use_custom_ops: bool = False
) -> tf.data.Dataset:
    """`seqio.utils.trim_and_pack_dataset(dataset, feature_lengths)`'s rows: `pack_batches`'
    below `LINEAR_FROM` tokens, `pack_linear`'s from there, seqio's own for features of
    rank > 1 or custom ops."""
    spec = dataset.element_spec
    if use_custom_ops or any(len(spec[k].shape) != 1 for k in feature_lengths):
        return _SEQIO_TRIM_AND_PACK(dataset, feature_lengths, use_custom_ops)
    if max(feature_lengths.values()) < LINEAR_FROM:
        return pack_batches(dataset, feature_lengths)
    return pack_linear(dataset, feature_lengths)


def _trimmed(dataset: tf.data.Dataset, feature_lengths: Mapping[str, int]) -> tf.data.Dataset:
    """The features `feature_lengths` names, cut to their lengths, as int32 (seqio's first
    step of packing; the other features dropped)."""
    return dataset.map(
        lambda x: {k: tf.cast(x[k][:n], tf.int32) for k, n in feature_lengths.items()},
        num_parallel_calls=tf.data.AUTOTUNE,
    )


def pack_batches(dataset: tf.data.Dataset, feature_lengths: Mapping[str, int]) -> tf.data.Dataset:
    """seqio's packed rows of the 1-D features `feature_lengths` names, packed as seqio does
    (batches of `L` examples padded to their longest) by explicit graph ops."""
    ds = _trimmed(dataset, feature_lengths)
    padded = {k: [-1] for k in feature_lengths}
    ds = ds.padded_batch(max(feature_lengths.values()), padded_shapes=padded)
    ds = ds.map(_batch_packer(tuple(feature_lengths.items())), num_parallel_calls=tf.data.AUTOTUNE)
    return ds.unbatch().map(
        functools.partial(_set_lengths, feature_lengths), num_parallel_calls=tf.data.AUTOTUNE
    )


@functools.cache
def _batch_packer(feature_lengths: tuple[tuple[str, int], ...]) -> Callable[..., Any]:
    """The packing of one padded batch, a `tf.function` traced once for all the datasets that
    pack these features (a host's logical shards: tf.data calls it from each one's map)."""
    keys = [k for k, _ in feature_lengths]
    lengths_of = dict(feature_lengths)

    def place(state, lengths):
        """The next example (its lengths, one a feature) in the row being filled, or, if a
        feature does not fit, at the start of the next row: (sizes after it, row, start)."""
        sizes, row, _ = state
        fits = tf.reduce_all(sizes + lengths <= [lengths_of[k] for k in keys])
        start = tf.where(fits, sizes, tf.zeros_like(sizes))
        return start + lengths, tf.where(fits, row, row + 1), start

    @tf.function(autograph=False)
    def pack(x: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        # seqio reads an example as its first `count_nonzero` tokens (padding was its zeros).
        lengths = tf.stack([tf.math.count_nonzero(x[k], 1, dtype=tf.int32) for k in keys], 1)
        empty = tf.zeros([len(keys)], tf.int32)
        _, rows, starts = tf.scan(place, lengths, (empty, tf.constant(0), empty))
        num_rows = rows[-1] + 1
        out = {}
        for i, k in enumerate(keys):
            width = tf.shape(x[k])[1]
            at = tf.where(tf.range(width)[None, :] < lengths[:, i : i + 1])  # (example, token)
            example, token = tf.cast(at[:, 0], tf.int32), tf.cast(at[:, 1], tf.int32)
            to = tf.stack([tf.gather(rows, example), tf.gather(starts[:, i], example) + token], 1)
            shape = tf.stack([num_rows, lengths_of[k]])
            out[k] = tf.scatter_nd(to, tf.gather_nd(x[k], at), shape)
            out[k + "_positions"] = tf.scatter_nd(to, token, shape)
            starts_of_segments = tf.cast(tf.equal(out[k + "_positions"], 0), tf.int32)
            out[k + "_segment_ids"] = tf.cumsum(starts_of_segments, axis=1) * tf.cast(
                tf.not_equal(out[k], 0), tf.int32
            )
        return out

    return pack


def _set_lengths(
    feature_lengths: Mapping[str, int], row: Mapping[str, tf.Tensor]
) -> dict[str, tf.Tensor]:
    """`row` with each packed feature's static length, `[feature_lengths[feature]]`. Only
    that, as seqio's last map: tf.data's rewrites then give the iterator seqio's structure,
    so a data position checkpointed under seqio's packer restores (segment ids computed here
    instead, as `pack_linear` does, changed it)."""
    for k, v in row.items():
        v.set_shape([feature_lengths[k.removesuffix("_positions").removesuffix("_segment_ids")]])
    return dict(row)


def pack_linear(dataset: tf.data.Dataset, feature_lengths: Mapping[str, int]) -> tf.data.Dataset:
    """seqio's packed rows of the 1-D features `feature_lengths` names, one row in memory."""
    keys = list(feature_lengths)
    flush_every = max(feature_lengths.values())  # seqio's batch of examples per packing
    ds = _trimmed(dataset, feature_lengths)
    # seqio reads an example as its first `count_nonzero` tokens (padding was its zeros).
    ds = ds.map(lambda x: {k: v[: tf.math.count_nonzero(v, dtype=tf.int32)] for k, v in x.items()})
    empty = {k: tf.zeros([0], tf.int32) for k in keys}
    ds = ds.map(lambda x: (x, False)).concatenate(tf.data.Dataset.from_tensors((empty, True)))
    # The row being filled: each feature's tokens and their positions.
    length_of = {k + s: feature_lengths[k] for k in keys for s in ("", "_positions")}
    nothing = {k: tf.zeros([0], tf.int32) for k in length_of}

    def as_row(partial: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        """`partial` padded to the lengths, as one row `[1, length]` a feature."""
        return {k: tf.pad(v, [[0, length_of[k] - tf.size(v)]])[None] for k, v in partial.items()}

    def no_row() -> dict[str, tf.Tensor]:
        return {k: tf.zeros([0, n], tf.int32) for k, n in length_of.items()}

    def emptied_if(cond: tf.Tensor, partial: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        return {k: tf.cond(cond, lambda k=k: nothing[k], lambda k=k: partial[k]) for k in partial}

    def step(state, element):
        partial, count = state
        example, is_end = element
        fits = tf.reduce_all(
            [tf.size(partial[k]) + tf.size(example[k]) <= feature_lengths[k] for k in keys]
        )
        # A full row goes out before an example that does not fit...
        before = tf.logical_and(tf.logical_not(fits), tf.logical_not(is_end))
        emitted = tf.cond(before, lambda: as_row(partial), no_row)
        partial = emptied_if(before, partial)
        grown = {}
        for k in keys:
            grown[k] = tf.concat([partial[k], example[k]], 0)
            grown[k + "_positions"] = tf.concat(
                [partial[k + "_positions"], tf.range(tf.size(example[k]), dtype=tf.int32)], 0
            )
        count = tf.where(is_end, count, count + 1)
        # ... and the row being filled after every `flush_every` examples, and at the end.
        flush = tf.logical_or(count == flush_every, tf.logical_and(is_end, count > 0))
        emitted = tf.cond(
            flush,
            lambda: {k: tf.concat([emitted[k], v], 0) for k, v in as_row(grown).items()},
            lambda: emitted,
        )
        count = tf.where(flush, tf.constant(0, tf.int64), count)
        return (emptied_if(flush, grown), count), emitted

    ds = ds.scan((nothing, tf.constant(0, tf.int64)), step).unbatch()

    def segments(x: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        out = dict(x)
        for k in keys:
            starts = tf.cast(tf.equal(x[k + "_positions"], 0), tf.int32)
            out[k + "_segment_ids"] = tf.cumsum(starts) * tf.cast(tf.not_equal(x[k], 0), tf.int32)
            out[k].set_shape([feature_lengths[k]])
            out[k + "_positions"].set_shape([feature_lengths[k]])
            out[k + "_segment_ids"].set_shape([feature_lengths[k]])
        return out

    return ds.map(segments, num_parallel_calls=tf.data.AUTOTUNE)


def use_linear_packing() -> None:
    """Makes seqio's feature converters pack with `trim_and_pack` (they look
    `seqio.utils.trim_and_pack_dataset` up when they pack)."""
    seqio.utils.trim_and_pack_dataset = trim_and_pack
