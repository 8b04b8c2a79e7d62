"""Where the seconds before the first step go: the table `--profile_startup` prints.

A timeline of marks from the process's start (interpreter, imports, Gin, the run's set-up,
its first batch, its first step) and, beside it, what those seconds were spent on: the first
import of each heavy library (TensorFlow, seqio, transformers, JAX, Flax, ...; each without
the others it imports), the datasets' and the state's set-up, and every XLA compilation (from
JAX's own monitoring events and log records: traced, lowered, compiled or read from the
persistent compilation cache). Nothing here changes what the run computes; the first step is
waited for, so its time is the step's and not its dispatch's.
"""

from __future__ import annotations

import builtins
import importlib.abc
import inspect
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# Top-level packages whose first import is timed (each without the watched ones it imports).
WATCHED_IMPORTS = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax",
    "tensorflow",
    "tensorflow_text",
    "keras",
    "sklearn",
    "seqio",
    "transformers",
    "torch",
)
# JAX's monitoring events (jax._src.dispatch and jax._src.compiler name them).
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"  # a cache read included
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_COMPILED_NAME = re.compile(r"Finished XLA compilation of (.+) in ([\d.e-]+) sec")


def process_start_time() -> float:
    """The wall-clock time this process started (Linux's /proc, to 10 ms), else now."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        return time.time() - (uptime - started_after_boot)
    except (OSError, ValueError, IndexError):
        return time.time()


class _CompileLog(logging.Handler):
    """Collects the names of the programs JAX compiles (its 'Finished XLA compilation' line)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = _COMPILED_NAME.match(record.getMessage())
        if match:
            self.names.append(match.group(1))


class StartupProfile:
    """Marks on a timeline from the process's start, and the time spent by category."""

    def __init__(self) -> None:
        self.start = process_start_time()
        self.last = self.start
        self.rows: list[tuple[str, float]] = []
        self.imports: dict[str, float] = {}
        self.spent: dict[str, float] = {}
        self.jax_seconds: dict[str, float] = {}
        self.jax_counts: dict[str, int] = {}
        self.compile_log = _CompileLog()
        self.printed = False

    def mark(self, label: str) -> None:
        """Ends a row of the timeline: the seconds since the previous mark."""
        now = time.time()
        self.rows.append((label, now - self.last))
        self.last = now

    def time_imports(self) -> None:
        """Times the first import of each of WATCHED_IMPORTS from now on."""
        original = builtins.__import__
        nested: list[float] = []

        def timed_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002
            top = name.partition(".")[0]
            if level or top not in WATCHED_IMPORTS or top in sys.modules:
                return original(name, globals, locals, fromlist, level)
            nested.append(0.0)
            start = time.perf_counter()
            try:
                return original(name, globals, locals, fromlist, level)
            finally:
                total = time.perf_counter() - start
                inner = nested.pop()
                self.imports[top] = self.imports.get(top, 0.0) + total - inner
                if nested:
                    nested[-1] += total

        builtins.__import__ = timed_import

    def watch_jax(self) -> None:
        """Counts and times JAX's tracing, lowering, compiling and persistent-cache hits."""
        from jax import monitoring

        def on_duration(event: str, seconds: float, **_: Any) -> None:
            if event in (_TRACE, _LOWER, _COMPILE):
                self.jax_seconds[event] = self.jax_seconds.get(event, 0.0) + seconds
                self.jax_counts[event] = self.jax_counts.get(event, 0) + 1

        def on_event(event: str, **_: Any) -> None:
            if event == _CACHE_HIT:
                self.jax_counts[event] = self.jax_counts.get(event, 0) + 1

        monitoring.register_event_duration_secs_listener(on_duration)
        monitoring.register_event_listener(on_event)
        dispatch_log = logging.getLogger("jax._src.dispatch")
        dispatch_log.addHandler(self.compile_log)
        if dispatch_log.getEffectiveLevel() > logging.DEBUG:
            # Its DEBUG records reach this handler only; the terminal's handlers sit on the
            # root logger, which they would otherwise propagate to.
            dispatch_log.setLevel(logging.DEBUG)
            dispatch_log.propagate = False

    def timed(self, owner: Any, attr: str, category: str) -> None:
        """Adds the time of every call of `owner.attr` to `category` (if it exists)."""
        fn = inspect.getattr_static(owner, attr, None)
        if fn is None:
            return
        is_classmethod = isinstance(fn, classmethod)
        inner = fn.__func__ if is_classmethod else fn

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[category] = self.spent.get(category, 0.0) + (time.perf_counter() - start)

        setattr(owner, attr, classmethod(wrapper) if is_classmethod else wrapper)

    def around_first_step(self, owner: Any, attr: str) -> None:
        """Wraps the step loop `owner.attr(..., train_step=, next_batch=, ...)`: marks the
        set-up's end, the first batch and the first step (waited for), then prints."""
        run_steps = getattr(owner, attr, None)
        if run_steps is None:
            return
        signature = inspect.signature(run_steps)
        profile = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            train_step = bound.arguments["train_step"]
            next_batch = bound.arguments["next_batch"]
            first = {"batch": True, "step": True}

            def batch(step: int) -> Any:
                if not first["batch"]:
                    return next_batch(step)
                first["batch"] = False
                profile.mark("run set-up (checks, datasets, state, restore)")
                out = next_batch(step)
                profile.mark("first batch")
                return out

            def step(*step_args: Any) -> Any:
                if not first["step"]:
                    return train_step(*step_args)
                first["step"] = False
                import jax

                out = jax.block_until_ready(train_step(*step_args))
                profile.mark("first step (compile + run)")
                profile.print_table()
                return out

            bound.arguments["train_step"] = step
            bound.arguments["next_batch"] = batch
            return run_steps(*bound.args, **bound.kwargs)

        setattr(owner, attr, wrapper)

    def print_table(self) -> None:
        """The timeline and the breakdown, to stdout (once)."""
        if self.printed:
            return
        self.printed = True
        lines = ["", "Start-up profile (seconds from the process's start):"]
        total = 0.0
        for label, seconds in self.rows:
            total += seconds
            lines.append(f"  {label:<52} {seconds:7.2f} {total:8.2f}")
        lines.append("Of which:")
        for name, seconds in sorted(self.imports.items(), key=lambda kv: -kv[1]):
            if seconds >= 0.01:
                lines.append(f"  import {name:<45} {seconds:7.2f}")
        for category, seconds in self.spent.items():
            lines.append(f"  {category:<52} {seconds:7.2f}")
        hits = self.jax_counts.get(_CACHE_HIT, 0)
        for event, label in (
            (_TRACE, "JAX trace"),
            (_LOWER, "JAX lower to StableHLO"),
            (_COMPILE, f"XLA compile ({hits} read from the cache instead)"),
        ):
            label = f"{label}, {self.jax_counts.get(event, 0)}x"
            lines.append(f"  {label:<52} {self.jax_seconds.get(event, 0.0):7.2f}")
        if self.compile_log.names:
            lines.append(f"  programs: {', '.join(self.compile_log.names)}")
        print("\n".join(lines) + "\n", flush=True)

    def compile_summary(self) -> str:
        """One line: how many programs the whole process compiled, how many it read from
        the persistent compilation cache instead."""
        compiles = self.jax_counts.get(_COMPILE, 0)
        hits = self.jax_counts.get(_CACHE_HIT, 0)
        return (
            f"XLA programs: {compiles} ({hits} read from the persistent compilation cache, "
            f"{compiles - hits} compiled)."
        )


