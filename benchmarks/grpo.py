"""GRPO's step at gin/grpo.gin's shape, split into rollout and update, for each rollout
engine (issue 48): 'batch' (the static-batch generator, each row prefilled, the log-probs
recomputed: the path before the engine) and 'paged' (the serving engine: each prompt
prefilled once for its group, the sampled log-probs kept).

    python benchmarks/grpo.py [--init-from /tmp/flaxlm/grpo_sft] [--lora] [--json out.json]

It builds what `grpo.grpo` builds (`steps.Setup`, `grpo.Rollouts`, the partitioned update)
with gin/grpo.gin's GRPO settings: the tiny GPT-J of gin/models/gptj_tiny.gin (4 layers,
width 256, vocab 384), 16 prompts of data/arithmetic a step x 8 completions, 8 prompt
tokens, 3 new tokens, temperature 1, 2 passes, beta 0.04, on one CPU device (as
`python -m flaxlm.main` runs it). `--init-from`: the policy's start (gin/grpo.gin's SFT_DIR
after its first stage: completions that stop at EOS, as in the real run), else a random
init. `--lora`: rank-8 adapters on q_proj and v_proj over it.

After a compiling warm-up the engines alternate by rounds (batch, paged; paged, batch; ...)
on one evolving state, so the machine's drift falls on both. The rollout phase ends when
the rollout batch is on the device (waited for), the update phase when the state is.
Reported per engine: the median seconds of each phase (wall, and the process's CPU seconds,
steadier on a shared machine), the step's, and the paged engine's prefill tokens against
what prefilling every row would read.

`--layout` instead compiles one decode step of the engine's program for the scanned stack
of the same model and reports XLA's memory analysis: the params laid out once outside the
program (a second, unrolled copy as an argument) against laid out inside it
(`Scheduler(layout_in_program=True)`, what GRPO uses).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402 - puts the repository on the path

bench_common.force_host_devices(1)

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import seqio  # noqa: E402

from flaxlm.data import pipeline  # noqa: E402
from flaxlm.data.config import DatasetConfig  # noqa: E402
from flaxlm.models.base import DecoderOnlyModel  # noqa: E402
from flaxlm.models.features import PromptFeatureConverter  # noqa: E402
from flaxlm.models.row_start import SEQIO_START  # noqa: E402
from flaxlm.parallel.partitioning import Partitioner  # noqa: E402
from flaxlm.posttrain import rl  # noqa: E402
from flaxlm.runs import grpo  # noqa: E402
from flaxlm.training import lora as lora_lib  # noqa: E402
from flaxlm.training import optimizers, steps  # noqa: E402

PROMPTS, GROUP, PROMPT_LEN, NEW, PASSES = 16, 8, 8, 3, 2  # gin/grpo.gin


def tiny_gptj(scan_layers: bool = False) -> DecoderOnlyModel:
    """gin/models/gptj_tiny.gin's model."""
    return bench_common.gin_model("gptj_tiny", scan_layers=scan_layers)


def prompt_iterator(partitioner: Partitioner) -> tuple[Any, DatasetConfig]:
    from tasks import jsonl

    repo = bench_common.REPO
    files = {"train": os.path.join(repo, "data/arithmetic/train.jsonl")}
    name = jsonl.register_jsonl_task(
        "arithmetic_bench", files, input_key="prompt", target_key="answer"
    )
    cfg = DatasetConfig(
        mixture_or_task_name=name,
        task_feature_lengths={"inputs": PROMPT_LEN, "targets": 4},
        batch_size=PROMPTS,
        shuffle=True,
        seed=0,
    )
    return pipeline.DataIterator.create(cfg, partitioner, PromptFeatureConverter), cfg


