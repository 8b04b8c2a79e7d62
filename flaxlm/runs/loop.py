"""The training loop and its hooks, shared by the runs that train (`train`, `grpo`).

The loop runs one step after another; between steps it runs the hooks whose period has come
(logging, evaluation, checkpointing; every hook also on the last step, the checkpoint also on
a preemption signal). The non-finite check of step N runs after step N+1 is dispatched (so
the host never idles the device) and before any hook reads step N.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import gin
import jax
import jax.numpy as jnp

from flaxlm.checkpoints import checkpointer, run_dir
from flaxlm.data.config import DatasetConfig
from flaxlm.models.base import BaseModel
from flaxlm.models.row_start import RowStart
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import metrics, preemption, steps
from flaxlm.training import objective as objective_lib
from flaxlm.training.train_state import TrainState

if TYPE_CHECKING:  # (the loop never imports TensorFlow: the data may come from another process)
    from flaxlm.data.pipeline import DataIterator
    from flaxlm.runs.evaluate import TaskEvaluator

StepMetrics = dict[str, jax.Array]


@dataclasses.dataclass
class Hook:
    """`run(step, state, step_metrics)` every `period` steps (0: never), on the last step
    (`at_end`) and, for checkpoints, when the run is told to stop (`on_stop`)."""

    period: int
    run: Callable[[int, TrainState, StepMetrics], None]
    at_end: bool = True
    on_stop: bool = False

    def due(self, step: int, total_steps: int, stop: bool) -> bool:
        return bool(
            (self.period and step % self.period == 0)
            or (self.at_end and step == total_steps)
            or (self.on_stop and stop)
        )


class NonFiniteCheck:
    """Stops the run on a NaN/Inf loss or gradient, naming the step and the last good
    checkpoint; with `skip`, counts the skipped updates instead."""

    def __init__(self, ckpt: checkpointer.Checkpointer, skip: bool):
        self.ckpt, self.skip = ckpt, skip
        self.pending: tuple[int, StepMetrics] | None = None
        self.skipped = jnp.zeros((), jnp.int32)

    def defer(self, step: int, step_metrics: StepMetrics) -> None:
        """Checks the step before, then holds this one until `check`."""
        self.check()
        self.pending = (step, step_metrics)
        if self.skip:
            self.skipped = self.skipped + step_metrics["nonfinite"]

    def check(self) -> None:
        pending, self.pending = self.pending, None
        if pending is None or self.skip or not int(pending[1]["nonfinite"]):
            return
        bad_step, bad = pending
        self.ckpt.wait()
        last = self.ckpt.latest_step()
        where = f"step {last} in {self.ckpt.directory}" if last is not None else "none yet"
        raise FloatingPointError(
            f"Non-finite values at step {bad_step} (loss {float(bad['loss'])}, gradient "
            f"norm {float(bad['grad_norm'])}); stopping. Last good checkpoint: {where}. "
            "Lower the learning rate or resume with "
            "--gin.train.skip_nonfinite_updates=True to skip such updates."
        )


def restore(
    setup: steps.Setup, ckpt: checkpointer.Checkpointer, iterator: DataIterator
) -> tuple[int, TrainState | None]:
    """The latest checkpoint's step and state, placed on `setup`'s shardings (and the
    iterator's position restored), saying so; else (0, None)."""
    step, state = ckpt.restore_latest(setup.abstract_state, iterator, setup.state_from_params)
    if state is None:
        return 0, None
    print(
        f"Resumed from checkpoint step {step} in {ckpt.directory} on {setup.partitioner}.",
        flush=True,
    )
    return step, state


def operative_config(path: Any) -> str:
    """Gin's operative config, written to `path / config.gin` by process 0."""
    config_str = gin.operative_config_str()
    if jax.process_index() == 0:
        (path / run_dir.CONFIG_FILE).write_text(config_str)
    return config_str


def checkpoint_hook(
    period: int,
    ckpt: checkpointer.Checkpointer,
    iterator: DataIterator,
    config_str: str,
    start_step: int,
) -> tuple[Hook, dict[str, int]]:
    """Saves the state, the data position and the config every `period` steps, at the end
    and on a stop signal; the dict holds the last saved step."""
    saved = {"step": start_step}

    def save(step: int, state: TrainState, step_metrics: StepMetrics) -> None:
        ckpt.save(step, state, iterator, config_str)
        saved["step"] = step

    return Hook(period, save, on_stop=True), saved


def log_hook(
    period: int,
    writer: metrics.MultiWriter,
    progress: metrics.Progress,
    tokens_per_step: int,
    train_iter: DataIterator,
    nonfinite: NonFiniteCheck,
) -> Hook:
    """Step metrics, rates and the progress line, every `period` steps."""
    last = {
        "time": time.perf_counter(),
        "wait": train_iter.wait_seconds,
        "step": progress.start_step,
    }

    def run(step: int, state: TrainState, step_metrics: StepMetrics) -> None:
        scalars = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
        if nonfinite.skip:
            scalars["nonfinite_updates_skipped"] = float(nonfinite.skipped)
        elapsed = time.perf_counter() - last["time"]
        scalars.update(progress.rates(tokens_per_step * (step - last["step"]), elapsed))
        scalars["input_wait_fraction"] = (train_iter.wait_seconds - last["wait"]) / max(
            elapsed, 1e-9
        )
        writer.write_scalars(step, scalars)
        writer.flush()
        metrics.print0(progress.line(step, scalars))
        last.update(time=time.perf_counter(), wait=train_iter.wait_seconds, step=step)

    return Hook(period, run)


def eval_hook(
    period: int,
    writer: metrics.MultiWriter,
    eval_step: Callable[..., Any],
    eval_iter: DataIterator,
    eval_steps: int,
    eval_params: Callable[[Any], Any],
    task_metrics_of: tuple[DatasetConfig, BaseModel, Partitioner, RowStart] | None,
    objective: objective_lib.Objective | None = None,
) -> Hook:
    """Loss, accuracy, perplexity (an objective's own summary of its metric sums) every
    `period` steps; with `task_metrics_of` (the eval dataset, model, partitioner and row
    start) also the task's own metric functions, if it has any. The task's evaluator (seqio
    builds and caches its examples) is set up at the first evaluation, not before the first
    step."""
    evaluators: list[TaskEvaluator | None] = []

    def task_evaluator() -> TaskEvaluator | None:
        if task_metrics_of is not None and not evaluators:
            # An input process says whether the task has metric functions (seqio's evaluator
            # would load TensorFlow here to find none).
            if not getattr(eval_iter, "has_task_metrics", lambda: True)():
                evaluators.append(None)
                return None
            # Imported here, after Gin's config is locked (it loads seqio); its configurables
            # register, and nothing binds them.
            with gin.unlock_config():
                from flaxlm.runs import evaluate

            cfg, model, partitioner, row_start = task_metrics_of
            num_examples = eval_steps * cfg.batch_size
            evaluator = evaluate.TaskEvaluator(
                cfg, model, partitioner, row_start, num_examples=num_examples
            )
            evaluators.append(evaluator if evaluator.active else None)
        return evaluators[0] if evaluators else None

    def run(step: int, state: TrainState, step_metrics: StepMetrics) -> None:
        scalars = steps.evaluate_batches(eval_step, state.params, eval_iter, eval_steps, objective)
        evaluator = task_evaluator()
        if evaluator is not None:
            scalars.update(evaluator.evaluate(eval_params(state.params), step))
        writer.write_scalars(step, scalars)
        writer.flush()
        metrics.print0(metrics.eval_line(step, scalars))

    return Hook(period, run)


def run_steps(
    state: TrainState,
    step: int,
    total_steps: int,
    train_step: Callable[[TrainState, steps.Batch], tuple[TrainState, StepMetrics]],
    next_batch: Callable[[int], steps.Batch],
    hooks: list[Hook],
    nonfinite: NonFiniteCheck,
    signals: preemption.PreemptionHandler,
) -> tuple[TrainState, int, bool]:
    """The loop: a step, then the hooks that are due (after the non-finite check of the
    steps they read). Returns the state, its step and whether a signal stopped it."""
    # A signal during set-up (restore, data start-up) stops before the first step: the state
    # is the latest checkpoint's, nothing new to save.
    stop = step < total_steps and signals.should_stop()
    while step < total_steps and not stop:
        state, step_metrics = train_step(state, next_batch(step))
        step += 1
        nonfinite.defer(step, step_metrics)
        stop = signals.should_stop()
        due = [hook for hook in hooks if hook.due(step, total_steps, stop)]
        if due:
            nonfinite.check()
        for hook in due:
            hook.run(step, state, step_metrics)
        if due and not stop and signals.should_stop():
            # The signal came during a hook (an evaluation): save this step, not the next.
            stop = True
            for hook in hooks:
                if hook.on_stop and hook not in due:
                    hook.run(step, state, step_metrics)
    nonfinite.check()
    return state, step, stop


def close(
    ckpt: checkpointer.Checkpointer | None,
    writer: metrics.MultiWriter | None,
    signals: preemption.PreemptionHandler,
) -> None:
    """A run's clean-up, whatever failed: waits for an async save in flight (a second signal
    exits at once), closes the metric writers, gives the signals back."""
    if ckpt is not None:
        ckpt.close()
    if writer is not None:
        writer.close()
    signals.uninstall()


def report_end(
    signals: preemption.PreemptionHandler,
    preempted: bool,
    step: int,
    start_step: int,
    total_steps: int,
    ckpt: checkpointer.Checkpointer,
    last_saved: int,
    path: Any,
    start_time: float,
) -> None:
    """The run's closing lines: why it stopped and what it wrote where."""
    cause = signals.received.name if signals.received else "a signal to another process"
    # No step 0 is ever saved: 0 means the run has no checkpoint.
    latest = f"latest step {last_saved}" if last_saved else "none yet"
    if preempted and step == start_step:
        where = f"latest checkpoint: step {last_saved}" if last_saved else "no checkpoint yet"
        print(
            f"Stopped by {cause} before the first step: nothing new to save ({where}).",
            flush=True,
        )
    elif preempted:
        print(
            f"Preempted by {cause} at step {step}: saved checkpoint "
            f"{ckpt.directory / str(step)}. Run the same command again to resume from it.",
            flush=True,
        )
    elif start_step >= total_steps:
        print(f"Already trained to step {start_step} (TRAIN_STEPS={total_steps}).")
    print(
        f"Done in {metrics.format_duration(time.perf_counter() - start_time)}. "
        f"Wrote to {path}:\n"
        f"  checkpoints  {ckpt.directory} ({latest})\n"
        f"  config       {path / run_dir.CONFIG_FILE}\n"
        f"  metrics      {path / 'metrics.jsonl'}\n"
        f"  tensorboard  {path / 'tensorboard'}",
        flush=True,
    )
