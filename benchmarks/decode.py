"""Decoding speed: flaxlm's KV-cache `generate` against HF's PyTorch `generate` on the same
small GPT-J, and against flaxlm decoding without a cache (the whole sequence re-run for
every token), alternating in one process.

The model is a random HF `GPTJForCausalLM` built from a config, saved, and imported with
`flaxlm.checkpoints.hf.from_pretrained` (so both sides hold the same weights). Every side greedily
decodes `--new` tokens after `--prompt`-token prompts for a batch of `--batch`, with EOS
disabled so every row decodes every token; the report gives each side's median tokens/s
over `--repeats` rounds (compile excluded) and the ratio to HF.

    python benchmarks/decode.py                     # the recorded configuration
    python benchmarks/decode.py --repeats 2 --new 16

Target: KV-cache tokens/s at least 2x HF's.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from flaxlm.checkpoints import hf  # noqa: E402
from flaxlm.inference import generation  # noqa: E402


def build(tmp: str, args: argparse.Namespace):
    import torch
    import transformers

    config = transformers.GPTJConfig(
        vocab_size=args.vocab,
        n_positions=args.prompt + args.new,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        rotary_dim=args.hidden // args.heads // 2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    torch_model = transformers.GPTJForCausalLM(config).eval()
    torch_model.save_pretrained(tmp, safe_serialization=True)
    model, params = hf.from_pretrained(tmp)
    return torch_model, model, params


def no_cache_decoder(model, params, prompt_len: int, new: int):
    """Greedy decoding that re-runs the full (fixed-size) sequence for every new token."""

    @jax.jit
    def decode(prompts):
        batch = prompts.shape[0]
        buf = jnp.zeros((batch, prompt_len + new), jnp.int32).at[:, :prompt_len].set(prompts)

        def body(t, buf):
            logits = model.compute_logits(params, {"decoder_input_tokens": buf})
            pos = prompt_len + t - 1
            token = jnp.argmax(logits[:, pos], axis=-1).astype(jnp.int32)
            return buf.at[:, pos + 1].set(token)

        return jax.lax.fori_loop(0, new, body, buf)[:, prompt_len:]

    return decode


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        torch_model, model, params = build(tmp, args)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, args.vocab, (args.batch, args.prompt)).astype(np.int32)
    batch = {"inputs": prompts}
    no_cache = no_cache_decoder(model, params, args.prompt, args.new)

    def run_cache():
        return generation.generate(model, params, batch, max_new_tokens=args.new, eos_id=None)

    def run_no_cache():
        return np.asarray(no_cache(jnp.asarray(prompts)))

    def run_torch():
        with torch.no_grad():
            out = torch_model.generate(
                torch.from_numpy(prompts.astype(np.int64)),
                attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        return out[:, args.prompt :].numpy()

    sides = {"flaxlm_cache": run_cache, "flaxlm_no_cache": run_no_cache, "hf_torch": run_torch}
    outputs = {name: fn() for name, fn in sides.items()}  # compile / warm up
    agree = bool((outputs["flaxlm_cache"] == outputs["flaxlm_no_cache"]).all())
    agree_hf = float((outputs["flaxlm_cache"] == outputs["hf_torch"]).mean())
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    tokens = args.batch * args.new
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    result = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/decode.py " + shlex.join(argv),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{jax.devices()[0].platform}",
        "config": f"GPT-J {args.layers}x{args.hidden}, B{args.batch}, prompt {args.prompt}, "
        f"new {args.new}, R{args.repeats}",
        "tokens_per_second": rate,
        "cache_over_hf": rate["flaxlm_cache"] / rate["hf_torch"],
        "cache_over_no_cache": rate["flaxlm_cache"] / rate["flaxlm_no_cache"],
        "cache_equals_no_cache": agree,
        "tokens_equal_to_hf": agree_hf,
    }
    for name, r in rate.items():
        print(f"{name:16s} {r:10.1f} tokens/s  (median of {args.repeats})")
    print(
        f"KV cache / HF = {result['cache_over_hf']:.2f}x (target >= 2); "
        f"KV cache / no cache = {result['cache_over_no_cache']:.2f}x; "
        f"cache == no cache tokens: {agree}; tokens equal to HF: {agree_hf:.1%}"
    )
    print(
        f"| {result['date']} | `{result['command'].strip()}` | {result['machine']} | "
        f"{result['config']} | {rate['flaxlm_cache']:.0f} | {rate['flaxlm_no_cache']:.0f} | "
        f"{rate['hf_torch']:.0f} | {result['cache_over_hf']:.2f} | |"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
