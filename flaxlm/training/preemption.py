"""SIGTERM/SIGINT during training: save at the current step and stop; a second signal exits.

Schedulers (Kubernetes, Slurm, spot/preemptible VMs) send SIGTERM and allow a grace period;
Ctrl-C sends SIGINT. The first signal only sets a flag that the training loop reads between
steps, so the loop can finish the step, save, wait for the save to commit and exit cleanly. A
second signal means "now": the process exits at once without saving (the last committed
checkpoint stays the latest, as after a `kill -9`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType

import jax
import numpy as np

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionHandler:
    """Context manager that turns the first SIGTERM/SIGINT into a stop request.

    Only the main thread may install signal handlers; elsewhere (a run started from a worker
    thread) the handler installs nothing and `should_stop` reads False.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS):
        self._signals = signals
        self._previous: dict[signal.Signals, object] = {}
        self.received: signal.Signals | None = None

    def install(self) -> PreemptionHandler:
        """Takes over the signals (until `uninstall`)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self._signals:
                self._previous[sig] = signal.signal(sig, self._handle)
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
            # Write straight to the file descriptor: a buffered print may be mid-flush.
            os.write(2, f"\nReceived {sig.name} again: exiting now without saving.\n".encode())
            os._exit(128 + signum)
        self.received = sig
        print(
            f"\nReceived {sig.name}: saving a checkpoint after this step, then stopping "
            f"(send {sig.name} again to exit at once, without saving).",
            file=sys.stderr,
            flush=True,
        )

    def should_stop(self) -> bool:
        """True once any process got a signal; all processes agree on the step they stop at."""
        local = self.received is not None
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(local, np.int32))
        return bool(np.any(flags))
