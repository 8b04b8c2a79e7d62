"""SeqIO glue: logical input shards, feature conversion, and global `jax.Array` batches.

The input is split into `R` logical shards, `R` fixed by the mesh and the config alone
(`DatasetConfig.num_input_shards`, by default the data-parallel degree: one shard per row block
of the global batch), never by the number of processes. Logical shard `r` is
`seqio.get_dataset(..., shard_info=ShardInfo(r, R), seed=seed)` batched to `B / R` rows, and
supplies rows `[r * B / R, (r + 1) * B / R)` of every global batch of `B` rows. So the sequence
of global batches is the same for 1 process with 8 devices, 2 with 4, or 4 with 2.

A host reads exactly the logical shards that cover the rows its devices hold
(`Partitioner.data_layout`, `host_input`): one tf.data iterator per shard, their batches
concatenated along the batch axis. Hosts holding the same rows (a model replica spanning hosts)
read the same shards, and no host builds the whole global batch unless its devices hold all of
it. A host's rows go to the mesh through `jax.make_array_from_process_local_data`.

Each logical shard's iterator is checkpointed with the train state (shuffle buffers and
position included; `checkpoints.data_state.DatasetCheckpointHandler`), once, by the
lowest-numbered process that reads it. A run restored with any process count (and the same
R) continues with exactly the batches an uninterrupted run would have seen, across epoch
boundaries too. Each logical shard is a full seqio pipeline (own shuffle buffer and packing),
so a host reading many shards pays their start-up once; `num_input_shards=1` is one pipeline
that every host reads whole and slices (fine for one host or small batches).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import gin
import numpy as np
import seqio
import tensorflow as tf

from flaxlm.data import length_checks, packing, vocabularies
from flaxlm.data.config import (
    DatasetConfig,
    host_input_shards,
    input_shard_count,
    shard_state_name,
    shards_saved_by,
    to_global,
)
from flaxlm.models import batch_shapes, features
from flaxlm.models.row_start import RowStart

if TYPE_CHECKING:
    import jax

    from flaxlm.parallel.partitioning import DataLayout, Partitioner

# seqio's own vocabularies, bindable in Gin files as `@seqio.SentencePieceVocabulary()`
# (`seqio.SentencePieceVocabulary.sentencepiece_model_file = '/path/spm.model'`) and
# `@seqio.ByteVocabulary()`; flaxlm's (computed in Python, seqio-free for inference) are
# seqio Vocabularies too.
# (A run may import this module after Gin's config is locked, at its first data lookup: a
# training run whose Gin files bind `config.DatasetConfig` and load no seqio. Registering
# binds nothing.)
with gin.unlock_config():
    gin.external_configurable(seqio.SentencePieceVocabulary, module="seqio")
    gin.external_configurable(seqio.ByteVocabulary, module="seqio")
seqio.Vocabulary.register(vocabularies.PythonVocabulary)

# The repository's task registry: imported the first time a run looks up a task or mixture
# that is not registered, so a run that reads none (infer of a file, serve) never loads it.
BUILTIN_TASKS_MODULE = "tasks"

_TF_CONFIGURED = False

# tf.data hands each function it maps to AutoGraph, which rewrites the function's source so
# that Python `if` / `for` over tensors become graph ops: 0.03-0.5 s a function, in every
# process, ~1 s of a default run's start. These modules' mapped functions have no such
# control flow (a `bool()` or iteration of a tensor in graph mode would fail loudly, not
# change a result), so tf.data calls them as written. seqio.utils stays converted: its
# map wrappers call the task's own functions, which AutoGraph converts through them; its
# packing loop (`_pack_with_tf_ops`, a Python `for` over `tf.range`) is not used
# (`packing.trim_and_pack` makes its rows from explicit graph ops).
NOT_AUTOGRAPHED = (
    "flaxlm.data.packing",
    "seqio.preprocessors",
    "seqio.feature_converters",
    "seqio.vocabularies",
    "dataclasses",
    BUILTIN_TASKS_MODULE,
)


def _skip_autograph(modules: Sequence[str]) -> None:
    """Puts AutoGraph's 'do not convert' rule for `modules` ahead of its own rules."""
    try:
        from tensorflow.python.autograph.core import config as autograph_config
    except ImportError:  # another TensorFlow layout: everything converted, as before
        return
    rules = tuple(autograph_config.CONVERSION_RULES)
    present = {str(r) for r in rules}
    skip = tuple(autograph_config.DoNotConvert(m) for m in modules)
    autograph_config.CONVERSION_RULES = tuple(r for r in skip if str(r) not in present) + rules


