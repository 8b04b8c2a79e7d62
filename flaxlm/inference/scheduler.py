"""Continuous batching over a paged KV cache (`pages.py`): jobs join the running batch at
any dispatch and leave when done, their pages freed at once.

Each `step` admits what fits (pages reserved for the prompt and every token it may
generate; a job that can never fit is refused, one that cannot fit yet waits its turn), runs
one prefill dispatch (the next chunk of up to `prefill_rows` prompts, so that a long prompt
never stalls the running streams for more than a chunk) and one decode dispatch
(`decode_steps` tokens for every running sequence in one `lax.scan` on the device: no host
round trip per token). While the decoding rows go on, each decode dispatch is enqueued
before the previous one's tokens are read (fed its last tokens on the device), so that the
device does not wait on the host between them.

Prefix sharing: a job whose prompt equals one being prefilled follows it (the prompt is
prefilled once; its full pages are shared, the page it ends in copied before either writes
there), and a prompt's full pages stay in the prefix cache after their sequence ends, found
again by later jobs with the same prefix.

Linear attention (Qwen3-Next, Kimi Linear): a running sequence also holds a state slot (its
layers' recurrent states, `models/state_slots.py`) from admission to its end; a follower
starts from a copy of its leader's. Their prefix cache keeps the state after a cached page
in a snapshot slot (`state_pool.py`; `prefix_snapshots`): a prefill chunk ends where a page
does, and a prompt resumes only after a page with a snapshot.

Many LoRA adapters: params that hold stacked adapters (`lora.with_row_adapters`) serve each
job with its own (`Job.adapter`; 0 the base) in the same dispatches (`lora.adapters_per_row`);
only jobs with the same adapter share pages. Guided jobs: `jobs.Guide`.
"""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from flaxlm.inference import sampling
from flaxlm.inference.jobs import Dispatch, Job, JobState, masks
from flaxlm.inference.pages import PagePool, pages_for, prefix_keys
from flaxlm.inference.programs import PagedPrograms
from flaxlm.inference.state_pool import StatePool
from flaxlm.models import decoding
from flaxlm.models.base import BaseModel
from flaxlm.models.paged_attention import check_page_size, check_paged_attention
from flaxlm.parallel.partitioning import Partitioner

Array = jax.Array
Copies = list[tuple[int, int]]  # (from, to) pages or state slots


