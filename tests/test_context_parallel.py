"""Context parallelism: a sequence split over the mesh's `sequence` axis gives the loss and the
gradients of the same model unsplit, by ring and by all-gather attention, packed or not, with
windows shorter than a shard, for every decoder family (with the chunked loss) and a mixture of
experts (its router statistics too, with and without an `expert` axis) and an MTP layer; the
load-balanced order gives every shard the same share of the causal work."""

import dataclasses
import re
from pathlib import Path

import gin
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from flaxlm.models import context_parallel
from flaxlm.models.base import DecoderOnlyModel, EncoderOnlyModel
from flaxlm.models.deepseek import DeepseekV3Config
from flaxlm.models.gemma import GemmaConfig
from flaxlm.models.gpt2 import GPT2Config
from flaxlm.models.gptj import GPTJConfig
from flaxlm.models.llama import LlamaConfig
from flaxlm.models.opt import OPTConfig
from flaxlm.models.phi3 import Phi3Config
from flaxlm.models.qwen import QwenConfig
from flaxlm.models.qwen_moe import QwenMoeConfig
from flaxlm.models.roberta import RobertaConfig
from flaxlm.parallel.partitioning import Partitioner

REPO = Path(__file__).resolve().parents[1]
AXES = ("data", "fsdp", "sequence", "tensor")
LENGTH = 1024
WINDOW = 100  # shorter than a shard at every mesh below (1024 / 8 = 128)


def test_balanced_order_gives_each_shard_two_mirrored_chunks():
    order = context_parallel.balanced_order(16, 4)  # 8 chunks of 2 slots, 4 per shard
    shards = order.reshape(4, 4)
    np.testing.assert_array_equal(shards[0], [0, 1, 14, 15])
    np.testing.assert_array_equal(shards[3], [6, 7, 8, 9])
    assert sorted(order.tolist()) == list(range(16))
    # Causal work (keys at or before each query) is the same on every shard.
    work = [(s + 1).sum() for s in shards]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="multiple of 8.*context_parallel_balance"):
        context_parallel.balanced_order(20, 4)


