"""Input iterators that are not built where the run creates them: at their first use (an
evaluation's, `DeferredDataIterator`) or on a thread beside the run's set-up (the training
data's, `BackgroundDataIterator`; `on_thread`)."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from flaxlm.data.pipeline import (
    DataIterator,
    DatasetConfig,
    check_registered,
    import_task_module,
)
from flaxlm.parallel.partitioning import Partitioner


class DeferredDataIterator:
    """A `DataIterator` built at its first use (`reset` or `next`): an evaluation dataset's
    seqio set-up is paid at the first evaluation, not before the first training step. The
    task is checked at once, so a misnamed one still fails in seconds."""

    def __init__(self, cfg: DatasetConfig, partitioner: Partitioner, converter: Any = None):
        import_task_module(cfg.module)
        check_registered(cfg.mixture_or_task_name)
        self._create = functools.partial(DataIterator.create, cfg, partitioner, converter)
        self._iterator: DataIterator | None = None

    @property
    def iterator(self) -> DataIterator:
        if self._iterator is None:
            self._iterator = self._create()
        return self._iterator

    def reset(self) -> None:
        self.iterator.reset()

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        return next(self.iterator)


class BackgroundDataIterator(DeferredDataIterator):
    """A `DataIterator` built on a thread from now on: seqio's and tf.data's set-up (Python
    that builds graphs, AutoGraph) runs while the run initialises its state and compiles,
    which release the GIL. Its first use waits for it and raises what building it raised;
    `wait` waits without raising (before a failed run exits). The task is checked at once,
    as `DeferredDataIterator` does."""

    def __init__(self, cfg: DatasetConfig, partitioner: Partitioner, converter: Any = None):
        super().__init__(cfg, partitioner, converter)
        self._built = on_thread(self._create)

    @property
    def iterator(self) -> DataIterator:
        return self._built.result()

    def wait(self) -> None:
        concurrent.futures.wait([self._built])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.iterator, name)


def on_thread(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """`fn(*args)` started on a daemon thread; the future holds its result or what it
    raised."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # raised again by `future.result()`
            future.set_exception(e)

    threading.Thread(
        target=run, name=f"flaxlm-{getattr(fn, '__name__', 'set-up')}", daemon=True
    ).start()
    return future
