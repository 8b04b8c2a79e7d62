"""Per-device memory of flaxlm's train step for GPT-J 6B, Llama 2 7B and any gin/models/ shape
on 8 devices.

Nothing is allocated: the train state is `trainer.Setup.abstract_state` (shapes, dtypes and
the shardings the run would use), the batch is abstract, and the step is flaxlm's own
(`make_train_step` partitioned by `Setup.partition_train_step`), lowered and compiled. Per
device and per configuration the report gives:

- params, optimizer state: bytes of one device's shard of each array of the abstract state
  (from its sharding), summed;
- temporaries: `compiled.memory_analysis().temp_size_in_bytes` (XLA's buffers for
  activations, gradients, gathered params, ... at this batch and length).

Partitionings are those of gin/partitioning/*.gin on 8 devices (dp, zero1, fsdp, tp,
fsdp_tp = fsdp 4 x tensor 2), with the model gin's remat policy; then every remat policy
under fsdp. Targets: FSDP params + optimizer <= 1.05 x total / 8 per device; ZeRO-1
optimizer <= 1.05 x total / 8 while params are whole.

    python benchmarks/memory.py --json /tmp/memory.json
    python benchmarks/memory.py --models gptj --layers 2 --hidden 256   # quick
    python benchmarks/memory.py --models llama3_1_8b qwen2_5_7b gemma2_9b qwen3_8b \
      --partitionings fsdp fsdp_tp --remat-policies    # the gin files' shapes, as they are

`--models` takes `gptj` and `llama` (built here; `--hidden` scales them) or the name of any
gin/models/ file (its shape, dtypes and remat as written; `--layers` still overrides).
`--loss-chunk-size N` computes the loss N positions at a time (the model's `loss_chunk_size`):
compare the temporaries with and without it at a long `--seq-len`. `--sequence N` adds a
`sequence` mesh axis of N devices (context parallelism: fsdp becomes (1, 8/N, N, 1), each
sequence split N ways, ring attention) and `--attention-chunk-size N` sets
`attention='chunked'` in blocks of N (the ring's blocks under `--sequence`; without it,
flash-style blocks on each device, also linear in the length). `--collectives` adds the
bytes each device's step moves by collective (e.g. the chunked loss's head traffic).
`--expert N` adds an `expert` mesh axis of N devices (expert parallelism, fsdp becomes
(1, 8/N, N, 1)) for the MoE models (benchmarks/moe.py compares fsdp with fsdp + expert);
`--first-dense K` keeps K of DeepSeek-V3's dense first layers under `--layers` (default: its
3, at most all but one layer), unrolled before the scanned MoE layers where the model scans.
`--preference dpo` measures the DPO step on pairs (the reference params a frozen argument,
"frozen GiB/dev"); with `--lora-rank R` the frozen params are the LoRA base, no second copy:

    python benchmarks/memory.py --models llama3_2_1b --partitionings fsdp \
      --remat-policies --preference dpo [--lora-rank 16]


    python benchmarks/memory.py --models llama3_1_8b --layers 1 --partitionings \
      --remat-policies none --seq-len 32768 --batch-size 1 --sequence 8 \
      --attention-chunk-size 1024
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402

bench_common.force_host_devices(8)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

from flaxlm.models import layers  # noqa: E402
from flaxlm.models.base import DecoderOnlyModel  # noqa: E402
from flaxlm.models.gptj import GPTJConfig  # noqa: E402
from flaxlm.models.llama import LlamaConfig  # noqa: E402

TARGET = 1.05
GIB = 2**30
COLLECTIVE_COLUMNS = ("all-gather", "reduce-scatter", "all-reduce")
MODEL_REMAT = "dots_with_no_batch_dims_saveable"  # the policy of gptj_6b.gin / llama2_7b.gin
BUILT_HERE = ("gptj", "llama")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--models",
        nargs="+",
        choices=(*BUILT_HERE, *bench_common.gin_model_names()),
        default=list(BUILT_HERE),
        metavar="MODEL",
        help="gptj, llama, or a gin/models/ file's name (e.g. llama3_1_8b)",
    )
    p.add_argument(
        "--partitionings",
        nargs="*",
        choices=tuple(bench_common.PARTITIONINGS),
        default=list(bench_common.PARTITIONINGS),
        help="each with the gins' remat policy (none: only the --remat-policies rows)",
    )
    p.add_argument(
        "--remat-policies",
        nargs="*",
        choices=tuple(layers.REMAT_POLICIES),
        default=list(layers.REMAT_POLICIES),
        help="compared under --remat-partitioning",
    )
    p.add_argument(
        "--remat-partitioning", default="fsdp", choices=tuple(bench_common.PARTITIONINGS)
    )
    p.add_argument("--layers", type=int, default=None, help="override the layer count (28 / 32)")
    p.add_argument("--hidden", type=int, default=None, help="override the width (4096)")
    p.add_argument(
        "--first-dense",
        type=int,
        default=None,
        metavar="K",
        help="of a gin model with dense first layers (DeepSeek-V3's 3), keep K (default: its "
        "own, at most --layers - 1: one MoE layer at least)",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument(
        "--loss-chunk-size",
        type=int,
        default=None,
        help="the models' loss_chunk_size (default: the loss over all positions at once)",
    )
    p.add_argument(
        "--attention-chunk-size",
        type=int,
        default=None,
        metavar="N",
        help="attention='chunked' in blocks of N queries and keys (also the ring's blocks "
        "under --sequence; default: the models' own attention)",
    )
    bench_common.add_sequence_arg(p)
    bench_common.add_expert_arg(p)
    p.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="nn.scan the blocks (as the model gins do; one layer body compiled)",
    )
    bench_common.add_target_args(p)
    p.add_argument(
        "--collectives",
        action="store_true",
        help="also the GiB each device's step all-gathers, reduce-scatters and all-reduces "
        "(array bytes, collectives.py's parser)",
    )
    p.add_argument(
        "--preference",
        choices=("dpo", "ipo", "orpo", "simpo"),
        default=None,
        help="the step of this preference loss on --batch-size pairs (DPO/IPO: with the "
        "frozen reference params as the step's argument)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        metavar="R",
        help="train LoRA adapters of rank R on the attention and MLP kernels (the base frozen)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON here")
    args = p.parse_args(argv)
    for name in ("batch_size", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1.")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be at least 1.")
    if not args.partitionings and not args.remat_policies:
        p.error("nothing to compile: give --partitionings or --remat-policies.")
    for name in ("loss_chunk_size", "attention_chunk_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1.")
    if args.sequence < 1 or 8 % args.sequence or args.seq_len % (2 * args.sequence):
        p.error("--sequence must divide 8 (the devices), --seq-len be a multiple of 2 x it.")
    if args.expert < 1 or 8 % (args.expert * args.sequence):
        p.error("--expert x --sequence must divide 8 (the devices).")
    if args.hidden is not None and (args.hidden < 128 or args.hidden % 128):
        p.error("--hidden must be a multiple of 128 (heads of 128 / 256 features).")
    if args.batch_size % (8 // args.sequence):
        p.error(
            f"--batch-size must be a multiple of {8 // args.sequence} (8 / --sequence, the "
            "data-parallel degree of dp)."
        )
    return args


def attention_options(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields `--attention-chunk-size` sets (none without it)."""
    if args.attention_chunk_size is None:
        return {}
    return dict(attention="chunked", attention_chunk_size=args.attention_chunk_size)


