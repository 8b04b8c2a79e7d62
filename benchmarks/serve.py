"""Serving throughput: requests/s and tokens/s of `python -m flaxlm.main
--gin_file=gin/runs/serve.gin` at 1, 4 and 16 concurrent clients.

A random HF GPT-J (4 layers, width 256, byte-sized vocabulary, no EOS so every request
decodes `--max-tokens` tokens) is saved and served by a subprocess on 127.0.0.1; each
client thread sends greedy completion requests back to back for `--seconds` seconds. The
server batches requests that arrive within BATCH_WAIT_MS of each other.

    python benchmarks/serve.py                 # the recorded configuration
    python benchmarks/serve.py --seconds 5 --clients 1 4

`--engines` instead measures the engines side by side in one process (no HTTP), alternating
on the same checkpoint: today's `Engine` (continuous batching over a paged KV cache) against
`BatchEngine` (dynamic batches over a contiguous cache). Each client sends greedy requests
of mixed prompt (4-200 bytes) and output (8-64 tokens) lengths back to back; the numbers are
completion tokens/s and the time to first token (p50 / p99).

    python benchmarks/serve.py --engines --clients 1 8 32 --seconds 10

`--adapters N` instead measures many LoRA adapters at once against one merged model, in one
process, alternating: the paged `Engine` over the base with N random adapters stacked beside
it (ranks 4, 8, 16, ... on every attention and MLP kernel), client i asking for adapter
i mod N (every batch mixes them), against the same engine over the first adapter merged into
the base. The ratio of their tokens/s is the price of the per-row adapter gather.

    python benchmarks/serve.py --adapters 3 --clients 8 --seconds 20

`--guided F` instead measures structured outputs in one process, alternating: the paged
`Engine` with a fraction F of its clients guided (a regex over the model's bytes,
llguidance's mask each token; `inference/guides.py`) against the same engine
with none guided. A guided row decodes one token a dispatch, and so does its batch while it
runs: the ratio is what guiding some of the requests costs all of them.

    python benchmarks/serve.py --guided 0.25 --clients 8 --seconds 20
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_model(path: str) -> None:
    import torch
    import transformers

    config = transformers.GPTJConfig(
        vocab_size=259,
        n_positions=512,
        n_embd=256,
        n_layer=4,
        n_head=4,
        rotary_dim=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.GPTJForCausalLM(config).save_pretrained(path, safe_serialization=True)


def post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


def load(url: str, clients: int, seconds: float, max_tokens: int) -> dict[str, float]:
    stop = time.monotonic() + seconds
    done = {"requests": 0, "tokens": 0}
    lock = threading.Lock()

    def client(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            out = post(
                url,
                {
                    "prompt": f"client {i} request {n}: def f(",
                    "max_tokens": max_tokens,
                    "temperature": 0,
                },
            )
            with lock:
                done["requests"] += 1
                done["tokens"] += out["usage"]["completion_tokens"]
            n += 1

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    elapsed = time.monotonic() - start
    return {
        "requests_per_second": done["requests"] / elapsed,
        "tokens_per_second": done["tokens"] / elapsed,
        "requests": done["requests"],
    }


def engine_load(
    engine, clients: int, seconds: float, seed: int = 0, adapters: int = 0, guide=None
) -> dict[str, float]:
    """Completion tokens/s and time-to-first-token percentiles of `clients` threads sending
    mixed-length greedy completions to `engine` back to back for `seconds` (client i to
    adapter `i % adapters + 1` when `adapters`; its requests guided where `guide(i)` gives
    a `Guide`)."""
    import numpy as np

    from flaxlm.inference.sampling import Sampling
    from flaxlm.runs.serve.api import Completion

    stop = time.monotonic() + seconds
    tokens, ttft = [0], []
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = np.random.default_rng(seed * 1000 + i)
        while time.monotonic() < stop:
            prompt = rng.integers(3, 259, int(rng.integers(4, 201))).tolist()
            adapter = i % adapters + 1 if adapters else 0
            c = Completion(
                prompt, int(rng.integers(8, 65)), Sampling(), [], None, 0, adapter=adapter
            )
            c.guide = guide and guide(i)
            start = time.monotonic()
            engine.submit(c)
            first, n = None, 0
            while True:
                event = c.events.get()
                if event[0] != "token":
                    break
                first = first or time.monotonic() - start
                n += 1
            with lock:
                tokens[0] += n
                if first is not None:
                    ttft.append(first)

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    elapsed = time.monotonic() - start
    p50, p99 = np.percentile(ttft, [50, 99])
    return {"tokens_per_second": tokens[0] / elapsed, "ttft_p50": p50, "ttft_p99": p99}


def engines_side_by_side(args: argparse.Namespace) -> dict[str, dict[int, dict[str, float]]]:
    """{engine name: {clients: engine_load's numbers}}, the engines alternating per count."""
    import seqio

    from flaxlm.checkpoints import hf
    from flaxlm.parallel.partitioning import Partitioner
    from flaxlm.runs.serve.engine import BatchEngine, Engine

    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp)
        partitioner = Partitioner()
        model, params = hf.from_pretrained(tmp, partitioner)
    vocab = seqio.ByteVocabulary()
    size = args.max_batch_size
    engines = {
        "paged": Engine(model, params, partitioner, vocab, max_batch_size=size, max_seq_len=512),
        "batch": BatchEngine(model, params, partitioner, vocab, max_batch_size=size),
    }
    results: dict[str, dict[int, dict[str, float]]] = {name: {} for name in engines}
    for engine in engines.values():
        engine.start()
        engine_load(engine, size, min(args.seconds, 20.0), seed=99)  # compiles its programs
    try:
        for clients in args.clients:
            for name, engine in engines.items():
                results[name][clients] = r = engine_load(engine, clients, args.seconds)
                print(
                    f"{name:5s} {clients:3d} clients: {r['tokens_per_second']:7.1f} tokens/s, "
                    f"first token p50 {r['ttft_p50']:.3f} s p99 {r['ttft_p99']:.3f} s",
                    flush=True,
                )
    finally:
        for engine in engines.values():
            engine.stop()
    return results


def adapters_vs_merged(args: argparse.Namespace) -> dict[str, dict[int, dict[str, float]]]:
    """{"adapters" | "merged": {clients: engine_load's numbers}}, alternating per count."""
    import jax
    import numpy as np
    import seqio
    from flax import traverse_util

    from flaxlm.checkpoints import hf
    from flaxlm.parallel.partitioning import Partitioner
    from flaxlm.runs.serve.engine import Engine
    from flaxlm.training import lora

    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp)
        partitioner = Partitioner()
        model, params = hf.from_pretrained(tmp, partitioner)
    shapes = model.example_batch_shapes()
    sets, kernels = [], {}
    for i in range(args.adapters):
        rank = 4 * 2 ** (i % 3)
        cfg = lora.LoraConfig(
            rules=((r"(q|k|v|out)_proj/kernel$", rank), (r"fc_(in|out)/kernel", rank))
        )
        planned = lora.plan(cfg, model, shapes)
        tree = lora.init_adapters(jax.random.PRNGKey(i), planned)
        rng = np.random.default_rng(i)  # B nonzero: the adapters change the answers
        flat = traverse_util.flatten_dict(tree)
        tree = traverse_util.unflatten_dict(
            {
                k: v + 0.02 * rng.standard_normal(v.shape, np.float32) if k[-1] == "lora_b" else v
                for k, v in flat.items()
            }
        )
        kernels.update(planned)
        sets.append((tree, cfg.alpha))
    stacked = lora.with_row_adapters(params, lora.stack_adapters(kernels, sets))
    merged = lora.apply_adapters(params, sets[0][0], sets[0][1])
    vocab, size = seqio.ByteVocabulary(), args.max_batch_size
    names = tuple(f"adapter{i}" for i in range(args.adapters))
    engines = {
        "adapters": Engine(
            model, stacked, partitioner, vocab, max_batch_size=size, max_seq_len=512, adapters=names
        ),
        "merged": Engine(model, merged, partitioner, vocab, max_batch_size=size, max_seq_len=512),
    }
    counts = {"adapters": args.adapters, "merged": 0}
    results: dict[str, dict[int, dict[str, float]]] = {name: {} for name in engines}
    for name, engine in engines.items():
        engine.start()
        engine_load(engine, size, min(args.seconds, 20.0), seed=99, adapters=counts[name])
    try:
        for clients in args.clients:
            for name, engine in engines.items():
                r = engine_load(engine, clients, args.seconds, adapters=counts[name])
                results[name][clients] = r
                print(
                    f"{name:8s} {clients:3d} clients: {r['tokens_per_second']:7.1f} tokens/s, "
                    f"first token p50 {r['ttft_p50']:.3f} s p99 {r['ttft_p99']:.3f} s",
                    flush=True,
                )
            ratio = (
                results["adapters"][clients]["tokens_per_second"]
                / results["merged"][clients]["tokens_per_second"]
            )
            print(f"{clients} clients over {args.adapters} adapters / merged: {ratio:.2f}")
    finally:
        for engine in engines.values():
            engine.stop()
    return results


