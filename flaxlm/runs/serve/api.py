"""OpenAI's wire format: completions and chat completions requests validated before any
device work (the checkpoint's defaults filled in, chat messages rendered with its own
template), and the decoding job one sample becomes."""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flaxlm.inference.sampling import Sampling

if TYPE_CHECKING:  # (serving loads neither seqio nor TensorFlow)
    import seqio

MAX_LOGPROBS = 5
MAX_LOGIT_BIAS = 300  # tokens a request's logit_bias may name (OpenAI's limit)
MAX_CHOICES = 16  # n x prompts of one request: each is a row of the engine's batches
SEED_LIMIT = 2**32  # the engine seeds each row's RNG with a uint32
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(ValueError):
    """A request the server answers with `status` (400) and a message; `param` names the
    field at fault (OpenAI's error `param`), None when it is the body as a whole; `code` is
    OpenAI's error `code` where it has one."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


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


@dataclasses.dataclass(frozen=True)
class Defaults:
    """The settings a request gets where it leaves them unset or null: the checkpoint's
    `generation_config.json` where it sets them (as vLLM reads it: `temperature`, `top_p`,
    `top_k`, `min_p`, `repetition_penalty`, `max_new_tokens`; `do_sample` is not
    consulted), else OpenAI's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # None: 16 for completions, what is left for chat

    @classmethod
    def from_generation_config(
        cls, config: Mapping[str, Any] | None, max_tokens_limit: int
    ) -> Defaults:
        """Those of an HF `generation_config.json` (None: OpenAI's); values out of the
        API's ranges are ignored, `max_new_tokens` is capped at `max_tokens_limit`."""
        config = config or {}

        def number(key: str, low: float, high: float, default: float) -> float:
            value = config.get(key)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            return float(value) if ok and low <= value <= high else default

        max_new = config.get("max_new_tokens")
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            max_new = None
        return cls(
            temperature=number("temperature", 0.0, 2.0, 1.0),
            top_p=number("top_p", 1e-9, 1.0, 1.0),
            top_k=top_k if _whole(top_k := config.get("top_k")) and top_k >= 0 else 0,
            min_p=number("min_p", 0.0, 1.0, 0.0),
            repetition_penalty=number("repetition_penalty", 1e-9, math.inf, 1.0),
            max_tokens=None if max_new is None else min(max_new, max_tokens_limit),
        )


_Types = type | tuple[type, ...]
_NONE = type(None)
# Every optional field may also be null (the request leaves it unset).
_SAMPLING: dict[str, tuple[_Types, str]] = {
    "model": (str, "a string"),
    "max_tokens": (int, "an integer"),
    "temperature": ((int, float), "a number"),
    "top_p": ((int, float), "a number"),
    "stop": ((str, list), "a string, a list of strings"),
    "stream": (bool, "a boolean"),
    "stream_options": (dict, "an object"),
    "seed": (int, "an integer"),
    "n": (int, "an integer"),
    "user": (str, "a string"),
    "frequency_penalty": ((int, float), "a number"),
    "presence_penalty": ((int, float), "a number"),
    # vLLM's sampling parameters beyond OpenAI's (the client's `extra_body`).
    "top_k": (int, "an integer"),
    "min_p": ((int, float), "a number"),
    "repetition_penalty": ((int, float), "a number"),
    "min_tokens": (int, "an integer"),
    "logit_bias": (dict, "an object"),
}
_COMPLETION_FIELDS = {
    **_SAMPLING,
    "prompt": ((str, list), "a string or a list of strings"),
    "logprobs": (int, "an integer"),
    "echo": (bool, "a boolean"),
}
_CHAT_FIELDS = {
    **_SAMPLING,
    "messages": (list, "a list of messages"),
    "max_completion_tokens": (int, "an integer"),
    "logprobs": (bool, "a boolean"),
    "top_logprobs": (int, "an integer"),
    "store": (bool, "a boolean"),
    "metadata": (dict, "an object"),
    # vLLM's: variables handed to the chat template (e.g. Qwen3's `enable_thinking`).
    "chat_template_kwargs": (dict, "an object"),
}
# apply_chat_template's own arguments, not the template's variables.
_TEMPLATE_ARGUMENTS = {
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
}  # fmt: skip


def parse_request(
    body: bytes,
    max_positions: int | None,
    max_tokens_limit: int,
    defaults: Defaults | None = None,
) -> dict:
    """The validated fields of a `/v1/completions` body; BadRequest names what is wrong.

    Every value the engine could not serve is refused here, so that a bad request fails
    alone, never the batch it would have joined."""
    request, defaults = _fields(body, _COMPLETION_FIELDS), defaults or Defaults()
    prompt = request.get("prompt")
    if prompt is None:
        raise BadRequest("Field 'prompt' is required.", "prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(
            "Field 'prompt' must be a string or a non-empty list of strings.", "prompt"
        )
    for p in prompts:
        _check_unicode("prompt", p)
    logprobs = request.get("logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadRequest(
            f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}.", "logprobs"
        )
    if logprobs is not None and request.get("echo"):
        raise BadRequest(
            "echo with logprobs asks for the prompt's log-probabilities too, which flaxlm does "
            "not return; leave out echo (or logprobs).",
            "echo",
        )
    max_tokens = request.get("max_tokens")
    max_tokens = "max_tokens", defaults.max_tokens or COMPLETIONS_MAX_TOKENS, max_tokens
    return {
        "prompts": prompts,
        **_sampling(request, max_tokens, max_positions, max_tokens_limit, defaults, len(prompts)),
        "logprobs": logprobs,
        "echo": bool(request.get("echo")),
        "chat": False,
    }


