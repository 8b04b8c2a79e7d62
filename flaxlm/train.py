"""The `train` run function: build, restore, then the loop with its hooks.

The loop runs one partitioned train step after another; between steps it runs the hooks
whose period has come (logging, evaluation, checkpointing; every hook also on the last step,
the checkpoint also on a preemption signal). The non-finite check of step N runs after step
N+1 is dispatched (so the host never idles the device) and before any hook reads step N.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import gin
import jax
import jax.numpy as jnp
import optax

from flaxlm import (
    checkpoints,
    data,
    evaluation,
    hf,
    metrics,
    optimizers,
    preemption,
    preference,
    run_dir,
    trainer,
)
from flaxlm import lora as lora_lib
from flaxlm.models.base import BaseModel
from flaxlm.partitioning import Partitioner
from flaxlm.train_state import TrainState

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

    def __init__(self, ckpt: checkpoints.Checkpointer, skip: bool):
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


def log_hook(
    period: int,
    writer: metrics.MultiWriter,
    progress: metrics.Progress,
    tokens_per_step: int,
    train_iter: data.DataIterator,
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
    eval_iter: data.DataIterator,
    eval_steps: int,
    eval_params: Callable[[Any], Any],
    task_metrics_of: tuple[data.DatasetConfig, BaseModel, Partitioner] | None,
) -> Hook:
    """Loss, accuracy, perplexity every `period` steps; with `task_metrics_of` (the eval
    dataset, model and partitioner) also the task's own metric functions, if it has any."""
    task_evaluator = None
    if task_metrics_of is not None:
        cfg, model, partitioner = task_metrics_of
        num_examples = eval_steps * cfg.batch_size
        task_evaluator = evaluation.TaskEvaluator(
            cfg, model, partitioner, num_examples=num_examples
        )
        task_evaluator = task_evaluator if task_evaluator.active else None

    def run(step: int, state: TrainState, step_metrics: StepMetrics) -> None:
        scalars = trainer.evaluate_batches(eval_step, state.params, eval_iter, eval_steps)
        if task_evaluator is not None:
            scalars.update(task_evaluator.evaluate(eval_params(state.params), step))
        writer.write_scalars(step, scalars)
        writer.flush()
        metrics.print0(metrics.eval_line(step, scalars))

    return Hook(period, run)


def frozen_params(
    setup: trainer.Setup,
    state: TrainState,
    start_step: int,
    model_dir: str,
    init_from_hf: str | None,
    lora_base_checkpoint: str | None,
) -> Any:
    """The steps' frozen params (`trainer.Setup.frozen_shardings`), or None: a LoRA run's
    base (`run_dir.load_lora_base`), else a preference run's reference, the params the run
    started from (on a resumed run: `init_from_hf` again, or the same fresh init)."""
    if setup.lora is not None:
        return run_dir.load_lora_base(setup, model_dir, init_from_hf, lora_base_checkpoint)
    if setup.frozen_shardings is None:
        return None
    if start_step == 0:
        params, source = setup.copy_params(state.params), "the starting params"
    elif init_from_hf:
        params = hf.load_params(setup.model, init_from_hf, shardings=setup.frozen_shardings)
        source = init_from_hf
    else:
        params, source = setup.init_state().params, "the run's initial params"
    metrics.print0(f"Reference model: {source}, frozen.")
    return params


def initial_state(
    setup: trainer.Setup,
    ckpt: checkpoints.Checkpointer,
    train_iter: data.DataIterator,
    model_dir: str,
    init_from_hf: str | None,
) -> tuple[int, TrainState]:
    """The latest checkpoint's step and state, else step 0 from `init_from_hf` or a fresh
    init."""
    model = setup.model
    start_step, state = ckpt.restore_latest(
        setup.abstract_state, train_iter, setup.state_from_params
    )
    if state is not None:
        print(f"Resumed from checkpoint step {start_step} in {ckpt.directory}.", flush=True)
    elif init_from_hf and setup.lora is None:
        params = hf.load_params(model, init_from_hf, shardings=setup.state_shardings.params)
        start_step, state = 0, setup.state_from_params(params)
        run_dir.write_model_record(model, model_dir, init_from_hf)
        print(f"Initialised {model.__class__.__name__} from {init_from_hf}.", flush=True)
    else:
        start_step, state = 0, setup.init_state()
        print(f"Initialised {model.__class__.__name__} on {setup.partitioner}.", flush=True)
    return start_step, state


