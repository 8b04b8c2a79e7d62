"""How a decoder-only model decodes: prefill and one step at a time over a contiguous KV
cache (what `inference/`'s loops drive), and over the paged KV cache the serving engine keeps
(`inference/pages.py`, `inference/scheduler.py`). A mixin of `base.DecoderOnlyModel`: it
reads the model's module, config and vocabulary mask, and holds no state of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.models import decoding, layers, losses, masks, stacks
from flaxlm.models.causal_lm import CausalLM

Array = jax.Array
Batch = Mapping[str, Array]
Params = Any
# Positions whose logits `prompt_logprobs` computes at once (a prompt's length is a multiple).
PROMPT_CHUNK = 256


class CachedDecoding:
    """`check_decoding`, `prefill`, `decode_step` and the paged cache's `paged_refusal`,
    `paged_cache`, `paged_logits` of a decoder-only model (`base.DecoderOnlyModel`).

    They decode over the layers unrolled, whatever the model trains with: a scanned stack
    slices each layer's KV cache out of the stacked cache and writes it back every step (3.4x
    slower at batch 64 on an H200; benchmarks/HISTORY.md, "Fourth session"). So they take the
    params in that layout: `decoding_params(params)`, once before decoding.
    """

    def _unrolls_for_decoding(self) -> bool:
        return bool(getattr(self.config, "scan_layers", False)) and isinstance(
            self.module, CausalLM
        )

    def _decode_module(self) -> Any:
        """The module for decoding: the same params (as `decoding_params` lays them out), no
        rematerialisation, the layers unrolled."""
        changes: dict[str, Any] = {}
        if getattr(self.config, "remat_policy", "none") != "none":
            changes["remat_policy"] = "none"
        if self._unrolls_for_decoding():
            changes["scan_layers"] = False
        return dataclasses.replace(self.config, **changes).make_module() if changes else self.module

    def decoding_params(self, params: Params) -> Params:
        """`params` as the decoding methods read them: a scanned stack (`<layers>/block`,
        `[layers, ...]` each, or a cycle's `block_j`) as `<layers>_0`, `<layers>_1`, ... (the
        stack's first layer is the config's `first_scanned_layer`, the unrolled ones before
        it and after it, `scan_tail`, kept); unchanged when unrolled."""
        if not self._unrolls_for_decoding():
            return params
        cfg = self.config
        return stacks.unstack(
            params,
            self.module.layers_name,
            cfg.num_layers,
            cfg.first_scanned_layer,
            cfg.scan_period,
            cfg.scan_tail,
        )

    def check_decoding(
        self, inputs: np.ndarray, lengths: np.ndarray, config: decoding.DecodingConfig
    ) -> None:
        if (lengths < 1).any():
            raise ValueError(
                f"Prompts {np.flatnonzero(lengths < 1).tolist()} are empty; a decoder-only "
                "model needs at least one prompt token (e.g. a BOS token) to continue from."
            )
        limit = self.position_limit()
        longest = int(lengths.max()) + config.max_new_tokens
        if limit is not None and longest > limit:
            raise ValueError(
                f"The longest prompt ({int(lengths.max())} tokens) plus max_new_tokens "
                f"({config.max_new_tokens}) is {longest}, beyond the model's "
                f"max_position_embeddings={limit}; shorten the prompt or max_new_tokens."
            )

    def _run_decoder(
        self, params: Params, tokens: Array, index: Array, state: dict[str, Any], cache_len: int
    ) -> tuple[Array, dict[str, Any]]:
        where = masks.Decoding(jnp.asarray(index, jnp.int32), state["start"], cache_len)
        positions = masks.decoding_positions(where, tokens.shape[0], tokens.shape[1])
        module = self._decode_module()
        # The head reads the last position alone: a prompt's other positions need no logits
        # (XLA does not push the slice through the head's product; prefilling 64 prompts of
        # 1k tokens of a 128k vocabulary had made 34 GB of float32 logits). A module not on
        # `CausalLM`'s skeleton gives its logits.
        skeleton = isinstance(module, CausalLM)
        with layers.decoding_products():
            out, variables = module.apply(
                {"params": params, "cache": state["cache"]},
                tokens,
                positions,
                None,
                decoding=where,
                mutable=["cache"],
                **({"return_hidden": True} if skeleton else {}),
            )
        last = out[:, -1:]
        logits = (module.head_logits(params, last) if skeleton else last)[:, 0]
        return self._mask_padded_vocab(logits), {**state, "cache": variables["cache"]}

    def prefill(
        self, params: Params, inputs: Array, lengths: Array, config: decoding.DecodingConfig
    ) -> tuple[Array, dict[str, Any]]:
        batch, prompt_len = inputs.shape
        # Left-pad: every row's prompt ends at slot prompt_len - 1, so all rows write the
        # same cache slot each step; slots before `start` are masked out.
        start = (prompt_len - lengths).astype(jnp.int32)
        source = jnp.arange(prompt_len)[None, :] - start[:, None]
        tokens = jnp.take_along_axis(inputs, jnp.maximum(source, 0), axis=1)
        tokens = jnp.where(source >= 0, tokens, 0)
        rows = batch * config.num_beams
        tokens, start = (jnp.repeat(x, config.num_beams, axis=0) for x in (tokens, start))
        cache_len = prompt_len + config.max_new_tokens

        def init_cache() -> Any:
            where = masks.Decoding(jnp.int32(0), start, cache_len)
            dummy = jnp.zeros((rows, cache_len), jnp.int32)
            module = self._decode_module()
            return module.init(jax.random.PRNGKey(0), dummy, None, None, decoding=where)["cache"]

        state = {"cache": decoding.empty_cache(init_cache), "start": start}
        state["prompt_len"] = jnp.int32(prompt_len)
        return self._run_decoder(params, tokens, jnp.int32(0), state, cache_len)

    def decode_step(
        self,
        params: Params,
        token: Array,
        t: Array,
        state: dict[str, Any],
        config: decoding.DecodingConfig,
    ) -> tuple[Array, dict[str, Any]]:
        cache_len = decoding.cache_length(state["cache"])
        return self._run_decoder(params, token[:, None], state["prompt_len"] + t, state, cache_len)

    def prompt_logprobs(self, params: Params, tokens: Array, top: int) -> tuple[Array, ...]:
        """What each position of `tokens` (int32 `[rows, length]`) predicts of the next
        token, from `decoding_params`' params: float32 `[rows, length]` log-probabilities of
        `tokens[:, 1:]` (the last position's of token 0), the `top` most likely ids and
        their log-probabilities `[rows, length, top]`, most likely first, and each token's
        rank there (int32 `[rows, length]`, 1: the most likely). A server's `echo` +
        `logprobs` (what lm-eval's `local-completions` scores with) and vLLM's
        `prompt_logprobs`. The head reads PROMPT_CHUNK positions at a time: a long prompt's
        float32 logits are never whole."""
        module = self._decode_module()
        skeleton = isinstance(module, CausalLM)
        with layers.decoding_products():
            out = module.apply(
                {"params": params}, tokens, **({"return_hidden": True} if skeleton else {})
            )
        rows, length = tokens.shape
        targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((rows, 1), tokens.dtype)], 1)

        def scores(block: tuple[Array, Array]) -> tuple[Array, Array, Array, Array]:
            x, target = block
            logits = self._mask_padded_vocab(module.head_logits(params, x) if skeleton else x)
            logps = jax.nn.log_softmax(logits, axis=-1)
            chosen = losses.select_tokens(logps, target)
            top_lps, top_ids = jax.lax.top_k(logps, top)
            rank = 1 + (logps > chosen[..., None]).sum(-1, dtype=jnp.int32)
            return chosen, top_ids, top_lps, rank

        chunk = min(length, PROMPT_CHUNK)
        if length % chunk:
            raise ValueError(f"prompt_logprobs: length {length} is not a multiple of {chunk}")
        blocks = tuple(
            jnp.moveaxis(a.reshape(rows, length // chunk, chunk, *a.shape[2:]), 1, 0)
            for a in (out, targets)
        )  # [blocks, rows, chunk, ...]
        return tuple(
            jnp.moveaxis(a, 0, 1).reshape(rows, length, *a.shape[3:])
            for a in jax.lax.map(scores, blocks)
        )

    # -------------------------------------------------------------- paged decoding

    def paged_refusal(self) -> str | None:
        """Why this model cannot decode over a paged KV cache (`paged_logits`), or None.
        Phi-3 overrides the skeleton's call (its LongRoPE switch recomputes a contiguous
        cache), so it keeps the contiguous path."""
        module = self._decode_module()
        if not isinstance(module, CausalLM) or type(module).__call__ is not CausalLM.__call__:
            return f"{type(module).__name__} decodes over a contiguous KV cache only."
        return module.paged_refusal

    def paged_cache(
        self, num_pages: int, page_size: int, max_rows: int = 1, max_seq_len: int | None = None
    ) -> Any:
        """Zeros of a paged KV cache (the `cache` collection): `num_pages` pages of
        `page_size` slots, each leaf `[(layers,) kv_heads, num_pages, page_size, head_dim]`
        (`paged_attention.write_pages`); a linear-attention layer's recurrent state
        (`decoding.RECURRENT_STATE`) in `max_rows + 1` state slots: the padding rows' scratch
        and `max_rows` others (the engine's: one for each sequence held at once, and the
        snapshots its prefix cache keeps; `state_slots.py`). `max_seq_len`: the longest
        sequence the engine holds, for a model whose per-sequence state grows with it
        (DeepSeek-V4's compressed entries; None: the pool's `num_pages x page_size`)."""
        del max_seq_len  # pages hold what grows here

        def init_cache() -> Any:
            one = jnp.zeros((1, 1), jnp.int32)
            where = masks.Decoding(
                jnp.int32(0), one[0], page_size, one, one, num_pages, page_size,
                state_slots=one[0], num_state_slots=max_rows + 1,
            )  # fmt: skip
            module = self._decode_module()
            return module.init(jax.random.PRNGKey(0), one, None, None, decoding=where)["cache"]

        return decoding.empty_cache(init_cache)

    def paged_logits(
        self,
        params: Params,
        cache: Any,
        tokens: Array,
        slots: Array,
        page_table: Array,
        last: Array,
        paged_attention: str = "gather",
        state_slots: Array | None = None,
    ) -> tuple[Array, Any]:
        """Feeds `tokens` int32 `[rows, length]` at `slots` (their positions; -1: padding,
        after a row's real tokens) of the rows whose pages `page_table` int32 `[rows, pages]`
        lists, writing their keys and values into the paged `cache`: float32 logits `[rows,
        vocab]` after the token at index `last` int32 `[rows]` of each row, and the cache.
        `paged_attention`: how the attention reads the pages
        (`models.paged_attention.PAGED_ATTENTION`). `state_slots` int32 `[rows]`: each row's
        recurrent-state slot (0: a padding row's scratch; a model with a recurrent state
        needs them, `state_slots.py`)."""
        pools = jax.tree_util.tree_leaves_with_path(cache)
        pages = [x for path, x in pools if not decoding.is_recurrent_state(path)]
        states = decoding.recurrent_states(cache)
        num_pages, page_size = pages[0].shape[-3:-1] if pages else (0, 1)
        rows = tokens.shape[0]
        where = masks.Decoding(
            jnp.int32(0),
            jnp.zeros((rows,), jnp.int32),
            page_table.shape[1] * page_size,
            page_table,
            slots,
            num_pages,
            page_size,
            paged_attention,
            state_slots,
            states[0].shape[-4] if states else 0,
        )
        with layers.decoding_products():
            hidden, variables = self._decode_module().apply(
                {"params": params, "cache": cache},
                tokens,
                jnp.maximum(slots, 0),
                None,
                decoding=where,
                return_hidden=True,
                mutable=["cache"],
            )
        hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
        logits = self.module.head_logits(params, hidden)[:, 0]
        return self._mask_padded_vocab(logits), variables["cache"]

    def paged_copy(
        self, cache: Any, pages: tuple[Array, Array], states: tuple[Array, Array]
    ) -> Any:
        """`cache` (`paged_cache`'s) with the pages `pages[0]` int32 `[n]` copied onto
        `pages[1]`, and the recurrent-state slots `states[0]` onto `states[1]` (a follower
        takes its leader's state; 0 onto 0: nothing)."""

        def copy(path: tuple, leaf: Array) -> Array:
            stateful = decoding.is_recurrent_state(path)
            # The slots of `[(layers,) slots, ...]`, the pages of `[(layers,) X, pages, ...]`.
            axis = leaf.ndim - (4 if stateful else 3)
            src, dst = states if stateful else pages
            index = (slice(None),) * axis + (dst,)
            return leaf.at[index].set(jnp.take(leaf, src, axis=axis))

        return jax.tree_util.tree_map_with_path(copy, cache)