def step_times(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_gptj()
    partitioner = Partitioner(mesh_shape=(1, -1, 1))
    config = rl.GrpoConfig(num_generations=GROUP, max_new_tokens=NEW, num_iterations=PASSES)
    lora = lora_lib.LoraConfig(rules=((r"(q|v)_proj/kernel$", 8),)) if args.lora else None
    length = PROMPT_LEN + 1 + NEW
    learning_rate = 3e-4
    setup = steps.Setup(
        model,
        partitioner,
        optimizers.create_optimizer(learning_rate=learning_rate),
        {k: length for k in rl.DECODER_FEATURES},
        lora=lora,
        frozen_reference=True,
    )
    setup.batch_axes = grpo.rollout_axes()
    start = grpo.starting_params(setup, args.init_from) if args.init_from else None
    if lora is not None:
        frozen = start if start is not None else setup.init_base()
        state = setup.init_state()
    else:
        state = setup.init_state() if start is None else setup.state_from_params(start)
        frozen = setup.copy_params(state.params)
    frozen_args = (frozen,)
    update = setup.partition_train_step(
        steps.make_train_step(model, partitioner, learning_rate, lora=lora, objective=config)
    )
    iterator, data_cfg = prompt_iterator(partitioner)
    vocabulary = (
        seqio.get_mixture_or_task(data_cfg.mixture_or_task_name)
        .output_features["targets"]
        .vocabulary
    )
    engines = {
        name: grpo.Rollouts(
            setup,
            dataclasses.replace(config, rollout_engine=name),
            vocabulary,
            frozen,
            0,
            PROMPT_LEN,
            PROMPTS,
            SEQIO_START,  # a model from scratch: seqio's start token
        )
        for name in ("batch", "paged")
    }
    times: dict[str, dict[str, list[float]]] = {
        name: {k: [] for k in ("rollout", "update", "rollout_cpu", "update_cpu")}
        for name in engines
    }
    rewards: dict[str, list[float]] = {name: [] for name in engines}
    lengths: dict[str, list[float]] = {name: [] for name in engines}
    step = 0

    def one(name: str, record: bool) -> None:
        nonlocal state, step
        prompts = next(iterator)
        wall, cpu = time.perf_counter(), time.process_time()
        batch, host = engines[name](state, prompts, step)
        jax.block_until_ready(batch)
        wall_mid, cpu_mid = time.perf_counter(), time.process_time()
        for _ in range(PASSES):
            state, _ = update(state, batch, *frozen_args)
        jax.block_until_ready(state)
        step += 1
        if record:
            t = times[name]
            t["rollout"].append(wall_mid - wall)
            t["update"].append(time.perf_counter() - wall_mid)
            t["rollout_cpu"].append(cpu_mid - cpu)
            t["update_cpu"].append(time.process_time() - cpu_mid)
            rewards[name].append(host["reward"])
            lengths[name].append(host["completion_length"])

    for _ in range(args.warmup):
        for name in engines:
            one(name, False)
    paged = engines["paged"].sampler
    read_before, rows_before = paged.prefilled_tokens, paged.prompt_tokens
    order = list(engines)
    for _ in range(args.repeats):
        for name in order:
            for _ in range(args.steps):
                one(name, True)
        order.reverse()
    result: dict[str, Any] = {"engines": {}}
    for name in engines:
        t = times[name]
        med = {k: statistics.median(v) for k, v in t.items()}
        med["step"] = statistics.median([a + b for a, b in zip(t["rollout"], t["update"])])
        med["step_cpu"] = statistics.median(
            [a + b for a, b in zip(t["rollout_cpu"], t["update_cpu"])]
        )
        med["reward"] = float(np.mean(rewards[name]))
        med["completion_length"] = float(np.mean(lengths[name]))
        med["steps"] = len(t["rollout"])
        result["engines"][name] = med
    result["prefill_tokens"] = {
        "read": paged.prefilled_tokens - read_before,
        "every_row": paged.prompt_tokens - rows_before,
    }
    return result


def layout_memory() -> dict[str, Any]:
    """XLA's memory analysis of one engine decode step (one token of 128 rows) of the
    scanned model: its params laid out once, outside, or inside the program."""
    import jax.numpy as jnp

    model = tiny_gptj(scan_layers=True)
    params = model.init_params(jax.random.PRNGKey(0), model.example_batch_shapes())
    rows, page_size, pages = PROMPTS * GROUP, 16, PROMPTS * GROUP + 1
    cache = jax.eval_shape(lambda: model.paged_cache(pages, page_size))
    tokens = jnp.zeros((rows, 1), jnp.int32)
    slots = jnp.zeros((rows, 1), jnp.int32)
    table = jnp.zeros((rows, 1), jnp.int32)
    last = jnp.zeros((rows,), jnp.int32)

    def step(p: Any, c: Any) -> Any:
        return model.paged_logits(p, c, tokens, slots, table, last)

    def analysed(fn: Any, p: Any) -> dict[str, int]:
        memory = jax.jit(fn, donate_argnums=(1,)).lower(p, cache).compile().memory_analysis()
        return {
            "arguments": int(memory.argument_size_in_bytes),
            "temp": int(memory.temp_size_in_bytes),
            "outputs": int(memory.output_size_in_bytes),
        }

    laid_out = jax.eval_shape(model.decoding_params, params)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    return {
        "param_bytes": param_bytes,
        "laid_out_once": {**analysed(step, laid_out), "copy_outside": param_bytes},
        "laid_out_inside": analysed(lambda p, c: step(model.decoding_params(p), c), params),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--init-from", help="the policy's start (default: a random init)")
    p.add_argument("--lora", action="store_true", help="rank-8 adapters on q_proj, v_proj")
    p.add_argument("--steps", type=int, default=3, help="steps per engine per round")
    p.add_argument("--repeats", type=int, default=4, help="rounds (keep it even)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per engine")
    p.add_argument("--layout", action="store_true", help="the memory of the params' layout")
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"conditions": bench_common.conditions(), "args": vars(args)}
    result["machine"] = bench_common.machine_description()
    if args.layout:
        result["layout"] = layout_memory()
    else:
        result.update(step_times(args))
    result["loadavg_after"] = list(os.getloadavg())
    print(json.dumps(result, indent=2))
    bench_common.write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
