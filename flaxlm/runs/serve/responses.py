"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it: a request's `input` (a
string, or items: messages, the function calls an earlier answer made and their outputs, its
reasoning) and `instructions` become a chat's messages, answered by the engine, chat
template, parsers and grammars `/v1/chat/completions` uses; the answer is a `response` of
output items (reasoning, a message, function calls), whole or as its typed events
(`response_answer.py`).

What maps to what:

- `instructions` -> a system message first (not carried to the next response, OpenAI's);
  `max_output_tokens` -> max tokens; `tools` (function tools) and `tool_choice` -> a chat's,
  read back by the server's tool-call parser or forced through a grammar (`guides.py`);
  `text.format` (`json_object`, `json_schema`) -> a structured output;
  `reasoning.effort` -> the chat template's `reasoning_effort` (gpt-oss's); `top_logprobs`
  or `include: ["message.output_text.logprobs"]` -> the output text's logprobs (each
  generated token's, as a chat's); vLLM's sampling parameters (`top_k`, `min_p`, `seed`,
  `stop`, ...) and `chat_template_kwargs` as on the chat endpoint;
  `include: ["reasoning.encrypted_content"]` gives each reasoning item an opaque blob that a
  client keeping no state (`store: false`, as Codex) sends back to continue: the reasoning's
  text, compressed and encoded, not encrypted (an open model's reasoning is no secret; vLLM's
  blob is the same); an item sent back with its text is read from the text.
