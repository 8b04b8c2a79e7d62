"""One orbax CheckpointManager for the train state, the data iterator and the config.

Saves are asynchronous and atomic (orbax writes to a temporary directory and renames it on
commit), so an interrupted save is never picked as the latest. Restores place every array
with the *current* partitioner's shardings, so a run saved on one mesh resumes on another.
A checkpoint that cannot be read is set aside (`{step}.unreadable`) when an older one can.
"""

from __future__ import annotations

import functools
import logging as std_logging
import re
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from flaxlm.checkpoints.data_state import (
    SUBDIR,
    DataIteratorMismatchError,
    DatasetArgs,
    check_dataset_state,
)
from flaxlm.parallel.pytrees import path_name

# An unreadable step directory is renamed `{step}.unreadable`: orbax's step names are bare
# numbers (`^(0|[1-9]\d*)$`; its legacy test, digits or `*_digits`) and its temporary ones
# hold `.orbax-checkpoint-tmp`, so it neither lists, restores, garbage-collects nor cleans
# up such a directory, and the step can be saved again.
UNREADABLE_SUFFIX = ".unreadable"
# orbax's replica-parallel save (its default off GPU) has each replica of a replicated array
# write a slice of it, cut on its device by a program compiled per array shape and replica.
# That spreads the writing over the hosts holding the replicas; in one process the same host
# writes the same bytes either way, after those compiles (72 for the tiny test model on 8
# data-parallel devices). So: only with several processes, and only for slices of at least
# this many bytes (smaller ones are written faster than a program compiles).
REPLICA_PARALLEL_MIN_SLICE_BYTES = 1 << 20


class CheckpointMismatchError(ValueError):
    """A checkpoint written for a model of another shape (or holding params only) than the
    one being restored."""


class NoReadableCheckpointError(ValueError):
    """Checkpoints exist but none of them can be read."""


def _scan_hint(saved: Any, wanted: Any) -> str:
    """A sentence naming `scan_layers` where one side's layers are a scanned stack
    (`layers/block/...`, a cycle's `layers/block_j/...`) and the other's are not: the rest of
    the mismatch follows from it."""

    theirs, ours = (
        any(re.match(r"[a-z]+/block(_\d+)?/", n) for n in names) for names in (saved, wanted)
    )
    if theirs == ours:
        return ""
    return (
        f" The checkpoint's layers are {'scanned' if theirs else 'unrolled'}, this model's "
        f"{'scanned' if ours else 'unrolled'}: set scan_layers={theirs} on the model's config "
        "(the DeepSeek-V3, Kimi K2 and GLM-4.5/4.6 gin files scan their MoE layers since "
        "2026-12-05, the Qwen3-Next, Qwen3.5, Llama 4 Maverick, Kimi Linear, DeepSeek-V4 and "
        "Gemma 4 31B / 26B-A4B ones their layers' cycles and the DeepSeek-V3.2 and GLM-5 "
        "ones their MoE layers since 2026-12-06)."
    )


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_name(path): tuple(leaf.shape) for path, leaf in leaves}


def _short_reason(error: BaseException, limit: int = 200) -> str:
    """`Type: first line` of the error's root cause (TensorStore's errors wrap a one-line
    cause in 60 lines of spec), cut to `limit` characters."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


# The step directories `restore_latest` has read in this process. A restore that fails
# leaves its other array reads running (TensorStore's threads, orbax's event loop, closed
# since); their errors name the directory they read.
_READ_DIRS: set[str] = set()


def _is_abandoned_read(error: BaseException | None, obj: Any = None) -> bool:
    """Whether an error Python would print as "ignored" comes from the array reads of a
    restore that already failed: orbax's read coroutines, collected with their error,
    TensorStore's callbacks into their event loop, closed since, and its reads' own errors
    (a future nobody retrieved, naming a step directory read)."""
    if isinstance(obj, types.CoroutineType) and "orbax" in obj.cr_code.co_filename:
        return True
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    text = str(error)
    if "Encountered error while reading array index" in text:
        return True
    return "Error reading" in text and any(d in text for d in _READ_DIRS)


def quiet_abandoned_reads(step_dir: str) -> None:
    """Before `step_dir` is read: the errors of a failed restore's other array reads (one
    traceback of ~60 lines of TensorStore spec each, a hundred or more, some printed from
    TensorStore's threads before the restore's own error reaches its caller, many after the
    run has finished) are not printed: the fallback's warning says what was wrong. Any
    other error still is."""
    _READ_DIRS.add(step_dir)
    if getattr(sys.unraisablehook, "flaxlm_quiet", False):
        return
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def unraisablehook(info: Any) -> None:
        if not _is_abandoned_read(info.exc_value, info.object):
            unraisable(info)

    def quiet_excepthook(kind: type, error: BaseException, tb: Any) -> None:
        if not _is_abandoned_read(error):
            excepthook(kind, error, tb)

    thread_hook = threading.excepthook

    def quiet_thread_hook(args: Any) -> None:  # a read's error in orbax's own thread
        if not _is_abandoned_read(args.exc_value):
            thread_hook(args)

    unraisablehook.flaxlm_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook, sys.excepthook = unraisablehook, quiet_excepthook
    threading.excepthook = quiet_thread_hook
    # asyncio reports a read task whose error nobody retrieved through its logger.
    std_logging.getLogger("asyncio").addFilter(_AbandonedReadFilter())


class _AbandonedReadFilter(std_logging.Filter):
    """Drops the asyncio logger's records of a failed restore's abandoned reads."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        context = getattr(record, "msg", "")
        return not (_is_abandoned_read(error) or "Encountered error while reading" in str(context))


