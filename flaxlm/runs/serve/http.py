"""The HTTP front: OpenAI's completions, chat completions and responses (JSON, or
server-sent events when `stream`; stored responses read and deleted), health and model
listing, and a small page at `/` to try it. HTTP threads only parse, validate and stream;
the engine thread decodes.

The models served are the base, by its own name, and each LoRA adapter the engine holds by
its name (`/v1/models` lists them; a request's `model` picks one, none the base)."""

from __future__ import annotations

import http.server
import json
import queue
import threading
from typing import Any

from etils import epath

from flaxlm.data import vocabularies
from flaxlm.inference import generation
from flaxlm.inference.guides import Grammars
from flaxlm.models.base import EncoderDecoderModel
from flaxlm.models.row_start import RowStart
from flaxlm.runs.serve import guides, reasoning, tokenizer_api, tools
from flaxlm.runs.serve.answer import Answer, StreamedChoice, error_body
from flaxlm.runs.serve.api import (
    Completion,
    check_prompt_ids,
    parse_chat_request,
    parse_request,
    render_chat,
)
from flaxlm.runs.serve.engine import Engine
from flaxlm.runs.serve.response_answer import ResponseAnswer
from flaxlm.runs.serve.responses import KEPT, Responses
from flaxlm.runs.serve.settings import (
    BadRequest,
    Defaults,
    check_token_ids,
    held,
    sample_seeds,
)
from flaxlm.runs.serve.stream import TextStream


