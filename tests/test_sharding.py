"""GPT-J's params and optimizer state land where the logical axis rules say."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from flaxlm.parallel.partitioning import Partitioner
from flaxlm.parallel.pytrees import path_name
from flaxlm.training.steps import Setup
from tests.helpers import adamw, feature_lengths, tiny_gptj


def _setup(mesh_shape, optimizer_sharding="params", **model_overrides):
    partitioner = Partitioner(mesh_shape=mesh_shape, optimizer_sharding=optimizer_sharding)
    model = tiny_gptj(**model_overrides)
    return Setup(model, partitioner, adamw(), feature_lengths())


def _leaves_with_axes(setup):
    axes = jax.tree_util.tree_flatten_with_path(
        setup.params_axes, is_leaf=lambda x: isinstance(x, P)
    )[0]
    shardings = jax.tree.leaves(setup.state_shardings.params)
    shapes = jax.tree.leaves(setup.abstract_state.params)
    return [
        (path_name(p), a, s, x.shape) for (p, a), s, x in zip(axes, shardings, shapes, strict=True)
    ]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_fsdp8_splits_every_embed_dimension_eight_ways(scan_layers):
    setup = _setup((1, 8, 1), scan_layers=scan_layers)
    checked = 0
    for name, axes, sharding, shape in _leaves_with_axes(setup):
        shard = sharding.shard_shape(shape)
        for dim, axis in enumerate(axes):
            if axis == "embed":
                assert shard[dim] * 8 == shape[dim], (name, axes, shard)
                checked += 1
            else:
                assert shard[dim] == shape[dim], (name, axes, shard)
    assert checked >= 10


def test_fsdp4_tp2_splits_mlp_heads_vocab_over_tensor_and_embed_over_fsdp():
    setup = _setup((1, 4, 2))
    seen = set()
    for name, axes, sharding, shape in _leaves_with_axes(setup):
        shard = sharding.shard_shape(shape)
        for dim, axis in enumerate(axes):
            want = {"mlp": 2, "heads": 2, "vocab": 2, "embed": 4}.get(axis, 1)
            # embed is only split where no tensor-split dim took fsdp... it never does.
            assert shard[dim] * want == shape[dim], (name, axes, shard)
            seen.add(axis)
    assert {"mlp", "heads", "vocab", "embed"} <= seen


def test_materialized_params_have_the_planned_shardings():
    setup = _setup((1, 4, 2))
    state = setup.init_state()
    for arr, sharding in zip(
        jax.tree.leaves(state.params), jax.tree.leaves(setup.state_shardings.params), strict=True
    ):
        assert arr.sharding.is_equivalent_to(sharding, arr.ndim)


def test_optimizer_state_mirrors_the_params():
    setup = _setup((1, 4, 2))
    adam_state = setup.state_shardings.opt_state[1]  # chain: clip, adam, decay, lr
    for mu, nu, p in zip(
        jax.tree.leaves(adam_state.mu),
        jax.tree.leaves(adam_state.nu),
        jax.tree.leaves(setup.state_shardings.params),
        strict=True,
    ):
        assert mu.spec == p.spec and nu.spec == p.spec


def test_zero1_replicates_params_and_shards_optimizer_state():
    setup = _setup((8, 1, 1), optimizer_sharding="zero1")
    for p in jax.tree.leaves(setup.state_shardings.params):
        assert p.is_fully_replicated
    adam_state = setup.state_shardings.opt_state[1]
    shapes = setup.abstract_state.opt_state[1]
    for sharding, shape in zip(jax.tree.leaves(adam_state.mu), jax.tree.leaves(shapes.mu)):
        shard = sharding.shard_shape(shape.shape)
        assert any(s * 8 == d for s, d in zip(shard, shape.shape)), (sharding, shape.shape)


def test_adafactor_factored_state_gets_a_valid_sharding():
    from flaxlm.training import optimizers

    partitioner = Partitioner(mesh_shape=(1, 4, 2))
    tx = optimizers.create_optimizer(name="adafactor", learning_rate=1e-3)
    setup = Setup(tiny_gptj(), partitioner, tx, feature_lengths())
    state = setup.init_state()
    assert int(state.step) == 0
