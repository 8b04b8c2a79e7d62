"""A Gin-bound factory that registers a seqio task over local JSONL files of text pairs.

Each line is a JSON object such as `{"in_text": "Q: 2+2?\\nA:", "out_text": " 4"}` (JaxSeq's
format). The task has features `inputs` and `targets`, so it serves both model kinds:

- decoder-only (prefix-LM): with `TASK_FEATURE_LENGTHS = {'inputs': ..., 'targets': ...}`
  seqio's `DecoderFeatureConverter` (the `DecoderOnlyModel`'s converter) switches to its
  prefix-LM form: the model reads `in_text` then `out_text`, and `decoder_loss_weights` is one
  on the `out_text` tokens only.
- encoder-decoder: `EncDecFeatureConverter` feeds `in_text` to the encoder and `out_text` to
  the decoder.

Every file is read and checked when the task is registered, so a malformed line fails, naming
its file and line, before training starts. The examples are held in memory (fine-tuning sets,
not pre-training corpora: use `register_text_files_task` or a TFDS/HF task for those).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import gin
import numpy as np
import seqio
import tensorflow as tf

from flaxlm.data.jsonl_reader import read_jsonl


def in_memory_dataset(
    columns: Mapping[str, Sequence[str]], shuffle: bool, seed: int | None
) -> tf.data.Dataset:
    """Examples `{name: text}` from equal-length columns held in memory, in order or, when
    `shuffle`, in a full permutation drawn from `seed` (a new one each epoch, the same
    sequence for the same seed). Only indices are shuffled, so the buffer stays small, and
    the iterator checkpoints (no Python generator in the pipeline)."""
    tensors = {k: tf.constant(list(v), tf.string) for k, v in columns.items()}
    n = len(next(iter(columns.values())))
    index = tf.data.Dataset.range(n)
    if shuffle:
        index = index.shuffle(n, seed=seed, reshuffle_each_iteration=True)
    return index.map(lambda i: {k: tf.gather(t, i) for k, t in tensors.items()})


def in_memory_token_dataset(
    columns: Mapping[str, tuple[np.ndarray, np.ndarray]], shuffle: bool, seed: int | None
) -> tf.data.Dataset:
    """`in_memory_dataset` for token ids: examples `{name: int32 ids}` (a vector each, of
    any length) from ragged columns held in memory, each `(values, row_splits)`: example `i`
    is `values[row_splits[i]:row_splits[i + 1]]`. Every column has the same number of
    examples; order and shuffling as `in_memory_dataset`."""
    tensors = {
        k: (tf.constant(np.asarray(v, np.int32)), tf.constant(np.asarray(s, np.int64)))
        for k, (v, s) in columns.items()
    }
    n = len(next(iter(columns.values()))[1]) - 1
    index = tf.data.Dataset.range(n)
    if shuffle:
        index = index.shuffle(n, seed=seed, reshuffle_each_iteration=True)
    return index.map(lambda i: {k: v[s[i] : s[i + 1]] for k, (v, s) in tensors.items()})


def split_file_lists(
    name: str, split_files: Mapping[str, str | Sequence[str]]
) -> dict[str, list[str]]:
    """`{split: the sorted files its glob(s) match}`; an empty mapping, or a split that
    matches no file, fails naming the task and the split."""
    patterns = {s: [p] if isinstance(p, str) else list(p) for s, p in split_files.items()}
    if not patterns:
        raise ValueError(f"Task {name!r}: split_files is empty; give e.g. {{'train': 'a.jsonl'}}.")
    files = {}
    for split, globs in patterns.items():
        files[split] = sorted({f for g in globs for f in tf.io.gfile.glob(g)})
        if not files[split]:
            raise FileNotFoundError(
                f"Task {name!r}: no files match {list(globs)} for split {split!r}."
            )
    return files


def read_pairs(
    files: Sequence[str], input_key: str = "in_text", target_key: str = "out_text"
) -> tuple[list[str], list[str]]:
    """`(inputs, targets)` texts of every line of `files`, in order; a malformed line (not
    JSON, not an object, a key missing or not a string) fails naming its file and line."""
    inputs, targets = [], []
    for path in files:
        for record in read_jsonl(path, required=(input_key, target_key)):
            inputs.append(record[input_key])
            targets.append(record[target_key])
    if not inputs:
        raise ValueError(f"{list(files)}: no JSONL records (the files are empty).")
    return inputs, targets


@gin.configurable
def register_jsonl_task(
    name: str = gin.REQUIRED,
    split_files: Mapping[str, str | Sequence[str]] = gin.REQUIRED,
    vocabulary: seqio.Vocabulary | None = None,
    input_key: str = "in_text",
    target_key: str = "out_text",
    add_eos: bool = True,
    inputs_add_eos: bool = False,
) -> str:
    """Registers (once) a task of `{inputs, targets}` pairs named `name`; returns the name.

    Args:
      split_files: {split: glob or list of globs}, e.g. {"train": "data/train*.jsonl"}.
      vocabulary: a seqio Vocabulary for both features; bytes if None.
      input_key, target_key: the JSON fields holding the input and the target text.
      add_eos: end the targets with EOS (so the model learns to stop).
      inputs_add_eos: end the inputs with EOS too. Off by default: a decoder-only model then
        reads `in_text` straight on into `out_text`, as JaxSeq trains and as flaxlm's infer
        prompts it; T5-style encoder-decoder fine-tuning usually turns it on.
    """
    if name in seqio.TaskRegistry.names():
        return name
    files = split_file_lists(name, split_files)
    for split_files_ in files.values():
        read_pairs(split_files_, input_key, target_key)  # fail now, not mid-training

    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
        inputs, targets = read_pairs(files[split], input_key, target_key)
        columns = {"inputs": inputs, "targets": targets}
        return in_memory_dataset(columns, shuffle=shuffle_files, seed=seed)

    vocabulary = vocabulary or seqio.ByteVocabulary()
    seqio.TaskRegistry.add(
        name,
        source=seqio.FunctionDataSource(dataset_fn, splits=tuple(files)),
        preprocessors=[
            seqio.preprocessors.tokenize,
            seqio.preprocessors.append_eos_after_trim,
        ],
        output_features={
            "inputs": seqio.Feature(vocabulary, add_eos=inputs_add_eos, dtype=tf.int32),
            "targets": seqio.Feature(vocabulary, add_eos=add_eos, dtype=tf.int32),
        },
        metric_fns=[],
    )
    return name
