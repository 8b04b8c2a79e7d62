"""GRPO with LoRA, and its rollouts through the paged engine: only the adapters train (the
base bit for bit as it started), the reward rises, the reference is the base without the
adapters, the engine's sampled log-probs are the trainer's, a group's prompt is read once."""

import dataclasses
import os

import jax
import numpy as np
import optax
import pytest
import seqio
from flax import traverse_util

from flaxlm.checkpoints import run_dir
from flaxlm.data.config import DatasetConfig
from flaxlm.models.row_start import SEQIO_START
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.posttrain import rewards, rl
from flaxlm.runs import grpo
from flaxlm.training import lora, steps
from tests.helpers import tiny_gptj
from tests.test_grpo import digit_share, read

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = ((r"(q|v)_proj/kernel$", 4), (r"(fc_in|fc_out|lm_head)/kernel$", 4))
GROUP, NEW, PROMPT = 8, 4, 8


def model():
    """A scanned stack: the engine lays its params out for decoding inside its programs."""
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
    """10 steps of GRPO with LoRA from a random base (saved to MODEL_DIR/base); the head is
    adapted too, as a random base's tiny head hides what the layers below it do."""
    model_dir = tmp_path_factory.mktemp("grpo_lora")
    state = grpo.grpo(
        model=model(),
        partitioner=Partitioner(mesh_shape=(2, 2, 2)),
        train_dataset_cfg=DatasetConfig(
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
        learning_rate=5e-2,
        model_dir=str(model_dir),
        total_steps=10,
        log_period=1,
        checkpoint_period=10,
        lora=lora.LoraConfig(rules=RULES),
    )
    return model_dir, state


@pytest.mark.slow
def test_grpo_with_lora_trains_only_the_adapters_and_raises_the_reward(lora_run):
    model_dir, state = lora_run
    by_step = {r["step"]: r for r in read(model_dir) if "reward" in r}
    first = np.mean([by_step[s]["reward"] for s in (1, 2, 3)])
    last = np.mean([by_step[s]["reward"] for s in (8, 9, 10)])
    assert last > first + 0.2, (first, last)
    assert by_step[10]["kl"] > 0  # the policy moved away from the base, its reference
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


@pytest.mark.slow
def test_engine_rollouts_give_the_trainers_logps_and_read_each_prompt_once(lora_run):
    """The trained adapters over the base (the adapters added in the engine's forward, the
    scanned params laid out for decoding inside its programs): the engine's sampled
    log-probs equal the update's recomputation, the reference's are the base's alone, and
    each prompt is prefilled once for its group of GROUP samples."""
    _, state = lora_run
    partitioner = Partitioner(mesh_shape=(2, 2, 2))
    setup = steps.Setup(
        model(),
        partitioner,
        optax.sgd(0.0),
        {k: PROMPT + 1 + NEW for k in rl.DECODER_FEATURES},
        lora=lora.LoraConfig(rules=RULES),
        frozen_reference=True,
    )
    setup.batch_axes = grpo.rollout_axes()
    base = setup.init_base()
    vocab = seqio.ByteVocabulary()
    config = rl.GrpoConfig(
        num_generations=GROUP, max_new_tokens=NEW, temperature=0.7, reward_fns=(digit_share,)
    )
    rollouts = grpo.Rollouts(setup, config, vocab, base, 0, PROMPT, 4, SEQIO_START)
    texts = ["1+2=", "3+4=", "12+7=", "9+9="]
    tokens = np.zeros((4, PROMPT), np.int32)
    for i, t in enumerate(texts):  # as PromptFeatureConverter gives them: id + 1, 0 pads
        tokens[i, : len(t)] = np.asarray(vocab.encode(t)) + 1
    prompts = {f"{k}_tokens": partitioner.global_array(tokens) for k in ("prompt", "answer")}
    batch, _ = rollouts(state, prompts, 0)
    decoder = {k: batch[k] for k in rl.DECODER_FEATURES}
    weights = np.asarray(batch["decoder_loss_weights"])
    assert weights.sum() > 0
    # float32 log-probs of magnitude ~6 (log 384) after two layers: the paged and the
    # training forward differ in summation order only, a few ulps (~1e-6) of that scale.
    recomputed = np.asarray(rollouts.policy_logps(state, decoder))
    gap = np.abs(np.asarray(batch["old_logps"]) - recomputed).max()
    assert gap < 1e-5, gap
    # Both of softmax(logits / temperature), as TRL's GRPO computes a token's log-prob.
    adapted = lora.with_adapters(base, state.params, lora.LoraConfig(rules=RULES).alpha)
    logits = jax.jit(model().compute_logits)(adapted, decoder) / 0.7
    targets = np.asarray(batch["decoder_target_tokens"])[..., None]
    tempered = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), targets, -1)[..., 0]
    np.testing.assert_allclose(recomputed, tempered * weights, rtol=0, atol=1e-5)
    # The reference: the base's log-probs (the adapters switched off), not the policy's.
    base_logps = jax.jit(lambda p, b: model().token_logps(p, b, None, 0.7)[0])(base, decoder)
    # (two compilations of the same forward: a few ulps of the log-probs' scale ~6 apart)
    np.testing.assert_allclose(batch["reference_logps"], base_logps, rtol=0, atol=2e-6)
    assert np.abs(recomputed - np.asarray(base_logps)).max() > 0.01
    # A group's prompt prefilled once: the engine read 1/GROUP of the rows' prompt tokens.
    sampler = rollouts.sampler
    read_once = sum(1 + len(t) for t in texts)  # the start token, then the prompt
    assert sampler.prompt_tokens == GROUP * read_once
    assert sampler.prefilled_tokens == read_once
    # The static-batch generator stays selectable (the families the engine cannot serve):
    # it samples with the same adapters, and the update's params recompute the log-probs.
    batch_engine = dataclasses.replace(config, rollout_engine="batch")
    rollouts = grpo.Rollouts(setup, batch_engine, vocab, base, 0, PROMPT, 4, SEQIO_START)
    assert rollouts.sampler is None
    batch, _ = rollouts(state, prompts, 0)
    assert np.asarray(batch["decoder_loss_weights"]).sum() > 0
    decoder = {k: batch[k] for k in rl.DECODER_FEATURES}
    np.testing.assert_array_equal(batch["old_logps"], rollouts.policy_logps(state, decoder))
