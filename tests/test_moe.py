"""The mixture-of-experts layer: its three implementations and the expert-parallel dispatch
give the same loss and gradients, the aux loss is transformers', capacity drops and counts,
and settings flaxlm cannot run are errors naming them."""

import dataclasses
import functools
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flaxlm.models import base, expert_parallel, experts, grouped_matmul, qwen_moe, routing
from flaxlm.parallel.partitioning import standard_logical_axis_rules
from flaxlm.plan import flops, hlo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AXES = ("data", "fsdp", "expert", "tensor")
# The Partitioner's standard rules for this mesh: batch over (data, fsdp, expert), the experts
# over expert, the other params' embed over (fsdp, expert).
RULES = standard_logical_axis_rules(AXES)
CONFIG = qwen_moe.QwenMoeConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_position_embeddings=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    router_z_loss_coef=1e-3,
)
# float32 sums of ~100 products of O(1) terms, in other orders: rounding grows like
# sqrt(terms) x eps (1.2e-7) x the magnitude; 1e-5 leaves a 10x margin over what we see.
TOL = 1e-5


def _batch(rows: int = 8, length: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, CONFIG.vocab_size, (rows, length)).astype(np.int32)
    weights = np.ones_like(tokens)
    weights[1, 10:] = 0  # some padding: the statistics count real tokens only
    segments = weights.copy()
    return {
        "decoder_input_tokens": tokens,
        "decoder_target_tokens": tokens,
        "decoder_loss_weights": weights,
        "decoder_segment_ids": segments,
        "decoder_positions": np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape),
    }


def _model(**overrides) -> base.DecoderOnlyModel:
    return base.DecoderOnlyModel(dataclasses.replace(CONFIG, **overrides))


@functools.cache
def _params():
    # Jitted: one program, not one per operation (10 s of compiling on a 2-core host).
    shapes = {"decoder_input_tokens": (1, 8)}
    return jax.jit(lambda: _model().init_params(jax.random.PRNGKey(0), shapes))()


def _mesh(shape: tuple[int, ...], axes: tuple[str, ...] = AXES) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def _loss_and_grads(model, params, batch, mesh_shape=None):
    if mesh_shape is None:
        fn = jax.value_and_grad(model.loss_fn, has_aux=True)
        return jax.tree.map(np.asarray, jax.jit(lambda p, b: fn(p, b, None))(params, batch))
    return _on_mesh(model, params, batch, mesh_shape)[0]


def _on_mesh(model, params, batch, mesh_shape, axes=AXES, experts_over_fsdp=False):
    """`((loss, metric sums), gradients)` as numpy on a mesh of `axes` under the
    Partitioner's standard rules for them (params split as those rules say, the batch's
    rows over `batch`'s axes), and the compiled program's HLO text."""

    def fn(params, batch):
        return jax.value_and_grad(model.loss_fn, has_aux=True)(params, batch, None)

    mesh = _mesh(mesh_shape, axes)
    rules = standard_logical_axis_rules(axes, experts_over_fsdp)
    params_axes = model.params_axes({"decoder_input_tokens": (1, 8)})
    shardings = nn.logical_to_mesh_sharding(params_axes, mesh, rules)
    rows = NamedSharding(mesh, nn.logical_to_mesh_axes(("batch",), rules))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        jitted = jax.jit(fn, in_shardings=(shardings, {k: rows for k in batch}))
        compiled = jitted.lower(params, batch).compile()
        out = compiled(jax.device_put(params, shardings), jax.device_put(batch, rows))
    return jax.tree.map(np.asarray, out), compiled.as_text()


