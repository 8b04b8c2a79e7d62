"""Structured outputs, as vLLM serves them: each token of a guided answer is chosen among
those its grammar allows next (llguidance computes the set; `sampling.select` masks the
rest), so the answer always parses.

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

JSON is written as Python's `json.dumps` writes it (`", "` and `": "`, no other
whitespace): vLLM allows any whitespace there by default, which a model may fill without
end; a schema's `"x-guidance": {"whitespace_flexible": true}` asks for that instead.

With a reasoning parser (`reasoning.py`), the grammar starts after the thinking block ends,
as vLLM's does: where the prompt leaves the block open or a thinking answer may open one,
the answer thinks freely and its closing tag starts the grammar (gpt-oss's harmony: its
final channel's `<|channel|>final<|message|>`). Where the answer ends
before its grammar is satisfied (`max_tokens`), it is cut (finish reason `length`).

The grammar needs the checkpoint's HF tokenizer (a fast one); each guided row decodes one
token per engine dispatch (its next set depends on the token it chose)."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flaxlm.runs.serve import harmony, reasoning
from flaxlm.runs.serve.settings import BadRequest, shown
from flaxlm.runs.serve.tool_formats import FORMATS, Call, Format, Tools, call

FIELDS = {
    "response_format": (dict, "an object"),
    "structured_outputs": (dict, "an object"),
}
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


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
        return Format("", _listed_calls)
    if spec is not None and spec.calls is not None:
        name = spec.calls
        return Format("", lambda text, tools: _named_call(name, text))
    if request.get("tools") and tool_parser is not None:
        return FORMATS[tool_parser]
    return None


def _listed_calls(text: str, tools: Tools) -> list[Call] | None:
    try:
        listed = json.loads(text)
    except ValueError:
        return None
    if not isinstance(listed, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) for c in listed
    ):
        return None
    return [call(c["name"], c.get("parameters", {})) for c in listed] or None


def _named_call(name: str, text: str) -> list[Call] | None:
    try:
        json.loads(text)
    except ValueError:
        return None
    return [call(name, text.strip())]


class Guide:
    """One guided row's grammar (`inference.jobs.Guide`): an llguidance matcher, the row's
    stop tokens (allowed wherever the grammar may end) and, with a reasoning parser, the
    tokens of the thinking block's closing tag it waits for first."""

    def __init__(self, matcher: Any, stops: Sequence[int], wait_for: Sequence[int] = ()):
        self.matcher, self.stops = matcher, list(stops)
        self.wait_for, self.tail = list(wait_for), []

    def fill(self, row: np.ndarray) -> None:
        if self.wait_for:
            row[:] = -1
            return
        if self.matcher.is_error():
            row[:] = 0
        else:
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self.matcher.is_error() or self.matcher.is_accepting():
            bits = row.view(np.uint32)
            for t in self.stops:
                if t < 32 * row.size:
                    bits[t // 32] |= np.uint32(1 << (t % 32))

    def advance(self, token: int) -> None:
        if self.wait_for:
            self.tail = (self.tail + [token])[-len(self.wait_for) :]
            if self.tail == self.wait_for:
                self.wait_for = []
            return
        self.matcher.consume_token(token)


class Guides:
    """A server's guides: the tokenizer llguidance reads (built at the first guided request,
    a second or so for a large vocabulary) and a `Guide` per guided job."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]):
        self.hf_tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, list(eos_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def tokenizer(self, field: str) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                import transformers

                if not isinstance(self.hf_tokenizer, transformers.PreTrainedTokenizerFast):
                    raise BadRequest(
                        f"{field}: structured outputs read the checkpoint's HF tokenizer (a "
                        "fast one, tokenizer.json); this server has none.",
                        field,
                    )
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids or None
                )
            return self._tokenizer

    def grammar(self, spec: Spec, tools: Tools | None, parallel: bool) -> str:
        """`spec`'s grammar, checked (a BadRequest where llguidance cannot use it)."""
        import llguidance

        tokenizer = self.tokenizer(spec.field)
        if spec.kind == "json":
            layout = {**JSON_LAYOUT}
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema(spec, tools or [], parallel), defaults=layout
            )
        elif spec.kind == "choice":
            grammar = llguidance.grammar_from("choice", spec.source)
        else:
            try:
                grammar = llguidance.grammar_from(spec.kind, spec.source)
            except ValueError as e:
                raise BadRequest(f"{spec.field}.{spec.kind}: {e}", spec.field) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise BadRequest(f"{spec.field}: {error.splitlines()[0]}", spec.field)
        return grammar

    def new(
        self, grammar: str, stops: Sequence[int], prompt: Sequence[int], block: Any = None
    ) -> Guide:
        """A row's guide; `block`: the reasoning parser's thinking block (`reasoning.Block`),
        whose end it waits for unless the prompt has closed it."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer("structured_outputs"), grammar, log_level=0)
        wait = ()
        if block is not None and not _closed(prompt, self._ids(block.start), self._ids(block.end)):
            wait = self._ids(block.end)
        return Guide(matcher, stops, wait)

    def _ids(self, text: str) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=False))


def _closed(prompt: Sequence[int], start: list[int], end: list[int]) -> bool:
    """Whether `prompt`'s last thinking block is closed (its end tag after its last start)."""
    text = list(prompt)

    def last(tag: list[int]) -> int:
        for at in range(len(text) - len(tag), -1, -1):
            if text[at : at + len(tag)] == tag:
                return at
        return -1

    return last(end) > last(start) if end else True


def reasoning_block(parser: str | None, template_kwargs: Mapping[str, Any]) -> Any:
    """The thinking block a guided chat answer's grammar waits out (None: none)."""
    if parser is None:
        return None
    block = reasoning.PARSERS[parser]
    if block.starts == "harmony":  # the final channel's message follows the grammar
        final = f"{harmony.CHANNEL}final{harmony.MESSAGE}"
        return reasoning.Block(f"{harmony.START}assistant", final, "harmony")
    if block.starts == "per_request" and not reasoning.thinks(template_kwargs):
        return None
    return block
