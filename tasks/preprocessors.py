"""Preprocessors shared by the language-modelling tasks."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import seqio
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


def mask_tokens(
    dataset: tf.data.Dataset,
    *,
    mask_id: int,
    random_ids: tuple[int, int],
    mask_rate: float = 0.15,
    never_mask: tuple[int, ...] = (0, 1),
    key: str = "targets",
) -> tf.data.Dataset:
    """BERT-style masking of the tokenized `key`, for `models.features.MaskedLMFeatureConverter`.

    Each token (except ids in `never_mask`) is chosen with probability `mask_rate`; a chosen
    token becomes `mask_id` 80% of the time, a random id in `[random_ids[0], random_ids[1])`
    10%, and stays itself 10%. Output: `inputs` (the masked ids) and `targets`: the original
    ids, negated where chosen (the loss is taken there). Zeros would not do as "no loss":
    seqio's packing treats 0 as padding and drops it. Deterministic given seqio's
    preprocessing seed (stateless random ops).
    """
    low, high = random_ids
    if not 0.0 < mask_rate < 1.0 or low >= high:
        raise ValueError(
            f"mask_tokens: mask_rate={mask_rate} must be in (0, 1) and random_ids={random_ids} "
            "a non-empty [low, high) range."
        )

    @seqio.map_over_dataset(num_seeds=3)
    def mask(ex: Mapping[str, tf.Tensor], seeds: tf.Tensor) -> dict[str, tf.Tensor]:
        tokens = ex[key]
        shape = tf.shape(tokens)
        eligible = tf.reduce_all(
            tf.not_equal(tokens[:, None], tf.constant(never_mask, tokens.dtype)[None, :]), axis=1
        )
        chosen = (tf.random.stateless_uniform(shape, seed=seeds[0]) < mask_rate) & eligible
        kind = tf.random.stateless_uniform(shape, seed=seeds[1])
        random = tf.random.stateless_uniform(
            shape, seed=seeds[2], minval=low, maxval=high, dtype=tokens.dtype
        )
        replaced = tf.where(kind < 0.8, tf.cast(mask_id, tokens.dtype), tokens)
        replaced = tf.where((kind >= 0.8) & (kind < 0.9), random, replaced)
        out = dict(ex)
        out["inputs"] = tf.where(chosen, replaced, tokens)
        out["targets"] = tf.where(chosen, -tokens, tokens)
        return out

    return mask(dataset)


def add_lm_task(
    name: str,
    source: seqio.DataSource,
    *,
    text_key: str = "text",
    vocabulary: seqio.Vocabulary | None = None,
    add_eos: bool = True,
    preprocessors: Sequence[Callable[..., tf.data.Dataset]] = (),
) -> str:
    """Registers a language-modelling task over `source` and returns its name: the text
    feature `text_key` (after `preprocessors`) becomes `targets`, tokenized (bytes if no
    `vocabulary`), cut into target-length chunks, with EOS after each."""
    seqio.TaskRegistry.add(
        name,
        source=source,
        preprocessors=[
            *preprocessors,
            functools.partial(seqio.preprocessors.rekey, key_map={"targets": text_key}),
            seqio.preprocessors.tokenize,
            split_targets,
            seqio.preprocessors.append_eos_after_trim,
        ],
        output_features={
            "targets": seqio.Feature(
                vocabulary or seqio.ByteVocabulary(), add_eos=add_eos, dtype=tf.int32
            )
        },
        metric_fns=[],
    )
    return name