def _assert_same(got, want):
    ((loss, sums), grads), ((ref_loss, ref_sums), ref_grads) = got, want
    np.testing.assert_allclose(loss, ref_loss, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(sums["moe_expert_counts"], ref_sums["moe_expert_counts"])
    flat = jax.tree_util.tree_leaves_with_path(grads)
    for (path, g), r in zip(flat, jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=TOL, atol=TOL, err_msg=jax.tree_util.keystr(path))


def fsdp_ep_loss_and_grads() -> tuple:
    """`((loss, metric sums), gradients)` of the dropless model on the mesh of
    gin/partitioning/fsdp_ep.gin (every device on `expert`, one of the 8 experts each on 8
    devices), as numpy, every process feeding its own rows of the batch (its
    `data_layout`): what tests/multiprocess_worker.py computes with the `expert` axis
    spanning two processes, and test_multiprocess compares with one process."""
    from tests.helpers import partitioner_from_gin

    partitioner = partitioner_from_gin("fsdp_ep")
    model = _model(moe_impl="dropless")
    axes = model.params_axes({"decoder_input_tokens": (1, 8)})
    # The same values on every process (one seed), each placing the shards it holds.
    params = jax.tree.map(
        lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: np.asarray(a)[i]),
        _params(),
        partitioner.sharding(axes),
    )
    full = _batch()
    layout = partitioner.data_layout(len(full["decoder_input_tokens"]))
    rows = slice(layout.row_start, layout.row_start + layout.per_host_batch_size)
    sharding = partitioner.batch_sharding(2)
    batch = {
        k: jax.make_array_from_process_local_data(sharding, v[rows], v.shape)
        for k, v in full.items()
    }

    def fn(params, batch):
        return jax.value_and_grad(model.loss_fn, has_aux=True)(params, batch, None)

    rows_axes = {k: P("batch", None) for k in batch}
    out = partitioner.partition(fn, (axes, rows_axes), (None, None))(params, batch)
    return jax.tree.map(np.asarray, out)


@functools.cache
def _reference():
    return _loss_and_grads(_model(moe_impl="dense"), _params(), _batch())


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["dropless", "capacity"])
def test_implementations_give_the_dense_loss_and_gradients(impl):
    # A capacity of 4x the fair share holds every assignment of this batch.
    model = _model(moe_impl=impl, capacity_factor=4.0)
    got = _loss_and_grads(model, _params(), _batch())
    _assert_same(got, _reference())
    assert got[0][1]["moe_dropped"] == 0


@pytest.mark.parametrize("mesh_shape", [(1, 2, 4, 1), (1, 1, 8, 1)], ids=str)
def test_expert_parallel_gives_the_unsplit_loss_and_gradients(mesh_shape):
    model = _model(moe_impl="dropless")
    got = _loss_and_grads(model, _params(), _batch(), mesh_shape)
    _assert_same(got, _reference())
    # The tokens did travel: the experts ran in the shard_map, not partitioned by XLA.
    with jax.set_mesh(_mesh(mesh_shape)), nn.logical_axis_rules(RULES):
        jaxpr = str(jax.make_jaxpr(lambda p: model.loss_fn(p, _batch(), None))(_params()))
    assert "all_gather" in jaxpr and ("psum_scatter" in jaxpr or "reduce_scatter" in jaxpr)


def test_experts_split_over_expert_and_fsdp_give_the_unsplit_loss_and_gradients():
    """`Partitioner(experts_over_fsdp=True)`: each device holds whole experts, 1 of the 8 on
    fsdp 2 x expert 4, and gathers its expert group's 2 over fsdp on their major dim inside
    the shard_map; their gradient comes back reduce-scattered onto that one expert."""
    model = _model(moe_impl="dropless", moe_dispatch="ragged", ragged_buffer_factor=4.0)
    got, text = _on_mesh(model, _params(), _batch(), (1, 2, 4, 1), experts_over_fsdp=True)
    _assert_same(got, _reference())
    d, f = CONFIG.hidden_size, CONFIG.moe_intermediate_size
    shards = _collective_arrays(text, "reduce-scatter")
    for size in (d * 2 * f, f * d):  # wi and wo of one expert
        assert shards.count(size) >= CONFIG.num_layers, (size, shards)


def test_experts_over_fsdp_needs_an_expert_axis():
    from flaxlm.parallel.partitioning import Partitioner

    with pytest.raises(ValueError, match="experts_over_fsdp=True .* add an 'expert' axis"):
        Partitioner((1, 8, 1), ("data", "fsdp", "tensor"), experts_over_fsdp=True)


def _nan_past(out, sizes):
    """`out` with its rows past the groups NaN: what a kernel that leaves them unwritten may
    hold there."""
    return jnp.where(jnp.arange(out.shape[0])[:, None] < jnp.sum(sizes), out, jnp.nan)


# Stand-ins for the Mosaic GPU kernels on CPU, through XLA's ragged_dot, NaN past the groups.
STAND_INS = grouped_matmul.Kernels(
    forward=lambda x, w, s: _nan_past(jax.lax.ragged_dot(x, w, s), s),
    rows_grad=lambda dy, w, s: _nan_past(jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), s), s),
    weights_grad=lambda x, dy, s: jax.lax.ragged_dot_general(
        x, dy, s,
        ragged_dot_dimension_numbers=jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())),
            lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[],
        ),
    ),
)  # fmt: skip


