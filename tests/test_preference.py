"""Preference optimisation wired to the trainer: DPO, IPO, ORPO, SimPO on pairs of answers."""

import jax
import numpy as np
import pytest

from flaxlm.data import pipeline
from flaxlm.models.row_start import HF_START
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.posttrain import loss_math, preference
from flaxlm.training import lora
from flaxlm.training import objective as objective_lib
from flaxlm.training import steps as train_steps
from tests.helpers import adamw, tiny_gptj

LENGTH = 16
PROMPT = 10
FEATURES = ("decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights")


def pair_batch(pairs: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """`[pairs, 2, LENGTH]` decoder features: a random prompt, then a 3-token answer drawn
    from ids 64-95 (chosen, row 0) or 96-127 (rejected, row 1), then padding."""
    rng = np.random.default_rng(seed)
    targets = np.zeros((pairs, 2, LENGTH), np.int32)
    prompt = rng.integers(3, 64, size=(pairs, PROMPT))
    targets[:, :, :PROMPT] = prompt[:, None]
    targets[:, 0, PROMPT : PROMPT + 3] = rng.integers(64, 96, size=(pairs, 3))
    targets[:, 1, PROMPT : PROMPT + 3] = rng.integers(96, 128, size=(pairs, 3))
    weights = np.zeros_like(targets)
    weights[:, :, PROMPT : PROMPT + 3] = 1
    inputs = np.concatenate([np.zeros_like(targets[..., :1]), targets[..., :-1]], axis=-1)
    return dict(zip(FEATURES, (inputs, targets, weights)))


def lengths() -> dict[str, int]:
    return {name: LENGTH for name in FEATURES}


def run(cfg, mesh_shape=(2, 2, 2), steps=25, lora_cfg=None, num_microbatches=1, lr=1e-2):
    """Trains a tiny GPT-J with `cfg`; returns (setup, frozen, first step's metrics, eval
    metrics on held-out pairs before and after)."""
    model = tiny_gptj(max_position_embeddings=LENGTH)
    partitioner = Partitioner(mesh_shape=mesh_shape)
    needs_reference = cfg.needs_reference
    setup = train_steps.Setup(
        model, partitioner, adamw(lr), lengths(), lora=lora_cfg, frozen_reference=needs_reference
    )
    state = setup.init_state()
    frozen = None
    if lora_cfg is not None:
        frozen = setup.init_base()
    elif needs_reference:
        frozen = setup.copy_params(state.params)
    extra = () if frozen is None else (frozen,)
    step = setup.partition_train_step(
        train_steps.make_train_step(
            model,
            partitioner,
            lr,
            lora=lora_cfg,
            objective=cfg,
            num_microbatches=num_microbatches,
        )
    )
    evaluate = setup.partition_eval_step(train_steps.make_eval_step(model, lora_cfg, cfg))
    held_out = pair_batch(seed=1000)
    before = train_steps.eval_scalars(evaluate(state.params, held_out, *extra), cfg)
    first = None
    for i in range(steps):
        state, metrics = step(state, pair_batch(seed=i % 8), *extra)
        first = first or jax.device_get(metrics)
    after = train_steps.eval_scalars(evaluate(state.params, held_out, *extra), cfg)
    return setup, state, frozen, first, before, after


@pytest.mark.slow
def test_dpo_learns_the_preference_with_trl_metrics_and_a_frozen_reference():
    cfg = preference.PreferenceConfig(loss="dpo", beta=0.1)
    setup, state, reference, first, before, after = run(cfg)
    # The first step's policy is its reference: rewards 0 (up to rounding: the reference's
    # log-probs come from another compiled program than the train step's), loss log 2.
    assert abs(first["rewards/chosen"]) < 1e-6 and abs(first["rewards/rejected"]) < 1e-6
    np.testing.assert_allclose(first["loss"], np.log(2.0), rtol=1e-6)
    assert first["num_pairs"] == 8
    for name in ("rewards/margins", "logps/chosen", "logps/rejected", "grad_norm"):
        assert np.isfinite(first[name]), name
    # Held-out pairs: the reference (= the initial policy) prefers chosen half the time at
    # best; after training the rewards' accuracy is above 0.9 and chosen log-probs went up.
    assert before["eval/rewards/accuracies"] == 0.0  # rewards exactly equal before training
    assert after["eval/rewards/accuracies"] > 0.9
    assert after["eval/rewards/margins"] > 0
    assert after["eval/logps/chosen"] > before["eval/logps/chosen"]
    # The reference stayed the starting params while the policy moved.
    ref, policy = jax.device_get(reference), jax.device_get(state.params)
    moved = [
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(policy))
    ]
    assert all(moved)
    start = jax.device_get(setup.init_state().params)
    for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(ref)):
        assert np.array_equal(a, b)


