"""An HTTP server for a checkpoint: OpenAI-style completions (streamed as server-sent
events), health and model listing, and a small page at `/` to try it.

One engine thread owns the model. Requests wait in a queue; the engine takes the first and
every other that arrives within `batch_wait_ms` (up to `max_batch_size`), decodes them as
one batch step by step on the mesh (KV cache, per-row temperature and top-p), and hands each
request its tokens as they come. HTTP threads only parse, validate and stream.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
import seqio
from etils import epath

from flaxlm import decoding, evaluation
from flaxlm.models.base import BaseModel, EncoderDecoderModel
from flaxlm.partitioning import Partitioner

MAX_LOGPROBS = 5
BUCKET = 32  # prompt and generation lengths are rounded up to this (fewer compiles)


class BadRequest(ValueError):
    """A request the server answers with 400 and a message."""


# ---------------------------------------------------------------------------- requests


@dataclasses.dataclass
class Completion:
    """One prompt's decoding job and the channel its events go back through."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    logprobs: int | None
    seed: int
    events: queue.Queue = dataclasses.field(default_factory=queue.Queue)


_FIELDS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "prompt": ((str, list), "a string or a list of strings"),
    "max_tokens": (int, "an integer"),
    "temperature": ((int, float), "a number"),
    "top_p": ((int, float), "a number"),
    "stop": ((str, list, type(None)), "a string, a list of strings or null"),
    "stream": (bool, "a boolean"),
    "logprobs": ((int, type(None)), "an integer or null"),
    "echo": (bool, "a boolean"),
    "seed": ((int, type(None)), "an integer or null"),
    "n": (int, "an integer"),
    "model": (str, "a string"),
    "user": (str, "a string"),
}


def parse_request(body: bytes, max_positions: int | None, max_tokens_limit: int) -> dict:
    """The validated fields of a completions request body; BadRequest names what is wrong."""
    try:
        request = json.loads(body or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"The body is not valid JSON: {e}.") from e
    if not isinstance(request, dict):
        raise BadRequest("The body must be a JSON object.")
    for key, value in request.items():
        if key not in _FIELDS:
            raise BadRequest(f"Unknown field {key!r}; supported: {sorted(_FIELDS)}.")
        types, what = _FIELDS[key]
        if not isinstance(value, types) or (
            isinstance(value, bool) and bool not in _as_tuple(types)
        ):
            raise BadRequest(f"Field {key!r} must be {what}, got {json.dumps(value)[:80]}.")
    prompt = request.get("prompt")
    if prompt is None:
        raise BadRequest("Field 'prompt' is required.")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("Field 'prompt' must be a string or a non-empty list of strings.")
    max_tokens = request.get("max_tokens", 16)
    if not 1 <= max_tokens <= max_tokens_limit:
        raise BadRequest(f"max_tokens must be between 1 and {max_tokens_limit}, got {max_tokens}.")
    temperature = float(request.get("temperature", 1.0))
    if not 0.0 <= temperature <= 2.0:
        raise BadRequest(f"temperature must be between 0 and 2, got {temperature}.")
    top_p = float(request.get("top_p", 1.0))
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.")
    stop = request.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of at most 4 of them.")
    logprobs = request.get("logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}.")
    if request.get("n", 1) != 1:
        raise BadRequest("Only n=1 is supported; send the prompt several times instead.")
    return {
        "prompts": prompts,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stop": stop,
        "stream": request.get("stream", False),
        "logprobs": logprobs,
        "echo": request.get("echo", False),
        "seed": request.get("seed") or 0,
        "max_positions": max_positions,
    }


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


