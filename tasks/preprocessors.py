"""Preprocessors shared by the language-modelling tasks."""

from __future__ import annotations

from collections.abc import Mapping

import tensorflow as tf


def split_targets(
    dataset: tf.data.Dataset, sequence_length: Mapping[str, int] | None = None
) -> tf.data.Dataset:
    """Cuts each tokenized `targets` into consecutive chunks of at most the target length.

    A long document becomes several training examples instead of being truncated to its
    first chunk; packing later fills each row with whole chunks.
    """
    length = (sequence_length or {}).get("targets")
    if not length:
        return dataset

    def to_chunks(ex: Mapping[str, tf.Tensor]) -> tf.data.Dataset:
        tokens = ex["targets"]
        n = tf.shape(tokens)[0]
        pad = (length - n % length) % length
        padded = tf.concat([tokens, tf.zeros([pad], tokens.dtype)], axis=0)
        rows = tf.reshape(padded, [-1, length])
        lengths = tf.minimum(length, n - tf.range(tf.shape(rows)[0]) * length)
        chunks = tf.RaggedTensor.from_tensor(rows, lengths=lengths)
        return tf.data.Dataset.from_tensor_slices({"targets": chunks})

    return dataset.flat_map(to_chunks).map(
        lambda ex: {"targets": ex["targets"]}, num_parallel_calls=tf.data.AUTOTUNE
    )