@pytest.mark.slow
def test_loss_is_the_formula_on_the_models_sequence_scores():
    """PreferenceModel's pairs, weights and reference feed objectives exactly: every loss
    against the formula on `model.score` of the chosen and rejected rows."""
    model = tiny_gptj(max_position_embeddings=LENGTH)
    params = model.init_params(jax.random.PRNGKey(0), {k: (1, LENGTH) for k in FEATURES})
    reference = model.init_params(jax.random.PRNGKey(1), {k: (1, LENGTH) for k in FEATURES})
    batch = pair_batch(4)
    rows = {k: v.reshape(8, LENGTH) for k, v in batch.items()}
    logps = np.asarray(model.score(params, rows)).reshape(4, 2)
    ref = np.asarray(model.score(reference, rows)).reshape(4, 2)
    avg, ref_avg = logps / 3.0, ref / 3.0
    expected = {
        "dpo": loss_math.dpo(*logps.T, *ref.T, beta=0.2, flip_probability=0.1)[0],
        "ipo": loss_math.ipo(*avg.T, *ref_avg.T, beta=0.2)[0],
        "orpo": loss_math.orpo(*avg.T, -avg[:, 0], beta=0.2)[0],
        "simpo": loss_math.simpo(*avg.T, beta=0.2, gamma=0.3, flip_probability=0.1)[0],
    }
    # RPO as TRL's loss_type=['sigmoid', 'sft']: DPO plus the chosen answers' NLL as a
    # mean over every chosen token of the batch (4 pairs x 3 answer tokens), weighted.
    expected["rpo"] = np.mean(expected["dpo"]) + 0.5 * -logps[:, 0].sum() / 12
    for name, want in expected.items():
        smoothing = 0.1 if name in ("dpo", "simpo", "rpo") else 0.0
        cfg = preference.PreferenceConfig(
            "dpo" if name == "rpo" else name,
            beta=0.2,
            label_flip_probability=smoothing,
            gamma=0.3,
            sft_weight=0.5 if name == "rpo" else None,
        )
        objective = preference.PreferenceModel(model, cfg, model, reference)
        loss, sums = objective.loss_fn(params, batch, None)
        np.testing.assert_allclose(loss, np.mean(want), rtol=1e-5, err_msg=name)
        # As TRL logs them: summed per answer (DPOTrainer), a mean per token for ORPO and
        # SimPO (ORPOTrainer, CPOTrainer).
        logged = avg if name in ("orpo", "simpo") else logps
        np.testing.assert_allclose(sums["logps/chosen"], logged[:, 0].sum(), rtol=1e-5)
        np.testing.assert_allclose(sums["logps/rejected"], logged[:, 1].sum(), rtol=1e-5)
        # Precomputed reference log-probs give the same loss as the reference model.
        if cfg.needs_reference:
            given = {**batch, preference.REFERENCE_FEATURE: ref}
            alone = preference.PreferenceModel(model, cfg)
            np.testing.assert_allclose(alone.loss_fn(params, given, None)[0], loss, rtol=1e-6)


