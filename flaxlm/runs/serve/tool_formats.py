"""How each model family writes tool calls in its answers, read as vLLM's parser of the same
name reads them (`--tool-call-parser NAME`). Each `Format` says where an answer's calls start
(the text before is its content) and reads the calls from there; `read` gives an answer's
`(content, calls)`, or `(text, [])` where the calls do not parse (all of it content, as vLLM
leaves it).

- `hermes` (Hermes, Qwen2.5, Qwen3, QwQ): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks (a last block left open is read too).
- `llama3_json` (Llama 3.1-3.3): an answer of `{"name": ..., "parameters": {...}}` objects
  joined by `; `, from its first character (`<|python_tag|>` before it allowed).
- `pythonic` (Llama 3.2, Llama 4 with their pythonic templates), `llama4_pythonic` (Llama
  4, `<|python_start|>` before it allowed): an answer that is a Python list of calls with
  literal keyword arguments, `[get_weather(city="Paris"), ...]`.
- `qwen3_coder` (Qwen3-Coder, Qwen3-Next, Qwen3.5): `<tool_call><function=NAME>` with a
  `<parameter=KEY>value</parameter>` per argument, `</function></tool_call>`; `seed_oss`
  (Seed-OSS): the same in `<seed:tool_call>` blocks.
- `glm45` / `glm47` (GLM-4.5 to GLM-5): `<tool_call>NAME` then `<arg_key>KEY</arg_key>
  <arg_value>value</arg_value>` pairs, `</tool_call>`.
- `deepseek_v3` (DeepSeek-V3, R1), `deepseek_v31` (V3.1), `deepseek_v32` (V3.2's DSML:
  `<｜DSML｜invoke name=...>` with `<｜DSML｜parameter name=... string="true|false">`).
- `kimi_k2` (Kimi K2): `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{...}
  <|tool_call_end|>` in a calls section; the call's id is `functions.NAME:N`, as Kimi's
  template renders it back.
- `mistral` (Mistral, Magistral, Devstral): `[TOOL_CALLS]NAME[ARGS]{...}` per call, or the
  older `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; ids of 9 letters and digits,
  which Mistral's templates require.
- `openai` (gpt-oss): harmony's commentary messages to `functions.NAME`, as the
  `openai_gptoss` reasoning parser hands them on (`harmony.py`).

Arguments written as text (the XML formats) are typed by the tool's JSON schema: a string
parameter keeps its text, any other is read as JSON (then as a Python literal), else kept as
text."""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import re
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flaxlm.runs.serve import harmony
from flaxlm.runs.serve.stream import prefix_at_end

Call = dict[str, Any]
Tools = Sequence[Mapping[str, Any]]
PYTHON_TAG = "<|python_tag|>"


@dataclasses.dataclass(frozen=True)
class Format:
    """One family's way of writing calls: `marker` starts them (anywhere in the answer;
    `at_start`: only as its first characters, as `alternatives` too); `calls` reads the
    text from the marker on (None: it does not parse)."""

    marker: str
    calls: Callable[[str, Tools], list[Call] | None]
    at_start: bool = False
    alternatives: tuple[str, ...] = ()

    def start(self, text: str, sent: int) -> tuple[int | None, int]:
        """(Where the calls start in `text`, None if they have not; how many of its last
        characters may still begin them); the first `sent` characters, already content,
        hold none."""
        if not self.at_start:
            at = text.find(self.marker, sent)
            return (at, 0) if at >= 0 else (None, prefix_at_end(text, self.marker))
        if sent or not text:
            return None, 0
        openers = (self.marker, *self.alternatives)
        if any(text.startswith(o) for o in openers):
            return 0, 0
        return None, len(text) if any(o.startswith(text) for o in openers) else 0


def read(fmt: Format, text: str, tools: Tools) -> tuple[str | None, list[Call]]:
    """`(content, calls)` of a whole answer: the text before the calls (None where blank)
    and the calls; `(text, [])` where there are none or they do not parse."""
    start, _ = fmt.start(text, 0)
    if start is None:
        return text, []
    calls = fmt.calls(text[start:], tools)
    if not calls:
        return text, []
    content = text[:start]
    return (content if content.strip() else None), calls


def call(name: str, arguments: Any, ident: str | None = None) -> Call:
    """A call in OpenAI's shape: an id, the function's name, its arguments as JSON text."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": ident or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _typed(text: str, as_text: bool) -> Any:
    """An argument written as text: kept (`as_text`), else read as JSON, then as a Python
    literal, else kept."""
    if as_text:
        return text
    for reader in (json.loads, ast.literal_eval):
        try:
            return reader(text.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return text


def _schema_type(tools: Tools, name: str, key: str) -> str | None:
    """The JSON schema type of function `name`'s parameter `key` (None: not given)."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            prop = ((function.get("parameters") or {}).get("properties") or {}).get(key)
            kind = prop.get("type") if isinstance(prop, dict) else None
            return kind if isinstance(kind, str) else None
    return None


