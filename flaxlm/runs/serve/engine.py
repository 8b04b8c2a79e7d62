"""The engine: one thread owns the model and hands each completion its tokens as they come.

`Engine` batches continuously over a paged KV cache (`inference/scheduler.py`): completions
join the running batch at any dispatch and leave when done, prompts are read in chunks
between decode dispatches of several tokens each, and completions with a common prompt share
its pages. A model that cannot page (`BaseModel.paged_refusal`: Phi-3, encoder-decoders)
decodes as `BatchEngine` does: the first queued completion and every other that arrives
within `batch_wait_ms` (up to `max_batch_size`) decoded as one batch step by step over a
contiguous cache, per-row temperature and top-p.

LoRA adapters stacked in the params (`serve/adapters.py`) are served by `Engine` only: each
completion's `adapter` picks its own, rows of different adapters and of the base in one
dispatch; `BatchEngine` serves the params as they are, one model."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.inference import generation, sampling
from flaxlm.inference.jobs import masks
from flaxlm.inference.scheduler import Scheduler
from flaxlm.models import decoding
from flaxlm.models.base import BaseModel
from flaxlm.models.cached_decoding import PROMPT_CHUNK
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs.serve.api import MAX_LOGPROBS, Completion, check_prompt_ids
from flaxlm.training import lora

if TYPE_CHECKING:  # (serving loads neither seqio nor TensorFlow)
    import seqio

BUCKET = 32  # prompt and generation lengths are rounded up to this (fewer compiles)
SHUTTING_DOWN = "The server is shutting down."


class _Row(NamedTuple):
    """One completion as the batch's arrays hold it."""

    completion: Completion
    prompt_ids: np.ndarray  # int32 [length]
    seed: np.uint32


