"""Preference optimisation as an objective of `training.steps`: DPO, IPO, ORPO, SimPO.

A batch holds pairs: every decoder feature is `[pairs, 2, length]`, row 0 the prompt with
the chosen answer, row 1 with the rejected one, loss weights on the answers' tokens only
(`features.PreferenceFeatureConverter`). `PreferenceModel.loss_fn` runs the policy once over
the `2 * pairs` rows (a pair never leaves its device), sums each answer's log-probabilities
and hands them to `loss_math` (the papers' formulas). The reference of DPO and IPO is the
frozen starting policy: the `reference_params` the step is given (with LoRA, the base params
without the adapters, so no second copy of the weights). Its log-probs may also come with
the batch (`reference_logps`, `[pairs, 2]`), computed once ahead of training.

Metrics carry TRL's names: `rewards/chosen`, `rewards/rejected`, `rewards/accuracies`,
`rewards/margins`, `logps/chosen`, `logps/rejected` (summed per step, divided by `pairs`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import gin
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from flaxlm.posttrain import loss_math
from flaxlm.training import metrics
from flaxlm.training import objective as objective_lib

Array = jax.Array
Batch = Mapping[str, Array]
LOSSES = ("dpo", "ipo", "orpo", "simpo")
REFERENCE_FEATURE = "reference_logps"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """Which preference loss, and its settings. A name TRL 1.16 also uses means what TRL
    means by it (`beta`, `gamma`); flaxlm's own choices carry their own names (the table in
    docs/posttraining.md gives each one's TRL equivalent).

    Attributes:
      loss: 'dpo' (TRL's `loss_type='sigmoid'`), 'ipo', 'orpo' (no reference) or 'simpo'
        (no reference).
      beta: DPO/IPO/SimPO's beta; ORPO's weight of the odds-ratio term (the paper's lambda).
      label_flip_probability: conservative DPO (cDPO) and SimPO's probability that a label
        is flipped, `-(1-e) log sigmoid(x) - e log sigmoid(-x)`. TRL 1.16's sigmoid loss has
        no such setting (its `label_smoothing` serves its robust / aot / exo_pair losses).
      gamma: SimPO's target reward margin.
      sft_weight: add this times the NLL of the chosen answers, a mean over every chosen
        token of the batch, to the loss (RPO, Pang et al. 2024): TRL 1.16's
        `loss_type=['sigmoid', 'sft'], loss_weights=[1, sft_weight]`. None: off. (ORPO has
        its own NLL term built in.)
      precompute_reference: compute the reference log-probs of every training batch (and
        of the evaluation batches) in one pass over the data before training, so the
        reference params are not held during training (DPO and IPO without LoRA).
    """

    loss: str = "dpo"
    beta: float = 0.1
    label_flip_probability: float = 0.0
    gamma: float = 0.5
    sft_weight: float | None = None
    precompute_reference: bool = False

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"PreferenceConfig.loss={self.loss!r}: choose one of {LOSSES}.")
        if not self.beta > 0:
            raise ValueError(f"PreferenceConfig.beta={self.beta!r} must be positive.")
        if not 0.0 <= self.label_flip_probability < 0.5:
            raise ValueError(
                "PreferenceConfig.label_flip_probability="
                f"{self.label_flip_probability!r} must be in [0, 0.5)."
            )
        if self.sft_weight is not None and (self.sft_weight < 0 or self.loss == "orpo"):
            raise ValueError(
                f"sft_weight={self.sft_weight!r}: a weight >= 0, for a loss other than 'orpo'."
            )
        if self.precompute_reference and self.loss not in ("dpo", "ipo"):
            raise ValueError(f"precompute_reference: {self.loss!r} has no reference model.")
        if self.label_flip_probability and self.loss not in ("dpo", "simpo"):
            raise ValueError(
                f"label_flip_probability applies to 'dpo' and 'simpo', not {self.loss!r}."
            )

    @property
    def needs_reference(self) -> bool:
        """Whether the steps need the reference params (not when precomputed)."""
        return self.loss in ("dpo", "ipo") and not self.precompute_reference

    @property
    def rows_per_example(self) -> int:
        return 2  # a pair: the chosen and the rejected sequence

    def bind(self, policy: Any, model: Any, frozen: Any) -> PreferenceModel:
        """The loss model a train step differentiates (see `steps.loss_model`)."""
        return PreferenceModel(policy, self, model, frozen)

    def summarize(self, sums: Mapping[str, Array]) -> dict[str, Array]:
        return summarize(sums)

    def check_data(self, converter: Any) -> None:
        """A ValueError unless the data is read as pairs (before any device work: the shapes
        would fail deep inside the step)."""
        if objective_lib.rows_of(converter) != 2:
            name = type(converter(pack=False)).__name__
            raise ValueError(
                f"train.objective is a {self.loss!r} preference loss, but the data is read "
                f"with {name}: bind DatasetConfig.feature_converter = "
                "@features.PreferenceFeatureConverter and a task of pairs "
                "(chat.register_preference_task), as gin/dpo.gin does."
            )

    def prepare(self, run: objective_lib.ObjectiveRun) -> ReferenceFeatures | None:
        """With `precompute_reference`: the reference log-probs of the training batches of
        steps `start_step + 1 ...` and of the evaluation batches (fresh iterators over the
        same data), in one pass before training; the reference params are then let go."""
        if not self.precompute_reference:
            return None
        setup = run.setup
        if setup.lora is not None:
            raise ValueError(
                "precompute_reference with LoRA: the reference is the base params the run "
                "holds anyway; unset PreferenceConfig.precompute_reference."
            )
        table = ReferenceTable(
            setup.model,
            setup.partitioner,
            setup.state_shardings.params,
            setup.batch_axes,
            run.reference_params(),
        )
        train_iter, eval_iter = run.data()
        start = time.perf_counter()
        train = table.compute(train_iter, run.start_step, run.total_steps - run.start_step)
        evaluation = table.compute(eval_iter, 0, run.eval_steps) if eval_iter else []
        metrics.print0(
            f"Reference log-probs of {len(train)} training and {len(evaluation)} evaluation "
            f"batches precomputed in {time.perf_counter() - start:.1f}s."
        )
        return ReferenceFeatures(train, evaluation, run.start_step)


def pairs_as_rows(batch: Batch) -> dict[str, Array]:
    """`[pairs, 2, length]` features -> `[2 * pairs, length]` rows (chosen, rejected, chosen,
    ...); features of other ranks are left out."""
    return {k: v.reshape((-1,) + v.shape[2:]) for k, v in batch.items() if v.ndim == 3}


def sequence_logps(
    policy: Any, params: Any, batch: Batch, rng: Array | None
) -> tuple[Array, Array]:
    """`[pairs, 2]` summed answer log-probs under `policy` (anything with `token_logps`, e.g. a
    model or a `LoraModel`) and `[pairs, 2]` answer token counts."""
    logps, weights = policy.token_logps(params, pairs_as_rows(batch), rng)
    pairs = logps.shape[0] // 2
    return logps.sum(-1).reshape(pairs, 2), (weights > 0).sum(-1).reshape(pairs, 2)


class PreferenceModel:
    """The preference loss of `policy`'s params, in the shape `training/steps.py` expects
    (`normalizer`, `loss_fn(params, batch, rng, normalizer) -> (loss, metric sums)`).

    `reference` (a model) and `reference_params` give the reference log-probs when the loss
    needs them and the batch does not carry them.
    """

    def __init__(
        self,
        policy: Any,
        cfg: PreferenceConfig,
        reference: Any = None,
        reference_params: Any = None,
    ):
        self.policy = policy
        self.cfg = cfg
        self.reference = reference
        self.reference_params = reference_params

    def normalizer(self, batch: Batch) -> dict[str, Array]:
        """The batch's pairs (the preference losses are means over pairs) and chosen answer
        tokens (`sft_weight`'s NLL is a mean over them, as TRL's 'sft' loss)."""
        return {
            "pairs": jnp.float32(next(iter(batch.values())).shape[0]),
            "chosen_tokens": batch["decoder_loss_weights"][:, 0].astype(jnp.float32).sum(),
        }

    def reference_logps(self, batch: Batch) -> Array:
        """`[pairs, 2]` summed answer log-probs under the reference (no gradient)."""
        if REFERENCE_FEATURE in batch:
            return batch[REFERENCE_FEATURE].astype(jnp.float32)
        if self.reference is None or self.reference_params is None:
            raise ValueError(
                f"The {self.cfg.loss!r} loss needs a reference model: none was given and the "
                f"batch has no {REFERENCE_FEATURE!r}."
            )
        params = jax.lax.stop_gradient(self.reference_params)
        return jax.lax.stop_gradient(sequence_logps(self.reference, params, batch, None)[0])

    def loss_fn(
        self, params: Any, batch: Batch, rng: Array | None, normalizer: Any = None
    ) -> tuple[Array, dict[str, Array]]:
        cfg = self.cfg
        logps, counts = sequence_logps(self.policy, params, batch, rng)
        avg = logps / jnp.maximum(counts, 1).astype(jnp.float32)
        extra = {}
        if cfg.loss == "dpo":
            ref = self.reference_logps(batch)
            loss, chosen, rejected = loss_math.dpo(
                logps[:, 0],
                logps[:, 1],
                ref[:, 0],
                ref[:, 1],
                beta=cfg.beta,
                flip_probability=cfg.label_flip_probability,
            )
        elif cfg.loss == "ipo":
            ref = self.reference_logps(batch) / jnp.maximum(counts, 1).astype(jnp.float32)
            loss, chosen, rejected = loss_math.ipo(
                avg[:, 0], avg[:, 1], ref[:, 0], ref[:, 1], beta=cfg.beta
            )
        elif cfg.loss == "orpo":
            nll = -avg[:, 0]
            loss, chosen, rejected = loss_math.orpo(avg[:, 0], avg[:, 1], nll, beta=cfg.beta)
            extra["chosen_nll"] = nll.sum()
        else:
            loss, chosen, rejected = loss_math.simpo(
                avg[:, 0],
                avg[:, 1],
                beta=cfg.beta,
                gamma=cfg.gamma,
                flip_probability=cfg.label_flip_probability,
            )
        # TRL's DPO trainer (DPO, IPO) logs each answer's summed log-prob; its ORPO and CPO
        # trainers (ORPO, SimPO) the per-token mean, which their losses use.
        logged = avg if cfg.loss in ("orpo", "simpo") else logps
        normalizer = self.normalizer(batch) if normalizer is None else normalizer
        if cfg.sft_weight is not None:
            # TRL's 'sft' term: the chosen tokens' NLL summed, over the whole batch's chosen
            # tokens; as a per-pair loss (pairs x that), so that the mean over pairs adds it.
            tokens = jnp.maximum(normalizer["chosen_tokens"], 1.0)
            nll_sum = -logps[:, 0]
            extra["sft_loss"] = nll_sum.sum() * normalizer["pairs"] / tokens
            loss = loss + cfg.sft_weight * nll_sum * normalizer["pairs"] / tokens
        sums = {
            "pairs": jnp.float32(loss.shape[0]),
            "loss": loss.sum(),
            "rewards/chosen": chosen.sum(),
            "rewards/rejected": rejected.sum(),
            "rewards/accuracies": (chosen > rejected).astype(jnp.float32).sum(),
            "rewards/margins": (chosen - rejected).sum(),
            "logps/chosen": logged[:, 0].sum(),
            "logps/rejected": logged[:, 1].sum(),
            **extra,
        }
        return sums["loss"] / normalizer["pairs"], sums


def summarize(sums: Mapping[str, Array]) -> dict[str, Array]:
    """Means over pairs of a preference loss's metric sums, and `num_pairs`."""
    pairs = jnp.maximum(sums["pairs"], 1.0)
    out = {k: v / pairs for k, v in sums.items() if k != "pairs"}
    out["num_pairs"] = sums["pairs"]
    return out


class ReferenceTable:
    """Reference log-probs computed ahead (`PreferenceConfig.precompute_reference`): the
    `[pairs, 2]` answer log-probs of the reference `params` (on `param_shardings`) for the
    batches (`batch_axes`) of an iterator, one forward pass each, kept on the devices."""

    def __init__(
        self, model: Any, partitioner: Any, param_shardings: Any, batch_axes: Any, params: Any
    ):
        self.params = params
        self.score = partitioner.partition(
            lambda p, batch: sequence_logps(model, p, batch, None)[0],
            (param_shardings, batch_axes),
            P("batch", None),
        )

    def compute(self, iterator: Any, skip: int, steps: int) -> list[Array]:
        """The next `steps` batches' log-probs after skipping `skip` (read, not computed)."""
        for _ in range(skip):
            iterator.next_numpy()
        table = []
        for _ in range(steps):
            try:
                table.append(self.score(self.params, next(iterator)))
            except StopIteration:
                break
        return table


@dataclasses.dataclass
class ReferenceFeatures:
    """Precomputed reference log-probs as batch features (`objective.BatchFeatures`): the
    training batch of step `start_step + 1 + i` carries `train[i]`, the i-th batch of an
    evaluation pass `evaluation[i]`."""

    train_table: list[Array]
    evaluation: list[Array]
    start_step: int
    axes: Mapping[str, P] = dataclasses.field(
        default_factory=lambda: {REFERENCE_FEATURE: P("batch")}
    )

    def train(self, step: int) -> dict[str, Array]:
        return {REFERENCE_FEATURE: self.train_table[step - self.start_step]}

    def eval_iterator(self, iterator: Any) -> WithReference | None:
        return None if iterator is None else WithReference(iterator, self.evaluation)


class WithReference:
    """An evaluation iterator whose batches carry their precomputed `reference_logps`
    (the i-th batch after each `reset`, the i-th entry of `table`)."""

    def __init__(self, iterator: Any, table: list[Array]):
        self.iterator, self.table, self.index = iterator, table, 0

    def reset(self) -> None:
        self.iterator.reset()
        self.index = 0

    def __iter__(self) -> WithReference:
        return self

    def __next__(self) -> dict[str, Array]:
        batch = next(self.iterator)
        if self.index >= len(self.table):
            raise StopIteration
        batch = {**batch, REFERENCE_FEATURE: self.table[self.index]}
        self.index += 1
        return batch
