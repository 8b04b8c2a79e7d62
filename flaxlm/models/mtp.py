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


def shifted(x: Array, k: int, fill: Any = 0) -> Array:
    """`x` `[batch, length, ...]` moved k places earlier along its length: position i holds
    x[i + k], the last k positions `fill`."""
    if k == 0:
        return x
    pad = jnp.full((x.shape[0], k, *x.shape[2:]), fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


def depth_targets(
    targets: Array, weights: Array, segment_ids: Array | None, k: int
) -> tuple[Array, Array]:
    """Depth k's targets and loss weights `[batch, length]`: position i predicts `targets[i +
    k]` (token i + k + 1) with its weight, where that target lies in position i's segment."""
    t, w = shifted(targets, k), shifted(weights, k)
    if segment_ids is not None:
        w = w * (shifted(segment_ids, k, -1) == segment_ids).astype(w.dtype)
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
        e = layers.RMSNorm(name="enorm", **norm)(embedded)
        h = layers.RMSNorm(name="hnorm", **norm)(hidden.astype(e.dtype))
        x = layers.DenseGeneral(cfg.hidden_size, ("mlp", "embed"), name="eh_proj", **dense)(
            jnp.concatenate([e, h], axis=-1)
        )
        x = layers.constrain(x, layers.ACTIVATION_AXES)
        block = self.block_cls(config=cfg, deterministic=self.deterministic, name="block")
        x = block(x, jnp.asarray(0, jnp.int32), mask, None, *block_args)
        return layers.RMSNorm(
            cfg.rms_norm_eps, dtype=jnp.float32, param_dtype=cfg.param_dtype, name="post_norm"
        )(x)


def block_config(config: Any) -> Any:
    """The config an MTP block is built with: every layer a mixture of experts (HF's MTP
    config sets `first_k_dense_replace = 0`)."""
    return dataclasses.replace(config, mlp_only_layers=())
