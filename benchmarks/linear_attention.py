"""One linear-attention layer against one full-attention layer of the same width, at long
lengths: forward + backward of `sum(out ** 2)` with respect to the params and the input.

Each layer is built alone from flaxlm's modules with a gin/models/ file's config, as that
family's block builds it (`--layers`):

- `gdn`: Gated DeltaNet (`gated_deltanet.GatedDeltaNet`) of `--model`, a Qwen3-Next or
  Qwen3.5 file (default `qwen3_next_tiny`: width 128, 2 key / 4 value heads of 32, chunks of
  64; `qwen3_next_80b_a3b`: width 2048, 16 / 32 heads of 128).
- `full`: the same file's gated full attention (`attention.rotary_self_attention` with the
  options of `qwen3_next.Qwen3NextBlock`: (1 + w) q/k RMSNorms, an output gate per head,
  partial rotary; tiny: 4 heads of 32, 2 KV; 80B: 16 of 256, 2 KV). Its attention is the
  config's ('auto': cuDNN's flash attention on a GPU in bfloat16, else 'xla', the whole score
  matrix; `--attention` replaces it), but where that is 'xla' and the float32 scores
  `[batch, heads, length, length]` would exceed `--max-scores-gib`, 'chunked' (blocks of the
  config's `attention_chunk_size`, memory linear in the length, hidden blocks skipped): the
  table says which ran.
- `kda`: Kimi Delta Attention (`kimi_delta.KimiDeltaAttention`) of `--kimi-model` (default
  `kimi_linear_tiny`: width 128, 4 heads of 32), compared with `full` where the widths agree.

Each (layer, length): inputs `[batch, length, hidden]` and params on the device, the jitted
gradient compiled ahead of time (its `memory_analysis` gives the temporaries), one warm-up
call, then up to `--calls` timed calls, stopping once they took `--max-seconds` (a warm-up
call longer than that is the timing: its first-call costs, under a second on CPU, are small
beside it). Reported: median seconds per call, tokens/s, temporaries, and per length
full / linear (> 1: the linear layer is faster). `--profile DIR` traces two calls of each row
and prints where the device's time goes (profile_summary.py; kernels on a GPU).

    python benchmarks/linear_attention.py               # 4k and 32k (~5 min, 2-core CPU)
    python benchmarks/linear_attention.py --layers gdn full kda --lengths 4096
    python benchmarks/linear_attention.py --model qwen3_next_80b_a3b \\
        --kimi-model kimi_linear_48b_a3b --layers gdn full kda --profile /tmp/p   # a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import bench_common  # (a sibling script; puts the repository on sys.path)
import flax.linen as nn
import jax
import jax.numpy as jnp
import profile_summary  # (a sibling script)

from flaxlm.models import attention, gated_deltanet, kimi_delta, masks, qwen3_next, rope

LAYERS = ("gdn", "full", "kda")
LINEAR = ("gdn", "kda")
NAMES = {"gdn": "Gated DeltaNet", "full": "gated full attention", "kda": "Kimi Delta Attention"}
MIB = 2**20
GIB = 2**30


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", nargs="+", choices=LAYERS, default=["gdn", "full"])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--model", default="qwen3_next_tiny", help="gdn's and full's gin/models/ file")
    p.add_argument("--kimi-model", default="kimi_linear_tiny", help="kda's gin/models/ file")
    p.add_argument("--dtype", help="compute dtype (default: the config's; params float32)")
    p.add_argument("--attention", choices=attention.ATTENTION_IMPLEMENTATIONS)
    p.add_argument("--max-scores-gib", type=float, default=2.0, help="'xla''s limit, else chunked")
    p.add_argument("--calls", type=int, default=3, help="timed calls per row, at most")
    p.add_argument("--max-seconds", type=float, default=10.0, help="a row's timed calls stop")
    p.add_argument("--profile", metavar="DIR", help="trace two calls of each row into DIR/...")
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def config(name: str, args: argparse.Namespace) -> Any:
    """The config of gin/models/<name>.gin, at `--dtype` and float32 params."""
    changes = {"param_dtype": "float32"} | ({"dtype": args.dtype} if args.dtype else {})
    return bench_common.gin_model(name, **changes).config


class FullAttention(nn.Module):
    """A Qwen3-Next / Qwen3.5 config's gated full-attention layer: `[batch, length, embed]`
    -> the same, as `qwen3_next.Qwen3NextBlock` builds it."""

    config: Any
    implementation: str

    @nn.compact
    def __call__(self, h: jax.Array, mask: masks.Mask, decoding: None = None) -> jax.Array:
        """The linear layers' signature; `decoding` None: training."""
        cfg = self.config
        batch, length, _ = h.shape
        positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
        sin, cos = rope.sin_cos(positions, cfg, dim=cfg.rotary_dim)
        return attention.rotary_self_attention(
            h,
            sin,
            cos,
            mask,
            None,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.kv_heads,
            head_dim=cfg.dim_per_head,
            hidden_size=cfg.hidden_size,
            qkv_bias=cfg.attention_bias,
            out_bias=cfg.attention_bias,
            qk_norm="rms_plus_one",
            output_gate=True,
            attention=self.implementation,
            chunk_size=cfg.attention_chunk_size,
            norm_eps=cfg.rms_norm_eps,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
        )