class Scheduler:
    """Continuous batching of `Job`s over one paged KV cache; not thread-safe (one thread
    calls `add`, `cancel` and `step`)."""

    def __init__(
        self,
        model: BaseModel,
        params: Any,
        partitioner: Partitioner,
        *,
        max_rows: int = 8,
        page_size: int = 16,
        num_pages: int | None = None,
        max_seq_len: int = 2048,
        decode_steps: int = 8,
        prefill_chunk: int = 64,
        prefill_rows: int = 2,
        num_top: int = 5,
        layout_in_program: bool = False,
        paged_attention: str = "gather",
        prefix_snapshots: int | None = None,
        tempered_logprobs: bool = False,
    ):
        """
        Args:
          max_rows: sequences held at once (the decode dispatch's rows, each with a state slot).
          page_size: slots per page.
          num_pages: pages of the pool (page 0 reserved); default: `max_rows` sequences of
            `max_seq_len` slots.
          max_seq_len: the longest prompt plus generated tokens a sequence may hold.
          decode_steps: tokens each decode dispatch generates per sequence.
          prefill_chunk, prefill_rows: each prefill dispatch reads this many prompt tokens of
            this many prompts.
          num_top: the most likely tokens reported with each token.
          layout_in_program: keep `params` as given (a trainer's, which `set_params` hands
            over after each update) and lay them out for decoding (`decoding_params`) inside
            each dispatch's program, not once here: no second copy of the weights outside
            the programs.
          paged_attention: how a decode dispatch's attention reads the pages: 'gather'
            (each row's pages copied out, then the model's own attention) or 'pallas' (JAX's
            Pallas kernel reads them in place; GPU; `models.paged_attention`).
          prefix_snapshots: for a model with recurrent state (linear attention), the state
            slots beside the rows' that keep the state after cached prompt pages
            (`state_pool.py`; each the size of a row's): default `max_rows`; 0 keeps no
            prefix cache for such a model (a repeated prompt is read again).
          tempered_logprobs: report a sampled token's log-prob under softmax(logits /
            temperature) (GRPO's, as TRL computes it), not the model's (`sampling.select`).
        """
        check_paged_attention(paged_attention)
        if paged_attention == "pallas":
            check_page_size(page_size)
        refusal = model.paged_refusal()
        if refusal is not None:
            raise ValueError(refusal)
        if prefix_snapshots is not None and prefix_snapshots < 0:
            raise ValueError(f"prefix_snapshots must be at least 0, got {prefix_snapshots}.")
        self.model = model
        self.paged_attention = paged_attention
        # Unrolled layers: laid out once here, or inside each program.
        self._layout_once = (lambda p: p) if layout_in_program else model.decoding_params
        self._layout = model.decoding_params if layout_in_program else (lambda p: p)
        self.params = self._layout_once(params)
        self.partitioner = partitioner
        self.max_rows = max_rows
        self.page_size = page_size
        self.max_table = pages_for(max_seq_len, page_size)
        self.max_seq_len = self.max_table * page_size
        self.num_pages = num_pages or max_rows * self.max_table + 1
        self.decode_steps = decode_steps
        self.prefill_chunk = prefill_chunk
        self.prefill_rows = prefill_rows
        self.num_top = num_top
        self.position_limit, self.eos_ids = model.position_limit(), tuple(model.eos_ids)
        self.mask_words = 0  # a guided row's bitmask, once one is added
        self.waiting: collections.deque[JobState] = collections.deque()
        self.running: list[JobState] = []
        self.prefilled_tokens = 0  # prompt tokens read by prefill dispatches
        self.decode_dispatches = self.prefill_dispatches = 0
        self.cached_tokens = 0  # prompt tokens found in the prefix cache
        self.read_wait_s = 0.0  # seconds `step` waited for dispatches' tokens (`_read`)
        new_cache = lambda: model.paged_cache(self.num_pages, page_size, max_rows, self.max_seq_len)
        shapes = jax.eval_shape(new_cache)
        self.stateful = bool(decoding.recurrent_states(shapes))
        self.snapshots = 0
        if self.stateful:
            self.snapshots = max_rows if prefix_snapshots is None else prefix_snapshots
        if self.snapshots:
            slots = max_rows + self.snapshots  # the rows' and the snapshots' (and the scratch)
            new_cache = lambda: model.paged_cache(
                self.num_pages, page_size, slots, self.max_seq_len
            )
            shapes = jax.eval_shape(new_cache)
        self.programs = PagedPrograms(
            model, partitioner, shapes, layout=self._layout, decode_steps=decode_steps,
            num_top=num_top, paged_attention=paged_attention, tempered=tempered_logprobs,
        )  # fmt: skip
        # One program, traced once (`reset` runs every rollout).
        self._make_cache = jax.jit(new_cache, out_shardings=self.programs.shardings)
        self.reset()

    # ------------------------------------------------------------ the host's side

    def reset(self) -> None:
        """A fresh pool and cache (after a failed dispatch: the donated cache is gone)."""
        self._pending = None
        self.states = StatePool(self.max_rows if self.stateful else 0, self.snapshots)
        self.pool = PagePool(self.num_pages, self.page_size, self.states.forget)
        with self.partitioner.context():
            self.cache = self._make_cache()

    def set_params(self, params: Any) -> None:
        """Decodes with `params` from now on (a trainer's after an update), on a fresh pool
        and cache (`reset`): the prefix cache holds keys and values of the old ones."""
        if self.busy:
            raise ValueError("set_params while jobs are held: let them finish first.")
        self.params = self._layout_once(params)
        self.reset()

    def release(self) -> None:
        """Frees the KV cache while the scheduler is idle (a trainer's update needs the
        memory); `set_params` or `reset` makes a new one."""
        if self.busy:
            raise ValueError("release while jobs are held: let them finish first.")
        self.cache = None

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    def add(self, job: Job) -> None:
        """Queues `job`; a ValueError when it could never fit (nothing queued then)."""
        prompt = np.asarray(job.prompt_ids, np.int32)
        slots = len(prompt) + job.max_tokens - 1  # the last token is never fed back
        if len(prompt) < 1 or job.max_tokens < 1:
            raise ValueError("A job needs a prompt token and max_tokens of at least 1.")
        if self.position_limit is not None and len(prompt) + job.max_tokens > self.position_limit:
            raise ValueError(
                f"The prompt has {len(prompt)} tokens; with max_tokens={job.max_tokens} that is "
                f"beyond the model's {self.position_limit} positions."
            )
        if slots > self.max_seq_len or pages_for(slots, self.page_size) > self.pool.capacity:
            raise ValueError(
                f"The prompt has {len(prompt)} tokens; with max_tokens={job.max_tokens} that is "
                f"beyond the engine's {min(self.max_seq_len, self.pool.capacity * self.page_size)}"
                " slots per sequence."
            )
        adapter = int(getattr(job, "adapter", 0))
        keys = prefix_keys(prompt, self.page_size, len(prompt) // self.page_size)
        if adapter:  # another adapter's keys and values: other pages
            salt = adapter.to_bytes(8, "little")
            keys = [hashlib.sha1(salt + key).digest() for key in keys]
        stops = frozenset(job.sampling.stops(self.eos_ids))
        if (guide := getattr(job, "guide", None)) is not None:
            self.mask_words = sampling.mask_words(self.model.config.vocab_size)
        self.waiting.append(JobState(job, prompt, [], keys, adapter, stops, guide))

    def cancel(self, job: Job, message: str) -> bool:
        """Drops `job` (its pages freed) with a ("cancelled", message) event; False when the
        scheduler does not hold it."""
        for seq in [*self.waiting, *self.running]:
            if seq.job is job:
                self._end(seq, ("cancelled", message))
                return True
        return False

    def cancel_all(self, kind: str, message: str) -> None:
        """Ends every job held with a (kind, message) event."""
        for seq in [*self.waiting, *self.running]:
            self._end(seq, (kind, message))

    def step(self) -> None:
        """Admits what fits, then one prefill and one decode dispatch where there is work."""
        self._admit()
        if any(s.leader is None and s.computed < len(s.prompt) for s in self.running):
            self._prefill_step()
        if any(s.decoding for s in self.running) or self._pending:
            self._decode_step()

    def _admit(self) -> None:
        snapshots: Copies = []  # where admitted prompts resume
        while self.waiting and len(self.running) < self.max_rows:
            seq = self.waiting[0]
            total = pages_for(len(seq.prompt) + seq.job.max_tokens - 1, self.page_size)
            leader = next(
                (
                    s
                    for s in self.running
                    if s.leader is None
                    and s.computed < len(s.prompt)
                    and s.adapter == seq.adapter
                    and np.array_equal(s.prompt, seq.prompt)
                ),
                None,
            )
            if leader is not None:  # shares the leader's full prompt pages once read
                need, hits = total - len(seq.keys), []
            else:  # the last prompt token is always read: its logits start the reply
                hits = self.pool.lookup(seq.keys[: (len(seq.prompt) - 1) // self.page_size])
                if self.stateful:  # resumes only where a snapshot holds the state
                    hits = hits[: self.states.longest(seq.keys[: len(hits)])]
                need = total - len(hits)
                self.pool.share(hits)
            if need > self.pool.available():
                self.pool.release(hits)
                break
            self.waiting.popleft()
            seq.state_slot = self.states.take() if self.stateful else 0
            seq.pages = hits + self.pool.allocate(need)
            seq.computed = seq.job.cached_tokens = len(hits) * self.page_size
            self.cached_tokens += seq.computed
            if self.stateful and hits:
                snapshots.append((self.states.slot_of(seq.keys[len(hits) - 1]), seq.state_slot))
            if leader is not None:
                seq.leader = leader
                leader.followers.append(seq)
            self.running.append(seq)
        self._copy_slots([], snapshots)

    def _end(self, seq: JobState, event: tuple) -> None:
        """Puts the last `event` of `seq` and frees its pages; its followers are queued
        again on their own when it had not read its prompt yet."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self._release(seq)
        if seq.leader is not None:
            seq.leader.followers.remove(seq)
        for f in reversed(seq.followers):
            self._release(f)
            f.leader = None
            self.waiting.appendleft(f)
        seq.followers = []
        seq.job.events.put(event)

    def _release(self, seq: JobState) -> None:
        """`seq` leaves the running batch: its pages and its state slot are free again."""
        self.running.remove(seq)
        self.pool.release(seq.pages)
        seq.pages = []
        if self.stateful:
            self.states.give_back(seq.state_slot)

    def _emit(self, seq: JobState, token: int, logprob: float, top: list) -> bool:
        """Hands `seq` its sampled token; True while it goes on."""
        if token in seq.stops:
            self._end(seq, ("done", "stop", token, logprob, top))
            return False
        if seq.guide is not None:
            seq.guide.advance(token)
        seq.job.events.put(("token", token, logprob, top))
        seq.generated += 1
        seq.tokens.append(token)
        seq.last_token = token
        if seq.generated >= seq.job.max_tokens:
            self._end(seq, ("done", "length"))
            return False
        return True

    def _table(self, rows: Sequence[JobState], pages: Sequence[int], count: int) -> np.ndarray:
        """The rows' page tables, as wide as a power of two (few compiled programs)."""
        width = max(1, self.max_table // 8)
        while width < max(pages):
            width *= 2
        table = np.zeros((count, min(width, self.max_table)), np.int32)
        for i, (seq, n) in enumerate(zip(rows, pages)):
            table[i, :n] = seq.pages[:n]
        return table

    def _prefill_step(self) -> None:
        rows = [s for s in self.running if s.leader is None and s.computed < len(s.prompt)]
        rows = rows[: self.prefill_rows]
        size, chunk = self.prefill_rows, self.prefill_chunk
        tokens = np.zeros((size, chunk), np.int32)
        slots = np.full((size, chunk), -1, np.int32)
        last = np.zeros((size,), np.int32)
        adapters = np.zeros((size,), np.int32)
        states = np.zeros((size,), np.int32)
        needed = []
        for i, seq in enumerate(rows):
            adapters[i], states[i] = seq.adapter, seq.state_slot
            n = self._chunk(seq)
            tokens[i, :n] = seq.prompt[seq.computed : seq.computed + n]
            slots[i, :n] = np.arange(seq.computed, seq.computed + n)
            last[i] = n - 1
            # Up to where an uncut chunk would end: a chunk cut at a page keeps its program.
            uncut = min(chunk, len(seq.prompt) - seq.computed)
            needed.append(pages_for(seq.computed + uncut, self.page_size))
        table = self._table(rows, needed, size)
        with self.partitioner.context():
            logits, self.cache = self.programs.prefill(
                self.params, self.cache, tokens, slots, table, last, adapters, states
            )
        self.prefill_dispatches += 1
        finished = []  # (sequence, its logits row)
        page_copies: Copies = []
        state_copies: Copies = []
        for i, seq in enumerate(rows):
            n = int(last[i]) + 1
            self.prefilled_tokens += n
            seq.computed += n
            full = seq.computed // self.page_size
            cached = min(full, len(seq.keys)) if not self.stateful or self.snapshots else 0
            for p in range(cached):
                self.pool.register(seq.keys[p], seq.pages[p])
            if self.snapshots and full and seq.computed % self.page_size == 0:
                snapshot = self.states.snapshot(seq.keys[full - 1], self.pool.held)
                state_copies += [(seq.state_slot, snapshot)] if snapshot else []
            if seq.computed == len(seq.prompt):
                finished += [(seq, i)] + [(f, i) for f in seq.followers]
                self._fork(seq, page_copies, state_copies)
        self._copy_slots(page_copies, state_copies)
        if finished:
            self._start(logits, finished)

    def _chunk(self, seq: JobState) -> int:
        """Prompt tokens of `seq` the next prefill dispatch reads: up to `prefill_chunk`; with
        state snapshots, ending where a page ends while the prompt goes on (a snapshot is
        taken there), at its last full page while that has none."""
        n = min(self.prefill_chunk, len(seq.prompt) - seq.computed)
        end, size = seq.computed + n, self.page_size
        if not self.snapshots or end == len(seq.prompt) and end % size == 0:
            return n
        last_full = len(seq.keys) * size
        if seq.computed < last_full < end and not self.states.has(seq.keys[-1]):
            return last_full - seq.computed
        aligned = end // size * size
        return aligned - seq.computed if end < len(seq.prompt) and aligned > seq.computed else n

    def _fork(self, leader: JobState, pages: Copies, states: Copies) -> None:
        """The leader's prompt is read: each follower takes its full prompt pages and a copy
        of the page it ends in (written by each of them next), and a copy of its state (the
        copies added to `pages` and `states`)."""
        full = len(leader.prompt) // self.page_size
        for f in leader.followers:
            self.pool.share(leader.pages[:full])
            if len(leader.prompt) % self.page_size:
                pages.append((leader.pages[full], f.pages[0]))
            if self.stateful:
                states.append((leader.state_slot, f.state_slot))
            f.pages = leader.pages[:full] + f.pages
            f.computed, f.leader = len(f.prompt), None
        leader.followers = []

    def _copy_slots(self, pages: Copies, states: Copies) -> None:
        """Copies pages and state slots on the device, `max_rows` of each a dispatch."""
        width = self.max_rows
        for start in range(0, max(len(pages), len(states)), width):
            copies = np.zeros((4, width), np.int32)  # pages, states: from, to (0 onto 0)
            for row, pairs in ((0, pages), (2, states)):
                if part := pairs[start : start + width]:
                    copies[row : row + 2, : len(part)] = np.asarray(part).T
            with self.partitioner.context():
                self.cache = self.programs.copy(self.cache, *copies)

    def _start(self, logits: Array, finished: list[tuple[JobState, int]]) -> None:
        """Samples each finished prompt's first token (a follower its own)."""
        size = self.max_rows
        index = np.zeros((size,), np.int32)
        seeds = np.zeros((size,), np.uint32)
        for j, (seq, i) in enumerate(finished):
            index[j], seeds[j] = i, seq.job.seed
        settings = [seq.job.sampling for seq, _ in finished]
        history = sampling.histories(settings, [s.prompt for s, _ in finished], [], size)
        counts = np.zeros((size,), np.int32)
        args = (logits, index, seeds, counts, sampling.rows(settings, size, self.eos_ids), history)
        args += (masks([seq.guide for seq, _ in finished], size, self.mask_words),)
        with self.partitioner.context():
            out = self.programs.first(*args)
        token, lp, top_ids, top_lps = self._read(out)
        for j, (seq, _) in enumerate(finished):
            top = list(zip(top_ids[j].tolist(), top_lps[j].tolist()))
            self._emit(seq, int(token[j]), float(lp[j]), top)

    def _decode_step(self) -> None:
        """One decode dispatch of every decoding row, enqueued before the tokens of the one
        before it are read (`Dispatch`) where the same rows go on, none at its max_tokens
        by then and none guided (`jobs.Guide`: one token a dispatch); else after. A row that
        ended in the dispatch read has run one more for nothing; its pages and state slot
        are reused only by dispatches enqueued after it."""
        rows = [s for s in self.running if s.decoding]
        steps, ahead = self.decode_steps, self._pending
        if ahead is not None and (
            ahead.rows != rows
            or any(s.generated + steps >= s.job.max_tokens or s.guide for s in rows)
        ):
            self._read_pending()
            rows, ahead = [s for s in self.running if s.decoding], None
        if not rows:
            return
        allowed = masks([seq.guide for seq in rows], self.max_rows, self.mask_words)
        steps = steps if allowed is None else 1
        done = steps if ahead else 0  # tokens each row has in the dispatch not read yet
        size = self.max_rows
        tokens = np.zeros((size,), np.int32)
        slots = np.zeros((size,), np.int32)
        remaining = np.zeros((size,), np.int32)
        seeds = np.zeros((size,), np.uint32)
        counts = np.zeros((size,), np.int32)
        adapters = np.zeros((size,), np.int32)
        states = np.zeros((size,), np.int32)
        needed = []
        for i, seq in enumerate(rows):
            adapters[i], states[i] = seq.adapter, seq.state_slot
            tokens[i] = seq.last_token
            slots[i] = len(seq.prompt) + seq.generated + done - 1
            remaining[i] = seq.job.max_tokens - seq.generated - done
            seeds[i], counts[i] = seq.job.seed, seq.generated + done
            needed.append(min(len(seq.pages), pages_for(slots[i] + steps, self.page_size)))
        table = self._table(rows, needed, size)
        # Ahead of a dispatch not read, each row is fed that dispatch's last token, on the
        # device (rows in the same order).
        fed = tokens if ahead is None else ahead.out[0][-1]
        settings = [seq.job.sampling for seq in rows]
        history = sampling.histories(
            settings, [seq.prompt for seq in rows], [seq.tokens for seq in rows], size
        )
        args = (fed, slots, table, adapters, remaining, seeds, counts)
        args += (sampling.rows(settings, size, self.eos_ids), states, history)
        args += (ahead.out[0] if ahead is not None and history is not None else None, allowed)
        with self.partitioner.context():
            self.cache, *out = self.programs.decode(self.params, self.cache, *args)
        self.decode_dispatches += 1
        self._read_pending()
        self._pending = Dispatch(rows, tuple(out))

    def _read(self, out: Sequence[Array]) -> list[np.ndarray]:
        """A dispatch's outputs on the host; the time spent waiting for them is counted
        (`read_wait_s`: the rest of a step is the host's own work)."""
        start = time.perf_counter()
        arrays = [np.asarray(x) for x in out]
        self.read_wait_s += time.perf_counter() - start
        return arrays

    def _read_pending(self) -> None:
        """Hands each row of the dispatch not read yet its tokens (none to a row that has
        ended since)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        token, lp, top_ids, top_lps = self._read(pending.out)  # [steps, rows, ...]
        for i, seq in enumerate(pending.rows):
            if seq not in self.running:  # ended in the dispatch before, or cancelled
                continue
            for k in range(len(token)):
                top = list(zip(top_ids[k, i].tolist(), top_lps[k, i].tolist()))
                if not self._emit(seq, int(token[k, i]), float(lp[k, i]), top):
                    break
