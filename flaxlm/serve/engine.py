"""The engine: one thread owns the model. It takes the first queued completion and every
other that arrives within `batch_wait_ms` (up to `max_batch_size`), decodes them as one batch
step by step on the mesh (KV cache, per-row temperature and top-p), and hands each request
its tokens as they come."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import seqio

from flaxlm import decoding, inference
from flaxlm.models import layers
from flaxlm.models.base import BaseModel
from flaxlm.partitioning import Partitioner
from flaxlm.serve.api import MAX_LOGPROBS, Completion

BUCKET = 32  # prompt and generation lengths are rounded up to this (fewer compiles)


class Engine:
    """Decodes queued completions in dynamic batches on one thread."""

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
        self.params = params
        self.partitioner = partitioner
        self.vocabulary = vocabulary
        self.max_batch_size = max_batch_size
        self.batch_wait = batch_wait_ms / 1000.0
        self.queue: queue.Queue[Completion] = queue.Queue()
        self._prefill = jax.jit(model.prefill, static_argnums=(3,))
        self._step = jax.jit(model.decode_step, static_argnums=(4,), donate_argnums=(3,))
        self._select = jax.jit(_select, static_argnums=(4,))
        self.batches = 0
        self._thread = threading.Thread(target=self._loop, name="flaxlm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, completion: Completion) -> None:
        self.queue.put(completion)

    def _loop(self) -> None:
        while True:
            batch = [self.queue.get()]
            deadline = time.monotonic() + self.batch_wait
            while len(batch) < self.max_batch_size:
                remaining = deadline - time.monotonic()
                try:
                    batch.append(self.queue.get(timeout=max(remaining, 0.0)))
                except queue.Empty:
                    break
            try:
                self.decode(batch)
            except Exception as e:  # noqa: BLE001 - report to the waiting requests, keep serving
                for c in batch:
                    c.events.put(("error", f"{type(e).__name__}: {e}"))

    def decode(self, batch: Sequence[Completion]) -> None:
        """Decodes every completion of the batch, emitting ("token", id, logprob, top) per
        new token and ("done", finish_reason) at the end."""
        self.batches += 1
        rows = self.max_batch_size
        prompt_len = inference.round_up(max(len(c.prompt_ids) for c in batch), BUCKET)
        new = inference.round_up(max(c.max_tokens for c in batch), BUCKET)
        config = decoding.DecodingConfig(max_new_tokens=new)
        inputs = np.zeros((rows, prompt_len), np.int32)
        lengths = np.ones((rows,), np.int32)
        for i, c in enumerate(batch):
            inputs[i, : len(c.prompt_ids)] = c.prompt_ids
            lengths[i] = len(c.prompt_ids)
        temperature = np.zeros((rows,), np.float32)
        top_p = np.ones((rows,), np.float32)
        seeds = np.zeros((rows,), np.uint32)
        for i, c in enumerate(batch):
            temperature[i], top_p[i], seeds[i] = c.temperature, c.top_p, c.seed
        with self.partitioner.context():
            placed = [self.partitioner.global_array(x) for x in (inputs, lengths)]
            logits, state = self._prefill(self.params, *placed, config)
            keys = jax.vmap(jax.random.PRNGKey)(jnp.asarray(seeds))
            active = list(range(len(batch)))
            counts = [0] * len(batch)
            for t in range(new):
                step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, t)
                token, token_lp, top_ids, top_lps = (
                    np.asarray(x)
                    for x in self._select(
                        logits,
                        step_keys,
                        jnp.asarray(temperature),
                        jnp.asarray(top_p),
                        MAX_LOGPROBS,
                    )
                )
                still = []
                for i in active:
                    c = batch[i]
                    tok = int(token[i])
                    if tok in self.model.eos_ids:
                        c.events.put(("done", "stop"))
                        continue
                    top = list(zip(top_ids[i].tolist(), top_lps[i].tolist()))
                    c.events.put(("token", tok, float(token_lp[i]), top))
                    counts[i] += 1
                    if counts[i] >= c.max_tokens:
                        c.events.put(("done", "length"))
                    else:
                        still.append(i)
                active = still
                if not active or t + 1 == new:
                    break
                logits, state = self._step(
                    self.params, jnp.asarray(token), jnp.int32(t), state, config
                )
            for i in active:
                batch[i].events.put(("done", "length"))


def _select(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    num_top: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per row: greedy where temperature is 0, else a sample from the top-p nucleus of
    softmax(logits / temperature); the token's log-probability and the `num_top` most
    likely tokens with theirs (of the model's distribution, before temperature)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    filtered = decoding.filter_logits(scaled, top_p=top_p[:, None])
    sampled = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, filtered)
    token = jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    token_lp = layers.select_tokens(log_probs, token)
    top_lps, top_ids = jax.lax.top_k(log_probs, num_top)
    return token, token_lp, top_ids, top_lps
