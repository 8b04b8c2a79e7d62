"""A request's answer in OpenAI's shapes: `text_completion` or `chat.completion`, whole or
as server-sent chunks, its usage, and the error body OpenAI's clients read."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from flaxlm.runs.serve import reasoning, tool_formats, tools
from flaxlm.runs.serve.stream import TextStream
from flaxlm.runs.serve.tool_formats import Format

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error"}


class Answer:
    """One request's answer in its endpoint's shape: OpenAI's `text_completion` or
    `chat.completion`, whole or as chunks."""

    def __init__(
        self,
        request: dict,
        model_name: str,
        prompt_ids: list[list[int]],
        texts: list[str],
        calls: Format | None = None,
        reasoning_parser: str | None = None,
    ):
        """`texts`: what `echo` shows of each prompt (`Server.prompt_texts`); `calls`: how a
        chat answer's tool calls are read (the tool-call parser's format, or a forced
        call's, `guides.answer_calls`; None: none are read); `reasoning_parser`: splits a
        chat answer's reasoning from its content (`reasoning.PARSERS`; None: all of it is
        content)."""
        self.request, self.chat, self.texts = request, request["chat"], texts
        self.prompt_only = request.get("prompt_only", False)  # max_tokens=0 with echo
        self.calls = calls
        self.reasoning_parser = reasoning_parser if self.chat else None
        self.ident = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created, self.model_name = int(time.time()), model_name
        self.prompt_ids = prompt_ids
        self.prompt_tokens = sum(len(ids) for ids in prompt_ids)  # once, whatever n is
        self.completion_tokens = 0
        self.cached_tokens = 0  # of the prompt tokens, those the prefix cache held

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        return {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.model_name,
            "system_fingerprint": None,
        }

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def count_cached(self, jobs: Sequence[Any]) -> None:
        """The cached prompt tokens of a request's ended `jobs` (`n` a prompt, which read it
        once): each prompt's once."""
        n = self.request["n"]
        self.cached_tokens = sum(
            max(j.cached_tokens for j in jobs[i : i + n]) for i in range(0, len(jobs), n)
        )

    def prompt(self, index: int) -> str:
        return self.texts[index // self.request["n"]]

    def logprobs(self, stream: TextStream, start: int = 0, end: int | None = None) -> Any:
        count = self.request["logprobs"]
        if self.chat:
            return stream.chat_logprobs(count, start, end)
        return stream.logprobs(count, start, end)

    def whole(self, choices: list[tuple[TextStream, str, str]]) -> dict[str, Any]:
        """The JSON answer: each choice's (stream, text, finish reason)."""
        out, count = [], self.request.get("prompt_logprobs")
        for index, (stream, text, reason) in enumerate(choices):
            choice: dict[str, Any] = {"index": index, "logprobs": self.logprobs(stream)}
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "refusal": None}
                content: str | None = text
                if self.reasoning_parser is not None:
                    message["reasoning"], content = reasoning.split(
                        text, self.reasoning_parser, self.request["chat_template_kwargs"]
                    )
                if self.calls is not None and content:
                    content, calls = tool_formats.read(self.calls, content, self.request["tools"])
                    if calls:
                        message["tool_calls"] = self.calls_kept(calls)
                        reason = self.calls_reason()
                choice["message"] = {**message, "content": content}
            else:
                choice["text"] = (self.prompt(index) if self.request["echo"] else "") + text
            choice["finish_reason"] = reason
            if count is not None and not self.chat:  # vLLM's, per choice of a completion
                choice["prompt_logprobs"] = stream.prompt_logprobs(count)
            if self.request.get("return_token_ids"):  # vLLM's
                choice["token_ids"] = token_ids(stream)
                if not self.chat:
                    choice["prompt_token_ids"] = self.prompt_ids[index // self.request["n"]]
            out.append(choice)
        body = {**self._envelope(False), "choices": out, "usage": self.usage()}
        if self.request.get("return_token_ids") and self.chat:
            body["prompt_token_ids"] = self.prompt_ids[0]
        if count is not None and self.chat:  # vLLM's, once for a chat's one prompt
            body["prompt_logprobs"] = choices[0][0].prompt_logprobs(count)
        return body

    def chunk(
        self,
        index: int,
        text: str | None,
        reason: str | None = None,
        logprobs: Any = None,
        *,
        role: bool = False,
        thought: str | None = None,
        calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One streamed event of choice `index`: its next text (None in the chat chunk that
        only ends a choice), its first with `role` (chat), the reasoning it adds (`thought`,
        with a reasoning parser), the tool calls read from it (`calls`, each whole)."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {} if thought is None else {"reasoning": thought}
            delta.update({} if text is None else {"content": text})
            if calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            choice["delta"] = {"role": "assistant", **delta} if role else delta
        else:
            choice["text"] = text or ""
        choice.update(logprobs=logprobs, finish_reason=reason)
        chunk = {**self._envelope(True), "choices": [choice]}
        if self.request["include_usage"]:
            chunk["usage"] = None
        return chunk

    def calls_reason(self) -> str:
        """An answer's finish reason once it calls tools: `tool_calls`, but `stop` where the
        request named the function (OpenAI's)."""
        return "stop" if isinstance(self.request.get("tool_choice"), dict) else "tool_calls"

    def calls_kept(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """An answer's tool calls, the first alone with `parallel_tool_calls=false` (vLLM's)."""
        return calls if self.request.get("parallel_tool_calls", True) else calls[:1]

    def usage_chunk(self) -> dict[str, Any]:
        """The last event when `stream_options.include_usage`: no choices, the usage."""
        return {**self._envelope(True), "choices": [], "usage": self.usage()}

    # Server-sent events (a Responses answer's differ: `response_answer.py`).

    def sse(self, chunk: dict[str, Any]) -> list[str]:
        """The events that stream `chunk`."""
        return [f"data: {json.dumps(chunk)}\n\n"]

    def sse_end(self) -> list[str]:
        """The events that end the stream."""
        return ["data: [DONE]\n\n"]

    def sse_error(self, status: int, message: str) -> list[str]:
        """The events that end a stream that failed."""
        return [*self.sse(error_body(status, message)), *self.sse_end()]


class StreamedChoice:
    """One choice of a streamed chat or text answer: its pieces of text as chunks, with the
    reasoning and the tool calls read out of them as `Answer.whole` reads the whole text,
    and the logprobs of the tokens `stream` has listed since the chunk before.

    A completion's `echo` comes first, alone; with `logprobs` it comes with the first piece
    of text, its tokens' logprobs with it, as vLLM streams it."""

    def __init__(self, answer: Answer, index: int, stream: TextStream):
        self.answer, self.index, self.stream = answer, index, stream
        echo = not answer.chat and answer.request["echo"]
        self.prompt = answer.prompt(index) if echo else None  # echo's text, until sent
        self.splitter = (
            None
            if answer.reasoning_parser is None
            else reasoning.splitter(answer.reasoning_parser, answer.request["chat_template_kwargs"])
        )
        self.calls = (
            None
            if answer.calls is None
            else tools.CallStream(answer.calls, answer.request["tools"])
        )
        self.ids_sent = 0  # with `return_token_ids`: the token ids streamed so far
        self.prompt_sent = answer.chat and index > 0  # a chat's prompt ids come once

    def _ids(self, chunk: dict[str, Any], last: bool = False) -> dict[str, Any]:
        """`chunk` with vLLM's `token_ids` (those decoded since the chunk before; the
        stop token with the `last`) and, in the first, `prompt_token_ids`, where the request
        asks for them."""
        if not self.answer.request.get("return_token_ids"):
            return chunk
        choice = chunk["choices"][0]
        ids, self.ids_sent = self.stream.ids[self.ids_sent :], len(self.stream.ids)
        stop = self.stream.stop_token
        choice["token_ids"] = ids + ([stop] if last and stop is not None else [])
        if not self.prompt_sent:
            self.prompt_sent = True
            prompt = self.answer.prompt_ids[self.index // self.answer.request["n"]]
            (chunk if self.answer.chat else choice)["prompt_token_ids"] = prompt
        return chunk

    def start(self) -> list[dict[str, Any]]:
        """The choice's first chunks: a chat's role, a completion's echo without logprobs."""
        if self.answer.chat:
            return [self._ids(self.answer.chunk(self.index, "", role=True))]
        if self.prompt is not None and not self.stream.echo_scores:
            prompt, self.prompt = self.prompt, None
            return [self._ids(self.answer.chunk(self.index, prompt))]
        return []

    def piece(self, text: str) -> dict[str, Any]:
        """The chunk of the next piece of text (its content may be '' while a tag or a call
        is held back; the logprobs of its tokens go out all the same)."""
        logprobs = self.answer.logprobs(self.stream, *self.stream.unreported())
        if self.prompt is not None:
            text, self.prompt = self.prompt + text, None
        thought = None
        if self.splitter is not None:
            thought, text = self.splitter.feed(text)
        if self.calls is not None:
            text = self.calls.feed(text)
        return self._ids(self.answer.chunk(self.index, text, None, logprobs, thought=thought))

    def end(self, reason: str) -> list[dict[str, Any]]:
        """The choice's last chunks once its text has ended: what was held back, its tool
        calls, and the finish reason."""
        thought, text = ("", "") if self.splitter is None else self.splitter.flush()
        calls: list[dict[str, Any]] = []
        if self.calls is not None:
            text = self.calls.feed(text)
            rest, calls = self.calls.flush()
            text += rest
        chunks = []
        if self.prompt is not None:  # echo with logprobs, no text generated
            chunks.append(self.piece(""))
        start, end = self.stream.unreported()  # tokens with no text of their own (a stop's)
        logprobs = self.answer.logprobs(self.stream, start, end) if end > start else None
        if thought or text or logprobs is not None:
            chunks.append(
                self.answer.chunk(self.index, text or None, None, logprobs, thought=thought or None)
            )
        if calls:
            calls, reason = self.answer.calls_kept(calls), self.answer.calls_reason()
            chunks.append(self.answer.chunk(self.index, None, calls=calls))
        return [*chunks, self._ids(self.answer.chunk(self.index, None, reason), last=True)]


def token_ids(stream: TextStream) -> list[int]:
    """vLLM's `token_ids` of a choice: the tokens decoded, the stop token that ended it
    included."""
    return stream.ids + ([stream.stop_token] if stream.stop_token is not None else [])


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape, which its clients read into their exceptions."""
    kind = _ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
