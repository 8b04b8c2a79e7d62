"""Training and decoding speed on one accelerator: flaxlm against HF transformers + torch.

For a gin/models/ shape (`--model`, default Llama-3.2-1B) and, with `--largest`, the first of
several (largest first) that the planner says fits one device, at each `--lengths` length:

  flaxlm   its own train step in `--dtype` (bfloat16 compute, float32 params and optimizer)
           with `--attention` (default 'auto': cuDNN flash attention on a GPU, is_causal),
           as the planner compiled it (`flaxlm.plan`: one device, the model gin's remat
           policy and scan unless `--remat` / `--scan` say otherwise, the loss over all
           positions at once unless `--loss-chunk-size` says how many); its prediction
           (roofline of `flaxlm/chips.py`) beside the measured time
  torch    HF's `AutoModelForCausalLM` (SDPA attention) loaded from the same weights
           (flaxlm's init, exported with `flaxlm.checkpoints.hf.save_pretrained`), autocast bfloat16
           over float32 params, fused AdamW with flaxlm's settings (torch_side.py),
           `torch.compile`d forward and loss (`--no-torch-compile`: eager); without
           gradient checkpointing, and with it if that runs out of memory (or as
           `--[no-]torch-checkpointing` says)

Both train on the same random tokens (`--tokens` per step: batch = tokens / length), every
position weighted; their first losses agree to bfloat16 rounding (the same weights), which
the report checks. Then decoding: greedy, `--decode-new` tokens after `--decode-prompt`-token
prompts for `--decode-batch` rows, flaxlm's KV-cache `generation.generate` against HF's
`generate` (bfloat16 weights on both sides), tokens/s and how many tokens agree.

Each side runs in a process of its own, one after the other (JAX and torch each want the
accelerator's memory to themselves): flaxlm first, then torch. Per side and length: warm-up
(`--warmup` steps: compiles), then R blocks (`--repeats`) of N steps (`--steps`); the
median ms/step. MFU both ways: model FLOPs per token `6 N + 12 L H T` (causal attention
counted whole, as `flaxlm.training.metrics` and the planner count it; T the length) and
`6 N + 6 L H T` (halved: the masked half of the scores is not work), over the chip's dense
bf16 peak (`flaxlm/chips.py`; none on CPU, where TFLOP/s alone is reported).

Made for a machine lent for minutes: each side saves its numbers after every length (the HF
weights are exported before flaxlm trains), a length that fails is a row saying how (its
traceback printed) and the others still run, and `--time-limit S` stops a side still running
at its share of S seconds (flaxlm half when torch follows, torch the rest). Torch runs the
lengths flaxlm finished; the report and `--json` ("unfinished") say which side did not
finish, and why.

    python benchmarks/accelerator.py --largest llama3_1_8b llama3_2_3b --json $OUT/acc.json
    python benchmarks/accelerator.py --model llama_tiny --lengths 64 --tokens 256 \\
        --no-torch-compile --decode-new 8      # CPU: what tests/test_benchmarks.py runs

Targets (an H100): MFU >= 45% for the 1B shape, flaxlm's step ahead of torch's.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Each side runs in a process of its own, so JAX may take nearly all of the accelerator.
if not {"XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"} & set(os.environ):
    os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.92"  # (the other name is JAX's deprecated one)

import argparse  # noqa: E402
import datetime  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from functools import partial  # noqa: E402
from typing import Any  # noqa: E402

import bench_common  # noqa: E402  (a sibling script; puts the repository on sys.path)
import numpy as np  # noqa: E402
import profile_summary  # noqa: E402  (a sibling script)

GIB = 2**30
SIDES = ("flaxlm", "torch")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama3_2_1b", help="a gin/models/ name")
    p.add_argument(
        "--largest",
        nargs="+",
        default=[],
        metavar="MODEL",
        help="also the first of these gin/models/ names (largest first) whose step the "
        "planner says fits one device at the first length, with full remat",
    )
    p.add_argument(
        "--layers",
        type=int,
        metavar="N",
        help="the model cut to its first N layers (a model too large for one device, e.g. "
        "qwen3_moe_30b_a3b: MFU is a per-layer rate, the embedding and head aside)",
    )
    p.add_argument(
        "--moe-impl",
        choices=("dense", "dropless", "capacity"),
        help="a mixture of experts' implementation (the config's moe_impl; default: the gin's)",
    )
    p.add_argument(
        "--grouped-matmul",
        choices=("auto", "xla", "mosaic_gpu"),
        help="how dropless experts run their grouped matmuls (the config's grouped_matmul; "
        "default: the gin's, 'auto')",
    )
    p.add_argument(
        "--grouped-matmul-tiles",
        metavar="JSON",
        help="the Mosaic GPU kernels' tiles from grouped_matmul.py --tune's JSON ('tiles')",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="after timing the first length, trace 2 steps (jax.profiler, perfetto) into DIR "
        "and print where the step's time goes (profile_summary.py)",
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--tokens", type=int, default=32768, help="tokens per step (batch x length)")
    p.add_argument("--steps", type=int, default=5, help="N: steps per timed block")
    p.add_argument("--repeats", type=int, default=4, help="R: timed blocks per side")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument(
        "--attention", default="auto", help="flaxlm's: auto (cuDNN on a GPU), xla, jax, chunked"
    )
    p.add_argument("--remat", help="flaxlm's remat policy (default: the model gin's)")
    p.add_argument(
        "--loss-chunk-size",
        type=int,
        metavar="N",
        help="flaxlm's loss N positions at a time (the model's loss_chunk_size: float32 "
        "logits [batch, N, vocab], not [batch, length, vocab]); default: all at once",
    )
    p.add_argument("--scan", action=argparse.BooleanOptionalAction, help="default: the gin's")
    p.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--torch-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="torch's gradient checkpointing (default: without, then with if out of memory)",
    )
    p.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--decode-new", type=int, default=128)
    p.add_argument("--note", default="", help="free text for the RESULTS.md rows")
    p.add_argument("--hlo", metavar="DIR", help="write each length's compiled step (gzip) here")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON here")
    p.add_argument(
        "--time-limit",
        type=float,
        metavar="SECONDS",
        help="stop after this long and report what finished (flaxlm gets half when torch "
        "runs too, torch the rest)",
    )
    # One side's process (the parent runs them): --side NAME --workdir DIR.
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = ("tokens", "steps", "repeats", "warmup", "decode_batch", "decode_prompt", "decode_new")
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1.")
    if any(n < 2 for n in args.lengths):
        p.error("--lengths must be at least 2.")
    if args.time_limit is not None and args.time_limit <= 0:
        p.error("--time-limit must be a positive number of seconds.")
    known = set(bench_common.gin_model_names())
    for name in (args.model, *args.largest):
        if name not in known:
            p.error(f"--model/--largest {name!r}: no gin/models/{name}.gin.")
    return args


def batch_size(args: argparse.Namespace, length: int) -> int:
    return max(1, args.tokens // length)


def random_batch(rows: int, length: int, vocab: int) -> dict[str, np.ndarray]:
    """Random tokens, every position weighted; the same in both sides' processes."""
    rng = np.random.default_rng(length)
    targets = rng.integers(3, vocab, size=(rows, length), dtype=np.int32)
    inputs = np.concatenate([np.ones((rows, 1), np.int32), targets[:, :-1]], axis=1)
    return {
        "decoder_input_tokens": inputs,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": np.ones_like(targets),
    }