def attention_choice(cfg: Any, args: argparse.Namespace, length: int) -> str:
    """What `full` runs at `length` (see the module's docstring)."""
    implementation = args.attention or cfg.attention
    if implementation == "auto":
        mask = masks.causal_mask(None, args.batch, length)
        implementation = attention.auto_choice(mask, None, None, cfg.dtype)
    if implementation != "xla":
        return implementation
    scores = 4 * args.batch * cfg.num_heads * length**2
    return "xla" if scores <= args.max_scores_gib * GIB else "chunked"


def build(name: str, args: argparse.Namespace, length: int) -> tuple[nn.Module, dict[str, Any]]:
    """The layer `name` and what describes it in the table."""
    if name == "kda":
        cfg = config(args.kimi_model, args)
        module = kimi_delta.KimiDeltaAttention(
            num_heads=cfg.linear_num_heads,
            head_dim=cfg.linear_head_dim,
            **qwen3_next.linear_layer_settings(cfg),
        )
        heads = f"{cfg.linear_num_heads} x {cfg.linear_head_dim}"
    elif name == "gdn":
        cfg = config(args.model, args)
        module = gated_deltanet.GatedDeltaNet(
            num_key_heads=cfg.linear_num_key_heads,
            num_value_heads=cfg.linear_num_value_heads,
            key_dim=cfg.linear_key_head_dim,
            value_dim=cfg.linear_value_head_dim,
            projection=cfg.projection,
            **qwen3_next.linear_layer_settings(cfg),
        )
        heads = (
            f"{cfg.linear_num_key_heads} key x {cfg.linear_key_head_dim}, "
            f"{cfg.linear_num_value_heads} value x {cfg.linear_value_head_dim}"
        )
    else:
        cfg = config(args.model, args)
        module = FullAttention(cfg, attention_choice(cfg, args, length))
        heads = f"{cfg.num_heads} x {cfg.dim_per_head}, {cfg.kv_heads} KV"
    description = {"heads": heads, "hidden": cfg.hidden_size, "dtype": str(cfg.dtype)}
    if name == "full":
        description["attention"] = module.implementation
    return module, description


def gradient_call(module: nn.Module, row: dict[str, Any], args: argparse.Namespace) -> dict:
    """The layer's jitted gradient compiled for `row`'s length, with device-resident inputs:
    `call()` runs it once; the compile's seconds and temporaries."""
    shape = (args.batch, row["length"], row["hidden"])
    h = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(row["dtype"])
    mask = masks.causal_mask(None, args.batch, row["length"])
    one = masks.causal_mask(None, args.batch, 1)  # the params do not depend on the length
    params = nn.unbox(jax.jit(lambda x: module.init(jax.random.key(0), x, one, None))(h[:, :1]))

    def loss(params: Any, h: jax.Array) -> jax.Array:
        return jnp.sum(module.apply(params, h, mask, None).astype(jnp.float32) ** 2)

    start = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, h).compile()
    compile_seconds = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    return {
        "call": lambda: jax.block_until_ready(compiled(params, h)),
        "compile_seconds": compile_seconds,
        "temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
        "params": sum(x.size for x in jax.tree.leaves(params)),
    }


