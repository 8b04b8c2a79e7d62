"""Entry point: `python -m flaxlm.main --gin_file=gin/gptj_pretrain.gin --gin.X=Y`.

Parses Gin files and overrides (their imports load the run's modules, and no others: an
`infer` never loads TensorFlow), joins the multi-process runtime when asked (or when the
cluster is one JAX detects), imports the task registry when the run reads data, and calls
the run function bound in Gin (`run.fn = @train`). A SIGTERM or SIGINT meanwhile is a stop
request, acted on at the start-up's next safe point (the next module imported, the steps
between) or handed to the run's own handler (`train`, `grpo`: they stop before the first
step); a mistake, a bad flag included, is one `error: ...` line and exit 2.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.abc
import importlib.util
import os
import platform
import re
import sys
import traceback

from absl import app, flags, logging

from flaxlm import gin_utils, startup
from flaxlm.data import library_start
from flaxlm.parallel import platforms
from flaxlm.training import preemption

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("gin_file", [], "Gin files to parse, in order (repeatable).")
flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings, e.g. 'TRAIN_STEPS = 10'.")
flags.DEFINE_list("gin_search_paths", [], "Extra directories to search for Gin files.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process).")
flags.DEFINE_integer("process_count", None, "Number of processes (multi-process).")
flags.DEFINE_integer("process_index", None, "This process's index (multi-process).")
flags.DEFINE_string("tasks_module", "tasks", "Module imported to register seqio tasks.")
flags.DEFINE_string(
    "compilation_cache_dir",
    None,
    "JAX's persistent compilation cache: compiled programs are kept here and reused by the "
    "next run. '' turns it off. Default: $JAX_COMPILATION_CACHE_DIR if set, else "
    "$XDG_CACHE_HOME/flaxlm/jax (~/.cache/flaxlm/jax), one folder per CPU kind.",
)
flags.DEFINE_bool(
    "profile_startup",
    False,
    "Print where the seconds from the process's start to the first step went (imports, Gin, "
    "task registration, datasets, state, compiles, first batch, first step).",
)

# The persistent cache's size in bytes when the user sets none: least recently used entries
# go first beyond it.
DEFAULT_CACHE_MAX_SIZE = 2 << 30


def _initialize_distributed() -> None:
    import jax

    explicit = [FLAGS.coordinator_address, FLAGS.process_count, FLAGS.process_index]
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            _fail("--coordinator_address, --process_count and --process_index go together.")
        problem = check_process_flags(
            FLAGS.coordinator_address, FLAGS.process_count, FLAGS.process_index
        )
        if problem:
            _fail(problem)
        # CPU processes exchange collectives over gloo (TPU/GPU ignore this setting).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=FLAGS.coordinator_address,
            num_processes=FLAGS.process_count,
            process_id=FLAGS.process_index,
        )
        return
    try:
        # Auto-detects TPU pods, Slurm, Open MPI, ...; a plain machine has nothing to join.
        # CPU processes exchange collectives over gloo (TPU/GPU ignore this setting).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize()
    except (ValueError, RuntimeError):
        pass


# The run that reads its data in an input process of its own (data/input_process.py).
TRAIN_RUN = "flaxlm.runs.train.train"
# The runs that take SIGTERM and SIGINT over (`preemption.PreemptionHandler`: they save, then
# stop): a stop asked for between the end of start-up and their handler's install is theirs.
RUNS_THAT_SAVE_ON_SIGNALS = (TRAIN_RUN, "flaxlm.runs.grpo.grpo")

# Imported when the Gin files name a configurable that their own imports have not
# registered (a file without `from __gin__ import dynamic_registration`, a binding of a
# module no file imports): every run's configurables (`train.train`, `infer.infer`, the
# model families, ...). The ready-to-run files import what they use, so a run loads only
# its own modules: `infer` and `serve` never load the training input pipeline.
REGISTERING_MODULES = (
    "flaxlm.models",
    "flaxlm.data.config",
    "flaxlm.data.pipeline",
    "flaxlm.plan.planner",
    "flaxlm.runs.convert",
    "flaxlm.runs.evaluate",
    "flaxlm.runs.infer",
    "flaxlm.runs.serve",
    "flaxlm.runs.train",
)


def check_process_flags(address: str, count: int, index: int) -> str | None:
    """What is wrong with the multi-process flags, if anything, checked before
    `jax.distributed.initialize` (which crashes on some malformed addresses)."""
    host, colon, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [IPv6]:port
    if not colon or not host or any(c.isspace() or c in "/[]" for c in host):
        return (
            f"--coordinator_address={address!r} must be HOST:PORT of process 0, e.g. "
            "10.0.0.1:1234 (a port is required)."
        )
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return (
            f"--coordinator_address={address!r}: the port {port!r} must be a number from 1 "
            "to 65535, e.g. 10.0.0.1:1234."
        )
    if count < 1:
        return f"--process_count={count} must be at least 1."
    if not 0 <= index < count:
        return f"--process_index={index} must be between 0 and --process_count - 1 = {count - 1}."
    return None


def host_kind() -> str:
    """A short name for this host's CPU kind: its architecture and a hash of its model and
    instruction-set features. A compiled CPU program may use any feature of the CPU it was
    compiled on, and JAX's cache key does not say which; a home directory shared by machines
    of several kinds keeps one cache folder per kind."""
    model = features = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "CPU part") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not features:
                    features = " ".join(sorted(value.split()))
    except OSError:
        model = platform.processor()
    digest = hashlib.sha256(f"{model}|{features}".encode()).hexdigest()[:12]
    return f"{platform.machine() or 'unknown'}-{digest}"


def compilation_cache_dir(flag: str | None, environ: dict[str, str]) -> str | None:
    """Where JAX's persistent compilation cache lives (None: off): `--compilation_cache_dir`
    ('' for off), else `JAX_COMPILATION_CACHE_DIR`, else the user's cache directory."""
    if flag is not None:
        return flag or None
    if "JAX_COMPILATION_CACHE_DIR" in environ:
        return environ["JAX_COMPILATION_CACHE_DIR"] or None
    cache_home = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "flaxlm", "jax", host_kind())


