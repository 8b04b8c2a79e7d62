"""The objective seam: what a train step and `train.train` ask of a training objective
(`Objective`, `RunObjective`), and the default one, next-token prediction.

Objectives beyond it (`posttrain/`: preference losses, GRPO's) implement the protocols;
nothing in `training/` or `runs/train.py` names them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from flaxlm.models import routing
from flaxlm.models.base import BaseModel


def summarize(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Mean loss and accuracy of next-token prediction from summed metrics (and a mixture
    of experts' router telemetry, `routing.summarize`)."""
    denom = jnp.maximum(sums["weight_sum"], 1.0)
    return {
        "loss": sums["loss_sum"] / denom,
        "z_loss": sums["z_loss_sum"] / denom,
        "accuracy": sums["correct_sum"] / denom,
        "num_tokens": sums["weight_sum"],
        **routing.summarize(sums),
        # Multi-token prediction's mean cross-entropy over its depths (models/mtp.py).
        **({"mtp_loss": sums["mtp_loss_sum"] / denom} if "mtp_loss_sum" in sums else {}),
    }


class Objective(Protocol):
    """What a train step needs of a training objective (next-token prediction, a preference
    loss, GRPO's): whether it compares with frozen reference params, the loss model it makes
    of a policy (`model` or a `LoraModel`), the model and the frozen params
    (`normalizer(batch)`, `loss_fn(params, batch, rng, normalizer) -> (loss, metric sums)`),
    and the metrics of its summed metrics."""

    @property
    def needs_reference(self) -> bool: ...

    def bind(self, policy: Any, model: BaseModel, frozen: Any) -> Any: ...

    def summarize(self, sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]: ...


class RunObjective(Objective, Protocol):
    """An objective `train.train` runs: besides the steps' needs, how many model rows an
    example is (tokens/s counts them), a check of the data before any device work, and what
    it adds to the batches before the first step (`prepare`, e.g. reference log-probs
    computed ahead). `train` names no particular objective: this is all it asks."""

    @property
    def rows_per_example(self) -> int: ...

    def check_data(self, converter: Callable[..., Any]) -> None: ...

    def prepare(self, run: ObjectiveRun) -> BatchFeatures | None: ...


@dataclasses.dataclass(frozen=True)
class ObjectiveRun:
    """What a run hands `RunObjective.prepare` before its first step: its setup, the step it
    starts from, the frozen reference (the params it started from: loaded, not copied) and
    fresh train and eval iterators over its data, with its train and eval step counts."""

    setup: Any  # the run's `steps.Setup` (model, partitioner, shardings, batch axes)
    start_step: int
    reference_params: Callable[[], Any]
    data: Callable[[], tuple[Any, Any | None]]
    total_steps: int
    eval_steps: int


class BatchFeatures(Protocol):
    """Features an objective adds to every batch (their `axes` on the mesh): the training
    batch of each step (`train(step)`), and each batch an evaluation iterator gives."""

    axes: Mapping[str, P]

    def train(self, step: int) -> dict[str, jax.Array]: ...

    def eval_iterator(self, iterator: Any) -> Any: ...


def rows_of(converter: Callable[..., Any]) -> int:
    """How many rows an example of `converter` (what makes the run's feature converters,
    `converter(pack=...)`) holds: 1 for `[length]` features, 2 for preference pairs'
    `[2, length]`."""
    specs = converter(pack=False).MODEL_FEATURES.values()
    return 2 if any(getattr(spec, "rank", 1) == 2 for spec in specs) else 1


class NextTokenPrediction:
    """The model's own loss, next-token cross-entropy on `[batch, length]` rows: what
    `train.train` optimises unless another objective is bound."""

    needs_reference = False
    rows_per_example = 1

    def bind(self, policy: Any, model: BaseModel, frozen: Any) -> Any:
        return policy

    def summarize(self, sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        return summarize(sums)

    def check_data(self, converter: Callable[..., Any]) -> None:
        if rows_of(converter) != 1:
            name = getattr(getattr(converter, "func", converter), "__name__", converter)
            raise ValueError(
                f"The data is read with {name}, whose examples are pairs, but train.objective "
                "is next-token prediction: bind train.objective = "
                "@preference.PreferenceConfig()."
            )

    def prepare(self, run: ObjectiveRun) -> None:
        return None


NEXT_TOKEN_PREDICTION = NextTokenPrediction()