def _blocks(text: str, open_: str, close: str, last_open: bool = True) -> list[str]:
    """The bodies of the `open_ ... close` blocks in `text` (what lies between them is not
    read, as vLLM's `findall`); a last block left open is read too where `last_open`."""
    out, at = [], 0
    while (begin := text.find(open_, at)) >= 0:
        begin += len(open_)
        end = text.find(close, begin)
        if end < 0:
            if last_open:
                out.append(text[begin:])
            break
        out.append(text[begin:end])
        at = end + len(close)
    return out


def _named(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("name"), str)


def _json_call(obj: dict[str, Any]) -> Call:
    """The call a `{"name", "arguments" (or "parameters")}` object writes."""
    return call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def listed_calls(text: str, tools: Tools) -> list[Call] | None:
    """A JSON list of `{"name", "parameters"}` objects (what `tool_choice` 'required' forces,
    as vLLM's schema has it)."""
    try:
        listed = json.loads(text)
    except ValueError:
        return None
    if not isinstance(listed, list) or not listed or not all(_named(c) for c in listed):
        return None
    return [_json_call(c) for c in listed]


def _hermes(text: str, tools: Tools) -> list[Call] | None:
    calls = []
    for body in _blocks(text, "<tool_call>", "</tool_call>"):
        obj = _json_object(body.strip())
        if not _named(obj):
            return None
        calls.append(_json_call(obj))
    return calls


def _llama3_json(text: str, tools: Tools) -> list[Call] | None:
    decoder, objects = json.JSONDecoder(), []
    at = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
    try:
        while at < len(text):
            obj, length = decoder.raw_decode(text[at:])
            objects.append(obj)
            at += length + len("; ")
    except ValueError:
        return None
    if not all(_named(o) for o in objects):
        return None
    return [_json_call(o) for o in objects]


PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


def _pythonic(text: str, tools: Tools) -> list[Call] | None:
    """A Python list of calls with literal keyword arguments, `[f(a=1), g(b="x")]` (Llama 4
    between `<|python_start|>` and `<|python_end|>` where it writes them)."""
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START) :].removesuffix(PYTHON_END).strip()
    try:
        listed = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(listed, ast.List) or not listed.elts:
        return None
    calls = []
    for node in listed.elts:
        if (
            not isinstance(node, ast.Call)
            or not isinstance(node.func, ast.Name)
            or node.args
            or any(k.arg is None for k in node.keywords)
        ):
            return None
        try:  # literals JSON can hold (not sets or bytes)
            arguments = json.dumps({k.arg: ast.literal_eval(k.value) for k in node.keywords})
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append(call(node.func.id, arguments))
    return calls


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_PARAMETER = re.compile(
    r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL
)


def _function_blocks(open_: str, close: str) -> Callable[[str, Tools], list[Call] | None]:
    """Qwen3-Coder's calls (`<function=NAME>` with `<parameter=KEY>` blocks) in `open_ ...
    close` blocks."""

    def calls_of(text: str, tools: Tools) -> list[Call] | None:
        calls = []
        for body in _blocks(text, open_, close):
            match = _FUNCTION.match(body)
            if match is None:
                return None
            name, arguments = match.group(1).strip(), {}
            for key, value in _PARAMETER.findall(match.group(2)):
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                kind = _schema_type(tools, name, key.strip())
                arguments[key.strip()] = _typed(value, kind in (None, "string"))
            calls.append(call(name, arguments))
        return calls

    return calls_of


_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm(text: str, tools: Tools) -> list[Call] | None:
    calls = []
    for body in _blocks(text, "<tool_call>", "</tool_call>", last_open=False):
        name = re.split(r"\n|<arg_key>", body, maxsplit=1)[0].strip()
        if not name:
            return None
        arguments = {
            key.strip(): _typed(value, _schema_type(tools, name, key.strip()) == "string")
            for key, value in _ARGUMENT.findall(body)
        }
        calls.append(call(name, arguments))
    return calls


_DS_CALL = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
_DS_SEP = "<｜tool▁sep｜>"
_DS_V3_ARGUMENTS = re.compile(r"(.*?)\n```json\n(.*?)\n```\s*\Z", re.DOTALL)