def enable_compilation_cache(directory: str | None) -> None:
    """Points JAX's persistent compilation cache at `directory` (None: turns it off),
    caching every program, however small or quick to compile, unless the user's
    `JAX_PERSISTENT_CACHE_*` variables say otherwise. An entry written by another jax or
    jaxlib version, backend or set of XLA flags has another key (JAX hashes them into it),
    and an unreadable one is a miss (JAX warns and compiles): neither is an error. A
    directory that cannot be written leaves the cache off."""
    import jax

    if directory is not None:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError:
            directory = None
    if directory is None or not os.access(directory, os.W_OK):
        jax.config.update("jax_enable_compilation_cache", False)
        return
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ and importlib.util.find_spec("filelock"):
        # With a size limit JAX also locks the entries it writes: several runs at once (the
        # tests' workers, a sweep) never read a half-written one.
        jax.config.update("jax_compilation_cache_max_size", DEFAULT_CACHE_MAX_SIZE)


def _multiprocess() -> bool:
    if "jax" not in sys.modules:  # (no JAX loaded: no runtime joined, none to load for it)
        return False
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if "flaxlm.data.input_process" in sys.modules:  # an input process no run took ends too
        sys.modules["flaxlm.data.input_process"].discard_early()
    if _multiprocess():
        # A normal exit waits at jax.distributed's shutdown barrier for peers that are
        # themselves blocked in a collective waiting for this process: leave at once so
        # that they see the connection drop and fail too, instead of hanging.
        library_start.exit_at_once(code)
    sys.exit(code)


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    _exit(2)


class _StopAsked(BaseException):
    """Raised at a module's import during start-up once a stop was asked for (not in the
    signal handler: at the import, where an exception unwinds as a failed import's does);
    a BaseException, so that no `except Exception` takes it for an error."""


def _raise_if_asked(signals: preemption.PreemptionHandler) -> None:
    if signals.received is not None:
        raise _StopAsked


