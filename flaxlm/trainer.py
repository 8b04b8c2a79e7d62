"""The train and eval steps (microbatched, partitioned) and the training loop.

`train` is the Gin-bound run function of `gin/runs/pretrain.gin`: it creates the state
already sharded, restores the latest checkpoint, and runs steps with logging, evaluation
and checkpointing between them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import gin
import jax
import jax.numpy as jnp
import optax
import seqio
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flaxlm import checkpoints, data, metrics, optimizers, preemption
from flaxlm import lora as lora_lib
from flaxlm.models.base import BaseModel
from flaxlm.models.features import batch_shapes_from
from flaxlm.partitioning import Partitioner
from flaxlm.train_state import TrainState

Batch = Mapping[str, jax.Array]
METRIC_SUMS = ("loss_sum", "z_loss_sum", "correct_sum", "weight_sum")


def split_microbatches(batch: Batch, num_microbatches: int) -> Batch:
    """`[batch, ...]` -> `[num_microbatches, batch // num_microbatches, ...]`.

    Microbatch i takes rows i, i + n, i + 2n, ...: every data-parallel device holds an equal
    share of every microbatch, so splitting moves no data between devices.
    """

    def split(x: jax.Array) -> jax.Array:
        rows = x.shape[0] // num_microbatches
        return x.reshape((rows, num_microbatches) + x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def summarize(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Mean loss and accuracy from summed metrics."""
    denom = jnp.maximum(sums["weight_sum"], 1.0)
    return {
        "loss": sums["loss_sum"] / denom,
        "z_loss": sums["z_loss_sum"] / denom,
        "accuracy": sums["correct_sum"] / denom,
        "num_tokens": sums["weight_sum"],
    }


def accumulate_gradients(
    model: BaseModel,
    partitioner: Partitioner,
    params: Any,
    batch: Batch,
    rng: jax.Array,
    num_microbatches: int = 1,
) -> tuple[Any, dict[str, jax.Array]]:
    """Gradients of the batch's mean loss and its metric sums, over microbatches in a scan.

    Every microbatch's loss is divided by the *whole* batch's weight sum, so the summed
    gradients equal the one-big-batch gradients (same math, less memory).
    """
    _, weights = model.targets_and_weights(batch)
    normalizer = jnp.maximum(jnp.sum(weights.astype(jnp.float32)), 1.0)
    grad_fn = jax.value_and_grad(model.loss_fn, has_aux=True)
    if num_microbatches == 1:
        (_, sums), grads = grad_fn(params, batch, rng, normalizer)
        return grads, sums

    batch_axes = partitioner.batch_mesh_axes() or None
    micro = jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(
            x, NamedSharding(partitioner.mesh, P(None, batch_axes))
        ),
        split_microbatches(batch, num_microbatches),
    )

    def body(carry, xs):
        i, mb = xs
        (_, sums), grads = grad_fn(params, mb, jax.random.fold_in(rng, i), normalizer)
        acc_grads, acc_sums = carry
        return (
            jax.tree.map(jnp.add, acc_grads, grads),
            jax.tree.map(jnp.add, acc_sums, sums),
        ), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zero_sums = {k: jnp.zeros((), jnp.float32) for k in METRIC_SUMS}
    (grads, sums), _ = jax.lax.scan(body, (zeros, zero_sums), (jnp.arange(num_microbatches), micro))
    return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), sums


