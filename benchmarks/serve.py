"""Serving throughput: requests/s and tokens/s of `python -m flaxlm.main
--gin_file=gin/runs/serve.gin` at 1, 4 and 16 concurrent clients.

A random HF GPT-J (4 layers, width 256, byte-sized vocabulary, no EOS so every request
decodes `--max-tokens` tokens) is saved and served by a subprocess on 127.0.0.1; each
client thread sends greedy completion requests back to back for `--seconds` seconds. The
server batches requests that arrive within BATCH_WAIT_MS of each other.

    python benchmarks/serve.py                 # the recorded configuration
    python benchmarks/serve.py --seconds 5 --clients 1 4
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


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

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
