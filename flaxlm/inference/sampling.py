"""How the serving engine and the paged batch path choose each row's next token, each row
(a job) by its own settings: temperature, top-k, top-p, min-p, the presence, frequency and
repetition penalties, a logit bias and a minimum length, applied as vLLM applies them (its
`SamplingParams`, the settings OpenAI-compatible servers take):

- `min_tokens`: the row's stop tokens (the model's EOS ids unless `ignore_eos`, and its
  `stop_token_ids`) cannot be chosen before it has generated that many.
- `logit_bias`: added to its tokens' logits (OpenAI's).
- the penalties, on the logits before temperature (so greedy rows too): a token in the
  prompt or generated before has its logit divided by `repetition_penalty` where positive,
  multiplied where negative (HF's `RepetitionPenaltyLogitsProcessor` over prompt and
  output); then `frequency_penalty` x its count among the generated tokens and
  `presence_penalty` where it is among them are subtracted (OpenAI's definition).
- temperature; then the tokens less likely than `min_p` x the most likely one's
  probability, the tokens outside the top-k and those outside the top-p nucleus of what is
  left are removed, in that order.

A guided row (structured outputs) chooses among the tokens its grammar allows next, after
all of these (`allowed`: a bitmask per row, `mask_words`).

The log-probabilities reported with each token are the model's own, before any of these
(vLLM's default `raw_logprobs`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.models import decoding

Array = jax.Array
PAD = np.iinfo(np.int32).max  # a history's padding: outside every vocabulary, dropped


@dataclasses.dataclass(frozen=True)
class Sampling:
    """One job's settings (the defaults: greedy, nothing filtered or penalized)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    ignore_eos: bool = False  # the model's EOS ids do not end the row (vLLM's)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the row besides (vLLM's)

    def __post_init__(self):
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}.")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be > 0 (1: none), got {self.repetition_penalty}."
            )
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}.")
        for token, bias in self.logit_bias:
            if token < 0 or not math.isfinite(bias):
                raise ValueError(f"logit_bias {token}: {bias} is not a token id and a number.")
        if any(token < 0 for token in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids, got {self.stop_token_ids}.")

    def stops(self, eos_ids: Sequence[int]) -> tuple[int, ...]:
        """The tokens that end the row, of a model whose EOS ids are `eos_ids`."""
        return (() if self.ignore_eos else tuple(eos_ids)) + self.stop_token_ids

    @property
    def penalized(self) -> bool:
        """Whether the row's choice depends on the tokens before it."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repeats

    @property
    def repeats(self) -> bool:
        """Whether the prompt's tokens are penalized (`repetition_penalty` != 1)."""
        return self.repetition_penalty != 1.0


class Rows(NamedTuple):
    """The settings of a dispatch's rows, one array `[rows]` each."""

    temperature: Array
    top_p: Array
    top_k: Array
    min_p: Array
    presence: Array
    frequency: Array
    repetition: Array
    min_tokens: Array
    bias_ids: Array  # int32 [rows, n]: the tokens of a row's logit bias (`PAD` after them)
    bias: Array  # float32 [rows, n]: what each adds
    stop_ids: Array  # int32 [rows, m]: the tokens that end a row (`Sampling.stops`; `PAD`)


def rows(settings: Sequence[Sampling], size: int, eos_ids: Sequence[int] = ()) -> Rows:
    """`settings` as a dispatch's arrays of `size` rows (the rest greedy, unpenalized) of a
    model whose EOS ids are `eos_ids`."""
    out = Rows(
        np.zeros((size,), np.float32),
        np.ones((size,), np.float32),
        np.zeros((size,), np.int32),
        np.zeros((size,), np.float32),
        np.zeros((size,), np.float32),
        np.zeros((size,), np.float32),
        np.ones((size,), np.float32),
        np.zeros((size,), np.int32),
        _ragged([[t for t, _ in s.logit_bias] for s in settings], size, PAD, np.int32),
        _ragged([[b for _, b in s.logit_bias] for s in settings], size, 0.0, np.float32),
        _ragged([s.stops(eos_ids) for s in settings], size, PAD, np.int32),
    )
    for i, s in enumerate(settings):
        out.temperature[i], out.top_p[i], out.top_k[i] = s.temperature, s.top_p, s.top_k
        out.min_p[i] = s.min_p
        out.presence[i], out.frequency[i] = s.presence_penalty, s.frequency_penalty
        out.repetition[i], out.min_tokens[i] = s.repetition_penalty, s.min_tokens
    return out


class Seen(NamedTuple):
    """What the penalties read of each row's tokens so far."""

    prompt: Array  # bool [rows, vocab]: in the prompt (where the row's repetition penalty reads it)
    output: Array  # int32 [rows, vocab]: times generated


def histories(
    settings: Sequence[Sampling],
    prompts: Sequence[np.ndarray],
    outputs: Sequence[Sequence[int]],
    size: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The token histories a dispatch's penalties read (`seen`), int32 `[size, width]` each,
    `PAD` after each row's tokens (the prompt only where the row's repetition penalty reads
    it; `_ragged`); None when no row is penalized."""
    if not any(s.penalized for s in settings):
        return None
    prompts = [p if s.repeats else p[:0] for s, p in zip(settings, prompts)]
    return _ragged(prompts, size, PAD, np.int32), _ragged(outputs, size, PAD, np.int32)


def seen(prompt: Array, output: Array, vocab: int) -> Seen:
    """`histories`' arrays as the penalties read them (on the device)."""
    counts = lambda tokens: _add(jnp.zeros((tokens.shape[0], vocab), jnp.int32), tokens)
    return Seen(counts(prompt) > 0, counts(output))


def count(seen: Seen, tokens: Array, active: Array) -> Seen:
    """`seen` after each row generated its `tokens` `[rows, n]` where `active` (bool,
    broadcast to `tokens`)."""
    return seen._replace(output=_add(seen.output, jnp.where(active, tokens, PAD)))


def select(
    logits: Array,
    keys: Array,
    settings: Rows,
    num_top: int,
    *,
    seen: Seen | None = None,
    generated: Array | None = None,
    tempered: bool = False,
    allowed: Array | None = None,
) -> tuple[Array, Array, Array, Array]:
    """Each row's next token by its own settings, its log-probability and the `num_top`
    most likely tokens with theirs (the model's distribution, before any setting; with
    `tempered`, of softmax(logits / temperature) where a row samples, as TRL's GRPO
    computes a sampled token's log-prob).

    `seen`: the rows' tokens so far (None: no row is penalized); `generated` int32 `[rows]`:
    how many each has generated (for `min_tokens`); `allowed` int32 `[rows, mask_words]`: bit
    `t % 32` of word `t // 32` set where a row may choose token `t` (None: every token)."""
    logits = logits.astype(jnp.float32)
    sampling = settings.temperature > 0
    if tempered:
        scale = jnp.where(sampling, settings.temperature, 1.0)[:, None]
        log_probs = jax.nn.log_softmax(logits / scale, axis=-1)
    else:
        log_probs = jax.nn.log_softmax(logits, axis=-1)
    row = jnp.arange(logits.shape[0])[:, None]
    if settings.bias_ids.shape[1]:
        logits = logits.at[row, settings.bias_ids].add(settings.bias, mode="drop")
    if generated is not None and settings.stop_ids.shape[1]:
        early = (generated < settings.min_tokens)[:, None]
        held = jnp.where(early, settings.stop_ids, PAD)  # the row's stop tokens, held back
        logits = logits.at[row, held].set(-jnp.inf, mode="drop")
    if seen is not None:
        logits = penalize(logits, seen, settings)
    if allowed is not None:
        logits = jnp.where(unpack(allowed, logits.shape[-1]), logits, -jnp.inf)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample() -> Array:
        scaled = logits / jnp.maximum(settings.temperature, 1e-6)[:, None]
        cut = sampling & ((settings.top_p < 1.0) | (settings.top_k > 0) | (settings.min_p > 0))
        filtered = jax.lax.cond(
            cut.any(),
            lambda: jnp.where(
                cut[:, None],
                decoding.filter_sets(scaled, settings.top_k, settings.top_p, settings.min_p),
                scaled,
            ),
            lambda: scaled,
        )
        return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)

    # The filter (each row's top candidates, the vocabulary sorted where its set may reach
    # past them) and the sample's noise over the vocabulary, every row at every step: a batch
    # that only decodes greedily skips both, a batch whose rows filter nothing the filter.
    token = jnp.where(sampling, jax.lax.cond(sampling.any(), sample, lambda: greedy), greedy)
    token_lp = jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0]
    top_lps, top_ids = jax.lax.top_k(log_probs, num_top)
    return token, token_lp, top_ids, top_lps


