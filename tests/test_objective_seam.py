"""A new training objective plugs into `train.train` through `objective.RunObjective` alone.

The toy objective here is next-token prediction plus a pull towards a frozen reference (the
params the run started from): it needs the reference, reports its own metric and counts
its rows, and `runs/train.py` names none of it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from flaxlm.data.config import DatasetConfig
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs import train
from flaxlm.training import objective as objective_lib
from tests.helpers import tiny_gptj


class AnchoredLoss:
    """`policy`'s loss plus `weight` x the squared distance of the params to `frozen`."""

    def __init__(self, policy: Any, frozen: Any, weight: float):
        self.policy, self.frozen, self.weight = policy, frozen, weight

    def normalizer(self, batch: Mapping[str, jax.Array]) -> Any:
        return self.policy.normalizer(batch)

    def loss_fn(self, params: Any, batch: Any, rng: Any, normalizer: Any = None) -> Any:
        loss, sums = self.policy.loss_fn(params, batch, rng, normalizer)
        distance = sum(
            jnp.sum(jnp.square(p - jax.lax.stop_gradient(f)))
            for p, f in zip(jax.tree.leaves(params), jax.tree.leaves(self.frozen))
        )
        return loss + self.weight * distance, {**sums, "anchor_distance": distance}


@dataclasses.dataclass(frozen=True)
class AnchoredToStart:
    """A `objective.RunObjective` defined outside flaxlm."""

    weight: float = 1.0
    prepared: list = dataclasses.field(default_factory=list, compare=False)

    needs_reference = True
    rows_per_example = 1

    def bind(self, policy: Any, model: Any, frozen: Any) -> AnchoredLoss:
        return AnchoredLoss(policy, frozen, self.weight)

    def summarize(self, sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        return {**objective_lib.summarize(sums), "anchor_distance": sums["anchor_distance"]}

    def check_data(self, converter: Callable[..., Any]) -> None:
        objective_lib.NEXT_TOKEN_PREDICTION.check_data(converter)

    def prepare(self, run: objective_lib.ObjectiveRun) -> None:
        self.prepared.append(run.start_step)


@pytest.mark.slow
def test_a_new_objective_with_a_frozen_reference_trains_through_train(tmp_path):
    import tasks  # noqa: F401 - registers stdlib_py

    objective = AnchoredToStart(weight=1e-3)
    dataset = DatasetConfig(
        mixture_or_task_name="stdlib_py", task_feature_lengths={"targets": 32}, batch_size=8
    )
    train.train(
        model=tiny_gptj(vocab_size=264, max_position_embeddings=32),
        partitioner=Partitioner(mesh_shape=(1, 4, 2)),
        train_dataset_cfg=dataset,
        learning_rate=1e-2,
        model_dir=str(tmp_path),
        total_steps=3,
        checkpoint_period=3,
        log_period=1,
        objective=objective,
    )
    assert objective.prepared == [0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    distances = [r["anchor_distance"] for r in rows if "anchor_distance" in r]
    # Step 1 compares the starting params with themselves (the frozen reference is a copy
    # of them); every later step with params the updates moved.
    assert len(distances) == 3 and distances[0] == pytest.approx(0.0, abs=1e-12)
    assert 0 < distances[1] < distances[2]
