"""The completions request: OpenAI's fields, validated before any device work, and the
decoding job one prompt becomes."""

from __future__ import annotations

import dataclasses
import json
import math
import queue
from collections.abc import Sequence

MAX_LOGPROBS = 5
SEED_LIMIT = 2**32  # the engine seeds each row's RNG with a uint32


class BadRequest(ValueError):
    """A request the server answers with 400 and a message."""


@dataclasses.dataclass
class Completion:
    """One prompt's decoding job and the channel its events go back through."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    logprobs: int | None
    seed: int
    events: queue.Queue = dataclasses.field(default_factory=queue.Queue)


_FIELDS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "prompt": ((str, list), "a string or a list of strings"),
    "max_tokens": (int, "an integer"),
    "temperature": ((int, float), "a number"),
    "top_p": ((int, float), "a number"),
    "stop": ((str, list, type(None)), "a string, a list of strings or null"),
    "stream": (bool, "a boolean"),
    "logprobs": ((int, type(None)), "an integer or null"),
    "echo": (bool, "a boolean"),
    "seed": ((int, type(None)), "an integer or null"),
    "n": (int, "an integer"),
    "model": (str, "a string"),
    "user": (str, "a string"),
}


def parse_request(body: bytes, max_positions: int | None, max_tokens_limit: int) -> dict:
    """The validated fields of a completions request body; BadRequest names what is wrong.

    Every value the engine could not serve is refused here, so that a bad request fails
    alone, never the batch it would have joined."""
    try:
        request = json.loads(body or b"")
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, 4300+ digits, deep nesting
        raise BadRequest(f"The body is not valid JSON: {_first_line(e)}.") from e
    if not isinstance(request, dict):
        raise BadRequest("The body must be a JSON object.")
    for key, value in request.items():
        if key not in _FIELDS:
            raise BadRequest(f"Unknown field {key!r}; supported: {sorted(_FIELDS)}.")
        types, what = _FIELDS[key]
        if not isinstance(value, types) or (
            isinstance(value, bool) and bool not in _as_tuple(types)
        ):
            raise BadRequest(f"Field {key!r} must be {what}, got {_shown(value)}.")
    prompt = request.get("prompt")
    if prompt is None:
        raise BadRequest("Field 'prompt' is required.")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("Field 'prompt' must be a string or a non-empty list of strings.")
    for p in prompts:
        _check_unicode("prompt", p)
    max_tokens = request.get("max_tokens", 16)
    if not 1 <= max_tokens <= max_tokens_limit:
        raise BadRequest(f"max_tokens must be between 1 and {max_tokens_limit}, got {max_tokens}.")
    if max_positions is not None and max_tokens >= max_positions:
        raise BadRequest(
            f"max_tokens={max_tokens} leaves no room for a prompt in the model's "
            f"{max_positions} positions."
        )
    temperature = _number(request, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise BadRequest(f"temperature must be between 0 and 2, got {temperature}.")
    top_p = _number(request, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.")
    stop = request.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of at most 4 of them.")
    for s in stop:
        _check_unicode("stop", s)
    logprobs = request.get("logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}.")
    seed = request.get("seed")
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise BadRequest(f"seed must be between 0 and 2**32 - 1, got {_shown(seed)}.")
    if request.get("n", 1) != 1:
        raise BadRequest("Only n=1 is supported; send the prompt several times instead.")
    return {
        "prompts": prompts,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stop": stop,
        "stream": request.get("stream", False),
        "logprobs": logprobs,
        "echo": request.get("echo", False),
        "seed": seed or 0,
        "max_positions": max_positions,
    }


def check_prompt_ids(
    ids: Sequence[int], max_tokens: int, max_positions: int | None, vocab_size: int
) -> None:
    """Raises BadRequest unless the tokenized prompt fits the model: not empty, every id in
    its vocabulary, and room for `max_tokens` more in its positions."""
    if not ids:
        raise BadRequest("The prompt is empty after tokenization.")
    outside = sorted({i for i in ids if not 0 <= i < vocab_size})
    if outside:
        raise BadRequest(
            f"The prompt has token ids {outside[:5]} outside the model's vocabulary of "
            f"{vocab_size}; the server's tokenizer does not match the model."
        )
    if max_positions is not None and len(ids) + max_tokens > max_positions:
        raise BadRequest(
            f"The prompt has {len(ids)} tokens; with max_tokens={max_tokens} "
            f"that is beyond the model's {max_positions} positions."
        )


def _number(request: dict, key: str, default: float) -> float:
    """A field's value as a float (JSON also allows NaN, Infinity and huge integers)."""
    try:
        value = float(request.get(key, default))
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise BadRequest(f"{key} must be a finite number, got {_shown(request[key])}.")
    return value


def _check_unicode(key: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"Field {key!r} is not valid Unicode: {e.reason} at {e.start}.") from e


def _shown(value: object) -> str:
    """`value` as the client wrote it, cut short."""
    return json.dumps(value)[:80]


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)
