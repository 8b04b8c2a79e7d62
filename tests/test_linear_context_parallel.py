"""Context parallelism for linear attention (`models/linear_context_parallel.py`): a tiny
Qwen3-Next (a Gated DeltaNet layer, then a full one) and a tiny Kimi Linear (a Kimi Delta
Attention layer, a decay per key channel, then latent attention without rotary) with their
sequence split over the mesh's `sequence` axis give the loss and gradients of the model
unsplit, in the load-balanced order and in order, beside data and tensor parallelism, on
packed rows whose segments start inside a piece, exactly at a shard boundary, a few positions
after one (the convolution's inputs across it are another segment's) and run across several
shards."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from flaxlm.models import kimi_linear, qwen3_next, stacks
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.parallel.partitioning import Partitioner

AXES = ("data", "fsdp", "sequence", "tensor")
EPS = float(np.finfo(np.float32).eps)
ROWS, LENGTH = 2, 64
LINEAR, FULL = qwen3_next.LINEAR, qwen3_next.FULL
QWEN3_NEXT = dict(
    model_type="qwen3_next",
    vocab_size=128,
    hidden_size=32,
    num_layers=2,
    layer_types=(LINEAR, FULL),
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    num_experts=0,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    linear_attention_chunk_size=5,  # pieces of 4 to 32 positions: partial chunks
    max_position_embeddings=LENGTH,
    attention_chunk_size=16,
)
# Dense MLPs (the experts' split is not what is tested); two linear heads of 8 channels.
KIMI_LINEAR = dict(
    vocab_size=128,
    hidden_size=32,
    num_layers=2,
    layer_types=(LINEAR, FULL),
    num_heads=4,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    intermediate_size=64,
    mlp_only_layers=(0, 1),
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    linear_num_heads=2,
    linear_head_dim=8,
    linear_conv_kernel_dim=4,
    linear_attention_chunk_size=5,
    max_position_embeddings=LENGTH,
    attention_chunk_size=16,
)
FAMILIES = {
    "qwen3_next": (qwen3_next.Qwen3NextConfig, QWEN3_NEXT),
    "kimi_linear": (kimi_linear.KimiLinearConfig, KIMI_LINEAR),
}
# Segment starts: row 0 at 10 (inside a piece at every split; its segment runs across
# two to four pieces) and 40 (a piece's start for pieces of 8); row 1 at 32 (a piece's start
# at every split) and 50 (two into the piece at 48: its convolution reads the segment
# before), padding (segment 0) from 61.
SEGMENTS = ((0, 10, 40, LENGTH), (0, 32, 50, 61))


def model(family: str, balance: bool = True, scan: bool = False) -> DecoderOnlyModel:
    config, fields = FAMILIES[family]
    return DecoderOnlyModel(config(**fields, context_parallel_balance=balance, scan_layers=scan))


def packed_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 128, (ROWS, LENGTH)).astype(np.int32)
    segments = np.zeros((ROWS, LENGTH), np.int32)
    positions = np.zeros((ROWS, LENGTH), np.int32)
    for row, cuts in enumerate(SEGMENTS):
        for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            segments[row, a:b] = i + 1
            positions[row, a:b] = np.arange(b - a)
    tokens[segments == 0] = 0
    return {
        "decoder_input_tokens": tokens,
        "decoder_target_tokens": np.roll(tokens, -1, 1),
        "decoder_loss_weights": (segments > 0).astype(np.float32),
        "decoder_segment_ids": segments,
        "decoder_positions": positions,
    }


# The params and the reference are a family's, whatever the mesh: built once a family (a
# module fixture parametrised beside the meshes would be rebuilt for every case).
@functools.cache
def params(family: str):
    """Random params at scale 0.3, the linear layer's decays slow (exp(A_log) 0.02-0.1 a
    position, for Kimi Linear's channels times a softplus near 0.7: the state reaches across
    every shard)."""
    shapes = {"decoder_input_tokens": (1, 8)}
    abstract = jax.eval_shape(lambda: model(family).init_params(jax.random.PRNGKey(0), shapes))
    rng = np.random.default_rng(1)

    def draw(path, a):
        if "A_log" in jax.tree_util.keystr(path):
            return np.log(rng.uniform(0.02, 0.1, a.shape)).astype(a.dtype)
        return rng.normal(0.0, 0.3, a.shape).astype(a.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


def loss_and_grads(model, params, batch, mesh_shape=None):
    def fn(params, batch):
        return jax.value_and_grad(lambda p: model.loss_fn(p, batch, None)[0])(params)

    if mesh_shape is None:
        return jax.tree.map(np.asarray, jax.jit(fn)(params, batch))
    partitioner = Partitioner(mesh_shape=mesh_shape, mesh_axis_names=AXES)
    axes = model.params_axes({"decoder_input_tokens": (1, 8)})
    rows = {k: P("batch", None) for k in batch}
    return jax.tree.map(
        np.asarray, partitioner.partition(fn, (axes, rows), (None, axes))(params, batch)
    )


def assert_same(got, want):
    """float32 round-off apart: every gradient is a sum over rows x positions of terms carried
    back through the sequence (forward and backward: 2 x LENGTH sequential updates), summed
    in another order split; the tolerance is that many round-offs of the leaf's largest."""
    depth = 2 * ROWS * LENGTH
    (loss, grads), (ref_loss, ref_grads) = got, want
    np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=4 * EPS * depth * abs(ref_loss))
    for (path, g), r in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True
    ):
        atol = 4 * EPS * depth * np.abs(r).max()
        np.testing.assert_allclose(g, r, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


@functools.cache
def unsplit(family: str):
    """The reference: the loss and gradients with each row whole on one device."""
    return loss_and_grads(model(family), params(family), packed_batch())


# (family, mesh, load-balanced order, scanned), heads split over tensor: sequence 2 balanced
# beside fsdp (pieces of 16), sequence 4 balanced (pieces of 8), sequence 2 in order beside
# data (32; Qwen3-Next's layers scanned as one (linear, full) cycle); Kimi Linear's
# per-channel decays on the first and the last.
CASES = [
    ("qwen3_next", (1, 2, 2, 2), True, False),
    ("qwen3_next", (1, 1, 4, 2), True, False),
    ("qwen3_next", (2, 1, 2, 2), False, True),
    ("kimi_linear", (1, 2, 2, 2), True, False),
    ("kimi_linear", (2, 1, 2, 2), False, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("family,mesh_shape,balance,scan", CASES, ids=str)
def test_split_sequence_gives_the_unsplit_loss_and_gradients(family, mesh_shape, balance, scan):
    split = model(family, balance, scan)
    cfg = split.config
    layout = ("layers", cfg.num_layers, cfg.first_scanned_layer, cfg.scan_period)
    weights = stacked(params(family), *layout) if scan else params(family)
    loss, grads = loss_and_grads(split, weights, packed_batch(), mesh_shape)
    if scan:  # compared layer by layer with the unscanned reference
        grads = stacks.unstack(grads, *layout)
    assert_same((loss, grads), unsplit(family))


def stacked(params, name: str, num_layers: int, first: int, period: int):
    """Unrolled `name_{i}` params as a scanned stack of `period`-layer cycles (`unstack`'s
    inverse)."""
    out = {k: v for k, v in params.items() if not k.startswith(f"{name}_")}
    blocks = {}
    for j in range(period):
        layers = [params[f"{name}_{i}"] for i in range(first + j, num_layers, period)]
        blocks[stacks.slot_name(j, period)] = jax.tree.map(lambda *x: np.stack(x), *layers)
    return {**out, name: blocks}
