"""A request's sampling settings (both endpoints'): each field checked, the checkpoint's
defaults filled in, as the `Sampling` of the decoding job each sample becomes; and the error a
bad request gets."""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
from collections.abc import Mapping
from typing import Any

from flaxlm.inference.sampling import Sampling

MAX_LOGIT_BIAS = 300  # tokens a request's logit_bias may name (OpenAI's limit)
MAX_CHOICES = 16  # n x prompts of one request: each is a row of the engine's batches
SEED_LIMIT = 2**32  # the engine seeds each row's RNG with a uint32


class BadRequest(ValueError):
    """A request the server answers with `status` (400) and a message; `param` names the
    field at fault (OpenAI's error `param`), None when it is the body as a whole; `code` is
    OpenAI's error `code` where it has one."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


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

        def whole(key: str, low: int) -> int | None:
            value = config.get(key)
            return value if is_whole(value) and low <= value < 2**31 else None

        max_new = whole("max_new_tokens", 1)
        return cls(
            temperature=number("temperature", 0.0, 2.0, 1.0),
            top_p=number("top_p", 1e-9, 1.0, 1.0),
            top_k=whole("top_k", 0) or 0,
            min_p=number("min_p", 0.0, 1.0, 0.0),
            repetition_penalty=number("repetition_penalty", 1e-9, math.inf, 1.0),
            max_tokens=None if max_new is None else min(max_new, max_tokens_limit),
        )


Types = type | tuple[type, ...]
# Every optional field may also be null (the request leaves it unset).
SAMPLING_FIELDS: dict[str, tuple[Types, str]] = {
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
    "ignore_eos": (bool, "a boolean"),
    "stop_token_ids": (list, "a list of token ids"),
    "logit_bias": (dict, "an object"),
    "skip_special_tokens": (bool, "a boolean"),
    "include_stop_str_in_output": (bool, "a boolean"),
}


def sample_seeds(seed: int | None, n: int) -> list[int]:
    """The seeds of a prompt's `n` samples: `seed`, `seed + 1`, ... (so sample 0 is the
    n=1 answer with the same seed); a random start where the request sets none."""
    start = secrets.randbelow(SEED_LIMIT) if seed is None else seed
    return [(start + i) % SEED_LIMIT for i in range(n)]


def sampling_settings(
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
                f"{key}={value} leaves no room for a prompt in {held(max_positions)}.", key
            )
    temperature = _number(request, "temperature", defaults.temperature)
    if not 0.0 <= temperature <= 2.0:
        raise BadRequest(f"temperature must be between 0 and 2, got {temperature}.", "temperature")
    top_p = _number(request, "top_p", defaults.top_p)
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.", "top_p")
    top_k = request.get("top_k", defaults.top_k)
    if not -1 <= top_k < 2**31:
        raise BadRequest(
            f"top_k must be -1 or 0 (no limit) or a count of tokens, got {shown(top_k)}.", "top_k"
        )
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
        ignore_eos=request.get("ignore_eos", False),
        stop_token_ids=_stop_token_ids(request.get("stop_token_ids") or []),
    )  # fmt: skip
    stop = request.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of at most 4 of them.", "stop")
    for s in stop:
        check_unicode("stop", s)
    seed = request.get("seed")
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise BadRequest(f"seed must be between 0 and 2**32 - 1, got {shown(seed)}.", "seed")
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
        # vLLM's: a stop string kept at the end of the text; the tokenizer's special tokens
        # left out of it (None: the endpoint's default, `Server.text_stream`).
        "include_stop": request.get("include_stop_str_in_output", False),
        "skip_special_tokens": request.get("skip_special_tokens"),
        "stream": stream,
        "include_usage": bool((options or {}).get("include_usage")),
        "seed": seed,
        "max_positions": max_positions,
    }


def _number(request: dict, key: str, default: float) -> float:
    """A field's value as a float (JSON also allows NaN, Infinity and huge integers)."""
    try:
        value = float(request.get(key, default))
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise BadRequest(f"{key} must be a finite number, got {shown(request[key])}.", key)
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
                f"logit_bias maps token ids (as strings) to numbers, got {shown({key: bias})}.",
                "logit_bias",
            )
        if isinstance(bias, bool) or not -100 <= bias <= 100:
            raise BadRequest(
                f"logit_bias values must be between -100 and 100, got {shown(bias)}.",
                "logit_bias",
            )
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def _stop_token_ids(value: list) -> tuple[int, ...]:
    if not all(is_whole(t) and t >= 0 for t in value):
        raise BadRequest(
            f"stop_token_ids must be a list of token ids, got {shown(value)}.", "stop_token_ids"
        )
    return tuple(value)


def check_token_ids(settings: Sampling, vocab_size: int) -> None:
    """Raises BadRequest where `logit_bias` or `stop_token_ids` names a token outside the
    model's vocabulary."""
    for key, ids in (
        ("logit_bias", [t for t, _ in settings.logit_bias]),
        ("stop_token_ids", settings.stop_token_ids),
    ):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise BadRequest(
                f"{key} names token ids {outside[:5]} outside the model's vocabulary of "
                f"{vocab_size}.",
                key,
            )


def held(max_positions: int) -> str:
    """The tokens a sequence may hold on this server, and where the limit comes from."""
    return (
        f"the server's max_model_len of {max_positions} tokens (the model's positions, or "
        "serve's MAX_MODEL_LEN where smaller)"
    )


def is_whole(value: object) -> bool:
    """An integer as JSON gives one (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool)


def shown(value: object) -> str:
    """`value` as the client wrote it, cut short."""
    return json.dumps(value)[:80]


def check_unicode(key: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(
            f"Field {key!r} is not valid Unicode: {e.reason} at {e.start}.", key
        ) from e
