"""DeepSeek-V4's modules (`deepseek_v4.py` holds the config and the model): a residual of
`hc_mult` streams mixed by hyper-connections around each attention and mixture-of-experts
sublayer, and the multi-token-prediction layer over those streams.

The embedded token is copied into `hc_mult` streams `[batch, length, hc_mult, embed]`. Before
each sublayer a hyper-connection (`HyperConnection`, HF's `attn_hc` / `ffn_hc`: mHC) reads
all streams (flattened, RMS-normalised, one linear map) and gives three weights: `pre`
collapses the streams into the sublayer's input, `post` spreads its output back over them,
and `comb`, made doubly stochastic by `hc_sinkhorn_iters` Sinkhorn-Knopp steps, mixes the
streams into the residual: streams <- post x out + comb^T streams. After the last layer a
`HyperHead` collapses the streams once more before the final norm and the head.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models import (
    causal_lm,
    deepseek_v4_attention,
    deepseek_v4_moe,
    layers,
    masks,
    moe,
    mtp,
    stacks,
)

Array = jax.Array

NO_PAGED = (
    "DeepSeek-V4's layers keep sliding windows, open compressor windows and compressed "
    "entries, not keys and values in pages: serve deepseek_v4.DeepseekV4LM (the model "
    "gin/models/deepseek_v4_*.gin and an HF import give), which holds them in state slots."
)
LEFT_PADDED = (
    "DeepSeek-V4's compressors count windows from each row's first token, so it decodes "
    "right-padded rows over its own cache, not a left-padded KV cache: generate with "
    "deepseek_v4.DeepseekV4LM (the model gin/models/deepseek_v4_*.gin and an HF import give)."
)


class HyperConnection(nn.Module):
    """`streams [batch, length, hc, embed]` -> (post `[batch, length, hc]`, comb `[batch,
    length, hc, hc]`, the collapsed input `[batch, length, embed]`), in float32 as HF's.
    Params (HF's `fn`, `base`, `scale`): `fn/kernel` `[hc x embed, (2 + hc) x hc]`,
    `base` `[(2 + hc) x hc]`, `scale` `[3]`."""

    config: Any

    @nn.compact
    def __call__(self, streams: Array) -> tuple[Array, Array, Array]:
        cfg = self.config
        hc, eps = cfg.hc_mult, cfg.hc_eps
        b, s = streams.shape[:2]
        mix = HyperMix((2 + hc) * hc, 3, cfg, name="mix")(streams)
        pre_w, post_w, comb_w = jnp.split(mix["logits"], [hc, 2 * hc], axis=-1)
        pre_b, post_b, comb_b = jnp.split(mix["base"], [hc, 2 * hc])
        pre_s, post_s, comb_s = mix["scale"]
        pre = jax.nn.sigmoid(pre_w * pre_s + pre_b) + eps
        post = 2 * jax.nn.sigmoid(post_w * post_s + post_b)
        comb = comb_w.reshape(b, s, hc, hc) * comb_s + comb_b.reshape(hc, hc)
        comb = jax.nn.softmax(comb, axis=-1) + eps
        comb = comb / (comb.sum(-2, keepdims=True) + eps)

        def sinkhorn(_: Any, comb: Array) -> Array:  # Sinkhorn-Knopp: rows, then columns
            comb = comb / (comb.sum(-1, keepdims=True) + eps)
            return comb / (comb.sum(-2, keepdims=True) + eps)

        comb = jax.lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, sinkhorn, comb)
        collapsed = (pre[..., None] * streams.astype(jnp.float32)).sum(2)
        return post, comb, collapsed.astype(streams.dtype)


class HyperMix(nn.Module):
    """The float32 linear map of the RMS-normalised flattened streams shared by
    `HyperConnection` and `HyperHead`: {'logits' `[batch, length, out]`, 'base' `[out]`,
    'scale' `[scales]`} (params `fn/kernel`, `base`, `scale`, in the parent's names)."""

    out: int
    scales: int
    config: Any

    @nn.compact
    def __call__(self, streams: Array) -> dict[str, Array]:
        cfg = self.config
        flat = streams.reshape(*streams.shape[:2], -1).astype(jnp.float32)
        flat = deepseek_v4_attention.unit_rms(flat, cfg.rms_norm_eps)
        logits = layers.DenseGeneral(
            self.out, ("embed", None), dtype=jnp.float32, param_dtype=cfg.param_dtype, name="fn"
        )(flat)
        zeros, ones = (
            nn.with_logical_partitioning(init, (None,))
            for init in (nn.initializers.zeros, nn.initializers.ones)
        )
        base = self.param("base", zeros, (self.out,), jnp.float32)
        scale = self.param("scale", ones, (self.scales,), jnp.float32)
        return {"logits": logits, "base": base, "scale": scale}


class HyperHead(nn.Module):
    """HF's `hc_head`: the streams `[batch, length, hc, embed]` collapsed into one, weighted
    by `sigmoid(mix x hc_scale + hc_base) + hc_eps`."""

    config: Any

    @nn.compact
    def __call__(self, streams: Array) -> Array:
        cfg = self.config
        mix = HyperMix(cfg.hc_mult, 1, cfg, name="mix")(streams)
        pre = jax.nn.sigmoid(mix["logits"] * mix["scale"][0] + mix["base"]) + cfg.hc_eps
        return (pre[..., None] * streams.astype(jnp.float32)).sum(2).astype(streams.dtype)


class DeepseekV4Block(nn.Module):
    """One layer on the streams: `(streams, mask, decoding, main, compress, positions,
    tokens)` -> streams, each sublayer between its hyper-connection's collapse and spread."""

    config: Any
    deterministic: bool = True

    @nn.compact
    def __call__(
        self,
        streams: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        main: tuple[Array, Array],
        compress: tuple[Array, Array],
        positions: Array,
        tokens: Array,
    ) -> Array:
        cfg = self.config
        if decoding is not None and decoding.paged:
            raise ValueError(NO_PAGED)
        if decoding is not None and decoding.slots is None:  # `CachedDecoding`'s layout
            raise ValueError(LEFT_PADDED)
        if mask.slots is not None:  # the compressors pool neighbouring slots
            raise ValueError(
                "context_parallel_balance=True reorders the sequence, but DeepSeek-V4's "
                "compressors pool windows of neighbouring tokens: set it False."
            )
        i = stacks.layer_of(self, cfg.first_scanned_layer)  # scanned: a cycle on, alike
        norm = dict(epsilon=cfg.rms_norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)

        def residual(name: str, sublayer: Any, streams: Array) -> Array:
            post, comb, collapsed = HyperConnection(cfg, name=name)(streams)
            out = sublayer(collapsed).astype(jnp.float32)
            mixed = jnp.einsum("bsjk,bsjd->bskd", comb, streams.astype(jnp.float32))
            return (post[..., None] * out[:, :, None] + mixed).astype(streams.dtype)

        attn = deepseek_v4_attention.DeepseekV4Attention(cfg, cfg.layer_types[i], name="self_attn")
        streams = residual(
            "attn_hc",
            lambda h: attn(layers.RMSNorm(name="input_layernorm", **norm)(h), mask, main,
                           compress, positions, decoding),
            streams,
        )  # fmt: skip
        mlp = deepseek_v4_moe.DeepseekV4MoE(cfg, cfg.mlp_layer_types[i] == "hash_moe", name="mlp")
        real = moe.real_tokens(mask, streams.shape[1])
        return residual(
            "ffn_hc",
            lambda h: mlp(layers.RMSNorm(name="post_attention_layernorm", **norm)(h), tokens, real),
            streams,
        )


class DeepseekV4MtpLayer(nn.Module):
    """One multi-token-prediction depth (`deepseek_v4`'s module docstring): `(embedded
    [batch, length, embed], streams [batch, length, hc, embed], mask, block_args)` -> (its
    streams, its hidden state after `hc_head` and `norm`, float32). `config`:
    `DeepseekV4Config.mtp_block_config`'s."""

    config: Any
    deterministic: bool = True

    @nn.compact
    def __call__(
        self, embedded: Array, streams: Array, mask: masks.Mask, block_args: tuple[Any, ...]
    ) -> tuple[Array, Array]:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        norm = dict(epsilon=cfg.rms_norm_eps, **dense)

        def proj(name: str, x: Array) -> Array:
            return layers.DenseGeneral(cfg.hidden_size, ("mlp", "embed"), name=name, **dense)(x)

        e = proj("e_proj", layers.RMSNorm(name="enorm", **norm)(embedded))
        h = proj("h_proj", layers.RMSNorm(name="hnorm", **norm)(streams))
        x = (e[:, :, None] + h).astype(streams.dtype)
        x = DeepseekV4Block(cfg, self.deterministic, name="block")(x, mask, None, *block_args)
        hidden = HyperHead(cfg, name="hc_head")(x)
        hidden = layers.RMSNorm(
            cfg.rms_norm_eps, dtype=jnp.float32, param_dtype=cfg.param_dtype, name="norm"
        )(hidden)
        return x, hidden


class DeepseekV4(causal_lm.CausalLM):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = DeepseekV4Block
    paged_refusal = NO_PAGED

    def mask(
        self,
        segment_ids: Array | None,
        positions: Array,
        decoding: masks.Decoding | None,
        deterministic: bool,
    ) -> masks.Mask:
        """Causal within segments, over `sliding_window` positions: a prompt read while
        decoding is a whole sequence too (a step's layers mask their caches themselves)."""
        batch, length = positions.shape
        return masks.causal_mask(
            segment_ids, batch, length, None, sliding_window=self.config.sliding_window
        )

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Any, ...]]:
        cfg = self.config
        streams = jnp.broadcast_to(x[:, :, None], (*x.shape[:2], cfg.hc_mult, x.shape[-1]))
        main = deepseek_v4_attention.main_sin_cos(positions, cfg)
        compress = deepseek_v4_attention.compress_sin_cos(positions, cfg)
        return streams, (main, compress, positions)

    def token_inputs(self, tokens: Array, x: Array) -> tuple[Any, ...]:
        return (tokens,)

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
        """The MTP layers (the module docstring) from the trunk's streams, each depth's
        hidden state sown as `mtp.after_trunk` sows DeepSeek-V3's."""
        del hidden, segment_ids  # the trunk's mask holds the segments
        if not mtp.runs(self, decoding):
            return
        streams = trunk
        for k in range(1, self.config.num_mtp_layers + 1):
            ids = mtp.shifted(tokens, k, slots=slots)
            x = embed(ids)
            _, args = self.block_inputs(x, mtp.shifted(positions, k, slots=slots), None)
            layer = DeepseekV4MtpLayer(
                self.config.mtp_block_config(k - 1), deterministic, name=f"mtp_{k - 1}"
            )
            streams, depth = layer(x, streams, mask, (*args, *self.token_inputs(ids, x)))
            self.sow(mtp.MTP_COLLECTION, mtp.HIDDEN, depth)

    def final_norm(self, streams: Array) -> Array:
        cfg = self.config
        x = HyperHead(cfg, name="hc_head")(streams)
        return layers.RMSNorm(
            cfg.rms_norm_eps, dtype=jnp.float32, param_dtype=cfg.param_dtype, name="norm"
        )(x)
