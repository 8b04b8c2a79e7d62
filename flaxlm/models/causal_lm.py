"""The decoder-only skeleton every causal family plugs its block into.

`CausalLM` is embed -> blocks (scanned or unrolled, rematerialised as the config says) ->
final norm -> tied or untied head, with the mask and the KV cache's decoding state handed to
every block. A family subclasses it: it names its block and the scopes of its params (so
they match its HF table), and overrides the hooks where it differs (positions, mask, final
norm). Its blocks are called `block(x, [layer_index,] mask, decoding, *extra)` with the
`extra` arguments its `block_inputs` returns.

The head can also run apart from the trunk, with the same params: `__call__(...,
return_hidden=True)` stops at the final norm, and `head_logits(params, hidden)` applies the head
to any block of those positions (the chunked loss, `losses.chunked_cross_entropy`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models import attention, layers, masks, stacks

Array = jax.Array


class CausalLMConfig(Protocol):
    """What the skeleton reads of a family config (a `options.ComputeOptions` subclass)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    dtype: str
    param_dtype: str
    dropout_rate: float
    remat_policy: str
    scan_layers: bool
    # Optional: tie_word_embeddings (the head is the embedding), final_logit_softcapping
    # (logits become cap * tanh(logits / cap)).


class CausalLM(nn.Module):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`.

    Class attributes a family sets:
      block_cls: its block, a module with fields `config` and `deterministic`.
      embed_name: the token embedding's scope ('embed_tokens', GPT-2's 'wte').
      layers_name: the blocks' scope prefix ('layers': `layers_0`, ... or scanned `layers`).
      layer_index: the blocks take their index (an int32 scalar) after `x`.
      head_bias: the untied head has a bias (GPT-J).
      paged_refusal: why its blocks cannot decode over the paged KV cache (None: they can).
    """

    config: Any  # a CausalLMConfig

    block_cls: ClassVar[type[nn.Module]]
    embed_name: ClassVar[str] = "embed_tokens"
    layers_name: ClassVar[str] = "layers"
    layer_index: ClassVar[bool] = False
    head_bias: ClassVar[bool] = False
    # Why the family cannot decode over the paged KV cache (None: it can).
    paged_refusal: ClassVar[str | None] = None

    # ------------------------------------------------------------ hooks

    @property
    def tied_head(self) -> bool:
        """Whether the head reuses the token embedding (the config's tie_word_embeddings)."""
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def embed_width(self) -> int:
        """Width of the token embedding (and of a tied head's input)."""
        return self.config.hidden_size

    def mask(
        self,
        segment_ids: Array | None,
        positions: Array,
        decoding: masks.Decoding | None,
        deterministic: bool,
    ) -> masks.Mask:
        """The blocks' self-attention mask: causal, within segments, over the cache while
        decoding."""
        batch, length = positions.shape
        return masks.causal_mask(segment_ids, batch, length, decoding)

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Any, ...]]:
        """The family's touches on the embedded tokens `x` [batch, length, embed_width]
        (position embeddings, scaling, a projection): `(x, extra block arguments)`."""
        return x, ()

    def token_inputs(self, tokens: Array, x: Array) -> tuple[Any, ...]:
        """More block arguments, after `block_inputs`' own, from the token ids and the `x`
        it returned (Gemma 4's per-layer input embeddings)."""
        return ()

    def final_norm(self, x: Array) -> Array:
        """The norm after the last block (and anything between it and the head)."""
        raise NotImplementedError(f"{type(self).__name__} must define final_norm.")

    def after_trunk(
        self,
        hidden: Array,
        trunk: Array,
        tokens: Array,
        positions: Array,
        segment_ids: Array | None,
        mask: masks.Mask,
        embed: layers.Embed,
        decoding: masks.Decoding | None,
        slots: Array | None,
        deterministic: bool,
    ) -> None:
        """Modules that read the final hidden states beside the head and sow what they
        compute (DeepSeek-V3's multi-token prediction, `mtp.py`); nothing by default.
        `hidden`: after `final_norm`; `trunk`: the last block's output before it (DeepSeek-V4's
        hyper-connection streams)."""

    # ------------------------------------------------------------ the skeleton

    @nn.compact
    def __call__(
        self,
        tokens: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        *,
        deterministic: bool = True,
        decoding: masks.Decoding | None = None,
        return_hidden: bool = False,
        slots: Array | None = None,
    ) -> Array:
        """float32 logits [batch, length, vocab]; with `return_hidden`, the final hidden
        states [batch, length, embed_width] instead (after the final norm, before the head).

        slots: int32 [length], the slot of each position of rows given in another order
        (context parallelism's load-balanced order, `context_parallel.balanced_order`): the
        mask follows the slots. `positions` must then be given in the same order."""
        cfg = self.config
        positions = masks.default_positions(tokens, positions)
        mask = self.mask(segment_ids, positions, decoding, deterministic)
        if slots is not None:
            mask = mask.replace(slots=slots)
        embed = self._embed(name=self.embed_name)
        x, extra = self.block_inputs(embed(tokens), positions, decoding)
        extra = (*extra, *self.token_inputs(tokens, x))
        if cfg.dropout_rate:
            x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = stacks.stack_blocks(
            self.block_cls,
            cfg.num_layers,
            scan_layers=cfg.scan_layers,
            remat_policy=cfg.remat_policy,
            name=self.layers_name,
            layer_index=self.layer_index,
            first_scanned=cfg.first_scanned_layer,
            period=cfg.scan_period,
            tail=cfg.scan_tail,
            config=cfg,
            deterministic=deterministic,
        )(x, mask, decoding, *extra)
        trunk, x = x, self.final_norm(x)
        self.after_trunk(
            x, trunk, tokens, positions, segment_ids, mask, embed, decoding, slots, deterministic
        )
        if return_hidden:
            return x
        head = embed if self.tied_head else self._lm_head(name="lm_head")
        return self._head(head, x)

    # ------------------------------------------------------------ the head alone

    @nn.nowrap
    def _embed(self, **kwargs: Any) -> layers.Embed:
        cfg = self.config
        return layers.Embed(
            cfg.vocab_size,
            self.embed_width,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            **kwargs,
        )

    @nn.nowrap
    def _lm_head(self, **kwargs: Any) -> layers.DenseGeneral:
        cfg = self.config
        return layers.DenseGeneral(
            cfg.vocab_size,
            ("embed", "vocab"),
            use_bias=self.head_bias,
            dtype=cfg.dtype,
            out_dtype=jnp.float32,
            param_dtype=cfg.param_dtype,
            **kwargs,
        )

    @nn.nowrap
    def _head(self, head: nn.Module, x: Array) -> Array:
        """float32 logits [batch, length, vocab] of `x` through `head`: the token embedding
        (tied) or `lm_head`, bound to its params. The product runs in the model's compute
        dtype (as under HF's autocast and in MaxText), accumulated and returned in float32
        (`layers.dot_general`): a bfloat16 model's head is not a float32 matmul, which an
        NVIDIA GPU runs as TF32 at half the bfloat16 rate."""
        if isinstance(head, layers.Embed):
            logits = head.attend(x, out_dtype=jnp.float32)
        else:
            logits = head(x)
        # Gemma 2/3: logits squashed into (-cap, cap).
        logits = attention.capped(logits, getattr(self.config, "final_logit_softcapping", None))
        return layers.constrain(logits, ("batch", "length", "vocab"))

    @nn.nowrap
    def head_logits(
        self, params: Any, hidden: Array, *, rngs: dict[str, Array] | None = None
    ) -> Array:
        """What `__call__` returns, from the final hidden states `hidden` [batch, length,
        embed_width] that `__call__(..., return_hidden=True)` gave (or any block of their
        positions): float32 logits [batch, length, vocab].

        `params` is this module's whole tree; the head reads only its own subtree (the token
        embedding or `lm_head`, with any LoRA adapters there). `rngs`: a `dropout` rng when
        LoRA drops the head's input.
        """
        # A compact module's submodules cannot be built outside its `__call__`, so the head
        # layer is bound to its subtree on its own.
        head = self._embed(parent=None) if self.tied_head else self._lm_head(parent=None)
        return self._head(head.bind({"params": params[self._head_scope()]}, rngs=rngs), hidden)

    @nn.nowrap
    def head_params(self, params: Any) -> dict[str, Any]:
        """The part of this module's params tree that `head_logits` reads (and accepts in
        place of the whole tree)."""
        return {self._head_scope(): params[self._head_scope()]}

    @nn.nowrap
    def _head_scope(self) -> str:
        return self.embed_name if self.tied_head else "lm_head"