def configure_tensorflow() -> None:
    """Keeps TensorFlow off the accelerators: it is only the input pipeline. Packs in memory
    linear in the length (`packing.use_linear_packing`: seqio's rows); has the feature
    converters check the lengths a dataset's spec fixes when it is built (`length_checks`:
    seqio's checks); maps the functions of `NOT_AUTOGRAPHED` without AutoGraph."""
    global _TF_CONFIGURED
    if _TF_CONFIGURED:
        return
    packing.use_linear_packing()
    length_checks.use_static_length_checks()
    _skip_autograph(NOT_AUTOGRAPHED)
    try:
        tf.config.set_visible_devices([], "GPU")
        tf.config.set_visible_devices([], "TPU")
    except (RuntimeError, ValueError):
        pass  # already initialised, or no such device type
    _TF_CONFIGURED = True


def without_autotune(ds: tf.data.Dataset) -> tf.data.Dataset:
    """`ds` without tf.data's autotuning thread. Destroying an iterator waits for that
    thread, which can miss the wake-up and sleep out its optimisation period (which grows to
    a minute): a finished or preempted run then sat at exit for up to 90 s. Parallel maps
    still run in parallel (at tf.data's default parallelism)."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)


def converter_for(
    cfg: DatasetConfig, model: Any, row_start: RowStart
) -> Callable[..., seqio.FeatureConverter]:
    """The feature converter `cfg` is read with (its own, else the model's), told the run's
    row start (`ConverterFactory`)."""
    converter_cls = cfg.feature_converter or model.FEATURE_CONVERTER_CLS
    if row_start.hf_form:
        import_task_module(cfg.module)  # the task's vocabulary says what the rows start with
    return ConverterFactory.create(converter_cls, row_start, cfg.mixture_or_task_name)


@dataclasses.dataclass(frozen=True)
class ConverterFactory:
    """Makes the run's feature converters, `converter_cls(pack=...)`, each told the run's row
    start: flaxlm's decoder-only converters (`features.ReadsRowStart`) read the rows from it;
    any other converter (seqio's own, a user's) only where the run reads seqio's start and
    the converter starts its rows with the same token; else a ValueError naming it, never a
    silent fallback to seqio's start. Called as the class it wraps is (`pack=` only)."""

    converter_cls: Callable[..., seqio.FeatureConverter]
    row_start: RowStart
    vocabulary: seqio.Vocabulary | None  # the task's: the HF form's prefix and EOS

    @classmethod
    def create(
        cls, converter_cls: Callable[..., seqio.FeatureConverter], row_start: RowStart, task: str
    ) -> ConverterFactory:
        vocabulary = task_vocabulary(task) if row_start.hf_form else None
        factory = cls(converter_cls, row_start, vocabulary)
        factory(pack=False)  # a converter that cannot read these rows is refused now
        return factory

    @property
    def name(self) -> str:
        cls = self.converter_cls
        return f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', cls)}"

    def __call__(self, pack: bool = True) -> seqio.FeatureConverter:
        converter = self.converter_cls(pack=pack)
        if isinstance(converter, features.ReadsRowStart):
            return converter.reading(self.row_start, self.vocabulary)
        start = self.row_start.decoder_start_id
        if self.row_start.hf_form or converter.bos_id != start:
            raise ValueError(
                f"DatasetConfig.feature_converter {self.name} starts each row with token "
                f"{converter.bos_id}, but this run reads its rows from "
                f"{self.row_start.describe()} (the model record or INIT_FROM_HF decides it): "
                "bind one of flaxlm's converters (features.LMFeatureConverter, "
                "ChatFeatureConverter, PreferenceFeatureConverter), which read either."
            )
        return converter


def task_vocabulary(name: str) -> seqio.Vocabulary:
    """The vocabulary of the `targets` (or first) feature of a registered task or mixture."""
    check_registered(name)
    features = seqio.get_mixture_or_task(name).output_features
    feature = features.get("targets") or next(iter(features.values()))
    return feature.vocabulary


def import_task_module(module: str | None, setting: str = "MIXTURE_OR_TASK_MODULE") -> None:
    """Imports `module` (it registers seqio tasks); a ValueError naming `setting` if it is
    not there or fails to import."""
    if not module:
        return
    try:
        # A run imports task modules after Gin's config is locked; they register tasks and
        # configurables, and bind nothing.
        with gin.unlock_config():
            importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and module.startswith(e.name):
            raise ValueError(
                f"{setting}={module!r}: no such module; give an importable module (on "
                "PYTHONPATH or in the working directory) that registers your seqio tasks."
            ) from e
        raise ValueError(f"{setting}={module!r} failed to import: {e}.") from e


def _is_registered(name: str) -> bool:
    return name in seqio.TaskRegistry.names() or name in seqio.MixtureRegistry.names()


def check_registered(name: str) -> None:
    """A ValueError naming the registered tasks if `name` is none of them, once the
    built-in tasks (`BUILTIN_TASKS_MODULE`, where it can be imported) are registered."""
    if _is_registered(name):
        return
    if importlib.util.find_spec(BUILTIN_TASKS_MODULE) is not None:
        import_task_module(BUILTIN_TASKS_MODULE)
        if _is_registered(name):
            return
    known = sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))
    close = difflib.get_close_matches(name, known, n=3)
    hint = f" Did you mean {close}?" if close else ""
    raise ValueError(
        f"No seqio task or mixture named {name!r} is registered.{hint} Registered: {known}. "
        "Register it in a module and pass that module (DatasetConfig.module or "
        "--gin.MIXTURE_OR_TASK_MODULE)."
    )


