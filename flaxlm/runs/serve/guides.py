"""Structured outputs in requests, as vLLM serves them: each token of a guided answer is
chosen among those its grammar allows next (`inference/guides.py`, llguidance's grammars;
`sampling.select` masks the rest), so the answer always parses.

What a request may ask for:

- OpenAI's `response_format`: `{"type": "json_object"}` (any JSON object) or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`; `"text"`: none.
- vLLM's `structured_outputs`: one of `json` (a JSON schema), `regex`, `choice` (a list of
  strings, the answer one of them), `grammar` (Lark, or llama.cpp's GBNF) or
  `json_object: true`.
- `tool_choice` `"required"` or `{"type": "function", "function": {"name": ...}}` (chat
  with `tools`): as vLLM forces them, the answer is a JSON list of `{"name", "parameters"}`
  objects, one of the tools each (one only with `parallel_tool_calls=false`), or the named
  function's arguments; it comes back as the message's `tool_calls` (finish reason
  `tool_calls` for `required`, `stop` for a named function, as OpenAI answers) whatever
  the server's tool-call parser.

JSON is laid out as `json.dumps` writes it (`inference/guides.py`: vLLM allows any
whitespace). With a reasoning parser (`reasoning.py`), the grammar starts after the
thinking block ends, as vLLM's does: where the prompt leaves the block open or a thinking
answer may open one, the answer thinks freely and its closing tag starts the grammar
(gpt-oss's harmony: its final channel's `<|channel|>final<|message|>`). Where the answer
ends before its grammar is satisfied (`max_tokens`), it is cut (finish reason `length`).

Each guided row decodes one token per engine dispatch (its next set depends on the token it
chose)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from flaxlm.inference.guides import KINDS, Grammars
from flaxlm.runs.serve import harmony, reasoning
from flaxlm.runs.serve.settings import BadRequest, shown
from flaxlm.runs.serve.tool_formats import FORMATS, Call, Format, Tools, call, listed_calls

FIELDS = {
    "response_format": (dict, "an object"),
    "structured_outputs": (dict, "an object"),
}
_KINDS = (*KINDS, "json_object")


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a request's answer must be: `kind` ('json', 'regex', 'choice', 'grammar') and
    its `source` (a JSON schema, a pattern, the choices, a grammar's text); `calls`: the
    tool_choice it forces ('required' or a function's name; None: none)."""

    kind: str
    source: Any
    calls: str | None = None
    field: str = "structured_outputs"


def parse(request: Mapping[str, Any], tools: Tools | None, tool_choice: Any) -> Spec | None:
    """The request's structured output, None where it asks for none; a BadRequest names a
    field that is not one flaxlm reads."""
    text = request.get("response_format", {}).get("type") == "text"  # OpenAI's default
    asked = [k for k in ("response_format", "structured_outputs") if k in request]
    asked = [k for k in asked if not (text and k == "response_format")]
    forced = tool_choice if tool_choice not in (None, "auto", "none") else None
    if len(asked) + (forced is not None) > 1:
        named = asked + (["tool_choice"] if forced is not None else [])
        raise BadRequest(f"{' and '.join(named)}: ask for one structured output.", named[-1])
    if forced is not None:
        return _forced(forced, tools or [])
    if not asked:
        return None
    if asked[0] == "response_format":
        return _response_format(request["response_format"])
    return _structured_outputs(request["structured_outputs"])


def _response_format(value: dict[str, Any]) -> Spec:
    kind = value.get("type")
    if kind == "json_object":
        return Spec("json", {"type": "object"}, field="response_format")
    if kind == "json_schema":
        body = value.get("json_schema")
        schema = body.get("schema") if isinstance(body, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': "
                f"{{...}}}}, got {shown(value)}.",
                "response_format",
            )
        return Spec("json", schema, field="response_format")
    raise BadRequest(
        f"response_format type {shown(kind)}: flaxlm answers 'text', 'json_object' and "
        "'json_schema'.",
        "response_format",
    )