class BatchEngine:
    """Decodes queued completions in dynamic batches on one thread.

    Events a completion receives: ("token", id, logprob, top) per new token, then
    ("done", finish_reason), ("error", message) when decoding it failed, or
    ("cancelled", message) when the engine stopped first."""

    def __init__(
        self,
        model: BaseModel,
        params: Any,
        partitioner: Partitioner,
        vocabulary: seqio.Vocabulary,
        *,
        max_batch_size: int = 8,
        batch_wait_ms: float = 10.0,
    ):
        self.model = model
        self.params = model.decoding_params(params)  # unrolled layers, laid out once
        self.partitioner = partitioner
        self.vocabulary = vocabulary
        self.vocab_size = getattr(model.config, "real_vocab_size", None) or model.config.vocab_size
        self.max_batch_size = max_batch_size
        self.batch_wait = batch_wait_ms / 1000.0
        self.adapters: tuple[str, ...] = ()  # the names of the LoRA adapters served (Engine)
        self.sequence_limit: int | None = None  # the longest prompt plus completion held
        # None: wake up, stop; a list: completions admitted together (`Engine.submit_many`).
        self.queue: queue.Queue[Completion | list[Completion] | None] = queue.Queue()
        self._prefill = jax.jit(model.prefill, static_argnums=(3,))
        self._step = jax.jit(model.decode_step, static_argnums=(4,), donate_argnums=(3,))
        self._select = jax.jit(sampling.select, static_argnums=(3,))
        self._seen = jax.jit(sampling.seen, static_argnums=(2,))
        self._count = jax.jit(sampling.count)
        self._prompt_scores = jax.jit(self._prompt_logprobs)
        self.batches = 0
        self._stopping = False
        self._lock = threading.Lock()  # orders submit() against stop()
        # Not a daemon: a daemon thread inside an XLA call when the interpreter shuts down
        # is ended in the middle of C++ code, and the process aborts.
        self._thread = threading.Thread(target=self._loop, name="flaxlm-engine")

    def start(self) -> None:
        self._thread.start()

    def submit(self, completion: Completion) -> None:
        """Queues `completion`; once the engine is stopping, cancels it at once."""
        with self._lock:
            if not self._stopping:
                self.queue.put(completion)
                return
        completion.events.put(("cancelled", SHUTTING_DOWN))

    def stop(self) -> None:
        """Stops after the current decode step and returns once the engine thread has ended
        (no device work of its own left running): every completion in flight or queued is
        cancelled."""
        with self._lock:
            self._stopping = True
        self.queue.put(None)
        if self._thread.ident is not None:
            self._thread.join()
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            for completion in _completions(item):
                completion.events.put(("cancelled", SHUTTING_DOWN))

    def _loop(self) -> None:
        while not self._stopping:
            batch = self._next_batch()
            if self._stopping:
                for c in batch:
                    c.events.put(("cancelled", SHUTTING_DOWN))
                return
            try:
                self.decode(batch)
            except Exception as e:  # noqa: BLE001 - report to the waiting requests, keep serving
                for c in batch:
                    c.events.put(("error", f"{type(e).__name__}: {e}"))

    def _next_batch(self) -> list[Completion]:
        """The first queued completion and every other that arrives within `batch_wait`."""
        first = self.queue.get()
        if first is None:
            return []
        batch = _completions(first)
        deadline = time.monotonic() + self.batch_wait
        while len(batch) < self.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                c = self.queue.get(timeout=max(remaining, 0.0))
            except queue.Empty:
                break
            if c is None:
                break
            batch += _completions(c)
        return batch

    def decode(self, batch: Sequence[Completion]) -> None:
        """Decodes every completion of the batch that can be: one that cannot (a setting out
        of range) gets its error event alone and its batch-mates are decoded."""
        rows = self._rows(batch)
        if not rows:
            return
        self.batches += 1
        size = self.max_batch_size
        prompt_len = generation.round_up(max(len(r.prompt_ids) for r in rows), BUCKET)
        new = generation.round_up(max(r.completion.max_tokens for r in rows), BUCKET)
        config = decoding.DecodingConfig(max_new_tokens=new)
        inputs = np.zeros((size, prompt_len), np.int32)
        lengths = np.ones((size,), np.int32)
        seeds = np.zeros((size,), np.uint32)
        for i, r in enumerate(rows):
            inputs[i, : len(r.prompt_ids)] = r.prompt_ids
            lengths[i] = len(r.prompt_ids)
            seeds[i] = r.seed
        batch = [r.completion for r in rows]
        settings = [c.sampling for c in batch]
        history = sampling.histories(settings, [r.prompt_ids for r in rows], [], size)
        stops = [frozenset(s.stops(self.model.eos_ids)) for s in settings]
        settings = sampling.rows(settings, size, self.model.eos_ids)
        with self.partitioner.context():
            placed = [self.partitioner.global_array(x) for x in (inputs, lengths)]
            logits, state = self._prefill(self.params, *placed, config)
            keys = jax.vmap(jax.random.PRNGKey)(jnp.asarray(seeds))
            active = list(range(len(batch)))
            counts = [0] * len(batch)
            guides = [c.guide for c in batch]
            words = sampling.mask_words(logits.shape[-1])
            seen = None if history is None else self._seen(*history, logits.shape[-1])
            for t in range(new):
                step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, t)
                live = [g if i in active else None for i, g in enumerate(guides)]
                allowed = masks(live, size, words)
                out = self._select(
                    logits, step_keys, settings, MAX_LOGPROBS, seen=seen,
                    generated=jnp.full((size,), t, jnp.int32), allowed=allowed,
                )  # fmt: skip
                if seen is not None:
                    seen = self._count(seen, out[0][:, None], True)
                token, token_lp, top_ids, top_lps = (np.asarray(x) for x in out)
                still = []
                for i in active:
                    c = batch[i]
                    tok = int(token[i])
                    top = list(zip(top_ids[i].tolist(), top_lps[i].tolist()))
                    if tok in stops[i]:
                        c.events.put(("done", "stop", tok, float(token_lp[i]), top))
                        continue
                    if guides[i] is not None:
                        guides[i].advance(tok)
                    c.events.put(("token", tok, float(token_lp[i]), top))
                    counts[i] += 1
                    if counts[i] >= c.max_tokens:
                        c.events.put(("done", "length"))
                    else:
                        still.append(i)
                active = still
                if not active or t + 1 == new:
                    break
                if self._stopping:  # checked between steps: nothing is left in flight
                    for i in active:
                        batch[i].events.put(("cancelled", SHUTTING_DOWN))
                    return
                logits, state = self._step(
                    self.params, jnp.asarray(token), jnp.int32(t), state, config
                )
            for i in active:
                batch[i].events.put(("done", "length"))

    def _rows(self, batch: Sequence[Completion]) -> list[_Row]:
        """The batch's completions that can be decoded; each other gets its error event."""
        rows = []
        for c in batch:
            try:
                rows.append(self._admit(c))
            except Exception as e:  # noqa: BLE001 - this completion alone fails
                c.events.put(("error", f"{type(e).__name__}: {e}"))
        return rows

    def _row(self, c: Completion) -> _Row:
        """`c`'s settings as the batch's arrays hold them; raises for one they cannot hold.
        (api.parse_request refuses all of these first; this keeps a bad job from failing
        its batch-mates whatever its source.)"""
        check_prompt_ids(c.prompt_ids, c.max_tokens, None, self.vocab_size)
        ids = np.asarray(c.prompt_ids, np.int32)
        if c.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {c.max_tokens}")
        if not 0 <= c.adapter <= len(self.adapters):
            raise ValueError(f"adapter {c.adapter}: this engine serves {len(self.adapters)}")
        return _Row(c, ids, np.uint32(c.seed))  # OverflowError: seed

    def _admit(self, c: Completion) -> _Row:
        """`_row(c)`; a completion that asks for its prompt's log-probs (`echo` with
        `logprobs`, vLLM's `prompt_logprobs`) then gets them as its first event, ("prompt",
        logprobs, top, ranks): each prompt token's given those before it, the MAX_LOGPROBS
        most likely there, most likely first, and its rank there (the first token's None:
        nothing predicts it)."""
        row = self._row(c)
        if c.prompt_logprobs is None:
            return row
        n = len(row.prompt_ids)
        length = generation.round_up(n, BUCKET if n <= PROMPT_CHUNK else PROMPT_CHUNK)
        rows = self.partitioner.data_parallel_degree()
        tokens = np.zeros((rows, length), np.int32)
        tokens[0, :n] = row.prompt_ids
        with self.partitioner.context():
            placed = [self.partitioner.global_array(x) for x in (tokens, np.full(rows, c.adapter))]
            out = self._prompt_scores(self.params, *placed)
            chosen, ids, lps, ranks = (np.asarray(x[0, : n - 1]) for x in out)
        top = [list(zip(i.tolist(), lp.tolist())) for i, lp in zip(ids, lps)]
        c.events.put(("prompt", [None, *chosen.tolist()], [None, *top], [None, *ranks.tolist()]))
        return row

    def _prompt_logprobs(
        self, params: Any, tokens: jax.Array, adapters: jax.Array
    ) -> tuple[jax.Array, ...]:
        """`prompt_logprobs` of the rows `tokens`, each with its LoRA adapter (Engine)."""
        scope = lora.adapters_per_row(adapters) if self.adapters else contextlib.nullcontext()
        with scope:
            return self.model.prompt_logprobs(params, tokens, MAX_LOGPROBS)