@pytest.mark.slow
def test_sequence_logps_sum_the_answers_log_probabilities():
    """`[pairs, 2]` sums of the targets' log-probabilities where weighted (numpy log-softmax
    of the model's logits), the weighted counts, differentiable in the params, and blind to
    the targets of unweighted positions."""
    model = tiny_gptj(max_position_embeddings=LENGTH)
    params = model.init_params(jax.random.PRNGKey(0), {k: (1, LENGTH) for k in FEATURES})
    batch = pair_batch(2)
    total, count = preference.sequence_logps(model, params, batch, None)
    rows = {k: v.reshape(4, LENGTH) for k, v in batch.items()}
    logits = np.asarray(jax.jit(model.compute_logits)(params, rows), np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    targets, weights = rows["decoder_target_tokens"], rows["decoder_loss_weights"]
    picked = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(total, (picked * weights).sum(-1).reshape(2, 2), rtol=1e-5)
    np.testing.assert_array_equal(count, np.full((2, 2), 3))
    grads = jax.grad(lambda p: preference.sequence_logps(model, p, batch, None)[0].sum())(params)
    assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads))
    # The prompt's targets carry no weight: changing the first one leaves the sums alone
    # (causal: it is read only as the second position's input, which the change keeps).
    other = dict(batch, decoder_target_tokens=batch["decoder_target_tokens"].copy())
    other["decoder_target_tokens"][:, :, 0] += 1
    np.testing.assert_array_equal(preference.sequence_logps(model, params, other, None)[0], total)


@pytest.mark.slow
def test_microbatches_give_the_one_batch_step():
    cfg = preference.PreferenceConfig(loss="dpo", beta=0.5)
    one = run(cfg, steps=1, num_microbatches=1)
    two = run(cfg, steps=1, num_microbatches=2)
    for name in ("loss", "grad_norm", "rewards/accuracies", "logps/chosen"):
        np.testing.assert_allclose(one[3][name], two[3][name], rtol=1e-6, err_msg=name)
    for name in ("eval/loss", "eval/rewards/margins", "eval/logps/rejected"):
        np.testing.assert_allclose(one[5][name], two[5][name], rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("loss", ["orpo", "ipo"])
def test_other_losses_train_and_need_no_reference_unless_theirs(loss):
    cfg = preference.PreferenceConfig(loss=loss, beta=0.5 if loss != "simpo" else 2.0)
    setup, _, frozen, first, before, after = run(cfg, steps=8, mesh_shape=(1, 4, 2))
    assert (frozen is None) == (loss != "ipo")
    assert (setup.frozen_shardings is None) == (loss != "ipo")
    assert after["eval/loss"] < before["eval/loss"]
    assert after["eval/rewards/margins"] > before["eval/rewards/margins"]
    if loss == "orpo":
        assert np.isfinite(first["chosen_nll"])


@pytest.mark.slow
def test_lora_dpo_keeps_the_base_bit_identical_and_uses_it_as_the_reference():
    cfg = preference.PreferenceConfig(loss="dpo", beta=0.1)
    # The head adapted too: the random tiny model learns token preferences through it.
    rules = (("(q|k|v|out)_proj/kernel$", 4), ("fc_(in|out)/kernel$", 4), ("lm_head/kernel$", 4))
    lora_cfg = lora.LoraConfig(rules=rules, alpha=8.0)
    setup, state, base, first, before, after = run(cfg, lora_cfg=lora_cfg, lr=3e-2)
    # No second copy of the weights: the frozen argument is the base itself.
    assert setup.frozen_shardings is setup.base_shardings
    assert not hasattr(setup, "copy_params")
    fresh = jax.device_get(setup.init_base())
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(jax.device_get(base))):
        assert np.array_equal(a, b)  # bit-identical after training
    np.testing.assert_allclose(first["loss"], np.log(2.0), rtol=1e-6)  # B = 0: policy = base
    assert after["eval/rewards/accuracies"] > 0.9


def test_a_preference_loss_needs_pairs_and_pairs_need_one():
    from flaxlm.models import features

    with pytest.raises(ValueError, match="bind DatasetConfig.feature_converter"):
        preference.PreferenceConfig().check_data(features.ChatFeatureConverter)
    with pytest.raises(ValueError, match="whose examples are pairs, but train.objective"):
        objective_lib.NEXT_TOKEN_PREDICTION.check_data(features.PreferenceFeatureConverter)
    preference.PreferenceConfig().check_data(features.PreferenceFeatureConverter)
    # As the run reads them: a factory of converters told the run's row start.
    preference.PreferenceConfig().check_data(
        pipeline.ConverterFactory(features.PreferenceFeatureConverter, HF_START, None)
    )
    with pytest.raises(ValueError, match="choose one of"):
        preference.PreferenceConfig(loss="kto")