def _structured_outputs(value: dict[str, Any]) -> Spec:
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_KINDS))
    if unknown or len(given) != 1:
        raise BadRequest(
            f"structured_outputs takes one of {list(_KINDS)}, got {sorted(given)}"
            + (f" ({unknown} are not read by flaxlm)." if unknown else "."),
            "structured_outputs",
        )
    (kind, source), = given.items()  # fmt: skip
    if kind == "json_object":
        return Spec("json", {"type": "object"})
    if kind == "json" and isinstance(source, str):
        try:
            source = json.loads(source)
        except ValueError as e:
            raise BadRequest(
                f"structured_outputs.json is not JSON: {e}.", "structured_outputs"
            ) from None
    wanted = {"json": dict, "regex": str, "grammar": str, "choice": list}[kind]
    if not isinstance(source, wanted) or (
        kind == "choice" and not (source and all(isinstance(c, str) for c in source))
    ):
        raise BadRequest(
            f"structured_outputs.{kind} must be "
            + {"json": "a JSON schema", "choice": "a non-empty list of strings"}.get(
                kind, "a string"
            )
            + f", got {shown(source)}.",
            "structured_outputs",
        )
    return Spec(kind, source)


def _forced(choice: Any, tools: Tools) -> Spec:
    """tool_choice 'required' or a named function, as vLLM forces them."""
    if not tools:
        raise BadRequest(f"tool_choice={shown(choice)} needs tools.", "tool_choice")
    if choice == "required":
        return Spec("json", None, calls="required", field="tool_choice")
    names = [t["function"]["name"] for t in tools]
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
    if name not in names:
        raise BadRequest(
            f"tool_choice={shown(choice)}: expected 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': one of {names}}}}}.",
            "tool_choice",
        )
    return Spec("json", None, calls=name, field="tool_choice")


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def schema(spec: Spec, tools: Tools, parallel: bool) -> dict[str, Any]:
    """The JSON schema of a 'json' spec (a forced call's: vLLM's)."""
    if spec.calls is None:
        return spec.source
    if spec.calls != "required":
        return _parameters(next(t for t in tools if t["function"]["name"] == spec.calls))
    one_of = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    array = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": one_of}}
    return array if parallel else {**array, "maxItems": 1}


def answer_calls(request: Mapping[str, Any], tool_parser: str | None) -> Format | None:
    """How a parsed request's answer gives tool calls: as a forced call's (a `Format` whose
    calls start at its first character), else by the server's tool-call parser where the
    request offers tools; None: it gives none."""
    spec = request.get("structured")
    if spec is not None and spec.calls == "required":
        return Format("", listed_calls)
    if spec is not None and spec.calls is not None:
        name = spec.calls
        return Format("", lambda text, tools: _named_call(name, text))
    if request.get("tools") and tool_parser is not None:
        return FORMATS[tool_parser]
    return None


def _named_call(name: str, text: str) -> list[Call] | None:
    try:
        json.loads(text)
    except ValueError:
        return None
    return [call(name, text.strip())]


def grammar(grammars: Grammars, spec: Spec, tools: Tools | None, parallel: bool) -> str:
    """`spec`'s grammar for the served model (a BadRequest naming the field where it cannot
    be used: llguidance's reason, or no tokenizer it reads)."""
    source = schema(spec, tools or [], parallel) if spec.kind == "json" else spec.source
    try:
        return grammars.compile(spec.kind, source)
    except ValueError as e:
        raise BadRequest(f"{spec.field}: {e}", spec.field) from None


def thinking_tags(parser: str | None, template_kwargs: Mapping[str, Any]) -> tuple[str, str] | None:
    """The (start, end) tags of the thinking block a guided chat answer's grammar waits out
    (None: none)."""
    if parser is None:
        return None
    block = reasoning.PARSERS[parser]
    if block.starts == "harmony":  # the final channel's message follows the grammar
        return f"{harmony.START}assistant", f"{harmony.CHANNEL}final{harmony.MESSAGE}"
    if block.starts == "per_request" and not reasoning.thinks(template_kwargs):
        return None
    return block.start, block.end