class Engine(BatchEngine):
    """Continuous batching over a paged KV cache on one thread (`inference/scheduler.py`);
    a model that cannot page decodes in dynamic batches (`BatchEngine`).

    Events a completion receives: ("token", id, logprob, top) per new token, then
    ("done", finish_reason), ("error", message) when it cannot be decoded, or
    ("cancelled", message) when the engine stopped first or `cancel` dropped it."""

    def __init__(
        self,
        model: BaseModel,
        params: Any,
        partitioner: Partitioner,
        vocabulary: seqio.Vocabulary,
        *,
        max_batch_size: int = 8,
        batch_wait_ms: float = 10.0,
        page_size: int = 16,
        num_pages: int | None = None,
        max_seq_len: int | None = None,
        decode_steps: int = 8,
        prefill_chunk: int = 64,
        prefill_rows: int = 2,
        adapters: Sequence[str] = (),
        paged_attention: str = "gather",
        prefix_snapshots: int | None = None,
    ):
        """
        Args:
          max_batch_size: sequences decoded together.
          batch_wait_ms: an idle engine waits this long after a completion arrives for
            others to start with it.
          page_size, num_pages, decode_steps, prefill_chunk, prefill_rows,
            paged_attention, prefix_snapshots: see `Scheduler`.
          max_seq_len: the longest prompt plus completion (default: the model's positions,
            at most 2048).
          adapters: the names of the LoRA adapters stacked in `params`
            (`serve.adapters.load_adapters`); a completion's `adapter` i > 0 is
            `adapters[i - 1]`. A model that cannot page refuses them.
        """
        super().__init__(
            model,
            params,
            partitioner,
            vocabulary,
            max_batch_size=max_batch_size,
            batch_wait_ms=batch_wait_ms,
        )
        self.scheduler: Scheduler | None = None
        self._cancels: list[tuple[Completion, str]] = []  # guarded by self._lock
        self.adapters = tuple(adapters)
        refusal = model.paged_refusal()
        if self.adapters and refusal is not None:
            raise ValueError(
                f"LORA_ADAPTERS: {refusal} Adapters are served per row over the paged cache "
                "only; serve each adapter merged (its own CHECKPOINT) instead."
            )
        if refusal is None:
            self.scheduler = Scheduler(
                model,
                params,
                partitioner,
                max_rows=max_batch_size,
                page_size=page_size,
                num_pages=num_pages,
                max_seq_len=max_seq_len or min(model.position_limit() or 2048, 2048),
                decode_steps=decode_steps,
                prefill_chunk=prefill_chunk,
                prefill_rows=prefill_rows,
                num_top=MAX_LOGPROBS,
                paged_attention=paged_attention,
                prefix_snapshots=prefix_snapshots,
            )
            held = min(self.scheduler.max_seq_len, self.scheduler.pool.capacity * page_size)
            self.sequence_limit = held + 1  # the last token is never fed back

    def submit_many(self, completions: Sequence[Completion]) -> None:
        """Queues `completions` to be admitted together: those with one prompt (a request's
        `n` choices) read it once and share its pages."""
        with self._lock:
            if not self._stopping:
                self.queue.put(list(completions))
                return
        for c in completions:
            c.events.put(("cancelled", SHUTTING_DOWN))

    def cancel(self, completion: Completion, message: str = "Cancelled by the client.") -> None:
        """Drops `completion` after the current dispatch (its pages freed) with a
        ("cancelled", message) event; nothing when it has ended already."""
        with self._lock:
            self._cancels.append((completion, message))
        self.queue.put(None)  # wakes an idle engine

    def _loop(self) -> None:
        if self.scheduler is None:
            return super()._loop()
        scheduler = self.scheduler
        while True:
            self._take(block=not scheduler.busy)
            if self._stopping:
                scheduler.cancel_all("cancelled", SHUTTING_DOWN)
                return
            try:
                scheduler.step()
            except Exception as e:  # noqa: BLE001 - report to the jobs in flight, keep serving
                scheduler.cancel_all("error", f"{type(e).__name__}: {e}")
                scheduler.reset()
            self.batches = scheduler.decode_dispatches

    def _take(self, block: bool) -> None:
        """Hands the scheduler what was queued (when `block`, waiting for something, then
        `batch_wait` for more) and the cancellations asked for."""
        items = []
        if block:
            items.append(self.queue.get())
            deadline = time.monotonic() + self.batch_wait
            while (remaining := deadline - time.monotonic()) > 0 and items[-1] is not None:
                try:
                    items.append(self.queue.get(timeout=remaining))
                except queue.Empty:
                    break
        while True:
            try:
                items.append(self.queue.get_nowait())
            except queue.Empty:
                break
        for item in items:
            for c in _completions(item):
                try:
                    self._admit(c)  # the settings the batch's arrays hold
                    self.scheduler.add(c)
                except Exception as e:  # noqa: BLE001 - this completion alone fails
                    c.events.put(("error", f"{type(e).__name__}: {e}"))
        with self._lock:
            cancels, self._cancels = self._cancels, []
        for c, message in cancels:
            self.scheduler.cancel(c, message)


def _completions(item: Completion | list[Completion] | None) -> list[Completion]:
    """The completions a queue item holds."""
    if item is None:
        return []
    return item if isinstance(item, list) else [item]
