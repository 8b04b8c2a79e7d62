"""GRPO's loss over rollouts, for `training/steps.py`'s steps, and the rollout batch it reads.

A rollout batch holds `prompts x num_generations` rows, each a prompt followed by one sampled
completion (`rollout_batch` builds it on the host): the decoder features of a causal LM
(`decoder_input_tokens`, `decoder_target_tokens`, `decoder_loss_weights` on the completion's
tokens, its EOS included), and per row what the step must not recompute: `old_logps` (the
tokens' log-probs under the policy that sampled them), `reference_logps` (under the frozen
reference) and `advantages` (the completion's group-normalised reward). `GrpoModel.loss_fn`
is `loss_math.grpo` on them; `grpo.py` is the run that samples, rewards and steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.posttrain import loss_math, rewards

Array = jax.Array
Batch = Mapping[str, Array]
DECODER_FEATURES = ("decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights")
ROLLOUT_FEATURES = ("old_logps", "reference_logps", "advantages")
ROLLOUT_ENGINES = ("paged", "batch")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class GrpoConfig:
    """GRPO's settings (TRL's `GRPOConfig` names where it has them).

    Attributes:
      num_generations: completions sampled per prompt (the group, G).
      max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty: how they are
        sampled (`inference/sampling.py`; min_p and repetition_penalty by the paged engine
        only). Log-probs are of softmax(logits / temperature), as TRL computes them.
      num_iterations: optimisation passes over each batch of rollouts (mu); the ratio to the
        sampling policy moves away from 1 from the second pass on.
      epsilon: the clip range of the policy ratio.
      beta: the weight of the KL penalty to the reference (0: no reference model).
      reward_fns: `fn(prompts, completions, answers) -> [float]` (see `rewards.py`).
      reward_weights: one per reward function (default all 1); the reward is the weighted
        sum.
      structured_outputs_regex: every completion follows this regex (then ends with its
        EOS), as TRL's `vllm_structured_outputs_regex` constrains vLLM's rollouts; the paged
        engine's (`inference/guides.py`; the task's vocabulary an HF fast tokenizer or
        bytes). Its log-probs stay the policy's, unmasked, as TRL's.
      rollout_engine: what samples the completions: 'paged', the serving engine's
        continuous batching over a paged KV cache (a group's completions read their prompt
        once, and the sampled tokens' log-probs are the policy's, so none are recomputed),
        or 'batch', the static-batch generator (each row prefilled; the families the paged
        engine cannot serve use it whatever is set).
    """

    num_generations: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    num_iterations: int = 1
    epsilon: float = 0.2
    beta: float = 0.04
    reward_fns: Sequence[Callable[..., Sequence[float]]] = (rewards.exact_match,)
    reward_weights: Sequence[float] | None = None
    rollout_engine: str = "paged"
    structured_outputs_regex: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_generations", "max_new_tokens", "num_iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GrpoConfig.{name}={value!r} must be a whole number >= 1.")
        if self.num_generations < 2:
            raise ValueError(
                "GrpoConfig.num_generations must be at least 2: advantages compare the "
                "completions of one prompt."
            )
        if not self.temperature > 0:
            raise ValueError(f"GrpoConfig.temperature={self.temperature!r}: GRPO samples, > 0.")
        if not 0 < self.epsilon < 1 or self.beta < 0:
            raise ValueError(f"GrpoConfig: epsilon in (0, 1) and beta >= 0, got {self}.")
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ValueError(
                f"GrpoConfig.rollout_engine={self.rollout_engine!r}: expected one of "
                f"{ROLLOUT_ENGINES}."
            )
        if not 0.0 <= self.min_p <= 1.0 or not self.repetition_penalty > 0.0:
            raise ValueError(
                f"GrpoConfig: min_p={self.min_p!r} must be in [0, 1] and repetition_penalty="
                f"{self.repetition_penalty!r} > 0."
            )
        if self.rollout_engine == "batch" and self.engine_only:
            raise ValueError(
                f"GrpoConfig: min_p={self.min_p!r}, repetition_penalty="
                f"{self.repetition_penalty!r} and structured_outputs_regex="
                f"{self.structured_outputs_regex!r} are the paged engine's settings; with "
                "rollout_engine='batch' leave them at 0, 1 and None."
            )
        if not self.reward_fns or not all(callable(f) for f in self.reward_fns):
            raise ValueError("GrpoConfig.reward_fns must be a non-empty list of callables.")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_fns):
            raise ValueError(
                f"GrpoConfig: {len(self.reward_weights)} reward_weights for "
                f"{len(self.reward_fns)} reward_fns."
            )

    @property
    def engine_only(self) -> bool:
        """Whether a sampling setting is one only the paged engine applies."""
        return (
            self.min_p > 0.0
            or self.repetition_penalty != 1.0
            or self.structured_outputs_regex is not None
        )

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    def bind(self, policy: Any, model: Any, frozen: Any) -> GrpoModel:
        """The loss model a train step differentiates (see `steps.loss_model`); the
        reference log-probs come with the batch, so `model` and `frozen` are not needed."""
        del model, frozen
        return GrpoModel(policy, self)

    def summarize(self, sums: Mapping[str, Array]) -> dict[str, Array]:
        return summarize(sums)

    def rewards(
        self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str]
    ) -> tuple[np.ndarray, dict[str, float]]:
        """float32 `[rows]` weighted rewards, and each function's mean (`rewards/<name>`)."""
        weights = self.reward_weights or [1.0] * len(self.reward_fns)
        total = np.zeros(len(completions), np.float32)
        means = {}
        for fn, weight in zip(self.reward_fns, weights):
            values = np.asarray(fn(prompts, completions, answers), np.float32)
            if values.shape != total.shape:
                raise ValueError(
                    f"Reward function {getattr(fn, '__name__', fn)} returned "
                    f"{values.shape[0] if values.ndim else values} values for "
                    f"{len(completions)} completions."
                )
            total += weight * values
            means[f"rewards/{getattr(fn, '__name__', 'reward')}"] = float(values.mean())
        return total, means