def steps_with_frozen(
    setup: trainer.Setup,
    train_step: Callable[..., Any],
    eval_step: Callable[..., Any] | None,
    frozen: Any,
) -> tuple[Callable[..., Any], Callable[..., Any] | None, Callable[[Any], Any]]:
    """The train and eval steps and `eval_params` (state params -> the model's params): the
    steps of a run with frozen params (LoRA's base, a preference loss's reference) take them
    as their last argument, and a LoRA run's model params are the base with the adapters
    merged."""
    if setup.frozen_shardings is None:
        return train_step, eval_step, lambda params: params
    eval_params = lambda params: params  # noqa: E731
    if setup.lora is not None:
        merge = setup.partition_merge()
        eval_params = lambda adapters: merge(frozen, adapters)  # noqa: E731

    def frozen_eval_step(params: Any, batch: trainer.Batch) -> Any:
        return eval_step(params, batch, frozen)

    return (
        lambda state, batch: train_step(state, batch, frozen),
        frozen_eval_step if eval_step is not None else None,
        eval_params,
    )


def resumed_input_shards(
    cfg: data.DatasetConfig, partitioner: Partitioner, model_dir: str
) -> data.DatasetConfig:
    """`cfg` reading as many logical input shards as `model_dir`'s checkpoint was written
    with, unless `num_input_shards` is set: a run resumed on another mesh (more or fewer
    devices, another data-parallel degree) continues with the global batches it would have
    seen on the old one."""
    saved = checkpoints.saved_input_shards(model_dir)
    if saved is None or cfg.num_input_shards is not None:
        return cfg
    degree = partitioner.data_parallel_degree()
    if saved != degree:
        print(
            f"Reading the training data as {saved} logical input shards, as the checkpoint "
            f"was written (this mesh's data-parallel degree is {degree}), so the data order "
            "continues unchanged.",
            flush=True,
        )
    return dataclasses.replace(cfg, num_input_shards=saved)


