"""A Gin-bound factory that registers a seqio task over local text files."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import gin
import seqio
import tensorflow as tf

from tasks.preprocessors import add_lm_task


@gin.configurable
def register_text_files_task(
    name: str = gin.REQUIRED,
    split_files: Mapping[str, str | Sequence[str]] = gin.REQUIRED,
    one_example_per: str = "line",
    vocabulary: seqio.Vocabulary | None = None,
    add_eos: bool = True,
) -> str:
    """Registers (once) a language-modelling task named `name` and returns the name.

    Args:
      split_files: {split: glob or list of globs}, e.g. {"train": "data/*.txt"}.
      one_example_per: 'line' (each line an example) or 'file' (each file an example, cut
        into target-length chunks).
      vocabulary: a seqio Vocabulary; bytes if None.
    """
    if name in seqio.TaskRegistry.names():
        return name
    patterns = {s: [p] if isinstance(p, str) else list(p) for s, p in split_files.items()}
    for split, globs in patterns.items():
        found = [f for g in globs for f in tf.io.gfile.glob(g)]
        if not found:
            raise FileNotFoundError(f"Task {name!r}: no files match {globs} for split {split!r}.")
        if not any(_has_text(f) for f in found):
            raise ValueError(
                f"Task {name!r}: the files for split {split!r} ({', '.join(found[:3])}"
                f"{', ...' if len(found) > 3 else ''}) are empty; give files with text."
            )
    if one_example_per == "line":
        source = seqio.TextLineDataSource(split_to_filepattern=patterns)
        to_dict = [lambda ds: ds.map(lambda line: {"text": line})]
    elif one_example_per == "file":

        def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None):
            files = sorted(f for g in patterns[split] for f in tf.io.gfile.glob(g))
            ds = tf.data.Dataset.from_tensor_slices(files)
            if shuffle_files:
                ds = ds.shuffle(len(files), seed=seed)
            return ds.map(lambda f: {"text": tf.io.read_file(f)})

        source = seqio.FunctionDataSource(dataset_fn, splits=tuple(patterns))
        to_dict = []
    else:
        raise ValueError(f"one_example_per={one_example_per!r}: expected 'line' or 'file'.")
    return add_lm_task(name, source, vocabulary=vocabulary, add_eos=add_eos, preprocessors=to_dict)


def _has_text(path: str, probe: int = 1 << 16) -> bool:
    """Whether the file has a non-blank character (files larger than `probe` count as text
    unread)."""
    if tf.io.gfile.stat(path).length > probe:
        return True
    with tf.io.gfile.GFile(path, "rb") as f:
        return bool(f.read().strip())