# ---------------------------------------------------------------------------- engine


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Engine:
    """Decodes queued completions in dynamic batches on one thread."""

    def __init__(
        self,
        model: BaseModel,
        params: Any,
        partitioner: Partitioner,
        vocabulary: seqio.Vocabulary,
        *,
        max_batch_size: int = 8,
        batch_wait_ms: float = 10.0,
    ):
        self.model = model
        self.params = params
        self.partitioner = partitioner
        self.vocabulary = vocabulary
        self.max_batch_size = max_batch_size
        self.batch_wait = batch_wait_ms / 1000.0
        self.queue: queue.Queue[Completion] = queue.Queue()
        self._prefill = jax.jit(model.prefill, static_argnums=(3,))
        self._step = jax.jit(model.decode_step, static_argnums=(4,), donate_argnums=(3,))
        self._select = jax.jit(_select, static_argnums=(4,))
        self.batches = 0
        self._thread = threading.Thread(target=self._loop, name="flaxlm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, completion: Completion) -> None:
        self.queue.put(completion)

    def _loop(self) -> None:
        while True:
            batch = [self.queue.get()]
            deadline = time.monotonic() + self.batch_wait
            while len(batch) < self.max_batch_size:
                remaining = deadline - time.monotonic()
                try:
                    batch.append(self.queue.get(timeout=max(remaining, 0.0)))
                except queue.Empty:
                    break
            try:
                self.decode(batch)
            except Exception as e:  # noqa: BLE001 - report to the waiting requests, keep serving
                for c in batch:
                    c.events.put(("error", f"{type(e).__name__}: {e}"))

    def decode(self, batch: Sequence[Completion]) -> None:
        """Decodes every completion of the batch, emitting ("token", id, logprob, top) per
        new token and ("done", finish_reason) at the end."""
        self.batches += 1
        rows = self.max_batch_size
        prompt_len = _round_up(max(len(c.prompt_ids) for c in batch), BUCKET)
        new = _round_up(max(c.max_tokens for c in batch), BUCKET)
        config = decoding.DecodingConfig(max_new_tokens=new)
        inputs = np.zeros((rows, prompt_len), np.int32)
        lengths = np.ones((rows,), np.int32)
        for i, c in enumerate(batch):
            inputs[i, : len(c.prompt_ids)] = c.prompt_ids
            lengths[i] = len(c.prompt_ids)
        temperature = np.zeros((rows,), np.float32)
        top_p = np.ones((rows,), np.float32)
        seeds = np.zeros((rows,), np.uint32)
        for i, c in enumerate(batch):
            temperature[i], top_p[i], seeds[i] = c.temperature, c.top_p, c.seed
        with self.partitioner.context():
            placed = [decoding._global_array(x, self.partitioner) for x in (inputs, lengths)]
            logits, state = self._prefill(self.params, *placed, config)
            keys = jax.vmap(jax.random.PRNGKey)(jnp.asarray(seeds))
            active = list(range(len(batch)))
            counts = [0] * len(batch)
            for t in range(new):
                step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, t)
                token, token_lp, top_ids, top_lps = (
                    np.asarray(x)
                    for x in self._select(
                        logits,
                        step_keys,
                        jnp.asarray(temperature),
                        jnp.asarray(top_p),
                        MAX_LOGPROBS,
                    )
                )
                still = []
                for i in active:
                    c = batch[i]
                    tok = int(token[i])
                    if tok in self.model.eos_ids:
                        c.events.put(("done", "stop"))
                        continue
                    top = list(zip(top_ids[i].tolist(), top_lps[i].tolist()))
                    c.events.put(("token", tok, float(token_lp[i]), top))
                    counts[i] += 1
                    if counts[i] >= c.max_tokens:
                        c.events.put(("done", "length"))
                    else:
                        still.append(i)
                active = still
                if not active or t + 1 == new:
                    break
                logits, state = self._step(
                    self.params, jnp.asarray(token), jnp.int32(t), state, config
                )
            for i in active:
                batch[i].events.put(("done", "length"))


def _select(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    num_top: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per row: greedy where temperature is 0, else a sample from the top-p nucleus of
    softmax(logits / temperature); the token's log-probability and the `num_top` most
    likely tokens with theirs (of the model's distribution, before temperature)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    filtered = decoding.filter_logits(scaled, top_p=top_p[:, None])
    sampled = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, filtered)
    token = jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    token_lp = jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0]
    top_lps, top_ids = jax.lax.top_k(log_probs, num_top)
    return token, token_lp, top_ids, top_lps


# ---------------------------------------------------------------------------- streaming text