def prompts(args: argparse.Namespace, vocab: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    shape = (args.decode_batch, args.decode_prompt)
    return rng.integers(3, vocab, size=shape, dtype=np.int32)


def timed(run: Callable[[int], float], args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up, then R blocks of N steps: the median seconds per step and every block's."""
    start = time.perf_counter()
    run(args.warmup)
    warmup = time.perf_counter() - start
    per_step = [run(args.steps) / args.steps for _ in range(args.repeats)]
    return {
        "step_seconds": statistics.median(per_step),
        "step_seconds_per_block": per_step,
        "warmup_seconds": warmup,
    }


def timed_decode(generate: Callable[[], Any], args: argparse.Namespace) -> dict[str, Any]:
    """One untimed call of `generate` (compiles), then R timed; tokens/s of the median."""
    tokens = np.asarray(generate())
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        tokens = np.asarray(generate())
        seconds.append(time.perf_counter() - start)
    return {
        "tokens_per_second": tokens.size / statistics.median(seconds),
        "seconds_per_round": seconds,
        "tokens": tokens.tolist(),
    }


def out_of_memory(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return "RESOURCE_EXHAUSTED" in text or "OutOfMemory" in text or "out of memory" in text


def failure(e: BaseException) -> str:
    """A table row's text for a length that failed (other than out of memory), its traceback
    printed: on a machine lent for minutes, one failing length (a kernel the compiler
    refuses, say) must not cost the others."""
    traceback.print_exc()
    first = str(e).strip().split("\n")[0]
    return f"failed: {type(e).__name__}" + (f": {first}" if first else "")


# ---------------------------------------------------------------------------- flaxlm


def grouped_matmul_tiles() -> dict:
    """The Mosaic GPU grouped matmul's tiles in force (flaxlm.models.grouped_matmul.TILES)."""
    from flaxlm.models import grouped_matmul

    return grouped_matmul.TILES


def flaxlm_model(name: str, args: argparse.Namespace, remat: str | None = None) -> Any:
    changes: dict[str, Any] = {"dtype": args.dtype, "attention": args.attention}
    if remat or args.remat:
        changes["remat_policy"] = remat or args.remat
    if args.scan is not None:
        changes["scan_layers"] = args.scan
    if args.layers:
        changes["num_layers"] = args.layers
    if args.moe_impl:
        changes["moe_impl"] = args.moe_impl
    if args.grouped_matmul:
        changes["grouped_matmul"] = args.grouped_matmul
    if args.grouped_matmul_tiles:
        from flaxlm.models import grouped_matmul

        with open(args.grouped_matmul_tiles) as f:
            grouped_matmul.TILES.update(json.load(f)["tiles"])
    bindings = []
    if args.loss_chunk_size is not None:  # what a user binds: gin/models/ import base
        bindings.append(f"base.DecoderOnlyModel.loss_chunk_size = {args.loss_chunk_size}")
    return bench_common.gin_model(name, bindings, **changes)


def plan_one(model: Any, rows: int, length: int, devices: Sequence[Any], chip: Any) -> Any:
    """The planner's `Result` for this run on one device (compiled: `result.step`)."""
    from flaxlm.parallel.partitioning import MESH_AXES
    from flaxlm.plan import aot, planner
    from flaxlm.plan import run as plan_run

    config = model.config
    knobs = plan_run.Knobs(
        mesh_shape=(1,) * len(MESH_AXES),
        optimizer_sharding="params",
        remat_policy=getattr(config, "remat_policy", "none"),
        num_microbatches=1,
        scan_layers=bool(getattr(config, "scan_layers", False)),
    )
    lengths = aot.feature_lengths(model, length)  # unpacked: tokens, targets, weights
    run = plan_run.plain_run(model, rows, lengths, MESH_AXES, knobs)
    return planner.Planner(run, devices, chip).evaluate(knobs)


def choose_largest(args: argparse.Namespace, devices: Sequence[Any], chip: Any) -> tuple[dict, Any]:
    """The first of `--largest` whose step fits one device at the first length (full
    remat), with every candidate's verdict; and its planner `Result` (compiled: its first
    length's step, not compiled again), None if none fits. A model whose training state
    alone exceeds the device is turned down without a compile (the planner's check)."""
    length = args.lengths[0]
    verdicts = []
    for name in args.largest:
        model = flaxlm_model(name, args, remat="full")
        result = plan_one(model, batch_size(args, length), length, devices, chip)
        gib = None if result.device_bytes is None else result.device_bytes / GIB
        verdicts.append(
            {"model": name, "status": result.status, "reason": result.reason, "gib": gib}
        )
        more = ">" if result.at_least else ""
        print(f"  --largest {name}: {result.status}" + (f", {more}{gib:.2f} GiB" if gib else ""))
        if result.status == "fits":
            return {"model": name, "verdicts": verdicts}, result
    return {"model": None, "verdicts": verdicts}, None


class FlaxlmRunner:
    """The planner's compiled step on its own initial state and one batch."""

    def __init__(self, step: Any, batch: dict[str, np.ndarray]) -> None:
        import jax

        self.step = step
        self.batch = {
            k: jax.device_put(v, step.abstract_batch[k].sharding) for k, v in batch.items()
        }
        self.state = step.setup.init_state()
        self.losses: list[float] = []

    def run(self, n: int) -> float:
        import jax

        start = time.perf_counter()
        state = self.state
        for _ in range(n):
            state, metrics = self.step.compiled(state, self.batch)
            if not self.losses:
                self.losses.append(float(metrics["loss"]))  # the first step's (waits once)
        jax.block_until_ready(state)
        elapsed = time.perf_counter() - start
        self.state = state
        self.losses.append(float(metrics["loss"]))
        return elapsed


def save_side(args: argparse.Namespace, out: dict) -> None:
    """This side's numbers so far, for the parent: written whole (to a file beside, then
    renamed), so that a side stopped or failed leaves the lengths it finished."""
    path = os.path.join(args.workdir, f"{args.side}.json")
    with open(path + ".partial", "w") as f:
        json.dump(out, f)
    os.replace(path + ".partial", path)


def flaxlm_train(
    model: Any,
    args: argparse.Namespace,
    devices: Sequence[Any],
    chip: Any,
    out: dict,
    save: Callable[[], None],
    planned: Any = None,
) -> None:
    """Each length's row into `out` (then `save()`): the planner's verdict and prediction,
    and the measured step where it fits. `planned`: the planner's `Result` for the first
    length, where it is already at hand (`choose_largest`)."""
    vocab = model.config.vocab_size
    for i, length in enumerate(args.lengths):
        try:
            first = planned if i == 0 else None
            row = flaxlm_length(model, args, devices, chip, length, vocab, first)
        except Exception as e:  # noqa: BLE001 - a failed length is a row; the others run
            row = {"batch_size": batch_size(args, length), "error": failure(e)}
        out[str(length)] = row
        save()


def flaxlm_length(
    model: Any,
    args: argparse.Namespace,
    devices: Sequence[Any],
    chip: Any,
    length: int,
    vocab: int,
    planned: Any = None,
) -> dict:
    """One length's row: the planner's verdict and prediction (`planned`, else planned
    here), and the measured step (or the out-of-memory error) where the planner says it
    fits."""
    rows = batch_size(args, length)
    row: dict[str, Any] = {"batch_size": rows}
    result = planned or plan_one(model, rows, length, devices, chip)
    row["planner"] = {
        "status": result.status,
        "reason": result.reason,
        "gib_per_device": None if result.device_bytes is None else result.device_bytes / GIB,
        "predicted_seconds": result.predicted_s,
        "compile_seconds": result.compile_s,
        "flops": result.flops,  # per step, loops and library calls counted (planner)
        "bytes_accessed": result.bytes_accessed,
    }
    if args.hlo and result.step is not None and result.step.compiled is not None:
        os.makedirs(args.hlo, exist_ok=True)
        size = f"{model.config.num_params() / 1e6:.0f}M"
        name = f"{type(model.config).__name__}_{size}_L{length}.hlo.txt.gz"
        with gzip.open(os.path.join(args.hlo, name), "wt") as f:
            f.write(result.step.hlo_text())
    print(f"  L{length} B{rows}: planner {result.status}", end="", flush=True)
    if result.predicted_s:
        print(f", predicts {result.predicted_s * 1e3:.1f} ms/step", end="")
    if result.status != "fits":
        print(f" ({result.reason})")
        return row
    runner = FlaxlmRunner(result.step, random_batch(rows, length, vocab))
    try:
        row.update(timed(runner.run, args))
        if args.profile and length == args.lengths[0]:
            row["profile"] = profile_summary.trace_steps(runner.run, args.profile, steps=2)
    except Exception as e:  # noqa: BLE001 - an out-of-memory length is a table row
        if not out_of_memory(e):
            raise
        row["error"] = "out of memory: " + str(e).split("\n")[0]
        print(f"; {row['error']}")
        return row
    finally:
        runner.state = None  # frees the device's copy before the next length
    losses = runner.losses
    row["first_loss"], row["last_loss"] = losses[0], losses[-1]
    print(f"; measured {row['step_seconds'] * 1e3:.1f} ms/step", flush=True)
    return row


def flaxlm_decode(model: Any, params: Any, args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp

    from flaxlm.inference import generation

    dtype = jnp.dtype(args.dtype)
    params = jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
    )
    batch = {"inputs": prompts(args, model.config.vocab_size)}
    return timed_decode(
        lambda: generation.generate(
            model, params, batch, max_new_tokens=args.decode_new, eos_id=None
        ),
        args,
    )


def flaxlm_side(args: argparse.Namespace) -> dict:
    import jax

    from flaxlm.checkpoints import hf
    from flaxlm.plan import chips

    devices = jax.devices()[:1]
    chip = chips.for_devices("this", devices)
    out: dict[str, Any] = {
        "machine": bench_common.machine_description(devices),
        "jax_version": jax.__version__,
        "chip": chip.name,
        "peak_flops": None if devices[0].platform == "cpu" else chip.peak_flops(args.dtype),
        "models": {},
    }
    save = partial(save_side, args, out)
    save()
    names, planned = [args.model], {}
    if args.largest:
        print("Choosing the largest model that fits:", flush=True)
        out["largest"], result = choose_largest(args, devices, chip)
        save()
        if out["largest"]["model"] and out["largest"]["model"] != args.model:
            names.append(out["largest"]["model"])
            planned[out["largest"]["model"]] = result
    for name in names:
        remat = "full" if name != args.model else None
        model = flaxlm_model(name, args, remat=remat)
        config = model.config
        chunks = f", loss {model.loss_chunk_size} positions at a time" * bool(model.loss_chunk_size)
        print(f"\nflaxlm, {name} ({config.remat_policy} remat, scan {config.scan_layers}{chunks}):")
        record: dict[str, Any] = {
            "remat_policy": config.remat_policy,
            "scan_layers": config.scan_layers,
            "loss_chunk_size": model.loss_chunk_size,
            "attention": config.attention,
            **{
                f: getattr(config, f)
                for f in ("moe_impl", "grouped_matmul", "capacity_factor")
                if hasattr(config, f)
            },
            **(
                {"grouped_matmul_tiles": grouped_matmul_tiles()}
                if hasattr(config, "moe_impl")
                else {}
            ),
            "params": config.num_params(),
            "vocab_size": config.vocab_size,
            "flops_per_token": {
                str(n): [model.flops_per_token(n), causal_flops_per_token(model, n)]
                for n in args.lengths
            },
        }
        # flaxlm's initial weights (key 0), compiled once: exported for torch before flaxlm
        # trains (torch can then run what flaxlm finished in the time limit), made again
        # for decoding rather than held on the device through training.
        init = jax.jit(partial(model.init_params, batch_shapes=model.example_batch_shapes(8)))
        if args.torch:
            path = weights_dir(args, name)
            hf.save_pretrained(model, init(jax.random.PRNGKey(0)), path, dtype=args.dtype)
        record["train"] = {}
        out["models"][name] = record
        save()
        flaxlm_train(model, args, devices, chip, record["train"], save, planned.get(name))
        if args.decode:
            print(f"  decoding B{args.decode_batch} {args.decode_prompt}+{args.decode_new}", end="")
            record["decode"] = flaxlm_decode(model, init(jax.random.PRNGKey(0)), args)
            print(f": {record['decode']['tokens_per_second']:.0f} tokens/s", flush=True)
            save()
    return out


def weights_dir(args: argparse.Namespace, name: str) -> str:
    """Where flaxlm's initial weights of model `name` are, as an HF checkpoint."""
    return os.path.join(args.workdir, name)


def causal_flops_per_token(model: Any, length: int) -> float:
    """Model FLOPs per token with causal attention's scores halved (the masked half)."""
    dense = model.flops_per_token(0)
    return dense + (model.flops_per_token(length) - dense) / 2


# ---------------------------------------------------------------------------- torch


def torch_side(args: argparse.Namespace, flaxlm: dict) -> dict:
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "models": {},
    }
    save = partial(save_side, args, out)
    for name, theirs in flaxlm["models"].items():
        path = weights_dir(args, name)
        if not os.path.exists(os.path.join(path, "config.json")):
            continue  # flaxlm did not finish: stopped or failed before exporting it
        record: dict[str, Any] = {"train": {}}
        out["models"][name] = record
        print(f"\ntorch, {name} (compile {args.torch_compile}):")
        for length in args.lengths:
            if str(length) not in theirs.get("train", {}):
                continue  # flaxlm did not get to this length
            rows = batch_size(args, length)
            batch = random_batch(rows, length, theirs["vocab_size"])
            print(f"  L{length} B{rows}", end="", flush=True)
            try:
                row = torch_train(path, batch, args, device)
            except Exception as e:  # noqa: BLE001 - a failed length is a row; the others run
                row = {"batch_size": rows, "error": failure(e)}
            record["train"][str(length)] = row
            save()
            if "step_seconds" in row:
                checkpointing = row["description"]["gradient_checkpointing"]
                print(f": {row['step_seconds'] * 1e3:.1f} ms/step, checkpointing {checkpointing}")
            else:
                print(f": {row['error']}", flush=True)
        if args.decode and "decode" in theirs:
            record["decode"] = torch_decode(path, args, dtype, device)
            print(f"  decoding: {record['decode']['tokens_per_second']:.0f} tokens/s")
            save()
    return out


def torch_train(path: str, batch: dict, args: argparse.Namespace, device: str) -> dict:
    """torch's step on `batch` from the checkpoint at `path`: without gradient checkpointing,
    and with it if that runs out of memory (torch's fastest step that fits), unless
    `--torch-checkpointing` or `--no-torch-checkpointing` says which."""
    import gc

    import torch
    import transformers
    from torch_side import TorchSide

    row: dict[str, Any] = {"batch_size": len(batch["decoder_input_tokens"])}
    tries = (False, True) if args.torch_checkpointing is None else (args.torch_checkpointing,)
    for remat in tries:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        )
        side = TorchSide(
            model,
            batch,
            adamw="fused" if device == "cuda" else "default",
            dtype=args.dtype,
            remat=remat,
            device=device,
            compile=args.torch_compile,
        )
        try:
            row.update(timed(side.run, args))
            row["first_loss"], row["last_loss"] = side.first_loss, side.loss
            row["description"] = side.description
            row.pop("error", None)
            return row
        except Exception as e:  # noqa: BLE001 - out of memory: retried, then a table row
            if not out_of_memory(e):
                raise
            row["error"] = "out of memory: " + str(e).split("\n")[0]
        finally:
            del side, model
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    return row


def torch_decode(path: str, args: argparse.Namespace, dtype: Any, device: str) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa"
    )
    model = model.to(device).eval()
    inputs = torch.from_numpy(prompts(args, model.config.vocab_size).astype(np.int64)).to(device)

    def generate() -> np.ndarray:
        with torch.no_grad():
            out = model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=args.decode_new,
                min_new_tokens=args.decode_new,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        return out[:, args.decode_prompt :].cpu().numpy()  # copying waits for the device

    return timed_decode(generate, args)


