"""DeepSeek-V3's aux-loss-free load balance: after each train step every MoE layer's
`e_score_correction_bias` moves by `rate x sign(mean load - load)`, the loads counted over the
whole global batch, outside the optimizer (AdamW with weight decay leaves it alone); the same
biases with 4 microbatches, scanned rematerialised layers and experts split over an `expert`
mesh axis. The bias is a param of the train state, so checkpoints save and restore it."""

import dataclasses

import jax
import numpy as np
import pytest

from flaxlm.models import deepseek, qwen_moe, stacks
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import optimizers
from flaxlm.training import steps as train_steps

RATE = 0.01
CONFIG = deepseek.DeepseekV3Config(
    vocab_size=64,
    hidden_size=16,
    num_layers=2,
    num_heads=2,
    intermediate_size=32,
    q_lora_rank=None,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=4,
    max_position_embeddings=64,
    rope_scaling_type=None,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    n_group=2,
    topk_group=1,
    mlp_only_layers=(),  # every layer sparse: the layers may scan
    correction_bias_update_rate=RATE,
)
ROWS, LENGTH = 32, 8


def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, CONFIG.vocab_size, (ROWS, LENGTH)).astype(np.int32)
    weights = np.ones_like(tokens)
    weights[3, 5:] = 0  # padding: its tokens are not counted
    return {
        "decoder_input_tokens": tokens,
        "decoder_target_tokens": tokens,
        "decoder_loss_weights": weights,
        "decoder_segment_ids": weights.copy(),
        "decoder_positions": np.broadcast_to(np.arange(LENGTH, dtype=np.int32), tokens.shape),
    }


def train(config, partitioner, steps=2, num_microbatches=1, params=None):
    """The initial params, then the biases `[layers, experts]` and the params after each of
    `steps` steps (AdamW, weight decay 0.1 on), from `params` or the model's init."""
    model = DecoderOnlyModel(config)
    tx = optimizers.create_optimizer(learning_rate=1e-2)
    data = batch()
    setup = train_steps.Setup(model, partitioner, tx, {k: v.shape[1] for k, v in data.items()})
    step = setup.partition_train_step(
        train_steps.make_train_step(model, partitioner, 1e-2, num_microbatches=num_microbatches)
    )
    state = setup.init_state() if params is None else setup.state_from_params(params)
    out = [jax.tree.map(np.asarray, state.params)]
    for _ in range(steps):
        state, _ = step(state, data)
        out.append((biases(state.params), jax.tree.map(np.asarray, state.params)))
    return out


def biases(params) -> np.ndarray:
    if "layers" in params:  # scanned: one stacked leaf
        return np.asarray(params["layers"]["block"]["mlp"]["e_score_correction_bias"])
    return np.stack(
        [np.asarray(params[f"layers_{i}"]["mlp"]["e_score_correction_bias"]) for i in (0, 1)]
    )


@pytest.fixture(scope="module")
def reference():
    return train(CONFIG, Partitioner())


@pytest.mark.slow
def test_bias_moves_by_the_sign_of_each_experts_load_over_two_steps(reference):
    """A hand computation: each step's loads from the params it starts from (the
    statistics the loss sows), the bias plus RATE x sign(mean - load), nothing else."""
    model = DecoderOnlyModel(CONFIG)
    loads = jax.jit(lambda p: model.loss_fn(p, batch(), None)[1]["moe_expert_counts"])
    params, *trained = reference
    want = np.zeros((2, CONFIG.num_experts), np.float32)
    for biases_after, params_after in trained:
        counts = np.asarray(loads(params))
        assert counts.sum() == 2 * (ROWS * LENGTH - 3) * CONFIG.num_experts_per_tok
        assert (counts != counts.mean(-1, keepdims=True)).any()  # something to balance
        want = want + np.float32(RATE) * np.sign(counts.mean(-1, keepdims=True) - counts)
        np.testing.assert_array_equal(biases_after, want)
        params = params_after
    # The optimizer trained the rest (the router's kernel too).
    kernel = params["layers_1"]["mlp"]["gate"]["kernel"]
    assert not np.allclose(kernel, reference[0]["layers_1"]["mlp"]["gate"]["kernel"])