def mask_words(vocab: int) -> int:
    """The int32 words of a row's `allowed` bitmask over `vocab` tokens."""
    return (vocab + 31) // 32


def unpack(bitmask: Array, vocab: int) -> Array:
    """bool `[rows, vocab]` of an int32 bitmask `[rows, mask_words(vocab)]`."""
    token = jnp.arange(vocab)
    return (bitmask[:, token // 32] >> (token % 32)) & 1 == 1


def penalize(logits: Array, seen: Seen, settings: Rows) -> Array:
    """float32 `logits` `[rows, vocab]` with each row's penalties applied (module doc)."""
    repeated = seen.prompt | (seen.output > 0)
    logits = decoding.penalize_repeats(logits, repeated, settings.repetition[:, None])
    output = seen.output.astype(jnp.float32)
    logits = logits - settings.frequency[:, None] * output
    return logits - settings.presence[:, None] * (output > 0)


def _add(counts: Array, tokens: Array) -> Array:
    """`counts` `[rows, vocab]` + each row's `tokens` `[rows, n]` (`PAD` dropped)."""
    row = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], tokens.shape)
    return counts.at[row, tokens].add(1, mode="drop")


def _ragged(seqs: Sequence[Sequence], size: int, fill: float, dtype: type) -> np.ndarray:
    """`seqs` as `[size, width]` `dtype` arrays' rows, `fill` after each one's values and in
    the rows past them; `width` the longest's length up to a power of two (>= 8; 0 where every
    one is empty): a few compiled programs."""
    longest = max(map(len, seqs), default=0)
    out = np.full((size, _bucket(longest) if longest else 0), fill, dtype)
    for i, values in enumerate(seqs):
        out[i, : len(values)] = values
    return out


def _bucket(length: int) -> int:
    width = 8
    while width < length:
        width *= 2
    return width
