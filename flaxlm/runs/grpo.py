"""The `grpo` run function: online RL with verifiable rewards (GRPO, Shao et al. 2024).

Each step takes a batch of prompts from a seqio task (`inputs`: the prompt, `targets`: the
reference answer, read by `features.PromptFeatureConverter`), samples `num_generations`
completions per prompt on the training mesh, scores them with the Gin-bound reward
functions, normalises the rewards within each prompt's group, and takes `num_iterations`
optimizer steps on the clipped objective with a KL penalty to the frozen reference
(`rl.GrpoModel` through `training.steps`' train step). The loop, logging, checkpointing and
preemption are `loop.py`'s (as `train`'s); a checkpoint holds the state and the prompt
iterator, and the sampling key of step k is `fold_in(seed, k)`, so a resumed run samples
what it would have.

The rollouts go through the serving engine (`PagedSampler`: continuous batching over a
paged KV cache, each prompt prefilled once for its group, the sampled tokens' log-probs
the policy's own) or, for the families it cannot serve, the static-batch generator. With
`lora`, only the adapters train; the policy samples with them beside the base's kernels
and the KL reference is the base without them (no second copy of the weights).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import seqio
from jax.sharding import PartitionSpec as P

from flaxlm.checkpoints import checkpointer, peft_config, run_dir
from flaxlm.data import pipeline
from flaxlm.data.config import DatasetConfig
from flaxlm.inference import generation, guides
from flaxlm.inference.guides import Guide
from flaxlm.inference.paged_batch import BatchGenerator
from flaxlm.inference.sampling import Sampling
from flaxlm.models.base import BaseModel
from flaxlm.models.features import PromptFeatureConverter, unpadded_ids
from flaxlm.models.row_start import RowStart
from flaxlm.parallel import pytrees
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.posttrain import loss_math, rl
from flaxlm.runs import checks, loop
from flaxlm.training import lora as lora_lib
from flaxlm.training import metrics, optimizers, preemption, steps
from flaxlm.training.train_state import TrainState

DECODE_STEPS = 32  # the most tokens a row generates in one engine dispatch


class PagedSampler:
    """A step's completions through the serving engine (`paged_batch.BatchGenerator`) on
    the training mesh: every row in one decode batch, each prompt prefilled once and its pages
    shared by its group's samples, the trainer's params handed over as they are (laid out
    for decoding inside the engine's programs: no copy). Returns each sampled token's
    log-prob beside it: the policy's, which the update would otherwise recompute."""

    def __init__(
        self,
        model: BaseModel,
        partitioner: Partitioner,
        cfg: rl.GrpoConfig,
        prompts: int,
        prompt_length: int,
        guided: Callable[[], Guide] | None = None,
    ):
        """`guided`: makes each completion's guide (`structured_outputs_regex`)."""
        self.cfg, self.guided = cfg, guided
        self.generator = BatchGenerator(
            model,
            None,
            partitioner,
            max_rows=prompts * cfg.num_generations,
            max_prompt_length=prompt_length,
            max_new_tokens=cfg.max_new_tokens,
            decode_steps=DECODE_STEPS,
            prefill_chunk=prompt_length,
            prefill_rows=prompts,
            layout_in_program=True,
            tempered_logprobs=True,  # the update's: of softmax(logits / temperature)
        )
        self.generator.scheduler.release()
        self.prompt_tokens = 0  # of every row: what prefilling each row would read
        self.prefilled_tokens = 0  # what the engine read

    def __call__(
        self, params: Any, prompts: Sequence[Sequence[int]], rng: jax.Array
    ) -> tuple[np.ndarray, np.ndarray]:
        """int32 `[rows, max_new_tokens]` completions of `prompts` (one row each; 0 after
        EOS, which is kept) and float32 their tokens' log-probs, sampled with `rng`."""
        cfg, scheduler = self.cfg, self.generator.scheduler
        seeds = np.asarray(jax.random.bits(rng, (len(prompts),), jnp.uint32))
        scheduler.set_params(params)
        read = scheduler.prefilled_tokens
        sampling = Sampling(
            cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p,
            repetition_penalty=cfg.repetition_penalty,
        )  # fmt: skip
        jobs = self.generator.generate(
            prompts, seeds, sampling=sampling, keep_eos=True, guide=self.guided
        )
        scheduler.release()
        self.prefilled_tokens += scheduler.prefilled_tokens - read
        self.prompt_tokens += sum(len(p) for p in prompts)
        tokens = np.zeros((len(jobs), cfg.max_new_tokens), np.int32)
        logps = np.zeros((len(jobs), cfg.max_new_tokens), np.float32)
        for i, job in enumerate(jobs):
            tokens[i, : len(job.tokens)] = job.tokens
            logps[i, : len(job.logps)] = job.logps
        return tokens, logps


class Rollouts:
    """Samples, rewards and batches the completions of one step's prompts."""

    def __init__(
        self,
        setup: steps.Setup,
        cfg: rl.GrpoConfig,
        vocabulary: seqio.Vocabulary,
        frozen: Any,
        seed: int,
        prompt_length: int,
        prompts: int,
        row_start: RowStart,
        guided: Callable[[], Guide] | None = None,
    ):
        self.setup, self.cfg, self.vocabulary = setup, cfg, vocabulary
        # Each prompt after what training rows started with (seqio's start token 0, or the
        # tokenizer's BOS for a model that reads its rows as HF does).
        self.start = list(row_start.ids(vocabulary))
        self.frozen, self.seed = frozen, seed
        self.prompt_length = prompt_length
        self.length = prompt_length + 1 + cfg.max_new_tokens
        model, partitioner, lora = setup.model, setup.partitioner, setup.lora
        decoder_axes = {k: P("batch", None) for k in rl.DECODER_FEATURES}
        # Token log-probs under a model's params (the reference's: a copy of the starting
        # params, or LoRA's base), and under the policy's (the adapters over the base).
        model_params = setup.state_shardings.params if lora is None else setup.base_shardings
        self.model_logps = partitioner.partition(
            lambda params, batch: model.token_logps(params, batch, None, cfg.temperature)[0],
            (model_params, decoder_axes),
            P("batch", None),
        )
        self.adapted_logps = None
        if lora is not None:
            self.adapted_logps = partitioner.partition(
                lambda adapters, base, batch: lora_lib.LoraModel(model, lora, base).token_logps(
                    adapters, batch, None, cfg.temperature
                )[0],
                (setup.state_shardings.params, setup.base_shardings, decoder_axes),
                P("batch", None),
            )
        # The longest prompt as the model reads it.
        self.prompt_width = len(self.start) + prompt_length
        self.sampler = None
        if cfg.rollout_engine == "paged":
            refusal = model.paged_refusal()
            if refusal is None:
                self.sampler = PagedSampler(
                    model, partitioner, cfg, prompts, self.prompt_width, guided
                )
            elif cfg.engine_only:
                raise ValueError(
                    f"{refusal} GrpoConfig.min_p, repetition_penalty and "
                    "structured_outputs_regex need the paged engine: leave them at 0, 1 and "
                    "None for this model."
                )
            else:
                metrics.print0(f"{refusal} GRPO's rollouts use the batch engine.")

    def check_prompts(self, rows: np.ndarray, step: int) -> None:
        """A ValueError where a prompt of the batch (read one token longer than
        `prompt_length`) is longer than `prompt_length`: rollouts have fixed shapes, and a
        prompt cut at either end is another prompt (a chat prompt cut at its end loses the
        assistant's header). Every process reads the whole batch, so all raise together."""
        longer = np.flatnonzero(rows[:, self.prompt_length :].any(-1))
        if longer.size:
            text = self.decode(unpadded_ids(rows[longer[0]]))
            raise ValueError(
                f"{longer.size} prompt(s) of GRPO step {step + 1}'s batch are longer than "
                f"TASK_FEATURE_LENGTHS['inputs']={self.prompt_length} tokens (the first: "
                f"{text[:60]!r}...): raise it to the task's longest prompt, or leave longer "
                "prompts out of the task. flaxlm does not cut a prompt (TRL keeps every "
                "prompt whole; its rollouts' shapes are not fixed)."
            )

    def decode(self, ids: Any) -> str:
        """Text of token ids up to the first EOS (a completion's: 0 only after it)."""
        return self.vocabulary.decode(
            generation.until_eos(np.asarray(ids), self.setup.model.eos_ids)
        )

    def policy_params(self, state: TrainState) -> Any:
        """The params the policy samples with: the state's, or with LoRA the base with the
        adapters beside its kernels (computed in the forward, as training does: no merge)."""
        if self.setup.lora is None:
            return state.params
        return lora_lib.with_adapters(self.frozen, state.params, self.setup.lora.alpha)

    def policy_logps(self, state: TrainState, decoder: dict[str, jax.Array]) -> jax.Array:
        """The policy's log-probs of the rollout tokens, as the update computes them."""
        if self.adapted_logps is None:
            return self.model_logps(state.params, decoder)
        return self.adapted_logps(state.params, self.frozen, decoder)

    def sample(
        self, state: TrainState, prompts: list[list[int]], step: int
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Completions of `prompts` (one row each) and, from the engine, their tokens'
        log-probs (None: the update's params recompute them)."""
        cfg = self.cfg
        params = self.policy_params(state)
        rng = jax.random.fold_in(jax.random.PRNGKey(self.seed), step)
        if self.sampler is not None:
            return self.sampler(params, prompts, rng)
        inputs = np.zeros((len(prompts), self.prompt_width), np.int32)
        for i, ids in enumerate(prompts):
            inputs[i, : len(ids)] = ids
        completions = generation.generate(
            self.setup.model,
            params,
            {"inputs": inputs, "inputs_lengths": np.asarray([len(p) for p in prompts])},
            partitioner=self.setup.partitioner,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            rng=rng,
        )
        return completions, None

    def __call__(
        self, state: TrainState, prompts: dict[str, jax.Array], step: int
    ) -> tuple[dict[str, jax.Array], dict[str, float]]:
        """The rollout batch of `prompts` (on the mesh) and its host metrics."""
        cfg, partitioner = self.cfg, self.setup.partitioner
        prompt_rows = pytrees.host_array(prompts["prompt_tokens"])
        self.check_prompts(prompt_rows, step)
        prompt_rows = prompt_rows[:, : self.prompt_length]
        answer_rows = pytrees.host_array(prompts["answer_tokens"])
        group = cfg.num_generations
        texts = [unpadded_ids(row) for row in prompt_rows for _ in range(group)]
        repeated = [self.start + ids for ids in texts]
        completions, sampled_logps = self.sample(state, repeated, step)
        rewards, reward_means = cfg.rewards(
            [self.decode(ids) for ids in texts],
            [self.decode(c) for c in completions],
            [self.decode(unpadded_ids(row)) for row in answer_rows for _ in range(group)],
        )
        advantages = loss_math.group_advantages(jnp.asarray(rewards.reshape(-1, group)))
        eos_ids = self.setup.model.eos_ids
        host = rl.rollout_batch(repeated, completions, eos_ids, self.length, sampled_logps)
        decoder = {k: partitioner.global_array(host[k]) for k in rl.DECODER_FEATURES}
        if sampled_logps is None:
            old_logps = self.policy_logps(state, decoder)
        else:  # the sampling policy's own: the recomputation's (tests/test_grpo_lora.py)
            old_logps = partitioner.global_array(host["old_logps"])
        batch = dict(decoder, old_logps=old_logps)
        batch["reference_logps"] = batch["old_logps"]  # unused with beta 0
        if cfg.needs_reference:
            batch["reference_logps"] = self.model_logps(self.frozen, decoder)
        batch["advantages"] = partitioner.global_array(np.asarray(advantages).reshape(-1))
        by_prompt = rewards.reshape(-1, group)
        host_metrics = {
            "reward": float(rewards.mean()),
            "reward_std": float(by_prompt.std(-1).mean()),
            "completion_length": float(host["decoder_loss_weights"].sum(-1).mean()),
            **reward_means,
        }
        return batch, host_metrics


def rollout_axes() -> dict[str, P]:
    return {
        **{k: P("batch", None) for k in rl.DECODER_FEATURES},
        "old_logps": P("batch", None),
        "reference_logps": P("batch", None),
        "advantages": P("batch"),
    }


@gin.configurable
def grpo(
    *,
    model: BaseModel = gin.REQUIRED,
    partitioner: Partitioner = gin.REQUIRED,
    train_dataset_cfg: DatasetConfig = gin.REQUIRED,
    config: rl.GrpoConfig = gin.REQUIRED,
    learning_rate: optax.ScalarOrSchedule = gin.REQUIRED,
    optimizer_factory: Callable[..., optax.GradientTransformation] = optimizers.create_optimizer,
    model_dir: str = gin.REQUIRED,
    total_steps: int = gin.REQUIRED,
    init_from: str | None = None,
    vocabulary: seqio.Vocabulary | None = None,
    log_period: int = 10,
    checkpoint_period: int = 100,
    keep_checkpoints: int | None = 3,
    seed: int = 0,
    lora: lora_lib.LoraConfig | None = None,
) -> TrainState:
    """GRPO on the prompts of `train_dataset_cfg` for `total_steps` rollout steps.

    Args:
      train_dataset_cfg: a task of `{inputs: prompt, targets: answer}` (e.g.
        `register_jsonl_task`); BATCH_SIZE prompts per step, each sampled
        `config.num_generations` times. Its `task_feature_lengths['inputs']` bounds the
        prompt: a longer one stops the run with an error naming it (read one token longer,
        so that seqio's trimming does not hide it).
      config: `@rl.GrpoConfig()`: group size, sampling, reward functions, epsilon, beta.
      init_from: the policy's starting params: a HuggingFace directory or a flaxlm MODEL_DIR
        (its latest checkpoint; a LoRA run's merged) or a PEFT directory (merged). None: a
        fresh init from `seed`. The reference (for `beta > 0`) is these params, frozen.
      lora: train low-rank adapters (`@lora.LoraConfig()`) over `init_from`'s params, frozen
        (as `train.train(lora=...)`: only the adapters have optimizer state and are
        checkpointed; `MODEL_DIR/lora.json` records the base, so infer, eval and export_hf
        merge them). The reference is then the base without the adapters: no second copy.
      vocabulary: decodes prompts, completions and answers for the reward functions
        (default: the task's `targets` vocabulary).

    A step is one batch of rollouts and `config.num_iterations` optimizer steps on it;
    metrics add `reward` (mean), `reward_std` (within groups), each reward function's mean,
    `kl`, `clip_ratio` and `completion_length`.
    """
    start_time = time.perf_counter()
    batch_size = train_dataset_cfg.batch_size
    checks.check_counts(
        TRAIN_STEPS=(total_steps, 1),
        BATCH_SIZE=(batch_size, 1),
        LOG_PERIOD=(log_period, 1),
        CHECKPOINT_PERIOD=(checkpoint_period, 1),
    )
    checks.check_learning_rate(learning_rate)
    path = checks.check_model_dir(model_dir)
    steps.check_batch_size(partitioner, batch_size, 1)
    lengths = dict(train_dataset_cfg.task_feature_lengths)
    if "inputs" not in lengths:
        raise ValueError(
            f"TASK_FEATURE_LENGTHS={lengths}: GRPO reads prompts ('inputs') and answers "
            "('targets'); give both, e.g. {'inputs': 32, 'targets': 8}."
        )
    length = lengths["inputs"] + 1 + config.max_new_tokens
    model.check_lengths({"prompt + completion": length})
    task = seqio.get_mixture_or_task(train_dataset_cfg.mixture_or_task_name)
    vocabulary = vocabulary or task.output_features["targets"].vocabulary
    regex = config.structured_outputs_regex  # checked before any device work
    try:
        spec = None if regex is None else ("regex", regex)
        guided = guides.guide_factory(spec, vocabulary, model.config.vocab_size, model.eos_ids)
    except ValueError as e:
        raise ValueError(f"GrpoConfig.structured_outputs_regex={regex!r}: {e}") from None
    row_start = run_dir.run_row_start(model, model_dir, init_from)
    signals = preemption.PreemptionHandler().install()
    ckpt = writer = None
    try:
        # Prompts read one token longer than they may be: a longer one is seen, not cut.
        reads = {**lengths, "inputs": lengths["inputs"] + 1}
        prompts = pipeline.DataIterator.create(
            dataclasses.replace(train_dataset_cfg, task_feature_lengths=reads),
            partitioner,
            PromptFeatureConverter,
        )
        setup = steps.Setup(
            model,
            partitioner,
            optimizer_factory(learning_rate=learning_rate),
            {k: length for k in rl.DECODER_FEATURES},
            seed=seed,
            lora=lora,
            frozen_reference=config.needs_reference,
        )
        setup.batch_axes = rollout_axes()
        ckpt = checkpointer.Checkpointer(model_dir, keep=keep_checkpoints)
        start_step, state = loop.restore(setup, ckpt, prompts)
        if lora is not None:  # the base, frozen: the steps' third argument and the reference
            frozen = lora_base(setup, model_dir, init_from, row_start)
            state = setup.init_state() if state is None else state
        else:
            state, frozen = policy_and_reference(setup, config, state, start_step, init_from)
        run_dir.record_if_known(model, model_dir, row_start)
        rollouts = Rollouts(
            setup, config, vocabulary, frozen, seed, lengths["inputs"], batch_size, row_start,
            guided,
        )  # fmt: skip
        update = setup.partition_train_step(
            steps.make_train_step(
                model, partitioner, learning_rate, seed=seed, lora=lora, objective=config
            )
        )
        frozen_args = () if setup.frozen_shardings is None else (frozen,)

        def rollout_step(state: TrainState, batch: Any) -> tuple[TrainState, Any]:
            step = int(state.step) // config.num_iterations
            rollout, host = rollouts(state, batch, step)
            for _ in range(config.num_iterations):
                state, out = update(state, rollout, *frozen_args)
            return state, {**out, **{k: jnp.float32(v) for k, v in host.items()}}

        config_str = loop.operative_config(path)
        writer = metrics.create_writer(model_dir)
        rows = batch_size * config.num_generations
        progress = metrics.Progress(
            total_steps, start_step, model.flops_per_token(length) * config.num_iterations
        )
        nonfinite = loop.NonFiniteCheck(ckpt, False)
        save, saved = loop.checkpoint_hook(checkpoint_period, ckpt, prompts, config_str, start_step)
        hooks = [
            loop.log_hook(log_period, writer, progress, rows * length, prompts, nonfinite),
            save,
        ]
        state, step, stop = loop.run_steps(
            state,
            start_step,
            total_steps,
            rollout_step,
            lambda step: steps.next_batch(prompts, train_dataset_cfg, step),
            hooks,
            nonfinite,
            signals,
        )
    finally:
        loop.close(ckpt, writer, signals)
    if jax.process_index() == 0:
        loop.report_end(
            signals, stop, step, start_step, total_steps, ckpt, saved["step"], path, start_time
        )
    return state


def policy_and_reference(
    setup: steps.Setup,
    config: rl.GrpoConfig,
    state: TrainState | None,
    start_step: int,
    init_from: str | None,
) -> tuple[TrainState, Any]:
    """The state (restored, else from `init_from`, else a fresh init) and the frozen
    reference (None for `beta` 0): `init_from`'s params, else the run's initial ones."""
    start = None  # the starting params: the policy's on a fresh start, the reference's always
    if init_from is not None and (state is None or config.needs_reference):
        start = starting_params(setup, init_from)
    if state is None and start is None:
        state = setup.init_state()
    elif state is None:  # a copy of `start`: the train step donates the state's buffers
        state = setup.state_from_params(setup.copy_params(start))
    frozen = None
    if config.needs_reference:
        if start is not None:
            frozen = start
        elif start_step == 0:
            frozen = setup.copy_params(state.params)
        else:  # resumed from a fresh init: the same init again
            frozen = setup.init_state().params
    return state, frozen


def starting_params(setup: steps.Setup, init_from: str | None) -> Any:
    """The params `init_from` names, on the shardings the run holds them with, or None."""
    if init_from is None:
        return None
    loaded = run_dir.load_model_and_params(init_from, setup.partitioner, model=setup.model)
    print(f"Policy and reference from {init_from}.", flush=True)
    return loaded.params


def lora_base(
    setup: steps.Setup, model_dir: str, init_from: str | None, row_start: RowStart
) -> Any:
    """The frozen base of a GRPO run with LoRA, recorded in `MODEL_DIR/lora.json` as a LoRA
    fine-tune records its own (`run_dir.load_lora_base`): an HF directory's params, a
    flaxlm MODEL_DIR's latest checkpoint, a random init (saved to `MODEL_DIR/base`), or a
    LoRA run's or PEFT directory's params merged (saved there once)."""
    if init_from is None or run_dir.is_hf_dir(init_from):
        return run_dir.load_lora_base(setup, model_dir, init_from, None, row_start)
    if not peft_config.is_peft_dir(init_from) and run_dir.read_lora_record(init_from) is None:
        return run_dir.load_lora_base(setup, model_dir, None, init_from, row_start)
    base_dir = os.path.join(os.path.abspath(model_dir), run_dir.LORA_BASE_DIR)
    source = {"checkpoint": base_dir, "step": 0}
    base_ckpt = checkpointer.Checkpointer(base_dir)
    try:
        if base_ckpt.latest_step() is None:
            params = starting_params(setup, init_from)
            base_ckpt.save_params(0, params)
        else:
            params = run_dir.restore_lora_base(source, setup.model, setup.partitioner)
    finally:
        base_ckpt.close()
    run_dir.write_lora_record(model_dir, setup.lora, source)
    print(f"LoRA on {len(setup.lora_kernels)} kernels; frozen base: {init_from}, merged.")
    return params