def task_examples(
    name: str, split: str, *, module: str | None = None, max_examples: int | None = None
) -> tuple[Mapping[str, seqio.Feature], Iterator[dict[str, np.ndarray]]]:
    """The output features of task or mixture `name` and the examples of its `split` in
    order, preprocessed and not cut to any length (what inference reads of a task)."""
    import_task_module(module)
    check_registered(name)
    configure_tensorflow()
    task = seqio.get_mixture_or_task(name)
    ds = task.get_dataset(None, split=split, shuffle=False, num_epochs=1)
    if max_examples:
        ds = ds.take(max_examples)
    return task.output_features, without_autotune(ds).as_numpy_iterator()


def logical_shard(
    cfg: DatasetConfig,
    index: int,
    num_shards: int,
    feature_converter_cls: type[seqio.FeatureConverter],
) -> tf.data.Dataset:
    """Logical shard `index` of `num_shards`, as unbatched model features."""
    ds = seqio.get_dataset(
        cfg.mixture_or_task_name,
        task_feature_lengths=dict(cfg.task_feature_lengths),
        dataset_split=cfg.split,
        shuffle=cfg.shuffle,
        num_epochs=cfg.num_epochs,
        feature_converter=feature_converter_cls(pack=cfg.pack),
        shard_info=seqio.ShardInfo(index=index, num_shards=num_shards),
        seed=cfg.seed,
        use_cached=cfg.use_cached,
        verbose=False,
    )
    return without_autotune(ds)