class Server:
    """The HTTP front: parses requests, feeds the engine, writes JSON or SSE."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        httpd: http.server.ThreadingHTTPServer,
        *,
        row_start: RowStart,
        max_tokens_limit: int = 512,
        request_timeout_s: float = 600.0,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        responses_kept: int = KEPT,
        max_model_len: int | None = None,
    ):
        """
        Args:
          httpd: the listening server from `sockets.listen()`; it answers with this
            Server's handler.
          row_start: what the checkpoint's training rows started with
            (`run_dir.Loaded.row_start`): a completion's prompt starts so.
          tool_call_parser: how a chat answer's tool calls are read (`tools.PARSERS`);
            None: requests offering tools with tool_choice 'auto' are refused.
          reasoning_parser: how a chat answer's reasoning is told from its content
            (`reasoning.PARSERS`); None: all of it is content.
          responses_kept: the stored responses (/v1/responses) kept in memory.
          max_model_len: the longest prompt plus completion served (None: the model's
            positions and the engine's slots per sequence decide).
        """
        tools.check_parser(tool_call_parser, reasoning_parser)
        reasoning.check_parser(reasoning_parser)
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_call_parser
        self.engine = engine
        self.model_name = model_name
        self.row_start = row_start
        # A request's `model` -> the engine's adapter index (0: the base).
        self.models = {model_name: 0}
        self.models.update({name: i + 1 for i, name in enumerate(engine.adapters)})
        self.max_tokens_limit = max_tokens_limit
        self.request_timeout = request_timeout_s
        # The longest prompt plus completion served (vLLM's max_model_len): the model's
        # positions (an encoder-decoder's relative ones have no hard limit), the engine's
        # slots per sequence and `max_model_len`, the smallest of them.
        limits = [engine.model.position_limit(), engine.sequence_limit, max_model_len]
        if isinstance(engine.model, EncoderDecoderModel):
            limits[0] = None
        self.max_positions = min((n for n in limits if n is not None), default=None)
        # Where a request leaves a sampling setting unset, the checkpoint's own choice.
        self.defaults = Defaults.from_generation_config(
            engine.model.generation_config, max_tokens_limit
        )
        tokenizer = getattr(engine.vocabulary, "tokenizer", None)
        self.special_ids = vocabularies.special_token_ids(tokenizer)
        self.added_vocab = getattr(tokenizer, "get_added_vocab", dict)()
        model = engine.model
        self.grammars = Grammars(engine.vocabulary, model.config.vocab_size, model.eos_ids)
        self.responses = Responses(responses_kept)
        self.httpd = httpd
        self.httpd.RequestHandlerClass = _make_handler(self)
        self._serving = threading.Thread(target=self.httpd.serve_forever, name="flaxlm-http")

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def model_list(self) -> dict[str, Any]:
        """GET /v1/models: the base, then each adapter with the base as its `parent` (as
        vLLM lists LoRA modules)."""
        data = []
        for name, index in self.models.items():
            model = {"id": name, "object": "model", "created": 0, "owned_by": "flaxlm"}
            data.append({**model, "parent": self.model_name} if index else model)
        return {"object": "list", "data": data}

    def adapter(self, request: dict) -> int:
        """The adapter index of the model a parsed request names (none: the base); an
        unknown name is a 404, as OpenAI answers it."""
        name = request["model"]
        if name is None:
            return 0
        if name not in self.models:
            raise BadRequest(
                f"The model `{name}` does not exist; GET /v1/models lists those served: "
                f"{list(self.models)}.",
                "model",
                status=404,
                code="model_not_found",
            )
        return self.models[name]

    def encode(self, text: str) -> list[int]:
        return generation.prompt_ids(
            self.engine.model, self.engine.vocabulary, text, self.row_start
        )

    def prompt_ids(self, request: dict) -> list[list[int]]:
        """The token ids of each prompt of a parsed request: a chat's messages rendered by
        the checkpoint's template (which places any BOS itself, as HF's tokenized
        `apply_chat_template` does), a completion's prompts as `encode` reads them."""
        if request["chat"]:
            vocabulary = self.engine.vocabulary
            text = render_chat(
                vocabulary,
                request["messages"],
                request["chat_template_kwargs"],
                request["tools"],
                request["add_generation_prompt"],
                request["continue_final_message"],
            )
            return [list(vocabulary.encode(text))]
        return [p if isinstance(p, list) else self.encode(p) for p in request["prompts"]]

    def prompt_texts(self, request: dict) -> list[str]:
        """What `echo` shows of each completions prompt: its text, or the text of its token
        ids (special tokens included, as vLLM decodes them)."""
        tokenizer = getattr(self.engine.vocabulary, "tokenizer", None)
        texts = []
        for p in request.get("prompts", ()):
            if isinstance(p, str):
                texts.append(p)
            elif tokenizer is not None:
                texts.append(tokenizer.decode(p, skip_special_tokens=False))
            else:
                texts.append(self.engine.vocabulary.decode(p))
        return texts

    def completions(self, request: dict) -> tuple[list[Completion], list[list[int]]]:
        """The decoding jobs of a parsed request, `n` per prompt (prompt-major, the order of
        the answer's choices, each sample with its own seed), and each prompt's ids (as
        given, for a prompt of token ids).

        A chat request that sets no max tokens (nor does the checkpoint) gets the room its
        prompt leaves, up to `max_tokens_limit`. Its `skip_special_tokens` is settled here:
        a chat answer shows no special tokens (its template's turn markers) unless its tool
        calls are read (their markers may be special tokens, as vLLM's parsers decode
        them), a completion shows every token, unless the request chose."""
        adapter, spec = self.adapter(request), request["structured"]
        calls_read = bool(request.get("tools")) and self.tool_parser is not None
        if request["skip_special_tokens"] and calls_read:
            raise BadRequest(
                "skip_special_tokens=true: this request's tool calls are read from the "
                "special tokens the answer keeps (as vLLM's parsers read them); leave it unset.",
                "skip_special_tokens",
            )
        if request["skip_special_tokens"] is None:
            request["skip_special_tokens"] = request["chat"] and not calls_read
        if request.get("tools") and spec is None and self.tool_parser is None:
            raise BadRequest(
                "This server reads no tool calls from answers: start it with "
                "--gin.TOOL_CALL_PARSER=\"'hermes'\" (serve.serve.tool_call_parser; vLLM's "
                "--tool-call-parser), or send tool_choice='none'.",
                "tools",
            )
        echoed = request["logprobs"] if request["echo"] else None  # the prompt's scores asked
        scored = echoed if echoed is not None else request["prompt_logprobs"]
        if scored is not None and isinstance(self.engine.model, EncoderDecoderModel):
            field = "echo" if echoed is not None else "prompt_logprobs"
            raise BadRequest(
                f"{field} asks for the prompt's log-probabilities, which an encoder-decoder "
                "model does not predict; leave it out.",
                field,
            )
        jobs, prompt_ids = [], self.prompt_ids(request)
        if spec is not None:  # checked before any job starts
            parallel = request.get("parallel_tool_calls", True)
            grammar = guides.grammar(self.grammars, spec, request.get("tools"), parallel)
            stops = request["sampling"].stops(self.engine.model.eos_ids)
            tags = None
            if request["chat"]:
                tags = guides.thinking_tags(self.reasoning_parser, request["chat_template_kwargs"])
        for ids in prompt_ids:
            max_tokens = request["max_tokens"]
            if max_tokens is None:
                room = self.max_tokens_limit
                if self.max_positions is not None:
                    room = min(room, self.max_positions - len(ids))
                if room < 1:
                    raise BadRequest(
                        f"The prompt has {len(ids)} tokens, all of "
                        f"{held(self.max_positions)}; shorten the messages.",
                        "messages",
                    )
                max_tokens = room
            check_prompt_ids(ids, max_tokens, self.max_positions, self.engine.vocab_size)
            check_token_ids(request["sampling"], self.engine.vocab_size)
            for seed in sample_seeds(request["seed"], request["n"]):
                guide = None if spec is None else self.grammars.guide(grammar, stops, ids, tags)
                jobs.append(
                    Completion(
                        ids,
                        max_tokens,
                        request["sampling"],
                        request["stop"],
                        request["logprobs"],
                        seed,
                        adapter=adapter,
                        prompt_logprobs=scored,
                        guide=guide,
                    )
                )
        return jobs, prompt_ids

    def text_stream(self, request: dict) -> TextStream:
        """A choice's TextStream, without the special tokens where the request (as
        `completions` settled it) leaves them out."""
        skip = self.special_ids if request["skip_special_tokens"] else frozenset()
        if self.reasoning_parser is not None:
            skip -= reasoning.tag_ids(self.added_vocab, self.reasoning_parser)
        scores = request["echo"] and request["logprobs"] is not None
        vocabulary, stop = self.engine.vocabulary, request["stop"]
        return TextStream(vocabulary, stop, skip, scores, request["include_stop"])

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


