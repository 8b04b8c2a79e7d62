"""What a run reads and how its rows are split, without TensorFlow: the `DatasetConfig` Gin
binds, the logical input shards a host reads (`input_shard_count`, `host_input_shards`,
`shards_saved_by`), and a host's rows put on the mesh (`to_global`).

seqio and tf.data live in `pipeline.py`, in the process that reads the data: the run's own
(`pipeline.DataIterator`) or, where the run has not loaded TensorFlow, an input process of
its own (`input_process.py`). Gin files bind `DatasetConfig` from here, so parsing them
loads neither."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import gin
import numpy as np

if TYPE_CHECKING:  # (the input process reads this module and never loads JAX or Flax)
    import jax

    from flaxlm.parallel.partitioning import DataLayout, Partitioner


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    """Which seqio task or mixture to read, and how (scoped in Gin: `train/`, `train_eval/`)."""

    mixture_or_task_name: str = gin.REQUIRED
    task_feature_lengths: Mapping[str, int] = gin.REQUIRED
    split: str = "train"
    batch_size: int = gin.REQUIRED  # global batch size, over all hosts
    shuffle: bool = True
    seed: int | None = 0  # None: nondeterministic
    pack: bool = True
    use_cached: bool = False
    module: str | None = None  # a module to import that registers the task
    num_epochs: int | None = None  # None: repeat forever
    # Logical input shards R (must divide batch_size); None: the mesh's data-parallel degree.
    # Fixed by the config and mesh, never by the process count, so the batches are too.
    num_input_shards: int | None = None
    # The seqio FeatureConverter class to read the task with (e.g. the chat tasks'
    # features.ChatFeatureConverter); None: the model's own (`model.FEATURE_CONVERTER_CLS`).
    feature_converter: type | None = None


def input_shard_count(cfg: DatasetConfig, layout: DataLayout) -> int:
    """R: `cfg.num_input_shards`, else one logical shard per row block of the batch."""
    shards = cfg.num_input_shards or layout.data_parallel_degree
    if shards < 1 or layout.global_batch_size % shards:
        raise ValueError(
            f"num_input_shards={shards} must be positive and divide the batch size "
            f"{layout.global_batch_size}; set DatasetConfig.num_input_shards to a divisor of it."
        )
    return shards


def host_input_shards(cfg: DatasetConfig, layout: DataLayout) -> range:
    """The logical shards that cover this host's rows of the global batch."""
    rows = layout.global_batch_size // input_shard_count(cfg, layout)
    return range(layout.row_start // rows, -(-layout.row_stop // rows))


def shards_saved_by(
    process: int, partitioner: Partitioner, global_batch_size: int, num_shards: int
) -> frozenset[int]:
    """The logical shards whose iterator state `process` checkpoints: those it reads and no
    lower-numbered process reads."""
    import jax

    rows = global_batch_size // num_shards
    owner: dict[int, int] = {}
    for p in range(jax.process_count()):
        try:
            layout = partitioner.data_layout(global_batch_size, process_index=p)
        except ValueError:
            continue  # a process with no device in the mesh reads nothing
        for r in range(layout.row_start // rows, -(-layout.row_stop // rows)):
            owner.setdefault(r, p)
    return frozenset(r for r, p in owner.items() if p == process)


def batch_structs(
    cfg: DatasetConfig,
    feature_lengths: Mapping[str, int],
    dtypes: Mapping[str, str],
    partitioner: Partitioner,
) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batches' shapes, dtypes and shardings: `[batch_size, length]` rows of each
    model feature (`feature_lengths`, `dtypes`: numpy dtype names)."""
    import jax

    sharding = partitioner.batch_sharding(2)
    return {
        name: jax.ShapeDtypeStruct(
            (cfg.batch_size, length), np.dtype(dtypes[name]), sharding=sharding
        )
        for name, length in feature_lengths.items()
    }


def shard_state_name(shard: int, num_shards: int) -> str:
    """The file name (before `.index` and the data files' suffixes) under which logical shard
    `shard` of `num_shards` keeps its position in a checkpoint's dataset directory."""
    return f"shard_{shard}-of-{num_shards}"


def to_global(
    batch: Mapping[str, Any], partitioner: Partitioner, layout: DataLayout
) -> dict[str, jax.Array]:
    """A host's rows (`layout`) of one global batch, as global arrays on the mesh."""
    import jax

    out = {}
    for name, local in batch.items():
        global_shape = (layout.global_batch_size,) + local.shape[1:]
        sharding = partitioner.batch_sharding(local.ndim)
        out[name] = jax.make_array_from_process_local_data(sharding, local, global_shape)
    return out
