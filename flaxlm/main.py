"""Entry point: `python -m flaxlm.main --gin_file=gin/gptj_pretrain.gin --gin.X=Y`.

Parses Gin files and overrides, joins the multi-process runtime when asked (or when the
cluster is one JAX detects), imports the task registry, and calls the run function bound in
Gin (`run.fn = @train`).
"""

from __future__ import annotations

import os
import sys
import traceback

from absl import app, flags, logging

from flaxlm import gin_utils, logs, platforms

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
            raise app.UsageError(
                "--coordinator_address, --process_count and --process_index go together."
            )
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


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; use --gin.NAME=VALUE for overrides.")
    if not FLAGS.gin_file:
        _fail("give at least one --gin_file (e.g. --gin_file=gin/gptj_pretrain.gin).")
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

        import importlib

        import gin
        import jax

        import flaxlm.models  # noqa: F401  (registers model configurables)
        from flaxlm import convert, data, evaluation, infer, serve, train  # noqa: F401

        if FLAGS.tasks_module:
            importlib.import_module(FLAGS.tasks_module)
        data.configure_tensorflow()
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