def _untyped(out):
    """`out` typed as a Pallas kernel's output is inside a `shard_map`: varying over no mesh
    axis, whatever its operands (a host callback's output is so typed)."""
    return jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(out.shape, out.dtype), out)


UNTYPED_STAND_INS = grouped_matmul.Kernels(*(lambda *a, f=f: _untyped(f(*a)) for f in STAND_INS))


def test_kernel_grouped_matmul_gives_ragged_dots_values_and_gradients():
    """The custom VJP the Mosaic GPU kernels run through (`kernel_ragged_dot`) against XLA's
    `ragged_dot` differentiated by JAX: an empty group, rows past the groups zero both ways
    however the kernels leave them."""
    kx, kw, kt = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, (20, 8)), jax.random.normal(kw, (3, 8, 6))
    sizes, target = jnp.array([5, 0, 9], jnp.int32), jax.random.normal(kt, (20, 6))

    def loss(dot, x, w):
        y = dot(x, w, sizes)
        return jnp.sum(jnp.tanh(y) * target), y

    kernel = functools.partial(grouped_matmul.kernel_ragged_dot, kernels=STAND_INS)
    grad = jax.jit(jax.value_and_grad(loss, (1, 2), has_aux=True), static_argnums=0)
    (got, y), got_grads = grad(kernel, x, w)
    (want, _), want_grads = grad(jax.lax.ragged_dot, x, w)
    np.testing.assert_allclose(got, want, rtol=TOL)
    assert np.all(np.asarray(y[14:]) == 0)
    for g, r in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=TOL, atol=TOL)
    assert np.all(np.isfinite(np.asarray(got_grads[0])))


@pytest.mark.parametrize("mesh_shape", [None, (1, 1, 8, 1)], ids=str)
def test_kernel_grouped_matmul_gives_the_dense_loss_and_gradients(monkeypatch, mesh_shape):
    """The model's dropless experts through the kernels' custom VJP (stand-ins here), on one
    device (every row grouped: nothing zeroed) and on (1, 1, 8, 1), where each device's rows
    of other devices' experts lie past its groups: the dense reference's loss and
    gradients."""
    monkeypatch.setattr(grouped_matmul, "choose", lambda impl, x, w: "mosaic_gpu")
    monkeypatch.setattr(grouped_matmul, "mosaic_gpu_kernels", lambda: STAND_INS)
    model = _model(moe_impl="dropless", grouped_matmul="mosaic_gpu")
    _assert_same(_loss_and_grads(model, _params(), _batch(), mesh_shape), _reference())


def test_kernel_grouped_matmul_types_its_gradients_inside_a_shard_map(monkeypatch):
    """Inside a `shard_map` the kernels' outputs are typed as varying over no mesh axis
    (`_untyped`); the custom VJP still gives each gradient its operand's type, and the
    weights, the same on every device, get the sum of every device's gradient."""
    monkeypatch.setattr(grouped_matmul, "mosaic_gpu_kernels", lambda: UNTYPED_STAND_INS)
    monkeypatch.setattr(grouped_matmul, "choose", lambda impl, x, w: impl)
    mesh = _mesh((8,), ("e",))
    kx, kw, kt = jax.random.split(jax.random.key(1), 3)
    x, w = jax.random.normal(kx, (8 * 6, 8)), jax.random.normal(kw, (3, 8, 4))
    target = jax.random.normal(kt, (8 * 6, 4))

    def loss(impl, x, w, target):
        def body(x, w, target):
            sizes = jnp.array([2, 0, 3], jnp.int32)  # one row past the groups a device
            y = grouped_matmul.ragged_dot(x, w, sizes, impl=impl)
            return jax.lax.psum(jnp.sum(jnp.tanh(y) * target), "e")

        specs = (P("e"), P(), P("e"))
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())(x, w, target)

    with jax.set_mesh(mesh):
        got, want = (
            jax.jit(jax.value_and_grad(functools.partial(loss, impl), (0, 1)))(x, w, target)
            for impl in ("mosaic_gpu", "xla")
        )
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, r, rtol=TOL, atol=TOL)


