"""The same batch gives the same loss and gradients however the work is partitioned."""

import functools

import jax
import numpy as np
import pytest

from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import steps as train_steps
from flaxlm.training.steps import Setup
from tests.helpers import adamw, feature_lengths, random_batch, tiny_gptj

MESHES = {
    "dp8": ((8, 1, 1), "params"),
    "fsdp8": ((1, 8, 1), "params"),
    "tp2_fsdp4": ((1, 4, 2), "params"),
    "zero1": ((8, 1, 1), "zero1"),
}


@functools.cache
def _grads_and_step(mesh_shape, optimizer_sharding, num_microbatches=1):
    model = tiny_gptj()
    partitioner = Partitioner(mesh_shape=mesh_shape, optimizer_sharding=optimizer_sharding)
    setup = Setup(model, partitioner, adamw(), feature_lengths())
    state = setup.init_state()
    batch = random_batch()
    rng = jax.random.PRNGKey(0)

    def grads_fn(params, batch):
        return train_steps.accumulate_gradients(
            model, partitioner, params, batch, rng, num_microbatches
        )

    grads, sums = partitioner.partition(
        grads_fn, (setup.state_shardings.params, setup.batch_axes), None
    )(state.params, batch)
    step = setup.partition_train_step(
        train_steps.make_train_step(model, partitioner, 1e-2, num_microbatches=num_microbatches)
    )
    new_state, metrics = step(state, batch)
    return (
        jax.device_get(grads),
        float(sums["loss_sum"] / sums["weight_sum"]),
        jax.device_get(new_state.params),
        float(metrics["loss"]),
    )


def _assert_trees_close(a, b, tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


@functools.cache
def _single_device_reference():
    model = tiny_gptj()
    partitioner = Partitioner(mesh_shape=(1, 1, 1), devices=jax.devices()[:1])
    setup = Setup(model, partitioner, adamw(), feature_lengths())
    state = setup.init_state()
    batch = random_batch()
    grads, sums = jax.jit(
        lambda p, b: train_steps.accumulate_gradients(
            model, partitioner, p, b, jax.random.PRNGKey(0), 1
        )
    )(state.params, batch)
    return jax.device_get(grads), float(sums["loss_sum"] / sums["weight_sum"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MESHES))
def test_same_batch_same_loss_and_gradients_under_every_mesh(name):
    ref_grads, ref_loss = _single_device_reference()
    grads, loss, _, step_loss = _grads_and_step(*MESHES[name])
    assert abs(loss - ref_loss) < 1e-5 and abs(step_loss - ref_loss) < 1e-5
    _assert_trees_close(grads, ref_grads, 1e-5)


def test_one_train_step_gives_the_same_params_under_dp_fsdp_tp_and_zero1():
    results = {name: _grads_and_step(*cfg)[2] for name, cfg in MESHES.items()}
    for name in MESHES:
        _assert_trees_close(results[name], results["dp8"], 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(8, 1, 1), (1, 4, 2)])
def test_four_microbatches_give_the_same_gradients_as_one_batch(mesh):
    grads_1, loss_1, params_1, _ = _grads_and_step(mesh, "params", num_microbatches=1)
    grads_4, loss_4, params_4, _ = _grads_and_step(mesh, "params", num_microbatches=4)
    assert abs(loss_1 - loss_4) < 1e-6
    _assert_trees_close(grads_4, grads_1, 1e-6)
    _assert_trees_close(params_4, params_1, 1e-5)


def test_batch_size_not_divisible_by_data_degree_times_microbatches_is_an_error():
    partitioner = Partitioner(mesh_shape=(4, 2, 1))
    with pytest.raises(ValueError, match="BATCH_SIZE=24 must be divisible .* 32"):
        train_steps.check_batch_size(partitioner, 24, 4)
