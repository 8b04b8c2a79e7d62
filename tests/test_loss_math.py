"""Each post-training objective equals its paper's formula, computed directly in numpy
(float64) on fixed log-probabilities, to 1e-6."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxlm.posttrain import loss_math

RNG = np.random.default_rng(0)
PAIRS = 6
# Sequence log-probs (sums) of chosen / rejected answers under the policy and the reference,
# and per-token averages (answers of 3-9 tokens).
POLICY = -RNG.uniform(5.0, 40.0, (2, PAIRS))
REFERENCE = POLICY + RNG.normal(0.0, 2.0, (2, PAIRS))
LENGTHS = RNG.integers(3, 10, (2, PAIRS)).astype(np.float64)
AVERAGE = POLICY / LENGTHS / 4.0  # between about -3.3 and -0.1: probabilities below 1


def log_sigmoid(x):
    return -np.log1p(np.exp(-x))


def close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=1e-6)


def f32(x):
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("flip_probability", [0.0, 0.1])
def test_dpo_is_the_papers_sigmoid_loss(flip_probability):
    beta = 0.1
    loss, chosen, rejected = loss_math.dpo(
        *map(f32, (POLICY[0], POLICY[1], REFERENCE[0], REFERENCE[1])),
        beta=beta,
        flip_probability=flip_probability,
    )
    # Rafailov et al., eq. 7 (and cDPO's smoothing): h = beta * log-ratio margin
    h = beta * ((POLICY[0] - REFERENCE[0]) - (POLICY[1] - REFERENCE[1]))
    want = -(1 - flip_probability) * log_sigmoid(h) - flip_probability * log_sigmoid(-h)
    close(loss, want)
    close(chosen, beta * (POLICY[0] - REFERENCE[0]))
    close(rejected, beta * (POLICY[1] - REFERENCE[1]))


def test_ipo_is_the_papers_squared_loss():
    beta = 0.5
    avg_ref = REFERENCE / LENGTHS
    avg_pol = POLICY / LENGTHS
    args = map(f32, (avg_pol[0], avg_pol[1], avg_ref[0], avg_ref[1]))
    loss, _, _ = loss_math.ipo(*args, beta=beta)
    # Azar et al., eq. 17: (h - 1 / (2 tau))^2, h the margin of log-ratios
    h = (avg_pol[0] - avg_ref[0]) - (avg_pol[1] - avg_ref[1])
    close(loss, (h - 1 / (2 * beta)) ** 2)


def test_orpo_adds_the_log_odds_ratio_to_the_nll():
    lam = 0.25
    nll = -AVERAGE[0]
    loss, chosen, _ = loss_math.orpo(f32(AVERAGE[0]), f32(AVERAGE[1]), f32(nll), beta=lam)
    # Hong et al.: odds(y) = P / (1 - P), P the average-token probability
    p = np.exp(AVERAGE)
    odds = p / (1 - p)
    want = nll - lam * log_sigmoid(np.log(odds[0] / odds[1]))
    close(loss, want)
    close(chosen, lam * AVERAGE[0])


def test_simpo_is_the_length_normalised_margin_loss():
    beta, gamma = 2.0, 0.5
    loss, _, _ = loss_math.simpo(f32(AVERAGE[0]), f32(AVERAGE[1]), beta=beta, gamma=gamma)
    # Meng et al., eq. 6
    close(loss, -log_sigmoid(beta * AVERAGE[0] - beta * AVERAGE[1] - gamma))


def test_grpo_advantages_clipped_objective_and_k3_kl():
    prompts, group, length = 2, 4, 5
    rewards = RNG.integers(0, 2, (prompts, group)).astype(np.float64)
    rewards[1] = [0.0, 0.5, 1.0, 1.0]
    # (TRL's: the group's sample standard deviation, torch's default `std`)
    std = rewards.std(-1, keepdims=True, ddof=1)
    adv = (rewards - rewards.mean(-1, keepdims=True)) / (std + 1e-4)
    close(loss_math.group_advantages(f32(rewards)), adv)

    n = prompts * group
    old = -RNG.uniform(0.1, 3.0, (n, length))
    new = old + RNG.normal(0.0, 0.3, (n, length))  # ratios on both sides of the clip range
    ref = old + RNG.normal(0.0, 0.3, (n, length))
    mask = np.ones((n, length))
    mask[0, 3:] = 0.0
    mask[5, 1:] = 0.0
    eps, beta = 0.2, 0.04
    a = adv.reshape(-1)[:, None]
    ratio = np.exp(new - old)
    surrogate = np.minimum(ratio * a, np.clip(ratio, 1 - eps, 1 + eps) * a)  # Shao et al., eq. 3
    kl = np.exp(ref - new) - (ref - new) - 1  # k3
    per_token = -(surrogate - beta * kl)
    want = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    loss, mean_kl, clipped = loss_math.grpo(
        *map(f32, (new, old, ref, adv.reshape(-1), mask)), epsilon=eps, beta=beta
    )
    close(loss.mean(), want)
    close(mean_kl.mean(), ((kl * mask).sum(-1) / mask.sum(-1)).mean())
    assert 0.0 < float(clipped.mean()) < 1.0


def test_log1mexp_keeps_its_digits_near_zero_and_far_from_it():
    """ORPO's log odds need log(1 - exp(x)) near x = 0 (answers the model finds likely),
    where log1p(-exp(x)) keeps ~4 digits in float32 (8.3e-5 off at -1e-4); the switch to
    expm1 keeps float32's relative precision (a few eps) across the range."""
    x = np.asarray([-1e-6, -1e-4, -0.1, -0.69, -0.7, -1.0, -5.0], np.float32)
    want = np.log(-np.expm1(x.astype(np.float64)))
    got = np.asarray(loss_math.log1mexp(jnp.asarray(x)), np.float64)
    np.testing.assert_allclose(got, want, rtol=8 * np.finfo(np.float32).eps)
    grads = jax.grad(lambda v: loss_math.log1mexp(v).sum())(jnp.asarray(x))
    assert np.isfinite(np.asarray(grads)).all()
