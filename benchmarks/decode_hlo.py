"""What a decode step moves through a GPU's memory, read off its compiled program (no GPU).

    pip install -e '.[gpu-compile]'   # XLA:GPU of the pinned jax; no GPU, driver or CUDA
    python benchmarks/decode_hlo.py --target h100 --batches 1 16 64 --context 1024

Decoding is bound by memory bandwidth: a step takes at least the bytes its kernels read and
write over the bandwidth, and the least it can read is every parameter and each sequence's
keys and values once (`decode_roofline.py`'s roofline). This compiles the two decode loops
for the target GPU ahead of time (`flaxlm.plan.aot.gpu_devices`), as `decode_roofline.py`
runs them,

- `generate`: `inference.generation.decode_tokens` (one contiguous KV cache), `--new` tokens
  after prompts of `--context`;
- `paged`: the serving engine's decode dispatch (`inference.scheduler.Scheduler`, a paged
  KV cache, `--decode-steps` tokens per dispatch), every row at the same context, each
  row's pages gathered for the attention (`paged_attention='gather'`);
- `pallas`: the same with `paged_attention='pallas'` (the Pallas kernel reads the pages
  in place, `flaxlm.models.paged_attention`),

and sums the bytes of the kernels one token step runs (`flaxlm.plan.traffic`, greedy: a
conditional counts its lightest branch), against the roofline's bytes. `roofline / step`
is the share of the roofline the program could reach at full bandwidth: what it moves
beyond the minimum is listed by kernel kind, the largest kernels named. `--target this`
compiles for this host's first device instead (CPU: XLA:CPU's program, which differs).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

import bench_common  # a sibling script; puts the repository on sys.path
import decode_roofline  # a sibling script


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama3_2_1b", help="a gin/models/ name")
    p.add_argument("--layers", type=int, help="the model cut to its first N layers")
    p.add_argument("--target", default="h100", help="h100, h200 or `this`")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=1024, help="prompt tokens")
    p.add_argument("--new", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument(
        "--paths",
        nargs="+",
        choices=("generate", "paged", "pallas"),
        default=["generate", "paged", "pallas"],
    )
    p.add_argument("--decode-steps", type=int, default=16, help="the engine's tokens per dispatch")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--heaviest-branch",
        action="store_true",
        help="count each conditional's heaviest branch (a program whose loop steps the model "
        "under a conditional, as the batch path did before the eighteenth session)",
    )
    p.add_argument("--top", type=int, default=8, help="kernel kinds and kernels listed")
    p.add_argument("--dump", metavar="DIR", help="write each compiled program's HLO here")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    return p.parse_args(argv)


def abstract(tree: Any, sharding: Any) -> Any:
    import jax

    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def compile_generate(model: Any, params: Any, batch: int, args: argparse.Namespace, device: Any):
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from flaxlm.inference import generation
    from flaxlm.models import decoding

    sharding = SingleDeviceSharding(device)
    config = decoding.DecodingConfig(max_new_tokens=args.new, eos_ids=())
    fn = functools.partial(generation.decode_tokens, model, config=config)
    inputs = abstract(jax.ShapeDtypeStruct((batch, args.context), jnp.int32), sharding)
    lengths = abstract(jax.ShapeDtypeStruct((batch,), jnp.int32), sharding)
    rng = abstract(jax.ShapeDtypeStruct((2,), jnp.uint32), sharding)
    return jax.jit(fn).lower(abstract(params, sharding), inputs, lengths, rng).compile()


def compile_paged(
    model: Any,
    params: Any,
    batch: int,
    args: argparse.Namespace,
    device: Any,
    paged_attention: str = "gather",
):
    """The engine's decode dispatch as `Scheduler` jits it, its pool sized for `batch` rows
    of `--context + --new` slots (nothing allocated: the scheduler's own cache is not made)."""
    import jax
    import jax.numpy as jnp

    from flaxlm.inference import sampling
    from flaxlm.inference.pages import pages_for
    from flaxlm.inference.scheduler import Scheduler
    from flaxlm.parallel.partitioning import Partitioner

    class Abstract(Scheduler):
        def reset(self) -> None:  # the pool would be allocated on the device
            self.cache = None

    partitioner = Partitioner(mesh_shape=(1, 1, 1), devices=[device])
    scheduler = Abstract(
        model,
        params,
        partitioner,
        max_rows=batch,
        page_size=args.page_size,
        max_seq_len=args.context + args.new,
        decode_steps=args.decode_steps,
        layout_in_program=True,
        paged_attention=paged_attention,
    )
    replicated = partitioner.replicated()
    cache = jax.eval_shape(lambda: model.paged_cache(scheduler.num_pages, args.page_size))
    cache = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        cache,
        scheduler.programs.shardings,
    )

    def rows(dtype: Any = jnp.int32, *shape: int) -> Any:
        return jax.ShapeDtypeStruct((batch, *shape), dtype, sharding=replicated)

    table = rows(jnp.int32, pages_for(args.context + args.new, args.page_size))
    inputs = (abstract(params, replicated), cache, rows(), rows(), table, None)
    settings = sampling.Rows(*(rows(x.dtype, *x.shape[1:]) for x in sampling.rows([], batch)))
    sample = (rows(), rows(), rows(), settings)
    with partitioner.context():
        return scheduler.programs.decode.lower(*inputs, *sample).compile()


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the target is compiled for, not run
    import jax

    from flaxlm.plan import aot, chips, traffic

    if args.target == "this":
        device, chip = jax.devices()[0], None
    else:
        device, chip = aot.gpu_devices(args.target)[0], chips.CHIPS.get(args.target)
    model, init = decode_roofline.model_and_init(args)
    params = jax.eval_shape(init)
    param_bytes = decode_roofline.parameter_bytes(params)
    kv_token = decode_roofline.kv_bytes_per_token(model, args.dtype)
    print(
        f"{args.model} compiled for {device.device_kind} on "
        f"{bench_common.machine_description([jax.devices('cpu')[0]])}: "
        f"{param_bytes / 1e9:.2f} GB of params, {kv_token} KV bytes per token"
    )
    rows = []
    for batch in args.batches:
        roof = param_bytes + batch * (args.context + args.new / 2) * kv_token
        for path in args.paths:
            if path == "generate":
                compiled = compile_generate(model, params, batch, args, device)
            else:
                attention = "pallas" if path == "pallas" else "gather"
                compiled = compile_paged(model, params, batch, args, device, attention)
            text = compiled.as_text()
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                with open(os.path.join(args.dump, f"{path}_b{batch}.hlo"), "w") as f:
                    f.write(text)
            kernels = traffic.loop_kernels(text)
            step = traffic.iteration_bytes(kernels, max if args.heaviest_branch else min)
            row = {
                "batch": batch,
                "path": path,
                "step_bytes": step,
                "roofline_bytes": roof,
                "of_roofline": roof / step,
                "kinds": traffic.by_kind(kernels)[: args.top],
                "largest": [
                    (k.name, k.kind, k.nbytes, k.shape)
                    for k in sorted(kernels, key=lambda k: -k.nbytes)[: args.top]
                    if k.branch is None
                ],
            }
            if chip is not None:
                row["step_ms_at_bandwidth"] = 1e3 * step / chip.memory_bytes_per_s
            rows.append(row)
            print(
                f"batch {batch} {path}: {step / 1e9:.3f} GB a step against the roofline's "
                f"{roof / 1e9:.3f} GB ({roof / step:.1%})",
                flush=True,
            )
            for kind, nbytes in row["kinds"]:
                print(f"    {kind:40s} {nbytes / 1e9:8.3f} GB")
            for name, kind, nbytes, shape in row["largest"][:3]:
                print(f"    largest: {name} ({kind}) {nbytes / 1e6:.1f} MB {shape}")
    bench_common.print_table(
        ["batch", "path", "GB a step", "roofline GB", "roofline / step"],
        [
            [
                r["batch"],
                r["path"],
                f"{r['step_bytes'] / 1e9:.3f}",
                f"{r['roofline_bytes'] / 1e9:.3f}",
                f"{r['of_roofline']:.1%}",
            ]
            for r in rows
        ],
    )
    bench_common.write_json({"rows": rows, "args": vars(args)}, args.json)
    return rows


if __name__ == "__main__":
    main()
