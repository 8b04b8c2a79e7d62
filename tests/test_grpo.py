"""GRPO: rollouts sampled on the mesh, rewarded, and learned from; exact resume."""

import json
import os
import re

import numpy as np
import pytest

from flaxlm.data.config import DatasetConfig
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.posttrain import rewards, rl
from flaxlm.runs import grpo
from tests.helpers import tiny_gptj

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def digit_share(prompts, completions, answers):
    """The share of a completion's characters that are digits: a dense reward a random
    byte-level policy starts near 0.08 on."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@pytest.fixture(scope="module")
def task():
    from tasks import jsonl

    files = {"train": os.path.join(REPO, "data/arithmetic/train.jsonl")}
    return jsonl.register_jsonl_task(
        "arithmetic_grpo_test", files, input_key="prompt", target_key="answer"
    )


def run(task, model_dir, steps, inputs=8, **config):
    rewarded = dict(reward_fns=(digit_share, rewards.exact_match), reward_weights=(1.0, 0.0))
    cfg = rl.GrpoConfig(num_generations=4, max_new_tokens=4, **{**rewarded, **config})
    return grpo.grpo(
        model=tiny_gptj(vocab_size=384, max_position_embeddings=32),
        partitioner=Partitioner(mesh_shape=(2, 2, 2)),
        train_dataset_cfg=DatasetConfig(
            mixture_or_task_name=task,
            task_feature_lengths={"inputs": inputs, "targets": 4},
            batch_size=4,
            seed=1,
        ),
        config=cfg,
        learning_rate=2e-2,
        model_dir=str(model_dir),
        total_steps=steps,
        log_period=1,
        checkpoint_period=2,
    )


def read(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_grpo_raises_the_reward_and_resumes_exactly(task, tmp_path):
    state = run(task, tmp_path / "once", 16, num_iterations=2)
    records = read(tmp_path / "once")
    by_step = {r["step"]: r for r in records if "reward" in r}
    first = np.mean([by_step[s]["reward"] for s in (1, 2, 3)])
    last = np.mean([by_step[s]["reward"] for s in (14, 15, 16)])
    assert last > first + 0.2, (first, last)
    for name in ("kl", "clip_ratio", "completion_length", "rewards/digit_share", "loss"):
        assert np.isfinite(by_step[16][name]), name
    # Metrics are the last pass's: the second pass over a batch whose rewards differ sees
    # the policy one update away from the sampler (ratios clipped) and from the reference
    # (KL above 0).
    early = [by_step[s] for s in (1, 2, 3) if by_step[s]["reward_std"] > 0]
    assert early and all(r["clip_ratio"] > 0 and r["kl"] > 0 for r in early)
    assert by_step[16]["kl"] > max(r["kl"] for r in early)
    assert state.step == 32  # two optimizer steps per batch of rollouts

    # Stopped after step 2 and resumed: the rollouts (sampling keys by step) and updates of
    # the run that went straight through.
    run(task, tmp_path / "twice", 2, num_iterations=2)
    run(task, tmp_path / "twice", 4, num_iterations=2)
    resumed = {r["step"]: r for r in read(tmp_path / "twice") if "reward" in r}
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        for name in ("reward", "loss", "completion_length", "kl", "grad_norm"):
            np.testing.assert_allclose(
                resumed[step][name], by_step[step][name], rtol=1e-6, err_msg=name
            )

    # Prompts ("4+7=") longer than TASK_FEATURE_LENGTHS['inputs'] stop the run, named, at
    # their first batch (seqio would have cut them to "4+7", silently): no checkpoint written.
    with pytest.raises(
        ValueError,
        match=r"4 prompt\(s\) of GRPO step 1's batch are longer than "
        r"TASK_FEATURE_LENGTHS\['inputs'\]=3 tokens \(the first: '\d\+\d=",
    ):
        run(task, tmp_path / "long", 2, inputs=3, num_iterations=2)
    assert not os.path.exists(tmp_path / "long" / "checkpoints" / "1")


@pytest.mark.slow
def test_rollouts_follow_trls_structured_outputs_regex(task, tmp_path):
    """`GrpoConfig.structured_outputs_regex` (TRL's `vllm_structured_outputs_regex`): every
    completion the paged engine samples is the regex, then EOS (the random policy writes any
    byte unguided); a regex llguidance cannot read stops the run before it writes anything."""
    completions = []

    def digits(prompts, completions_, answers):
        completions.extend(completions_)
        return [float(bool(re.fullmatch("[0-9]{1,2}", c))) for c in completions_]

    guided = dict(reward_fns=(digits,), reward_weights=None)
    run(task, tmp_path / "guided", 2, structured_outputs_regex="[0-9]{1,2}", **guided)
    assert len(completions) == 2 * 4 * 4  # steps x prompts x generations
    assert all(re.fullmatch("[0-9]{1,2}", c) for c in completions), completions
    records = [r for r in read(tmp_path / "guided") if "reward" in r]
    assert [r["reward"] for r in records] == [1.0, 1.0]
    assert all(r["completion_length"] <= 3 for r in records)  # digits, then EOS
    with pytest.raises(ValueError, match=r"structured_outputs_regex='\(\[': "):
        run(task, tmp_path / "bad", 2, structured_outputs_regex="([")
    assert not os.path.exists(tmp_path / "bad" / "checkpoints")


def test_rollout_batch_and_bad_config():
    # Prompts after seqio's start token 0: rows read [0, prompt, completion].
    batch = rl.rollout_batch([[0, 5, 6], [0, 7]], np.array([[8, 1, 0], [9, 9, 9]]), (1,), 6)
    np.testing.assert_array_equal(
        batch["decoder_target_tokens"], [[5, 6, 8, 1, 0, 0], [7, 9, 9, 9, 0, 0]]
    )
    np.testing.assert_array_equal(
        batch["decoder_input_tokens"], [[0, 5, 6, 8, 0, 0], [0, 7, 9, 9, 0, 0]]
    )
    np.testing.assert_array_equal(
        batch["decoder_loss_weights"], [[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0]]
    )
    # As HF feeds a tokenizer without BOS: nothing inserted, the first token unpredicted.
    hf = rl.rollout_batch([[5, 6], [7]], np.array([[8, 1, 0], [9, 9, 9]]), (1,), 5)
    np.testing.assert_array_equal(hf["decoder_input_tokens"], [[5, 6, 8, 0, 0], [7, 9, 9, 0, 0]])
    np.testing.assert_array_equal(hf["decoder_target_tokens"], [[6, 8, 1, 0, 0], [9, 9, 9, 0, 0]])
    np.testing.assert_array_equal(hf["decoder_loss_weights"], [[0, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    # The engine's sampled log-probs where token_logps puts the completion's.
    logps = np.array([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], np.float32)
    sampled = rl.rollout_batch(
        [[0, 5, 6], [0, 7]], np.array([[8, 1, 0], [9, 9, 9]]), (1,), 6, logps
    )
    np.testing.assert_array_equal(
        sampled["old_logps"], [[0, 0, -1, -2, 0, 0], [0, -4, -5, -6, 0, 0]]
    )
    with pytest.raises(ValueError, match="repetition_penalty=1.1 and structured_outputs_regex="):
        rl.GrpoConfig(repetition_penalty=1.1, rollout_engine="batch")
    with pytest.raises(ValueError, match="structured_outputs_regex='a' are the paged engine's"):
        rl.GrpoConfig(structured_outputs_regex="a", rollout_engine="batch")
    with pytest.raises(ValueError, match="min_p=2 must be in"):
        rl.GrpoConfig(min_p=2)
    with pytest.raises(ValueError, match="rollout_engine='vllm'"):
        rl.GrpoConfig(rollout_engine="vllm")
    with pytest.raises(ValueError, match="num_generations must be at least 2"):
        rl.GrpoConfig(num_generations=1)
    with pytest.raises(ValueError, match="2 reward_weights for 1 reward_fns"):
        rl.GrpoConfig(reward_weights=(1.0, 2.0))
    assert rewards.leading_number_match(["", ""], ["12 apples", "x"], ["12", "3"]) == [1.0, 0.0]
    assert rewards.format_match(["", ""], [" 42 ", "4 2"], ["", ""]) == [1.0, 0.0]