class TextStream:
    """Turns a completion's token events into text deltas, honouring stop strings."""

    def __init__(self, vocabulary: seqio.Vocabulary, stop: Sequence[str]):
        self.vocabulary = vocabulary
        self.stop = list(stop)
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []

    def add(self, token: int, logprob: float, top: Sequence[tuple[int, float]]) -> str:
        """The new text this token makes final (may be ''); sets `stopped` at a stop string."""
        before = self.vocabulary.decode(self.ids)
        self.ids.append(token)
        text = self.vocabulary.decode(self.ids)
        self.tokens.append(text[len(before) :])
        self.token_logprobs.append(logprob)
        self.top_logprobs.append({self.vocabulary.decode([i]): lp for i, lp in top})
        for s in self.stop:
            at = text.find(s, max(0, len(self.sent) - len(s)))
            if at != -1:
                self.stopped = True
                text = text[:at]
        if not self.stopped and text.endswith("\ufffd"):
            return ""  # part of a multi-byte character: wait for the rest
        final = len(text) if self.stopped else len(text) - self._stop_prefix(text)
        delta = text[len(self.sent) : final]
        self.sent = text[:final] if final > len(self.sent) else self.sent
        return delta

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of `text` that may begin a stop string (held back)."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """Whatever text is still held back (an unfinished character) once decoding ends."""
        if self.stopped:
            return ""
        text = self.vocabulary.decode(self.ids)
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def logprobs(self, count: int | None) -> dict[str, Any] | None:
        if count is None:
            return None
        offsets, position = [], 0
        for token in self.tokens:
            offsets.append(position)
            position += len(token)
        top = [dict(sorted(t.items(), key=lambda kv: -kv[1])[:count]) for t in self.top_logprobs]
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": top if count else None,
            "text_offset": offsets,
        }


# ---------------------------------------------------------------------------- HTTP


class Server:
    """The HTTP front: parses requests, feeds the engine, writes JSON or SSE."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        max_tokens_limit: int = 512,
        request_timeout_s: float = 600.0,
    ):
        self.engine = engine
        self.model_name = model_name
        self.max_tokens_limit = max_tokens_limit
        self.request_timeout = request_timeout_s
        self.max_positions = engine.model.position_limit()
        if isinstance(engine.model, EncoderDecoderModel):
            self.max_positions = None  # relative positions: no hard limit
        handler = _make_handler(self)
        self.httpd = _HTTPServer((host, port), handler)

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def encode(self, text: str) -> list[int]:
        return evaluation._model_ids(
            self.engine.model, self.engine.vocabulary, text, is_target=False
        )

    def completions(self, request: dict) -> tuple[list[Completion], list[list[int]]]:
        jobs, prompt_ids = [], []
        for prompt in request["prompts"]:
            ids = self.encode(prompt)
            if not ids:
                raise BadRequest("The prompt is empty after tokenization.")
            limit = self.max_positions
            if limit is not None and len(ids) + request["max_tokens"] > limit:
                raise BadRequest(
                    f"The prompt has {len(ids)} tokens; with max_tokens={request['max_tokens']} "
                    f"that is beyond the model's {limit} positions."
                )
            prompt_ids.append(ids)
            jobs.append(
                Completion(
                    ids,
                    request["max_tokens"],
                    request["temperature"],
                    request["top_p"],
                    request["stop"],
                    request["logprobs"],
                    request["seed"],
                )
            )
        return jobs, prompt_ids

    def serve_forever(self) -> None:
        self.engine.start()
        self.httpd.serve_forever()


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # many clients connecting at once are queued, not reset


_PAGE = epath.Path(__file__).parent / "serve_page.html"


