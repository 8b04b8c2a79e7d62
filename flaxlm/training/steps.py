"""The train and eval steps (microbatched, partitioned, for any loss function) and the
`Setup` every run builds before its first step: the state created already sharded.

The loop that drives them is `train.py`'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from flaxlm.data.config import DatasetConfig
from flaxlm.models import routing
from flaxlm.models.base import BaseModel
from flaxlm.models.batch_shapes import batch_shapes_from
from flaxlm.models.layers import MICROBATCH_LOOP
from flaxlm.models.row_start import RowStart
from flaxlm.parallel import pytrees
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import lora as lora_lib
from flaxlm.training import objective as objective_lib
from flaxlm.training.train_state import TrainState

if TYPE_CHECKING:  # the input pipeline (seqio, TensorFlow) only where batches are read
    from flaxlm.data import pipeline

Batch = Mapping[str, jax.Array]


def split_microbatches(batch: Batch, num_microbatches: int) -> Batch:
    """`[batch, ...]` -> `[num_microbatches, batch // num_microbatches, ...]`.

    Microbatch i takes rows i, i + n, i + 2n, ...: every data-parallel device holds an equal
    share of every microbatch, so splitting moves no data between devices.
    """

    def split(x: jax.Array) -> jax.Array:
        rows = x.shape[0] // num_microbatches
        return x.reshape((rows, num_microbatches) + x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


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
    normalizer = model.normalizer(batch)
    grad_fn = jax.value_and_grad(model.loss_fn, has_aux=True)
    if num_microbatches == 1:
        (_, sums), grads = grad_fn(params, batch, rng, normalizer)
        return grads, sums

    micro = jax.tree.map(
        lambda x: partitioner.constrain(x, P(None, "batch")),
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
    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(model.loss_fn, params, first, rng, normalizer)[1]
    zero_sums = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    with jax.named_scope(MICROBATCH_LOOP):  # the planner counts this loop's body once
        init, xs = (zeros, zero_sums), (jnp.arange(num_microbatches), micro)
        (grads, sums), _ = jax.lax.scan(body, init, xs)
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
    objective: objective_lib.Objective | None = None,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """The (unjitted) train step: accumulate gradients, apply the optimizer, report metrics.

    A mixture of experts with `correction_bias_update_rate` (DeepSeek-V3's aux-loss-free
    balance) then moves its routers' correction biases by the step's expert loads
    (`routing.update_correction_bias`), outside the optimizer.

    `metrics["nonfinite"]` is 1 when the loss or the gradient norm is NaN/Inf. With
    `skip_nonfinite_updates` such an update leaves params and optimizer state unchanged (the
    step still advances). `inject_nonfinite_loss_at_step=k` (testing only) scales the loss and
    gradients of step k (1-based, as logged) by inf.

    The step takes the frozen params as a third argument, `train_step(state, batch,
    frozen)`, when there are any: with `lora` (`state.params` are the adapters) the base
    params; with an `objective` that needs a reference, and no LoRA, the reference params
    (see `loss_model`).
    """

    def train_step(
        state: TrainState, batch: Batch, frozen: Any = None
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        rng = jax.random.fold_in(jax.random.PRNGKey(seed), state.step)
        grads, sums = accumulate_gradients(
            loss_model(model, lora, objective, frozen),
            partitioner,
            state.params,
            batch,
            rng,
            num_microbatches,
        )
        if inject_nonfinite_loss_at_step is not None:
            scale = jnp.where(state.step + 1 == inject_nonfinite_loss_at_step, jnp.inf, 1.0)
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
            sums = {**sums, "loss_sum": sums["loss_sum"] * scale}
        new_state = state.apply_gradients(grads)
        rate = getattr(model.config, "correction_bias_update_rate", 0.0)
        if rate and lora is None and "moe_expert_counts" in sums:  # LoRA: the base stays
            counts = sums["moe_expert_counts"]  # the global batch's, microbatches summed
            rows = routing.walk_rows(model.config, counts.shape[0])
            params = routing.update_correction_bias(
                state.params, new_state.params, counts, rate, rows
            )
            new_state = new_state.replace(params=params)
        out = (objective or objective_lib.NEXT_TOKEN_PREDICTION).summarize(sums)
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


def loss_model(
    model: BaseModel,
    lora: lora_lib.LoraConfig | None,
    objective: objective_lib.Objective | None,
    frozen: Any,
) -> Any:
    """What a step differentiates: `model`'s loss; with `lora`, as a function of the
    adapters (`frozen`: the base params); with an `objective`, its loss of either, whose
    reference is the frozen params (with LoRA: the base without adapters, no second copy of
    the weights)."""
    policy = model if lora is None else lora_lib.LoraModel(model, lora, frozen)
    return (objective or objective_lib.NEXT_TOKEN_PREDICTION).bind(policy, model, frozen)


def make_eval_step(
    model: BaseModel,
    lora: lora_lib.LoraConfig | None = None,
    objective: objective_lib.Objective | None = None,
) -> Callable[..., dict[str, jax.Array]]:
    """`eval_step(params, batch)`; `eval_step(params, batch, frozen)` when the train step
    takes frozen params (see `make_train_step`)."""

    def eval_step(params: Any, batch: Batch, frozen: Any = None) -> dict[str, jax.Array]:
        if objective is not None:  # (its own normalizer: only the metric sums are kept)
            return loss_model(model, lora, objective, frozen).loss_fn(params, batch, None)[1]
        if lora is not None:
            params = lora_lib.merge(frozen, params, lora)
        _, sums = model.loss_fn(params, batch, None, 1.0)
        return sums

    return eval_step


def check_batch_size(partitioner: Partitioner, batch_size: int, num_microbatches: int) -> None:
    """A ValueError naming BATCH_SIZE unless it splits into `num_microbatches` microbatches
    over the data-parallel degree, as the steps need (a run checks it before device work)."""
    layout_degree = partitioner.data_parallel_degree()
    if num_microbatches < 1 or batch_size % (layout_degree * num_microbatches):
        raise ValueError(
            f"BATCH_SIZE={batch_size} must be divisible by the data-parallel degree "
            f"{layout_degree} times num_microbatches={num_microbatches} "
            f"(= {layout_degree * num_microbatches})."
        )


class Setup:
    """Everything a run builds before its first step (shared by train and benchmarks).

    With `lora`, the state's params are the adapters (`lora_kernels` says which); the base
    params stay outside the state, on `base_shardings`, and are an extra argument of the
    partitioned train and eval steps. With `frozen_reference` (a preference loss's reference
    model) and no LoRA, that argument is a copy of the params (`copy_params`, which a run
    also uses to start from params it must keep: the step donates the state's).
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
        frozen_reference: bool = False,
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
            step=partitioner.replicated(),
            params=partitioner.sharding(axes.params),
            opt_state=partitioner.opt_state_sharding(axes.opt_state, abstract.opt_state),
        )
        self.abstract_state = pytrees.with_shardings(abstract, self.state_shardings)
        self.init_state = partitioner.partition(init_state, (), self.state_shardings)
        # Given params (an import or INIT_FROM_HF), a fresh optimizer state beside them.
        self.state_from_params = partitioner.partition(
            lambda params: TrainState.create(params, optimizer),
            (self.state_shardings.params,),
            self.state_shardings,
        )
        self.batch_axes = {name: P("batch", None) for name in feature_lengths}
        # The steps' frozen argument: a LoRA run's base params, or (`frozen_reference`) a
        # copy of the starting params that a preference loss compares the policy with.
        self.frozen_shardings = self.base_shardings
        if lora is None:
            params = self.state_shardings.params
            self.copy_params = partitioner.partition(
                lambda p: jax.tree.map(jnp.copy, p), (params,), params
            )
            if frozen_reference:
                self.frozen_shardings = params

    def partition_train_step(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        frozen = () if self.frozen_shardings is None else (self.frozen_shardings,)
        return self.partitioner.partition(
            step_fn,
            (self.state_shardings, self.batch_axes, *frozen),
            (self.state_shardings, None),
            donate_argnums=(0,),
        )

    def partition_eval_step(self, eval_fn: Callable[..., Any]) -> Callable[..., Any]:
        frozen = () if self.frozen_shardings is None else (self.frozen_shardings,)
        return self.partitioner.partition(
            eval_fn, (self.state_shardings.params, self.batch_axes, *frozen), None
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
    eval_step: Callable[..., Any],
    params: Any,
    iterator: pipeline.DataIterator,
    steps: int,
    objective: objective_lib.Objective | None = None,
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
    return eval_scalars(total, objective)


def eval_scalars(
    total: Mapping[str, jax.Array], objective: objective_lib.Objective | None = None
) -> dict[str, float]:
    """`eval/loss`, `eval/accuracy`, `eval/perplexity` (of the cross-entropy, z-loss
    excluded), ... from summed eval metrics (an objective's: its own summary)."""
    metrics = (objective or objective_lib.NEXT_TOKEN_PREDICTION).summarize(total)
    out = {f"eval/{k}": float(v) for k, v in metrics.items() if jnp.ndim(v) == 0}
    if "weight_sum" not in total:  # not a next-token loss: no perplexity
        return out
    out["eval/perplexity"] = float(math.exp(min(out["eval/loss"] - out["eval/z_loss"], 700.0)))
    return out


def evaluate_split(
    model: BaseModel,
    params: Any,
    partitioner: Partitioner,
    cfg: DatasetConfig,
    row_start: RowStart,
    max_batches: int | None = None,
) -> dict[str, float]:
    """Loss, token accuracy and perplexity over one pass of `cfg`'s split (the last
    partial batch left out; at most `max_batches`), with the params as they are sharded and
    the rows read from the checkpoint's `row_start`."""
    from flaxlm.data import pipeline

    cfg = dataclasses.replace(cfg, num_epochs=1, shuffle=False)
    check_batch_size(partitioner, cfg.batch_size, 1)
    converter = pipeline.converter_for(cfg, model, row_start)
    iterator = pipeline.DataIterator.create(cfg, partitioner, converter)
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


def next_batch(iterator: pipeline.DataIterator, cfg: DatasetConfig, step: int) -> Batch:
    """The next training batch; running out is an error that names the data."""
    try:
        return next(iterator)
    except StopIteration:
        import seqio

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