- `store` (OpenAI's default: true) keeps the response in the server's memory (the last
  `kept`), for `previous_response_id` (the stored conversation, its input and output, goes
  before the new input) and `GET` / `DELETE /v1/responses/{id}`.

What flaxlm does not serve is refused with a 400 naming the field: hosted tools (web search,
file search, ...), images and files in the input, `background`, `truncation: "auto"`,
reasoning summaries, another server's encrypted reasoning, item references, `conversation`,
`prompt`."""

from __future__ import annotations

import base64
import binascii
import collections
import copy
import dataclasses
import json
import threading
import zlib
from typing import Any

from flaxlm.runs.serve import api
from flaxlm.runs.serve.settings import SAMPLING_FIELDS, BadRequest, Defaults, check_unicode, shown

KEPT = 1024  # stored responses a server keeps (the oldest go first)
_PASSED = (  # fields handed to the chat request as they are (vLLM's sampling extras)
    "model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
    "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "logit_bias", "stream", "chat_template_kwargs",
)  # fmt: skip
FIELDS = {
    **{k: v for k, v in SAMPLING_FIELDS.items() if k in _PASSED},
    "chat_template_kwargs": (dict, "an object"),
    "input": ((str, list), "a string or a list of items"),
    "instructions": (str, "a string"),
    "max_output_tokens": (int, "an integer"),
    "tools": (list, "a list of tools"),
    "tool_choice": ((str, dict), "'none', 'auto', 'required' or an object"),
    "parallel_tool_calls": (bool, "a boolean"),
    "text": (dict, "an object"),
    "reasoning": (dict, "an object"),
    "store": (bool, "a boolean"),
    "previous_response_id": (str, "a string"),
    "metadata": (dict, "an object"),
    "include": (list, "a list of strings"),
    "top_logprobs": (int, "an integer"),
    "truncation": (str, "'disabled'"),
    "background": (bool, "a boolean"),
    "service_tier": (str, "a string"),
    "max_tool_calls": (int, "an integer"),
    "prompt_cache_key": (str, "a string"),
    "safety_identifier": (str, "a string"),
    "user": (str, "a string"),
    "stream_options": (dict, "an object"),
}
LOGPROBS = "message.output_text.logprobs"
BLOB = "reasoning.encrypted_content"
_BLOB_PREFIX = "flaxlm-reasoning-v1."
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")


@dataclasses.dataclass
class Stored:
    """A kept response: its JSON and the conversation it ends (chat messages, without its
    instructions) that a later `previous_response_id` continues."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]


class Responses:
    """The responses a server keeps, and the parser of requests that may continue them."""

    def __init__(self, kept: int = KEPT):
        self.kept = kept
        self._stored: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._lock = threading.Lock()

    def parse(
        self,
        body: bytes,
        max_positions: int | None,
        max_tokens_limit: int,
        defaults: Defaults | None = None,
    ) -> dict:
        """The request as `api.chat_request` gives it (so the server answers it as a chat),
        with `response`: what its answer echoes and keeps."""
        fields = api.json_fields(body, FIELDS)
        _refuse_unserved(fields)
        if "input" not in fields:
            raise BadRequest("Field 'input' is required.", "input")
        conversation = []
        if "previous_response_id" in fields:
            stored = self.get(fields["previous_response_id"], "previous_response_id")
            conversation = copy.deepcopy(stored.messages)  # the chat's checks rewrite it
        conversation += input_messages(fields["input"])
        instructions = fields.get("instructions")
        if instructions is not None:
            check_unicode("instructions", instructions)
        system = [] if instructions is None else [{"role": "system", "content": instructions}]
        tools = [_chat_tool(t, n) for n, t in enumerate(fields.get("tools") or [])]
        chat = {k: fields[k] for k in _PASSED if k in fields}
        chat.update(messages=system + conversation, tools=tools)
        if "tool_choice" in fields:
            chat["tool_choice"] = _chat_tool_choice(fields["tool_choice"], tools)
        if "parallel_tool_calls" in fields:
            chat["parallel_tool_calls"] = fields["parallel_tool_calls"]
        if "max_output_tokens" in fields:
            chat["max_output_tokens"] = fields["max_output_tokens"]
        text_format = _text_format(fields.get("text"))
        if text_format["type"] == "json_object":
            chat["structured_outputs"] = {"json_object": True}
        elif text_format["type"] == "json_schema":
            chat["structured_outputs"] = {"json": text_format["schema"]}
        include = fields.get("include") or []
        if not set(include) <= {LOGPROBS, BLOB}:
            raise BadRequest(
                f"include {shown(include)}: flaxlm includes {[LOGPROBS, BLOB]} only.", "include"
            )
        if LOGPROBS in include or "top_logprobs" in fields:
            chat.update(logprobs=True, top_logprobs=fields.get("top_logprobs", 0))
        effort = _reasoning_effort(fields.get("reasoning"))
        if effort is not None:  # the variable gpt-oss's template reads
            kwargs = chat.get("chat_template_kwargs") or {}
            chat["chat_template_kwargs"] = {"reasoning_effort": effort, **kwargs}
        request = api.chat_request(
            chat, max_positions, max_tokens_limit, defaults, max_key="max_output_tokens"
        )
        spec = request["structured"]
        if spec is not None and spec.field == "structured_outputs":  # text.format's
            request["structured"] = dataclasses.replace(spec, field="text.format")
        sampling = request["sampling"]
        request["response"] = {
            "blob": BLOB in include,
            "store": fields.get("store", True),
            "conversation": conversation,
            "echo": {
                "background": False,
                "instructions": instructions,
                "max_output_tokens": fields.get("max_output_tokens"),
                "max_tool_calls": fields.get("max_tool_calls"),
                "metadata": fields.get("metadata") or {},
                "parallel_tool_calls": request["parallel_tool_calls"],
                "previous_response_id": fields.get("previous_response_id"),
                "prompt_cache_key": fields.get("prompt_cache_key"),
                "reasoning": {"effort": effort, "summary": None},
                "safety_identifier": fields.get("safety_identifier"),
                "service_tier": "default",
                "store": fields.get("store", True),
                "temperature": sampling.temperature,
                "text": {"format": text_format},
                "tool_choice": fields.get("tool_choice", "auto" if tools else "none"),
                "tools": [_echoed_tool(t) for t in tools],
                "top_logprobs": fields.get("top_logprobs"),
                "top_p": sampling.top_p,
                "truncation": "disabled",
                "user": fields.get("user"),
            },
        }
        return request

    def keep(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Keeps a finished response (the oldest kept goes once `kept` are)."""
        with self._lock:
            self._stored[body["id"]] = Stored(body, messages)
            while len(self._stored) > self.kept:
                self._stored.popitem(last=False)

    def get(self, ident: str, field: str | None = None) -> Stored:
        """The kept response `ident`; a 404 where none is (never stored, deleted, or among
        the oldest the server let go)."""
        with self._lock:
            stored = self._stored.get(ident)
        if stored is None:
            raise BadRequest(
                f"Response with id {ident!r} not found: this server keeps the last {self.kept} "
                "responses sent with store (OpenAI's default), in memory, until it restarts.",
                field,
                status=404,
            )
        return stored

    def delete(self, ident: str) -> dict[str, Any]:
        self.get(ident)
        with self._lock:
            self._stored.pop(ident, None)
        return {"id": ident, "object": "response", "deleted": True}


def _refuse_unserved(fields: dict[str, Any]) -> None:
    if fields.get("background"):
        raise BadRequest("background=true: flaxlm answers while the request waits.", "background")
    if fields.get("truncation", "disabled") != "disabled":
        raise BadRequest(
            f"truncation {shown(fields['truncation'])}: flaxlm drops no input to fit the "
            "model ('disabled', OpenAI's default: a conversation too long is a 400).",
            "truncation",
        )
    if fields.get("stream_options") and not fields.get("stream"):
        raise BadRequest("stream_options is only allowed when stream is true.", "stream_options")
    if any(k != "include_obfuscation" for k in fields.get("stream_options", {})):
        raise BadRequest("stream_options supports only include_obfuscation.", "stream_options")


def input_messages(value: str | list) -> list[dict[str, Any]]:
    """A request's `input` as chat messages: a string is a user's message; of items, a
    message keeps its role and text, a function call joins the assistant's message of its
    turn as one of its tool calls, a call's output is a tool message, a reasoning item's
    text the next assistant message's `reasoning_content`."""
    if isinstance(value, str):
        check_unicode("input", value)
        return [{"role": "user", "content": value}]
    if not value:
        raise BadRequest("Field 'input' must be a string or a non-empty list of items.", "input")
    out: list[dict[str, Any]] = []
    thought = None  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise BadRequest(
                    f"{where}.role must be one of {list(_ROLES)}, got {shown(role)}.",
                    f"{where}.role",
                )
            message = {
                "role": role,
                "content": api.message_text(item.get("content"), where, _TEXT_PARTS),
            }
            if role == "assistant" and thought is not None:
                message["reasoning_content"], thought = thought, None
            out.append(message)
        elif kind == "function_call":
            call = _call(item, where)
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or thought is not None:
                last = {"role": "assistant", "content": ""}
                if thought is not None:
                    last["reasoning_content"], thought = thought, None
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise BadRequest(f"{where}.call_id must be a string.", f"{where}.call_id")
            text = (
                output
                if isinstance(output, str)
                else api.message_text(output, f"{where}.output", _TEXT_PARTS)
            )
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            thought = _reasoning_text(item, where)
        else:
            raise BadRequest(
                f"{where}: flaxlm reads message, function_call, function_call_output and "
                f"reasoning items, got {shown(item)[:60]} (no item references or hosted tools' "
                "items).",
                where,
            )
    if thought is not None:  # reasoning that ended the input: an assistant turn of its own
        out.append({"role": "assistant", "content": "", "reasoning_content": thought})
    return out


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function_call item as a chat's tool call (its arguments a JSON object's text)."""
    name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not (isinstance(name, str) and isinstance(call_id, str) and isinstance(arguments, str)):
        raise BadRequest(
            f"{where}: a function_call needs a call_id, a name and arguments (strings).", where
        )
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise BadRequest(f"{where}.arguments must be a JSON object's text.", f"{where}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    content = item.get("content") or []
    parts = [p.get("text") for p in content if isinstance(p, dict)]
    if not content:
        summary = item.get("summary") or []
        parts = [p.get("text") for p in summary if isinstance(p, dict)]
    if not parts and item.get("encrypted_content"):
        parts = [_read_blob(item["encrypted_content"], where)]
    if not all(isinstance(p, str) for p in parts):
        raise BadRequest(f"{where}: a reasoning item's parts need their text.", where)
    text = "\n".join(parts)
    check_unicode(where, text)
    return text


def reasoning_blob(text: str) -> str:
    """A reasoning item's `encrypted_content`: its text, compressed and encoded."""
    packed = base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8")))
    return _BLOB_PREFIX + packed.decode("ascii")


def _read_blob(blob: Any, where: str) -> str:
    try:
        if not isinstance(blob, str) or not blob.startswith(_BLOB_PREFIX):
            raise ValueError
        return zlib.decompress(base64.urlsafe_b64decode(blob[len(_BLOB_PREFIX) :])).decode()
    except (ValueError, binascii.Error, zlib.error, UnicodeDecodeError):
        raise BadRequest(
            f"{where}.encrypted_content is not a blob this server wrote (another server's "
            "encrypted reasoning cannot be read); send the reasoning's text as its content.",
            f"{where}.encrypted_content",
        ) from None


def _chat_tool(tool: Any, n: int) -> dict[str, Any]:
    """A Responses function tool (`{"type": "function", "name", "parameters", ...}`) as a
    chat's."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise BadRequest(
            f"tools[{n}]: flaxlm serves function tools ({{'type': 'function', 'name': ..., "
            f"'parameters': {{...}}}}) only, got {shown(tool)}.",
            f"tools[{n}]",
        )
    name, parameters = tool.get("name"), tool.get("parameters")
    if not isinstance(name, str) or not isinstance(parameters or {}, dict):
        raise BadRequest(
            f"tools[{n}] must be {{'type': 'function', 'name': str, 'parameters': object, "
            f"...}}, got {shown(tool)}.",
            f"tools[{n}]",
        )
    function = {"name": name}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    return {
        "type": "function",
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
        "strict": function.get("strict"),
    }


def _chat_tool_choice(value: Any, tools: list[dict[str, Any]]) -> Any:
    """'none', 'auto', 'required', or `{"type": "function", "name"}` as a chat's."""
    if value in ("none", "auto", "required"):
        return value
    names = [t["function"]["name"] for t in tools]
    if isinstance(value, dict) and value.get("type") == "function" and value.get("name") in names:
        return {"type": "function", "function": {"name": value["name"]}}
    raise BadRequest(
        f"tool_choice={shown(value)}: expected 'none', 'auto', 'required' or "
        f"{{'type': 'function', 'name': one of {names}}} (flaxlm serves function tools only).",
        "tool_choice",
    )


def _text_format(text: dict[str, Any] | None) -> dict[str, Any]:
    """`text.format`: `{"type": "text"}` (the default), `json_object`, or `json_schema`
    with its `name` and `schema`."""
    value = (text or {}).get("format") or {"type": "text"}
    if (text or {}).get("verbosity") is not None:
        raise BadRequest(
            "text.verbosity: a hint OpenAI's models read, which an open model has no setting "
            "for; leave it out.",
            "text.verbosity",
        )
    unknown = sorted(set(text or {}) - {"format", "verbosity"})
    kind = value.get("type") if isinstance(value, dict) else None
    if unknown or kind not in ("text", "json_object", "json_schema"):
        raise BadRequest(
            f"text {shown(text)}: expected {{'format': {{'type': 'text' | 'json_object' | "
            "'json_schema', ...}}}.",
            "text.format",
        )
    if kind == "json_schema" and not isinstance(value.get("schema"), dict):
        raise BadRequest(
            "text.format json_schema needs {'type': 'json_schema', 'name': ..., 'schema': "
            f"{{...}}}}, got {shown(value)}.",
            "text.format",
        )
    return value


def _reasoning_effort(value: dict[str, Any] | None) -> str | None:
    """`reasoning.effort`; `summary` 'auto' leaves the summary to the server (flaxlm has
    no summarizer: none, the reasoning itself is the item's content)."""
    value = value or {}
    for key in ("summary", "generate_summary"):
        if value.get(key) not in (None, "auto"):
            raise BadRequest(
                f"reasoning.{key}={shown(value[key])}: flaxlm gives the reasoning itself (a "
                "reasoning item's content), not a summary; leave it out or set 'auto'.",
                f"reasoning.{key}",
            )
    effort = value.get("effort")
    if set(value) - {"effort", "summary", "generate_summary"} or not (
        effort is None or isinstance(effort, str)
    ):
        raise BadRequest(f"reasoning {shown(value)}: expected {{'effort': str}}.", "reasoning")
    return effort
