"""Settings a run refuses before any device work, each with an error naming the setting.

The checks of one setting that the runs share, each once: the counts, the learning rate,
MODEL_DIR, INIT_FROM_HF, the sequence split. What a step needs of a setting is checked
beside the step (`steps.check_batch_size`, which evaluation's steps use too), what a model
needs by the model (`model.check_lengths`, the positions).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from etils import epath

from flaxlm.checkpoints import checkpointer
from flaxlm.models.causal_lm import CausalLM
from flaxlm.parallel.partitioning import Partitioner

SEQUENCE_AXIS = "sequence"  # the mesh axis context parallelism splits sequences over


def has_checkpoint(model_dir: str) -> bool:
    """Whether `model_dir` holds a checkpoint a run would resume from."""
    directory = epath.Path(model_dir) / checkpointer.SUBDIR
    return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def check_counts(**counts: tuple[Any, int]) -> None:
    """A ValueError naming the first setting (`NAME=(value, minimum)`) that is not an integer
    of at least its minimum: before any device work, so a typo costs nothing."""
    for name, (value, minimum) in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(
                f"{name}={value!r} must be a whole number >= {minimum} (no quotes, no decimals)."
            )


def check_learning_rate(learning_rate: Any) -> None:
    """A ValueError unless `learning_rate` is a number or a schedule (a quoted '1e-3' is
    neither)."""
    if isinstance(learning_rate, bool) or not (
        callable(learning_rate) or isinstance(learning_rate, int | float)
    ):
        raise ValueError(
            f"LEARNING_RATE={learning_rate!r} must be a number (e.g. 1e-4, no quotes) or a "
            "schedule."
        )


def check_model_dir(model_dir: str) -> epath.Path:
    """`model_dir` as a path, made if missing: a ValueError naming MODEL_DIR when it cannot
    be written (before any device work, not at the first checkpoint)."""
    path = epath.Path(model_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_test_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"MODEL_DIR {model_dir!r} cannot be written: {e}") from e
    return path


def check_init_from_hf(init_from_hf: str | None) -> None:
    """A ValueError naming INIT_FROM_HF when it is not a HuggingFace checkpoint directory
    (config.json and *.safetensors): missing, empty, or a file."""
    if not init_from_hf:
        return
    path = epath.Path(init_from_hf)
    if not path.is_dir():
        raise ValueError(
            f"INIT_FROM_HF={init_from_hf!r}: no such directory; give a HuggingFace checkpoint "
            "directory (config.json and *.safetensors), e.g. one `huggingface-cli download` "
            "wrote."
        )
    missing = [
        name
        for name, present in (
            ("config.json", (path / "config.json").exists()),
            ("*.safetensors", any(path.glob("*.safetensors"))),
        )
        if not present
    ]
    if missing:
        raise ValueError(
            f"INIT_FROM_HF={init_from_hf!r} is not a HuggingFace checkpoint directory: it has "
            f"no {' and no '.join(missing)}."
        )


def check_sequence_split(
    model: Any, partitioner: Partitioner, feature_lengths: Mapping[str, int]
) -> None:
    """A ValueError naming TASK_FEATURE_LENGTHS when the load-balanced context-parallel
    layout (a decoder-only model's `context_parallel_balance`, on by default) cannot split
    a sequence: it cuts each into 2 x the mesh's `sequence` size chunks. Without balancing,
    any length works (the last shard holds fewer positions)."""
    shards = dict(partitioner.mesh.shape).get(SEQUENCE_AXIS, 1)
    config = getattr(model, "config", None)
    balance = getattr(config, "context_parallel_balance", False)
    if shards == 1 or not balance or not isinstance(getattr(model, "module", None), CausalLM):
        return
    for name, length in feature_lengths.items():
        if length % (2 * shards):
            lower = length // (2 * shards) * (2 * shards)
            upper = lower + 2 * shards
            raise ValueError(
                f"TASK_FEATURE_LENGTHS gives {name} of length {length}, not a multiple of "
                f"2 x sequence={shards} = {2 * shards}: the load-balanced context-parallel "
                f"layout splits each sequence into {2 * shards} chunks. Use a length of "
                f"{lower or upper} or {upper}, or set context_parallel_balance=False on the "
                "model's config (then any length)."
            )
