"""OpenAI's wire format: completions and chat completions requests validated before any
device work (the checkpoint's defaults filled in, chat messages rendered with its own
template), and the decoding job one sample becomes."""

from __future__ import annotations

import dataclasses
import json
import queue
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flaxlm.data.vocabularies import CHAT_TEMPLATE_ARGUMENTS
from flaxlm.inference.sampling import Sampling
from flaxlm.runs.serve import guides
from flaxlm.runs.serve import tools as tools_lib
from flaxlm.runs.serve.settings import (
    SAMPLING_FIELDS,
    BadRequest,
    Defaults,
    Types,
    check_unicode,
    held,
    is_whole,
    sampling_settings,
    shown,
)

if TYPE_CHECKING:  # (serving loads neither seqio nor TensorFlow)
    import seqio

MAX_LOGPROBS = 5
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass
class Completion:
    """One sample's decoding job and the channel its events go back through."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop: list[str]
    logprobs: int | None
    seed: int
    events: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    adapter: int = 0  # the LoRA adapter the request's `model` names (0: the base)
    # `echo` with `logprobs`: the prompt's log-probs come first (a ("prompt", ...) event).
    prompt_logprobs: int | None = None
    guide: Any = None  # the grammar its tokens follow (`guides.Guide`; None: any token)
    cached_tokens: int = 0  # its prompt's tokens found in the prefix cache (the scheduler's)


_NONE = type(None)
# Every optional field may also be null (the request leaves it unset).
_COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "prompt": ((str, list), "a string or a list"),
    "logprobs": (int, "an integer"),
    "echo": (bool, "a boolean"),
    **guides.FIELDS,
    "prompt_logprobs": (int, "an integer"),  # vLLM's
    "return_token_ids": (bool, "a boolean"),  # vLLM's
}
_CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "messages": (list, "a list of messages"),
    "max_completion_tokens": (int, "an integer"),
    "logprobs": (bool, "a boolean"),
    "top_logprobs": (int, "an integer"),
    "store": (bool, "a boolean"),
    "metadata": (dict, "an object"),
    # vLLM's: variables handed to the chat template (e.g. Qwen3's `enable_thinking`), and
    # whether the assistant's turn is opened or its last message continued.
    "chat_template_kwargs": (dict, "an object"),
    "add_generation_prompt": (bool, "a boolean"),
    "continue_final_message": (bool, "a boolean"),
    "tools": (list, "a list of tools"),
    "tool_choice": ((str, dict), "'none', 'auto', 'required' or an object"),
    "parallel_tool_calls": (bool, "a boolean"),
    **guides.FIELDS,
    "prompt_logprobs": (int, "an integer"),
    "return_token_ids": (bool, "a boolean"),
}


def parse_request(
    body: bytes,
    max_positions: int | None,
    max_tokens_limit: int,
    defaults: Defaults | None = None,
) -> dict:
    """The validated fields of a `/v1/completions` body; BadRequest names what is wrong.

    Every value the engine could not serve is refused here, so that a bad request fails
    alone, never the batch it would have joined."""
    request, defaults = json_fields(body, _COMPLETION_FIELDS), defaults or Defaults()
    prompts = _prompts(request.get("prompt"))
    logprobs = request.get("logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadRequest(
            f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}.", "logprobs"
        )
    echo = bool(request.get("echo"))
    max_tokens = request.get("max_tokens")
    # OpenAI's (and vLLM's) max_tokens=0 with echo: the prompt alone, scored with logprobs.
    # The engine decodes one token (its prompt event comes first), which the answer drops.
    prompt_only = max_tokens == 0 and echo
    if max_tokens == 0 and not echo:
        raise BadRequest(
            "max_tokens=0 answers the prompt alone: it needs echo=true (with logprobs to "
            "score it).",
            "max_tokens",
        )
    if prompt_only:
        max_tokens = 1
    max_tokens = "max_tokens", defaults.max_tokens or COMPLETIONS_MAX_TOKENS, max_tokens
    return {
        "prompts": prompts,
        **sampling_settings(
            request, max_tokens, max_positions, max_tokens_limit, defaults, len(prompts)
        ),
        "logprobs": logprobs,
        "echo": echo,
        "prompt_only": prompt_only,
        "structured": guides.parse(request, None, None),
        "prompt_logprobs": _prompt_logprobs(request),
        "return_token_ids": request.get("return_token_ids", False),
        "chat": False,
    }


def _prompt_logprobs(request: dict) -> int | None:
    """vLLM's `prompt_logprobs`: each prompt token's log-prob, rank and this many most likely
    there (answered whole, as vLLM answers them)."""
    value = request.get("prompt_logprobs")
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(
            f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {value}.",
            "prompt_logprobs",
        )
    if value is not None and request.get("stream"):
        raise BadRequest(
            "prompt_logprobs are answered whole, not streamed (as vLLM); leave out stream.",
            "prompt_logprobs",
        )
    return value


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A completions request's `prompt` as a list of prompts, each a string or token ids:
    OpenAI takes a string, a list of strings, a list of token ids, or a list of those."""
    if prompt is None:
        raise BadRequest("Field 'prompt' is required.", "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and _token_ids(prompt)):
        prompts = [prompt]
    else:
        prompts = prompt
    if (
        not isinstance(prompts, list)
        or not prompts
        or not all(isinstance(p, str) or _token_ids(p) for p in prompts)
    ):
        raise BadRequest(
            "Field 'prompt' must be a string, a list of token ids, or a non-empty list of either.",
            "prompt",
        )
    for p in prompts:
        if isinstance(p, str):
            check_unicode("prompt", p)
    return prompts


def _token_ids(value: Any) -> bool:
    """A non-empty list of integers (not booleans)."""
    return isinstance(value, list) and bool(value) and all(is_whole(x) for x in value)


def parse_chat_request(
    body: bytes,
    max_positions: int | None,
    max_tokens_limit: int,
    defaults: Defaults | None = None,
) -> dict:
    """The validated fields of a `/v1/chat/completions` body, as `parse_request`'s (one
    prompt: `messages`, to render with the checkpoint's template; `max_tokens` None where
    the request and the checkpoint leave it to the room the prompt leaves)."""
    fields = json_fields(body, _CHAT_FIELDS)
    return chat_request(fields, max_positions, max_tokens_limit, defaults)


def chat_request(
    request: dict,
    max_positions: int | None,
    max_tokens_limit: int,
    defaults: Defaults | None = None,
    max_key: str | None = None,
) -> dict:
    """`parse_chat_request` of a body's fields (`json_fields`' dict; the Responses API hands
    its request so, `responses.py`); `max_key`: the field holding max tokens (None: chat's
    `max_completion_tokens` or `max_tokens`)."""
    defaults = defaults or Defaults()
    if request.get("store"):
        raise BadRequest("store=true: flaxlm keeps no completions to retrieve.", "store")
    if request.get("messages") is None:
        raise BadRequest("Field 'messages' is required.", "messages")
    messages = _messages(request["messages"])
    template_kwargs = request.get("chat_template_kwargs") or {}
    reserved = sorted(set(template_kwargs) & CHAT_TEMPLATE_ARGUMENTS)
    if reserved:
        raise BadRequest(
            f"chat_template_kwargs {reserved} are apply_chat_template's own arguments, not the "
            "template's variables.",
            "chat_template_kwargs",
        )
    continued = request.get("continue_final_message", False)
    if continued and request.get("add_generation_prompt"):
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    top = request.get("top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise BadRequest(
            f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {top}.", "top_logprobs"
        )
    if top is not None and not request.get("logprobs"):
        raise BadRequest("top_logprobs needs logprobs set to true.", "top_logprobs")
    key = max_key or (
        "max_completion_tokens" if "max_completion_tokens" in request else "max_tokens"
    )
    max_tokens = key, defaults.max_tokens, request.get(key)
    tools = tools_lib.check_tools(request.get("tools") or [])
    choice = tools_lib.tool_choice(request.get("tool_choice"), tools)
    return {
        "messages": messages,
        "chat_template_kwargs": template_kwargs,
        # vLLM's: the assistant's turn opened (the default), or its last message continued.
        "add_generation_prompt": request.get("add_generation_prompt", not continued),
        "continue_final_message": continued,
        # As vLLM: with tool_choice 'none' the tools are not shown to the model.
        "tools": tools if choice != "none" else None,
        "tool_choice": choice,
        "structured": guides.parse(request, tools, choice),
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        **sampling_settings(request, max_tokens, max_positions, max_tokens_limit, defaults, 1),
        "logprobs": (top or 0) if request.get("logprobs") else None,
        "prompt_logprobs": _prompt_logprobs(request),
        "return_token_ids": request.get("return_token_ids", False),
        "echo": False,
        "chat": True,
    }


def render_chat(
    vocabulary: seqio.Vocabulary,
    messages: list[dict[str, Any]],
    template_kwargs: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """`messages` as the checkpoint's own chat template renders them, ending with the
    assistant's turn opened (HF's `apply_chat_template(add_generation_prompt=True)`): the
    text the model was fine-tuned on, so it answers as it learned to. `template_kwargs`:
    variables the template reads (a request's `chat_template_kwargs`); `tools`: the
    request's, which the template shows the model; `add_generation_prompt`,
    `continue_final_message`: `apply_chat_template`'s (vLLM's request fields)."""
    tokenizer = getattr(vocabulary, "tokenizer", None)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BadRequest(
            "This checkpoint's tokenizer has no chat template, so chat messages cannot be "
            "rendered; send the text to /v1/completions as a prompt instead.",
            "messages",
        )
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as e:  # noqa: BLE001 - the template's raise_exception (e.g. role order)
        raise BadRequest(f"The chat template refused the messages: {e}", "messages") from e


def check_prompt_ids(
    ids: Sequence[int], max_tokens: int, max_positions: int | None, vocab_size: int
) -> None:
    """Raises BadRequest unless the tokenized prompt fits the model: not empty, every id in
    its vocabulary, and room for `max_tokens` more in its positions."""
    if not ids:
        raise BadRequest("The prompt is empty after tokenization.", "prompt")
    outside = sorted({i for i in ids if not 0 <= i < vocab_size})
    if outside:
        raise BadRequest(
            f"The prompt has token ids {outside[:5]} outside the model's vocabulary of "
            f"{vocab_size}; the server's tokenizer does not match the model."
        )
    if max_positions is not None and len(ids) + max_tokens > max_positions:
        raise BadRequest(
            f"The prompt has {len(ids)} tokens; with max_tokens={max_tokens} "
            f"that is beyond {held(max_positions)}.",
            "max_tokens",
        )


def json_fields(body: bytes, fields: dict[str, tuple[Types, str]]) -> dict:
    """The body's JSON object, every field known and of its type; null fields dropped."""
    try:
        request = json.loads(body or b"")
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, 4300+ digits, deep nesting
        raise BadRequest(f"The body is not valid JSON: {_first_line(e)}.") from e
    if not isinstance(request, dict):
        raise BadRequest("The body must be a JSON object.")
    for key, value in request.items():
        if key not in fields:
            raise BadRequest(f"Unknown field {key!r}; supported: {sorted(fields)}.", key)
        types, what = fields[key]
        if value is None:
            continue
        if not isinstance(value, types) or (
            isinstance(value, bool) and bool not in _as_tuple(types)
        ):
            raise BadRequest(f"Field {key!r} must be {what} or null, got {shown(value)}.", key)
    return {k: v for k, v in request.items() if v is not None}


# What a message may carry besides its role and content, handed to the chat template as it
# is (templates render a name, an assistant's tool calls and a tool result's call id; vLLM
# passes them on alike), with the JSON type each must have.
_MESSAGE_EXTRAS = {
    "name": (str, "a string"),
    "tool_calls": (list, "a list of tool calls"),
    "tool_call_id": (str, "a string"),
    "reasoning_content": (str, "a string"),
    "reasoning": (str, "a string"),
}


def _message_extras(message: dict, where: str) -> dict[str, Any]:
    """A message's fields beyond role and content for its template: `_MESSAGE_EXTRAS` (a tool
    call's JSON `arguments` parsed into the object templates expect, as vLLM does); the null
    or empty fields a client echoes back from a response (`refusal`, `audio`, ...) dropped;
    anything else a BadRequest naming it."""
    extras: dict[str, Any] = {}
    for key, value in message.items():
        if key in ("role", "content") or value in (None, [], {}):
            continue
        if key not in _MESSAGE_EXTRAS:
            raise BadRequest(
                f"{where}.{key} is not supported (a message may carry "
                f"{['role', 'content', *_MESSAGE_EXTRAS]}).",
                f"{where}.{key}",
            )
        kind, described = _MESSAGE_EXTRAS[key]
        if not isinstance(value, kind):
            raise BadRequest(f"{where}.{key} must be {described}.", f"{where}.{key}")
        extras[key] = value
    if "reasoning" in extras:  # vLLM's name in an answer, templates' (Qwen3's) in a history
        extras.setdefault("reasoning_content", extras["reasoning"])
    for i, call in enumerate(extras.get("tool_calls", [])):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(
                f"{where}.tool_calls[{i}] must be an object with a function's name and arguments.",
                f"{where}.tool_calls",
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise BadRequest(
                    f"{where}.tool_calls[{i}].function.arguments must be a JSON object.",
                    f"{where}.tool_calls",
                ) from None
        extras["tool_calls"][i] = {**call, "function": {**function, "arguments": arguments}}
    return extras


def _messages(value: list) -> list[dict[str, Any]]:
    """Chat messages as templates read them: a role, a string content (text parts joined by
    newlines, as vLLM joins them) and the fields a template renders besides
    (`_message_extras`)."""
    if not value:
        raise BadRequest("Field 'messages' must be a non-empty list of messages.", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where} must be an object, got {shown(message)}.", where)
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(
                f"{where}.role must be one of {list(ROLES)}, got {shown(role)}.", f"{where}.role"
            )
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        content = message_text(content, where)
        out.append({"role": role, "content": content, **_message_extras(message, where)})
    return out


def message_text(content: Any, where: str, parts: tuple[str, ...] = ("text",)) -> str:
    """A message's content as a chat template reads it: a string, or text parts (of the
    types `parts`) joined by newlines, as vLLM joins them."""
    if isinstance(content, list):
        if not all(
            isinstance(p, dict) and p.get("type") in parts and isinstance(p.get("text"), str)
            for p in content
        ):
            raise BadRequest(
                f"{where}.content: only text parts ({{'type': '{parts[0]}', 'text': ...}}) are "
                "supported (no images, files or audio).",
                f"{where}.content",
            )
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise BadRequest(
            f"{where}.content must be a string or a list of text parts, got {shown(content)}.",
            f"{where}.content",
        )
    check_unicode(f"{where}.content", content)
    return content


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _as_tuple(types: Types) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)