class _Failed(Exception):
    """A completion that ended without its text: the HTTP status and message to answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


_PAGE = epath.Path(__file__).parent / "page.html"
_RESPONSES = "/v1/responses"
_ENDPOINTS = {"/v1/completions": parse_request, "/v1/chat/completions": parse_chat_request}
_TOKENIZER_ENDPOINTS = {
    "/tokenize": tokenizer_api.tokenize,
    "/detokenize": tokenizer_api.detokenize,
}


def _make_handler(server: Server) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "flaxlm"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # quiet; the engine prints its own progress

        def handle_one_request(self) -> None:
            try:
                super().handle_one_request()
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client left mid-answer: nothing to tell

        def _json(self, code: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(
            self, status: int, message: str, param: str | None = None, code: str | None = None
        ) -> None:
            self._json(status, error_body(status, message, param, code))

        def _send(self, events: list[str]) -> None:
            self.wfile.write("".join(events).encode())
            self.wfile.flush()

        def do_GET(self) -> None:  # noqa: N802
            path = self.path.split("?")[0]
            if path == "/health":
                self._json(200, {"status": "ok", "batches": server.engine.batches})
            elif path == "/v1/models":
                self._json(200, server.model_list())
            elif path == "/tokenizer_info":
                try:
                    self._json(200, tokenizer_api.tokenizer_info(server))
                except BadRequest as e:
                    self._error(e.status, str(e), e.param, e.code)
            elif path.startswith(_RESPONSES + "/"):
                try:
                    self._json(200, server.responses.get(path[len(_RESPONSES) + 1 :]).body)
                except BadRequest as e:
                    self._error(e.status, str(e), e.param, e.code)
            elif path in ("/", "/index.html"):
                body = _PAGE.read_text().replace("{{MODEL}}", server.model_name).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self._error(404, f"No such path {path!r}; try GET /v1/models.")

        def do_DELETE(self) -> None:  # noqa: N802
            path = self.path.split("?")[0]
            if not path.startswith(_RESPONSES + "/"):
                self._error(404, f"No such path {path!r}; try DELETE /v1/responses/{{id}}.")
                return
            try:
                self._json(200, server.responses.delete(path[len(_RESPONSES) + 1 :]))
            except BadRequest as e:
                self._error(e.status, str(e), e.param, e.code)

        def _body(self) -> bytes:
            """The request's body, of its Content-Length."""
            length = int(self.headers.get("Content-Length") or 0)
            if length < 0:
                raise BadRequest(f"Content-Length must not be negative, got {length}.")
            return self.rfile.read(length)

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?")[0]
            if path in _TOKENIZER_ENDPOINTS:
                try:
                    self._json(200, _TOKENIZER_ENDPOINTS[path](server, self._body()))
                except BadRequest as e:
                    self._error(e.status, str(e), e.param, e.code)
                except ValueError as e:
                    self._error(400, f"Bad request: {e}")
                return
            parse = server.responses.parse if path == _RESPONSES else _ENDPOINTS.get(path)
            if parse is None:
                self._error(
                    404,
                    f"No such path {self.path!r}; try POST /v1/chat/completions, "
                    "/v1/completions or /v1/responses.",
                )
                return
            try:
                request = parse(
                    self._body(),
                    server.max_positions,
                    server.max_tokens_limit,
                    server.defaults,
                )
                jobs, prompt_ids = server.completions(request)
            except BadRequest as e:
                self._error(e.status, str(e), e.param, e.code)
                return
            except ValueError as e:
                self._error(400, f"Bad request: {e}")
                return
            n = request["n"]
            for start in range(0, len(jobs), n):  # a prompt's samples share its pages
                server.engine.submit_many(jobs[start : start + n])
            name = request["model"] or server.model_name
            texts = server.prompt_texts(request)
            calls = guides.answer_calls(request, server.tool_parser)
            if "response" in request:  # /v1/responses
                answer: Answer = ResponseAnswer(
                    request, name, prompt_ids, calls, server.reasoning_parser,
                    server.responses, server.engine.vocabulary.encode,
                )  # fmt: skip
            else:
                answer = Answer(request, name, prompt_ids, texts, calls, server.reasoning_parser)
            try:
                if request["stream"]:
                    self._stream(answer, jobs)
                else:
                    self._complete(answer, jobs)
            except (BrokenPipeError, ConnectionResetError):
                for job in jobs:  # the client left: free the rows it no longer reads
                    server.engine.cancel(job, "The client disconnected.")

        def _follow(
            self, job: Completion, stream: TextStream, on_text: Any, prompt_only: bool
        ) -> str:
            """Feeds `job`'s tokens through `stream`, calling `on_text` with each piece of
            text that is final; returns the finish reason. `prompt_only`: none of them."""
            while True:
                try:
                    event = job.events.get(timeout=server.request_timeout)
                except queue.Empty:
                    raise _Failed(500, "Decoding timed out.") from None
                if event[0] == "error":
                    raise _Failed(500, f"Decoding failed: {event[1]}")
                if event[0] == "cancelled" and not stream.stopped:
                    raise _Failed(503, event[1])
                if event[0] == "prompt":  # the prompt's scores come first
                    stream.add_prompt(job.prompt_ids, *event[1:])
                    continue
                if prompt_only:  # max_tokens=0: the token decoded after the prompt is dropped
                    if event[0] == "token":
                        server.engine.cancel(job, "Only the prompt was asked for.")
                    return "length"
                if event[:2] == ("done", "stop") and len(event) > 2 and not stream.stopped:
                    stream.add_stop(*event[2:])
                if event[0] in ("done", "cancelled"):
                    rest = stream.flush()
                    if rest:
                        on_text(rest)
                    return "stop" if stream.stopped else event[1]
                if stream.stopped:
                    continue  # tokens decoded before the engine saw the cancel
                delta = stream.add(*event[1:])
                if delta:
                    on_text(delta)
                if stream.stopped:  # at a stop string: the rest is not wanted
                    server.engine.cancel(job, "Stopped at a stop string.")

        def _complete(self, answer: Answer, jobs: list[Completion]) -> None:
            choices = []
            try:
                for job in jobs:
                    stream, parts = server.text_stream(answer.request), []
                    reason = self._follow(job, stream, parts.append, answer.prompt_only)
                    answer.completion_tokens += stream.generated
                    choices.append((stream, "".join(parts), reason))
            except _Failed as e:
                self._error(e.status, e.message)
                return
            answer.count_cached(jobs)
            self._json(200, answer.whole(choices))

        def _stream(self, answer: Answer, jobs: list[Completion]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            try:
                for index, job in enumerate(jobs):
                    stream = server.text_stream(answer.request)
                    choice = StreamedChoice(answer, index, stream)
                    self._send([e for chunk in choice.start() for e in answer.sse(chunk)])

                    def send(text: str, choice: StreamedChoice = choice) -> None:
                        self._send(answer.sse(choice.piece(text)))

                    reason = self._follow(job, stream, send, answer.prompt_only)
                    answer.completion_tokens += stream.generated
                    self._send([e for chunk in choice.end(reason) for e in answer.sse(chunk)])
                answer.count_cached(jobs)
                if answer.request["include_usage"]:
                    self._send(answer.sse(answer.usage_chunk()))
                end = answer.sse_end()
            except _Failed as e:
                end = answer.sse_error(e.status, e.message)
            self._send(end)

    return Handler
