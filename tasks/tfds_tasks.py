"""TFDS text datasets by name: a Gin-bound factory, and `c4_en`, `lm1b`, `wiki40b_en`.

The registered tasks are lazy: nothing is read, downloaded or prepared until a run asks for
their data (TFDS then prepares them in `tfds_data_dir`, or `~/tensorflow_datasets`, which
needs the network and, for c4 and wiki40b, a lot of disk and time; prepare them once with
`tfds build` and point `tfds_data_dir` at the result). Their vocabulary is bytes; register
your own with `register_tfds_task(..., vocabulary=...)` for another tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import gin
import seqio

from tasks.preprocessors import add_lm_task

# {task: (tfds name, {split: TFDS split})}. The splits are spelled out so that registering
# never asks TFDS for the dataset's info (which could reach the network).
DEFAULT_TASKS = {
    "c4_en": ("c4/en:3.1.0", {"train": "train", "validation": "validation"}),
    "lm1b": ("lm1b:1.1.0", {"train": "train", "validation": "test"}),
    "wiki40b_en": ("wiki40b/en:1.3.0", {"train": "train", "validation": "validation"}),
}


@gin.configurable
def register_tfds_task(
    name: str = gin.REQUIRED,
    tfds_name: str = gin.REQUIRED,
    text_key: str = "text",
    splits: Sequence[str] | Mapping[str, str] = ("train", "validation"),
    vocabulary: seqio.Vocabulary | None = None,
    add_eos: bool = True,
    tfds_data_dir: str | None = None,
) -> str:
    """Registers (once) a language-modelling task over TFDS `tfds_name`; returns the name.

    Args:
      tfds_name: "name[/config]:version" (seqio needs the version), e.g. "c4/en:3.1.0".
      text_key: the dataset's text feature; it becomes `targets`, cut into target-length
        chunks.
      splits: split names, or {split: TFDS split or slice}, e.g.
        {"train": "train", "validation": "validation[:1000]"}.
      vocabulary: a seqio Vocabulary; bytes if None.
      tfds_data_dir: where the prepared dataset lives (TFDS's default if None).
    """
    if name in seqio.TaskRegistry.names():
        return name
    split_map = dict(splits) if isinstance(splits, Mapping) else {s: s for s in splits}
    return add_lm_task(
        name,
        seqio.TfdsDataSource(tfds_name, tfds_data_dir=tfds_data_dir, splits=split_map),
        text_key=text_key,
        vocabulary=vocabulary,
        add_eos=add_eos,
    )


for _name, (_tfds_name, _splits) in DEFAULT_TASKS.items():
    register_tfds_task(name=_name, tfds_name=_tfds_name, splits=_splits)
