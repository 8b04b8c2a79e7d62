"""The losses a model adds from what its layers sow during the forward pass: a mixture of
experts' router losses (`routing.loss_terms`) and the multi-token-prediction layers' loss
(`mtp.py`). `base.BaseModel` inherits them; they read its `_apply`, `_loss_and_sums`,
`_chunked_loss_sums`, `_mask_padded_vocab`, `_feature`, `module`, `config`, `z_loss` and
`loss_chunk_size`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from flaxlm.models import losses, mtp, routing

Array = jax.Array
Batch = Mapping[str, Array]
Params = Any


class SownLosses:
    """`_sown_loss_fn`: `BaseModel.loss_fn` of a model with experts or MTP layers."""

    def _sown_loss_fn(
        self,
        params: Params,
        batch: Batch,
        rng: Array | None,
        normalizer: Array | float | None,
        targets: Array,
        weights: Array,
    ) -> tuple[Array, dict[str, Array]]:
        """`loss_fn` of a mixture of experts or a model with MTP layers (Qwen3.5's dense
        one): the same cross-entropy plus the router losses
        (`routing.loss_terms`) from the statistics its layers sow, weighted by this batch's share
        of the normalizer (so microbatches add up to the whole batch's); with MTP layers
        (DeepSeek-V3's `num_mtp_layers`), their loss (`mtp.py`)."""
        depths = getattr(self.config, "num_mtp_layers", 0)
        sow = {"mutable": [routing.ROUTER_COLLECTION, *([mtp.MTP_COLLECTION] if depths else [])]}
        if self.loss_chunk_size is None:
            out, sown = self._apply(params, batch, rng=rng, **sow)
            sums = losses.cross_entropy(self._mask_padded_vocab(out), targets, weights, self.z_loss)
        else:
            hidden, sown = self._apply(params, batch, rng=rng, return_hidden=True, **sow)
            sums = self._chunked_loss_sums(params, batch, rng, targets, weights, hidden=hidden)
        loss, metrics = self._loss_and_sums(sums, weights, normalizer)
        weight_sum = metrics["weight_sum"]
        normalizer = jnp.maximum(weight_sum, 1.0) if normalizer is None else normalizer
        router_loss, router_sums = routing.loss_terms(self.config, sown, weight_sum)
        loss, metrics = loss + weight_sum / normalizer * router_loss, {**metrics, **router_sums}
        if depths:  # lambda / D x the depths' summed cross-entropies, normalised as the loss
            hiddens = sown[mtp.MTP_COLLECTION][mtp.HIDDEN]
            mtp_sum = self._mtp_loss_sum(params, batch, rng, targets, weights, hiddens) / depths
            loss += self.config.mtp_loss_weight * mtp_sum / normalizer
            metrics["mtp_loss_sum"] = mtp_sum
        return loss, metrics

    def _mtp_loss_sum(
        self,
        params: Params,
        batch: Batch,
        rng: Array | None,
        targets: Array,
        weights: Array,
        hiddens: Sequence[Array],
    ) -> Array:
        """The summed cross-entropy of every MTP depth (`mtp.py`): depth k's hidden states
        through the head, against the targets k places on (`mtp.depth_targets`)."""
        segment_ids = batch.get(self._feature("segment_ids"))
        slots = batch.get(self._feature("slots"))  # the load-balanced order's, if any
        total = jnp.zeros((), jnp.float32)
        for k, hidden in enumerate(hiddens, start=1):
            t, w = mtp.depth_targets(targets, weights, segment_ids, k, slots)
            if self.loss_chunk_size is None:
                logits = self._mask_padded_vocab(self.module.head_logits(params, hidden))
                total += losses.cross_entropy(logits, t, w, self.z_loss)[0]
            else:
                total += self._chunked_loss_sums(params, batch, rng, t, w, hidden=hidden)[0]
        return total
