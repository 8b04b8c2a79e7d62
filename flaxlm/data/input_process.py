"""The input pipeline in a process of its own: a run that has not loaded TensorFlow reads its
data through a child process (`python -m flaxlm.data.input_process`) that has.

Importing TensorFlow, tensorflow_text and seqio and building a task's tf.data pipeline is
~3-4 s of Python on one core, which in the run's own process waits for the GIL beside JAX's
tracing and its state's set-up (and they for it). In a process of its own it runs on another
core from the run's first second, and the run never imports TensorFlow: gin files bind
`config.DatasetConfig`, and the batches' shapes come from the model (`batch_shapes.py`) or
the input process's answer. grain's worker processes (MaxText's input pipeline) are the same
idea; here one process reads all of a host's logical shards (`pipeline.HostReader`), and
only the run's process touches JAX's devices.

The child answers requests in order over its stdin and stdout (pickled, length-prefixed):
build an iterator of a `DatasetConfig` for a host's rows (its answer: the model features'
lengths and dtypes), its next rows as numpy, reset it, write or read its shards' positions
in a checkpoint's dataset directory (tf.data's own checkpoints, the files an in-process
run writes). It reads ahead only as tf.data does (its own prefetch is part of the
checkpointed state), so a position saved after step k is the one step k+1 reads from,
as in one process. It ignores SIGINT and SIGTERM (the run saves on them, its data position
included; a terminal's Ctrl-C does not reach its process group) and exits when the run
closes its stdin, or ends (quietly, also after a `kill -9` of the run). A bad configuration
it finds comes back as the same ValueError the run would have raised itself; any other
error as a RuntimeError naming the child's exception and message on its first line.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from flaxlm.data import config, library_start
from flaxlm.data.config import DatasetConfig

if TYPE_CHECKING:  # (the child never loads JAX: its batches are numpy)
    import jax

    from flaxlm.parallel.partitioning import Partitioner

_HEADER = struct.Struct("<Q")
# Exceptions that come back as themselves (a run turns them into an `error:` line, exit 2);
# anything else is a RuntimeError carrying the child's traceback.
_USER_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


def _pack(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _send(stream: BinaryIO, message: Any) -> None:
    stream.write(_pack(message))
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


class InputProcess:
    """The child process that reads a run's data, and the requests to it (`request` sends,
    `reply` waits for that request's answer; answers come in order). Thread-safe: a
    checkpoint's save may ask from another thread than the loop's."""

    def __init__(self, quiet: bool = False):
        env = dict(os.environ)
        # It imports what the run would (the run's sys.path: its working directory, -m).
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "flaxlm.data.input_process", f"--run_pid={os.getpid()}"]
            + (["--quiet"] if quiet else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            # A process group of its own: a terminal's Ctrl-C (sent to the run's group)
            # reaches the run alone, also while this process still imports (before it
            # ignores SIGINT), and the run says what the stop does.
            process_group=0,
        )
        self._lock = threading.Lock()
        self._sent = 0
        self._received = 0
        self._replies: dict[int, Any] = {}
        self._keys = 0

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    def request(self, *message: Any) -> int:
        """Sends `message`; returns the ticket `reply` takes."""
        with self._lock:
            try:
                _send(self._proc.stdin, message)  # type: ignore[arg-type]
            except (BrokenPipeError, OSError):
                raise self._exited() from None
            self._sent += 1
            return self._sent

    def reply(self, ticket: int) -> Any:
        """The answer to request `ticket`; what the child raised, raised again."""
        with self._lock:
            while ticket not in self._replies:
                try:
                    answer = _receive(self._proc.stdout)  # type: ignore[arg-type]
                except EOFError:
                    raise self._exited() from None
                self._received += 1
                self._replies[self._received] = answer
            status, *value = self._replies.pop(ticket)
        if status == "ok":
            return value[0]
        kind, message, trace = value
        if kind in _USER_ERRORS:
            raise _USER_ERRORS[kind](message)
        # The cause on the first line: a one-line report of the error (a checkpoint's
        # "could not be read (...)") names it; the child's traceback follows.
        first = next((line for line in message.splitlines() if line.strip()), "")
        cause = f"{kind}: {first}" if first else kind
        raise RuntimeError(f"The input process failed: {cause}\n{trace}")

    def call(self, *message: Any) -> Any:
        return self.reply(self.request(*message))

    def new_key(self) -> int:
        self._keys += 1
        return self._keys

    def _exited(self) -> RuntimeError:
        code = self._proc.wait(timeout=30)
        return RuntimeError(
            f"The input process (pid {self._proc.pid}) exited with code {code} "
            "(its own lines above say why)."
        )

    def kill(self) -> None:
        """Ends the child at once (it holds nothing of the run's yet)."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def close(self) -> None:
        """Ends the child: closes its stdin, waits for it (killed after 30 s)."""
        if self._proc.poll() is not None:
            return
        try:
            self._proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class RemoteDataIterator:
    """A `pipeline.DataIterator` whose rows the input process reads: global batches on the
    mesh, checkpointable per logical shard (`write_state` / `read_state`, done by the
    child), its wait on the input counted in `wait_seconds`. `lazy`: the child builds it
    at its first use (an evaluation's data, as `deferred.DeferredDataIterator`), else at
    once (beside the run's set-up; `description` waits for it). `feature_lengths`: the
    model features' lengths where the run knows them already
    (`batch_shapes.model_feature_lengths`), which `feature_shapes` then gives at once."""

    def __init__(
        self,
        process: InputProcess,
        cfg: DatasetConfig,
        partitioner: Partitioner,
        converter: Any,
        *,
        lazy: bool = False,
        feature_lengths: Mapping[str, int] | None = None,
    ):
        import jax

        self._process = process
        self._cfg = cfg
        self._converter = converter
        self._partitioner = partitioner
        self._layout = partitioner.data_layout(cfg.batch_size)
        self._feature_lengths = None if feature_lengths is None else dict(feature_lengths)
        self.num_shards = config.input_shard_count(cfg, self._layout)
        self.input_shards = list(config.host_input_shards(cfg, self._layout))
        self.saved_shards = config.shards_saved_by(
            jax.process_index(), partitioner, cfg.batch_size, self.num_shards
        )
        self.wait_seconds = 0.0
        self._key = process.new_key()
        self._ticket: int | None = None
        self._description: dict[str, Any] | None = None
        self._checked: int | None = None
        if lazy:  # the task is looked up at once all the same (`check`)
            self._checked = process.request("check", cfg)
        else:
            self._create()

    def _create(self) -> None:
        if self._ticket is None:
            self._ticket = self._process.request(
                "create", self._key, self._cfg, self._layout, self._converter
            )

    def description(self) -> dict[str, Any]:
        """The child's answer to building the iterator (waited for): `feature_lengths`
        (`{model feature: length}`), `dtypes` (`{feature: numpy dtype name}`, or None where
        a feature is not a row of tokens) and `task_metrics` (whether the task has metric
        functions for its split)."""
        if self._description is None:
            self._create()
            self._description = self._process.reply(self._ticket)  # type: ignore[arg-type]
        return self._description

    def feature_shapes(self) -> tuple[dict[str, int], dict[str, str] | None]:
        """`(feature_lengths, dtypes)` of `description`: the run's own `feature_lengths`
        (the decoder's token rows, int32), if given, without waiting for the child."""
        if self._feature_lengths is not None:
            return self._feature_lengths, dict.fromkeys(self._feature_lengths, "int32")
        description = self.description()
        return description["feature_lengths"], description["dtypes"]

    def has_task_metrics(self) -> bool:
        """Whether the task has metric functions for its split (seqio's evaluator's)."""
        return self.description()["task_metrics"]

    def check(self) -> None:
        """Waits for the child's look-up of a lazy iterator's task: a misnamed one raised
        (before the first step, not at the first evaluation)."""
        if self._checked is not None:
            self._process.reply(self._checked)
            self._checked = None

    def next_numpy(self) -> dict[str, np.ndarray]:
        self.description()
        start = time.perf_counter()
        batch = self._process.call("next", self._key)
        self.wait_seconds += time.perf_counter() - start
        if batch is None:
            raise StopIteration
        return batch

    def to_global(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        return config.to_global(batch, self._partitioner, self._layout)

    def reset(self) -> None:
        self.description()
        self._process.call("reset", self._key)

    def write_state(self, directory: str) -> None:
        self.description()
        self._process.call("write_state", self._key, str(directory), sorted(self.saved_shards))

    def read_state(self, directory: str) -> None:
        self.description()
        self._process.call("read_state", self._key, str(directory))

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        return self.to_global(self.next_numpy())


def load_pipeline() -> types.ModuleType:
    """`flaxlm.data.pipeline` (seqio, tf.data), TensorFlow kept off the accelerators. A run
    whose process loads it after start-up (its Gin files load no seqio) keeps TensorFlow's
    C++ start-up lines off a quiet terminal, as `flaxlm.main`'s start-up does."""
    quiet = library_start.is_quiet() and "tensorflow" not in sys.modules
    with library_start.native_stderr_hidden(quiet):
        from flaxlm.data import pipeline

        pipeline.configure_tensorflow()
    return pipeline


_EARLY: list[InputProcess] = []


def start_early() -> None:
    """Starts the input process now (its imports then run beside the run's own), for the
    next `start` to take."""
    if not _EARLY:
        _EARLY.append(InputProcess(quiet=library_start.is_quiet()))


def discard_early() -> None:
    """Ends the process `start_early` started (the run reads no data through it)."""
    while _EARLY:
        _EARLY.pop().kill()


def start() -> InputProcess:
    """The input process `start_early` started, else a new one."""
    return _EARLY.pop() if _EARLY else InputProcess(quiet=library_start.is_quiet())


# ---------------------------------------------------------------------------------------------
# The child.


class _Child:
    """The input process's requests (each a method of the same name)."""

    def __init__(self) -> None:
        from flaxlm.data import pipeline
        from flaxlm.models import batch_shapes

        pipeline.configure_tensorflow()
        self.pipeline = pipeline
        self.batch_shapes = batch_shapes
        self.readers: dict[int, Any] = {}

    def create(self, key: int, cfg: DatasetConfig, layout: Any, converter: Any) -> dict:
        pipeline = self.pipeline
        if isinstance(converter, str):  # "module:Class", as batch_shapes.ConverterClass
            # (read here, not through flaxlm.models, which imports every family)
            module, name = converter.split(":")
            converter = getattr(importlib.import_module(module), name)
        reader = pipeline.HostReader(pipeline.host_input(cfg, layout, converter))
        self.readers[key] = reader
        return {
            "feature_lengths": self.batch_shapes.model_feature_lengths(
                converter, cfg.task_feature_lengths, cfg.pack
            ),
            "dtypes": pipeline.batch_dtypes(cfg, converter),
            "task_metrics": pipeline.has_task_metrics(cfg),
        }

    def check(self, cfg: DatasetConfig) -> None:
        self.pipeline.import_task_module(cfg.module)
        self.pipeline.check_registered(cfg.mixture_or_task_name)

    def next(self, key: int) -> dict[str, np.ndarray] | None:
        try:
            return self.readers[key].next_numpy()
        except StopIteration:
            return None

    def reset(self, key: int) -> None:
        self.readers[key].reset()

    def write_state(self, key: int, directory: str, shards: list[int]) -> None:
        self.readers[key].write_state(directory, shards)

    def read_state(self, key: int, directory: str) -> None:
        self.readers[key].read_state(directory)


def serve(requests: BinaryIO, answers: BinaryIO, quiet: bool) -> None:
    """Answers `requests` until they end (the run closed them)."""
    library_start.configure(quiet)
    library_start.hide_while_tensorflow_loads()
    child: _Child | None = None
    failed: tuple[str, str, str] | None = None
    with library_start.native_stderr_hidden(quiet):
        try:
            child = _Child()
        except Exception as e:  # noqa: BLE001 - answered to each request
            failed = (type(e).__name__, str(e), traceback.format_exc())
    while True:
        try:
            op, *args = _receive(requests)
        except EOFError:
            return
        try:
            if child is None:
                answer = _pack(("error", *failed))
            else:
                answer = _pack(("ok", getattr(child, op)(*args)))
        except Exception as e:  # noqa: BLE001 - the run raises it again (also: no pickle)
            answer = _pack(_error(e))
        try:
            answers.write(answer)
            answers.flush()
        except BrokenPipeError:
            return  # the run has gone: nothing is left to answer, nor anyone to say it to


def _error(error: Exception) -> tuple[str, str, str, str]:
    """The answer that makes the run raise `error` again (type, message, traceback)."""
    return ("error", type(error).__name__, str(error), traceback.format_exc())


def _exit_when_orphaned(run_pid: int, period: float = 0.5) -> None:
    """Ends this process, quietly, once the run that started it has gone (a `kill -9`;
    then this process is no longer its child): a request it was busy with (importing
    TensorFlow, building a pipeline) has no one left to answer, nor this process anyone
    left to write for."""
    while os.getppid() == run_pid:
        time.sleep(period)
    library_start.exit_at_once(0)


def _main() -> None:
    # The run saves its data position on these; this process must live to write it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # (the run's pid from its command line: the run may have gone before this line runs)
    (run_pid,) = [int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--run_pid=")]
    threading.Thread(target=_exit_when_orphaned, args=(run_pid,), daemon=True).start()
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a task's print() stays off the pipe
    serve(sys.stdin.buffer, answers, quiet="--quiet" in sys.argv[1:])
    library_start.exit_at_once(0)  # (without TensorFlow's teardown)


if __name__ == "__main__":
    _main()
