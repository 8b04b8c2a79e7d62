"""The HTTP front: OpenAI-style completions (JSON, or server-sent events when `stream`),
health and model listing, and a small page at `/` to try it. HTTP threads only parse,
validate and stream; the engine thread decodes."""

from __future__ import annotations

import errno
import http.server
import json
import queue
import socket
import threading
import time
import uuid
from typing import Any

from etils import epath

from flaxlm.inference import generation
from flaxlm.models.base import EncoderDecoderModel
from flaxlm.runs.serve.api import BadRequest, Completion, check_prompt_ids, parse_request
from flaxlm.runs.serve.engine import Engine
from flaxlm.runs.serve.stream import TextStream


def listen(host: str, port: int) -> http.server.ThreadingHTTPServer:
    """The bound, listening socket of a server not yet answering (connections wait in its
    backlog): taken before the model loads, so a port in use fails at once, as a ValueError
    naming the setting to change."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"PORT must be an integer between 0 and 65535, got {port!r}.")
    try:
        return _HTTPServer((host, port), http.server.BaseHTTPRequestHandler)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} is in use; set --gin.PORT") from e
        raise ValueError(
            f"cannot listen on {host}:{port} ({e.strerror or e}); set --gin.HOST or --gin.PORT"
        ) from e


class Server:
    """The HTTP front: parses requests, feeds the engine, writes JSON or SSE."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        httpd: http.server.ThreadingHTTPServer,
        *,
        max_tokens_limit: int = 512,
        request_timeout_s: float = 600.0,
    ):
        """
        Args:
          httpd: the listening server from `listen()`; it answers with this Server's handler.
        """
        self.engine = engine
        self.model_name = model_name
        self.max_tokens_limit = max_tokens_limit
        self.request_timeout = request_timeout_s
        self.max_positions = engine.model.position_limit()
        if isinstance(engine.model, EncoderDecoderModel):
            self.max_positions = None  # relative positions: no hard limit
        self.httpd = httpd
        self.httpd.RequestHandlerClass = _make_handler(self)
        self._serving = threading.Thread(target=self.httpd.serve_forever, name="flaxlm-http")

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def encode(self, text: str) -> list[int]:
        return generation.prompt_ids(
            self.engine.model, self.engine.vocabulary, text, is_target=False
        )

    def completions(self, request: dict) -> tuple[list[Completion], list[list[int]]]:
        jobs, prompt_ids = [], []
        for prompt in request["prompts"]:
            ids = self.encode(prompt)
            check_prompt_ids(ids, request["max_tokens"], self.max_positions, self.engine.vocab_size)
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

    def start(self) -> None:
        """Starts the engine, then answers requests (on threads of their own)."""
        self.engine.start()
        self._serving.start()

    def stop(self) -> None:
        """Stops accepting connections, stops the engine after its current step (requests
        still decoding are answered as cancelled), lets every handler finish its answer,
        and closes the sockets."""
        if self._serving.ident is not None:
            self.httpd.shutdown()
            self._serving.join()
        self.engine.stop()
        self.httpd.stop_reading()
        self.httpd.server_close()  # joins the handler threads


class _HTTPServer(http.server.ThreadingHTTPServer):
    # Handler threads are joined by server_close() (none is cut off at exit); stop_reading()
    # first ends those still waiting for a request (an idle connection, a preconnect).
    daemon_threads = False
    block_on_close = True
    request_queue_size = 128  # many clients connecting at once are queued, not reset

    def __init__(self, *args: Any, **kwargs: Any):
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def stop_reading(self) -> None:
        """Shuts the reading side of every open connection: a handler waiting for a request
        sees it end; one writing its answer goes on."""
        with self._connections_lock:
            for connection in self._connections:
                try:
                    connection.shutdown(socket.SHUT_RD)
                except OSError:
                    pass  # the client has gone already


class _Failed(Exception):
    """A completion that ended without its text: the HTTP status and message to answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


_PAGE = epath.Path(__file__).parent / "page.html"


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
            kind = {400: "invalid_request_error", 503: "unavailable"}.get(code, "server_error")
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
                if length < 0:
                    raise BadRequest(f"Content-Length must not be negative, got {length}.")
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
                try:
                    event = job.events.get(timeout=server.request_timeout)
                except queue.Empty:
                    raise _Failed(500, "Decoding timed out.") from None
                if event[0] == "error":
                    raise _Failed(500, f"Decoding failed: {event[1]}")
                if event[0] == "cancelled":
                    raise _Failed(503, event[1])
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
            except _Failed as e:
                self._error(e.status, e.message)
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
            except _Failed as e:
                error = {"message": e.message, "code": e.status}
                self.wfile.write(f"data: {json.dumps({'error': error})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler
