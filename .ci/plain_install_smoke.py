"""Every shipped Gin file in gin/, run for a step or two by `python -m flaxlm.main` in the
Python this script runs under: `.ci/run` runs it in a venv of `pip install -e .` alone (no
extras), so a runtime dependency that setup.py's install_requires lacks fails CI. Then
`serve` answers one chat completion over an HF export of the chat model.

Standard library only. Usage: python .ci/plain_install_smoke.py [WORK_DIR]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# Standard library only: each run forks from a Python that imported TensorFlow, seqio and JAX
# once (flaxlm and everything else it needs are imported afresh by each run).
from tests import zygote  # noqa: E402

SHORT = [
    "--gin.TRAIN_STEPS=1",
    "--gin.WARMUP_STEPS=0",
    "--gin.EVAL_PERIOD=0",
    "--gin.LOG_PERIOD=1",
    "--gin.CHECKPOINT_PERIOD=1",
    "--gin.BATCH_SIZE=8",
]
# What is checked is what runs, not how fast: XLA's quick compiles (as the tests use).
FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
    "--xla_cpu_use_fusion_emitters=false"
)
PARALLEL = 2  # runs at a time
LM = ["--gin.TASK_FEATURE_LENGTHS={'targets': 64}"]


def runs(work: str) -> list[tuple[str, list[str]]]:
    """(Gin file, its settings); the first two in order, before the rest (finetune_hf and
    serve start from chat_sft's export)."""
    d = lambda name: f"--gin.MODEL_DIR='{os.path.join(work, name)}'"  # noqa: E731
    hf = os.path.join(work, "chat_hf")
    return [
        ("chat_sft.gin", [d("chat_sft"), "--gin.MAX_LENGTH=64"]),
        ("runs/export_hf.gin", [d("chat_sft"), f"--gin.HF_OUT_DIR='{hf}'"]),
        ("finetune_hf.gin", [d("finetune_hf"), f"--gin.INIT_FROM_HF='{hf}'", *LM]),
        ("dpo.gin", [d("dpo"), "--gin.MAX_LENGTH=32"]),
        ("orpo.gin", [d("orpo"), "--gin.MAX_LENGTH=32"]),
        ("gptj_pretrain.gin", [d("gptj_pretrain"), *LM]),
        ("gptj_fcm_pretrain.gin", [d("gptj_fcm"), *LM]),
        ("gpt2_alibi_zero1.gin", [d("gpt2_alibi"), *LM]),
        ("opt_pretrain.gin", [d("opt"), *LM]),
        ("llama_finetune.gin", [d("llama_finetune"), *LM]),
        (
            "jsonl_finetune.gin",
            [
                d("jsonl"),
                "--gin.JSONL_TRAIN='data/instructions/train.jsonl'",
                "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 16}",
            ],
        ),
        ("t5_finetune.gin", [d("t5")]),
        (
            "llama_lora.gin",
            [
                d("llama_lora"),
                f"--gin.OUTPUT_DIR='{os.path.join(work, 'llama_lora_generations')}'",
                "--gin.MAX_NEW_TOKENS=2",
            ],
        ),
        (
            "grpo.gin",
            [
                d("grpo"),
                f"--gin.SFT_DIR='{os.path.join(work, 'grpo_sft')}'",
                "--gin.SFT_STEPS=1",
                "--gin.grpo.grpo.total_steps=1",
                "--gin.grpo.grpo.checkpoint_period=1",
            ],
        ),
    ]


def flaxlm_main(gin_file: str, settings: list[str]):
    """`python -m flaxlm.main --gin_file=gin/<gin_file> <settings>`, its output piped."""
    args = [f"--gin_file=gin/{gin_file}", *settings]
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}"}
    return zygote.start(args, REPO, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def check_runs(planned: list[tuple[str, list[str]]], work: str) -> None:
    """Runs `planned`, `PARALLEL` at a time; exits naming the first that fails."""
    running: list[tuple[str, Any, float]] = []
    todo = list(planned)
    while todo or running:
        while todo and len(running) < PARALLEL:
            gin_file, settings = todo.pop(0)
            settings = settings if gin_file.startswith("runs/") else [*settings, *SHORT]
            running.append((gin_file, flaxlm_main(gin_file, settings), time.perf_counter()))
        gin_file, process, start = running.pop(0)
        out, err = process.communicate(timeout=900)
        if process.returncode != 0:
            for _, other, _ in running:
                other.kill()
            sys.exit(
                f"FAILED: gin/{gin_file} exited {process.returncode}\n{out[-2000:]}{err[-4000:]}"
            )
        print(f"ok  gin/{gin_file} ({time.perf_counter() - start:.1f} s)", flush=True)


def check_serve(work: str) -> None:
    """`serve` over the HF export answers a chat completion (the chat template: jinja2), a
    guided one and a Responses API request."""
    start = time.perf_counter()
    settings = [f"--gin.CHECKPOINT='{os.path.join(work, 'chat_hf')}'", "--gin.PORT=0"]
    process = flaxlm_main("runs/serve.gin", settings)
    try:
        address = None
        for line in process.stdout:
            match = re.search(r" on (http://\S+) with batches", line)
            if match:
                address = match.group(1)
                break
        if address is None:
            sys.exit(f"FAILED: serve did not start\n{process.stderr.read()[-4000:]}")
        # A plain answer, then a guided one (structured outputs: llguidance).
        guided = {"structured_outputs": {"choice": ["yes", "no"]}}
        for extra in ({}, guided):
            request = urllib.request.Request(
                address + "/v1/chat/completions",
                data=json.dumps(
                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
                ).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=300) as response:
                message = json.load(response)["choices"][0]["message"]
            if message["role"] != "assistant" or extra and message["content"] not in ("yes", "no"):
                sys.exit(f"FAILED: serve answered {message}")
        # The Responses API (/v1/responses), its answer stored then retrieved.
        request = urllib.request.Request(
            address + "/v1/responses",
            data=json.dumps({"input": "hi", "max_output_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.load(response)
        with urllib.request.urlopen(f"{address}/v1/responses/{answer['id']}") as response:
            if json.load(response) != answer or answer["output"][0]["type"] != "message":
                sys.exit(f"FAILED: serve's /v1/responses answered {answer}")
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    took = time.perf_counter() - start
    print(f"ok  gin/runs/serve.gin: chat completions, plain and guided, a response ({took:.1f} s)")


def main() -> None:
    work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="flaxlm_smoke_")
    shipped = {f for f in os.listdir(os.path.join(REPO, "gin")) if f.endswith(".gin")}
    planned = runs(work)
    missing = shipped - {name for name, _ in planned}
    if missing:
        sys.exit(f"FAILED: .ci/plain_install_smoke.py does not run {sorted(missing)}")
    start = time.perf_counter()
    check_runs(planned[:1], work)
    check_runs(planned[1:2], work)
    hf = os.path.join(work, "chat_hf")  # the chat tokenizer goes with the export
    for name in os.listdir(os.path.join(REPO, "data/chat/tokenizer")):
        shutil.copy(os.path.join(REPO, "data/chat/tokenizer", name), hf)
    check_runs(planned[2:], work)
    check_serve(work)
    shutil.rmtree(work, ignore_errors=True)
    print(f"plain install: {len(planned) + 1} runs in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
