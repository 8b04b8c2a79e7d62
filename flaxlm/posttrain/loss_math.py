"""The math of post-training objectives, on log-probabilities: DPO, IPO, ORPO, SimPO, GRPO.

Pure functions of per-sequence (or per-token) log-probabilities, float32, no model and no
mesh: the preference and RL losses that `training/steps.py`'s steps take (through the
`Objective` protocol) are built on these (`preference.py`, `rl.py`).
Each follows its paper, with TRL's conventions where TRL fixed a free choice:

- DPO (Rafailov et al. 2023, eq. 7): `-log sigmoid(beta * (chosen_ratio - rejected_ratio))`,
  ratios of policy to reference log-probs; `flip_probability` (cDPO) mixes in the flipped
  preference. Rewards are `beta * ratio`, as TRL logs them.
- IPO (Azar et al. 2023, eq. 17): `(ratio difference - 1 / (2 * beta))**2`; as in TRL, the
  log-probs given are per-token averages.
- ORPO (Hong et al. 2024): the odds ratio term `-log sigmoid(log odds(chosen) - log
  odds(rejected))` of average log-probs, weighted by `beta` (the paper's lambda) and added to
  the chosen answers' negative log-likelihood; no reference model.
- SimPO (Meng et al. 2024, eq. 6): `-log sigmoid(beta * (avg chosen - avg rejected) - gamma)`
  on per-token average log-probs; no reference model.
- GRPO (Shao et al. 2024, eq. 3): group-normalised advantages, the clipped policy ratio per
  token, and the k3 estimate of KL to the reference, `exp(ref - logp) - (ref - logp) - 1`;
  token losses averaged over each completion's tokens, then over completions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _log_sigmoid(x: Array) -> Array:
    return jax.nn.log_sigmoid(x.astype(jnp.float32))


def log1mexp(x: Array) -> Array:
    """`log(1 - exp(x))` for `x < 0`, accurate at both ends (Maechler 2012): `log(-expm1(x))`
    near 0, where `1 - exp(x)` loses its digits, and `log1p(-exp(x))` below `-log 2`."""
    x = x.astype(jnp.float32)
    near_zero = x > -jnp.log(2.0)
    # Each branch sees an argument it is safe for, so neither gradient is NaN.
    a = jnp.where(near_zero, x, -1.0)
    b = jnp.where(near_zero, -1.0, x)
    return jnp.where(near_zero, jnp.log(-jnp.expm1(a)), jnp.log1p(-jnp.exp(b)))


def _sigmoid_loss(logits: Array, flip_probability: float) -> Array:
    """`-log sigmoid(logits)` with `flip_probability` of the flipped preference mixed in
    (cDPO; DPO's and SimPO's loss on their margins)."""
    return -(1.0 - flip_probability) * _log_sigmoid(logits) - flip_probability * _log_sigmoid(
        -logits
    )


def dpo(
    policy_chosen: Array,
    policy_rejected: Array,
    reference_chosen: Array,
    reference_rejected: Array,
    *,
    beta: float = 0.1,
    flip_probability: float = 0.0,
) -> tuple[Array, Array, Array]:
    """DPO per pair: (loss, chosen reward, rejected reward), each `[pairs]`, from the
    sequence log-probs of the policy and the reference."""
    chosen = policy_chosen - reference_chosen
    rejected = policy_rejected - reference_rejected
    loss = _sigmoid_loss(beta * (chosen - rejected), flip_probability)
    return loss, beta * chosen, beta * rejected


def ipo(
    policy_chosen: Array,
    policy_rejected: Array,
    reference_chosen: Array,
    reference_rejected: Array,
    *,
    beta: float = 0.1,
) -> tuple[Array, Array, Array]:
    """IPO per pair: (loss, chosen reward, rejected reward) from per-token *average*
    log-probs of the policy and the reference."""
    chosen = policy_chosen - reference_chosen
    rejected = policy_rejected - reference_rejected
    loss = jnp.square(chosen - rejected - 1.0 / (2.0 * beta))
    return loss, beta * chosen, beta * rejected


def orpo(
    chosen_avg: Array, rejected_avg: Array, chosen_nll: Array, *, beta: float = 0.1
) -> tuple[Array, Array, Array]:
    """ORPO per pair: (loss, chosen reward, rejected reward) from the policy's per-token
    average log-probs of both answers and the chosen answer's mean negative log-likelihood
    (its SFT loss). Rewards are `beta * average log-prob`, as TRL logs them."""

    def log_odds(avg: Array) -> Array:
        # log(p / (1 - p)) with p = exp(avg) < 1
        return avg - log1mexp(jnp.minimum(avg, -1e-7))

    odds_ratio = _log_sigmoid(log_odds(chosen_avg) - log_odds(rejected_avg))
    return chosen_nll - beta * odds_ratio, beta * chosen_avg, beta * rejected_avg


def simpo(
    chosen_avg: Array,
    rejected_avg: Array,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    flip_probability: float = 0.0,
) -> tuple[Array, Array, Array]:
    """SimPO per pair: (loss, chosen reward, rejected reward) from the policy's per-token
    average log-probs; `gamma` is the target reward margin."""
    loss = _sigmoid_loss(beta * (chosen_avg - rejected_avg) - gamma, flip_probability)
    return loss, beta * chosen_avg, beta * rejected_avg


def group_advantages(rewards: Array, eps: float = 1e-4) -> Array:
    """GRPO's advantages: each completion's reward minus its group's mean, over the group's
    sample standard deviation (Bessel-corrected, as TRL's `scale_rewards='group'` takes it;
    a group has 2 or more) + `eps`; `[prompts, group]` -> `[prompts, group]`."""
    rewards = rewards.astype(jnp.float32)
    mean = rewards.mean(-1, keepdims=True)
    std = rewards.std(-1, keepdims=True, ddof=1)
    return (rewards - mean) / (std + eps)


def grpo(
    logps: Array,
    old_logps: Array,
    reference_logps: Array,
    advantages: Array,
    mask: Array,
    *,
    epsilon: float = 0.2,
    beta: float = 0.04,
) -> tuple[Array, Array, Array]:
    """GRPO's objective on `[completions, length]` token log-probs under the policy being
    trained, the policy that sampled them and the reference, `[completions]` advantages and a
    `[completions, length]` mask of the completion's tokens.

    Returns `[completions]` (loss, KL, clipped fraction), each averaged over the
    completion's tokens: the loss to minimise, `-(clipped surrogate - beta * KL)`, the k3 KL
    and the fraction of tokens whose ratio was clipped. Their means over completions are
    the objective (sums, so that microbatches add up).
    """
    mask = mask.astype(jnp.float32)
    ratio = jnp.exp(logps - old_logps)
    adv = advantages.astype(jnp.float32)[:, None]
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon)
    surrogate = jnp.minimum(ratio * adv, clipped * adv)
    log_ref_ratio = reference_logps - logps
    kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0
    was_clipped = (ratio * adv > clipped * adv).astype(jnp.float32)

    def per_completion(x: Array) -> Array:
        return (x * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)

    loss = per_completion(-(surrogate - beta * kl))
    return loss, per_completion(kl), per_completion(was_clipped)