# ---------------------------------------------------------------------------- report


def summarize(args: argparse.Namespace, flaxlm: dict, torch: dict | None) -> list[dict]:
    """One row per model and length: both sides' ms/step, tokens/s, MFU (whole, causal),
    the planner's prediction, torch / flaxlm and the first losses."""
    peak = flaxlm["peak_flops"]
    rows = []
    for name, record in flaxlm["models"].items():
        theirs = (torch or {}).get("models", {}).get(name, {}).get("train", {})
        for length in args.lengths:
            ours = record.get("train", {}).get(str(length))
            if ours is None:
                continue  # flaxlm did not get to this length (stopped or failed)
            row: dict[str, Any] = {"model": name, "length": length, "batch": ours["batch_size"]}
            whole, causal = record["flops_per_token"][str(length)]
            for side, numbers in (("flaxlm", ours), ("torch", theirs.get(str(length)))):
                if not numbers or "step_seconds" not in numbers:
                    row[side] = (numbers or {}).get("error") or (
                        ours["planner"]["reason"] if side == "flaxlm" else None
                    )
                    continue
                tokens_per_s = numbers["batch_size"] * length / numbers["step_seconds"]
                row[side] = {
                    "ms_per_step": numbers["step_seconds"] * 1e3,
                    "tokens_per_second": tokens_per_s,
                    "tflops_whole": tokens_per_s * whole / 1e12,
                    "mfu_whole": tokens_per_s * whole / peak if peak else None,
                    "mfu_causal": tokens_per_s * causal / peak if peak else None,
                    "first_loss": numbers.get("first_loss"),
                }
            planner = ours.get("planner", {})  # none where the length failed before it
            row["planner_ms"] = (planner.get("predicted_seconds") or 0) * 1e3 or None
            row["planner_gib"] = planner.get("gib_per_device")
            if isinstance(row["flaxlm"], dict) and isinstance(row.get("torch"), dict):
                row["torch_over_flaxlm"] = (
                    row["torch"]["ms_per_step"] / row["flaxlm"]["ms_per_step"]
                )
                a, b = row["flaxlm"]["first_loss"], row["torch"]["first_loss"]
                row["first_losses_agree"] = abs(a - b) < 0.01 * abs(a)
            rows.append(row)
    return rows