def _stop_if_asked(signals: preemption.PreemptionHandler) -> None:
    """A safe point of the start-up: exits 0 if a stop was asked for (nothing is written
    before the run starts)."""
    if signals.received is not None:
        print(
            f"\nReceived {signals.received.name} during start-up: exiting; nothing to save.",
            file=sys.stderr,
            flush=True,
        )
        _exit(0)


def main(argv: list[str]) -> None:
    # Until the run function starts (and `train` takes the signals over to save on them), a
    # scheduler's SIGTERM or a Ctrl-C is a stop request, acted on at the next safe point
    # (`_stop_if_asked`) with a line saying so; a second one exits at once.
    signals = preemption.PreemptionHandler(announce=False).install()
    profile = None
    if FLAGS.profile_startup:
        profile = startup.StartupProfile()
        profile.mark("interpreter, absl, gin, flaxlm.main")
        profile.time_imports()
    # A stop asked for while the libraries load (JAX's and TensorFlow's imports are thousands
    # of modules and seconds) ends the start-up at the next module's import.
    imports = startup.BeforeEachImport(functools.partial(_raise_if_asked, signals))
    imports.install()
    try:
        _start_up(argv, signals, profile)
    except _StopAsked:
        pass  # (unwound from the import it came at, as from a failed import)
    finally:
        imports.uninstall()
    _stop_if_asked(signals)
    if next(iter(gin_utils.bound_runs()), None) not in RUNS_THAT_SAVE_ON_SIGNALS:
        # Other runs get the signals' usual handling back (serve takes them its own way).
        signals.uninstall()
    if profile:
        run_modules = (*REGISTERING_MODULES, "flaxlm.runs.loop", "flaxlm.checkpoints.run_dir")
        startup.instrument_run(profile, [sys.modules[m] for m in run_modules if m in sys.modules])
    try:
        gin_utils.run()
        if profile:
            if not profile.printed:  # a run with no step (infer, import_hf): at its end
                profile.mark("the run (no training step)")
                profile.print_table()
            print(profile.compile_summary(), flush=True)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    except FloatingPointError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        _exit(1)
    except Exception:
        if not _multiprocess():
            raise
        import jax

        print(f"process {jax.process_index()} failed:", file=sys.stderr)
        traceback.print_exc()
        _exit(1)


