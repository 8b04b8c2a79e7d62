"""Tool calling in chat completions, as vLLM serves it: a request's `tools` go to the chat
template (`apply_chat_template(tools=...)`), and with `tool_choice` 'auto' (the default when
tools are given) the answer's text is read for calls by the parser the server was started
with (`serve.tool_call_parser`, vLLM's `--tool-call-parser`; the formats are in
`tool_formats.py`): the calls become the message's `tool_calls`, the text before them its
`content`, and the finish reason `tool_calls`. An answer that does not parse is all content,
no calls, as vLLM's parsers leave it. Such an answer is decoded with its special tokens (the
markers some formats write are special tokens), as vLLM's parsers have it decoded
(`skip_special_tokens=false`).

Streamed (`CallStream`), the text before the calls streams as content; from where the calls
start it is held, and read by the same parser once the answer ends, so that a streamed answer
gives what the whole one gives (vLLM streams a call's arguments as they come: its streamed and
whole answers can differ where a call does not parse). Each call then comes as one delta
(`index`, `id`, `type`, the name and all of its arguments), as OpenAI's clients accumulate
them.

`parallel_tool_calls=false` keeps an answer's first call alone, as vLLM does (it does not
stop the model writing more). `tool_choice` `required` or a named function forces calls
through the answer's grammar (`guides.py`)."""

from __future__ import annotations

from typing import Any

from flaxlm.runs.serve import tool_formats
from flaxlm.runs.serve.settings import BadRequest, shown
from flaxlm.runs.serve.tool_formats import Call, Format, Tools

PARSERS = tool_formats.FORMATS


class CallStream:
    """Reads a chat answer for tool calls as it streams, as its format reads the whole answer
    (`tool_formats.read`): `feed` each piece of content (returns the content that is final),
    `flush` at the end (returns the content still held and the calls)."""

    def __init__(self, fmt: Format, tools: Tools):
        self.format, self.tools = fmt, tools
        self.text = ""
        self.sent = 0  # characters given back as content
        self.start: int | None = None  # where the calls start, once seen

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.start is not None:
            return ""
        self.start, hold = self.format.start(self.text, self.sent)
        end = max(self.sent, self.start if self.start is not None else len(self.text) - hold)
        if not self.text[:end].strip():
            return ""  # blank so far: a whole answer's content before its calls is None
        out, self.sent = self.text[self.sent : end], end
        return out

    def flush(self) -> tuple[str, list[Call]]:
        if self.start is not None:
            calls = self.format.calls(self.text[self.start :], self.tools)
            if calls:
                return "", calls
        rest, self.sent = self.text[self.sent :], len(self.text)
        return rest, []


def check_parser(name: str | None, reasoning_parser: str | None, final: bool = True) -> None:
    """A ValueError naming the setting for a parser flaxlm does not have, or for `openai`
    without the reasoning parser that hands it harmony's calls (`final=False`: before the
    model loads, an unset reasoning parser may still become gpt-oss's, `serve.serve`)."""
    if name is not None and name not in PARSERS:
        raise ValueError(
            f"serve.tool_call_parser={name!r}: expected None or one of {sorted(PARSERS)}."
        )
    unknown_yet = not final and reasoning_parser is None
    if name == "openai" and reasoning_parser != "openai_gptoss" and not unknown_yet:
        raise ValueError(
            "serve.tool_call_parser='openai' reads gpt-oss's calls as the harmony reasoning "
            "parser hands them on: set serve.reasoning_parser='openai_gptoss' too."
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


def tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> Any:
    """'none' or 'auto' (OpenAI's default: 'auto' with tools, 'none' without), or what forces
    a call ('required', a named function: `guides.py` reads them)."""
    if value is None:
        return "auto" if tools else "none"
    if value == "auto" and not tools:
        raise BadRequest("tool_choice='auto' needs tools.", "tool_choice")
    return value