def _deepseek(v3: bool) -> Callable[[str, Tools], list[Call] | None]:
    def calls_of(text: str, tools: Tools) -> list[Call] | None:
        body = text[len("<｜tool▁calls▁begin｜>") :].split("<｜tool▁calls▁end｜>")[0]
        calls = []
        for block in _blocks(body, *_DS_CALL, last_open=False):
            head, sep, rest = block.partition(_DS_SEP)
            if v3:  # `function<sep>NAME\n```json\n{...}\n````
                match = _DS_V3_ARGUMENTS.match(rest)
                name, rest = (match.group(1), match.group(2)) if match else ("", "")
            else:
                name = head
            arguments = _json_object(rest.strip())
            if not (sep and name.strip() and arguments is not None):
                return None
            calls.append(call(name.strip(), arguments))
        return calls

    return calls_of


_DSML = "｜DSML｜"
_INVOKE = re.compile(rf'<{_DSML}invoke\s+name="([^"]+)"\s*>(.*?)</{_DSML}invoke>', re.DOTALL)
_DSML_PARAMETER = re.compile(
    rf'<{_DSML}parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>(.*?)</{_DSML}parameter>',
    re.DOTALL,
)


def _deepseek_v32(text: str, tools: Tools) -> list[Call] | None:
    end = text.find(f"</{_DSML}function_calls>")
    if end < 0:
        return None
    calls = []
    for name, body in _INVOKE.findall(text[:end]):
        arguments = {
            key: _typed(value, as_text == "true")
            for key, as_text, value in _DSML_PARAMETER.findall(body)
        }
        calls.append(call(name, arguments))
    return calls


_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*([\w.\-]+:\d+)\s*<\|tool_call_argument_begin\|>\s*(.*?)\s*"
    r"<\|tool_call_end\|>",
    re.DOTALL,
)


def _kimi_k2(text: str, tools: Tools) -> list[Call] | None:
    section = text.split("<|tool_calls_section_end|>")[0]
    calls = []
    for ident, arguments in _KIMI_CALL.findall(section):
        parsed = _json_object(arguments)
        if parsed is None:
            return None
        calls.append(call(ident.split(":")[0].split(".")[-1], parsed, ident))
    return calls


def _mistral_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def _mistral(text: str, tools: Tools) -> list[Call] | None:
    pieces = [p for p in text.split("[TOOL_CALLS]") if p.strip()]
    calls = []
    for piece in pieces:
        name, sep, arguments = piece.partition("[ARGS]")
        if sep:  # tokenizers v11 on: NAME[ARGS]{...}
            parsed = _json_object(arguments.strip())
            if not name.strip() or parsed is None:
                return None
            calls.append(call(name.strip(), parsed, _mistral_id()))
            continue
        try:
            listed = json.loads(piece.strip())
        except ValueError:
            return None
        for obj in listed if isinstance(listed, list) else [listed]:
            if not _named(obj):
                return None
            calls.append(call(obj["name"], obj.get("arguments", {}), _mistral_id()))
    return calls


_HARMONY_CALL = re.compile(
    re.escape(harmony.CALL) + r"functions\.([^<\s]+)" + re.escape(harmony.MESSAGE)
    + r"(.*?)(?:" + re.escape(harmony.END) + r"|\Z)",
    re.DOTALL,
)  # fmt: skip


def _openai(text: str, tools: Tools) -> list[Call] | None:
    calls = []
    for name, arguments in _HARMONY_CALL.findall(text):
        parsed = _json_object(arguments.strip())
        if parsed is None:
            return None
        calls.append(call(name, parsed))
    return calls


_GLM = Format("<tool_call>", _glm)
FORMATS: dict[str, Format] = {
    "hermes": Format("<tool_call>", _hermes),
    "llama3_json": Format("{", _llama3_json, at_start=True, alternatives=(PYTHON_TAG,)),
    "pythonic": Format("[", _pythonic, at_start=True),
    "llama4_pythonic": Format("[", _pythonic, at_start=True, alternatives=(PYTHON_START,)),
    "qwen3_coder": Format("<tool_call>", _function_blocks("<tool_call>", "</tool_call>")),
    "seed_oss": Format(
        "<seed:tool_call>", _function_blocks("<seed:tool_call>", "</seed:tool_call>")
    ),
    "glm45": _GLM,
    "glm47": _GLM,
    "deepseek_v3": Format("<｜tool▁calls▁begin｜>", _deepseek(True)),
    "deepseek_v31": Format("<｜tool▁calls▁begin｜>", _deepseek(False)),
    "deepseek_v32": Format(f"<{_DSML}function_calls>", _deepseek_v32),
    "kimi_k2": Format("<|tool_calls_section_begin|>", _kimi_k2),
    "mistral": Format("[TOOL_CALLS]", _mistral),
    "openai": Format(harmony.CALL, _openai),
}