def time_calls(call: Callable[[], Any], args: argparse.Namespace) -> dict[str, Any]:
    """One warm-up call, then timed calls until `--calls` or `--max-seconds`."""
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    seconds = [first] if first > args.max_seconds else []
    while len(seconds) < args.calls and sum(seconds) < args.max_seconds:
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return {"first_call_seconds": first, "call_seconds": seconds}


def run_row(name: str, length: int, args: argparse.Namespace) -> dict[str, Any]:
    module, description = build(name, args, length)
    row: dict[str, Any] = {"layer": name, "length": length, **description}
    print(f"  {NAMES[name]}, L{length}: ", end="", flush=True)
    try:
        step = gradient_call(module, row, args)
        row.update({k: v for k, v in step.items() if k != "call"})
        row.update(time_calls(step["call"], args))
    except Exception as e:  # noqa: BLE001 - a length that does not fit is a row saying so
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(row["error"])
        return row
    row["seconds"] = statistics.median(row["call_seconds"])
    row["tokens_per_second"] = args.batch * length / row["seconds"]
    temp = "?" if row["temp_bytes"] is None else f"{row['temp_bytes'] / MIB:,.0f}"
    print(
        f"compiled in {row['compile_seconds']:.1f} s, {row['seconds']:.3f} s/call "
        f"({len(row['call_seconds'])} timed), {row['tokens_per_second']:,.0f} tokens/s, "
        f"temporaries {temp} MiB"
    )
    if args.profile:

        def run(calls: int) -> None:
            for _ in range(calls):
                step["call"]()

        directory = os.path.join(args.profile, f"{name}_L{length}")
        row["profile"] = profile_summary.trace_steps(run, directory, steps=2)
    return row


def ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per length, full / linear of the time and the temporaries, for each linear layer of
    the full one's width."""
    timed = {(r["layer"], r["length"]): r for r in rows if "seconds" in r}
    out = []
    for (name, length), linear in timed.items():
        full = timed.get(("full", length))
        if name not in LINEAR or full is None or full["hidden"] != linear["hidden"]:
            continue
        temp = None
        if full["temp_bytes"] and linear["temp_bytes"]:
            temp = full["temp_bytes"] / linear["temp_bytes"]
        out.append(
            {
                "length": length,
                "linear": name,
                "full_over_linear": full["seconds"] / linear["seconds"],
                "temp_full_over_linear": temp,
            }
        )
    return out


def print_tables(rows: Sequence[dict[str, Any]], compared: Sequence[dict[str, Any]]) -> None:
    table = []
    for r in rows:
        what = NAMES[r["layer"]] + (f" ('{r['attention']}')" if "attention" in r else "")
        shape = f"{r['hidden']}; {r['heads']}"
        if "error" in r:
            table.append([what, r["length"], shape, r["error"], "", "", ""])
            continue
        spread = f"{min(r['call_seconds']):.3f}-{max(r['call_seconds']):.3f}"
        temp = "?" if r["temp_bytes"] is None else f"{r['temp_bytes'] / MIB:,.0f}"
        table.append(
            [
                what,
                r["length"],
                shape,
                f"{r['seconds']:.3f} ({spread}, {len(r['call_seconds'])})",
                f"{r['tokens_per_second']:,.0f}",
                temp,
                f"{r['compile_seconds']:.1f}",
            ]
        )
    header = ["layer", "length", "width; heads", "s/call (range, calls)", "tokens/s"]
    bench_common.print_table([*header, "temp MiB", "compile s"], table)
    if compared:
        print()
        bench_common.print_table(
            ["length", "linear layer", "full / linear: time", "temporaries"],
            [
                [
                    r["length"],
                    NAMES[r["linear"]],
                    f"{r['full_over_linear']:.2f}",
                    "?"
                    if r["temp_full_over_linear"] is None
                    else f"{r['temp_full_over_linear']:.2f}",
                ]
                for r in compared
            ],
        )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    machine = bench_common.machine_description()
    print(f"{machine}; B{args.batch}, {args.model} / {args.kimi_model}")
    rows = [run_row(name, length, args) for length in args.lengths for name in args.layers]
    compared = ratios(rows)
    print(f"\nForward + backward of one layer, B{args.batch}, params float32\n")
    print_tables(rows, compared)
    results = bench_common.run_record("linear_attention.py", args, argv, rows=rows, ratios=compared)
    bench_common.write_json(results, args.json)
    return results


if __name__ == "__main__":
    main()
