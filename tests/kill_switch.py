"""A `--tasks_module` for test_reliability: registers the usual tasks, then `kill -9`s this
process at the point that FLAXLM_TEST_KILL names: 'save:4' while step 4's checkpoint is being
written (before orbax commits it), 'eval:6' in the middle of the evaluation at step 6,
'import' right now (start-up, before Gin is parsed), 'checks' in the run's checks (after
flaxlm.main's start-up, before the run takes the signals over), 'restore' as the train state
is restored (the run's set-up). FLAXLM_TEST_SIGNAL=TERM sends SIGTERM instead (after which
the process goes on as a preempted one does)."""

import os
import signal

import tasks  # noqa: F401
from flaxlm.checkpoints import checkpointer, data_state
from flaxlm.training import metrics, steps

WHERE, _, STEP = os.environ.get("FLAXLM_TEST_KILL", "").partition(":")
SIGNAL = signal.Signals["SIG" + os.environ.get("FLAXLM_TEST_SIGNAL", "KILL")]


def _die() -> None:
    os.kill(os.getpid(), SIGNAL)


if WHERE == "save":
    _save = data_state.DatasetCheckpointHandler.save

    def _save_then_die(self, directory, args):
        _save(self, directory, args)
        # `directory` is `<step>.orbax-checkpoint-tmp-<n>/dataset` until the commit renames it.
        if directory.parent.name.split(".")[0] == STEP:
            assert "tmp" in directory.parent.name, directory
            _die()

    data_state.DatasetCheckpointHandler.save = _save_then_die

elif WHERE == "eval":
    _last_logged = [None]
    _write = metrics.JsonlWriter.write_scalars
    _evaluate = steps.evaluate_batches

    def _write_and_remember(self, step, scalars):
        _last_logged[0] = step
        _write(self, step, scalars)

    def _evaluate_then_die(eval_step, params, iterator, count, *rest):
        if str(_last_logged[0]) == STEP:
            iterator.reset()
            eval_step(params, next(iterator))  # one batch in, then die
            _die()  # (SIGTERM: the evaluation goes on, from its first batch)
        return _evaluate(eval_step, params, iterator, count, *rest)

    metrics.JsonlWriter.write_scalars = _write_and_remember
    steps.evaluate_batches = _evaluate_then_die

elif WHERE == "import":
    _die()

elif WHERE == "checks":
    _check_resumed_lengths = data_state.check_resumed_lengths

    def _die_then_check(*args, **kwargs):
        _die()
        return _check_resumed_lengths(*args, **kwargs)

    data_state.check_resumed_lengths = _die_then_check

elif WHERE == "restore":
    _restore_latest = checkpointer.Checkpointer.restore_latest

    def _die_then_restore(self, *args, **kwargs):
        _die()
        return _restore_latest(self, *args, **kwargs)

    checkpointer.Checkpointer.restore_latest = _die_then_restore