def test_mosaic_gpu_off_a_hopper_gpu_is_an_error_naming_the_setting():
    x, w = jnp.ones((4, 64), jnp.bfloat16), jnp.ones((2, 64, 64), jnp.bfloat16)
    assert grouped_matmul.choose("auto", x, w) == "xla"
    with pytest.raises(ValueError, match="grouped_matmul='mosaic_gpu' needs an NVIDIA Hopper"):
        grouped_matmul.ragged_dot(x, w, jnp.array([2, 2]), impl="mosaic_gpu")


def test_a_hopper_cluster_compiled_for_from_here_gets_the_kernels_and_their_flops():
    """The planner compiles for `h100:NxM` from a host without a GPU: 'auto' chooses by the
    mesh's devices, not this process's (XLA's dense fallback it got before, every local
    expert over every row, made the MoE steps tens of GiB too large), JAX's kernels compile
    for them, and the planner counts their FLOPs, which XLA's cost analysis leaves out."""
    from flaxlm.plan import aot

    mesh = jax.sharding.Mesh(aot.gpu_devices("h100", 8), ("x",))
    m, k, n, g = 512, 128, 192, 4
    whole = NamedSharding(mesh, P())
    shapes = ((m, k), (g, k, n), (g,))
    dtypes = (jnp.bfloat16, jnp.bfloat16, jnp.int32)
    args = [jax.ShapeDtypeStruct(s, d, sharding=whole) for s, d in zip(shapes, dtypes)]

    def loss(x, w, sizes):
        return jnp.sum(grouped_matmul.ragged_dot(x, w, sizes).astype(jnp.float32) ** 2)

    assert not grouped_matmul.hopper()  # this process's devices: CPUs
    with jax.set_mesh(mesh):
        assert grouped_matmul.hopper()
        text = jax.jit(jax.grad(loss, (0, 1))).lower(*args).compile().as_text()
    assert text.count('custom_call_target="mosaic_gpu') == 3  # forward, both gradients
    costs = flops.matmul_costs(text)
    assert costs["dot_flops"] == 0 and costs["custom_calls"] == 3
    assert costs["custom_flops"] == 3 * 2 * m * k * n


@pytest.mark.parametrize(
    "dispatch,mesh_shape,factor",
    [
        ("all_to_all", (1, 1, 8, 1), dict(capacity_factor=4.0)),
        ("ragged", (1, 2, 4, 1), dict(ragged_buffer_factor=4.0)),
    ],
    ids=str,
)
def test_bounded_dispatches_give_the_dropless_loss_and_gradients(dispatch, mesh_shape, factor):
    """Each device's 16 tokens sent to their experts' devices and back give the unsplit
    loss and gradients, nothing dropped: `all_to_all` on (1, 1, 8, 1) in buffers of
    capacity_factor x the fair share (4 x 2 x 16 / 8 = 16 rows a device: an expert takes a
    token at most once), `ragged` on (1, 2, 4, 1) into receive buffers of the axis's size
    (4) x the 16 x 2 assignments a device sends (the whole group's: none can drop; on CPU
    through `dense_ragged_all_to_all`)."""
    model = _model(moe_impl="dropless", moe_dispatch=dispatch, **factor)
    got = _loss_and_grads(model, _params(), _batch(), mesh_shape)
    _assert_same(got, _reference())
    assert got[0][1]["moe_dropped"] == 0
    with jax.set_mesh(_mesh(mesh_shape)), nn.logical_axis_rules(RULES):
        jaxpr = str(jax.make_jaxpr(lambda p: model.loss_fn(p, _batch(), None))(_params()))
    assert "all_to_all" in jaxpr


def _over_experts(fn, args: int):
    """`fn` in a `shard_map` over the mesh's `expert` axis, its `args` arguments and its
    outputs split over it."""
    return jax.shard_map(fn, in_specs=(P("expert"),) * args, out_specs=P("expert"))


