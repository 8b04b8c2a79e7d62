"""The `train` run function: build, restore, then `loop.run_steps` with its hooks (logging,
evaluation, checkpointing; see `loop.py`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import gin
import jax
import optax

from flaxlm.checkpoints import checkpointer, data_state, hf, peft_dir, run_dir
from flaxlm.data import input_process as input_process_lib
from flaxlm.data.config import DatasetConfig, batch_structs
from flaxlm.models import batch_shapes
from flaxlm.models.base import BaseModel
from flaxlm.models.row_start import RowStart
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs import checks, loop
from flaxlm.training import lora as lora_lib
from flaxlm.training import metrics, optimizers, preemption, steps
from flaxlm.training import objective as objective_lib
from flaxlm.training.train_state import TrainState

StepMetrics = loop.StepMetrics


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


def reads_in_own_process(
    setting: bool | None,
    model: BaseModel,
    cfgs: tuple[DatasetConfig | None, ...],
    objective: objective_lib.RunObjective,
    row_start: RowStart,
) -> bool:
    """Whether the run reads its data in an input process of its own
    (`input_process.py`; `train.input_process`). None: where it can, and this process has
    not loaded TensorFlow (a Gin file or task module that did means its input pipeline
    may need this process: read here)."""
    why_not = None
    if batch_shapes.converter_reference(model) is None:
        why_not = "the model names its feature converter as a class"
    elif any(cfg is not None and cfg.feature_converter is not None for cfg in cfgs):
        why_not = "a DatasetConfig.feature_converter is set (its class loaded TensorFlow)"
    elif row_start.hf_form:
        why_not = "the rows start as the task's HF tokenizer says (its vocabulary is read here)"
    elif objective is not objective_lib.NEXT_TOKEN_PREDICTION:
        why_not = "train.objective is not next-token prediction"
    if setting is None:
        return why_not is None and "tensorflow" not in sys.modules
    if setting and why_not:
        raise ValueError(
            f"train.input_process=True, but {why_not}: such a run reads its data in its own "
            "process. Leave train.input_process unset (or False)."
        )
    return setting


def _data_iterators(
    inputs: input_process_lib.InputProcess | None,
    model: BaseModel,
    partitioner: Partitioner,
    train_cfg: DatasetConfig,
    eval_cfg: DatasetConfig | None,
    converter: Any,
    feature_lengths: dict[str, int] | None,
    row_start: RowStart,
) -> tuple[Any, Any]:
    """The run's train iterator (built from now on) and eval iterator (built at the first
    evaluation; its task looked up at once), read through `inputs` or in this process
    (the train data on a thread)."""
    if inputs is not None:
        train_iter = input_process_lib.RemoteDataIterator(
            inputs, train_cfg, partitioner, converter, expected=feature_lengths
        )
        eval_iter = eval_cfg and input_process_lib.RemoteDataIterator(
            inputs, eval_cfg, partitioner, converter, lazy=True
        )
        return train_iter, eval_iter
    pipeline = input_process_lib.load_pipeline()
    from flaxlm.data import deferred

    train_iter = deferred.BackgroundDataIterator(train_cfg, partitioner, converter)
    eval_iter = eval_cfg and deferred.DeferredDataIterator(
        eval_cfg, partitioner, pipeline.converter_for(eval_cfg, model, row_start)
    )
    return train_iter, eval_iter


def _batch_spec(
    inputs: Any, train_iter: Any, cfg: DatasetConfig, converter: Any, partitioner: Partitioner
) -> Any:
    """The training batches' shapes (`compile_ahead`'s), or None."""
    if inputs is None:
        return input_process_lib.load_pipeline().batch_spec(cfg, converter, partitioner)
    lengths, dtypes = train_iter.feature_shapes()
    return None if dtypes is None else batch_structs(cfg, lengths, dtypes, partitioner)


def fresh_iterators(
    partitioner: Partitioner, converter: Any, *cfgs: DatasetConfig | None
) -> tuple[Any, ...]:
    """A new in-process `DataIterator` of each of `cfgs` (None for None): an objective's own
    passes over the data."""
    pipeline = input_process_lib.load_pipeline()
    return tuple(
        pipeline.DataIterator.create(c, partitioner, converter) if c else None for c in cfgs
    )


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
    start_time = time.perf_counter()
    checks.check_counts(
        TRAIN_STEPS=(total_steps, 1),
        BATCH_SIZE=(train_dataset_cfg.batch_size, 1),
        NUM_MICROBATCHES=(num_microbatches, 1),
        LOG_PERIOD=(log_period, 1),
        CHECKPOINT_PERIOD=(checkpoint_period, 1),
        EVAL_PERIOD=(eval_period, 0),
        EVAL_STEPS=(eval_steps, 1),
    )
    checks.check_learning_rate(learning_rate)
    peft_adapters = None
    if lora_init_from_peft:
        if not lora_base_checkpoint:
            init_from_hf = init_from_hf or peft_dir.base_model_path(lora_init_from_peft)
        lora, peft_adapters = peft_dir.load_adapters(model, lora_init_from_peft, lora)
    if lora_base_checkpoint and lora is None:
        raise ValueError("lora_base_checkpoint is set but lora is not: bind train.lora too.")
    path = checks.check_model_dir(model_dir)
    if not checks.has_checkpoint(model_dir) or lora is not None or objective.needs_reference:
        checks.check_init_from_hf(init_from_hf)  # (a resumed run may not read it again)
    row_start = run_dir.run_row_start(model, model_dir, init_from_hf)
    steps.check_batch_size(partitioner, train_dataset_cfg.batch_size, num_microbatches)
    model.check_lengths(train_dataset_cfg.task_feature_lengths)
    if eval_dataset_cfg is not None and eval_period:
        steps.check_batch_size(partitioner, eval_dataset_cfg.batch_size, 1)
    else:
        eval_dataset_cfg = None
    own_process = reads_in_own_process(
        input_process, model, (train_dataset_cfg, eval_dataset_cfg), objective, row_start
    )
    if not own_process:
        input_process_lib.discard_early()
    if own_process:
        converter = batch_shapes.converter_reference(model)
        feature_lengths = batch_shapes.packed_lm_features(
            model, train_dataset_cfg.task_feature_lengths, train_dataset_cfg.pack
        )
    else:
        pipeline = input_process_lib.load_pipeline()
        converter = pipeline.converter_for(train_dataset_cfg, model, row_start)
        objective.check_data(converter)
        feature_lengths = pipeline.model_feature_lengths(train_dataset_cfg, converter)
    if feature_lengths is not None:
        checks.check_sequence_split(model, partitioner, feature_lengths)
    data_state.check_resumed_lengths(train_dataset_cfg.task_feature_lengths, model_dir)
    train_dataset_cfg = data_state.resumed_input_shards(train_dataset_cfg, partitioner, model_dir)
    # From here on a first SIGTERM/SIGINT is a request to stop cleanly: during set-up, before
    # the first step; in the loop, after the current step, saving it (see run_steps).
    signals = preemption.PreemptionHandler().install()
    ckpt = writer = train_iter = inputs = None
    try:  # whatever fails from here on, the signals go back and the checkpointer is closed
        if own_process:
            inputs = input_process_lib.start()
        train_iter, eval_iter = _data_iterators(
            inputs,
            model,
            partitioner,
            train_dataset_cfg,
            eval_dataset_cfg,
            converter,
            feature_lengths,
            row_start,
        )
        if feature_lengths is None:  # the input process says
            feature_lengths = train_iter.description()["feature_lengths"]
            checks.check_sequence_split(model, partitioner, feature_lengths)
        setup = steps.Setup(
            model,
            partitioner,
            optimizer_factory(learning_rate=learning_rate),
            feature_lengths,
            seed=seed,
            lora=lora,
            frozen_reference=objective.needs_reference,
        )
        ckpt = checkpointer.Checkpointer(model_dir, keep=keep_checkpoints, keep_period=keep_period)
        start_step, state = initial_state(
            setup, ckpt, train_iter, model_dir, init_from_hf, row_start, peft_adapters
        )
        frozen = frozen_params(
            setup, state, start_step, model_dir, init_from_hf, lora_base_checkpoint, row_start
        )
        extra = objective.prepare(
            objective_lib.ObjectiveRun(
                setup,
                start_step,
                reference_params=lambda: reference_params(
                    setup, state, start_step, init_from_hf, copy=False
                ),
                data=lambda: fresh_iterators(
                    partitioner, converter, train_dataset_cfg, eval_dataset_cfg
                ),
                total_steps=total_steps,
                eval_steps=eval_steps,
            )
        )
        if extra is not None:
            setup.batch_axes = {**setup.batch_axes, **extra.axes}
            eval_iter = extra.eval_iterator(eval_iter)
        partitioned_step = setup.partition_train_step(
            steps.make_train_step(
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
        )
        train_step, eval_step, eval_params = steps_with_frozen(
            setup,
            partitioned_step,
            setup.partition_eval_step(steps.make_eval_step(model, lora, objective))
            if eval_iter
            else None,
            frozen,
        )
        # (a stop asked for in the set-up ends the run before its first step: no compile)
        if extra is None and start_step < total_steps and not signals.should_stop():
            batch = _batch_spec(inputs, train_iter, train_dataset_cfg, converter, partitioner)
            compile_ahead(setup, partitioned_step, batch)
        if inputs is not None and eval_iter is not None:
            eval_iter.check()
        run_dir.record_if_known(model, model_dir, row_start)
        config_str = loop.operative_config(path)

        writer = metrics.create_writer(model_dir)
        longest = max(feature_lengths.values())
        progress = metrics.Progress(total_steps, start_step, model.flops_per_token(longest))
        nonfinite = loop.NonFiniteCheck(ckpt, skip_nonfinite_updates)
        save, saved = loop.checkpoint_hook(
            checkpoint_period, ckpt, train_iter, config_str, start_step
        )

        hooks = [
            loop.log_hook(
                log_period,
                writer,
                progress,
                train_dataset_cfg.batch_size * longest * objective.rows_per_example,
                train_iter,
                nonfinite,
            ),
            save,
        ]
        if eval_step is not None:
            task = (eval_dataset_cfg, model, partitioner, row_start) if eval_task_metrics else None
            hooks.insert(
                1,
                loop.eval_hook(
                    eval_period,
                    writer,
                    eval_step,
                    eval_iter,
                    eval_steps,
                    eval_params,
                    task,
                    objective,
                ),
            )

        def next_batch(step: int) -> steps.Batch:
            batch = steps.next_batch(train_iter, train_dataset_cfg, step)
            return batch if extra is None else {**batch, **extra.train(step)}

        state, step, stop = loop.run_steps(
            state, start_step, total_steps, train_step, next_batch, hooks, nonfinite, signals
        )
    except BaseException:
        if inputs is not None:  # a failed run's input process has nothing left to do
            inputs.kill()
        raise
    finally:
        if inputs is not None:
            inputs.close()  # (it ends once it has read that there is nothing more to ask)
        elif train_iter is not None:  # (a failed set-up's data thread ends before the process)
            train_iter.wait()
        loop.close(ckpt, writer, signals)
    if jax.process_index() == 0:
        loop.report_end(
            signals, stop, step, start_step, total_steps, ckpt, saved["step"], path, start_time
        )
    return state