def parse_chat_request(
    body: bytes,
    max_positions: int | None,
    max_tokens_limit: int,
    defaults: Defaults | None = None,
) -> dict:
    """The validated fields of a `/v1/chat/completions` body, as `parse_request`'s (one
    prompt: `messages`, to render with the checkpoint's template; `max_tokens` None where
    the request and the checkpoint leave it to the room the prompt leaves)."""
    request, defaults = _fields(body, _CHAT_FIELDS), defaults or Defaults()
    if request.get("store"):
        raise BadRequest("store=true: flaxlm keeps no completions to retrieve.", "store")
    if request.get("messages") is None:
        raise BadRequest("Field 'messages' is required.", "messages")
    messages = _messages(request["messages"])
    template_kwargs = request.get("chat_template_kwargs") or {}
    reserved = sorted(set(template_kwargs) & _TEMPLATE_ARGUMENTS)
    if reserved:
        raise BadRequest(
            f"chat_template_kwargs {reserved} are apply_chat_template's own arguments, not the "
            "template's variables.",
            "chat_template_kwargs",
        )
    top = request.get("top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise BadRequest(
            f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {top}.", "top_logprobs"
        )
    if top is not None and not request.get("logprobs"):
        raise BadRequest("top_logprobs needs logprobs set to true.", "top_logprobs")
    key = "max_completion_tokens" if "max_completion_tokens" in request else "max_tokens"
    max_tokens = key, defaults.max_tokens, request.get(key)
    return {
        "messages": messages,
        "chat_template_kwargs": template_kwargs,
        **_sampling(request, max_tokens, max_positions, max_tokens_limit, defaults, 1),
        "logprobs": (top or 0) if request.get("logprobs") else None,
        "echo": False,
        "chat": True,
    }


def render_chat(
    vocabulary: seqio.Vocabulary,
    messages: list[dict[str, Any]],
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """`messages` as the checkpoint's own chat template renders them, ending with the
    assistant's turn opened (HF's `apply_chat_template(add_generation_prompt=True)`): the
    text the model was fine-tuned on, so it answers as it learned to. `template_kwargs`:
    variables the template reads (a request's `chat_template_kwargs`)."""
    tokenizer = getattr(vocabulary, "tokenizer", None)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BadRequest(
            "This checkpoint's tokenizer has no chat template, so chat messages cannot be "
            "rendered; send the text to /v1/completions as a prompt instead.",
            "messages",
        )
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
    except Exception as e:  # noqa: BLE001 - the template's raise_exception (e.g. role order)
        raise BadRequest(f"The chat template refused the messages: {e}", "messages") from e


def sample_seeds(seed: int | None, n: int) -> list[int]:
    """The seeds of a prompt's `n` samples: `seed`, `seed + 1`, ... (so sample 0 is the
    n=1 answer with the same seed); a random start where the request sets none."""
    start = secrets.randbelow(SEED_LIMIT) if seed is None else seed
    return [(start + i) % SEED_LIMIT for i in range(n)]


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
            f"that is beyond the model's {max_positions} positions.",
            "max_tokens",
        )


def _fields(body: bytes, fields: dict[str, tuple[_Types, str]]) -> dict:
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
            raise BadRequest(f"Field {key!r} must be {what} or null, got {_shown(value)}.", key)
    return {k: v for k, v in request.items() if v is not None}