def _batches(length, seed=0):
    """Two rows, packed (three and two documents, the second row ending in padding) and the
    same tokens unpacked."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 128, (2, length)).astype(np.int32)
    segments = np.zeros((2, length), np.int32)
    positions = np.zeros((2, length), np.int32)
    for row, cuts in enumerate(
        [[0, length // 3, length // 2, length], [0, length // 5, length - 7]]
    ):
        for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            segments[row, a:b] = i + 1
            positions[row, a:b] = np.arange(b - a)
    tokens[segments == 0] = 0
    weights = (segments > 0).astype(np.float32)
    unpacked = {
        "decoder_input_tokens": tokens,
        "decoder_target_tokens": np.roll(tokens, -1, 1),
        "decoder_loss_weights": weights,
    }
    packed = {**unpacked, "decoder_segment_ids": segments, "decoder_positions": positions}
    return {"packed": packed, "unpacked": unpacked}


def _random_params(model, shapes, scale=0.3):
    abstract = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0), shapes))
    rng = np.random.default_rng(1)
    return jax.tree.map(lambda a: rng.normal(0.0, scale, a.shape).astype(a.dtype), abstract)


def _loss_and_grads(model, params, batch, mesh_shape=None):
    """The loss and its gradients: unsplit (no mesh), or through a partitioned function on a
    mesh with a `sequence` axis."""

    def fn(params, batch):
        return jax.value_and_grad(lambda p: model.loss_fn(p, batch, None)[0])(params)

    if mesh_shape is None:
        out = jax.jit(fn)(params, batch)
    else:
        partitioner = Partitioner(mesh_shape=mesh_shape, mesh_axis_names=AXES)
        shapes = {k: (1, 8) for k in batch if k.endswith("input_tokens")}
        axes = model.params_axes(shapes)
        rows = {k: P("batch", None) for k in batch}
        out = partitioner.partition(fn, (axes, rows), (None, axes))(params, batch)
    return jax.tree.map(np.asarray, out)


def _assert_same(got, want, tol=1e-5):
    (loss, grads), (ref_loss, ref_grads) = got, want
    np.testing.assert_allclose(loss, ref_loss, rtol=tol, atol=tol)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    for (path, g), r in zip(flat, jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol, err_msg=jax.tree_util.keystr(path))


def _mistral(kind, strategy="ring"):
    window = dict(model_type="mistral", sliding_window=WINDOW) if kind == "mistral" else {}
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_position_embeddings=LENGTH,
        attention_chunk_size=64,
        context_parallel=strategy,
        **window,
    )
    return DecoderOnlyModel(config)


@pytest.fixture(scope="module")
def unsplit():
    """The reference: each model and batch with the whole sequence on one device."""
    batches = _batches(LENGTH)
    out = {}
    for kind in ("llama", "mistral"):
        model = _mistral(kind)
        params = _random_params(model, {"decoder_input_tokens": (1, 8)})
        for packing, batch in batches.items():
            out[kind, packing] = params, batch, _loss_and_grads(model, params, batch)
    return out


# (mesh, attention across shards, model): the ring of 8 (the most hops, the most skipped
# by the window) for both models, the ring beside fsdp and tensor for the full-attention
# one, beside data for the windowed one, and the all-gather once, on the windowed one.
CASES = [
    ((1, 1, 8, 1), "ring", "llama"),
    ((1, 1, 8, 1), "ring", "mistral"),
    ((1, 2, 2, 2), "ring", "llama"),
    ((2, 1, 4, 1), "ring", "mistral"),
    ((2, 1, 4, 1), "all_gather", "mistral"),
]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,strategy,kind", CASES, ids=str)
def test_split_sequence_gives_the_unsplit_loss_and_gradients(unsplit, mesh_shape, strategy, kind):
    model = _mistral(kind, strategy)
    for packing in ("packed", "unpacked"):
        params, batch, want = unsplit[kind, packing]
        _assert_same(_loss_and_grads(model, params, batch, mesh_shape), want)


def _hlo(model, params, batch, mesh_shape):
    partitioner = Partitioner(mesh_shape=mesh_shape, mesh_axis_names=AXES)
    axes = model.params_axes({"decoder_input_tokens": (1, 8)})

    def loss(params, batch):
        return model.loss_fn(params, batch, None)[0]

    fn = partitioner.partition(loss, (axes, {k: P("batch", None) for k in batch}), None)
    return fn.lower(params, batch).compile().as_text()


@pytest.mark.parametrize("remat_policy", ["none", "dots_with_no_batch_dims_saveable"])
def test_the_ring_passes_keys_and_the_gather_gathers_them(unsplit, remat_policy):
    """Also under rematerialisation (which turns the mask's fields into tracers)."""
    params, batch, _ = unsplit["mistral", "packed"]
    models = {
        s: DecoderOnlyModel(
            dataclasses.replace(_mistral("mistral", s).config, remat_policy=remat_policy)
        )
        for s in ("ring", "all_gather")
    }
    ring = _hlo(models["ring"], params, batch, (1, 1, 8, 1))
    gather = _hlo(models["all_gather"], params, batch, (1, 1, 8, 1))
    assert "collective-permute" in ring
    assert "collective-permute" not in gather
    assert "all-gather" in gather


# Every decoder family's features on a (1, 1, 4, 2) mesh: heads split too, 16 positions a
# shard. GPT-2 with ALiBi passes its bias to the plain kernel (XLA partitions it).
SMALL = dict(vocab_size=128, hidden_size=32, num_heads=4, max_position_embeddings=64)
FAMILIES = {
    "gemma2_softcapped_windows": lambda: GemmaConfig(
        **SMALL,
        model_type="gemma2",
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        query_pre_attn_scalar=8,
        sliding_window=6,
        sliding_window_pattern=2,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        tie_word_embeddings=True,
    ),
    "gpt2": lambda: GPT2Config(**SMALL, num_layers=1),
    "gpt2_alibi": lambda: GPT2Config(**SMALL, num_layers=1, position_embedding="alibi"),
    "gptj": lambda: GPTJConfig(**SMALL, num_layers=1, rotary_dim=4),
    "opt": lambda: OPTConfig(**SMALL, num_layers=1, ffn_dim=64),
    "phi3": lambda: Phi3Config(
        **SMALL,
        num_layers=1,
        num_kv_heads=2,
        intermediate_size=64,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.5,
    ),
    "qwen3": lambda: QwenConfig(
        **SMALL, model_type="qwen3", num_layers=1, num_kv_heads=2, head_dim=8, intermediate_size=64
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_splits_its_sequence_and_its_chunked_loss(family):
    """Split, the loss is also chunked (5 of each device's 16 positions at a time, the
    vocabulary on `tensor`): the same loss and gradients as the whole loss unsplit."""
    model = DecoderOnlyModel(FAMILIES[family]())
    params = _random_params(model, {"decoder_input_tokens": (1, 8)}, scale=0.2)
    batch = _batches(64, seed=2)["packed"]
    want = _loss_and_grads(model, params, batch)
    chunked = DecoderOnlyModel(FAMILIES[family](), loss_chunk_size=5)
    _assert_same(_loss_and_grads(chunked, params, batch, (1, 1, 4, 2)), want)


@pytest.mark.slow
def test_multi_token_prediction_splits_its_sequence_in_the_balanced_order():
    """DeepSeek-V3 with an MTP layer (a dense first layer, an MoE one): split over
    `sequence` in the load-balanced order, the MTP layer's next tokens and its targets
    follow each position's slot, k slots on: the unsplit loss (the MTP loss's included)
    and gradients."""
    config = DeepseekV3Config(
        **SMALL,
        num_layers=2,
        mlp_only_layers=(0,),
        intermediate_size=64,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_group=1,
        topk_group=1,
        num_mtp_layers=1,
        mtp_loss_weight=0.3,
    )
    model = DecoderOnlyModel(config)
    params = _random_params(model, {"decoder_input_tokens": (1, 8)}, scale=0.2)
    batch = _batches(64, seed=2)["packed"]
    want = _loss_and_grads(model, params, batch)
    _assert_same(_loss_and_grads(model, params, batch, (1, 1, 4, 2)), want)


# A Qwen3-MoE (8 experts, 2 a token, dropless, layers scanned so the block compiles once) whose
# router losses weigh enough that their gradients stand well above the tolerance.
MOE = QwenMoeConfig(
    **SMALL,
    model_type="qwen3_moe",
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    norm_topk_prob=True,
    router_aux_loss_coef=0.1,
    router_z_loss_coef=0.01,
    scan_layers=True,
)
EP_AXES = ("data", "fsdp", "sequence", "expert", "tensor")


def _moe_run(model, params, batch, mesh_shape=None, axis_names=AXES):
    """(loss, metric sums), gradients, and the compiled program's text (None unsplit)."""

    def fn(params, batch):
        return jax.value_and_grad(lambda p: model.loss_fn(p, batch, None), has_aux=True)(params)

    if mesh_shape is None:
        return jax.tree.map(np.asarray, jax.jit(fn)(params, batch)), None
    partitioner = Partitioner(mesh_shape=mesh_shape, mesh_axis_names=axis_names)
    axes = model.params_axes({"decoder_input_tokens": (1, 8)})
    rows = {k: P("batch", None) for k in batch}
    compiled = partitioner.partition(fn, (axes, rows), (None, axes)).lower(params, batch).compile()
    return jax.tree.map(np.asarray, compiled(params, batch)), compiled.as_text()


@pytest.fixture(scope="module")
def moe_unsplit():
    """Four packed rows (two expert-split ones on (1, 2, 2, 2, 1)), the whole sequence on one
    device."""
    model = DecoderOnlyModel(MOE)
    params = _random_params(model, {"decoder_input_tokens": (1, 8)}, scale=0.2)
    rows = [_batches(64, seed=seed)["packed"] for seed in (2, 3)]
    batch = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    return params, batch, _moe_run(model, params, batch)[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh_shape,axis_names", [((1, 1, 4, 2), AXES), ((1, 2, 2, 2, 1), EP_AXES)], ids=str
)
def test_a_mixture_of_experts_splits_its_sequence_and_its_router_statistics(
    moe_unsplit, mesh_shape, axis_names
):
    """Split over `sequence` (heads and experts' widths on `tensor`; then also the experts
    over an `expert` axis beside fsdp), the loss chunked: the unsplit loss and gradients,
    and the router statistics (sums over the real tokens: the split rows add up to them),
    the same experts chosen for every token."""
    params, batch, want = moe_unsplit
    model = DecoderOnlyModel(MOE, loss_chunk_size=5)
    got, hlo = _moe_run(model, params, batch, mesh_shape, axis_names)
    ((loss, sums), grads), ((ref_loss, ref_sums), ref_grads) = got, want
    _assert_same((loss, grads), (ref_loss, ref_grads))
    np.testing.assert_array_equal(sums["moe_expert_counts"], ref_sums["moe_expert_counts"])
    assert ref_sums["moe_expert_counts"].shape == (MOE.num_layers, MOE.num_experts)
    # k assignments a real token and layer: the padding was not counted.
    k_per_token = MOE.num_layers * MOE.num_experts_per_tok
    assert sums["moe_expert_counts"].sum() == k_per_token * sums["weight_sum"]
    for name in ("moe_aux_loss_sum", "moe_z_loss_sum", "weight_sum"):
        np.testing.assert_allclose(sums[name], ref_sums[name], rtol=1e-5, err_msg=name)
    # Each device routes its own tokens (XLA:CPU's top-k: one row a token) and sorts the
    # assignments of its expert group's tokens (gathered over `expert`; its own without one)
    # by expert: not the whole batch's gathered onto it.
    sizes = {"expert": 1, **dict(zip(axis_names, mesh_shape))}
    own = batch["decoder_input_tokens"].size
    own //= sizes["data"] * sizes["fsdp"] * sizes["sequence"] * sizes["expert"]
    routed = {int(n) for n in re.findall(r"\(f32\[(\d+),2\]\S* s32\S*\) custom-call\(", hlo)}
    assert routed == {own}
    sorted_rows = {int(n) for n in re.findall(r"\(s32\[(\d+)\]\S* s32\[\d+\]\S*\) sort\(", hlo)}
    assert sorted_rows == {own * sizes["expert"] * MOE.num_experts_per_tok}


def test_a_bidirectional_encoder_splits_its_sequence():
    config = RobertaConfig(**SMALL, num_layers=1, intermediate_size=64, pad_token_id=1)
    model = EncoderOnlyModel(config)
    params = _random_params(model, {"encoder_input_tokens": (1, 8)}, scale=0.2)
    packed = _batches(64, seed=3)["packed"]
    batch = {k.replace("decoder_", "encoder_"): v for k, v in packed.items()}
    batch["encoder_positions"] = batch["encoder_positions"] + 2  # RoBERTa counts from pad + 1
    want = _loss_and_grads(model, params, batch)
    _assert_same(_loss_and_grads(model, params, batch, (1, 1, 4, 2)), want)


def test_the_partitioning_file_splits_sequences_over_every_device():
    gin.clear_config()
    try:
        gin.parse_config_file(str(REPO / "gin" / "partitioning" / "fsdp_cp.gin"))
        partitioner = Partitioner()
    finally:
        gin.clear_config()
    assert dict(zip(partitioner.mesh_axis_names, partitioner.mesh_shape)) == {
        "data": 1,
        "fsdp": 1,
        "sequence": 8,
        "tensor": 1,
    }
    assert partitioner.mesh_axes(("batch", "length", "embed")) == P(
        ("data", "fsdp"), "sequence", None
    )
    assert partitioner.mesh_axes(("embed", "mlp")) == P(("fsdp", "sequence"), "tensor")
