"""Sequence-to-sequence task over the default corpus, for encoder-decoder models.

`stdlib_py_continuation`: the standard-library sources (the same files and splits as
`stdlib_py`) cut into chunks; the encoder reads the first part of a chunk and the decoder
writes the rest. Evaluated by exact match, BLEU and ROUGE of the generated rest. Nothing to
download.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import seqio
import tensorflow as tf

from tasks.metrics import bleu, exact_match, rouge
from tasks.stdlib import stdlib_files

TASK_NAME = "stdlib_py_continuation"
DEFAULT_LENGTHS = {"inputs": 256, "targets": 256}  # when seqio passes no sequence_length


def continuation_pairs(
    dataset: tf.data.Dataset, sequence_length: Mapping[str, int] | None = None
) -> tf.data.Dataset:
    """Tokenized `targets` -> `{inputs, targets}` pairs, consecutive chunks of each document.

    A chunk holds `inputs - 1` then `targets - 1` tokens (one place each for EOS); a
    document's last, shorter chunk is cut at the same proportion (its first half when the
    two lengths are equal). Chunks under two tokens are dropped.
    """
    lengths = dict(DEFAULT_LENGTHS, **(sequence_length or {}))
    n_inputs, n_targets = lengths["inputs"] - 1, lengths["targets"] - 1
    if n_inputs < 1 or n_targets < 1:
        raise ValueError(
            f"TASK_FEATURE_LENGTHS {dict(lengths)}: {TASK_NAME} needs inputs and targets of at "
            "least 2 tokens each."
        )
    chunk = n_inputs + n_targets

    def to_chunks(ex: Mapping[str, tf.Tensor]) -> tf.data.Dataset:
        tokens = ex["targets"]
        n = tf.shape(tokens)[0]
        pad = (chunk - n % chunk) % chunk
        rows = tf.reshape(tf.concat([tokens, tf.zeros([pad], tokens.dtype)], axis=0), [-1, chunk])
        sizes = tf.minimum(chunk, n - tf.range(tf.shape(rows)[0]) * chunk)
        return tf.data.Dataset.from_tensor_slices({"row": rows, "size": sizes})

    def to_pair(ex: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        cut = ex["size"] * n_inputs // chunk
        return {"inputs": ex["row"][:cut], "targets": ex["row"][cut : ex["size"]]}

    return (
        dataset.flat_map(to_chunks)
        .filter(lambda ex: ex["size"] >= 2)
        .map(to_pair, num_parallel_calls=tf.data.AUTOTUNE)
    )


def _dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
    files = tf.data.Dataset.from_tensor_slices(list(stdlib_files(split)))
    if shuffle_files:
        files = files.shuffle(len(stdlib_files(split)), seed=seed)
    return files.map(lambda f: {"text": tf.io.read_file(f)}, num_parallel_calls=1)


_VOCABULARY = seqio.ByteVocabulary()

seqio.TaskRegistry.add(
    TASK_NAME,
    source=seqio.FunctionDataSource(_dataset_fn, splits=("train", "validation")),
    preprocessors=[
        functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
        seqio.preprocessors.tokenize,
        continuation_pairs,
        seqio.preprocessors.append_eos_after_trim,
    ],
    output_features={
        "inputs": seqio.Feature(_VOCABULARY, add_eos=True, dtype=tf.int32),
        "targets": seqio.Feature(_VOCABULARY, add_eos=True, dtype=tf.int32),
    },
    metric_fns=[exact_match, bleu, rouge],
)
