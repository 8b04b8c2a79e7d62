"""Multi-token prediction (DeepSeek-V3's MTP modules): `num_mtp_layers` extra blocks after
the trunk, depth k predicting the token k + 1 places after the next one.

Depth k (from 1) at position i takes the previous depth's output there (depth 0: the trunk's
final hidden state, after its norm, as transformers' `MtpModel` is fed) and the embedding of
token i + k, each RMS-normalised (`hnorm`, `enorm`), joins them embedding first (`eh_proj`,
2 x hidden -> hidden, no bias), runs one block of the family over the sequence (the block's
rotary at token i + k's position, the trunk's causal mask within segments), and normalises
the result (`post_norm`): depth k's hidden state, whose logits through the model's own head
predict token i + k + 1, and which depth k + 1 reads. This is transformers' `MtpLayer` /
`MtpModel` (`modeling_layers.py`) run over whole sequences, as its loss with `labels` does;
the Hub's DeepSeek-V3 files store depth k as decoder layer `num_hidden_layers + k - 1`
(`model.layers.61.{enorm,hnorm,eh_proj,shared_head.norm,...}`; the copies of the embedding
and head there are not read).

The loss (`mtp_loss_weight`, DeepSeek-V3's lambda: 0.3, later 0.1) is `lambda / D` times the
sum over depths of each depth's cross-entropy, each over the positions whose target exists in
the same segment, normalised as the main loss is (its weight sum), so microbatches add up.
The modules run only where a loss asks for them (the `MTP_COLLECTION` is mutable) or params
are built; generation never runs them (no speculative decoding here).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models import layers, masks

Array = jax.Array

MTP_COLLECTION = "mtp"  # the sown hidden states of each depth
HIDDEN = "hidden"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MtpOptions:
    """The fields a family with MTP layers adds to its config (a MoE config: each MTP
    layer is a MoE block of the family), checked by `check_mtp()` in its `__post_init__`."""

    # The MTP layers after the `num_layers` decoder layers (HF: num_nextn_predict_layers;
    # 0 reads none of the Hub's, as transformers' causal LM), and the weight of their loss
    # in training (DeepSeek-V3's lambda: 0.3, then 0.1).
    num_mtp_layers: int = 0
    mtp_loss_weight: float = 0.0

    def check_mtp_counts(self) -> None:
        """ValueErrors for counts and weights no MTP layer can have."""
        if self.num_mtp_layers < 0 or self.mtp_loss_weight < 0:
            raise ValueError(
                f"num_mtp_layers {self.num_mtp_layers} / mtp_loss_weight "
                f"{self.mtp_loss_weight}: both must be >= 0."
            )
        if self.mtp_loss_weight and not self.num_mtp_layers:
            raise ValueError(
                f"mtp_loss_weight {self.mtp_loss_weight} with num_mtp_layers 0: set "
                "num_mtp_layers (the Hub's files hold 1) or leave mtp_loss_weight at 0."
            )

    def check_mtp(self) -> None:
        """ValueErrors for settings no MTP layer of DeepSeek-V3's kind can have."""
        self.check_mtp_counts()
        if self.num_mtp_layers and not getattr(self, "num_experts", 0):
            raise ValueError("num_mtp_layers needs experts: an MTP layer is a MoE block.")

    def mtp_block_fields(self) -> dict[str, Any]:
        """The fields an MTP layer's block is built with (`block_config`): every layer a
        mixture of experts (HF's MTP config sets `first_k_dense_replace = 0`)."""
        return {"mlp_only_layers": ()}

    def mtp_param_counts(self) -> tuple[int, int]:
        """(all, active per token) params of the MTP layers: each a MoE block (the family's
        `attention_params` and `moe_params`, two norms), three norms and the 2 x hidden ->
        hidden projection."""
        if not self.num_mtp_layers:
            return 0, 0
        e = self.hidden_size
        moe_all, moe_active = self.moe_params(e)
        extra = self.attention_params() + 2 * e + 3 * e + 2 * e * e
        return self.num_mtp_layers * (extra + moe_all), self.num_mtp_layers * (extra + moe_active)


