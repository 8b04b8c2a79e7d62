"""GRPO with LoRA: only the adapters train (the base bit for bit as it started), the reward
rises, export and infer read the merged model."""

import os

import jax
import numpy as np
import optax
import pytest
from flax import traverse_util

from flaxlm.checkpoints import run_dir
from flaxlm.data import pipeline
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.posttrain import rewards, rl
from flaxlm.runs import grpo
from flaxlm.training import lora, steps
from tests.helpers import tiny_gptj
from tests.test_grpo import digit_share, read

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = ((r"(q|v)_proj/kernel$", 4), (r"(fc_in|fc_out|lm_head)/kernel$", 4))
GROUP, NEW, PROMPT = 4, 4, 8


def model():
    return tiny_gptj(vocab_size=384, max_position_embeddings=32, scan_layers=True)


@pytest.fixture(scope="module")
def task():
    from tasks import jsonl

    files = {"train": os.path.join(REPO, "data/arithmetic/train.jsonl")}
    return jsonl.register_jsonl_task(
        "arithmetic_grpo_lora_test", files, input_key="prompt", target_key="answer"
    )


@pytest.fixture(scope="module")
def lora_run(task, tmp_path_factory):
    """8 steps of GRPO with LoRA from a random base (saved to MODEL_DIR/base); the head is
    adapted too, as a random base's tiny head hides what the layers below it do."""
    model_dir = tmp_path_factory.mktemp("grpo_lora")
    state = grpo.grpo(
        model=model(),
        partitioner=Partitioner(mesh_shape=(2, 2, 2)),
        train_dataset_cfg=pipeline.DatasetConfig(
            mixture_or_task_name=task,
            task_feature_lengths={"inputs": PROMPT, "targets": 4},
            batch_size=4,
            seed=1,
        ),
        config=rl.GrpoConfig(
            num_generations=GROUP,
            max_new_tokens=NEW,
            num_iterations=2,
            reward_fns=(digit_share, rewards.exact_match),
            reward_weights=(1.0, 0.0),
        ),
        learning_rate=3e-2,
        model_dir=str(model_dir),
        total_steps=8,
        log_period=1,
        checkpoint_period=8,
        lora=lora.LoraConfig(rules=RULES),
    )
    return model_dir, state


def test_grpo_with_lora_trains_only_the_adapters_and_raises_the_reward(lora_run):
    model_dir, state = lora_run
    by_step = {r["step"]: r for r in read(model_dir) if "reward" in r}
    first = np.mean([by_step[s]["reward"] for s in (1, 2, 3)])
    last = np.mean([by_step[s]["reward"] for s in (6, 7, 8)])
    assert last > first + 0.2, (first, last)
    assert by_step[8]["kl"] > 0  # the policy moved away from the base, its reference
    # The state holds the adapters alone (so do the optimizer and the checkpoints).
    names = {path[-1] for path in traverse_util.flatten_dict(state.params)}
    assert names == {"lora_a", "lora_b"}
    # The base as it started, bit for bit: the seed's init, recorded for infer and export.
    partitioner = Partitioner(mesh_shape=(2, 2, 2))
    cfg, source = run_dir.read_lora_record(model_dir)
    assert cfg.rules == RULES and source["checkpoint"].endswith("base")
    base = run_dir.restore_lora_base(source, model(), partitioner)
    setup = steps.Setup(
        model(), partitioner, optax.sgd(0.0), {k: 13 for k in rl.DECODER_FEATURES}, lora=cfg
    )
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(base), setup.init_base())
    # Export and infer read the merged model: the base outside the adapted kernels.
    merged = run_dir.load_model_and_params(str(model_dir), partitioner, model=model()).params
    flat_base = traverse_util.flatten_dict(jax.device_get(base))
    flat_merged = traverse_util.flatten_dict(jax.device_get(merged))
    adapted = {k.path for k in lora.plan(cfg, model(), model().example_batch_shapes()).values()}
    changed = {p for p in flat_base if not np.array_equal(flat_base[p], flat_merged[p])}
    assert changed == adapted
