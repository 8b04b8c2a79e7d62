"""Tokens -> text: the deltas a completion streams, held back while they may still turn
into a stop string or an unfinished character, and their log-probabilities as OpenAI's two
endpoints show them."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (serving loads neither seqio nor TensorFlow)
    import seqio


# Tokens before a prompt token that its text is decoded after (`TextStream._piece`).
PIECE_CONTEXT = 6


class TextStream:
    """Turns a completion's token events into text deltas, honouring stop strings.

    Tokens in `skip_ids` (a chat template's special tokens) are decoded to nothing, as an
    OpenAI-style server's chat answers never show them."""

    def __init__(
        self,
        vocabulary: seqio.Vocabulary,
        stop: Sequence[str],
        skip_ids: Collection[int] = (),
        echo_scores: bool = False,
        include_stop: bool = False,
    ):
        """`echo_scores`: `logprobs` lists the prompt's tokens and the stop token too (`echo`
        with `logprobs`); `include_stop`: the stop string that ended the text stays at its
        end (vLLM's `include_stop_str_in_output`)."""
        self.include_stop = include_stop
        self.vocabulary = vocabulary
        self.echo_scores = echo_scores
        # The prompt's scores where the engine gave them: (ids, logprobs, top, ranks).
        self.prompt_scores: tuple[Sequence, ...] | None = None
        self.stop = list(stop)
        self.skip_ids = frozenset(skip_ids)
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False
        # What `logprobs` lists: the new tokens (after the prompt's with `echo`).
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[list[tuple[str, float]] | None] = []  # most likely first
        self.reported = 0  # tokens whose logprobs a stream has sent
        self.stop_token: int | None = None  # the token that ended the completion, if one did

    def add(self, token: int, logprob: float, top: Sequence[tuple[int, float]]) -> str:
        """The new text this token makes final (may be ''); sets `stopped` at a stop string."""
        before = self._decode(self.ids)
        self.ids.append(token)
        text = self._decode(self.ids)
        self._listed(text[len(before) :], logprob, top)
        for s in self.stop:
            at = text.find(s, max(0, len(self.sent) - len(s)))
            if at != -1:
                self.stopped = True
                text = text[: at + (len(s) if self.include_stop else 0)]
        if not self.stopped and text.endswith("\ufffd"):
            return ""  # part of a multi-byte character: wait for the rest
        final = len(text) if self.stopped else len(text) - self._stop_prefix(text)
        delta = text[len(self.sent) : final]
        self.sent = text[:final] if final > len(self.sent) else self.sent
        return delta

    def add_prompt(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float | None],
        top: Sequence[Sequence[tuple[int, float]] | None],
        ranks: Sequence[int | None],
    ) -> None:
        """The prompt's scores: each token's log-prob given those before it, the most likely
        there and its rank (the first's None); with `echo_scores` its tokens are listed ahead
        of the new ones in `logprobs`, each with its text in the prompt's."""
        self.prompt_scores = (ids, logprobs, top, ranks)
        for i in range(len(ids) if self.echo_scores else 0):
            self._listed(self._piece(ids, i), logprobs[i], top[i])

    def add_stop(self, token: int, logprob: float, top: Sequence[tuple[int, float]]) -> None:
        """The stop token that ended the completion: counted in `generated` (as vLLM's and
        OpenAI's usage count it), and with `echo_scores` listed after its tokens in
        `logprobs`, as vLLM lists it (its text is not the completion's)."""
        self.stop_token = token
        if self.echo_scores:
            self._listed(self.vocabulary.decode([token]), logprob, top)

    def prompt_logprobs(self, count: int) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs` field: per prompt token (the first None), its own
        `{"logprob", "rank", "decoded_token"}` and the `count` most likely's, keyed by id."""
        ids, logprobs, top, ranks = self.prompt_scores or ((),) * 4
        out: list[dict[str, dict[str, Any]] | None] = [None] if ids else []
        for i in range(1, len(ids)):
            entry = {str(ids[i]): self._scored(ids[i], logprobs[i], ranks[i])}
            for rank, (token, logprob) in enumerate(top[i][:count], 1):
                entry.setdefault(str(token), self._scored(token, logprob, rank))
            out.append(entry)
        return out

    def _scored(self, token: int, logprob: float, rank: int) -> dict[str, Any]:
        text = self.vocabulary.decode([token])
        return {"logprob": logprob, "rank": rank, "decoded_token": text}

    @property
    def generated(self) -> int:
        """The tokens the completion generated: its own and the stop token that ended it."""
        return len(self.ids) + (self.stop_token is not None)

    def _listed(
        self, text: str, logprob: float | None, top: Sequence[tuple[int, float]] | None
    ) -> None:
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(
            None if top is None else [(self.vocabulary.decode([i]), lp) for i, lp in top]
        )

    def _piece(self, ids: Sequence[int], i: int) -> str:
        """Token `i`'s text where `ids` decode: what it adds to the few tokens before it."""
        start = max(0, i - PIECE_CONTEXT)
        before, text = self._decode(ids[start:i]), self._decode(ids[start : i + 1])
        return text[len(before) :] if text.startswith(before) else self._decode([ids[i]])

    def _decode(self, ids: Sequence[int]) -> str:
        return self.vocabulary.decode([i for i in ids if i not in self.skip_ids])

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of `text` that may begin a stop string (held back)."""
        return max((prefix_at_end(text, s) for s in self.stop), default=0)

    def flush(self) -> str:
        """Whatever text is still held back (an unfinished character) once decoding ends."""
        if self.stopped:
            return ""
        text = self._decode(self.ids)
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def unreported(self) -> tuple[int, int]:
        """The tokens (start, end) added since the last call: those a stream chunk's
        logprobs cover."""
        start, self.reported = self.reported, len(self.tokens)
        return start, self.reported

    def logprobs(self, count: int | None, start: int = 0, end: int | None = None) -> Any:
        """/v1/completions' logprobs of tokens [start, end): tokens, theirs, the `count`
        most likely at each, character offsets (None when the request asked for none)."""
        if count is None:
            return None
        end = len(self.tokens) if end is None else end
        position = sum(len(t) for t in self.tokens[:start])
        offsets = []
        for token in self.tokens[start:end]:
            offsets.append(position)
            position += len(token)
        top = [
            None if t is None else _most_likely_first(t[:count])
            for t in self.top_logprobs[start:end]
        ]
        return {
            "tokens": self.tokens[start:end],
            "token_logprobs": self.token_logprobs[start:end],
            "top_logprobs": top if count else None,
            "text_offset": offsets,
        }

    def chat_logprobs(self, count: int | None, start: int = 0, end: int | None = None) -> Any:
        """/v1/chat/completions' logprobs of tokens [start, end): `{"content": [{token,
        logprob, bytes, top_logprobs}]}` (None when the request asked for none)."""
        if count is None:
            return None
        end = len(self.tokens) if end is None else end
        content = []
        for token, logprob, top in zip(
            self.tokens[start:end], self.token_logprobs[start:end], self.top_logprobs[start:end]
        ):
            content.append(
                {
                    **_entry(token, logprob),
                    "top_logprobs": [_entry(t, lp) for t, lp in top[:count]],
                }
            )
        return {"content": content}


def prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (to hold back while the
    next piece may complete it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _most_likely_first(top: Sequence[tuple[str, float]]) -> dict[str, float]:
    """`top` as a dict, most likely first; two ids that decode alike keep the likelier."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(token, logprob)
    return out