def _make_handler(server: Server) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "flaxlm"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # quiet; the engine prints its own progress

        def _json(self, code: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, code: int, message: str) -> None:
            kind = "invalid_request_error" if code == 400 else "server_error"
            self._json(code, {"error": {"message": message, "type": kind, "code": code}})

        def do_GET(self) -> None:  # noqa: N802
            path = self.path.split("?")[0]
            if path == "/health":
                self._json(200, {"status": "ok", "batches": server.engine.batches})
            elif path == "/v1/models":
                self._json(
                    200,
                    {
                        "object": "list",
                        "data": [
                            {"id": server.model_name, "object": "model", "owned_by": "flaxlm"}
                        ],
                    },
                )
            elif path in ("/", "/index.html"):
                body = _PAGE.read_text().replace("{{MODEL}}", server.model_name).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self._error(404, f"No such path {path!r}; try POST /v1/completions.")

        def do_POST(self) -> None:  # noqa: N802
            if self.path.split("?")[0] != "/v1/completions":
                self._error(404, f"No such path {self.path!r}; try POST /v1/completions.")
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                request = parse_request(
                    self.rfile.read(length), server.max_positions, server.max_tokens_limit
                )
                jobs, prompt_ids = server.completions(request)
            except BadRequest as e:
                self._error(400, str(e))
                return
            except ValueError as e:
                self._error(400, f"Bad request: {e}")
                return
            for job in jobs:
                server.engine.submit(job)
            try:
                if request["stream"]:
                    self._stream(request, jobs)
                else:
                    self._complete(request, jobs, prompt_ids)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client left; the engine finishes the rows on its own

        def _events(self, job: Completion, stream: TextStream) -> Any:
            """Yields text deltas until the job is done; returns the finish reason."""
            while True:
                event = job.events.get(timeout=server.request_timeout)
                if event[0] == "error":
                    raise RuntimeError(event[1])
                if event[0] == "done":
                    return event[1]
                if stream.stopped:
                    continue  # past a stop string: drain the rest
                delta = stream.add(*event[1:])
                yield delta

        def _complete(
            self, request: dict, jobs: list[Completion], prompt_ids: list[list[int]]
        ) -> None:
            choices, completion_tokens = [], 0
            try:
                for index, (prompt, job) in enumerate(zip(request["prompts"], jobs)):
                    stream = TextStream(server.engine.vocabulary, request["stop"])
                    gen = self._events(job, stream)
                    text = ""
                    while True:
                        try:
                            text += next(gen)
                        except StopIteration as done:
                            reason = done.value
                            break
                    text += stream.flush()
                    reason = "stop" if stream.stopped else reason
                    completion_tokens += len(stream.ids)
                    choices.append(
                        {
                            "text": (prompt if request["echo"] else "") + text,
                            "index": index,
                            "logprobs": stream.logprobs(request["logprobs"]),
                            "finish_reason": reason,
                        }
                    )
            except (RuntimeError, queue.Empty) as e:
                self._error(500, f"Decoding failed: {e}")
                return
            prompt_tokens = sum(len(p) for p in prompt_ids)
            self._json(
                200,
                {
                    "id": f"cmpl-{uuid.uuid4().hex}",
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": server.model_name,
                    "choices": choices,
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens,
                    },
                },
            )

        def _stream(self, request: dict, jobs: list[Completion]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

            def send(index: int, text: str, reason: str | None, logprobs: Any = None) -> None:
                chunk = {
                    "id": ident,
                    "object": "text_completion",
                    "created": created,
                    "model": server.model_name,
                    "choices": [
                        {
                            "text": text,
                            "index": index,
                            "logprobs": logprobs,
                            "finish_reason": reason,
                        }
                    ],
                }
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()

            try:
                for index, (prompt, job) in enumerate(zip(request["prompts"], jobs)):
                    stream = TextStream(server.engine.vocabulary, request["stop"])
                    if request["echo"]:
                        send(index, prompt, None)
                    gen = self._events(job, stream)
                    while True:
                        try:
                            delta = next(gen)
                        except StopIteration as done:
                            reason = "stop" if stream.stopped else done.value
                            rest = stream.flush()
                            if rest:
                                send(index, rest, None)
                            break
                        if delta:
                            logprobs = None
                            if request["logprobs"] is not None:
                                logprobs = {
                                    "tokens": stream.tokens[-1:],
                                    "token_logprobs": stream.token_logprobs[-1:],
                                }
                            send(index, delta, None, logprobs)
                    send(index, "", reason)
            except (RuntimeError, queue.Empty) as e:
                self.wfile.write(f"data: {json.dumps({'error': {'message': str(e)}})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler


# ---------------------------------------------------------------------------- run


@gin.configurable
def serve(
    *,
    checkpoint: str = gin.REQUIRED,
    host: str = "127.0.0.1",
    port: int = 8000,
    model: BaseModel | None = None,
    partitioner: Partitioner | None = None,
    vocabulary: seqio.Vocabulary | None = None,
    model_name: str | None = None,
    max_batch_size: int = 8,
    batch_wait_ms: float = 10.0,
    max_tokens_limit: int = 512,
    step: int | None = None,
    ready: Callable[[Server], None] | None = None,
) -> None:
    """Run function: serves `checkpoint` (a flaxlm MODEL_DIR or an HF directory) over HTTP
    until interrupted: POST /v1/completions, GET /health, GET /v1/models, and a page at /.

    Requests that arrive within `batch_wait_ms` of each other decode together (up to
    `max_batch_size` prompts per batch)."""
    partitioner = partitioner or Partitioner()
    model, params, step = evaluation.load_model_and_params(checkpoint, partitioner, model, step)
    vocabulary = vocabulary or evaluation._checkpoint_vocabulary(checkpoint)
    vocabulary = vocabulary or seqio.ByteVocabulary()
    engine = Engine(
        model,
        params,
        partitioner,
        vocabulary,
        max_batch_size=max_batch_size,
        batch_wait_ms=batch_wait_ms,
    )
    name = model_name or epath.Path(checkpoint).name
    server = Server(engine, name, host=host, port=port, max_tokens_limit=max_tokens_limit)
    print(
        f"Serving {name} (step {step}, {type(model.config).__name__}) on {server.address} "
        f"with batches of up to {max_batch_size}; open {server.address}/ to try it.",
        flush=True,
    )
    if ready is not None:
        ready(server)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("Stopped.", flush=True)
    finally:
        server.httpd.server_close()
