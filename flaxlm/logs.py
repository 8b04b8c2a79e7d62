"""What reaches the terminal of `python -m flaxlm.main`: flaxlm's own lines unless asked.

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
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

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
