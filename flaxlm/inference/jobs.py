"""What the continuous-batching scheduler (`scheduler.py`) holds: a job as it reads it (and
its grammar, `Guide`, where its tokens are guided), each job's progress (`JobState`: its
pages, state slot, prompt read, tokens generated, prefix sharing), and a decode dispatch
whose tokens are not read yet (`Dispatch`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from flaxlm.inference.sampling import Sampling

Array = jax.Array


class Job(Protocol):
    """What the scheduler reads of a job (the server's `Completion`); it puts ("token", id,
    logprob, top), then ("done", "stop" | "length") on `events` (or ("cancelled", msg));
    ("done", "stop") carries the stop token (an EOS id), its log-prob and the most likely
    tokens there (as "token" events do) as its third to fifth items.
    A job may also have `adapter`: the index of its LoRA adapter in the params' stacked
    adapters (0, the base, when it has none), and `guide`: the grammar its tokens follow
    (None: any token). Admitted, its `cached_tokens` are set: the prompt tokens found in the
    prefix cache (0 for a job following another's reading of the same prompt)."""

    prompt_ids: Sequence[int]
    max_tokens: int
    sampling: Sampling
    seed: int
    events: Any
    cached_tokens: int


class Guide(Protocol):
    """A guided job's grammar, on the host (structured outputs, `serve/guides.py`): each of
    its tokens is chosen among those `fill` allows, then handed to `advance`. A guided row
    decodes one token a dispatch (the next bitmask depends on the token chosen)."""

    def fill(self, row: np.ndarray) -> None:
        """Writes the tokens allowed next into `row`, int32 `[sampling.mask_words(vocab)]`
        (bit `t % 32` of word `t // 32` for token `t`)."""

    def advance(self, token: int) -> None:
        """The token chosen (a stop token ends the job instead)."""


def masks(guides: Sequence[Guide | None], size: int, words: int) -> np.ndarray | None:
    """The bitmasks of a dispatch's `size` rows, the first with `guides` (None: any token),
    where any is guided; None where none is."""
    if all(guide is None for guide in guides):
        return None
    allowed = np.full((size, words), -1, np.int32)
    for i, guide in enumerate(guides):
        if guide is not None:
            guide.fill(allowed[i])
    return allowed


@dataclasses.dataclass(eq=False)
class JobState:
    """A job held: waiting, reading its prompt or decoding."""

    job: Job
    prompt: np.ndarray  # int32 [length]
    pages: list[int]  # a follower's own pages until its leader's prompt is read
    keys: list[bytes]  # prefix-cache keys of the prompt's full pages
    adapter: int = 0  # its LoRA adapter's index (0: the base)
    stops: frozenset[int] = frozenset()  # the tokens that end it (`Sampling.stops`)
    guide: Guide | None = None  # its grammar, where its tokens are guided
    state_slot: int = 0  # its recurrent state's slot while running (a stateful model's)
    computed: int = 0  # prompt tokens whose keys and values are in the cache
    generated: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)  # those read back (penalties')
    last_token: int = 0  # sampled, not yet fed
    leader: JobState | None = None
    followers: list[JobState] = dataclasses.field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.leader is None and self.computed == len(self.prompt)


@dataclasses.dataclass(eq=False)
class Dispatch:
    """A decode dispatch enqueued whose tokens are not read yet: its rows, in order, and its
    outputs on the device (tokens, logprobs, top ids and logprobs: `[steps, max_rows, ...]`)."""

    rows: list[JobState]
    out: tuple[Array, ...]