def test_microbatched_scanned_rematerialised_expert_parallel_gives_the_same_biases(reference):
    # Loads are integer counts: any order of summing them gives the same bias exactly (the
    # other params differ by float rounding, which moves no top-k choice of these tokens).
    mesh = Partitioner(
        mesh_shape=(1, 2, 4, 1), mesh_axis_names=("data", "fsdp", "expert", "tensor")
    )
    config = dataclasses.replace(CONFIG, scan_layers=True, remat_policy="full")
    unrolled = reference[0]
    stacked = jax.tree.map(lambda *x: np.stack(x), unrolled["layers_0"], unrolled["layers_1"])
    params = {k: v for k, v in unrolled.items() if not k.startswith("layers_")}
    got = train(config, mesh, num_microbatches=4, params={**params, "layers": {"block": stacked}})
    for (want, _), (biases_after, _) in zip(reference[1:], got[1:], strict=True):
        np.testing.assert_array_equal(biases_after, want)


def test_a_rate_without_the_bias_is_an_error_naming_both():
    with pytest.raises(ValueError, match="correction_bias_update_rate"):
        dataclasses.replace(CONFIG, score_correction_bias=False)


@pytest.mark.slow
def test_scanned_cycles_report_and_move_each_layer_as_their_unrolled_twin():
    """Dense MLPs among the MoE ones (layers 2 and 5 of 7): the scan stacks (MoE, MoE,
    dense) twice and leaves layer 6 unrolled, so the router statistics come out of the walk
    as layers 6, 0, 3, 1, 4. The per-layer telemetry (`moe_max_load_{i}`, the i-th MoE layer)
    and each layer's bias after two steps are the unrolled twin's."""
    config = qwen_moe.QwenMoeConfig(
        model_type="qwen3_moe", vocab_size=64, hidden_size=16, num_layers=7, num_heads=2,
        num_kv_heads=1, head_dim=8, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=8, mlp_only_layers=(2, 5), router="sigmoid_topk",
        score_correction_bias=True, correction_bias_update_rate=RATE,
        max_position_embeddings=64,
    )  # fmt: skip
    scanned = dataclasses.replace(config, scan_layers=True)
    layout = stacks.scan_layout(scanned)
    assert stacks.walk_order(7, layout) == [6, 0, 3, 1, 4, 2, 5]
    scanned_run = train_with_metrics(scanned)
    unrolled_run = train_with_metrics(config, stacks.unstack(scanned_run[0], "layers", 7, *layout))
    for (_, got), (_, want) in zip(scanned_run[1:], unrolled_run[1:], strict=True):
        loads = {k: v for k, v in want.items() if k.startswith("moe_max_load_")}
        assert len(loads) == 5 and len(set(loads.values())) > 1  # the layers differ
        for key, value in loads.items():
            assert got[key] == pytest.approx(value, rel=1e-6), key
    for step, ((got, _), (want, _)) in enumerate(zip(scanned_run[1:], unrolled_run[1:])):
        got = stacks.unstack(got, "layers", 7, *layout)
        for i in (0, 1, 3, 4, 6):
            biases = [
                np.asarray(p[f"layers_{i}"]["mlp"]["e_score_correction_bias"]) for p in (got, want)
            ]
            np.testing.assert_array_equal(*biases)
            assert step or (np.abs(biases[1]) == RATE).all()  # the first step moves them all


def train_with_metrics(config, params=None, steps=2):
    """The initial params, then (params, metrics) after each of `steps` steps on one device
    (from `params` or the model's init)."""
    model = DecoderOnlyModel(config)
    partitioner = Partitioner(devices=jax.devices()[:1])
    tx = optimizers.create_optimizer(learning_rate=1e-2)
    data = batch()
    setup = train_steps.Setup(model, partitioner, tx, {k: v.shape[1] for k, v in data.items()})
    step = setup.partition_train_step(train_steps.make_train_step(model, partitioner, 1e-2))
    state = setup.init_state() if params is None else setup.state_from_params(params)
    out: list = [jax.tree.map(np.asarray, state.params)]
    for _ in range(steps):
        state, metrics = step(state, data)
        out.append(
            (jax.tree.map(np.asarray, state.params), {k: float(v) for k, v in metrics.items()})
        )
    return out
