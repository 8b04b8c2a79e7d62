"""Tokens -> text: the deltas a completion streams, held back while they may still turn
into a stop string or an unfinished character."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import seqio


class TextStream:
    """Turns a completion's token events into text deltas, honouring stop strings."""

    def __init__(self, vocabulary: seqio.Vocabulary, stop: Sequence[str]):
        self.vocabulary = vocabulary
        self.stop = list(stop)
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []

    def add(self, token: int, logprob: float, top: Sequence[tuple[int, float]]) -> str:
        """The new text this token makes final (may be ''); sets `stopped` at a stop string."""
        before = self.vocabulary.decode(self.ids)
        self.ids.append(token)
        text = self.vocabulary.decode(self.ids)
        self.tokens.append(text[len(before) :])
        self.token_logprobs.append(logprob)
        self.top_logprobs.append({self.vocabulary.decode([i]): lp for i, lp in top})
        for s in self.stop:
            at = text.find(s, max(0, len(self.sent) - len(s)))
            if at != -1:
                self.stopped = True
                text = text[:at]
        if not self.stopped and text.endswith("\ufffd"):
            return ""  # part of a multi-byte character: wait for the rest
        final = len(text) if self.stopped else len(text) - self._stop_prefix(text)
        delta = text[len(self.sent) : final]
        self.sent = text[:final] if final > len(self.sent) else self.sent
        return delta

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of `text` that may begin a stop string (held back)."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """Whatever text is still held back (an unfinished character) once decoding ends."""
        if self.stopped:
            return ""
        text = self.vocabulary.decode(self.ids)
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def logprobs(self, count: int | None) -> dict[str, Any] | None:
        if count is None:
            return None
        offsets, position = [], 0
        for token in self.tokens:
            offsets.append(position)
            position += len(token)
        top = [dict(sorted(t.items(), key=lambda kv: -kv[1])[:count]) for t in self.top_logprobs]
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": top if count else None,
            "text_offset": offsets,
        }
