"""vLLM's tokenizer endpoints: `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`,
which clients use to count and split text as the server does (lm-eval's `local-completions`
looks for them to tokenize its requests; without them it needs the tokenizer on its own
disk). Served for checkpoints with an HF tokenizer; a 404 names why otherwise."""

from __future__ import annotations

from typing import Any, Protocol

from flaxlm.runs.serve.api import json_fields
from flaxlm.runs.serve.settings import BadRequest, check_unicode, is_whole


class Server(Protocol):
    """What these endpoints read of `http.Server`."""

    engine: Any  # its vocabulary and vocab_size
    max_positions: int | None

    def adapter(self, request: dict) -> int: ...

    def encode(self, text: str) -> list[int]: ...


_TOKENIZE_FIELDS = {
    "model": (str, "a string"),
    "prompt": (str, "a string"),
    "add_special_tokens": (bool, "a boolean"),
    "return_token_strs": (bool, "a boolean"),
}
_DETOKENIZE_FIELDS = {
    "model": (str, "a string"),
    "tokens": (list, "a list of token ids"),
}
# The tokenizer's settings `tokenizer_info` reports, as vLLM's endpoint names them.
_INFO = ("eos_token", "bos_token", "pad_token", "unk_token", "chat_template")


def _tokenizer(server: Server) -> Any:
    tokenizer = getattr(server.engine.vocabulary, "tokenizer", None)
    if tokenizer is None:
        raise BadRequest(
            "This checkpoint has no HF tokenizer, so the server has no tokenizer endpoints; "
            "tokenize with the checkpoint's vocabulary.",
            status=404,
        )
    return tokenizer


def tokenize(server: Server, body: bytes) -> dict[str, Any]:
    """`POST /tokenize`: a `prompt`'s token ids (with `add_special_tokens`, the default, as a
    completion's prompt is read: the BOS its training rows started with; without, the text's
    own tokens), their count and the model's positions."""
    tokenizer = _tokenizer(server)
    request = json_fields(body, _TOKENIZE_FIELDS)
    request.setdefault("model", None)
    server.adapter(request)  # an unknown model is a 404
    if "prompt" not in request:
        raise BadRequest("Field 'prompt' is required.", "prompt")
    check_unicode("prompt", request["prompt"])
    if request.get("add_special_tokens", True):
        ids = server.encode(request["prompt"])
    else:
        ids = list(server.engine.vocabulary.encode(request["prompt"]))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": server.max_positions, "tokens": ids}
    if request.get("return_token_strs"):
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(server: Server, body: bytes) -> dict[str, Any]:
    """`POST /detokenize`: the text of `tokens` (special tokens included, as vLLM's)."""
    tokenizer = _tokenizer(server)
    request = json_fields(body, _DETOKENIZE_FIELDS)
    request.setdefault("model", None)
    server.adapter(request)
    ids = request.get("tokens")
    if ids is None or not all(is_whole(i) for i in ids):
        raise BadRequest("Field 'tokens' must be a list of token ids.", "tokens")
    outside = sorted({i for i in ids if not 0 <= i < server.engine.vocab_size})
    if outside:
        raise BadRequest(
            f"Token ids {outside[:5]} are outside the model's vocabulary of "
            f"{server.engine.vocab_size}.",
            "tokens",
        )
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


def tokenizer_info(server: Server) -> dict[str, Any]:
    """`GET /tokenizer_info`: the tokenizer's class, special tokens, chat template and the
    model's positions."""
    tokenizer = _tokenizer(server)
    info = {name: getattr(tokenizer, name, None) for name in _INFO}
    return {
        "tokenizer_class": type(tokenizer).__name__,
        **info,
        "model_max_length": server.max_positions,
    }
