"""How the libraries start in a run's process and in its input process: quietly (what
reaches the terminal of `python -m flaxlm.main` is flaxlm's own lines unless asked), and
TensorFlow without the modules keras would import for nothing.

Both processes set this up before TensorFlow loads (`flaxlm.main`'s start-up, the input
process's `input_process.serve`), so it lives here, below both: the entry imports data/,
never the reverse.

Two kinds of output come from the libraries flaxlm uses, and each needs its own switch:

- C++ logs (TensorFlow, XLA, libtpu) write straight to file descriptor 2. TensorFlow's start-up
  lines ("oneDNN custom operations are on", "Could not find cuda drivers", "failed call to
  cuInit") are written while its libraries load, before `TF_CPP_MIN_LOG_LEVEL` takes effect,
  so `native_stderr_hidden` catches them at the descriptor while the libraries start; after
  that `TF_CPP_MIN_LOG_LEVEL=2` keeps their info and warnings out.
- Python logs (absl logging, which seqio and others use through `logging`; `warnings`) are
  filtered by level: errors still show.

flaxlm's own lines are `print`s (progress, evaluation, "Wrote to ...", `error: ...`), so none
of this hides them. absl's `--verbosity` flag (`-v`) turns all of it off: its level applies,
and the libraries' C++ logs print as they do without flaxlm.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import os
import sys
import tempfile
import types
from collections.abc import Iterator
from typing import Any, NoReturn

_QUIET = False


def configure(quiet: bool) -> None:
    """Sets the Python log levels, and the C++ log level for libraries not loaded yet.

    `quiet`: only errors from the libraries (absl verbosity ERROR, `warnings` routed into
    logging at WARNING, so hidden too); otherwise absl's `--verbosity` stands.
    """
    global _QUIET
    _QUIET = quiet
    if not quiet:
        return
    from absl import logging as absl_logging

    # Read by TensorFlow and XLA when they load: their info and warnings stay out of the log.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    absl_logging.set_verbosity(absl_logging.ERROR)
    logging.captureWarnings(True)


def is_quiet() -> bool:
    """Whether `configure` made the libraries quiet (a process this one starts does too)."""
    return _QUIET


@contextlib.contextmanager
def native_stderr_hidden(enabled: bool = True) -> Iterator[None]:
    """Sends what C++ code writes to stderr (file descriptor 2) to a temporary file.

    Python's `sys.stderr` and absl's log handler keep the terminal, so flaxlm's `error: ...`
    lines and the errors logging lets through still show. If the block raises (other than
    `SystemExit`, a usage error already explained), the hidden output is written out before
    the exception goes on: it may say why.
    """
    if not enabled:
        yield
        return
    from absl import logging as absl_logging

    sys.stderr.flush()
    terminal = os.dup(2)
    python_stderr = sys.stderr
    # absl's handler holds the stream it was made with (the old sys.stderr, i.e. fd 2).
    absl_handler = absl_logging.get_absl_handler().python_handler
    absl_stream = absl_handler.stream
    with tempfile.TemporaryFile() as hidden:
        os.dup2(hidden.fileno(), 2)
        # Left open: a library may keep it (JAX's log handlers take sys.stderr on import),
        # and it stays the terminal.
        sys.stderr = open(os.dup(terminal), "w", buffering=1, encoding="utf-8")
        if absl_stream is python_stderr:
            absl_handler.stream = sys.stderr
        try:
            yield
        except Exception:
            hidden.seek(0)
            data = hidden.read()
            while data:
                data = data[os.write(terminal, data) :]
            raise
        finally:
            sys.stderr.flush()
            sys.stderr = python_stderr
            absl_handler.stream = absl_stream
            os.dup2(terminal, 2)
            os.close(terminal)


# Installed modules hidden while TensorFlow loads. keras (which TensorFlow imports, and
# tensorflow_text needs) imports scikit-learn, when it is there, for its scikit-learn
# wrappers alone (~1-1.5 s of every start that reads data), pandas for its DataFrame input
# adapter and scipy for sparse inputs (TensorFlow's legacy keras too; ~0.5 s together):
# classes and inputs flaxlm never uses. keras and TensorFlow guard each import and go
# without. They stay importable otherwise: a task module may use them.
HIDDEN_WHILE_TENSORFLOW_LOADS = ("sklearn", "pandas", "scipy")


@contextlib.contextmanager
def modules_hidden(names: tuple[str, ...]) -> Iterator[None]:
    """`import name` raises ImportError inside the block for each of `names` not yet imported
    (Python's own sys.modules convention), and works again after it."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, "") is None:
                del sys.modules[name]


class HiddenWhileLoading(importlib.abc.MetaPathFinder):
    """An import hook: the first import of `module`, whoever asks for it (a Gin file's
    import, a task module, seqio), runs with `hidden` hidden (`modules_hidden`). Finds
    nothing itself, and leaves `sys.meta_path` once `module` loads (not at a mere
    `importlib.util.find_spec`, which etils.epath makes to see whether TensorFlow is
    installed)."""

    def __init__(self, module: str, hidden: tuple[str, ...]):
        self.module = module
        self.hidden = hidden
        self._finding = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.module or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        hidden = self.hidden

        def exec_hidden(module: types.ModuleType) -> None:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            with modules_hidden(hidden):
                exec_module(module)

        spec.loader.exec_module = exec_hidden  # type: ignore[method-assign]
        return spec

    def install(self) -> None:
        """Puts the hook first in `sys.meta_path` (unless `module` is already imported)."""
        if self.module not in sys.modules and self not in sys.meta_path:
            sys.meta_path.insert(0, self)


def hide_while_tensorflow_loads() -> None:
    """Installs the hook that hides `HIDDEN_WHILE_TENSORFLOW_LOADS` while TensorFlow loads
    (in whichever process loads it: a run's, or its input process)."""
    HiddenWhileLoading("tensorflow", HIDDEN_WHILE_TENSORFLOW_LOADS).install()


# TensorFlow's autograph writes each Python function it converts (seqio's preprocessors, the
# tf.data maps) to a `__autograph_generated_file*.py` in the temporary directory, imports it
# as a module of that name and deletes the file in an atexit handler. A process that leaves
# through `os._exit` (a finished `flaxlm.main` run, an input process: no interpreter teardown)
# runs no atexit handler, so `exit_at_once` deletes them, or each run would leave its files in
# /tmp.
AUTOGRAPH_MODULE_PREFIX = "__autograph_generated_file"


def exit_at_once(code: int) -> NoReturn:
    """Ends the process without the interpreter's teardown (`os._exit`): its standard streams
    flushed and the source files TensorFlow's autograph generated deleted first (what its
    atexit handlers would have done)."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.startswith(AUTOGRAPH_MODULE_PREFIX) and path:
            with contextlib.suppress(OSError):
                os.remove(path)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (closed or replaced: nothing left to write)
            stream.flush()
    os._exit(code)
