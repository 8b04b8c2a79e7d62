"""The `train` run function, a short sequence of `TrainRun`'s steps: check the settings, open
the data (`train_data.TrainData`), restore or initialise the state, build the steps, then
`loop.run_steps` with its hooks (logging, evaluation, checkpointing; see `loop.py`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import gin
import jax
import optax

from flaxlm.checkpoints import checkpointer, hf, peft_config, peft_dir, run_dir
from flaxlm.data.config import DatasetConfig
from flaxlm.models.base import BaseModel
from flaxlm.models.row_start import RowStart
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs import checks, loop, train_data
from flaxlm.training import lora as lora_lib
from flaxlm.training import metrics, optimizers, preemption, steps
from flaxlm.training import objective as objective_lib
from flaxlm.training.train_state import TrainState


def frozen_params(
    setup: steps.Setup,
    state: TrainState,
    start_step: int,
    model_dir: str,
    init_from_hf: str | None,
    lora_base_checkpoint: str | None,
    row_start: RowStart,
) -> Any:
    """The steps' frozen params (`steps.Setup.frozen_shardings`), or None: a LoRA run's
    base (`run_dir.load_lora_base`), else the reference of an objective that needs one
    (`reference_params`, a copy: the steps donate the state)."""
    if setup.lora is not None:
        return run_dir.load_lora_base(
            setup, model_dir, init_from_hf, lora_base_checkpoint, row_start
        )
    if setup.frozen_shardings is None:
        return None
    return reference_params(setup, state, start_step, init_from_hf, copy=True)


def reference_params(
    setup: steps.Setup, state: TrainState, start_step: int, init_from_hf: str | None, copy: bool
) -> Any:
    """An objective's frozen reference: the params the run started from (on a resumed run:
    `init_from_hf` again, or the same fresh init)."""
    shardings = setup.state_shardings.params
    if start_step == 0:
        params, source = state.params, "the starting params"
        params = setup.copy_params(params) if copy else params
    elif init_from_hf:
        params = hf.load_params(setup.model, init_from_hf, shardings=shardings)
        source = init_from_hf
    else:
        params, source = setup.init_state().params, "the run's initial params"
    metrics.print0(f"Reference model: {source}, frozen.")
    return params


def initial_state(
    setup: steps.Setup,
    ckpt: checkpointer.Checkpointer,
    train_iter: Any,
    model_dir: str,
    init_from_hf: str | None,
    row_start: RowStart,
    adapters: Any = None,
) -> tuple[int, TrainState]:
    """The latest checkpoint's step and state, else step 0 from `init_from_hf` or a fresh
    init (a LoRA run's adapters: `adapters`, if given)."""
    model = setup.model
    start_step, state = loop.restore(setup, ckpt, train_iter)
    if state is not None:
        return start_step, state
    if adapters is not None:
        print("Initialised the LoRA adapters from the PEFT directory.", flush=True)
        return 0, setup.state_from_params(adapters)
    if init_from_hf and setup.lora is None:
        params = hf.load_params(model, init_from_hf, shardings=setup.state_shardings.params)
        run_dir.write_model_record(model, model_dir, row_start, init_from_hf)
        print(f"Initialised {model.__class__.__name__} from {init_from_hf}.", flush=True)
        return 0, setup.state_from_params(params)
    print(f"Initialised {model.__class__.__name__} on {setup.partitioner}.", flush=True)
    return 0, setup.init_state()


def steps_with_frozen(
    setup: steps.Setup,
    train_step: Callable[..., Any],
    eval_step: Callable[..., Any] | None,
    frozen: Any,
) -> tuple[Callable[..., Any], Callable[..., Any] | None, Callable[[Any], Any]]:
    """The train and eval steps and `eval_params` (state params -> the model's params): the
    steps of a run with frozen params (LoRA's base, an objective's reference) take them
    as their last argument, and a LoRA run's model params are the base with the adapters
    merged."""
    if setup.frozen_shardings is None:
        return train_step, eval_step, lambda params: params
    eval_params = lambda params: params  # noqa: E731
    if setup.lora is not None:
        merge = setup.partition_merge()
        eval_params = lambda adapters: merge(frozen, adapters)  # noqa: E731

    def frozen_eval_step(params: Any, batch: steps.Batch) -> Any:
        return eval_step(params, batch, frozen)

    return (
        lambda state, batch: train_step(state, batch, frozen),
        frozen_eval_step if eval_step is not None else None,
        eval_params,
    )


def compile_ahead(setup: steps.Setup, train_step: Callable[..., Any], batch: Any) -> None:
    """Compiles `train_step` for the first step's arguments now (`batch`: the batches'
    shapes), while the input pipeline is still being built (on a thread,
    `deferred.BackgroundDataIterator`, or in the input process): the first step finds the
    program in JAX's caches. Left to the first call where the step takes frozen params or
    only the pipeline knows the batch's features (`batch` None)."""
    if setup.frozen_shardings is None and batch is not None:
        train_step.lower(setup.abstract_state, batch).compile()


@dataclasses.dataclass(frozen=True)
class Settings:
    """`train`'s keyword arguments, all of them (its docstring says what each does): as Gin
    bound them, then as the run uses them (`TrainRun.check`)."""

    model: BaseModel
    partitioner: Partitioner
    train_dataset_cfg: DatasetConfig
    eval_dataset_cfg: DatasetConfig | None
    learning_rate: optax.ScalarOrSchedule
    optimizer_factory: Callable[..., optax.GradientTransformation]
    model_dir: str
    total_steps: int
    num_microbatches: int
    log_period: int
    eval_period: int
    eval_steps: int
    checkpoint_period: int
    keep_checkpoints: int | None
    keep_period: int | None
    seed: int
    init_from_hf: str | None
    eval_task_metrics: bool
    skip_nonfinite_updates: bool
    inject_nonfinite_loss_at_step: int | None
    lora: lora_lib.LoraConfig | None
    lora_base_checkpoint: str | None
    lora_init_from_peft: str | None
    objective: objective_lib.RunObjective
    input_process: bool | None


@gin.configurable
def train(
    *,
    model: BaseModel = gin.REQUIRED,
    partitioner: Partitioner = gin.REQUIRED,
    train_dataset_cfg: DatasetConfig = gin.REQUIRED,
    eval_dataset_cfg: DatasetConfig | None = None,
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
    lora_init_from_peft: str | None = None,
    objective: objective_lib.RunObjective = objective_lib.NEXT_TOKEN_PREDICTION,
    input_process: bool | None = None,
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
      lora_init_from_peft: a PEFT adapter directory whose adapters start a LoRA run (when
        `model_dir` has no checkpoint yet). `lora` defaults to its adapter_config.json's
        (a bound one must adapt the same kernels at the same ranks), and `init_from_hf` to
        its `base_model_name_or_path`.
      objective: what the run optimises (`objective.RunObjective`): next-token prediction by
        default, or e.g. a preference loss on pairs of answers
        (`@preference.PreferenceConfig()`: DPO, IPO, ORPO, SimPO; the data must be pairs,
        `features.PreferenceFeatureConverter`). An objective that needs a reference gets
        the starting params, frozen (with `lora`: the base).
      input_process: read the data in a process of its own (`data/input_process.py`:
        TensorFlow and the pipeline's set-up on another core, off this process's GIL), or
        in this one (False). None: its own where the run allows it (the model's own
        converter, next-token prediction) and this process has not loaded TensorFlow.

    SIGTERM or SIGINT saves a checkpoint at the current step and returns (see
    `preemption.py`).
    """
    run = TrainRun(Settings(**locals()))  # (its arguments: the first line sees nothing else)
    run.check()  # every refusal, before any device work
    # From here on a first SIGTERM/SIGINT is a request to stop cleanly: during set-up, before
    # the first step; in the loop, after the current step, saving it (see run_steps).
    run.signals = preemption.PreemptionHandler().install()
    try:  # whatever fails from here on, the signals go back and the checkpointer is closed
        run.data.open()
        run.start_state()
        run.build_steps()
        state, step, stopped = run.run_steps()
    except BaseException:
        run.abort()
        raise
    finally:
        run.close()
    run.report(stopped, step)
    return state


class TrainRun:
    """One `train` run, step by step, in the order `train` calls them: `check`, `data.open`,
    `start_state`, `build_steps`, `run_steps`; then `close` (whatever happened; `abort`
    first where something failed) and `report`. Each step keeps what later ones read."""

    def __init__(self, settings: Settings) -> None:
        self.start_time = time.perf_counter()
        self.settings = settings
        self.signals: preemption.PreemptionHandler | None = None
        self.data: train_data.TrainData | None = None
        self.ckpt: checkpointer.Checkpointer | None = None
        self.writer: metrics.MultiWriter | None = None

    def check(self) -> None:
        """Refuses a bad setting, naming it, and settles what the run derives from them:
        LoRA and INIT_FROM_HF from a PEFT directory (its `adapters`), MODEL_DIR (`path`),
        the row start, no eval data without EVAL_PERIOD, and its data (`TrainData`)."""
        s = self.settings
        checks.check_counts(
            TRAIN_STEPS=(s.total_steps, 1),
            BATCH_SIZE=(s.train_dataset_cfg.batch_size, 1),
            NUM_MICROBATCHES=(s.num_microbatches, 1),
            LOG_PERIOD=(s.log_period, 1),
            CHECKPOINT_PERIOD=(s.checkpoint_period, 1),
            EVAL_PERIOD=(s.eval_period, 0),
            EVAL_STEPS=(s.eval_steps, 1),
        )
        checks.check_learning_rate(s.learning_rate)
        self.adapters = None
        if s.lora_init_from_peft:
            init_from_hf = s.init_from_hf
            if not s.lora_base_checkpoint:
                init_from_hf = init_from_hf or peft_config.base_model_path(s.lora_init_from_peft)
            lora, self.adapters = peft_dir.load_adapters(s.model, s.lora_init_from_peft, s.lora)
            s = dataclasses.replace(s, lora=lora, init_from_hf=init_from_hf)
        if s.lora_base_checkpoint and s.lora is None:
            raise ValueError("lora_base_checkpoint is set but lora is not: bind train.lora too.")
        self.path = checks.check_model_dir(s.model_dir)
        # (a resumed run reads it again only for its frozen params: LoRA's base, a reference)
        rereads = s.lora is not None or s.objective.needs_reference
        if not checks.has_checkpoint(s.model_dir) or rereads:
            checks.check_init_from_hf(s.init_from_hf)
        self.row_start = run_dir.run_row_start(s.model, s.model_dir, s.init_from_hf)
        steps.check_batch_size(s.partitioner, s.train_dataset_cfg.batch_size, s.num_microbatches)
        s.model.check_lengths(s.train_dataset_cfg.task_feature_lengths)
        eval_cfg = s.eval_dataset_cfg if s.eval_period else None
        if eval_cfg is not None:
            steps.check_batch_size(s.partitioner, eval_cfg.batch_size, 1)
        self.data = train_data.TrainData(
            s.model,
            s.partitioner,
            s.train_dataset_cfg,
            eval_cfg,
            s.objective,
            self.row_start,
            s.input_process,
            s.model_dir,
        )
        self.settings = dataclasses.replace(
            s, train_dataset_cfg=self.data.train_cfg, eval_dataset_cfg=eval_cfg
        )

    def start_state(self) -> None:
        """The steps' `Setup` and the train state: the latest checkpoint's, else step 0
        (from INIT_FROM_HF, a PEFT directory's adapters, or a fresh init); the steps' frozen
        params (a LoRA base, an objective's reference), if any."""
        s, data = self.settings, self.data
        self.setup = setup = steps.Setup(
            s.model,
            s.partitioner,
            s.optimizer_factory(learning_rate=s.learning_rate),
            data.feature_lengths,
            seed=s.seed,
            lora=s.lora,
            frozen_reference=s.objective.needs_reference,
        )
        self.ckpt = checkpointer.Checkpointer(
            s.model_dir, keep=s.keep_checkpoints, keep_period=s.keep_period
        )
        self.start_step, self.state = initial_state(
            setup,
            self.ckpt,
            data.train_iter,
            s.model_dir,
            s.init_from_hf,
            self.row_start,
            self.adapters,
        )
        self.frozen = frozen_params(
            setup,
            self.state,
            self.start_step,
            s.model_dir,
            s.init_from_hf,
            s.lora_base_checkpoint,
            self.row_start,
        )

    def build_steps(self) -> None:
        """The partitioned train and eval steps, with what the objective adds to each batch
        (`objective.prepare`); the train step compiled now for the first batch's shapes
        where they are known (`compile_ahead`)."""
        s, data, setup = self.settings, self.data, self.setup
        state, start_step = self.state, self.start_step
        self.extra = s.objective.prepare(
            objective_lib.ObjectiveRun(
                setup,
                start_step,
                reference_params=lambda: reference_params(
                    setup, state, start_step, s.init_from_hf, copy=False
                ),
                data=data.fresh_iterators,
                total_steps=s.total_steps,
                eval_steps=s.eval_steps,
            )
        )
        self.eval_iter = data.eval_iter
        if self.extra is not None:
            setup.batch_axes = {**setup.batch_axes, **self.extra.axes}
            self.eval_iter = self.extra.eval_iterator(self.eval_iter)
        partitioned_step = setup.partition_train_step(
            steps.make_train_step(
                s.model,
                s.partitioner,
                s.learning_rate,
                num_microbatches=s.num_microbatches,
                seed=s.seed,
                skip_nonfinite_updates=s.skip_nonfinite_updates,
                inject_nonfinite_loss_at_step=s.inject_nonfinite_loss_at_step,
                lora=s.lora,
                objective=s.objective,
            )
        )
        eval_step = None
        if self.eval_iter:
            eval_step = setup.partition_eval_step(
                steps.make_eval_step(s.model, s.lora, s.objective)
            )
        self.train_step, self.eval_step, self.eval_params = steps_with_frozen(
            setup, partitioned_step, eval_step, self.frozen
        )
        # (a stop asked for in the set-up ends the run before its first step: no compile)
        if self.extra is None and start_step < s.total_steps and not self.signals.should_stop():
            compile_ahead(setup, partitioned_step, data.batch_spec())
        data.check_eval_task()

    def run_steps(self) -> tuple[TrainState, int, bool]:
        """`loop.run_steps` from the start step to TRAIN_STEPS with the run's hooks
        (`hooks`): the state, its step, and whether a signal stopped it."""
        s, train_iter = self.settings, self.data.train_iter
        run_dir.record_if_known(s.model, s.model_dir, self.row_start)
        config_str = loop.operative_config(self.path)
        self.writer = metrics.create_writer(s.model_dir)

        def next_batch(step: int) -> steps.Batch:
            batch = steps.next_batch(train_iter, s.train_dataset_cfg, step)
            return batch if self.extra is None else {**batch, **self.extra.train(step)}

        hooks, nonfinite = self.hooks(config_str)
        return loop.run_steps(
            self.state,
            self.start_step,
            s.total_steps,
            self.train_step,
            next_batch,
            hooks,
            nonfinite,
            self.signals,
        )

    def hooks(self, config_str: str) -> tuple[list[loop.Hook], loop.NonFiniteCheck]:
        """The loop's hooks, in the order they run: the metrics and progress line every
        LOG_PERIOD, evaluation every EVAL_PERIOD, a checkpoint every CHECKPOINT_PERIOD (and
        on a stop); and the check of non-finite losses they share."""
        s, train_iter = self.settings, self.data.train_iter
        longest = max(self.data.feature_lengths.values())
        progress = metrics.Progress(
            s.total_steps, self.start_step, s.model.flops_per_token(longest)
        )
        nonfinite = loop.NonFiniteCheck(self.ckpt, s.skip_nonfinite_updates)
        save, self.saved = loop.checkpoint_hook(
            s.checkpoint_period, self.ckpt, train_iter, config_str, self.start_step
        )
        tokens_per_step = s.train_dataset_cfg.batch_size * longest * s.objective.rows_per_example
        log = loop.log_hook(
            s.log_period, self.writer, progress, tokens_per_step, train_iter, nonfinite
        )
        if self.eval_step is None:
            return [log, save], nonfinite
        task = (s.eval_dataset_cfg, s.model, s.partitioner, self.row_start)
        evaluate = loop.eval_hook(
            s.eval_period,
            self.writer,
            self.eval_step,
            self.eval_iter,
            s.eval_steps,
            self.eval_params,
            task if s.eval_task_metrics else None,
            s.objective,
        )
        return [log, evaluate, save], nonfinite

    def abort(self) -> None:
        """A failed run's data stops at once (`TrainData.abort`)."""
        if self.data is not None:
            self.data.abort()

    def close(self) -> None:
        """The clean-up, whatever happened: the data (`TrainData.close`), then the
        checkpointer, writers and signals (`loop.close`)."""
        if self.data is not None:
            self.data.close()
        loop.close(self.ckpt, self.writer, self.signals)

    def report(self, stopped: bool, step: int) -> None:
        """The run's closing lines (process 0's): why it stopped, what it wrote where."""
        if jax.process_index() == 0:
            loop.report_end(
                self.signals,
                stopped,
                step,
                self.start_step,
                self.settings.total_steps,
                self.ckpt,
                self.saved["step"],
                self.path,
                self.start_time,
            )