@functools.cache
def _register_array_handler(process_count: int) -> None:
    """orbax's handler of `jax.Array`s as its registry has it, with replica-parallel saving
    where it pays (`REPLICA_PARALLEL_MIN_SLICE_BYTES`). The files are the same either way."""
    from orbax.checkpoint._src.metadata import array_metadata_store

    ocp.type_handlers.register_type_handler(
        jax.Array,
        ocp.type_handlers.ArrayHandler(
            array_metadata_store=array_metadata_store.Store(),
            use_replica_parallel=None if process_count > 1 else False,  # None: orbax's
            min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_SLICE_BYTES,
        ),
        override=True,
    )


class Checkpointer:
    """Train state + data iterator + operative config under `model_dir/checkpoints`."""

    def __init__(
        self,
        model_dir: str,
        *,
        keep: int | None = 3,
        keep_period: int | None = None,
        async_save: bool = True,
    ):
        """
        Args:
          keep: how many of the newest checkpoints to keep (None keeps all).
          keep_period: also keep every checkpoint whose step is a multiple of this.
          async_save: write array data in a background thread.
        """
        self.directory = epath.Path(model_dir) / SUBDIR
        _register_array_handler(jax.process_count())
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            keep_period=keep_period,
            enable_async_checkpointing=async_save,
            create=True,
            # A save killed before its commit leaves a `*.orbax-checkpoint-tmp*` directory
            # that no restore considers; remove it on the next start.
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "dataset", "config", "params")
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, data_iterator: Any | None, config: str) -> bool:
        items = {
            "state": ocp.args.StandardSave(state),
            "config": ocp.args.JsonSave({"operative_config": config}),
        }
        if data_iterator is not None:
            items["dataset"] = DatasetArgs(data_iterator)
        return self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def save_params(self, step: int, params: Any) -> bool:
        """A params-only checkpoint (an import): training from it starts a fresh optimizer."""
        return self._manager.save(
            step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)), force=True
        )

    def is_params_only(self, step: int) -> bool:
        step_dir = self.directory / str(step)
        return (step_dir / "params").exists() and not (step_dir / "state").exists()

    def saved_param_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
        """`{'path/to/param': shape}` as recorded in the checkpoint's metadata."""
        item = "params" if self.is_params_only(step) else "state"
        meta = ocp.PyTreeCheckpointHandler().metadata(self.directory / str(step) / item)
        tree = meta.tree if hasattr(meta, "tree") else meta
        if item == "state":
            tree = tree["params"]
        return _shapes(tree)

    def _check_shapes(
        self, step: int, saved: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]]
    ) -> None:
        """Raises CheckpointMismatchError naming the params whose shapes differ."""
        if saved == wanted:
            return
        problems = [
            f"{name}: {saved[name]} in the checkpoint, {wanted[name]} in this model"
            for name in sorted(saved.keys() & wanted.keys())
            if saved[name] != wanted[name]
        ]
        problems += [f"{n}: only in the checkpoint" for n in sorted(saved.keys() - wanted.keys())]
        problems += [f"{n}: only in this model" for n in sorted(wanted.keys() - saved.keys())]
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointMismatchError(
            f"Checkpoint {self.directory}/{step} was written for a different model: "
            + "; ".join(problems[:5])
            + f"{more}. Use a new MODEL_DIR, or the model configuration the checkpoint was "
            "trained with (its config.gin)." + _scan_hint(saved, wanted)
        )

    def restore(
        self,
        step: int,
        abstract_state: Any,
        data_iterator: Any | None = None,
        from_params: Callable[[Any], Any] | None = None,
    ) -> Any:
        """Restores `step` onto the shardings carried by `abstract_state` (ShapeDtypeStructs).

        A params-only checkpoint becomes a state through `from_params(params)`.
        """
        if self.is_params_only(step):
            if from_params is None:
                raise CheckpointMismatchError(
                    f"{self.directory}/{step} holds params only, not a train state."
                )
            return from_params(self.restore_params(step, abstract_state.params))
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        # A checkpoint without an iterator position starts the data from the beginning.
        dataset_dir = self.directory / str(step) / "dataset"
        if data_iterator is not None and dataset_dir.exists():
            check_dataset_state(dataset_dir, data_iterator)
            items["dataset"] = DatasetArgs(data_iterator)
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        return restored["state"]

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only the params at `step` (of a train state or a params-only checkpoint)."""
        if self.is_params_only(step):
            args = ocp.args.StandardRestore(abstract_params)
            return self._manager.restore(step, args=ocp.args.Composite(params=args))["params"]
        args = ocp.args.PyTreeRestore(
            item={"params": abstract_params},
            restore_args=ocp.checkpoint_utils.construct_restore_args({"params": abstract_params}),
            partial_restore=True,
        )
        restored = self._manager.restore(step, args=ocp.args.Composite(state=args))
        return restored["state"]["params"]

    def restore_latest(
        self,
        abstract_state: Any,
        data_iterator: Any | None = None,
        from_params: Callable[[Any], Any] | None = None,
    ) -> tuple[int | None, Any]:
        """The newest readable checkpoint. Newer unreadable ones are set aside (renamed
        `{step}.unreadable`, named in a warning) so that their steps can be saved again.

        A checkpoint of another model or input-shard count is an error, not a fallback; so
        is having checkpoints of which none can be read (then nothing is moved).
        """
        unreadable: list[tuple[int, Exception]] = []

        def note(step: int, e: Exception) -> None:
            # The whole text (TensorStore's run to 60 lines) under --verbosity; the terminal
            # gets one line from `_set_aside` or NoReadableCheckpointError.
            logging.warning("Checkpoint at step %d could not be read (%s).", step, e)
            unreadable.append((step, e))

        for step in sorted(self.all_steps(), reverse=True):
            quiet_abandoned_reads(str(self.directory / str(step)))
            try:
                saved = self.saved_param_shapes(step)
            except Exception as e:  # noqa: BLE001 - report and try the previous one
                note(step, e)
                continue
            self._check_shapes(step, saved, _shapes(abstract_state.params))
            try:
                state = self.restore(step, abstract_state, data_iterator, from_params)
            except (CheckpointMismatchError, DataIteratorMismatchError):
                raise  # not about this checkpoint's content: an older one has it too
            except Exception as e:  # noqa: BLE001 - report and try the previous one
                note(step, e)
                continue
            self._set_aside(unreadable, step)
            return step, state
        if unreadable:
            reasons = "; ".join(f"step {step}: {_short_reason(e)}" for step, e in unreadable)
            raise NoReadableCheckpointError(
                f"No checkpoint under {self.directory} could be read ({reasons}); refusing "
                "to train from scratch over them. Move them away to start over."
            )
        return None, None

    def _unreadable_path(self, step: int) -> epath.Path:
        """`{step}.unreadable`, or `{step}.unreadable-{n}` if a former one is there."""
        path, n = self.directory / f"{step}{UNREADABLE_SUFFIX}", 1
        while path.exists():
            n += 1
            path = self.directory / f"{step}{UNREADABLE_SUFFIX}-{n}"
        return path

    def _set_aside(self, unreadable: list[tuple[int, Exception]], restored: int) -> None:
        """Renames the `unreadable` steps' directories (newer than `restored`) out of orbax's
        sight, kept for inspection; one warning line each. With several processes, first
        checks that all of them found the same."""
        moves = [(step, self._unreadable_path(step), e) for step, e in unreadable]
        found = f"restored step {restored}, could not read {[s for s, _, _ in moves]}"
        multiprocess = jax.process_count() > 1
        if multiprocess:
            # Every process has finished reading. Each reads only its own shards, so a damaged
            # file can fail some of them: a barrier named by what each found stops all, before
            # anything is renamed or trained from two different steps.
            try:
                multihost_utils.sync_global_devices(f"flaxlm checkpoint {found}")
            except AssertionError as e:
                raise ValueError(
                    f"The processes read different checkpoints under {self.directory}: this "
                    f"one {found}. Move the damaged checkpoint away and run again."
                ) from e
        if not moves:
            return
        if jax.process_index() == 0:
            for step, target, _ in moves:
                (self.directory / str(step)).rename(target)
        if multiprocess:
            multihost_utils.sync_global_devices(f"flaxlm checkpoints set aside, {found}")
        self._manager.reload()  # orbax's cached step list still holds them: a save would fail
        for step, target, e in moves:
            print(
                f"WARNING: checkpoint {self.directory}/{step} could not be read "
                f"({_short_reason(e)}); moved it to {target} and fell back to step {restored}.",
                flush=True,
            )

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        # orbax starts a thread cleaning up temporary directories when the manager opens, and
        # its close() does not wait for it: a run failing early (bad input) then exited under
        # it, and the thread printed a traceback at interpreter shutdown. Wait for it here.
        await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:
            await_cleanup()
        self._manager.close()
