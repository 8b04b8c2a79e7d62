"""A batch of prompts completed through the continuous-batching scheduler (`scheduler.py`):
every prompt queued at once, a row's place taken by the next prompt as soon as it ends.

`infer`'s paged engine and GRPO's rollouts both generate this way; the serving engine drives
the same scheduler with requests that arrive over time (`runs/serve/engine.py`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from flaxlm.inference.sampling import Sampling
from flaxlm.inference.scheduler import Scheduler
from flaxlm.models.base import BaseModel
from flaxlm.parallel.partitioning import Partitioner


@dataclasses.dataclass(eq=False)
class BatchJob:
    """One prompt's completion as the scheduler reads it (a `jobs.Job`): its sampled
    tokens and their log-probs, the EOS that ended it among them when `keep_eos`; appended
    to `finished` when it ends."""

    prompt_ids: Sequence[int]
    max_tokens: int
    sampling: Sampling
    seed: int
    keep_eos: bool = False
    finished: list[BatchJob] = dataclasses.field(default_factory=list, repr=False)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    guide: Any = None  # the grammar its tokens follow (`jobs.Guide`; None: any token)
    cached_tokens: int = 0  # its prompt's tokens found in the prefix cache (the scheduler's)

    @property
    def events(self) -> BatchJob:
        return self

    @property
    def generated(self) -> int:
        """Tokens the model generated for an ended job, the EOS that ended it counted."""
        return len(self.tokens) + (not self.keep_eos and len(self.tokens) < self.max_tokens)

    def put(self, event: tuple) -> None:
        if event[0] == "token" or (self.keep_eos and event[:2] == ("done", "stop")):
            token, logp = event[1:3] if event[0] == "token" else event[2:4]
            self.tokens.append(int(token))
            self.logps.append(float(logp))
        if event[0] == "done":
            self.finished.append(self)
        elif event[0] != "token":
            raise RuntimeError(f"Generating for a prompt was {event[0]}: {event[1:]}")


@dataclasses.dataclass(frozen=True)
class BatchProgress:
    """Where a `BatchGenerator.generate` call stands."""

    ended: int  # jobs that have ended
    total: int  # jobs queued
    generated: int  # tokens the ended jobs generated, each EOS counted
    elapsed: float  # seconds since the jobs were queued


class BatchGenerator:
    """Completes batches of prompts through one `Scheduler` of `max_rows` rows, each prompt
    of at most `max_prompt_length` tokens given `max_new_tokens`, sampling only the token
    each row emits (no top-k report). Every process must pass the same prompts: each runs
    the same dispatches and reads every result.

    A generator kept across batches serves new params with `scheduler.set_params` (with
    `layout_in_program`: a trainer's, as they are) and frees its KV cache between batches
    with `scheduler.release`."""

    def __init__(
        self,
        model: BaseModel,
        params: Any,
        partitioner: Partitioner,
        *,
        max_rows: int,
        max_prompt_length: int,
        max_new_tokens: int,
        decode_steps: int,
        prefill_chunk: int,
        prefill_rows: int,
        page_size: int = 16,
        paged_attention: str = "gather",
        layout_in_program: bool = False,
        tempered_logprobs: bool = False,
    ):
        """
        Args:
          decode_steps: the most tokens a row generates in one decode dispatch (fewer when
            `max_new_tokens` is smaller: the first token comes with the prefill).
          prefill_chunk, prefill_rows, page_size, paged_attention, layout_in_program,
            tempered_logprobs: the `Scheduler`'s.
        """
        self.max_new_tokens = max_new_tokens
        self.scheduler = Scheduler(
            model,
            params,
            partitioner,
            max_rows=max_rows,
            page_size=page_size,
            max_seq_len=max_prompt_length + max_new_tokens,
            # The first token comes with the prefill; a dispatch makes at most the rest, and
            # the host stops once every row has ended.
            decode_steps=max(1, min(max_new_tokens - 1, decode_steps)),
            prefill_chunk=prefill_chunk,
            prefill_rows=prefill_rows,
            num_top=1,
            layout_in_program=layout_in_program,
            paged_attention=paged_attention,
            tempered_logprobs=tempered_logprobs,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        *,
        sampling: Sampling,
        keep_eos: bool = False,
        progress: Callable[[BatchProgress], None] | None = None,
        guide: Callable[[], Any] | None = None,
    ) -> list[BatchJob]:
        """The ended job of each prompt, in order, prompt i sampled from `seeds[i]` alone (so
        its completion does not depend on the rows decoded beside it). `progress` is called
        each time another `max_rows` jobs have ended, and once when all have; `guide` makes
        each job's grammar (`jobs.Guide`; None: none)."""
        finished: list[BatchJob] = []
        jobs = [
            BatchJob(p, self.max_new_tokens, sampling, int(seed), keep_eos, finished)
            for p, seed in zip(prompts, seeds)
        ]
        for job in jobs if guide is not None else ():
            job.guide = guide()
        scheduler = self.scheduler
        for job in jobs:
            scheduler.add(job)
        start, counted, generated, report = time.perf_counter(), 0, 0, scheduler.max_rows
        while scheduler.busy:
            scheduler.step()
            generated += sum(job.generated for job in finished[counted:])
            counted = len(finished)
            if progress and (counted >= report or not scheduler.busy):
                report = counted + scheduler.max_rows
                elapsed = time.perf_counter() - start
                progress(BatchProgress(counted, len(jobs), generated, elapsed))
        return jobs
