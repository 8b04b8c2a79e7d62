"""What tests/multiprocess_worker.py computes on a mesh spanning its two processes and
test_multiprocess.py on one process's 8 devices: the same functions, seeds and mesh shapes,
so that the two results differ only where the cross-process collectives add in another
order. Each returns host numpy arrays, whole on every process."""

from __future__ import annotations

import dataclasses

import numpy as np
import seqio

from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.row_start import SEQIO_START
from flaxlm.parallel import pytrees
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.posttrain import rl
from flaxlm.runs import grpo
from flaxlm.training import lora, optimizers, steps
from tests import test_aux_free_balance as balance
from tests.helpers import tiny_gptj
from tests.test_grpo_lora import RULES

GRPO_PROMPTS = ("1+2=", "3+4=", "12+7=", "9+9=")
GRPO_GROUP, GRPO_NEW, GRPO_PROMPT = 4, 4, 8  # 16 rows: the batch splits over 8 devices


def decoded_length(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """The characters a completion decodes to: a reward that already differs within every
    group of a random policy's samples (ids past the bytes and invalid UTF-8 decode to
    nothing, EOS ends it),
    so the first update has advantages to learn from. (A reward that is the same across a
    group leaves only the gradient's rounding noise, which Adam scales up to a full step.)"""
    return [float(len(c)) for c in completions]


def grpo_lora_steps(num_steps: int = 2) -> dict:
    """`num_steps` GRPO steps with LoRA and the paged engine on fsdp 8, as `grpo.grpo`'s
    rollout_step takes them (its Rollouts and partitioned update, two passes over each
    step's rollouts, the KL to the base), on prompts given as ids rather than read by seqio.

    Returns `[steps, rows, length]` the rollouts' target tokens (prompt and sampled
    completion), `[steps, rows, length]` the engine's sampled log-probs, `[steps]` the mean
    reward, and `[steps, passes]` each update's loss, KL and gradient norm."""
    partitioner = Partitioner(mesh_shape=(1, 8, 1))
    config = rl.GrpoConfig(
        num_generations=GRPO_GROUP,
        max_new_tokens=GRPO_NEW,
        num_iterations=2,
        reward_fns=(decoded_length,),
    )
    cfg = lora.LoraConfig(rules=RULES)
    # One unscanned layer: half the compile time of test_grpo_lora's scanned two, the same
    # collectives across the processes (the scanned layout is the engine's own matter).
    model = tiny_gptj(vocab_size=384, max_position_embeddings=32, num_layers=1)
    length = GRPO_PROMPT + 1 + GRPO_NEW
    setup = steps.Setup(
        model,
        partitioner,
        optimizers.create_optimizer(learning_rate=5e-2),
        {k: length for k in rl.DECODER_FEATURES},
        lora=cfg,
        frozen_reference=config.needs_reference,
    )
    setup.batch_axes = grpo.rollout_axes()
    base, state = setup.init_base(), setup.init_state()
    vocab = seqio.ByteVocabulary()
    prompts = len(GRPO_PROMPTS)
    rollouts = grpo.Rollouts(setup, config, vocab, base, 0, GRPO_PROMPT, prompts, SEQIO_START)
    update = setup.partition_train_step(
        steps.make_train_step(model, partitioner, 5e-2, lora=cfg, objective=config)
    )
    tokens = np.zeros((prompts, GRPO_PROMPT), np.int32)
    for i, text in enumerate(GRPO_PROMPTS):  # as PromptFeatureConverter gives them: id + 1
        tokens[i, : len(text)] = np.asarray(vocab.encode(text)) + 1
    batch = {f"{k}_tokens": partitioner.global_array(tokens) for k in ("prompt", "answer")}
    out = {k: [] for k in ("tokens", "sampled_logps", "reward", "loss", "kl", "grad_norm")}
    for step in range(num_steps):
        rollout, host = rollouts(state, batch, step)
        out["tokens"].append(pytrees.host_array(rollout["decoder_target_tokens"]))
        out["sampled_logps"].append(pytrees.host_array(rollout["old_logps"]))
        out["reward"].append(host["reward"])
        passes = []
        for _ in range(config.num_iterations):
            state, metrics = update(state, rollout, base)
            passes.append(
                {k: float(pytrees.host_array(metrics[k])) for k in ("loss", "kl", "grad_norm")}
            )
        for name in ("loss", "kl", "grad_norm"):
            out[name].append([p[name] for p in passes])
    return {k: np.asarray(v) for k, v in out.items()}


def aux_free_balance_steps(num_steps: int = 2) -> dict:
    """tests/test_aux_free_balance.py's expert-parallel case made cheap: DeepSeek-V3's MoE
    (its CONFIG with one layer, unscanned, one microbatch: under half the compile time) on
    (1, 2, 4, 1) with an `expert` axis, `num_steps` train steps on its batch from the
    model's init. Returns `[steps, experts]` the layer's correction bias after each step and
    `[steps]` the losses."""
    partitioner = Partitioner(
        mesh_shape=(1, 2, 4, 1), mesh_axis_names=("data", "fsdp", "expert", "tensor")
    )
    model = DecoderOnlyModel(dataclasses.replace(balance.CONFIG, num_layers=1))
    host = balance.batch()
    setup = steps.Setup(
        model,
        partitioner,
        optimizers.create_optimizer(learning_rate=1e-2),
        {k: v.shape[1] for k, v in host.items()},
    )
    step = setup.partition_train_step(steps.make_train_step(model, partitioner, 1e-2))
    # The same host batch on every process, each placing the rows its devices hold.
    data = {k: partitioner.global_array(v) for k, v in host.items()}
    state = setup.init_state()
    biases, losses = [], []
    for _ in range(num_steps):
        state, metrics = step(state, data)
        bias = state.params["layers_0"]["mlp"]["e_score_correction_bias"]
        biases.append(pytrees.host_array(bias))
        losses.append(float(pytrees.host_array(metrics["loss"])))
    return {"biases": np.stack(biases), "loss": np.asarray(losses)}
