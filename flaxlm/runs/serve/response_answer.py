"""A Responses API request's answer (`responses.py`): the chat answer `Answer` makes, as a
`response` of output items — the reasoning (with a reasoning parser), the assistant's
message, each function call — whole, or streamed as OpenAI's typed events.

Streamed, each item opens (`response.output_item.added`, its content part), grows by deltas
(`response.reasoning_text.delta`, `response.output_text.delta` with the logprobs of the
tokens since the last) and closes (`...done`); function calls come whole at the end, as on
the chat endpoint (`tools.py`), each as one arguments delta; `response.completed` (or
`response.incomplete` where `max_output_tokens` cut it) carries the whole response, the same
as the JSON answer. The output text's logprobs are those of every generated token (its
reasoning's and calls' too), as a chat's are.

Usage counts the prompt's and the answer's tokens as a chat's does (`cached_tokens` those
the prefix cache held; `cache_write_tokens` 0: flaxlm's cache is no paid write);
`reasoning_tokens` are the reasoning's text as the tokenizer reads it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from flaxlm.runs.serve.answer import Answer, error_body
from flaxlm.runs.serve.responses import Responses, reasoning_blob
from flaxlm.runs.serve.tool_formats import Format


class ResponseAnswer(Answer):
    """One Responses request's answer (one choice: the API has no `n`)."""

    def __init__(
        self,
        request: dict,
        model_name: str,
        prompt_ids: list[list[int]],
        calls: Format | None,
        reasoning_parser: str | None,
        responses: Responses,
        encode: Callable[[str], Any],
    ):
        """`responses`: where a stored answer is kept; `encode`: the tokenizer's (to count
        the reasoning's tokens)."""
        super().__init__(request, model_name, prompt_ids, [""], calls, reasoning_parser)
        self.ident = f"resp_{uuid.uuid4().hex}"
        self.responses, self.encode = responses, encode
        self.sequence = 0  # the next event's sequence_number
        self.items: list[dict[str, Any]] = []  # streamed output items, as they stand
        self.open: str | None = None  # the type of the item being streamed, if any
        self.reason: str | None = None
        self.pending: list[dict[str, Any]] = []  # logprobs for the message not yet open

    def whole(self, choices: list[tuple[Any, str, str]]) -> dict[str, Any]:
        """The JSON answer: the chat answer's message as output items."""
        chat = super().whole(choices)
        (choice,) = chat["choices"]
        message, logprobs = choice["message"], choice["logprobs"]
        items = []
        if message.get("reasoning"):
            items.append(_reasoning(f"rs_{uuid.uuid4().hex}", message["reasoning"]))
        calls = message.get("tool_calls") or []
        if message["content"] or not calls:
            listed = (logprobs or {}).get("content")
            items.append(_message(f"msg_{uuid.uuid4().hex}", message["content"] or "", listed))
        items.extend(_call(f"fc_{uuid.uuid4().hex}", call) for call in calls)
        return self._finished(items, choice["finish_reason"])

    def _finished(self, items: list[dict[str, Any]], reason: str) -> dict[str, Any]:
        """The whole response once its items are, kept where the request stores it."""
        status = "incomplete" if reason == "length" else "completed"
        for n, item in enumerate(items):  # the text the limit cut is the last item's
            cut = n == len(items) - 1 and item["type"] != "function_call"
            item["status"] = status if cut else "completed"
            self._seal(item)
        body = self._response(status, items)
        info = self.request["response"]
        if info["store"]:
            self.responses.keep(body, [*info["conversation"], _as_message(items)])
        return body

    def _response(self, status: str, items: list[dict[str, Any]]) -> dict[str, Any]:
        thought = "".join(
            c["text"] for i in items if i["type"] == "reasoning" for c in i["content"]
        )
        reasoning_tokens = len(self.encode(thought)) if thought else 0
        usage = {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": self.cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        return {
            "id": self.ident,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "model": self.model_name,
            "output": items,
            "usage": usage if status in ("completed", "incomplete") else None,
            **self.request["response"]["echo"],
        }

    # Streamed: each of the chat answer's chunks becomes the Responses events it implies.

    def sse(self, chunk: dict[str, Any]) -> list[str]:
        choice = chunk["choices"][0] if chunk["choices"] else {}
        delta, events = choice.get("delta", {}), []
        if delta.get("role"):  # the answer's first chunk
            snapshot = self._response("in_progress", [])
            events.append(self._event("response.created", response=snapshot))
            events.append(self._event("response.in_progress", response=snapshot))
        listed = (choice.get("logprobs") or {}).get("content") or []
        if delta.get("reasoning"):
            events += self._grow("reasoning", delta["reasoning"], [])
        if delta.get("content") or (listed and self.open == "message"):
            events += self._grow("message", delta.get("content") or "", listed)
        else:  # logprobs of tokens before the message (reasoning): its, once it opens
            self.pending += listed
        for call in delta.get("tool_calls") or []:
            events += self._close()
            item = _call(f"fc_{uuid.uuid4().hex}", call)
            events += self._added({**item, "arguments": "", "status": "in_progress"})
            where = {"item_id": item["id"], "output_index": len(self.items) - 1}
            arguments = item["arguments"]
            events.append(
                self._event("response.function_call_arguments.delta", **where, delta=arguments)
            )
            events.append(
                self._event("response.function_call_arguments.done", **where, arguments=arguments)
            )
            self.items[-1] = {**item, "status": "completed"}
            events.append(
                self._event(
                    "response.output_item.done",
                    item=self.items[-1],
                    output_index=where["output_index"],
                )
            )
        if choice.get("finish_reason"):
            self.reason = choice["finish_reason"]
        return events

    def sse_end(self) -> list[str]:
        events = self._close()
        if not any(i["type"] in ("message", "function_call") for i in self.items):
            events += self._grow("message", "", [])  # an empty answer is an empty message
            events += self._close()
        body = self._finished(self.items, self.reason or "stop")
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=body)]

    def sse_error(self, status: int, message: str) -> list[str]:
        """An `error` event, then `response.failed` with the items streamed so far."""
        code = error_body(status, message)["error"]["type"]
        failed = self._response("failed", self.items)
        failed.update(error={"code": code, "message": message}, usage=None)
        return [
            self._event("error", code=code, message=message, param=None),
            self._event("response.failed", response=failed),
        ]

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _added(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        index = len(self.items) - 1
        return [self._event("response.output_item.added", output_index=index, item=item)]

    def _grow(self, kind: str, text: str, listed: list[dict[str, Any]]) -> list[str]:
        """Events adding `text` (and the logprobs `listed`) to the open item of `kind`,
        opening it first (closing the one before)."""
        events = []
        if self.open != kind:
            events += self._close()
            self.open = kind
            ident = f"{'rs' if kind == 'reasoning' else 'msg'}_{uuid.uuid4().hex}"
            item = _reasoning(ident, "") if kind == "reasoning" else _message(ident, "", [])
            events += self._added({**item, "content": [], "status": "in_progress"})
            self.items[-1]["content"].append(item["content"][0])
            events.append(
                self._event("response.content_part.added", **self._where(), part=_part(item))
            )
        if kind == "message":
            listed, self.pending = [*self.pending, *listed], []
        part = self.items[-1]["content"][0]
        part["text"] += text
        kind_delta = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra = {} if kind == "reasoning" else {"logprobs": listed}
        if kind == "message":
            part["logprobs"] = (part.get("logprobs") or []) + listed
        events.append(self._event(kind_delta, **self._where(), delta=text, **extra))
        return events

    def _seal(self, item: dict[str, Any]) -> None:
        """A finished reasoning item's blob, where the request includes it."""
        if item["type"] == "reasoning" and self.request["response"]["blob"]:
            item["encrypted_content"] = reasoning_blob(item["content"][0]["text"])

    def _where(self) -> dict[str, Any]:
        return {
            "item_id": self.items[-1]["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
        }

    def _close(self) -> list[str]:
        """Events closing the open reasoning or message item (none where none is open)."""
        if self.open is None:
            return []
        kind, self.open = self.open, None
        item, where = self.items[-1], self._where()
        part = item["content"][0]
        if kind == "reasoning":
            done = self._event("response.reasoning_text.done", **where, text=part["text"])
        else:
            done = self._event(
                "response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]
            )
        item["status"] = "incomplete" if self.reason == "length" else "completed"
        self._seal(item)
        return [
            done,
            self._event("response.content_part.done", **where, part=_part(item)),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]


def _reasoning(ident: str, text: str) -> dict[str, Any]:
    return {
        "id": ident,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _message(ident: str, text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {
        "id": ident,
        "type": "message",
        "role": "assistant",
        "content": [part],
        "status": "completed",
    }


def _part(item: dict[str, Any]) -> dict[str, Any]:
    return dict(item["content"][0])


def _call(ident: str, call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a function_call item (its call id the chat's)."""
    function = call["function"]
    return {
        "id": ident,
        "type": "function_call",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": "completed",
    }


def _as_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the assistant's chat message a later request continues."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "reasoning":
            message["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            message["content"] = item["content"][0]["text"]
        else:
            call = {"name": item["name"], "arguments": item["arguments"]}
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": call}
            )
    return message
