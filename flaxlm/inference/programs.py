"""The continuous-batching scheduler's programs on the device (`scheduler.py` decides what
runs, on the host): a prefill chunk, `decode_steps` tokens of every row in one `lax.scan`,
the first token's sampling, copies of pages and state slots, each with the paged cache laid
out on the mesh as `shardings` says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from flaxlm.inference import sampling
from flaxlm.models import decoding
from flaxlm.models.base import BaseModel
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import lora

Array = jax.Array


class PagedPrograms:
    """The jitted programs of one `Scheduler`; each donates the cache it is handed."""

    def __init__(
        self,
        model: BaseModel,
        partitioner: Partitioner,
        shapes: Any,
        *,
        layout: Callable[[Any], Any],
        decode_steps: int,
        num_top: int,
        paged_attention: str,
        tempered: bool = False,
    ):
        """
        Args:
          shapes: the paged cache's (`jax.eval_shape` of `model.paged_cache`).
          layout: lays the params out for decoding inside each program (the identity when
            the scheduler laid them out once).
          decode_steps, num_top, paged_attention, tempered: the `Scheduler`'s.
        """
        self.model = model
        self.partitioner = partitioner
        self._layout = layout
        self.decode_steps = decode_steps
        self.num_top = num_top
        self.paged_attention = paged_attention
        self.tempered = tempered
        self.shardings = jax.tree_util.tree_map_with_path(self._pool_sharding, shapes)
        if paged_attention == "pallas" and not all(
            s.is_fully_replicated for s in jax.tree.leaves(self.shardings)
        ):
            raise ValueError(
                "paged_attention='pallas': the kernel reads a whole pool on each device, and "
                "this mesh splits the pool's heads (tensor parallelism): use 'gather' here."
            )
        self.prefill = jax.jit(self._prefill_fn, donate_argnums=(1,))
        self.decode = jax.jit(self.decode_fn, donate_argnums=(1,))
        self.copy = jax.jit(self._copy_fn, donate_argnums=(0,))
        self.first = jax.jit(self._first_fn)

    def _pool_sharding(self, path: tuple, leaf: jax.ShapeDtypeStruct) -> NamedSharding:
        """A pool leaf `[(layers,) kv_heads, pages, page_size, head_dim]`: its heads split as
        the model splits them where they divide, the rest replicated."""
        if decoding.is_recurrent_state(path):  # a pool of state slots: small beside the pages
            return self.partitioner.replicated()
        heads = "kv_heads" if leaf.shape[-4] > 1 else None
        axes = (None,) * (leaf.ndim - 4) + (heads, None, None, "head_dim")
        sharding = NamedSharding(self.partitioner.mesh, self.partitioner.mesh_axes(axes))
        if not all(d % n == 0 for d, n in zip(leaf.shape, sharding.shard_shape(leaf.shape))):
            return self.partitioner.replicated()
        return sharding

    def _prefill_fn(self, params, cache, tokens, slots, table, last, adapters, states):
        params = self._layout(params)
        with lora.adapters_per_row(adapters):
            logits, cache = self.model.paged_logits(
                params, cache, tokens, slots, table, last, state_slots=states
            )
        return logits, jax.lax.with_sharding_constraint(cache, self.shardings)

    def _first_fn(self, logits, index, seeds, counts, settings, history, allowed=None):
        keys = jax.vmap(jax.random.fold_in)(jax.vmap(jax.random.PRNGKey)(seeds), counts)
        logits = logits[index]
        seen = None if history is None else sampling.seen(*history, logits.shape[-1])
        out = self._select(logits, keys, settings, seen, counts, allowed)
        return self._on_every_host(out)

    def decode_fn(
        self, params: Any, cache: Any, tokens: Array, slots: Array, table: Array,
        adapters: Array, remaining: Array, seeds: Array, counts: Array,
        settings: sampling.Rows, states: Array | None = None,
        history: tuple[Array, Array] | None = None, ahead: Array | None = None,
        allowed: Array | None = None,
    ) -> tuple:  # fmt: skip
        """`decode_steps` tokens of every row: feed the last one, sample the next; a row
        stops writing after an EOS or its last token. `states`: each row's state slot;
        `history`: the rows' prompt and generated tokens where a row is penalized
        (`sampling.histories`), `ahead` `[steps, rows]` the tokens of a dispatch before this
        one that the host has not read (None: none); `allowed`: the tokens each row may
        choose (`sampling.select`'s bitmask; guided rows): one token, not `decode_steps`."""
        params = self._layout(params)
        keys = jax.vmap(jax.random.PRNGKey)(seeds)
        last = jnp.zeros_like(tokens)
        seen = None
        if history is not None:
            seen = sampling.seen(*history, self.model.config.vocab_size)
            if ahead is not None:
                seen = sampling.count(seen, ahead.T, True)

        def one(carry, _):
            cache, token, slot, remaining, count, seen = carry
            active = remaining > 0
            fed = jnp.where(active, slot, -1)[:, None]
            with lora.adapters_per_row(adapters):
                logits, cache = self.model.paged_logits(
                    params, cache, token[:, None], fed, table, last, self.paged_attention, states
                )
            step_keys = jax.vmap(jax.random.fold_in)(keys, count)
            out = self._select(logits, step_keys, settings, seen, count, allowed)
            if seen is not None:
                seen = sampling.count(seen, out[0][:, None], active[:, None])
            stop = (out[0][:, None] == settings.stop_ids).any(-1)
            remaining = jnp.where(active & ~stop, remaining - 1, 0)
            return (cache, out[0], slot + 1, remaining, count + 1, seen), out

        init = (cache, tokens, slots, remaining, counts, seen)
        steps = self.decode_steps if allowed is None else 1
        (cache, *_), out = jax.lax.scan(one, init, None, length=steps)
        return (jax.lax.with_sharding_constraint(cache, self.shardings), *self._on_every_host(out))

    def _select(self, logits, keys, settings, seen, generated, allowed):
        return sampling.select(
            logits, keys, settings, self.num_top, seen=seen, generated=generated,
            tempered=self.tempered, allowed=allowed,
        )  # fmt: skip

    def _on_every_host(self, tree: Any) -> Any:
        """`tree` replicated: what the host reads back, whole on every process (a trainer's
        rollouts on a mesh that spans processes)."""
        return jax.lax.with_sharding_constraint(tree, self.partitioner.replicated())

    def _copy_fn(self, cache, src, dst, state_src, state_dst):
        cache = self.model.paged_copy(cache, (src, dst), (state_src, state_dst))
        return jax.lax.with_sharding_constraint(cache, self.shardings)
