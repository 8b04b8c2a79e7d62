"""Entry point: `python -m flaxlm.main --gin_file=gin/gptj_pretrain.gin --gin.X=Y`.

Parses Gin files and overrides, joins the multi-process runtime when asked (or when the
cluster is one JAX detects), imports the task registry, and calls the run function bound in
Gin (`run.fn = @train`).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import traceback
from typing import Any

from absl import app, flags, logging

from flaxlm import gin_utils, logs
from flaxlm.parallel import platforms

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("gin_file", [], "Gin files to parse, in order (repeatable).")
flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings, e.g. 'TRAIN_STEPS = 10'.")
flags.DEFINE_list("gin_search_paths", [], "Extra directories to search for Gin files.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process).")
flags.DEFINE_integer("process_count", None, "Number of processes (multi-process).")
flags.DEFINE_integer("process_index", None, "This process's index (multi-process).")
flags.DEFINE_string("tasks_module", "tasks", "Module imported to register seqio tasks.")


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


# Imported before the Gin files are parsed: they register the configurables that the
# run names (`train.train`, `infer.infer`, the model families, ...).
REGISTERING_MODULES = (
    "flaxlm.models",
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


def _multiprocess() -> bool:
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if _multiprocess():
        # A normal exit waits at jax.distributed's shutdown barrier for peers that are
        # themselves blocked in a collective waiting for this process: leave at once so
        # that they see the connection drop and fail too, instead of hanging.
        os._exit(code)
    sys.exit(code)


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    _exit(2)


def _stop_during_start_up(signum: int, frame: Any) -> None:
    # A SystemExit raised here unwinds whatever start-up step is running (imports, Gin).
    print(
        f"\nReceived {signal.Signals(signum).name} during start-up: exiting; nothing to save.",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(0)


def main(argv: list[str]) -> None:
    # Until the run function starts (and `train` takes the signals over to save on them), a
    # scheduler's SIGTERM or a Ctrl-C ends the start-up with a line saying so.
    previous = {s: signal.signal(s, _stop_during_start_up) for s in (signal.SIGTERM, signal.SIGINT)}
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; use --gin.NAME=VALUE for overrides.")
    if not FLAGS.gin_file:
        _fail("give at least one --gin_file (e.g. --gin_file=gin/gptj_pretrain.gin).")
    try:  # a mistyped path fails at once, before TensorFlow and JAX load
        gin_utils.find_gin_files(FLAGS.gin_file, FLAGS.gin_search_paths)
    except FileNotFoundError as e:
        _fail(f"bad Gin configuration: {e}")
    # By default the terminal shows flaxlm's own lines only; absl's --verbosity (-v) brings
    # the libraries' logs back. Both settings precede TensorFlow's and JAX's imports.
    quiet = not FLAGS["verbosity"].present
    logs.configure(quiet)
    platforms.exclude_absent_tpu()  # (also done by `import flaxlm`; a no-op once done)
    with logs.native_stderr_hidden(quiet):
        # The libraries write their C++ start-up lines while they load and first touch the
        # devices: importing TensorFlow, hiding the accelerators from it, starting JAX's
        # backends. Do all of it here, where that output is hidden.
        _initialize_distributed()

        import gin
        import jax

        for module in REGISTERING_MODULES:
            importlib.import_module(module)
        from flaxlm.data import pipeline

        try:
            pipeline.import_task_module(FLAGS.tasks_module, "--tasks_module")
        except ValueError as e:
            _fail(str(e))
        pipeline.configure_tensorflow()
        jax.devices()
    try:
        # Gin logs every search-path miss while resolving includes; failures still raise.
        verbosity = logging.get_verbosity()
        logging.set_verbosity(logging.FATAL)
        try:
            gin_utils.parse_gin(FLAGS.gin_file, FLAGS.gin_bindings, FLAGS.gin_search_paths)
        finally:
            logging.set_verbosity(verbosity)
    except Exception as e:  # noqa: BLE001 - any Gin mistake is a usage error
        _fail(f"bad Gin configuration: {gin_utils.with_suggestion(str(e))}")
    try:
        gin_utils.check_macros(FLAGS.gin_bindings or (), FLAGS.gin_search_paths or ())
    except ValueError as e:
        _fail(f"bad Gin configuration: {e}")
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    try:
        gin_utils.run()
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
    del gin


def console_main() -> None:
    app.run(main, argv=gin_utils.rewrite_gin_args(sys.argv))


if __name__ == "__main__":
    console_main()