def _sampling(
    request: dict,
    max_tokens: tuple[str, int | None, int | None],
    max_positions: int | None,
    max_tokens_limit: int,
    defaults: Defaults,
    prompts: int,
) -> dict:
    """The settings both endpoints share. `max_tokens`: the field's name, its default and
    the request's value."""
    key, default, value = max_tokens
    value = default if value is None else value
    if value is not None:
        if not 1 <= value <= max_tokens_limit:
            raise BadRequest(f"{key} must be between 1 and {max_tokens_limit}, got {value}.", key)
        if max_positions is not None and value >= max_positions:
            raise BadRequest(
                f"{key}={value} leaves no room for a prompt in the model's "
                f"{max_positions} positions.",
                key,
            )
    temperature = _number(request, "temperature", defaults.temperature)
    if not 0.0 <= temperature <= 2.0:
        raise BadRequest(f"temperature must be between 0 and 2, got {temperature}.", "temperature")
    top_p = _number(request, "top_p", defaults.top_p)
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.", "top_p")
    top_k = request.get("top_k", defaults.top_k)
    if top_k < -1:
        raise BadRequest(f"top_k must be -1 or 0 (no limit) or at least 1, got {top_k}.", "top_k")
    min_p = _number(request, "min_p", defaults.min_p)
    if not 0.0 <= min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {min_p}.", "min_p")
    penalties = {}
    for key in ("presence_penalty", "frequency_penalty"):
        penalties[key] = _number(request, key, 0.0)
        if not -2.0 <= penalties[key] <= 2.0:
            raise BadRequest(f"{key} must be between -2 and 2, got {penalties[key]}.", key)
    repetition = _number(request, "repetition_penalty", defaults.repetition_penalty)
    if not repetition > 0.0:
        raise BadRequest(
            f"repetition_penalty must be > 0 (1: none), got {repetition}.", "repetition_penalty"
        )
    min_tokens = request.get("min_tokens", 0)
    if not 0 <= min_tokens <= (value or max_tokens_limit):
        raise BadRequest(
            f"min_tokens must be between 0 and max_tokens ({value or max_tokens_limit}), got "
            f"{min_tokens}.",
            "min_tokens",
        )
    settings = Sampling(
        temperature, top_p, max(top_k, 0), min_p, **penalties,
        repetition_penalty=repetition, min_tokens=min_tokens,
        logit_bias=_logit_bias(request.get("logit_bias") or {}),
    )  # fmt: skip
    stop = request.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of at most 4 of them.", "stop")
    for s in stop:
        _check_unicode("stop", s)
    seed = request.get("seed")
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise BadRequest(f"seed must be between 0 and 2**32 - 1, got {_shown(seed)}.", "seed")
    n = request.get("n", 1)
    if not 1 <= n * prompts <= MAX_CHOICES:
        raise BadRequest(
            f"n must be at least 1 and n x prompts at most {MAX_CHOICES}, got n={n} with "
            f"{prompts} prompt(s).",
            "n",
        )
    stream = request.get("stream", False)
    options = request.get("stream_options")
    if options is not None:
        if not stream:
            raise BadRequest(
                "stream_options is only allowed when stream is true.", "stream_options"
            )
        unknown = sorted(set(options) - {"include_usage"})
        if unknown or not isinstance(options.get("include_usage", False), bool):
            raise BadRequest(
                "stream_options supports only include_usage (a boolean).", "stream_options"
            )
    return {
        "model": request.get("model"),
        "n": n,
        "max_tokens": value,
        "sampling": settings,
        "stop": stop,
        "stream": stream,
        "include_usage": bool((options or {}).get("include_usage")),
        "seed": seed,
        "max_positions": max_positions,
    }


# What a message may carry besides its role and content, handed to the chat template as it
# is (templates render a name, an assistant's tool calls and a tool result's call id; vLLM
# passes them on alike), with the JSON type each must have.
_MESSAGE_EXTRAS = {
    "name": (str, "a string"),
    "tool_calls": (list, "a list of tool calls"),
    "tool_call_id": (str, "a string"),
    "reasoning_content": (str, "a string"),
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
            raise BadRequest(f"{where} must be an object, got {_shown(message)}.", where)
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(
                f"{where}.role must be one of {list(ROLES)}, got {_shown(role)}.", f"{where}.role"
            )
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise BadRequest(
                    f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are "
                    "supported.",
                    f"{where}.content",
                )
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(
                f"{where}.content must be a string or a list of text parts, got {_shown(content)}.",
                f"{where}.content",
            )
        _check_unicode(f"{where}.content", content)
        out.append({"role": role, "content": content, **_message_extras(message, where)})
    return out


def _number(request: dict, key: str, default: float) -> float:
    """A field's value as a float (JSON also allows NaN, Infinity and huge integers)."""
    try:
        value = float(request.get(key, default))
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise BadRequest(f"{key} must be a finite number, got {_shown(request[key])}.", key)
    return value


def _logit_bias(value: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token ids as strings -> -100..100) as `Sampling` holds it."""
    if len(value) > MAX_LOGIT_BIAS:
        raise BadRequest(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(value)}.", "logit_bias"
        )
    out = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or not isinstance(bias, (int, float)):
            raise BadRequest(
                f"logit_bias maps token ids (as strings) to numbers, got {_shown({key: bias})}.",
                "logit_bias",
            )
        if isinstance(bias, bool) or not -100 <= bias <= 100:
            raise BadRequest(
                f"logit_bias values must be between -100 and 100, got {_shown(bias)}.",
                "logit_bias",
            )
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def check_logit_bias(settings: Sampling, vocab_size: int) -> None:
    """Raises BadRequest where `logit_bias` names a token outside the model's vocabulary."""
    outside = [t for t, _ in settings.logit_bias if t >= vocab_size]
    if outside:
        raise BadRequest(
            f"logit_bias names token ids {outside[:5]} outside the model's vocabulary of "
            f"{vocab_size}.",
            "logit_bias",
        )


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_unicode(key: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(
            f"Field {key!r} is not valid Unicode: {e.reason} at {e.start}.", key
        ) from e


def _shown(value: object) -> str:
    """`value` as the client wrote it, cut short."""
    return json.dumps(value)[:80]


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _as_tuple(types: _Types) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)
