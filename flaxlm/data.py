"""SeqIO glue: this host's shard, feature conversion, and global `jax.Array` batches.

Each host asks seqio for the shard that `Partitioner.data_layout` assigns to it (hosts that
hold the same rows of the global batch read the same shard), batches it to the per-host batch
size, and `jax.make_array_from_process_local_data` assembles the global batch on the mesh.
The tf.data iterator is checkpointable, so a restored run continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import gin
import jax
import numpy as np
import seqio
import tensorflow as tf

from flaxlm.partitioning import DataLayout, Partitioner

_TF_CONFIGURED = False


def configure_tensorflow() -> None:
    """Keeps TensorFlow off the accelerators: it is only the input pipeline."""
    global _TF_CONFIGURED
    if _TF_CONFIGURED:
        return
    try:
        tf.config.set_visible_devices([], "GPU")
        tf.config.set_visible_devices([], "TPU")
    except (RuntimeError, ValueError):
        pass  # already initialised, or no such device type
    _TF_CONFIGURED = True


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


def import_task_module(module: str | None) -> None:
    if module:
        importlib.import_module(module)


def _check_registered(name: str) -> None:
    if name in seqio.TaskRegistry.names() or name in seqio.MixtureRegistry.names():
        return
    known = sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))
    close = difflib.get_close_matches(name, known, n=3)
    hint = f" Did you mean {close}?" if close else ""
    raise ValueError(
        f"No seqio task or mixture named {name!r} is registered.{hint} Registered: {known}. "
        "Register it in a module and pass that module (DatasetConfig.module or "
        "--gin.MIXTURE_OR_TASK_MODULE)."
    )


def get_dataset(
    cfg: DatasetConfig, layout: DataLayout, feature_converter_cls: type[seqio.FeatureConverter]
) -> tf.data.Dataset:
    """This host's batches `[per_host_batch, length]` of model features, as tf.data."""
    configure_tensorflow()
    import_task_module(cfg.module)
    _check_registered(cfg.mixture_or_task_name)
    ds = seqio.get_dataset(
        cfg.mixture_or_task_name,
        task_feature_lengths=dict(cfg.task_feature_lengths),
        dataset_split=cfg.split,
        shuffle=cfg.shuffle,
        num_epochs=cfg.num_epochs,
        feature_converter=feature_converter_cls(pack=cfg.pack),
        shard_info=seqio.ShardInfo(index=layout.shard_index, num_shards=layout.num_shards),
        seed=cfg.seed,
        use_cached=cfg.use_cached,
        verbose=False,
    )
    return ds.batch(layout.per_host_batch_size, drop_remainder=True).prefetch(2)


def model_feature_lengths(
    cfg: DatasetConfig, feature_converter_cls: type[seqio.FeatureConverter]
) -> dict[str, int]:
    converter = feature_converter_cls(pack=cfg.pack)
    return dict(converter.get_model_feature_lengths(dict(cfg.task_feature_lengths)))


class DataIterator:
    """Global batches on the mesh from this host's tf.data iterator; checkpointable."""

    def __init__(self, ds: tf.data.Dataset, partitioner: Partitioner, layout: DataLayout):
        self._ds = ds
        self._iterator = iter(ds)
        self._partitioner = partitioner
        self._layout = layout
        self.wait_seconds = 0.0  # time spent waiting on the input pipeline

    @property
    def tf_iterator(self) -> Any:
        return self._iterator

    def reset(self) -> None:
        self._iterator = iter(self._ds)

    def next_numpy(self) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        batch = jax.tree.map(np.asarray, next(self._iterator))
        self.wait_seconds += time.perf_counter() - start
        return batch

    def to_global(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        out = {}
        for name, local in batch.items():
            global_shape = (self._layout.global_batch_size,) + local.shape[1:]
            sharding = self._partitioner.batch_sharding(local.ndim)
            out[name] = jax.make_array_from_process_local_data(sharding, local, global_shape)
        return out

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        return self.to_global(self.next_numpy())