def decode_rows(flaxlm: dict, torch: dict | None) -> list[dict]:
    rows = []
    for name, record in flaxlm["models"].items():
        if "decode" not in record:
            continue
        ours = record["decode"]
        theirs = (torch or {}).get("models", {}).get(name, {}).get("decode")
        row = {"model": name, "flaxlm_tokens_per_second": ours["tokens_per_second"]}
        if theirs:
            row["hf_tokens_per_second"] = theirs["tokens_per_second"]
            row["flaxlm_over_hf"] = ours["tokens_per_second"] / theirs["tokens_per_second"]
            a, b = np.asarray(ours["tokens"]), np.asarray(theirs["tokens"])
            row["tokens_equal"] = float((a == b).mean())
            # Greedy bf16 decoding drifts apart once two logits tie to rounding: the first
            # token of each row, decided by the prompt alone, must agree.
            row["first_tokens_equal"] = float((a[:, 0] == b[:, 0]).mean())
        rows.append(row)
    return rows


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_report(results: dict) -> None:
    peak = results["peak_flops"]
    peak = "no peak to take MFU from" if peak is None else f"peak {peak / 1e12:.0f} TFLOP/s"
    print(f"\n{results['machine']}; {peak} per device\n")
    for side, why in results["unfinished"].items():
        print(f"{side} did not finish: {why}. The rows below are what finished.")
    if results["unfinished"]:
        print()
    header = [
        "model",
        "L",
        "B",
        "flaxlm ms",
        "tokens/s",
        "MFU (whole / causal)",
        "planner ms",
        "GiB",
        "torch ms",
        "torch MFU (whole / causal)",
        "torch / flaxlm",
    ]
    table = []
    for r in results["train"]:
        ours, theirs = r["flaxlm"], r.get("torch")
        cells = [r["model"], r["length"], r["batch"]]
        if isinstance(ours, dict):
            mfu = f"{pct(ours['mfu_whole'])} / {pct(ours['mfu_causal'])}"
            cells += [f"{ours['ms_per_step']:.1f}", f"{ours['tokens_per_second']:,.0f}", mfu]
        else:
            cells += [str(ours), "-", "-"]
        cells += [
            "-" if r["planner_ms"] is None else f"{r['planner_ms']:.1f}",
            "-" if r["planner_gib"] is None else f"{r['planner_gib']:.2f}",
        ]
        if isinstance(theirs, dict):
            mfu = f"{pct(theirs['mfu_whole'])} / {pct(theirs['mfu_causal'])}"
            cells += [f"{theirs['ms_per_step']:.1f}", mfu]
        else:
            cells += [str(theirs or "-"), "-"]
        ratio = r.get("torch_over_flaxlm")
        cells.append("-" if ratio is None else f"{ratio:.2f}")
        table.append(cells)
    bench_common.print_table(header, table)
    for r in results["train"]:
        if r.get("first_losses_agree") is False:
            print(
                f"first losses differ at {r['model']} L{r['length']}: {r['flaxlm']} vs {r['torch']}"
            )
    if results["decode"]:
        print()
        rows = [
            [
                d["model"],
                f"{d['flaxlm_tokens_per_second']:,.0f}",
                f"{d.get('hf_tokens_per_second', 0):,.0f}",
                f"{d.get('flaxlm_over_hf', 0):.2f}",
                pct(d.get("tokens_equal")),
                pct(d.get("first_tokens_equal")),
            ]
            for d in results["decode"]
        ]
        header = ["decode", "flaxlm tokens/s", "HF tokens/s", "flaxlm / HF", "equal", "first equal"]
        bench_common.print_table(header, rows)


