"""The completions request: OpenAI's fields, validated before any device work, and the
decoding job one prompt becomes."""

from __future__ import annotations

import dataclasses
import json
import queue

MAX_LOGPROBS = 5


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
    """The validated fields of a completions request body; BadRequest names what is wrong."""
    try:
        request = json.loads(body or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"The body is not valid JSON: {e}.") from e
    if not isinstance(request, dict):
        raise BadRequest("The body must be a JSON object.")
    for key, value in request.items():
        if key not in _FIELDS:
            raise BadRequest(f"Unknown field {key!r}; supported: {sorted(_FIELDS)}.")
        types, what = _FIELDS[key]
        if not isinstance(value, types) or (
            isinstance(value, bool) and bool not in _as_tuple(types)
        ):
            raise BadRequest(f"Field {key!r} must be {what}, got {json.dumps(value)[:80]}.")
    prompt = request.get("prompt")
    if prompt is None:
        raise BadRequest("Field 'prompt' is required.")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("Field 'prompt' must be a string or a non-empty list of strings.")
    max_tokens = request.get("max_tokens", 16)
    if not 1 <= max_tokens <= max_tokens_limit:
        raise BadRequest(f"max_tokens must be between 1 and {max_tokens_limit}, got {max_tokens}.")
    temperature = float(request.get("temperature", 1.0))
    if not 0.0 <= temperature <= 2.0:
        raise BadRequest(f"temperature must be between 0 and 2, got {temperature}.")
    top_p = float(request.get("top_p", 1.0))
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.")
    stop = request.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of at most 4 of them.")
    logprobs = request.get("logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}.")
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
        "seed": request.get("seed") or 0,
        "max_positions": max_positions,
    }


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)