def instrument_run(profile: StartupProfile, modules: list[Any]) -> None:
    """Times the run's set-up seams in `modules` (those they have): task registration,
    dataset build, state init or restore, a checkpoint's load for inference, and the step
    loop's first batch and step."""
    for module in dict.fromkeys(modules):
        if hasattr(module, "import_task_module"):
            profile.timed(module, "import_task_module", "task registration (import_task_module)")
        if hasattr(module, "DataIterator"):
            profile.timed(module.DataIterator, "create", "dataset build (DataIterator.create)")
        if hasattr(module, "load_model_and_params"):
            profile.timed(
                module, "load_model_and_params", "checkpoint load (load_model_and_params)"
            )
        if hasattr(module, "initial_state"):
            profile.timed(module, "initial_state", "state: init or restore (initial_state)")
        if hasattr(module, "run_steps"):
            profile.around_first_step(module, "run_steps")


# Functions that call code with a bare `except:` around it, logging what they catch with its
# traceback: an exception raised at an import under them would be swallowed and printed, not
# end the start-up. JAX's plugin discovery calls each installed plugin's `initialize()` so
# (the CUDA plugin imports NVIDIA's packages there, with or without a GPU).
_SWALLOWING_CALLERS = frozenset({("jax._src.xla_bridge", "discover_pjrt_plugins")})


def _under_swallowing_caller(frame: Any) -> bool:
    while frame is not None:
        key = (frame.f_globals.get("__name__"), frame.f_code.co_name)
        if key in _SWALLOWING_CALLERS:
            return True
        frame = frame.f_back
    return False


class BeforeEachImport(importlib.abc.MetaPathFinder):
    """An import hook: `check()` runs before each module the main thread imports (or looks
    up), and may raise to end the start-up there: the exception unwinds as a failed
    import's does. Finds nothing itself; other threads' imports pass unchecked. Under a
    caller that would swallow the exception (JAX's plugin discovery), it is not raised
    there: the next import outside raises it."""

    def __init__(self, check: Callable[[], None]):
        self.check = check

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if threading.current_thread() is threading.main_thread():
            try:
                self.check()
            except BaseException:
                if not _under_swallowing_caller(sys._getframe(1)):
                    raise
        return None

    def install(self) -> None:
        """Puts the hook first in `sys.meta_path`."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        """Takes the hook out of `sys.meta_path`."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)
