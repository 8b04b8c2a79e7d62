"""Tool calling in chat completions, as vLLM serves it: a request's `tools` go to the chat
template (`apply_chat_template(tools=...)`), and with `tool_choice` 'auto' (the default when
tools are given) the answer's text is read for calls by the parser the server was started
with (`serve.tool_call_parser`, vLLM's `--tool-call-parser`): the calls become the message's
`tool_calls`, the text before them its `content`, and the finish reason `tool_calls`.

`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the format of
Hermes, Qwen2.5, Qwen3 and QwQ, whose templates teach it). `llama3_json`: an answer that is
`{"name": ..., "parameters": {...}}` objects joined by `; ` (Llama 3.1-3.3's). An answer
that does not parse is all content, no calls, as vLLM's parsers leave it.

Streamed (`CallStream`), the text before the calls streams as content; from where the calls
start it is held, and read by the same parser once the answer ends, so that a streamed answer
gives what the whole one gives (vLLM streams a call's arguments as they come: its streamed and
whole answers can differ where a call does not parse). Each call then comes as one delta
(`index`, `id`, `type`, the name and all of its arguments), as OpenAI's clients accumulate
them.

`parallel_tool_calls=false` keeps an answer's first call alone, as vLLM does (it does not
stop the model writing more)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from flaxlm.runs.serve.settings import BadRequest, shown
from flaxlm.runs.serve.stream import prefix_at_end

Call = dict[str, Any]
HERMES_OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[Call]]:
    """`(content, calls)` of an answer in the Hermes format: the text before the first
    `<tool_call>` (None where it is blank) and each block's call in OpenAI's shape (an id,
    the function's name and its arguments as a JSON string); `(text, [])` where there is no
    block or one does not parse. A last block the answer ended inside (no closing tag) is
    read as well."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for match in _HERMES.finditer(text, start):
        body = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
        try:
            call = json.loads(body)
        except ValueError:
            return text, []
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return text, []
        calls.append(_call(call["name"], call.get("arguments", call.get("parameters", {}))))
    content = text[:start]
    return (content if content.strip() else None), calls


def parse_llama3_json(text: str) -> tuple[str | None, list[Call]]:
    """`(content, calls)` of an answer in Llama 3.1-3.3's JSON format: an answer that starts
    with `{` (or `<|python_tag|>`, where the tokenizer leaves it in the text) is one or more
    `{"name": ..., "parameters": {...}}` objects joined by `; `, all calls and no content;
    `(text, [])` for any other answer or one that does not parse, as vLLM's `llama3_json`."""
    if not (text.startswith(PYTHON_TAG) or text.startswith("{")):
        return text, []
    start = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
    decoder, at, objects = json.JSONDecoder(), start, []
    try:
        while at < len(text):
            obj, length = decoder.raw_decode(text[at:])
            objects.append(obj)
            at += length + len("; ")
    except ValueError:
        return text, []
    if not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in objects):
        return text, []
    return None, [_call(o["name"], o.get("arguments", o.get("parameters", {}))) for o in objects]


def _call(name: str, arguments: Any) -> Call:
    """A call in OpenAI's shape: an id, the function's name, its arguments as JSON text."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


PARSERS: dict[str, Callable[[str], tuple[str | None, list[Call]]]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
}


def _hermes_start(text: str, sent: int) -> tuple[int | None, int]:
    """(Where the calls start in `text`, None if they have not; how many of its last
    characters may still begin them): the first `<tool_call>` (the first `sent` characters,
    already content, hold none)."""
    at = text.find(HERMES_OPEN, sent)
    return (at, 0) if at >= 0 else (None, prefix_at_end(text, HERMES_OPEN))


def _llama3_json_start(text: str, sent: int) -> tuple[int | None, int]:
    """As `_hermes_start`: Llama 3's calls are the whole answer, from its first character."""
    if sent or not text:
        return None, 0
    if text.startswith(PYTHON_TAG) or text.startswith("{"):
        return 0, 0
    return None, len(text) if PYTHON_TAG.startswith(text) else 0


STARTS = {"hermes": _hermes_start, "llama3_json": _llama3_json_start}


class CallStream:
    """Reads a chat answer for tool calls as it streams, as its parser reads the whole answer:
    `feed` each piece of content (returns the content that is final), `flush` at the end
    (returns the content still held and the calls)."""

    def __init__(self, parser: str):
        self.parse, self.start_of = PARSERS[parser], STARTS[parser]
        self.text = ""
        self.sent = 0  # characters given back as content
        self.start: int | None = None  # where the calls start, once seen

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.start is not None:
            return ""
        self.start, hold = self.start_of(self.text, self.sent)
        end = max(self.sent, self.start if self.start is not None else len(self.text) - hold)
        if not self.text[:end].strip():
            return ""  # blank so far: a whole answer's content before its calls is None
        out, self.sent = self.text[self.sent : end], end
        return out

    def flush(self) -> tuple[str, list[Call]]:
        if self.start is not None:
            _, calls = self.parse(self.text[self.start :])
            if calls:
                return "", calls
        rest, self.sent = self.text[self.sent :], len(self.text)
        return rest, []


def check_parser(name: str | None) -> None:
    """A ValueError naming the setting for a parser flaxlm does not have."""
    if name is not None and name not in PARSERS:
        raise ValueError(
            f"serve.tool_call_parser={name!r}: expected None or one of {sorted(PARSERS)}."
        )


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """A request's `tools`: each `{"type": "function", "function": {"name", "description"?,
    "parameters"?}}`; a BadRequest names the first that is not."""
    for n, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or tool.get("type") != "function"
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("parameters", {}), dict)
        ):
            raise BadRequest(
                f"tools[{n}] must be {{'type': 'function', 'function': {{'name': str, "
                f"'parameters': object, ...}}}}, got {shown(tool)}.",
                f"tools[{n}]",
            )
    return tools


def tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str:
    """'none' or 'auto' (OpenAI's default: 'auto' with tools, 'none' without); 'required'
    and a named function (which vLLM forces with guided decoding) are a BadRequest."""
    if value is None:
        return "auto" if tools else "none"
    if value in ("none", "auto"):
        if value == "auto" and not tools:
            raise BadRequest("tool_choice='auto' needs tools.", "tool_choice")
        return value
    raise BadRequest(
        f"tool_choice={shown(value)}: flaxlm answers 'auto' or 'none' (forcing a call takes "
        "guided decoding, which it does not do).",
        "tool_choice",
    )