class GrpoModel:
    """GRPO's loss of `policy`'s params over a rollout batch, in the shape `training/steps.py`'s
    steps expect (`normalizer`: the number of completions; metric sums under TRL's names)."""

    def __init__(self, policy: Any, cfg: GrpoConfig):
        self.policy = policy
        self.cfg = cfg

    def normalizer(self, batch: Batch) -> Array:
        return jnp.float32(batch["advantages"].shape[0])

    def loss_fn(
        self, params: Any, batch: Batch, rng: Array | None, normalizer: Any = None
    ) -> tuple[Array, dict[str, Array]]:
        decoder = {k: batch[k] for k in DECODER_FEATURES}
        logps, weights = self.policy.token_logps(params, decoder, rng, self.cfg.temperature)
        loss, kl, clipped = loss_math.grpo(
            logps,
            batch["old_logps"],
            batch["reference_logps"] if self.cfg.beta > 0 else jax.lax.stop_gradient(logps),
            batch["advantages"],
            weights > 0,
            epsilon=self.cfg.epsilon,
            beta=self.cfg.beta,
        )
        sums = {
            "completions": jnp.float32(loss.shape[0]),
            "loss": loss.sum(),
            "kl": kl.sum(),
            "clip_ratio": clipped.sum(),
        }
        normalizer = self.normalizer(batch) if normalizer is None else normalizer
        return sums["loss"] / normalizer, sums


def summarize(sums: Mapping[str, Array]) -> dict[str, Array]:
    """Means over completions of GRPO's metric sums."""
    count = jnp.maximum(sums["completions"], 1.0)
    return {k: v / count for k, v in sums.items() if k != "completions"}


def rollout_batch(
    prompts: Sequence[Sequence[int]],
    completions: np.ndarray,
    eos_ids: Sequence[int],
    length: int,
    completion_logps: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The decoder features of prompt + completion rows, `[rows, length]` int32, and with
    `completion_logps` (float32 `[rows, max_new_tokens]`: each sampled token's log-prob)
    their `old_logps` `[rows, length]`, where `token_logps` puts them.

    Each prompt starts as the model's training rows do (seqio's start token 0, or the
    tokenizer's BOS, as in the rollout); row i reads `[*prompts[i], *completion][:-1]` and
    predicts `[*prompts[i], *completion][1:]`; the loss weights cover the completion up to
    and including its first EOS. `completions` is `generation.generate`'s output (0 after
    EOS).
    """
    rows = len(prompts)
    inputs = np.zeros((rows, length), np.int32)
    targets = np.zeros((rows, length), np.int32)
    weights = np.zeros((rows, length), np.int32)
    old_logps = np.zeros((rows, length), np.float32)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids = list(completion)
        end = next((j + 1 for j, t in enumerate(ids) if t in eos_ids), len(ids))
        row = (list(prompt) + ids[:end])[: length + 1]
        inputs[i, : len(row) - 1] = row[:-1]
        targets[i, : len(row) - 1] = row[1:]
        weights[i, len(prompt) - 1 : len(row) - 1] = 1
        if completion_logps is not None:
            kept = len(row) - len(prompt)
            old_logps[i, len(prompt) - 1 : len(row) - 1] = completion_logps[i, :kept]
    batch = dict(zip(DECODER_FEATURES, (inputs, targets, weights)))
    if completion_logps is not None:
        batch["old_logps"] = old_logps
    return batch