def without_option(argv: Sequence[str], option: str) -> list[str]:
    """`argv` less `option VALUE` and `option=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def run_side(
    side: str, argv: Sequence[str], workdir: str, timeout: float | None = None
) -> tuple[dict | None, str | None]:
    """One side in a process of its own (a session of its own, so that its helpers, e.g.
    torch.compile's workers, stop with it): the numbers it saved (None if none), and why it
    did not finish (None if it did): stopped at `timeout` seconds, or failed."""
    command = [sys.executable, os.path.abspath(__file__), *argv, "--side", side]
    process = subprocess.Popen([*command, "--workdir", workdir], start_new_session=True)
    unfinished = None
    try:
        code = process.wait(timeout=timeout)
        if code:
            unfinished = f"failed (exit code {code}; its output says why)"
    except subprocess.TimeoutExpired:
        unfinished = f"stopped at the time limit ({timeout:.0f} s)"
    finally:
        if process.poll() is None:  # the time limit, or this process interrupted
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    if unfinished:
        print(f"\n{side}: {unfinished}; keeping what finished.", flush=True)
    path = os.path.join(workdir, f"{side}.json")
    if not os.path.exists(path):
        return None, unfinished
    with open(path) as f:
        return json.load(f), unfinished


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.side:  # one side's process
        if args.side == "flaxlm":
            out = flaxlm_side(args)
        else:
            with open(os.path.join(args.workdir, "flaxlm.json")) as f:
                out = torch_side(args, json.load(f))
        save_side(args, out)
        return out
    start = time.monotonic()
    limit = args.time_limit
    unfinished = {}
    with tempfile.TemporaryDirectory() as workdir:
        child = without_option(argv, "--json")
        share = None if limit is None else limit / 2 if args.torch else limit
        flaxlm, unfinished["flaxlm"] = run_side("flaxlm", child, workdir, share)
        if flaxlm is None:  # ended before its first numbers
            flaxlm = {"machine": "-", "peak_flops": None, "models": {}}
        torch = None
        left = None if limit is None else limit - (time.monotonic() - start)
        finished = any(record.get("train") for record in flaxlm["models"].values())
        if args.torch and finished and (left is None or left > 0):
            torch, unfinished["torch"] = run_side("torch", child, workdir, left)
    results = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/accelerator.py", *argv]),
        "machine": flaxlm["machine"],
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "side", "workdir")},
        "peak_flops": flaxlm["peak_flops"],
        "train": summarize(args, flaxlm, torch),
        "decode": decode_rows(flaxlm, torch),
        "flaxlm": flaxlm,
        "torch": torch,
        # Each side that did not finish, and why: its rows are the lengths it finished.
        "unfinished": {side: why for side, why in unfinished.items() if why},
    }
    print_report(results)
    bench_common.write_json(results, args.json)
    return results


if __name__ == "__main__":
    main()
