"""SIGTERM/SIGINT: stop at the next safe point, saving what a stop saves; a second one exits.

Schedulers (Kubernetes, Slurm, spot/preemptible VMs) send SIGTERM and allow a grace period;
Ctrl-C sends SIGINT. The first signal only records a stop request, read at the next safe
point: `flaxlm.main`'s checkpoints through start-up (it exits, nothing to save), the run's
set-up, and the training loop between steps (it finishes the step, saves, waits for the save
to commit and exits cleanly). Nothing is raised from the handler: a signal may arrive inside
a callback that drops exceptions (JAX's garbage-collector callback), where a raised
`SystemExit` would be lost and the run would go on. A second signal means "now": the process
exits at once without saving (the last committed checkpoint stays the latest, as after a
`kill -9`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType

from flaxlm.data import library_start

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _write_stderr(text: str) -> None:
    """Writes straight to stderr's file descriptor: a buffered print may be mid-flush in the
    code the signal interrupted (and raise a reentrant-call error)."""
    try:
        fd = sys.stderr.fileno()  # (the terminal, also while flaxlm hides fd 2's C++ lines)
    except (AttributeError, OSError, ValueError):
        fd = 2
    os.write(fd, text.encode())


class PreemptionHandler:
    """Context manager that turns the first SIGTERM/SIGINT into a stop request (`received`).

    A handler installed over another one takes its place: the stop the other was asked for
    is this one's too (`flaxlm.main`'s during start-up, before the run took the signals),
    and `uninstall` gives the signals back to the handlers the other had replaced.

    Only the main thread may install signal handlers; elsewhere (a run started from a worker
    thread) the handler installs nothing and `should_stop` reads False.

    Args:
      signals: the signals taken over.
      announce: say on the first signal that the run saves, then stops (flaxlm.main's
        start-up handler says what it does when it acts on the request).
    """

    def __init__(
        self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS, announce: bool = True
    ):
        self._signals = signals
        self._announce = announce
        self._previous: dict[signal.Signals, object] = {}
        self.received: signal.Signals | None = None

    def install(self) -> PreemptionHandler:
        """Takes over the signals (until `uninstall`)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self._signals:
                previous = signal.signal(sig, self._handle)
                outer = getattr(previous, "__self__", None)
                if isinstance(outer, PreemptionHandler) and outer is not self:
                    self.received = self.received or outer.received
                    previous = outer._previous.pop(sig, signal.SIG_DFL)
                self._previous[sig] = previous
        return self

    def uninstall(self) -> None:
        """Gives the signals back to their previous handlers."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            _write_stderr(f"\nReceived {sig.name} again: exiting now without saving.\n")
            library_start.exit_at_once(128 + signum)
        self.received = sig
        if self._announce:
            _write_stderr(
                f"\nReceived {sig.name}: saving a checkpoint after this step, then stopping "
                f"(send {sig.name} again to exit at once, without saving).\n"
            )

    def should_stop(self) -> bool:
        """True once any process got a signal; all processes agree on the step they stop at."""
        local = self.received is not None
        # (imported here: flaxlm.main installs its handler before JAX loads, which is what
        # its first seconds are spent on)
        import jax

        if jax.process_count() == 1:
            return local
        import numpy as np
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(local, np.int32))
        return bool(np.any(flags))