def make_train_step(
    model: BaseModel,
    partitioner: Partitioner,
    learning_rate: optax.ScalarOrSchedule,
    *,
    num_microbatches: int = 1,
    seed: int = 0,
    skip_nonfinite_updates: bool = False,
    inject_nonfinite_loss_at_step: int | None = None,
    lora: lora_lib.LoraConfig | None = None,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """The (unjitted) train step: accumulate gradients, apply the optimizer, report metrics.

    `metrics["nonfinite"]` is 1 when the loss or the gradient norm is NaN/Inf. With
    `skip_nonfinite_updates` such an update leaves params and optimizer state unchanged (the
    step still advances). `inject_nonfinite_loss_at_step=k` (testing only) scales the loss and
    gradients of step k (1-based, as logged) by inf.

    With `lora`, `state.params` are the adapters and the step takes the frozen base params as
    a third argument: `train_step(state, batch, base_params)`.
    """

    def train_step(
        state: TrainState, batch: Batch, base_params: Any = None
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        rng = jax.random.fold_in(jax.random.PRNGKey(seed), state.step)
        loss_model = model if lora is None else lora_lib.LoraModel(model, lora, base_params)
        grads, sums = accumulate_gradients(
            loss_model, partitioner, state.params, batch, rng, num_microbatches
        )
        if inject_nonfinite_loss_at_step is not None:
            scale = jnp.where(state.step + 1 == inject_nonfinite_loss_at_step, jnp.inf, 1.0)
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
            sums = {**sums, "loss_sum": sums["loss_sum"] * scale}
        new_state = state.apply_gradients(grads)
        out = summarize(sums)
        out["grad_norm"] = optax.global_norm(grads)
        finite = jnp.isfinite(out["loss"]) & jnp.isfinite(out["grad_norm"])
        out["nonfinite"] = 1 - finite.astype(jnp.int32)
        if skip_nonfinite_updates:
            kept = state.replace(step=new_state.step)
            new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, kept)
        out["param_norm"] = optax.global_norm(state.params)
        lr = learning_rate(state.step) if callable(learning_rate) else learning_rate
        out["learning_rate"] = jnp.asarray(lr, jnp.float32)
        return new_state, out

    return train_step


def make_eval_step(
    model: BaseModel, lora: lora_lib.LoraConfig | None = None
) -> Callable[..., dict[str, jax.Array]]:
    """`eval_step(params, batch)`; with `lora`, `eval_step(adapters, batch, base_params)`."""

    def eval_step(params: Any, batch: Batch, base_params: Any = None) -> dict[str, jax.Array]:
        if lora is not None:
            params = lora_lib.merge(base_params, params, lora)
        _, sums = model.loss_fn(params, batch, None, 1.0)
        return sums

    return eval_step


def check_batch_size(partitioner: Partitioner, batch_size: int, num_microbatches: int) -> None:
    layout_degree = partitioner.data_parallel_degree()
    if num_microbatches < 1 or batch_size % (layout_degree * num_microbatches):
        raise ValueError(
            f"BATCH_SIZE={batch_size} must be divisible by the data-parallel degree "
            f"{layout_degree} times num_microbatches={num_microbatches} "
            f"(= {layout_degree * num_microbatches})."
        )


def check_model_dir(model_dir: str) -> epath.Path:
    path = epath.Path(model_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_test_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"MODEL_DIR {model_dir!r} cannot be written: {e}") from e
    return path


class Setup:
    """Everything a run builds before its first step (shared by train and benchmarks).

    With `lora`, the state's params are the adapters (`lora_kernels` says which); the base
    params stay outside the state, on `base_shardings`, and are an extra argument of the
    partitioned train and eval steps.
    """

    def __init__(
        self,
        model: BaseModel,
        partitioner: Partitioner,
        optimizer: optax.GradientTransformation,
        feature_lengths: Mapping[str, int],
        *,
        seed: int = 0,
        lora: lora_lib.LoraConfig | None = None,
    ):
        self.model = model
        self.partitioner = partitioner
        self.lora = lora
        init_shapes = batch_shapes_from(feature_lengths, 1)
        self.params_axes = model.params_axes(init_shapes)
        self.base_shardings = None
        if lora is not None:
            self.lora_kernels = lora_lib.plan(lora, model, init_shapes)
            self.base_shardings = partitioner.sharding(self.params_axes)
            self.init_base = partitioner.partition(
                lambda: model.init_params(jax.random.PRNGKey(seed), init_shapes),
                (),
                self.base_shardings,
            )
            self.params_axes = lora_lib.adapter_axes(self.lora_kernels)

        def init_params() -> Any:
            if lora is not None:
                rng = jax.random.fold_in(jax.random.PRNGKey(seed), 1)
                return lora_lib.init_adapters(rng, self.lora_kernels)
            return model.init_params(jax.random.PRNGKey(seed), init_shapes)

        def init_state() -> TrainState:
            return TrainState.create(init_params(), optimizer)

        abstract = jax.eval_shape(init_state)
        axes = abstract.logical_axes(self.params_axes)
        self.state_shardings = abstract.replace(
            step=NamedSharding(partitioner.mesh, P()),
            params=partitioner.sharding(axes.params),
            opt_state=partitioner.opt_state_sharding(axes.opt_state, abstract.opt_state),
        )
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract,
            self.state_shardings,
        )
        self.init_state = partitioner.partition(init_state, (), self.state_shardings)
        # Given params (an import or INIT_FROM_HF), a fresh optimizer state beside them.
        self.state_from_params = partitioner.partition(
            lambda params: TrainState.create(params, optimizer),
            (self.state_shardings.params,),
            self.state_shardings,
        )
        self.batch_axes = {name: P("batch", None) for name in feature_lengths}

    def partition_train_step(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        base = () if self.lora is None else (self.base_shardings,)
        return self.partitioner.partition(
            step_fn,
            (self.state_shardings, self.batch_axes, *base),
            (self.state_shardings, None),
            donate_argnums=(0,),
        )

    def partition_eval_step(self, eval_fn: Callable[..., Any]) -> Callable[..., Any]:
        base = () if self.lora is None else (self.base_shardings,)
        return self.partitioner.partition(
            eval_fn, (self.state_shardings.params, self.batch_axes, *base), None
        )

    def partition_merge(self) -> Callable[[Any, Any], Any]:
        """`merge(base_params, adapters)` -> the model's params, on the base shardings."""
        lora = self.lora
        return self.partitioner.partition(
            lambda base, adapters: lora_lib.merge(base, adapters, lora),
            (self.base_shardings, self.state_shardings.params),
            self.base_shardings,
        )


def evaluate_batches(
    eval_step: Callable[..., Any], params: Any, iterator: data.DataIterator, steps: int
) -> dict[str, float]:
    iterator.reset()
    total = None
    for _ in range(steps):
        try:
            sums = eval_step(params, next(iterator))
        except StopIteration:
            break
        total = sums if total is None else jax.tree.map(jnp.add, total, sums)
    if total is None:
        raise ValueError("The evaluation dataset produced no batches.")
    return eval_scalars(total)


def eval_scalars(total: Mapping[str, jax.Array]) -> dict[str, float]:
    """`eval/loss`, `eval/accuracy`, `eval/perplexity` (of the cross-entropy, z-loss
    excluded), ... from summed eval metrics."""
    out = {f"eval/{k}": float(v) for k, v in summarize(total).items()}
    out["eval/perplexity"] = float(math.exp(min(out["eval/loss"] - out["eval/z_loss"], 700.0)))
    return out


def evaluate_split(
    model: BaseModel,
    params: Any,
    partitioner: Partitioner,
    cfg: data.DatasetConfig,
    max_batches: int | None = None,
) -> dict[str, float]:
    """Loss, token accuracy and perplexity over one pass of `cfg`'s split (the last
    partial batch left out; at most `max_batches`), with the params as they are sharded."""
    cfg = dataclasses.replace(cfg, num_epochs=1, shuffle=False)
    check_batch_size(partitioner, cfg.batch_size, 1)
    layout = partitioner.data_layout(cfg.batch_size)
    converter = model.FEATURE_CONVERTER_CLS
    iterator = data.DataIterator(data.host_input(cfg, layout, converter), partitioner, layout)
    step = jax.jit(make_eval_step(model))
    total = None
    for number, batch in enumerate(iterator):
        if max_batches is not None and number >= max_batches:
            break
        with partitioner.context():
            sums = step(params, batch)
        total = sums if total is None else jax.tree.map(jnp.add, total, sums)
    if total is None:
        raise ValueError(
            f"{cfg.mixture_or_task_name} ({cfg.split}) has fewer than one batch of "
            f"{cfg.batch_size} examples to evaluate."
        )
    return eval_scalars(total)


def next_batch(iterator: data.DataIterator, cfg: data.DatasetConfig, step: int) -> Batch:
    """The next training batch; running out is an error that names the data."""
    try:
        return next(iterator)
    except StopIteration:
        name = cfg.mixture_or_task_name
        source = getattr(seqio.get_mixture_or_task(name), "source", None)
        files = None
        if isinstance(source, seqio.FileDataSource):
            files = list(source.list_shards(cfg.split))
        raise ValueError(
            f"The training data ran out at step {step}: task {name!r} (split {cfg.split!r}"
            + (f", files {files}" if files else "")
            + f") produced no more batches of {cfg.batch_size}. Is a data file empty, or "
            "num_epochs too small for TRAIN_STEPS?"
        ) from None


def load_lora_base(
    setup: Setup, model_dir: str, init_from_hf: str | None, base_checkpoint: str | None
) -> Any:
    """The frozen base params of a LoRA run (see `train`), and `model_dir/lora.json`."""
    model, partitioner = setup.model, setup.partitioner
    if init_from_hf:
        from flaxlm import hf

        source: dict[str, Any] = {"hf": os.path.abspath(init_from_hf)}
        params = hf.load_params(model, init_from_hf, shardings=setup.base_shardings)
        hf.record_hf_config(model, model_dir, init_from_hf)
    elif base_checkpoint:
        step = checkpoints.Checkpointer(base_checkpoint).latest_step()
        source = {"checkpoint": os.path.abspath(base_checkpoint), "step": step}
        params = lora_lib.restore_base(source, model, partitioner)
    else:
        base_dir = os.path.join(os.path.abspath(model_dir), "base")
        source = {"checkpoint": base_dir, "step": 0}
        base_ckpt = checkpoints.Checkpointer(base_dir)
        if base_ckpt.latest_step() is None:
            params = setup.init_base()
            base_ckpt.save_params(0, params)
            base_ckpt.close()
        else:
            base_ckpt.close()
            params = lora_lib.restore_base(source, model, partitioner)
    lora_lib.write_record(model_dir, setup.lora, source)
    print(f"LoRA on {len(setup.lora_kernels)} kernels; frozen base params from {source}.")
    return params


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

    SIGTERM or SIGINT saves a checkpoint at the current step and returns (see
    `preemption.py`).
    """
    start_time = time.perf_counter()
    if lora_base_checkpoint and lora is None:
        raise ValueError("lora_base_checkpoint is set but lora is not: bind train.lora too.")
    path = check_model_dir(model_dir)
    check_batch_size(partitioner, train_dataset_cfg.batch_size, num_microbatches)
    model.check_lengths(train_dataset_cfg.task_feature_lengths)
    converter = model.FEATURE_CONVERTER_CLS
    feature_lengths = data.model_feature_lengths(train_dataset_cfg, converter)

    layout = partitioner.data_layout(train_dataset_cfg.batch_size)
    train_iter = data.DataIterator(
        data.host_input(train_dataset_cfg, layout, converter), partitioner, layout
    )
    eval_iter = None
    if eval_dataset_cfg is not None and eval_period:
        check_batch_size(partitioner, eval_dataset_cfg.batch_size, 1)
        eval_layout = partitioner.data_layout(eval_dataset_cfg.batch_size)
        eval_iter = data.DataIterator(
            data.host_input(eval_dataset_cfg, eval_layout, converter), partitioner, eval_layout
        )

    tx = optimizer_factory(learning_rate=learning_rate)
    setup = Setup(model, partitioner, tx, feature_lengths, seed=seed, lora=lora)
    ckpt = checkpoints.Checkpointer(model_dir, keep=keep_checkpoints, keep_period=keep_period)
    start_step, state = ckpt.restore_latest(
        setup.abstract_state, train_iter, setup.state_from_params
    )
    base_params = None
    if lora is not None:
        base_params = load_lora_base(setup, model_dir, init_from_hf, lora_base_checkpoint)
    if state is None and init_from_hf and lora is None:
        from flaxlm import hf

        params = hf.load_params(model, init_from_hf, shardings=setup.state_shardings.params)
        start_step, state = 0, setup.state_from_params(params)
        hf.record_hf_config(model, model_dir, init_from_hf)
        print(f"Initialised {model.__class__.__name__} from {init_from_hf}.", flush=True)
    elif state is None:
        start_step, state = 0, setup.init_state()
        print(f"Initialised {model.__class__.__name__} on {partitioner}.", flush=True)
    else:
        print(f"Resumed from checkpoint step {start_step} in {ckpt.directory}.", flush=True)

    train_step = setup.partition_train_step(
        make_train_step(
            model,
            partitioner,
            learning_rate,
            num_microbatches=num_microbatches,
            seed=seed,
            skip_nonfinite_updates=skip_nonfinite_updates,
            inject_nonfinite_loss_at_step=inject_nonfinite_loss_at_step,
            lora=lora,
        )
    )
    eval_step = setup.partition_eval_step(make_eval_step(model, lora)) if eval_iter else None

    def eval_params(params: Any) -> Any:
        """The model's params from the state's."""
        return params

    if lora is not None:  # the steps take the frozen base params as their last argument
        lora_train_step, lora_eval_step, merge = train_step, eval_step, setup.partition_merge()

        def train_step(state: TrainState, batch: Batch) -> Any:
            return lora_train_step(state, batch, base_params)

        if lora_eval_step is not None:

            def eval_step(adapters: Any, batch: Batch) -> Any:
                return lora_eval_step(adapters, batch, base_params)

        def eval_params(adapters: Any) -> Any:
            return merge(base_params, adapters)

    task_evaluator = None
    if eval_iter is not None and eval_task_metrics:
        from flaxlm import evaluation

        task_evaluator = evaluation.TaskEvaluator(
            eval_dataset_cfg,
            model,
            partitioner,
            num_examples=eval_steps * eval_dataset_cfg.batch_size,
        )
        task_evaluator = task_evaluator if task_evaluator.active else None
    if not (path / "hf_config.json").exists():
        from flaxlm import hf

        # What infer/score/evaluate/export rebuild the model from (families flaxlm knows).
        if any(isinstance(model.config, spec.config_cls) for spec in hf.HF_SPECS.values()):
            hf.record_hf_config(model, model_dir)
    config_str = gin.operative_config_str()
    if jax.process_index() == 0:
        (path / "config.gin").write_text(config_str)
    writer = metrics.create_writer(model_dir)
    progress = metrics.Progress(
        total_steps, start_step, model.flops_per_token(max(feature_lengths.values()))
    )
    tokens_per_step = train_dataset_cfg.batch_size * max(feature_lengths.values())

    step = start_step
    last_saved = start_step
    preempted = False
    # The non-finite check of step N runs after step N+1 is dispatched (so the host never
    # idles the device), and before anything that logs, evaluates or saves step N.
    unchecked: tuple[int, dict[str, jax.Array]] | None = None
    skipped = jnp.zeros((), jnp.int32)

    def check_finite() -> None:
        nonlocal unchecked
        if unchecked is None or skip_nonfinite_updates:
            unchecked = None
            return
        bad_step, bad = unchecked
        unchecked = None
        if int(bad["nonfinite"]):
            ckpt.wait()
            last = ckpt.latest_step()
            where = f"step {last} in {ckpt.directory}" if last is not None else "none yet"
            raise FloatingPointError(
                f"Non-finite values at step {bad_step} (loss {float(bad['loss'])}, gradient "
                f"norm {float(bad['grad_norm'])}); stopping. Last good checkpoint: {where}. "
                "Lower the learning rate or resume with "
                "--gin.train.skip_nonfinite_updates=True to skip such updates."
            )

    period_start, period_steps, period_wait = time.perf_counter(), 0, train_iter.wait_seconds
    signals = preemption.PreemptionHandler().install()
    try:
        while step < total_steps:
            state, step_metrics = train_step(state, next_batch(train_iter, train_dataset_cfg, step))
            step += 1
            period_steps += 1
            check_finite()
            unchecked = (step, step_metrics)
            if skip_nonfinite_updates:
                skipped = skipped + step_metrics["nonfinite"]
            stop = signals.should_stop()
            if step % log_period == 0 or step == total_steps:
                check_finite()
                scalars = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
                if skip_nonfinite_updates:
                    scalars["nonfinite_updates_skipped"] = float(skipped)
                elapsed = time.perf_counter() - period_start
                scalars.update(progress.rates(tokens_per_step * period_steps, elapsed))
                scalars["input_wait_fraction"] = (train_iter.wait_seconds - period_wait) / max(
                    elapsed, 1e-9
                )
                writer.write_scalars(step, scalars)
                writer.flush()
                if jax.process_index() == 0:
                    print(progress.line(step, scalars), flush=True)
                period_start, period_steps = time.perf_counter(), 0
                period_wait = train_iter.wait_seconds
            if eval_step and (step % eval_period == 0 or step == total_steps):
                check_finite()
                scalars = evaluate_batches(eval_step, state.params, eval_iter, eval_steps)
                if task_evaluator is not None:
                    scalars.update(task_evaluator.evaluate(eval_params(state.params), step))
                writer.write_scalars(step, scalars)
                writer.flush()
                if jax.process_index() == 0:
                    task = "".join(
                        f" | {k[len('eval/') :]} {v:.4g}"
                        for k, v in scalars.items()
                        if k.count("/") > 1
                    )
                    print(
                        f"step {step} | eval loss {scalars['eval/loss']:.4f} | "
                        f"eval accuracy {scalars['eval/accuracy']:.4f} | "
                        f"eval perplexity {scalars['eval/perplexity']:.4g}{task}",
                        flush=True,
                    )
            if step % checkpoint_period == 0 or step == total_steps or stop:
                check_finite()
                ckpt.save(step, state, train_iter, config_str)
                last_saved = step
            if stop:
                preempted = True
                break
        check_finite()
    finally:
        ckpt.close()  # waits for an async save in flight (a second signal exits at once)
        writer.close()
        signals.uninstall()
    if jax.process_index() == 0:
        if preempted:
            cause = signals.received.name if signals.received else "a signal to another process"
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
            f"  config       {path / 'config.gin'}\n"
            f"  metrics      {path / 'metrics.jsonl'}\n"
            f"  tensorboard  {path / 'tensorboard'}",
            flush=True,
        )
    return state