def guided_vs_not(args: argparse.Namespace) -> dict[str, dict[int, dict[str, float]]]:
    """{"guided" | "none": {clients: engine_load's numbers}}, alternating per count."""
    import seqio

    from flaxlm.checkpoints import hf
    from flaxlm.inference.guides import Grammars
    from flaxlm.parallel.partitioning import Partitioner
    from flaxlm.runs.serve.engine import Engine

    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp)
        partitioner = Partitioner()
        model, params = hf.from_pretrained(tmp, partitioner)
    grammars = Grammars(seqio.ByteVocabulary(), model.config.vocab_size, [])
    grammar = grammars.compile("regex", "[a-z ]+")  # never ends
    every = max(1, round(1 / args.guided))

    def guide(i: int):
        return grammars.guide(grammar, []) if i % every == 0 else None

    size = args.max_batch_size
    engine = Engine(
        model, params, partitioner, seqio.ByteVocabulary(), max_batch_size=size, max_seq_len=512
    )
    engine.start()
    engine_load(engine, size, min(args.seconds, 20.0), seed=99, guide=guide)  # compiles
    results: dict[str, dict[int, dict[str, float]]] = {"guided": {}, "none": {}}
    try:
        for clients in args.clients:
            for name in results:
                r = engine_load(
                    engine, clients, args.seconds, guide=guide if name == "guided" else None
                )
                results[name][clients] = r
                print(
                    f"{name:6s} {clients:3d} clients, "
                    f"{f'1 in {every}' if name == 'guided' else 'none'} guided: "
                    f"{r['tokens_per_second']:7.1f} tokens/s, first token p50 "
                    f"{r['ttft_p50']:.3f} s",
                    flush=True,
                )
    finally:
        engine.stop()
    return results


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--engines", action="store_true", help="the engines side by side in one process"
    )
    parser.add_argument(
        "--adapters", type=int, default=0, help="N LoRA adapters at once against one merged model"
    )
    parser.add_argument(
        "--guided", type=float, default=0.0, help="the fraction of clients guided, against none"
    )
    args = parser.parse_args(argv)
    if args.engines or args.adapters or args.guided:
        side_by_side = engines_side_by_side
        if args.adapters or args.guided:
            side_by_side = adapters_vs_merged if args.adapters else guided_vs_not
        results = side_by_side(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return

    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flaxlm.main",
                "--gin_file=gin/runs/serve.gin",
                f"--gin.CHECKPOINT='{tmp}'",
                f"--gin.PORT={port}",
                f"--gin.MAX_BATCH_SIZE={args.max_batch_size}",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(url + "/health", timeout=2).close()
                    break
                except OSError:
                    time.sleep(0.5)
            post(url, {"prompt": "warm up", "max_tokens": args.max_tokens, "temperature": 0})
            results = {c: load(url, c, args.seconds, args.max_tokens) for c in args.clients}
        finally:
            server.terminate()
            server.wait(timeout=30)

    date = datetime.date.today().isoformat()
    command = "python benchmarks/serve.py " + shlex.join(argv)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, cpu"
    for clients, r in results.items():
        print(
            f"{clients:3d} clients: {r['requests_per_second']:7.2f} requests/s, "
            f"{r['tokens_per_second']:8.1f} tokens/s ({r['requests']} requests)"
        )
    cells = " | ".join(
        f"{r['requests_per_second']:.2f} / {r['tokens_per_second']:.0f}" for r in results.values()
    )
    print(
        f"| {date} | `{command.strip()}` | {machine} | GPT-J 4x256, {args.max_tokens} new tokens, "
        f"batches <= {args.max_batch_size} | {cells} |"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": date, "command": command, "results": results}, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
