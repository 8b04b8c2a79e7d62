"""The Partitioner's promises on 8 simulated CPU devices."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from flaxlm.parallel.partitioning import Partitioner, resolve_mesh_shape

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "shape, expected",
    [
        ((8, 1, 1), (8, 1, 1)),
        ((1, 8, 1), (1, 8, 1)),
        ((2, 2, 2), (2, 2, 2)),
        ((1, -1, 2), (1, 4, 2)),
    ],
)
def test_mesh_shapes_that_divide_the_devices_build(shape, expected):
    partitioner = Partitioner(mesh_shape=shape)
    assert partitioner.mesh.devices.shape == expected
    assert partitioner.mesh.axis_names == ("data", "fsdp", "tensor")
    assert sorted(d.id for d in partitioner.mesh.devices.flat) == list(range(8))


@pytest.mark.parametrize("shape", [(3, -1, 1), (2, 2, 3)])
def test_mesh_shape_that_does_not_divide_the_devices_names_shape_and_count(shape):
    with pytest.raises(ValueError) as e:
        Partitioner(mesh_shape=shape)
    message = str(e.value)
    assert str(shape) in message and "8" in message


def test_more_than_one_minus_one_is_an_error():
    with pytest.raises(ValueError, match="at most one -1"):
        resolve_mesh_shape((-1, -1, 1), 8)


def test_logical_axes_follow_the_standard_rules():
    partitioner = Partitioner(mesh_shape=(2, 2, 2))
    assert partitioner.mesh_axes(("embed", "mlp")) == P("fsdp", "tensor")
    assert partitioner.mesh_axes(("vocab", "embed")) == P("tensor", "fsdp")
    # Activations: batch takes fsdp, so embed stays whole.
    assert partitioner.mesh_axes(("batch", "length", "embed")) == P(("data", "fsdp"), None, None)
    assert partitioner.mesh_axes(("layers", "embed", "heads", "head_dim")) == P(
        None, "fsdp", "tensor", None
    )


def test_logical_axis_without_a_rule_is_named():
    partitioner = Partitioner(mesh_shape=(1, 8, 1))
    with pytest.raises(ValueError, match="router_group"):
        partitioner.mesh_axes(("router_group", "embed"))


def test_experts_are_replicated_without_an_expert_axis():
    partitioner = Partitioner(mesh_shape=(1, 4, 2))
    assert partitioner.mesh_axes(("expert", "embed", None, "mlp")) == P(
        None, "fsdp", None, "tensor"
    )


def test_the_partitioning_file_splits_experts_and_batch_and_keeps_params_sharded():
    from tests.helpers import partitioner_from_gin

    partitioner = partitioner_from_gin("fsdp_ep")
    assert dict(zip(partitioner.mesh_axis_names, partitioner.mesh_shape)) == {
        "data": 1,
        "fsdp": 1,
        "expert": 8,
        "tensor": 1,
    }
    # Outside the MoE layers the expert axis splits the batch: no device idles.
    assert partitioner.batch_mesh_axes() == ("data", "fsdp", "expert")
    assert partitioner.data_parallel_degree() == 8


def test_expert_axis_splits_the_experts_and_the_params_over_every_device():
    axes = ("data", "fsdp", "expert", "tensor")
    partitioner = Partitioner(mesh_shape=(1, 2, 2, 2), mesh_axis_names=axes)
    assert partitioner.mesh_axes(("batch", "length", "embed")) == P(
        ("data", "fsdp", "expert"), None, None
    )
    # The experts over `expert`; their embed dim, whose expert axis is taken, over fsdp.
    assert partitioner.mesh_axes(("expert", "embed", None, "mlp")) == P(
        "expert", "fsdp", None, "tensor"
    )
    assert partitioner.mesh_axes(("expert", "mlp", "embed")) == P("expert", "tensor", "fsdp")
    # Every other param sharded over every device, as under fsdp.
    assert partitioner.mesh_axes(("embed", "mlp")) == P(("fsdp", "expert"), "tensor")
    assert partitioner.mesh_axes(("vocab", "embed")) == P("tensor", ("fsdp", "expert"))
    # With context parallelism as well.
    both = Partitioner(
        mesh_shape=(1, 2, 2, 2, 1), mesh_axis_names=("data", "fsdp", "sequence", "expert", "tensor")
    )
    assert both.mesh_axes(("batch", "length", "embed")) == P(
        ("data", "fsdp", "expert"), "sequence", None
    )
    assert both.mesh_axes(("embed", "mlp")) == P(("fsdp", "sequence", "expert"), "tensor")
    assert both.mesh_axes(("expert", "embed", None, "mlp")) == P(
        "expert", ("fsdp", "sequence"), None, "tensor"
    )


def test_data_layout_single_process_reads_the_whole_batch():
    layout = Partitioner(mesh_shape=(2, 2, 2)).data_layout(16)
    assert (layout.per_host_batch_size, layout.shard_index, layout.num_shards) == (16, 0, 1)


def test_batch_not_divisible_by_data_parallel_degree_is_an_error():
    with pytest.raises(ValueError, match="not divisible by the data-parallel degree 4"):
        Partitioner(mesh_shape=(2, 2, 2)).data_layout(6)


def test_zero1_shards_optimizer_state_over_data_and_keeps_params_replicated():
    partitioner = Partitioner(mesh_shape=(8, 1, 1), optimizer_sharding="zero1")
    axes = {"w": P("embed", "mlp"), "b": P("mlp")}
    shapes = {
        "w": jax.ShapeDtypeStruct((16, 24), np.float32),
        "b": jax.ShapeDtypeStruct((24,), np.float32),
    }
    params = partitioner.sharding(axes)
    opt = partitioner.opt_state_sharding(axes, shapes)
    assert params["w"].is_fully_replicated and params["b"].is_fully_replicated
    assert opt["w"].shard_shape((16, 24)) == (2, 24)
    assert opt["b"].shard_shape((24,)) == (3,)


def test_optimizer_sharding_must_be_known():
    with pytest.raises(ValueError, match="zero1"):
        Partitioner(optimizer_sharding="zero3")


def test_partitioned_function_runs_under_logical_constraints():
    import flax.linen as nn

    partitioner = Partitioner(mesh_shape=(2, 2, 2))

    def fn(x):
        return nn.with_logical_constraint(x * 2, ("batch", "embed"))

    f = partitioner.partition(fn, P("batch", "embed"), P("batch", "embed"))
    out = f(np.ones((8, 4), np.float32))
    assert out.sharding.spec == P(("data", "fsdp"), None)
    np.testing.assert_array_equal(np.asarray(out), 2 * np.ones((8, 4)))
