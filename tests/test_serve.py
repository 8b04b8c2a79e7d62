"""The HTTP server as users run it: a subprocess on 127.0.0.1 serving a tiny HF model."""

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import seqio

from flaxlm import inference, run_dir
from flaxlm.partitioning import Partitioner
from flaxlm.serve import api
from tests import cdp

HERE = os.path.dirname(os.path.abspath(__file__))
ARTIFACTS = os.environ.get("FLAXLM_TEST_ARTIFACTS", os.path.join(HERE, "..", "test-artifacts"))
VOCAB = seqio.ByteVocabulary()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, payload, timeout=120):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    request = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def stream_text(url, payload):
    status, body = post(url, {**payload, "stream": True})
    assert status == 200, body
    events = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    return "".join(c["choices"][0]["text"] for c in chunks), len(chunks)


@pytest.fixture(scope="module")
def server(tmp_path_factory, repo_dir, trained_gptj):
    """`python -m flaxlm.main --gin_file=gin/runs/serve.gin` over the tiny trained GPT-J."""
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    log = open(tmp / "server.log", "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flaxlm.main",
            "--gin_file=gin/runs/serve.gin",
            f"--gin.CHECKPOINT='{trained_gptj}'",
            f"--gin.PORT={port}",
            "--gin.MAX_BATCH_SIZE=8",
            "--gin.BATCH_WAIT_MS=50",
            "--gin.Partitioner.mesh_shape=(1, 2, 4)",
        ],
        cwd=repo_dir,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            proc.kill()
            pytest.fail(f"The server did not start:\n{log.read()[-3000:]}")
        time.sleep(0.5)
    model, params, _ = run_dir.load_model_and_params(trained_gptj, Partitioner((1, 8, 1)))
    yield url, model, params
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def expected_text(model, params, prompt, max_tokens):
    ids = np.asarray([VOCAB.encode(prompt)])
    tokens = inference.generate(model, params, {"inputs": ids}, max_new_tokens=max_tokens)[
        0
    ].tolist()
    out = []
    for t in tokens:
        if t in model.eos_ids:
            break
        out.append(t)
    return VOCAB.decode(out)


@pytest.mark.slow
def test_completions_equal_generate_and_streaming_equals_non_streaming(server):
    url, model, params = server
    with urllib.request.urlopen(url + "/v1/models") as r:
        assert json.load(r)["data"][0]["object"] == "model"
    for prompt in ("def main(", "The quick brown fox"):
        payload = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        status, body = post(url, payload)
        assert status == 200, body
        response = json.loads(body)
        (choice,) = response["choices"]
        assert choice["text"] == expected_text(model, params, prompt, 12)
        assert response["usage"]["prompt_tokens"] == len(VOCAB.encode(prompt))
        streamed, _ = stream_text(url, payload)
        assert streamed == choice["text"]
    # Sampled with a seed: the same text streamed (token by token) and not.
    sampled = {"prompt": "x = ", "max_tokens": 24, "temperature": 1.0, "seed": 3}
    text = json.loads(post(url, sampled)[1])["choices"][0]["text"]
    assert json.loads(post(url, sampled)[1])["choices"][0]["text"] == text
    streamed, chunks = stream_text(url, sampled)
    assert streamed == text
    assert chunks > 3  # the text arrived in several events
    # echo, logprobs, a list of prompts, stop strings.
    status, body = post(
        url,
        {"prompt": ["ab", "cd"], "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 2},
    )
    choices = json.loads(body)["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["text"] == "ab" + expected_text(model, params, "ab", 5)
    logprobs = choices[1]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["tokens"]) == 5
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    full = expected_text(model, params, "def main(", 12)
    stop = full[3:5]
    status, body = post(
        url, {"prompt": "def main(", "max_tokens": 12, "temperature": 0, "stop": stop}
    )
    choice = json.loads(body)["choices"][0]
    assert choice["text"] == full[: full.find(stop)] and choice["finish_reason"] == "stop"


@pytest.mark.slow
def test_ten_concurrent_clients_are_batched(server):
    url, model, params = server
    prompts = [f"item {i}: " for i in range(10)]

    def one(prompt):
        status, body = post(url, {"prompt": prompt, "max_tokens": 16, "temperature": 0})
        assert status == 200, body
        return json.loads(body)["choices"][0]["text"]

    one(prompts[0])  # compiled
    start = time.perf_counter()
    one(prompts[1])
    single = time.perf_counter() - start
    with urllib.request.urlopen(url + "/health") as r:
        batches_before = json.load(r)["batches"]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        texts = list(pool.map(one, prompts))
    together = time.perf_counter() - start
    with urllib.request.urlopen(url + "/health") as r:
        batches = json.load(r)["batches"] - batches_before
    assert texts == [expected_text(model, params, p, 16) for p in prompts]
    assert batches < 10  # requests shared decode batches
    print(f"one request {single:.3f}s; 10 concurrent {together:.3f}s in {batches} batches")


@pytest.mark.slow
def test_bad_requests_get_400_and_the_server_keeps_serving(server):
    url, model, params = server
    bad = [
        (b"{not json", "not valid JSON"),
        ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "x" * 2040, "max_tokens": 10}, "positions"),
        ({"prompt": "hi", "temperature": "hot"}, "'temperature' must be a number"),
        ({"prompt": "hi", "stream": "yes"}, "'stream' must be a boolean"),
        ({"prompt": 42}, "'prompt' must be"),
        ({"max_tokens": 3}, "'prompt' is required"),
        ({"prompt": "hi", "frobnicate": 1}, "Unknown field 'frobnicate'"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ([1, 2], "JSON object"),
    ]
    for payload, message in bad:
        status, body = post(
            url, payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        )
        assert status == 400, (payload, body)
        assert message in json.loads(body)["error"]["message"], (payload, body)
        status, body = post(url, {"prompt": "ok", "max_tokens": 2, "temperature": 0})
        assert status == 200, body


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # Chromium's pipe fds, then exec
def test_the_page_streams_a_completion_in_headless_chromium(server):
    url, model, params = server
    binary = cdp.chromium_binary()
    if binary is None:
        pytest.fail(
            "This test needs Chromium (Debian: apt-get install chromium); .ci/run installs it."
        )
    prompt = "def main("
    browser = cdp.Browser(f"{url}/?prompt=def%20main(&max_tokens=24&run=1", binary)
    try:
        seen = []
        for _ in range(240):
            state = browser.evaluate("document.body.dataset.state || ''")
            seen.append(browser.evaluate("document.getElementById('generated')?.textContent || ''"))
            if state in ("done", "error"):
                break
            time.sleep(0.25)
        os.makedirs(ARTIFACTS, exist_ok=True)
        browser.screenshot(os.path.join(ARTIFACTS, "serve_page.png"))
    finally:
        browser.close()
    assert state == "done", seen[-1]
    assert seen[-1] == expected_text(model, params, prompt, 24)
    assert os.path.getsize(os.path.join(ARTIFACTS, "serve_page.png")) > 1000


def test_request_validation_names_the_field():
    with pytest.raises(api.BadRequest, match="'max_tokens' must be an integer"):
        api.parse_request(b'{"prompt": "a", "max_tokens": true}', None, 16)
    with pytest.raises(api.BadRequest, match="between 1 and 16"):
        api.parse_request(b'{"prompt": "a", "max_tokens": 17}', None, 16)
    parsed = api.parse_request(b'{"prompt": ["a", "b"], "stop": "\\n"}', None, 16)
    assert parsed["prompts"] == ["a", "b"] and parsed["stop"] == ["\n"]