def test_dense_ragged_all_to_all_is_jax_ragged_all_to_all():
    """The CPU formulation on `jax.lax.ragged_all_to_all`'s documented example (axis of
    2): each sender's slices written where it says on their receivers, `output` elsewhere."""
    example = [
        [[1, 2, 2], [3, 4, 0]],  # operand, a row per device
        [[0, 0, 0, 0]] * 2,  # output
        [[0, 1], [0, 1]],  # input_offsets
        [[1, 2], [1, 1]],  # send_sizes
        [[0, 0], [1, 2]],  # output_offsets
        [[1, 1], [2, 1]],  # recv_sizes
    ]
    args = [np.asarray(a, np.float32 if i < 2 else np.int32) for i, a in enumerate(example)]

    def body(*args):
        return expert_parallel.dense_ragged_all_to_all(*(a[0] for a in args))[None]

    with jax.set_mesh(_mesh((2,), ("expert",))):
        got = jax.jit(_over_experts(body, 6))(*args)
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_ragged_dispatch_drops_past_a_receivers_buffer_and_counts():
    """Each receiver's buffer holds `rows` rows: the senders' chunks in device order, each
    sorted by rank, then token; the rows past it are dropped, contribute zero and are
    counted: the loss and gradients of the dense experts with their weights zeroed. On a
    TPU mesh the rows travel by `jax.lax.ragged_all_to_all`, both ways, typed as varying
    over `expert` (the op types its result as its `output` buffer)."""
    n, local, tokens, k, d, f, rows = 4, 2, 6, 2, 8, 16, 16  # tokens a device
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n * tokens, d)).astype(np.float32)
    wi = rng.normal(size=(n * local, d, 2, f)).astype(np.float32)
    wo = rng.normal(size=(n * local, f, d)).astype(np.float32)
    ids = np.stack([rng.choice(n * local, k, replace=False) for _ in range(n * tokens)])
    ids = ids.astype(np.int32)
    ids[: 2 * tokens] = [0, 1]  # devices 0 and 1: all their 24 rows to device 0
    weights = rng.random((n * tokens, k)).astype(np.float32)
    want = np.zeros((n * tokens, k), np.float32)
    filled = np.zeros(n, int)  # rows each receiver holds
    for device in range(n):
        mine = [(t, r) for r in range(k) for t in range(device * tokens, (device + 1) * tokens)]
        for t, r in sorted(mine, key=lambda a: ids[a] // local):  # stable
            want[t, r] = filled[ids[t, r] // local] >= rows
            filled[ids[t, r] // local] += 1
    # Device 0's 12 rows fit, then device 1's first 4 (its best experts, in token order).
    assert want[:tokens].sum() == 0 and want[tokens : 2 * tokens].sum() == 8

    def body(x, wi, wo, weights, ids):
        return expert_parallel.ragged_experts(x, wi, wo, weights, ids, "silu", rows)

    def ragged(x, wi, wo, weights):
        y, dropped = _over_experts(body, 5)(x, wi, wo, weights, ids)
        return jnp.sum(jnp.tanh(y)), dropped

    def dense(x, wi, wo, weights):
        y = experts.dense_experts(x, wi, wo, weights * (1 - want), ids, "silu")
        return jnp.sum(jnp.tanh(y)), None

    args = (x, wi, wo, weights)
    with jax.set_mesh(_mesh((n,), ("expert",))):
        (loss, dropped), grads = jax.jit(jax.value_and_grad(ragged, (0, 1, 2, 3), True))(*args)
    (want_loss, _), want_grads = jax.jit(jax.value_and_grad(dense, (0, 1, 2, 3), True))(*args)
    np.testing.assert_array_equal(dropped, want)
    # float32 sums of d x f products of O(1) normals: rounding ~sqrt(terms) x eps x |y|.
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for g, r in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
    tpu = jax.sharding.AbstractDevice(device_kind="TPU v5", num_cores=None, platform="tpu")
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((n,), ("expert",), abstract_device=tpu)
    ):
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda *a: ragged(*a)[0]))(*args))
    assert jaxpr.count("ragged_all_to_all") == 5  # rows, ids, outputs; the two transposes
    # Each device's rows and experts are its own: no gradient summed over the devices.
    assert "psum" not in jaxpr