def _start_up(
    argv: list[str],
    signals: preemption.PreemptionHandler,
    profile: startup.StartupProfile | None,
) -> None:
    """Checks the flags, loads the libraries, parses Gin, registers the tasks; exits on a
    mistake (`_fail`) or a stop asked for (`_stop_if_asked`) at its safe points."""
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; use --gin.NAME=VALUE for overrides.")
    if not FLAGS.gin_file:
        _fail("give at least one --gin_file (e.g. --gin_file=gin/gptj_pretrain.gin).")
    _stop_if_asked(signals)
    try:  # a mistyped path fails at once, before TensorFlow and JAX load
        gin_utils.find_gin_files(FLAGS.gin_file, FLAGS.gin_search_paths)
    except FileNotFoundError as e:
        _fail(f"bad Gin configuration: {e}")
    # By default the terminal shows flaxlm's own lines only; absl's --verbosity (-v) brings
    # the libraries' logs back. Both settings precede TensorFlow's and JAX's imports.
    quiet = not FLAGS["verbosity"].present
    library_start.configure(quiet)
    platforms.exclude_absent_tpu()  # (also done by `import flaxlm`; a no-op once done)
    library_start.hide_while_tensorflow_loads()
    from flaxlm.data import input_process

    if not FLAGS["tasks_module"].present and "tensorflow" not in sys.modules:
        # A training run reads its data in a process of its own (data/input_process.py):
        # started now, it imports TensorFlow on another core while this one imports JAX and
        # parses the Gin files; ended once they say the run is not one that takes it.
        input_process.start_early()
    with library_start.native_stderr_hidden(quiet):
        # The libraries write their C++ start-up lines while they load and first touch the
        # devices: importing TensorFlow (a Gin file's imports may), hiding the accelerators
        # from it, starting JAX's backends. Do all of it here, where that output is hidden.
        _initialize_distributed()
        enable_compilation_cache(
            compilation_cache_dir(FLAGS.compilation_cache_dir, dict(os.environ))
        )

        import gin
        import jax

        if profile:
            profile.watch_jax()
            profile.mark("import jax, distributed init, compilation cache")
        _stop_if_asked(signals)
        _parse_gin()
        if profile:
            profile.mark("Gin: parse (imports the modules the files name)")
        _stop_if_asked(signals)
        if "tensorflow" in sys.modules or TRAIN_RUN not in gin_utils.bound_runs():
            input_process.discard_early()
        if FLAGS["tasks_module"].present or "seqio" in sys.modules:
            # The tasks register where the run reads data (its Gin files loaded seqio), and a
            # module the user names (it may hook the run) always. Elsewhere, the input
            # pipeline registers them when a run first looks a task up.
            from flaxlm.data import pipeline

            try:
                pipeline.import_task_module(FLAGS.tasks_module, "--tasks_module")
            except ValueError as e:
                _fail(str(e))
            if profile:
                profile.mark(f"task registration (import {FLAGS.tasks_module})")
        if "tensorflow" in sys.modules:  # the run reads data: TensorFlow stays off devices
            importlib.import_module("flaxlm.data.pipeline").configure_tensorflow()
        jax.devices()
        try:
            gin.finalize()  # (all that registers configurables at start-up is in)
            gin_utils.check_macros(FLAGS.gin_bindings or (), FLAGS.gin_search_paths or ())
            gin_utils.check_callables()
        except ValueError as e:
            required = re.match(r"(\w+)/macro\.value set to `%gin\.REQUIRED`", str(e))
            if required:  # a run's file leaves it to the user (the task, the model dir, ...)
                name = required.group(1)
                e = f"{name} is required and not set: add --gin.{name}=... or a file binding it."
            _fail(f"bad Gin configuration: {e}")
        if profile:
            profile.mark("TensorFlow set-up, JAX devices, Gin checks")


def _parse_gin() -> None:
    """Parses the Gin files and bindings (`gin_utils.parse_gin`), leaving the config open
    for the task modules to register in; a mistake is a usage error."""
    try:
        # Gin logs every search-path miss while resolving includes; failures still raise.
        verbosity = logging.get_verbosity()
        logging.set_verbosity(logging.FATAL)
        try:
            gin_utils.parse_gin(
                FLAGS.gin_file,
                FLAGS.gin_bindings,
                FLAGS.gin_search_paths,
                finalize=False,
                registering_modules=(*REGISTERING_MODULES, FLAGS.tasks_module),
            )
        finally:
            logging.set_verbosity(verbosity)
    except Exception as e:  # noqa: BLE001 - any Gin mistake is a usage error
        _fail(f"bad Gin configuration: {gin_utils.with_suggestion(str(e))}")


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, where a bad flag (`--profile_startup=maybe`, an unknown one) is
    a usage error like the others: one `error: ...` line, exit 2."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"error: {message} (--helpshort lists the flags).", file=sys.stderr, flush=True)
        sys.exit(2)


def console_main() -> None:
    try:
        app.run(main, argv=gin_utils.rewrite_gin_args(sys.argv), flags_parser=parse_flags)
    except SystemExit as e:
        if e.code in (None, 0) and not ("jax" in sys.modules and _multiprocess()):
            # A finished run has closed all it wrote (checkpoints waited for, metrics and
            # event files flushed, W&B finished): leave without the interpreter's teardown
            # (JAX clearing its backends, TensorFlow's and XLA's destructors, every module
            # collected), about a tenth of a tiny run's seconds. Several processes keep the
            # normal exit: jax.distributed's shutdown barrier lets the peers finish together.
            import logging as std_logging

            std_logging.shutdown()
            library_start.exit_at_once(0)
        raise


if __name__ == "__main__":
    console_main()
