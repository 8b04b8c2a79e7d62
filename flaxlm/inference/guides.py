"""Guided decoding on the host (structured outputs): a grammar (a JSON schema, a regex, a
choice of strings, a Lark or GBNF grammar) compiled by llguidance for a model's vocabulary,
and per row a `Guide` that gives the scheduler the tokens it allows next (`jobs.Guide`).
`serve` reads a request's grammar (`runs/serve/guides.py`); GRPO constrains its rollouts
(`GrpoConfig.structured_outputs_regex`, TRL's `vllm_structured_outputs_regex`).

`Grammars` reads the checkpoint's HF fast tokenizer, or flaxlm's bytes (`ByteVocabulary`:
seqio's ids, a byte b is b + 3) as a byte-level tokenizer of its own. JSON is laid out as
Python's `json.dumps` writes it (`", "`, `": "`, no other whitespace): llguidance (and vLLM)
allow any whitespace by default, which a model may fill without end; a schema's
`"x-guidance": {"whitespace_flexible": true}` asks for that instead.

A row's stop tokens are allowed wherever its grammar may end. Given a thinking block's tags
(`tags`), a guide lets every token through until the block's closing tag, unless the prompt
closed it, as vLLM's structured outputs wait for a reasoning parser's end."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from flaxlm.data import vocabularies

KINDS = ("json", "regex", "choice", "grammar")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Guide:
    """One guided row's grammar (`jobs.Guide`): an llguidance matcher, the row's stop tokens
    and the tokens of a thinking block's closing tag it waits for first (none: it holds from
    the first token)."""

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


class Grammars:
    """The grammars of one model: its vocabulary as llguidance reads it (built at the first
    grammar: a second or so for a large vocabulary) and a `Guide` per guided row."""

    def __init__(self, vocabulary: Any, vocab_size: int, eos_ids: Sequence[int]):
        """`vocab_size`: the model's (its logits' width, padding included)."""
        self.vocabulary, self.vocab_size, self.eos_ids = vocabulary, vocab_size, list(eos_ids)
        self._tokenizer: Any = None  # llguidance's
        self._hf: Any = None
        self._lock = threading.Lock()

    def hf_tokenizer(self) -> Any:
        """The HF fast tokenizer llguidance reads; a ValueError where there is none."""
        import transformers

        tokenizer = getattr(self.vocabulary, "tokenizer", None)
        if isinstance(tokenizer, transformers.PreTrainedTokenizerFast):
            return tokenizer
        if isinstance(self.vocabulary, vocabularies.ByteVocabulary) or _seqio_bytes(
            self.vocabulary
        ):
            self._hf = self._hf or _byte_tokenizer()
            return self._hf
        raise ValueError(
            f"structured outputs read an HF fast tokenizer (tokenizer.json) or flaxlm's "
            f"bytes; this model's vocabulary is {type(self.vocabulary).__name__}."
        )

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer(), n_vocab=self.vocab_size, eos_token=self.eos_ids or None
                )
            return self._tokenizer

    def compile(self, kind: str, source: Any) -> str:
        """llguidance's grammar of a JSON schema (a dict), a regex, a list of choices or a
        Lark / GBNF grammar; a ValueError saying why it cannot be used."""
        import llguidance

        tokenizer = self.tokenizer()
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(source), defaults=dict(JSON_LAYOUT)
            )
        elif kind in KINDS:
            grammar = llguidance.grammar_from(kind, source)
        else:
            raise ValueError(f"a grammar is one of {KINDS}, got {kind!r}")
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(error.splitlines()[0])
        return grammar

    def guide(
        self,
        grammar: str,
        stops: Sequence[int],
        prompt: Sequence[int] = (),
        tags: tuple[str, str] | None = None,
    ) -> Guide:
        """A row's guide for `compile`'s `grammar`; `tags`: a thinking block's (start, end),
        whose end it waits for unless `prompt` has closed the block."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        wait: list[int] = []
        if tags is not None:
            start, end = (self._ids(tag) for tag in tags)
            wait = [] if _closed(prompt, start, end) else end
        return Guide(matcher, stops, wait)

    def _ids(self, text: str) -> list[int]:
        return list(self.hf_tokenizer().encode(text, add_special_tokens=False))


def guide_factory(
    spec: tuple[str, str] | None, vocabulary: Any, vocab_size: int, eos_ids: Sequence[int]
) -> Callable[[], Guide] | None:
    """What makes each row's guide for a run's `(kind, source)` (`GenerationSettings.
    structured_outputs`, GRPO's regex: a JSON schema or the choices as JSON text), the
    model's EOS ids its stops; None for no spec. A ValueError says why it cannot be used."""
    if spec is None:
        return None
    kind, source = spec
    grammars = Grammars(vocabulary, vocab_size, eos_ids)
    grammar = grammars.compile(kind, json.loads(source) if kind in ("json", "choice") else source)
    return functools.partial(grammars.guide, grammar, tuple(eos_ids))


def check_spec(spec: Sequence[str] | None) -> tuple[str, str] | None:
    """A `(kind, source)` spec as a tuple; a ValueError for one that is not (before any
    model loads)."""
    if spec is None:
        return None
    if not (
        isinstance(spec, (tuple, list))
        and len(spec) == 2
        and spec[0] in KINDS
        and isinstance(spec[1], str)
    ):
        raise ValueError(
            f"structured outputs: expected (kind, source text), kind one of {KINDS}; got {spec!r}."
        )
    if spec[0] in ("json", "choice"):
        try:
            json.loads(spec[1])
        except ValueError as e:
            raise ValueError(
                f"structured outputs ({spec[0]!r}): the source is not JSON text: {e}."
            ) from None
    return spec[0], spec[1]


def _closed(prompt: Sequence[int], start: list[int], end: list[int]) -> bool:
    """Whether `prompt`'s last thinking block is closed (its end tag after its last start)."""
    text = list(prompt)

    def last(tag: list[int]) -> int:
        for at in range(len(text) - len(tag), -1, -1):
            if text[at : at + len(tag)] == tag:
                return at
        return -1

    return last(end) > last(start) if end else True


def _seqio_bytes(vocabulary: Any) -> bool:
    """seqio's own `ByteVocabulary` (a task's), without importing seqio where none is."""
    kind = type(vocabulary)
    return kind.__name__ == "ByteVocabulary" and kind.__module__.startswith("seqio")


def _byte_tokenizer() -> Any:
    """flaxlm's (and seqio's) bytes as an HF byte-level tokenizer: ids 0-2 special (pad, EOS,
    UNK), byte b id b + 3, through GPT-2's byte-to-character map."""
    import tokenizers
    import transformers

    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in kept]
    char = {b: chr(b) if b in kept else chr(256 + moved.index(b)) for b in range(256)}
    special = ["<pad>", "</s>", "<unk>"]
    vocab = {**{s: i for i, s in enumerate(special)}, **{char[b]: b + 3 for b in range(256)}}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(special)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