def test_all_to_all_dispatch_drops_past_capacity_and_counts():
    """Each device sends each device of its expert group at most `capacity` assignments, a
    token's best expert before its second, then in token order; the rest contribute zero
    and are counted: the dense experts with the dropped assignments' weights zeroed."""
    n, tokens, k, d, f = 8, 4, 2, 8, 16  # tokens a device; one expert a device
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n * tokens, d)).astype(np.float32)
    wi = rng.normal(size=(n, d, 2, f)).astype(np.float32)
    wo = rng.normal(size=(n, f, d)).astype(np.float32)
    ids = np.stack([rng.choice(n, k, replace=False) for _ in range(n * tokens)]).astype(np.int32)
    ids[:tokens] = [0, 1]  # device 0's tokens all to experts 0 and 1: 3 of 4 drop on each
    weights = rng.random((n * tokens, k)).astype(np.float32)
    capacity = 1

    def body(x, wi, wo, weights, ids):
        return expert_parallel.all_to_all_experts(x, wi, wo, weights, ids, "silu", capacity)

    spec = P("expert")
    with jax.set_mesh(_mesh((1, 1, 8, 1))):
        y, dropped = jax.jit(jax.shard_map(body, in_specs=(spec,) * 5, out_specs=(spec, spec)))(
            x, wi, wo, weights, ids
        )
    want = np.zeros((n * tokens, k), np.float32)
    for device in range(n):
        sent = np.zeros(n, int)
        for rank in range(k):
            for t in range(device * tokens, (device + 1) * tokens):
                sent[ids[t, rank]] += 1
                want[t, rank] = sent[ids[t, rank]] > capacity
    assert want[:tokens].sum() == 6
    np.testing.assert_array_equal(dropped, want)
    dense = jax.jit(experts.dense_experts, static_argnums=5)
    kept = dense(x, wi, wo, weights * (1 - want), ids, "silu")
    # float32 sums of d x f products of O(1) normals: rounding ~sqrt(terms) x eps x |y|.
    np.testing.assert_allclose(y, kept, rtol=1e-5, atol=1e-4)


def _collective_arrays(text: str, kind: str) -> list[int]:
    """Element counts of the arrays each `kind` op (all-reduce, reduce-scatter) of an HLO
    text returns, one entry per array of a tuple-shaped (combined) op."""
    sizes = []
    for line in text.splitlines():
        m = hlo.INSTRUCTION_RE.match(line)
        if not m:
            continue
        type_str, opcode, _ = hlo.split_type(m.group(2))
        if opcode in (kind, f"{kind}-start"):
            for _, dims in hlo.SHAPE_RE.findall(type_str):
                sizes.append(math.prod(int(d) for d in dims.split(",") if d))
    return sizes


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 4, 1)], ids=str)
def test_fsdp_reduce_scatters_the_experts_gradient(mesh_shape):
    """Under fsdp the experts' weights enter the MoE shard_map split over fsdp on `embed`,
    as their params lie, and are gathered inside: their gradient comes back as a
    reduce-scatter onto each device's shard, where taken whole it was all-reduced whole;
    over `data` (replicas) only the shard is all-reduced. The same loss and gradients."""
    model = _model(moe_impl="dropless")
    got, text = _on_mesh(model, _params(), _batch(), mesh_shape, ("data", "fsdp", "tensor"))
    _assert_same(got, _reference())
    e, d, f = CONFIG.num_experts, CONFIG.hidden_size, CONFIG.moe_intermediate_size
    fsdp = mesh_shape[1]
    shards = _collective_arrays(text, "reduce-scatter")
    # Each layer's wi [experts, embed, 2, mlp] and wo [experts, mlp, embed], embed / fsdp.
    for size in (e * d * 2 * f // fsdp, e * f * d // fsdp):
        assert shards.count(size) >= CONFIG.num_layers, (size, shards)
    # No all-reduce of a whole expert's-size weight (its gate or up half, or wo, is the
    # smallest: e * d * f elements; every other param of this model is smaller).
    assert max(_collective_arrays(text, "all-reduce")) < e * d * f


LAYERS_TOKENS_EXPERTS_K = (3, 40, 8, 2)


def routed_layers():
    """Random router logits of 3 layers of 40 tokens over 8 experts (k=2), a padding mask
    (0 on padding) and the stacked router statistics of those layers."""
    layers, tokens, experts, k = LAYERS_TOKENS_EXPERTS_K
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(layers, tokens, experts)).astype(np.float32)
    mask = (rng.random(tokens) > 0.3).astype(np.float32)

    @jax.jit  # one program for the 3 layers, not one per operation
    def layer_stats(layer, mask):
        return routing.router_stats(
            layer, routing.route(layer, k, "softmax_topk", False)[1], mask, experts
        )

    stats = [layer_stats(layer, mask) for layer in logits]
    sown = {f"layers_{i}": {routing.ROUTER_STATS: (s,)} for i, s in enumerate(stats)}
    return logits, mask, routing.collect_router_stats(sown)


