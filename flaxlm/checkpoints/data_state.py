"""The data iterators' part of a checkpoint: each logical input shard's position, and what a
resumed run must read as the checkpoint was written (the same lengths, the same number of
logical input shards)."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from flaxlm.data.config import shard_state_name

SUBDIR = "checkpoints"  # of a MODEL_DIR


def saved_input_shards(model_dir: str) -> int | None:
    """R, the number of logical input shards, of the newest checkpoint under `model_dir`
    holding a data-iterator position (None: no such checkpoint). A resumed run reads its
    data as that many shards, whatever its mesh, so it continues the same global batches."""
    directory = epath.Path(model_dir) / SUBDIR
    if not directory.is_dir():
        return None
    steps = sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit()), reverse=True)
    for step in steps:
        dataset = directory / str(step) / "dataset"
        if not dataset.is_dir():
            continue
        names = (re.fullmatch(r"shard_\d+-of-(\d+)\.index", f.name) for f in dataset.iterdir())
        counts = {int(m.group(1)) for m in names if m}
        if len(counts) == 1:
            return counts.pop()
    return None


def _config_value(config: str, selector: str) -> Any:
    """The literal bound to `selector` (a regular expression) in an operative Gin config,
    through one macro (`= %NAME`); None if it is not there or not a literal."""

    def bound(pattern: str) -> str | None:
        # A long value continues on the lines below it, indented.
        match = re.search(rf"^{pattern} = (.*(?:\n[ \t]+.*)*)", config, re.MULTILINE)
        return match.group(1) if match else None

    text = bound(selector)
    if text is not None and text.strip().startswith("%"):
        text = bound(re.escape(text.strip()[1:]))
    try:
        return ast.literal_eval(text) if text is not None else None
    except (ValueError, SyntaxError):
        return None


def saved_task_feature_lengths(model_dir: str) -> tuple[int, dict[str, int]] | None:
    """(step, the training data's `task_feature_lengths`) of the newest checkpoint under
    `model_dir`, read from the operative config saved with it; None if there is none (or
    its config does not say)."""
    directory = epath.Path(model_dir) / SUBDIR
    if not directory.is_dir():
        return None
    steps = sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit()), reverse=True)
    for step in steps:
        metadata = directory / str(step) / "config" / "metadata"
        try:
            config = json.loads(metadata.read_text())["operative_config"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        lengths = _config_value(config, r"train/(?:[\w.]+\.)?DatasetConfig\.task_feature_lengths")
        return (step, lengths) if isinstance(lengths, dict) else None
    return None


def check_resumed_lengths(task_feature_lengths: Any, model_dir: str) -> None:
    """A ValueError naming TASK_FEATURE_LENGTHS when `model_dir`'s checkpoint was trained on
    other lengths: its data position is one of batches of those (a resumed tf.data iterator
    of other shapes fails deep in TensorFlow)."""
    saved = saved_task_feature_lengths(model_dir)
    if saved is None:
        return
    step, lengths = saved
    if dict(lengths) != dict(task_feature_lengths):
        raise ValueError(
            f"TASK_FEATURE_LENGTHS={dict(task_feature_lengths)}, but the checkpoint "
            f"{epath.Path(model_dir) / SUBDIR / str(step)} was trained with {dict(lengths)}: a "
            "run resumes with the lengths it started with: set those, or train in a new "
            "MODEL_DIR."
        )


def resumed_input_shards(cfg: Any, partitioner: Any, model_dir: str) -> Any:
    """`cfg` reading as many logical input shards as `model_dir`'s checkpoint was written
    with, unless `num_input_shards` is set: a run resumed on another mesh (more or fewer
    devices, another data-parallel degree) continues with the global batches it would have
    seen on the old one."""
    saved = saved_input_shards(model_dir)
    if saved is None or cfg.num_input_shards is not None:
        return cfg
    degree = partitioner.data_parallel_degree()
    if saved != degree:
        print(
            f"Reading the training data as {saved} logical input shards, as the checkpoint "
            f"was written (this mesh's data-parallel degree is {degree}), so the data order "
            "continues unchanged.",
            flush=True,
        )
    return dataclasses.replace(cfg, num_input_shards=saved)


class DataIteratorMismatchError(ValueError):
    """A checkpoint's data-iterator state was written for other logical input shards."""


def check_dataset_state(directory: epath.Path, data_iterator: Any) -> None:
    """Raises `DataIteratorMismatchError`, naming the fix, unless `directory` holds the state
    of every logical input shard `data_iterator` reads."""
    num_shards = data_iterator.num_shards
    missing = [
        r
        for r in data_iterator.input_shards
        if not (directory / f"{shard_state_name(r, num_shards)}.index").exists()
    ]
    if not missing:
        return
    found = sorted({f.name.split(".")[0] for f in directory.iterdir() if "-of-" in f.name})
    raise DataIteratorMismatchError(
        f"{directory} holds no data-iterator state for logical input shard(s) {missing} of "
        f"{num_shards} (it has {found}). The checkpoint was written with another "
        "number of logical input shards: leave DatasetConfig.num_input_shards unset (a "
        "resumed run then reads the number the checkpoint was written with) or set it to the "
        "number in its file names to resume the data exactly, or train from its params with "
        "a fresh data order in a new MODEL_DIR."
    )


class DatasetCheckpointHandler(ocp.CheckpointHandler):
    """Saves the data iterator's position per logical input shard (`shard_{r}-of-{R}`, each
    written by the lowest-numbered process that reads it), so a run restores onto any
    process count that keeps R. The iterator writes and reads them itself
    (`write_state` / `read_state`: tf.data's own checkpoints, in whichever process reads
    the data), so a run that only restores params never loads TensorFlow."""

    def save(self, directory: epath.Path, args: DatasetArgs) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        args.iterator.write_state(str(directory))

    def restore(self, directory: epath.Path, args: DatasetArgs) -> Any:
        # `Checkpointer.restore` has checked that every shard's state is there.
        args.iterator.read_state(str(directory))
        return args.iterator

    def metadata(self, directory: epath.Path) -> None:
        return None

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass


@ocp.args.register_with_handler(DatasetCheckpointHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class DatasetArgs(ocp.args.CheckpointArgs):
    iterator: Any
