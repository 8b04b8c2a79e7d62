"""A Gin-bound factory that registers a seqio task over a local HuggingFace `datasets` dataset.

The data is a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (read
with `datasets.load_from_disk`) or local json/jsonl/parquet files (read with
`datasets.load_dataset("json" | "parquet", data_files=...)`). Nothing is downloaded. The
task reads one text column as language-modelling `targets` (cut into target-length chunks,
as `register_text_files_task` does), or an input and a target column as `{inputs, targets}`
pairs (as `register_jsonl_task` does).

Examples go through `seqio.FunctionDataSource`: seqio shards them over hosts, and a split is
shuffled as a full permutation drawn from the run's seed. The text columns are held in memory
while the task is read: meant for fine-tuning sets, not pre-training corpora.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import seqio
import tensorflow as tf

from tasks.jsonl import in_memory_dataset
from tasks.preprocessors import split_targets

_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _load(
    name: str, path_or_files: str | Mapping[str, str | Sequence[str]], file_format: str | None
) -> dict[str, Any]:
    """{split: datasets.Dataset}."""
    import datasets

    if isinstance(path_or_files, str):
        if not os.path.isdir(path_or_files):
            raise FileNotFoundError(
                f"Task {name!r}: {path_or_files!r} is not a directory written by "
                "save_to_disk; for data files give {split: file or files}."
            )
        loaded = datasets.load_from_disk(path_or_files)
        if isinstance(loaded, datasets.Dataset):
            return {"train": loaded}
        return dict(loaded)
    files = {s: [f] if isinstance(f, str) else list(f) for s, f in path_or_files.items()}
    for split, paths in files.items():
        missing = [p for p in paths if not os.path.exists(p)]
        if missing or not paths:
            raise FileNotFoundError(f"Task {name!r}: split {split!r}: no such files {missing}.")
    if file_format is None:
        kinds = {os.path.splitext(p)[1] for paths in files.values() for p in paths}
        formats = {_FORMATS.get(k) for k in kinds}
        if len(formats) != 1 or None in formats:
            raise ValueError(
                f"Task {name!r}: cannot tell the format of files ending {sorted(kinds)}; set "
                "file_format to 'json' or 'parquet'."
            )
        (file_format,) = formats
    return dict(datasets.load_dataset(file_format, data_files=files))


def _check_columns(name: str, splits: Mapping[str, Any], keys: Sequence[str]) -> None:
    for split, ds in splits.items():
        for key in keys:
            kind = ds.features.get(key)
            if kind is None or getattr(kind, "dtype", None) not in ("string", "large_string"):
                columns = {k: str(v) for k, v in ds.features.items()}
                raise ValueError(
                    f"Task {name!r}, split {split!r}: needs a string column {key!r}; the "
                    f"dataset has {columns}."
                )
        if len(ds) == 0:
            raise ValueError(f"Task {name!r}: split {split!r} has no examples.")


@gin.configurable
def register_hf_dataset_task(
    name: str = gin.REQUIRED,
    path_or_files: str | Mapping[str, str | Sequence[str]] = gin.REQUIRED,
    text_key: str = "text",
    input_key: str | None = None,
    target_key: str | None = None,
    vocabulary: seqio.Vocabulary | None = None,
    add_eos: bool = True,
    file_format: str | None = None,
) -> str:
    """Registers (once) a task over a local HF dataset named `name`; returns the name.

    Args:
      path_or_files: a `save_to_disk` directory (a single Dataset becomes split 'train'), or
        {split: file or list of files} of json/jsonl/parquet.
      text_key: the text column of a language-modelling task (used when no input_key).
      input_key, target_key: both set: an `{inputs, targets}` task from these columns (prefix-LM
        for decoder-only models, or encoder-decoder), as `register_jsonl_task`.
      vocabulary: a seqio Vocabulary; bytes if None.
      file_format: 'json' or 'parquet'; from the file extensions if None.
    """
    if name in seqio.TaskRegistry.names():
        return name
    if (input_key is None) != (target_key is None):
        raise ValueError(
            f"Task {name!r}: give both input_key and target_key (a pairs task) or neither "
            f"(a text task over {text_key!r}); got {input_key=}, {target_key=}."
        )
    splits = _load(name, path_or_files, file_format)
    pairs = input_key is not None
    key_map = {"inputs": input_key, "targets": target_key} if pairs else {"targets": text_key}
    _check_columns(name, splits, list(key_map.values()))

    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
        ds = splits[split]
        columns = {feature: list(ds[key]) for feature, key in key_map.items()}
        return in_memory_dataset(columns, shuffle=shuffle_files, seed=seed)

    vocabulary = vocabulary or seqio.ByteVocabulary()
    targets = seqio.Feature(vocabulary, add_eos=add_eos, dtype=tf.int32)
    if pairs:
        features = {"inputs": seqio.Feature(vocabulary, add_eos=False, dtype=tf.int32)}
        chunking = []
    else:
        features = {}
        chunking = [split_targets]
    seqio.TaskRegistry.add(
        name,
        source=seqio.FunctionDataSource(dataset_fn, splits=tuple(splits)),
        preprocessors=[
            seqio.preprocessors.tokenize,
            *chunking,
            seqio.preprocessors.append_eos_after_trim,
        ],
        output_features={**features, "targets": targets},
        metric_fns=[],
    )
    return name