def test_aux_loss_is_transformers_load_balancing_loss():
    torch = pytest.importorskip("torch")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    _, _, experts, k = LAYERS_TOKENS_EXPERTS_K
    logits, mask, stats = routed_layers()
    ours = routing.router_losses(stats, experts, k)["aux"]
    theirs = load_balancing_loss_func(
        tuple(torch.from_numpy(x) for x in logits),
        experts,
        k,
        torch.from_numpy(mask).reshape(4, 10),
    )
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-6)


def test_per_layer_aux_loss_counts_each_layers_imbalance_that_pooled_hides():
    # 2 layers of 4 tokens, 4 experts, k=1. Layer 0 sends its tokens to experts 0 and 1
    # (f = [1/2, 1/2, 0, 0], mean probabilities p = [3/8, 3/8, 1/8, 1/8]), layer 1 to
    # experts 2 and 3 (the mirror image): each layer's loss is 4 x (2 x 1/2 x 3/8) = 3/2,
    # their mean 3/2; pooled, both layers' f and p are uniform: 4 x (4 x 1/4 x 1/4) = 1 = k,
    # what perfect balance reads. The sums are of exact binary fractions: equal, not close.
    stats = {
        "expert_counts": jnp.array([[2.0, 2.0, 0.0, 0.0], [0.0, 0.0, 2.0, 2.0]]),
        "prob_sums": jnp.array([[1.5, 1.5, 0.5, 0.5], [0.5, 0.5, 1.5, 1.5]]),
        "tokens": jnp.array([4.0, 4.0]),
        "z_sum": jnp.array([1.0, 3.0]),
        "dropped": jnp.zeros(2),
    }
    per_layer = routing.router_losses(stats, 4, 1, scope="per_layer")
    pooled = routing.router_losses(stats, 4, 1)
    assert float(per_layer["aux"]) == 1.5 and float(pooled["aux"]) == 1.0
    assert float(per_layer["z"]) == float(pooled["z"]) == 0.5  # (1 + 3) / 8 tokens


def test_per_layer_aux_loss_is_the_layers_mean_of_transformers_loss():
    # Switch Transformer's loss of each layer alone, as transformers computes it on that
    # layer's logits (one-layer tuple), averaged over the layers; padding left out.
    torch = pytest.importorskip("torch")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    _, _, experts, k = LAYERS_TOKENS_EXPERTS_K
    logits, mask, stats = routed_layers()
    ours = routing.router_losses(stats, experts, k, scope="per_layer")["aux"]
    mask_rows = torch.from_numpy(mask).reshape(4, 10)
    theirs = np.mean(
        [
            float(load_balancing_loss_func((torch.from_numpy(x),), experts, k, mask_rows))
            for x in logits
        ]
    )
    np.testing.assert_allclose(float(ours), theirs, rtol=1e-6)


def test_aux_loss_scope_is_a_training_choice_config_json_leaves_out():
    trained = dataclasses.replace(CONFIG, router_aux_loss_scope="per_layer")
    written = qwen_moe.config_to_hf(trained)
    assert not any("scope" in key for key in written)
    assert qwen_moe.config_from_hf(written).router_aux_loss_scope == "pooled"


def test_routers_agree_when_renormalised():
    logits = jax.random.normal(jax.random.PRNGKey(2), (16, 8))
    w1, i1 = routing.route(logits, 3, "softmax_topk", True)
    w2, i2 = routing.route(logits, 3, "topk_softmax", False)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_allclose(w1, w2, rtol=1e-6)


def test_small_capacity_drops_and_counts_assignments():
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 8))
    wi = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 2, 16))
    wo = jax.random.normal(jax.random.PRNGKey(2), (4, 16, 8))
    ids = jnp.zeros((32, 1), jnp.int32)  # every token to expert 0
    weights = jnp.ones((32, 1))
    capacity = experts.expert_capacity(32, 1, 4, 0.5)  # 4 of 32
    run = jax.jit(experts.capacity_experts, static_argnums=(5, 6))
    y, dropped = run(x, wi, wo, weights, ids, "silu", capacity)
    assert capacity == 4 and float(dropped.sum()) == 28
    want = jax.jit(experts.dense_experts, static_argnums=5)(x, wi, wo, weights, ids, "silu")
    np.testing.assert_allclose(y[:4], want[:4], rtol=1e-5, atol=1e-5)  # the first 4 kept
    np.testing.assert_array_equal(y[4:], 0)


