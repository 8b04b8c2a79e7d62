"""The default corpus: the running Python's standard-library source files.

Every machine that runs flaxlm has them, so the default pre-training run needs no download.
Files are listed sorted; a file goes to `validation` when the CRC32 of its relative path is
0 mod 20, so the split is deterministic and stable as files come and go.
"""

from __future__ import annotations

import functools
import os
import sysconfig
import zlib

import gin
import seqio
import tensorflow as tf

from tasks.preprocessors import add_lm_task, split_targets

TASK_NAME = "stdlib_py"
VALIDATION_EVERY = 20


@functools.cache
def stdlib_files(split: str) -> tuple[str, ...]:
    """Sorted absolute paths of the `.py` files of `split` ('train' or 'validation')."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for f in filenames:
            if f.endswith(".py"):
                files.append(os.path.join(dirpath, f))
    files.sort()
    if not files:
        raise FileNotFoundError(f"No .py files under the standard library at {root}.")

    def is_validation(path: str) -> bool:
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        return zlib.crc32(rel.encode()) % VALIDATION_EVERY == 0

    if split == "validation":
        return tuple(f for f in files if is_validation(f))
    if split == "train":
        return tuple(f for f in files if not is_validation(f))
    raise ValueError(f"split {split!r}: the stdlib corpus has 'train' and 'validation'.")


def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
    files = tf.data.Dataset.from_tensor_slices(list(stdlib_files(split)))
    if shuffle_files:
        files = files.shuffle(len(stdlib_files(split)), seed=seed)
    return files.map(lambda f: {"text": tf.io.read_file(f)}, num_parallel_calls=1)


seqio.TaskRegistry.add(
    TASK_NAME,
    source=seqio.FunctionDataSource(dataset_fn, splits=("train", "validation")),
    preprocessors=[
        functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
        seqio.preprocessors.tokenize,
        split_targets,
    ],
    output_features={
        "targets": seqio.Feature(seqio.ByteVocabulary(), add_eos=False, dtype=tf.int32)
    },
    metric_fns=[],
)


@gin.configurable
def register_stdlib_task(vocabulary: seqio.Vocabulary = gin.REQUIRED) -> str:
    """The same corpus tokenized by `vocabulary` (a checkpoint's own tokenizer, e.g.
    `@HuggingFaceVocabulary()`), registered once; returns the task's name, the same in every
    process for the same vocabulary."""
    name = f"{TASK_NAME}_{zlib.crc32(repr(vocabulary).encode()):08x}"
    if name in seqio.TaskRegistry.names():
        return name
    source = seqio.FunctionDataSource(dataset_fn, splits=("train", "validation"))
    return add_lm_task(name, source, vocabulary=vocabulary, add_eos=False)
