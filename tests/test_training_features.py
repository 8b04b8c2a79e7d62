"""Training options that trade memory and speed: mixed precision, FCM, ALiBi, optimizers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxlm.inference import generation
from flaxlm.models import base, gpt2, masks
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import optimizers
from flaxlm.training import steps as train_steps
from flaxlm.training.steps import Setup
from tests.helpers import feature_lengths, random_batch, tiny_gptj


def train_losses(model, optimizer, steps, mesh_shape=(1, 8, 1), batches=4):
    partitioner = Partitioner(mesh_shape=mesh_shape)
    setup = Setup(model, partitioner, optimizer, feature_lengths())
    state = setup.init_state()
    step = setup.partition_train_step(train_steps.make_train_step(model, partitioner, 3e-3))
    data = [random_batch(seed=i) for i in range(batches)]
    losses = []
    for i in range(steps):
        state, metrics = step(state, data[i % batches])
        losses.append(float(metrics["loss"]))
    return np.asarray(losses), state


@pytest.mark.slow
def test_bfloat16_training_tracks_float32_over_50_steps():
    opt = optimizers.create_optimizer(learning_rate=3e-3, weight_decay=0.0)
    f32, _ = train_losses(tiny_gptj(), opt, 50)
    bf16, state = train_losses(tiny_gptj(dtype="bfloat16"), opt, 50)
    assert f32[-1] < f32[0] - 0.5  # it learns
    # Same curve within bf16 rounding: params and optimizer state stay float32.
    assert np.max(np.abs(bf16 - f32)) < 0.05
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))


@pytest.mark.slow
def test_bfloat16_params_and_first_moments():
    opt = optimizers.create_optimizer(learning_rate=3e-3, weight_decay=0.0, mu_dtype="bfloat16")
    f32, _ = train_losses(tiny_gptj(), optimizers.create_optimizer(learning_rate=3e-3), 20)
    losses, state = train_losses(tiny_gptj(dtype="bfloat16", param_dtype="bfloat16"), opt, 20)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.params))
    (adam,) = [
        x
        for x in jax.tree.leaves(
            state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
        )
        if isinstance(x, optax.ScaleByAdamState)
    ]
    mu = adam.mu
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(mu))
    assert losses[-1] < losses[0] - 0.3 and abs(losses[-1] - f32[-1]) < 0.2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adafactor", "lion"])
def test_other_optimizers_train(name):
    lr = 1e-3 if name == "lion" else 3e-3
    losses, _ = train_losses(tiny_gptj(), optimizers.create_optimizer(name, lr), 20)
    assert losses[-1] < losses[0] - 0.3


def test_forgetful_causal_masking_changes_training_but_not_eval():
    plain, fcm = tiny_gptj(), tiny_gptj(fcm_min_ratio=0.2, fcm_max_ratio=0.6)
    params = plain.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 16)})
    batch = {k: jnp.asarray(v) for k, v in random_batch().items()}
    rng = jax.random.PRNGKey(3)
    # Evaluation (no rng): identical.
    np.testing.assert_array_equal(
        jax.jit(plain.compute_logits)(params, batch), jax.jit(fcm.compute_logits)(params, batch)
    )
    assert float(plain.loss_fn(params, batch, None)[0]) == float(
        fcm.loss_fn(params, batch, None)[0]
    )
    # Training (an rng): FCM hides keys, so the loss differs; plain GPT-J has no dropout.
    train_plain = float(plain.loss_fn(params, batch, rng)[0])
    train_fcm = float(fcm.loss_fn(params, batch, rng)[0])
    assert train_plain == float(plain.loss_fn(params, batch, None)[0])
    assert abs(train_fcm - train_plain) > 1e-4


def test_forgetful_mask_hides_a_fraction_of_keys_but_never_a_segment_start():
    positions = jnp.tile(jnp.concatenate([jnp.arange(50), jnp.arange(50)])[None], (64, 1))
    mask = masks.attention_mask(None, 64, 100)
    fcm = masks.forgetful_causal_mask(mask, jax.random.PRNGKey(0), positions, 0.3, 0.3)
    keep = np.asarray(fcm.kv_keep)
    assert keep[:, 0].all() and keep[:, 50].all()
    assert abs(1 - keep.mean() - 0.3) < 0.03
    dense = np.asarray(fcm.dense())[:, 0]
    assert (dense == (np.tril(np.ones((100, 100), bool))[None] & keep[:, None, :])).all()


def alibi_gpt2(**overrides):
    config = gpt2.GPT2Config(
        vocab_size=128,
        hidden_size=48,
        num_layers=2,
        num_heads=6,  # not a power of two: the interpolated slopes
        max_position_embeddings=16,
        position_embedding="alibi",
        **overrides,
    )
    return base.DecoderOnlyModel(config)


def test_alibi_slopes_and_bias_match_a_direct_computation():
    # Press et al.: 8 heads -> 1/2, 1/4, ..., 1/256; 6 heads -> those of 4, then odd ones of 8.
    np.testing.assert_allclose(gpt2.alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)])
    np.testing.assert_allclose(gpt2.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    positions = jnp.asarray([[0, 1, 2, 0, 1]])
    bias = np.asarray(gpt2.alibi_bias(positions, positions, 6))
    slopes = gpt2.alibi_slopes(6)
    for h in range(6):
        for i in range(5):
            for j in range(5):
                expected = -slopes[h] * abs(int(positions[0, i]) - int(positions[0, j]))
                assert bias[0, h, i, j] == pytest.approx(expected)


@pytest.mark.slow
def test_alibi_model_has_no_position_table_and_extrapolates():
    model = alibi_gpt2()
    params = model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 16)})
    assert "wpe" not in params
    # Trained at 16 positions, it reads 64 (no position table to run out of).
    model.check_lengths({"targets": 64})
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 64), 1, 128)
    logits = jax.jit(model.compute_logits)(params, {"decoder_input_tokens": tokens})
    assert logits.shape == (2, 64, 128) and np.isfinite(np.asarray(logits)).all()
    # The first 16 positions see what a 16-token input sees (causal).
    short = jax.jit(model.compute_logits)(params, {"decoder_input_tokens": tokens[:, :16]})
    np.testing.assert_allclose(logits[:, :16], short, atol=1e-5)
    # Decoding with the cache follows the same bias.
    prompts = {"inputs": np.asarray(tokens[:, :5])}
    out = generation.generate(model, params, prompts, max_new_tokens=6, eos_id=None)
    # (One length for every reference step: causal, so the zeros after position t change
    # nothing at t, and the forward is traced once instead of once per length.)
    seq = np.zeros((2, 11), np.int32)
    seq[:, :5] = np.asarray(tokens[:, :5])
    for t in range(5, 11):
        logits_t = jax.jit(model.compute_logits)(params, {"decoder_input_tokens": seq})[:, t - 1]
        seq[:, t] = np.asarray(logits_t).argmax(-1)
    np.testing.assert_array_equal(out, seq[:, 5:])


def test_alibi_gpt2_export_is_refused_with_a_reason():
    from flaxlm.checkpoints import hf

    model = alibi_gpt2()
    with pytest.raises(ValueError, match="no HuggingFace"):
        hf.hf_config_dict(model)