def test_capacity_telemetry_reports_the_dropped_fraction():
    model = _model(moe_impl="capacity", capacity_factor=0.25)
    (_, sums), _ = _loss_and_grads(model, _params(), _batch())
    stats = routing.summarize(sums)
    assert 0 < float(stats["moe_dropped_fraction"]) < 1
    # Scalars only (what the metric writers take), one load per MoE layer.
    assert all(np.ndim(v) == 0 for v in stats.values())
    per_layer = [float(stats[f"moe_max_load_{i}"]) for i in range(CONFIG.num_layers)]
    assert float(stats["moe_max_load"]) == max(per_layer) and min(per_layer) >= 1.0
    assert 0.0 <= float(stats["moe_min_load"]) <= 1.0


@pytest.mark.parametrize(
    "field,value",
    [
        ("router", "sinkhorn"),
        ("moe_impl", "megablocks"),
        ("moe_dispatch", "ring"),
        ("grouped_matmul", "triton"),
        ("ragged_buffer_factor", 0.0),
        ("router_aux_loss_scope", "global"),
    ],
    ids=str,
)
def test_unknown_settings_are_errors_naming_them(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(CONFIG, **{field: value})


def test_experts_not_divisible_by_the_expert_axis_is_an_error():
    model = _model(num_experts=6)
    params = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    mesh = _mesh((1, 1, 4, 2))
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        with pytest.raises(ValueError, match="num_experts 6 .* 'expert' axis \\(4\\)"):
            jax.eval_shape(lambda p: model.loss_fn(p, _batch(), None), params)


@pytest.mark.slow
def test_lora_on_experts_trains_one_pair_per_expert_and_merges():
    """LoRA over the stacked experts (`experts/wi` `[expert, embed, 2, mlp]`, `experts/wo`):
    adapters `[layers, expert, in, r]` / `[layers, expert, r, out...]` split over `expert` as
    their kernels, a scanned run on an expert-parallel mesh trains them (loss falls, the
    base untouched) and the merged params' logits equal the adapted model's."""
    from flax import traverse_util

    from flaxlm.parallel.partitioning import Partitioner
    from flaxlm.training import lora, steps
    from tests.helpers import adamw, feature_lengths, random_batch

    config = dataclasses.replace(CONFIG, vocab_size=128, scan_layers=True)
    model = base.DecoderOnlyModel(config)
    partitioner = Partitioner(mesh_shape=(1, 2, 4, 1), mesh_axis_names=AXES)
    cfg = lora.LoraConfig(rules=((r"experts/(wi|wo)$", 4), (r"q_proj/kernel$", 4)))
    setup = steps.Setup(model, partitioner, adamw(3e-2), feature_lengths(), lora=cfg)
    frozen, state = setup.init_base(), setup.init_state()
    flat = traverse_util.flatten_dict(state.params, sep="/")
    experts = "layers/block/mlp/experts"
    e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
    assert flat[f"{experts}/wi_lora_a"].shape == (2, e, d, 4)
    assert flat[f"{experts}/wi_lora_b"].shape == (2, e, 4, 2, f)
    assert flat[f"{experts}/wo_lora_a"].shape == (2, e, f, 4)
    assert flat[f"{experts}/wo_lora_b"].shape == (2, e, 4, d)
    assert flat[f"{experts}/wi_lora_a"].sharding.spec[1] == "expert"

    step = setup.partition_train_step(steps.make_train_step(model, partitioner, 3e-2, lora=cfg))
    before = jax.device_get(frozen)
    losses = []
    for i in range(4):
        state, metrics = step(state, random_batch(seed=i % 2), frozen)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    jax.tree.map(np.testing.assert_array_equal, before, jax.device_get(frozen))
    moved = traverse_util.flatten_dict(jax.device_get(state.params), sep="/")
    assert np.abs(moved[f"{experts}/wo_lora_b"]).max() > 0

    batch = random_batch(seed=5)
    adapted = lora.with_adapters(frozen, state.params, cfg.alpha)
    merged = setup.partition_merge()(frozen, state.params)
    logits = jax.jit(model.compute_logits)
    np.testing.assert_allclose(logits(merged, batch), logits(adapted, batch), atol=TOL, rtol=TOL)
