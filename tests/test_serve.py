"""The HTTP server as users run it: a subprocess on 127.0.0.1 serving a tiny HF model."""

import concurrent.futures
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import seqio

from flaxlm.checkpoints import run_dir
from flaxlm.inference import generation
from flaxlm.inference.sampling import Sampling
from flaxlm.models.row_start import SEQIO_START
from flaxlm.parallel import platforms
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs.serve import api, settings
from flaxlm.runs.serve.engine import Engine
from tests import cdp, zygote

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


def server_env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = platforms.host_device_flags(8)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def server_process(tmp_path_factory, repo_dir, trained_gptj):
    """`python -m flaxlm.main --gin_file=gin/runs/serve.gin` over the tiny trained GPT-J:
    (process, url, log path). At the end, SIGTERM stops it with exit status 0 (unless a test
    has stopped it already)."""
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    log_path = tmp / "server.log"
    log = open(log_path, "w+")
    proc = zygote.start(
        [
            "--gin_file=gin/runs/serve.gin",
            f"--gin.CHECKPOINT='{trained_gptj}'",
            f"--gin.PORT={port}",
            "--gin.MAX_BATCH_SIZE=8",
            "--gin.BATCH_WAIT_MS=50",
            "--gin.Partitioner.mesh_shape=(1, 2, 4)",
            # The engine's settings as a user tunes them (vLLM's --max-model-len).
            "--gin.MAX_MODEL_LEN=600",
            "--gin.DECODE_STEPS=4",
            "--gin.PREFILL_ROWS=3",
        ],
        cwd=repo_dir,
        env=server_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # a crash ends the wait at once (poll)
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
    yield proc, url, log_path
    if proc.poll() is None:
        proc.terminate()
    try:
        returncode = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        returncode = "a hang"
    log.close()
    assert returncode == 0, (
        f"SIGTERM ended the server with {returncode}:\n{log_path.read_text()[-3000:]}"
    )


@pytest.fixture(scope="module")
def server(server_process, trained_gptj):
    _, url, _ = server_process
    model, params, *_ = run_dir.load_model_and_params(trained_gptj, Partitioner((1, 8, 1)))
    return url, model, params


def expected_text(model, params, prompt, max_tokens):
    ids = np.asarray([VOCAB.encode(prompt)])
    tokens = generation.generate(model, params, {"inputs": ids}, max_new_tokens=max_tokens)[
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
        assert response["usage"]["prompt_tokens"] == len(
            generation.prompt_ids(model, VOCAB, prompt, SEQIO_START)
        )
        streamed, _ = stream_text(url, payload)
        assert streamed == choice["text"]
    # Sampled with a seed: the same text streamed (token by token) and not.
    sampled = {"prompt": "x = ", "max_tokens": 24, "temperature": 1.0, "seed": 3}
    text = json.loads(post(url, sampled)[1])["choices"][0]["text"]
    assert json.loads(post(url, sampled)[1])["choices"][0]["text"] == text
    streamed, chunks = stream_text(url, sampled)
    assert streamed == text
    assert chunks > 3  # the text arrived in several events
    # echo, logprobs, a list of prompts, stop strings (echo with logprobs, the prompt's
    # log-probs too: tests/test_openai_api.py).
    status, body = post(
        url, {"prompt": ["ab", "cd"], "max_tokens": 5, "temperature": 0, "echo": True}
    )
    choices = json.loads(body)["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["text"] == "ab" + expected_text(model, params, "ab", 5)
    status, body = post(url, {"prompt": "cd", "max_tokens": 5, "temperature": 0, "logprobs": 2})
    logprobs = json.loads(body)["choices"][0]["logprobs"]
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


# Request bodies the server refuses with 400, each with what the message names.
BAD_REQUESTS = [
    (b"{not json", "not valid JSON"),
    ({"prompt": [1, True]}, "list of token ids"),
    ({"prompt": [[5], []]}, "list of token ids"),
    ({"prompt": [9999999]}, "outside the model's vocabulary"),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature must be a finite number, got NaN"),
    (b'{"prompt": "hi", "top_p": Infinity}', "top_p must be a finite number"),
    (b'{"prompt": "hi", "temperature": 1e999}', "temperature must be a finite number"),
    (b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}", "temperature must be a finite"),
    (b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", "not valid JSON"),
    (b"[" * 100_000, "not valid JSON"),
    (b'{"prompt": "\\ud800"}', "'prompt' is not valid Unicode"),
    ({"prompt": "hi", "temperature": 0.5, "seed": -5}, "seed must be between 0 and 2**32 - 1"),
    ({"prompt": "hi", "temperature": 0.5, "seed": 2**40}, "seed must be between 0 and 2**32 - 1"),
    ({"prompt": "hi", "seed": 1.5}, "'seed' must be an integer or null"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2**70}, "max_tokens"),
    ({"prompt": "x" * 2040, "max_tokens": 10}, "positions"),
    ({"prompt": []}, "non-empty list"),
    ({"prompt": "hi", "temperature": "hot"}, "'temperature' must be a number"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature must be between 0 and 2"),
    ({"prompt": "hi", "temperature": -1}, "temperature must be between 0 and 2"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "logprobs": 6}, "logprobs must be between 0 and 5"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs must be between 0 and 5"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop must be"),
    ({"prompt": "hi", "stop": [""]}, "stop must be"),
    ({"prompt": "hi", "n": 0}, "n must be at least 1"),
    ({"prompt": ["a"] * 9, "n": 2}, "n x prompts at most 16"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "only allowed when stream"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias maps token ids"),
    ({"prompt": "hi", "stream": "yes"}, "'stream' must be a boolean"),
    ({"prompt": 42}, "'prompt' must be"),
    ({"max_tokens": 3}, "'prompt' is required"),
    ({"prompt": "hi", "frobnicate": 1}, "Unknown field 'frobnicate'"),
    ([1, 2], "JSON object"),
]
# Refused by the served model's limit: its MAX_MODEL_LEN (600, below the engine's 2048 slots).
SERVED_LIMITS = [({"prompt": "x" * 100, "max_tokens": 512}, "max_model_len of 600 tokens")]


# Refused where the model reads nothing before a prompt (the server may prefix a start token).
EMPTY_PROMPTS = [
    ({"prompt": "", "max_tokens": 2}, "empty after tokenization"),
    ({"prompt": ["ok", ""], "max_tokens": 2}, "empty after tokenization"),
]


@pytest.mark.slow
def test_bad_requests_get_400_alone_and_their_batch_mates_are_served(server):
    url, model, params = server
    good = [{"prompt": f"good {i}: ", "max_tokens": 6, "temperature": 0} for i in range(3)]
    bad = BAD_REQUESTS + SERVED_LIMITS
    requests = [payload for payload, _ in bad] + good
    # All at once: the good requests decode in the batches the bad ones would have joined.
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda payload: post(url, payload), requests))
    for (payload, message), (status, body) in zip(bad, answers):
        assert status == 400, (str(payload)[:80], body)
        assert message in json.loads(body)["error"]["message"], (str(payload)[:80], body)
    for payload, (status, body) in zip(good, answers[len(bad) :]):
        assert status == 200, body
        text = json.loads(body)["choices"][0]["text"]
        assert text == expected_text(model, params, payload["prompt"], 6)
    status, body = post(url, {"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert status == 200, body


@pytest.mark.slow
def test_a_job_the_engine_cannot_prepare_fails_alone(server):
    """Past the API's checks (a job built some other way), a job the batch's arrays cannot
    hold gets its error and the rest of its batch is decoded."""
    url, model, params = server
    engine = Engine(model, params, Partitioner((1, 8, 1)), VOCAB)

    def job(prompt_ids, seed=0):
        return api.Completion(prompt_ids, 3, Sampling(), [], None, seed)

    good = [job(VOCAB.encode("good 0: ")), job(VOCAB.encode("good 1: "))]
    bad = [job(VOCAB.encode("hi"), seed=-5), job([engine.vocab_size]), job([])]
    engine.decode([good[0], *bad, good[1]])
    for c in bad:
        assert c.events.get_nowait()[0] == "error" and c.events.empty()
    for prompt, c in zip(["good 0: ", "good 1: "], good):
        events = [c.events.get_nowait() for _ in range(c.events.qsize())]
        assert events[-1][0] == "done"
        text = VOCAB.decode([e[1] for e in events if e[0] == "token"])
        assert text == expected_text(model, params, prompt, 3)


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
    with pytest.raises(settings.BadRequest, match="'max_tokens' must be an integer"):
        api.parse_request(b'{"prompt": "a", "max_tokens": true}', None, 16)
    with pytest.raises(settings.BadRequest, match="between 1 and 16"):
        api.parse_request(b'{"prompt": "a", "max_tokens": 17}', None, 16)
    for payload, message in BAD_REQUESTS + EMPTY_PROMPTS:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        try:
            parsed = api.parse_request(body, 2048, 512)
            for prompt in parsed["prompts"]:
                ids = prompt if isinstance(prompt, list) else VOCAB.encode(prompt)
                api.check_prompt_ids(ids, parsed["max_tokens"], 2048, 259)
        except settings.BadRequest as e:
            assert message in str(e), (str(payload)[:80], str(e))
        else:
            pytest.fail(f"{str(payload)[:80]} was accepted")
    with pytest.raises(
        settings.BadRequest, match=r"token ids \[300\] outside .* vocabulary of 259"
    ):
        api.check_prompt_ids([5, 300], 1, 2048, 259)
    parsed = api.parse_request(
        b'{"prompt": ["a", "b"], "stop": "\\n", "seed": 4294967295}', None, 16
    )
    assert parsed["prompts"] == ["a", "b"] and parsed["stop"] == ["\n"]
    assert parsed["seed"] == 2**32 - 1


@pytest.mark.slow
def test_a_port_in_use_is_named_before_the_model_loads(tmp_path, repo_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "flaxlm.main",
                "--gin_file=gin/runs/serve.gin",
                # Never read: the port is taken before the checkpoint is looked at.
                f"--gin.CHECKPOINT='{tmp_path / 'no_checkpoint_here'}'",
                f"--gin.PORT={port}",
            ],
            cwd=repo_dir,
            env=server_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"error: port {port} is in use; set --gin.PORT" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "no_checkpoint_here" not in result.stderr


@pytest.mark.slow
def test_sigint_with_decodes_in_flight_cancels_them_and_exits_0(server_process, server):
    """Last in the module: it stops the server."""
    proc, url, log_path = server_process
    streams = []
    for i in range(4):
        connection = http.client.HTTPConnection(*url.removeprefix("http://").split(":"))
        body = {"prompt": f"in flight {i}: ", "max_tokens": 500, "temperature": 0, "stream": True}
        connection.request("POST", "/v1/completions", json.dumps(body))
        streams.append(connection.getresponse())
    # Every request is decoding once its first token has arrived.
    firsts = [response.readline() + response.readline() for response in streams]
    proc.send_signal(signal.SIGINT)
    returncode = proc.wait(timeout=120)
    log = log_path.read_text()
    assert returncode == 0, log[-3000:]
    for bad in ("Fatal Python error", "terminate called", "Traceback"):
        assert bad not in log, log[-3000:]
    assert "SIGINT: stopping." in log and "Stopped." in log, log[-3000:]
    ends = []
    for first, response in zip(firsts, streams):
        events = (first + response.read()).decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""], events[-3:]
        ends.append(json.loads(events[-3][len("data: ") :]))
    cancelled = [e for e in ends if "error" in e]
    assert cancelled, ends  # (a stream that reached EOS first ends as usual)
    for end in cancelled:
        assert end["error"] == {
            "message": "The server is shutting down.",
            "type": "server_error",
            "param": None,
            "code": None,
        }