@dataclasses.dataclass(frozen=True)
class HostInput:
    """The logical input shards a host reads, `{r: shard r batched to B / R rows}` of
    `num_shards` R, and its rows: `[offset, offset + rows)` of their concatenation."""

    shards: Mapping[int, tf.data.Dataset]
    num_shards: int
    offset: int
    rows: int

    def combine(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """This host's rows of one global batch from the next batch of each of its shards
        (in `shards` order)."""
        if len(parts) == 1:
            batch = dict(parts[0])
        else:
            batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        if self.offset == 0 and self.rows == next(iter(batch.values())).shape[0]:
            return batch
        return {k: v[self.offset : self.offset + self.rows] for k, v in batch.items()}

    def next_batch(self, iterators: Iterable[Iterator[Any]]) -> dict[str, np.ndarray]:
        """`combine` of the next batch of each shard's iterator (StopIteration at the end)."""
        return self.combine([{k: np.asarray(v) for k, v in next(it).items()} for it in iterators])


def host_input(
    cfg: DatasetConfig, layout: DataLayout, feature_converter_cls: type[seqio.FeatureConverter]
) -> HostInput:
    """The logical shards covering this host's rows (`layout`) of every global batch."""
    configure_tensorflow()
    import_task_module(cfg.module)
    check_registered(cfg.mixture_or_task_name)
    total = input_shard_count(cfg, layout)
    rows = layout.global_batch_size // total
    shards = host_input_shards(cfg, layout)
    parts = {
        r: logical_shard(cfg, r, total, feature_converter_cls)
        .batch(rows, drop_remainder=True)
        .prefetch(2)
        for r in shards
    }
    # With num_input_shards below the data-parallel degree, a shard may cover more rows
    # than this host holds.
    offset = layout.row_start - shards.start * rows
    return HostInput(parts, total, offset, layout.per_host_batch_size)


def host_batches(
    cfg: DatasetConfig, layout: DataLayout, feature_converter_cls: type[seqio.FeatureConverter]
) -> Iterator[dict[str, np.ndarray]]:
    """This host's rows `[per_host_batch, length]` of each global batch, as numpy: what a
    `DataIterator` puts on the mesh, without a mesh. Bad configurations raise here, not at
    the first batch."""
    source = host_input(cfg, layout, feature_converter_cls)

    def batches() -> Iterator[dict[str, np.ndarray]]:
        iterators = [iter(ds) for ds in source.shards.values()]
        while True:
            try:
                yield source.next_batch(iterators)
            except StopIteration:
                return

    return batches()


def batch_dtypes(
    cfg: DatasetConfig, converter: Callable[..., seqio.FeatureConverter]
) -> dict[str, str] | None:
    """`{model feature: numpy dtype name}` of the batches, known before the pipeline is
    built; None where a feature is not one token row an example (preference pairs), which
    only the pipeline says."""
    features = converter(pack=cfg.pack).MODEL_FEATURES
    out = {}
    for name in batch_shapes.model_feature_lengths(converter, cfg.task_feature_lengths, cfg.pack):
        spec = features.get(name)
        if spec is None and name.endswith(("_segment_ids", "_positions")):  # packing's own
            out[name] = "int32"
        elif spec is not None and spec.rank == 1:
            out[name] = np.dtype(spec.dtype.as_numpy_dtype).name
        else:
            return None
    return out


def has_task_metrics(cfg: DatasetConfig) -> bool:
    """Whether `cfg`'s task (or a task of its mixture) has metric functions for its split:
    what seqio's evaluator evaluates."""
    import_task_module(cfg.module)
    check_registered(cfg.mixture_or_task_name)
    tasks = seqio.get_subtasks(seqio.get_mixture_or_task(cfg.mixture_or_task_name))
    return bool(seqio.evaluation.get_valid_eval_tasks(tasks, cfg.split))


class HostReader:
    """This host's rows of each global batch, as numpy, from the tf.data iterators of its
    logical input shards; checkpointable per shard. What a `DataIterator` reads, in the
    run's process or in its input process (`input_process.py`)."""

    def __init__(self, source: HostInput):
        self.source = source
        self.reset()

    def reset(self) -> None:
        self.iterators = {r: iter(ds) for r, ds in self.source.shards.items()}

    def next_numpy(self) -> dict[str, np.ndarray]:
        return self.source.next_batch(self.iterators.values())

    def write_state(self, directory: str, shards: Iterable[int]) -> None:
        """Writes the tf.data position of each of `shards` under `directory`."""
        for r in sorted(shards):
            path = shard_state_path(directory, r, self.source.num_shards)
            tf.train.Checkpoint(iterator=self.iterators[r]).write(path)

    def read_state(self, directory: str) -> None:
        """Restores the tf.data position of every shard this host reads from `directory`."""
        for r, iterator in self.iterators.items():
            path = shard_state_path(directory, r, self.source.num_shards)
            tf.train.Checkpoint(iterator=iterator).read(path).assert_consumed()


class DataIterator:
    """Global batches on the mesh from this host's logical input shards; checkpointable per
    logical shard (`write_state` / `read_state`; each shard saved by one process:
    `saved_shards`)."""

    def __init__(self, source: HostInput, partitioner: Partitioner, layout: DataLayout):
        if not isinstance(source, HostInput):
            raise TypeError(
                f"DataIterator reads a data.HostInput (data.host_input(...)), not {type(source)}."
            )
        import jax  # (here: the input process reads this module and never loads JAX)

        self._reader = HostReader(source)
        self._partitioner = partitioner
        self._layout = layout
        self.wait_seconds = 0.0  # time spent waiting on the input pipeline
        self.num_shards = source.num_shards
        self.saved_shards = shards_saved_by(
            jax.process_index(), partitioner, layout.global_batch_size, source.num_shards
        )

    @classmethod
    def create(
        cls, cfg: DatasetConfig, partitioner: Partitioner, converter: Any = None
    ) -> DataIterator:
        """The iterator of `cfg` on `partitioner`'s mesh (rows as its data layout says)."""
        layout = partitioner.data_layout(cfg.batch_size)
        return cls(host_input(cfg, layout, converter), partitioner, layout)

    @property
    def shard_iterators(self) -> dict[int, Any]:
        """`{r: tf.data iterator}` for the logical shards this host reads."""
        return dict(self._reader.iterators)

    @property
    def input_shards(self) -> list[int]:
        """The logical shards this host reads."""
        return list(self._reader.iterators)

    def reset(self) -> None:
        self._reader.reset()

    def next_numpy(self) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        batch = self._reader.next_numpy()
        self.wait_seconds += time.perf_counter() - start
        return batch

    def to_global(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        return to_global(batch, self._partitioner, self._layout)

    def write_state(self, directory: str) -> None:
        """Writes the position of each shard in `saved_shards` under `directory`."""
        self._reader.write_state(directory, self.saved_shards)

    def read_state(self, directory: str) -> None:
        """Restores every shard's position from `directory` (all must be there)."""
        self._reader.read_state(directory)

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        return self.to_global(self.next_numpy())


def shard_state_path(directory: str, shard: int, num_shards: int) -> str:
    """Where logical shard `shard` of `num_shards` keeps its position under `directory`
    (`<path>.index` plus data files: a `tf.train.Checkpoint` of its iterator)."""
    return os.path.join(str(directory), shard_state_name(shard, num_shards))