def gin_model(name: str, args: argparse.Namespace, remat: str) -> DecoderOnlyModel:
    """The decoder-only model of gin/models/<name>.gin, with `remat` and `args`' scan_layers
    (and layer count, if given: `bench_common.reduce_layers`, which keeps `--first-dense` of
    DeepSeek-V3's dense first layers). A model whose dense and MoE layers are mixed runs
    unscanned whatever `--scan-layers` says: a scan needs every layer alike."""
    model = bench_common.gin_model(name)
    if args.layers or args.first_dense is not None:
        layers = args.layers or model.config.num_layers
        model = bench_common.reduce_layers(model, layers, args.first_dense)
    c = model.config
    mixed = hasattr(c, "sparse_layers") and len(set(c.sparse_layers(c.num_layers))) > 1
    changes = dict(
        remat_policy=remat, scan_layers=args.scan_layers and not mixed, **attention_options(args)
    )
    config = dataclasses.replace(c, **changes)
    return DecoderOnlyModel(config, loss_chunk_size=args.loss_chunk_size)


def build_model(name: str, args: argparse.Namespace, remat: str) -> DecoderOnlyModel:
    """The shapes of gin/models/gptj_6b.gin or llama2_7b.gin (bf16 compute, f32 params), or
    a gin model file's."""
    if name not in BUILT_HERE:
        return gin_model(name, args, remat)
    hidden = args.hidden or 4096
    scale = hidden / 4096
    common = dict(
        hidden_size=hidden,
        dtype="bfloat16",
        param_dtype="float32",
        remat_policy=remat,
        scan_layers=args.scan_layers,
        **attention_options(args),
    )
    if name == "gptj":
        config = GPTJConfig(
            vocab_size=50400,
            num_layers=args.layers or 28,
            num_heads=max(8, int(16 * scale)),
            rotary_dim=min(64, hidden // max(8, int(16 * scale))),
            intermediate_size=4 * hidden,
            max_position_embeddings=2048,
            **common,
        )
    else:
        config = LlamaConfig(
            vocab_size=32000,
            num_layers=args.layers or 32,
            num_heads=max(8, int(32 * scale)),
            num_kv_heads=max(8, int(32 * scale)),
            intermediate_size=int(11008 * scale) // 8 * 8,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            **common,
        )
    return DecoderOnlyModel(config, loss_chunk_size=args.loss_chunk_size)


def measure(
    model_name: str,
    partitioning: str,
    remat: str,
    args: argparse.Namespace,
    devices: Sequence[Any],
) -> dict[str, Any]:
    model = build_model(model_name, args, remat)
    partitioner = bench_common.make_partitioner(partitioning, devices, args.sequence, args.expert)
    start = time.perf_counter()
    step = bench_common.CompiledStep(
        model,
        partitioner,
        args.batch_size,
        args.seq_len,
        matmul_precision=args.matmul_precision,
        out_of_memory_ok=True,
        preference_loss=args.preference,
        lora_rank=args.lora_rank,
    )
    wall = time.perf_counter() - start
    state = step.setup.abstract_state
    mem = step.compiled.memory_analysis() if step.compiled is not None else None
    n = len(devices)
    params_total = bench_common.total_bytes(state.params)
    opt_total = bench_common.total_bytes(state.opt_state)
    row = {
        "model": model_name,
        "partitioning": partitioning,
        "mesh": dict(zip(partitioner.mesh_axis_names, partitioner.mesh_shape)),
        "remat_policy": remat,
        "loss_chunk_size": args.loss_chunk_size,
        "attention_chunk_size": args.attention_chunk_size,
        "sequence": args.sequence,
        "expert": args.expert,
        "num_layers": model.config.num_layers,
        "scan_layers": model.config.scan_layers,
        "num_params": sum(x.size for x in jax.tree.leaves(state.params)),
        "params_total_bytes": params_total,
        "opt_total_bytes": opt_total,
        "params_bytes": bench_common.per_device_bytes(state.params),
        "opt_bytes": bench_common.per_device_bytes(state.opt_state),
        "compile_seconds": wall,
        "preference": args.preference,
        "lora_rank": args.lora_rank,
        "frozen_bytes": 0
        if step.abstract_frozen is None
        else bench_common.per_device_bytes(step.abstract_frozen),
    }
    if mem is None:
        row["out_of_memory"] = step.out_of_memory
    else:
        row["temp_bytes"] = int(mem.temp_size_in_bytes)
        row["argument_bytes"] = int(mem.argument_size_in_bytes)
        row["output_bytes"] = int(mem.output_size_in_bytes)
        row["alias_bytes"] = int(mem.alias_size_in_bytes)
        if args.collectives:
            import collectives

            by_kind = collectives.parse_hlo(step.compiled.as_text(), n)["by_kind"]
            row["collective_bytes"] = {
                k: by_kind.get(k, {}).get("array_bytes", 0) for k in COLLECTIVE_COLUMNS
            }
    ideal = (params_total + opt_total) / n
    if args.lora_rank is not None:
        pass  # the targets are the full params' (adapters are too small to split evenly)
    elif partitioning == "fsdp":
        value = row["params_bytes"] + row["opt_bytes"]
        row["target"] = f"params+opt <= {TARGET} x total/{n}"
        row["target_ratio"] = value / ideal
        row["pass"] = value <= TARGET * ideal
    elif partitioning == "zero1":
        row["target"] = f"opt <= {TARGET} x total/{n}, params whole"
        row["target_ratio"] = row["opt_bytes"] / (opt_total / n)
        row["pass"] = (
            row["opt_bytes"] <= TARGET * opt_total / n and row["params_bytes"] == params_total
        )
    if row.get("pass") is False:
        # Name what keeps the target from being met: arrays held whole on every device.
        tree = state.opt_state if partitioning == "zero1" else state
        row["unsharded"] = [
            f"{p} {s} {spec}"
            for p, s, spec in bench_common.unsharded_leaves(tree, min_bytes=1 << 20)
        ]
    return row


def gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    configs = []
    for model_name in args.models:
        for partitioning in args.partitionings:
            configs.append((model_name, partitioning, MODEL_REMAT))
        for remat in args.remat_policies:
            if (model_name, args.remat_partitioning, remat) not in configs:
                configs.append((model_name, args.remat_partitioning, remat))
    devices = bench_common.target_devices(args)
    n = len(devices)
    rows = []
    for model_name, partitioning, remat in configs:
        print(f"compiling {model_name} / {partitioning} / {remat} ...", flush=True)
        rows.append(measure(model_name, partitioning, remat, args, devices))
        print(f"  {rows[-1]['compile_seconds']:.1f}s", flush=True)

    header = [
        "model",
        "partitioning",
        "remat",
        "params GiB/dev",
        "opt GiB/dev",
        "frozen GiB/dev",
        "temp GiB/dev",
        f"params+opt / (total/{n})",
        "target",
    ]
    if args.collectives:
        header += [f"{k} GiB/step" for k in COLLECTIVE_COLUMNS]
    table = []
    for r in rows:
        ratio = (r["params_bytes"] + r["opt_bytes"]) / (
            (r["params_total_bytes"] + r["opt_total_bytes"]) / n
        )
        verdict = "-"
        if "pass" in r:
            verdict = f"{'PASS' if r['pass'] else 'FAIL'} ({r['target_ratio']:.3f}, {r['target']})"
        table.append(
            [
                r["model"],
                r["partitioning"]
                + (f" + sequence {r['sequence']}" if r["sequence"] > 1 else "")
                + (f" + expert {r['expert']}" if r["expert"] > 1 else ""),
                r["remat_policy"],
                gib(r["params_bytes"]),
                gib(r["opt_bytes"]),
                gib(r["frozen_bytes"]),
                gib(r["temp_bytes"]) if "temp_bytes" in r else "does not fit",
                f"{ratio:.3f}",
                verdict,
            ]
        )
        if args.collectives:
            moved = r.get("collective_bytes", {})
            table[-1] += [gib(moved[k]) if k in moved else "-" for k in COLLECTIVE_COLUMNS]
    print()
    for m in args.models:
        first = next(r for r in rows if r["model"] == m)
        print(
            f"{m}: {first['num_params'] / 1e9:.3f}B params in {first['num_layers']} layers"
            f"{'' if first['scan_layers'] == args.scan_layers else ' (unscanned)'}, "
            f"params {gib(first['params_total_bytes'])} GiB, "
            f"optimizer {gib(first['opt_total_bytes'])} GiB in all"
        )
    print(
        f"batch {args.batch_size} x length {args.seq_len}, scan_layers={args.scan_layers}, "
        f"loss_chunk_size={args.loss_chunk_size}, attention_chunk_size="
        f"{args.attention_chunk_size}, sequence={args.sequence}, preference="
        f"{args.preference}, lora_rank={args.lora_rank}; "
        f"{bench_common.machine_description(devices, args.tpu_topology)}\n"
    )
    bench_common.print_table(header, table)
    for r in rows:
        if "out_of_memory" in r:
            print(f"  {r['model']}/{r['partitioning']}/{r['remat_policy']}: {r['out_of_memory']}")
        for line in r.get("unsharded", []):
            print(f"  FAIL {r['model']}/{r['partitioning']}: whole on every device: {line}")
    results = bench_common.run_record("memory.py", args, argv, devices, rows=rows)
    bench_common.write_json(results, args.json)
    return results


if __name__ == "__main__":
    main()