@gin.configurable
def train(
    *,
    model: BaseModel = gin.REQUIRED,
    partitioner: Partitioner = gin.REQUIRED,
    train_dataset_cfg: data.DatasetConfig = gin.REQUIRED,
    eval_dataset_cfg: data.DatasetConfig | None = None,
    learning_rate: optax.ScalarOrSchedule = gin.REQUIRED,
    optimizer_factory: Callable[..., optax.GradientTransformation] = optimizers.create_optimizer,
    model_dir: str = gin.REQUIRED,
    total_steps: int = gin.REQUIRED,
    num_microbatches: int = 1,
    log_period: int = 10,
    eval_period: int = 0,
    eval_steps: int = 10,
    checkpoint_period: int = 100,
    keep_checkpoints: int | None = 3,
    keep_period: int | None = None,
    seed: int = 0,
    init_from_hf: str | None = None,
    eval_task_metrics: bool = True,
    skip_nonfinite_updates: bool = False,
    inject_nonfinite_loss_at_step: int | None = None,
    lora: lora_lib.LoraConfig | None = None,
    lora_base_checkpoint: str | None = None,
    objective: trainer.Objective | None = None,
) -> TrainState:
    """Trains `model` on `train_dataset_cfg` for `total_steps`, resuming from `model_dir`.

    Args:
      learning_rate: a float or an optax schedule (e.g. `@create_schedule()`).
      optimizer_factory: called with `learning_rate=` to build the optax optimizer.
      eval_period: evaluate every this many steps (and at the end); 0 disables.
      checkpoint_period: save every this many steps (and at the end).
      keep_checkpoints / keep_period: keep the newest K, and every Mth permanently.
      init_from_hf: a HuggingFace directory whose params start the run (fine-tuning) when
        `model_dir` has no checkpoint yet; `model` must have the checkpoint's shape.
      eval_task_metrics: at each evaluation also run the eval task's own metric functions
        (seqio evaluation over generated text and scores), if it has any.
      skip_nonfinite_updates: on a NaN/Inf loss or gradient, skip that update and count it
        (`nonfinite_updates_skipped`) instead of stopping with the step and last good
        checkpoint named.
      inject_nonfinite_loss_at_step: testing only: make step k's loss and gradients Inf.
      lora: train low-rank adapters (`@lora.LoraConfig()`) instead of the params. The base
        params are frozen: from `init_from_hf`, else the latest checkpoint of
        `lora_base_checkpoint` (a flaxlm MODEL_DIR), else a random init saved once to
        `model_dir/base`. Only the adapters have optimizer state and are checkpointed;
        `model_dir/lora.json` records the config and the base, so infer, eval and
        export_hf merge them.
      objective: train on pairs of answers with a preference loss
        (`@preference.PreferenceConfig()`: DPO, IPO, ORPO, SimPO) instead of next-token
        prediction; the data must be pairs (`features.PreferenceFeatureConverter`). The
        reference of DPO and IPO is the starting params, frozen (with `lora`: the base).

    SIGTERM or SIGINT saves a checkpoint at the current step and returns (see
    `preemption.py`).
    """
    start_time = time.perf_counter()
    trainer.check_counts(
        TRAIN_STEPS=(total_steps, 1),
        BATCH_SIZE=(train_dataset_cfg.batch_size, 1),
        NUM_MICROBATCHES=(num_microbatches, 1),
        LOG_PERIOD=(log_period, 1),
        CHECKPOINT_PERIOD=(checkpoint_period, 1),
        EVAL_PERIOD=(eval_period, 0),
        EVAL_STEPS=(eval_steps, 1),
    )
    trainer.check_learning_rate(learning_rate)
    if lora_base_checkpoint and lora is None:
        raise ValueError("lora_base_checkpoint is set but lora is not: bind train.lora too.")
    path = trainer.check_model_dir(model_dir)
    trainer.check_batch_size(partitioner, train_dataset_cfg.batch_size, num_microbatches)
    model.check_lengths(train_dataset_cfg.task_feature_lengths)
    converter = data.converter_for(train_dataset_cfg, model)
    preference.check_data(objective, converter)
    feature_lengths = data.model_feature_lengths(train_dataset_cfg, converter)
    train_dataset_cfg = resumed_input_shards(train_dataset_cfg, partitioner, model_dir)
    # From here on a first SIGTERM/SIGINT is a request to stop cleanly: during set-up, before
    # the first step; in the loop, after the current step, saving it (see run_steps).
    signals = preemption.PreemptionHandler().install()
    ckpt = writer = None
    try:  # whatever fails from here on, the signals go back and the checkpointer is closed
        train_iter = data.DataIterator.create(train_dataset_cfg, partitioner, converter)
        eval_iter = None
        if eval_dataset_cfg is not None and eval_period:
            trainer.check_batch_size(partitioner, eval_dataset_cfg.batch_size, 1)
            eval_iter = data.DataIterator.create(
                eval_dataset_cfg, partitioner, data.converter_for(eval_dataset_cfg, model)
            )
        setup = trainer.Setup(
            model,
            partitioner,
            optimizer_factory(learning_rate=learning_rate),
            feature_lengths,
            seed=seed,
            lora=lora,
            frozen_reference=objective is not None and objective.needs_reference,
        )
        ckpt = checkpoints.Checkpointer(model_dir, keep=keep_checkpoints, keep_period=keep_period)
        start_step, state = initial_state(setup, ckpt, train_iter, model_dir, init_from_hf)
        frozen = frozen_params(
            setup, state, start_step, model_dir, init_from_hf, lora_base_checkpoint
        )
        train_step, eval_step, eval_params = steps_with_frozen(
            setup,
            setup.partition_train_step(
                trainer.make_train_step(
                    model,
                    partitioner,
                    learning_rate,
                    num_microbatches=num_microbatches,
                    seed=seed,
                    skip_nonfinite_updates=skip_nonfinite_updates,
                    inject_nonfinite_loss_at_step=inject_nonfinite_loss_at_step,
                    lora=lora,
                    objective=objective,
                )
            ),
            setup.partition_eval_step(trainer.make_eval_step(model, lora, objective))
            if eval_iter
            else None,
            frozen,
        )
        run_dir.record_if_known(model, model_dir)
        config_str = gin.operative_config_str()
        if jax.process_index() == 0:
            (path / run_dir.CONFIG_FILE).write_text(config_str)

        writer = metrics.create_writer(model_dir)
        longest = max(feature_lengths.values())
        rows_per_example = 2 if isinstance(objective, preference.PreferenceConfig) else 1
        progress = metrics.Progress(total_steps, start_step, model.flops_per_token(longest))
        nonfinite = NonFiniteCheck(ckpt, skip_nonfinite_updates)
        saved = {"step": start_step}

        def save(step: int, state: TrainState, step_metrics: StepMetrics) -> None:
            ckpt.save(step, state, train_iter, config_str)
            saved["step"] = step

        hooks = [
            log_hook(
                log_period,
                writer,
                progress,
                train_dataset_cfg.batch_size * longest * rows_per_example,
                train_iter,
                nonfinite,
            ),
            Hook(checkpoint_period, save, on_stop=True),
        ]
        if eval_step is not None:
            task = (eval_dataset_cfg, model, partitioner) if eval_task_metrics else None
            hooks.insert(
                1,
                eval_hook(eval_period, writer, eval_step, eval_iter, eval_steps, eval_params, task),
            )

        def next_batch(step: int) -> trainer.Batch:
            return trainer.next_batch(train_iter, train_dataset_cfg, step)

        state, step, stop = run_steps(
            state, start_step, total_steps, train_step, next_batch, hooks, nonfinite, signals
        )
    finally:
        if ckpt is not None:
            ckpt.close()  # waits for an async save in flight (a second signal exits at once)
        if writer is not None:
            writer.close()
        signals.uninstall()
    if jax.process_index() == 0:
        report_end(
            signals, stop, step, start_step, total_steps, ckpt, saved["step"], path, start_time
        )
    return state


def run_steps(
    state: TrainState,
    step: int,
    total_steps: int,
    train_step: Callable[[TrainState, trainer.Batch], tuple[TrainState, StepMetrics]],
    next_batch: Callable[[int], trainer.Batch],
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


def report_end(
    signals: preemption.PreemptionHandler,
    preempted: bool,
    step: int,
    start_step: int,
    total_steps: int,
    ckpt: checkpoints.Checkpointer,
    last_saved: int,
    path: Any,
    start_time: float,
) -> None:
    """The run's closing lines: why it stopped and what it wrote where."""
    cause = signals.received.name if signals.received else "a signal to another process"
    if preempted and step == start_step:
        print(
            f"Stopped by {cause} before the first step: nothing new to save (latest "
            f"checkpoint: step {last_saved}).",
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
        f"  checkpoints  {ckpt.directory} (latest step {last_saved})\n"
        f"  config       {path / run_dir.CONFIG_FILE}\n"
        f"  metrics      {path / 'metrics.jsonl'}\n"
        f"  tensorboard  {path / 'tensorboard'}",
        flush=True,
    )
