"""Tool calling in chat completions, as vLLM serves it: a request's `tools` go to the chat
template (`apply_chat_template(tools=...)`), and with `tool_choice` 'auto' (the default when
tools are given) the answer's text is read for calls by the parser the server was started
with (`serve.tool_call_parser`, vLLM's `--tool-call-parser`): the calls become the message's
`tool_calls`, the text before them its `content`, and the finish reason `tool_calls`.

`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the format of
Hermes, Qwen2.5, Qwen3 and QwQ, whose templates teach it). `llama3_json`: an answer that is
`{"name": ..., "parameters": {...}}` objects joined by `; ` (Llama 3.1-3.3's). An answer
that does not parse is all content, no calls, as vLLM's parsers leave it."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from flaxlm.runs.serve.settings import BadRequest, shown

Call = dict[str, Any]
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[Call]]:
    """`(content, calls)` of an answer in the Hermes format: the text before the first
    `<tool_call>` (None where it is blank) and each block's call in OpenAI's shape (an id,
    the function's name and its arguments as a JSON string); `(text, [])` where there is no
    block or one does not parse. A last block the answer ended inside (no closing tag) is
    read as well."""
    start = text.find("<tool_call>")
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
    tag = "<|python_tag|>"
    if not (text.startswith(tag) or text.startswith("{")):
        return text, []
    decoder, at, objects = json.JSONDecoder(), len(tag) if text.startswith(tag) else 0, []
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