def shifted(x: Array, k: int, fill: Any = 0, slots: Array | None = None) -> Array:
    """`x` `[batch, length, ...]` moved k places earlier along its length: position i holds
    x[i + k], the last k positions `fill`. With `slots` (int32 `[length]`, the slot each
    position holds: context parallelism's load-balanced order, `Mask.slots`), k slots on:
    position i holds the x of the position at slot `slots[i] + k`."""
    x = jnp.asarray(x)
    if k == 0:
        return x
    if slots is None:
        pad = jnp.full((x.shape[0], k, *x.shape[2:]), fill, x.dtype)
        return jnp.concatenate([x[:, k:], pad], axis=1)
    length = x.shape[1]
    slots = jnp.asarray(slots, jnp.int32)
    position_of = jnp.zeros((length,), jnp.int32).at[slots].set(jnp.arange(length, dtype=jnp.int32))
    source = slots + k
    moved = jnp.take(x, position_of[jnp.minimum(source, length - 1)], axis=1)
    inside = (source < length).reshape(1, length, *(1,) * (x.ndim - 2))
    return jnp.where(inside, moved, jnp.asarray(fill, x.dtype))


def depth_targets(
    targets: Array,
    weights: Array,
    segment_ids: Array | None,
    k: int,
    slots: Array | None = None,
) -> tuple[Array, Array]:
    """Depth k's targets and loss weights `[batch, length]`: position i predicts `targets[i +
    k]` (token i + k + 1) with its weight, where that target lies in position i's segment
    (rows in the load-balanced order: `slots`, as `shifted`)."""
    t, w = shifted(targets, k, slots=slots), shifted(weights, k, slots=slots)
    if segment_ids is not None:
        w = w * (shifted(segment_ids, k, -1, slots) == segment_ids).astype(w.dtype)
    return t, w


class MtpLayer(nn.Module):
    """One depth: `(embedded, hidden, mask, block_args) -> hidden` (`block_cls` called with
    index 0, `mask`, no decoding, then `block_args`)."""

    config: Any
    block_cls: type[nn.Module]
    deterministic: bool = True

    @nn.compact
    def __call__(
        self, embedded: Array, hidden: Array, mask: masks.Mask, block_args: tuple[Any, ...]
    ) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        norm = dict(epsilon=cfg.rms_norm_eps, **dense)
        norm["scale_plus_one"] = cfg.norm_scale_plus_one  # Qwen3-Next's (1 + w) norms
        e = layers.RMSNorm(name="enorm", **norm)(embedded)
        h = layers.RMSNorm(name="hnorm", **norm)(hidden.astype(e.dtype))
        x = layers.DenseGeneral(cfg.hidden_size, ("mlp", "embed"), name="eh_proj", **dense)(
            jnp.concatenate([e, h], axis=-1)
        )
        x = layers.constrain(x, layers.ACTIVATION_AXES)
        block = self.block_cls(config=cfg, deterministic=self.deterministic, name="block")
        x = block(x, jnp.asarray(0, jnp.int32), mask, None, *block_args)
        return layers.RMSNorm(
            cfg.rms_norm_eps,
            scale_plus_one=cfg.norm_scale_plus_one,
            dtype=jnp.float32,
            param_dtype=cfg.param_dtype,
            name="post_norm",
        )(x)


def block_config(config: Any) -> Any:
    """The config an MTP block is built with (`MtpOptions.mtp_block_fields`)."""
    return dataclasses.replace(config, **config.mtp_block_fields())


def runs(module: nn.Module, decoding: masks.Decoding | None) -> bool:
    """Whether `module`'s MTP layers run in this call: where its config has some, a loss asks
    for their hidden states (`MTP_COLLECTION` mutable) or the params are built; never while
    decoding."""
    if not getattr(module.config, "num_mtp_layers", 0) or decoding is not None:
        return False  # (a family sharing the module may have none)
    return module.is_initializing() or module.is_mutable_collection(MTP_COLLECTION)


def after_trunk(
    module: nn.Module,
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
    """`causal_lm.CausalLM.after_trunk` of a family with MTP layers (its config an
    `MtpOptions`): the depths run and their hidden states sown where a loss asks for them
    (`MTP_COLLECTION` mutable) or the params are built; never while decoding."""
    del trunk, segment_ids  # the trunk's mask holds the segments
    if not runs(module, decoding):
        return
    block_cfg = block_config(module.config)
    for k in range(1, module.config.num_mtp_layers + 1):
        x, args = module.block_inputs(
            embed(shifted(tokens, k, slots=slots)), shifted(positions, k, slots=slots), None
        )
        layer = MtpLayer(block_cfg, module.block_cls, deterministic, name=f"mtp_{k - 1}")
        hidden = layer(x, hidden, mask, args)
        module.sow(MTP_COLLECTION, HIDDEN, hidden)
