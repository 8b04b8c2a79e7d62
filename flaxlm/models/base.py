"""Models around a Flax module: init, logical axes, loss, logits.

A model pairs a family's module (`gptj.py`, ...) with the loss that trains it and the seqio
converter that shapes its batches (imported when read: models compute without TensorFlow).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.models import (
    batch_shapes,
    context_parallel,
    decoding,
    layers,
    losses,
    masks,
    moe,
)
from flaxlm.models.cached_decoding import CachedDecoding
from flaxlm.models.causal_lm import CausalLM
from flaxlm.models.options import (
    ModuleConfig,
    eos_tuple,
)
from flaxlm.models.sown_losses import SownLosses

Array = jax.Array
Batch = Mapping[str, Array]
Params = Any


class BaseModel(SownLosses, abc.ABC):
    """Loss, logits and parameter layout of one module; DESIGN.md's model seam."""

    FEATURE_CONVERTER_CLS: Any  # a seqio converter class, imported when read (batch_shapes.py)
    TASK_FEATURES: tuple[str, ...] = ("targets",)  # the task features the converter reads
    UNPACKED_FEATURES: tuple[str, ...] = ()  # what the converter gives with pack=False

    def __init__(
        self,
        config: ModuleConfig = gin.REQUIRED,
        *,
        z_loss: float = 0.0,
        loss_chunk_size: int | None = None,
        eos_id: int | Sequence[int] | None = 1,
        special_ids: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
    ):
        """
        Args:
          loss_chunk_size: compute the loss this many positions at a time, so that the
            float32 logits `[batch, length, vocab]` never exist whole, in the forward or the
            backward pass (`losses.chunked_cross_entropy`; decoder-only models on
            `causal_lm.CausalLM`). None: all positions at once.
          eos_id: the token(s) that end generation (seqio's vocabularies use 1; an HF import
            takes its generation config's `eos_token_id`, else its config's).
          special_ids: an HF checkpoint's `*_token_id` settings (bos, eos as an int or a
            list, pad, decoder start, ...), kept so that an export writes them back.
          generation_config: an HF checkpoint's `generation_config.json`, kept likewise.
        """
        self.config = config
        self.module = config.make_module()
        self.z_loss = z_loss
        self.loss_chunk_size = loss_chunk_size
        if loss_chunk_size is not None:
            where = f"{type(self).__name__} with {type(self.module).__name__}"
            losses.check_chunk_size(loss_chunk_size, self._chunks_loss(), where)
        self.eos_ids = eos_tuple(eos_id)
        self.special_ids = dict(special_ids or {})
        self.generation_config = dict(generation_config) if generation_config else None

    # -------------------------------------------------------------- parameters

    @abc.abstractmethod
    def _dummy_batch(self, batch_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Array]: ...

    @abc.abstractmethod
    def _apply(self, params: Params, batch: Batch, *, rng: Array | None = None) -> Array: ...

    def init_boxed(self, rng: Array, batch_shapes: Mapping[str, tuple[int, ...]]) -> Any:
        """Fresh params boxed with their logical axes (`nn.Partitioned` leaves)."""
        batch = self._dummy_batch(batch_shapes)
        return self._init_variables(rng, batch)["params"]

    @abc.abstractmethod
    def _init_variables(self, rng: Array, batch: dict[str, Array]) -> Any: ...

    def init_params(self, rng: Array, batch_shapes: Mapping[str, tuple[int, ...]]) -> Params:
        """Fresh params (plain arrays). Works under `jax.eval_shape` and `jax.jit`."""
        return nn.unbox(self.init_boxed(rng, batch_shapes))

    def example_batch_shapes(self, length: int = 8, batch: int = 1) -> dict[str, tuple[int, int]]:
        """Model-feature shapes for `length`-long task features, unpacked (enough to build
        params)."""
        return batch_shapes.unpacked_shapes(self, length, batch)

    def params_axes(self, batch_shapes: Mapping[str, tuple[int, ...]]) -> Any:
        """Tree of PartitionSpecs of logical axis names, one per param."""
        boxed = jax.eval_shape(lambda: self.init_boxed(jax.random.PRNGKey(0), batch_shapes))
        return nn.get_partition_spec(boxed)

    # -------------------------------------------------------------- training

    def loss_fn(
        self,
        params: Params,
        batch: Batch,
        rng: Array | None,
        normalizer: Array | float | None = None,
    ) -> tuple[Array, dict[str, Array]]:
        """Weighted cross-entropy divided by `normalizer` (the batch's weight sum if None).

        Passing the global weight sum as `normalizer` makes microbatches add up to the
        full-batch loss exactly. Metrics are sums, so they also add across microbatches.
        """
        batch = self._arranged(batch)
        targets, weights = self.targets_and_weights(batch)
        if moe.has_experts(self.config) or getattr(self.config, "num_mtp_layers", 0):
            return self._sown_loss_fn(params, batch, rng, normalizer, targets, weights)
        if self.loss_chunk_size is None:
            logits = self._logits(params, batch, rng)
            sums = losses.cross_entropy(logits, targets, weights, self.z_loss)
        else:
            sums = self._chunked_loss_sums(params, batch, rng, targets, weights)
        return self._loss_and_sums(sums, weights, normalizer)

    def _loss_and_sums(
        self, sums: tuple[Array, Array, Array], weights: Array, normalizer: Array | float | None
    ) -> tuple[Array, dict[str, Array]]:
        loss_sum, z_sum, correct_sum = sums
        weight_sum = jnp.sum(weights.astype(jnp.float32))
        normalizer = jnp.maximum(weight_sum, 1.0) if normalizer is None else normalizer
        sums = {"loss_sum": loss_sum, "z_loss_sum": z_sum, "correct_sum": correct_sum}
        return loss_sum / normalizer, {**sums, "weight_sum": weight_sum}

    def normalizer(self, batch: Batch) -> Array:
        """What `loss_fn`'s sums are divided by: the batch's loss-weight sum (at least 1)."""
        weights = self.targets_and_weights(self._arranged(batch))[1]
        return jnp.maximum(jnp.sum(weights.astype(jnp.float32)), 1.0)

    def _arranged(self, batch: Batch) -> Batch:
        """`batch` in the order a loss or a score (sums over positions) is best computed in."""
        return batch

    def _chunks_loss(self) -> bool:
        """Whether `_chunked_loss_sums` is implemented (a `loss_chunk_size` is allowed)."""
        return False

    def _chunked_loss_sums(
        self,
        params: Params,
        batch: Batch,
        rng: Array | None,
        targets: Array,
        weights: Array,
        hidden: Array | None = None,
    ) -> tuple[Array, Array, Array]:
        """`hidden`: the final hidden states when already computed."""
        raise NotImplementedError

    def compute_logits(self, params: Params, batch: Batch) -> Array:
        """float32 logits `[batch, length, vocab]` (deterministic: no dropout)."""
        return self._logits(params, batch, None)

    def _logits(self, params: Params, batch: Batch, rng: Array | None) -> Array:
        return self._mask_padded_vocab(self._apply(params, batch, rng=rng))

    def _mask_padded_vocab(self, logits: Array) -> Array:
        """float32 logits where ids padded onto the vocabulary (for sharding) never win or
        take probability."""
        logits = logits.astype(jnp.float32)
        real = getattr(self.config, "real_vocab_size", None)
        if real is not None and real < logits.shape[-1]:
            ids = jnp.arange(logits.shape[-1])
            logits = jnp.where(ids < real, logits, jnp.finfo(jnp.float32).min)
        return logits

    def token_logps(
        self, params: Params, batch: Batch, rng: Array | None = None, temperature: float = 1.0
    ) -> tuple[Array, Array]:
        """float32 `[batch, length]`: each target's log-probability times its loss weight,
        and the weights (`rng`: with dropout; `temperature`: of softmax(logits /
        temperature), as a sampler at that temperature draws). Sums over positions score
        sequences (`score`, preference losses)."""
        batch = self._arranged(batch)
        targets, weights = self.targets_and_weights(batch)
        logits = self._logits(params, batch, rng)
        if temperature != 1.0:
            logits = logits / temperature
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        weights = weights.astype(jnp.float32)
        return losses.select_tokens(log_probs, targets) * weights, weights

    def score(self, params: Params, batch: Batch) -> Array:
        """float32 `[batch]`: each example's summed log-likelihood of its targets (weighted
        by the loss weights), from an unpacked batch of the model's features."""
        return self.token_logps(params, batch)[0].sum(-1)

    # -------------------------------------------------------------- decoding

    def check_decoding(
        self, inputs: np.ndarray, lengths: np.ndarray, config: decoding.DecodingConfig
    ) -> None:
        """Fails before any device work when a request cannot be decoded."""
        del inputs, lengths, config  # nothing to check in general

    def paged_refusal(self) -> str | None:
        """Why this model cannot decode over a paged KV cache, or None (`CachedDecoding`'s)."""
        return f"{type(self).__name__} decodes over a contiguous KV cache only."

    def decoding_params(self, params: Params) -> Params:
        """`params` as `prefill` and `decode_step` read them (a decoder-only model unrolls a
        scanned stack: `cached_decoding`); call once before decoding."""
        return params

    def _decode_module(self) -> nn.Module:
        """The module for decoding: the same params, no rematerialisation."""
        if getattr(self.config, "remat_policy", "none") == "none":
            return self.module
        return dataclasses.replace(self.config, remat_policy="none").make_module()

    def prefill(
        self, params: Params, inputs: Array, lengths: Array, config: decoding.DecodingConfig
    ) -> tuple[Array, dict[str, Any]]:
        """Reads the prompts (`num_beams` copies of each): float32 logits `[rows, vocab]` for
        the first new token, and the decoding state (the KV cache and what the steps need;
        a pytree whose 4-D+ leaves are the cache, rows in axis `ndim - 4`)."""
        raise TypeError(f"{type(self).__name__} does not generate text.")

    def decode_step(
        self,
        params: Params,
        token: Array,
        t: Array,
        state: dict[str, Any],
        config: decoding.DecodingConfig,
    ) -> tuple[Array, dict[str, Any]]:
        """Feeds new token number `t` (int32 `[rows]`): the logits for token `t + 1`."""
        raise TypeError(f"{type(self).__name__} does not generate text.")

    @abc.abstractmethod
    def targets_and_weights(self, batch: Batch) -> tuple[Array, Array]: ...

    def flops_per_token(self, seq_len: int) -> float:
        return self.config.flops_per_token(seq_len)

    def position_limit(self) -> int | None:
        """The longest sequence the model's positions cover (None: no limit)."""
        if hasattr(self.config, "position_limit"):
            return self.config.position_limit
        return getattr(self.config, "max_position_embeddings", None)

    def check_lengths(self, task_feature_lengths: Mapping[str, int]) -> None:
        """Fails early when a feature is longer than the model's positions."""
        limit = self.position_limit()
        for name, length in task_feature_lengths.items():
            if limit is not None and length > limit:
                raise ValueError(
                    f"Feature length {name}={length} exceeds the model's "
                    f"max_position_embeddings={limit}; shorten TASK_FEATURE_LENGTHS."
                )


class _SingleStackModel(BaseModel):
    """A model of one stack fed `<STACK>_input_tokens` (+ positions and segment ids), with
    the loss on `<STACK>_target_tokens` weighted by `<STACK>_loss_weights`."""

    STACK = "decoder"

    def _feature(self, name: str) -> str:
        return f"{self.STACK}_{name}"

    def _dummy_batch(self, batch_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Array]:
        key = self._feature("input_tokens")
        return {key: jnp.zeros(tuple(batch_shapes[key]), jnp.int32)}

    def _init_variables(self, rng: Array, batch: dict[str, Array]) -> Any:
        return self.module.init(rng, batch[self._feature("input_tokens")])

    def _apply(
        self, params: Params, batch: Batch, *, rng: Array | None = None, **kwargs: Any
    ) -> Array:
        """The module's output; `kwargs` go to its call."""
        rngs = {"dropout": rng} if rng is not None else None
        if batch.get(self._feature("slots")) is not None:
            kwargs["slots"] = batch[self._feature("slots")]
        return self.module.apply(
            {"params": params},
            batch[self._feature("input_tokens")],
            batch.get(self._feature("positions")),
            batch.get(self._feature("segment_ids")),
            deterministic=rng is None,
            rngs=rngs,
            **kwargs,
        )

    def targets_and_weights(self, batch: Batch) -> tuple[Array, Array]:
        targets = batch[self._feature("target_tokens")]
        weights = batch.get(self._feature("loss_weights"))
        if weights is None:
            weights = (targets > 0).astype(jnp.float32)
        return targets, weights


@gin.configurable
class DecoderOnlyModel(CachedDecoding, _SingleStackModel):
    """A causal language model over seqio's decoder-only features."""

    FEATURE_CONVERTER_CLS = batch_shapes.DECODER_CONVERTER
    UNPACKED_FEATURES = batch_shapes.DECODER_FEATURES

    def _chunks_loss(self) -> bool:
        return isinstance(self.module, CausalLM)

    def _arranged(self, batch: Batch) -> Batch:
        """`context_parallel.balanced_batch`, with the config's `context_parallel_balance`."""
        balance = getattr(self.config, "context_parallel_balance", False)
        if balance and isinstance(self.module, CausalLM):
            names = (self._feature(n) for n in ("input_tokens", "positions", "slots"))
            return context_parallel.balanced_batch(batch, *names)
        return batch

    def _chunked_loss_sums(
        self,
        params: Params,
        batch: Batch,
        rng: Array | None,
        targets: Array,
        weights: Array,
        hidden: Array | None = None,
    ) -> tuple[Array, Array, Array]:
        if hidden is None:
            hidden = self._apply(params, batch, rng=rng, return_hidden=True)

        def head(head_params: Params, x: Array, block: Array) -> Array:
            # The head has no dropout of its own; a dropout rng per block serves LoRA's.
            rngs = {"dropout": jax.random.fold_in(rng, block)} if rng is not None else None
            return self._mask_padded_vocab(self.module.head_logits(head_params, x, rngs=rngs))

        head_params, chunk = self.module.head_params(params), self.loss_chunk_size
        return losses.chunked_cross_entropy(
            hidden, head, head_params, targets, weights, chunk, self.z_loss
        )


@gin.configurable
class EncoderDecoderModel(BaseModel):
    """A sequence-to-sequence model over seqio's encoder-decoder features.

    The module is called as `module(encoder_input_tokens, decoder_input_tokens,
    encoder_segment_ids, decoder_segment_ids, encoder_positions, decoder_positions,
    deterministic=...)`, the last four possibly None, and returns logits
    `[batch, target_len, vocab]`. `decoder_input_tokens` are the targets shifted right
    (seqio's `EncDecFeatureConverter` does the shift).
    """

    FEATURE_CONVERTER_CLS = batch_shapes.ENCODER_DECODER_CONVERTER
    TASK_FEATURES = ("inputs", "targets")
    UNPACKED_FEATURES = batch_shapes.ENCODER_DECODER_FEATURES

    def _dummy_batch(self, batch_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Array]:
        return {
            k: jnp.zeros(tuple(batch_shapes[k]), jnp.int32)
            for k in ("encoder_input_tokens", "decoder_input_tokens")
        }

    def _init_variables(self, rng: Array, batch: dict[str, Array]) -> Any:
        return self.module.init(rng, batch["encoder_input_tokens"], batch["decoder_input_tokens"])

    def _apply(self, params: Params, batch: Batch, *, rng: Array | None = None) -> Array:
        rngs = {"dropout": rng} if rng is not None else None
        encoder_segment_ids = batch.get("encoder_segment_ids")
        if encoder_segment_ids is None:
            # seqio's unpacked batches carry no segment ids; the encoder's padding (id 0)
            # must still be hidden from its keys, as t5x masks `encoder_input_tokens > 0`.
            encoder_segment_ids = (batch["encoder_input_tokens"] > 0).astype(jnp.int32)
        return self.module.apply(
            {"params": params},
            batch["encoder_input_tokens"],
            batch["decoder_input_tokens"],
            encoder_segment_ids,
            batch.get("decoder_segment_ids"),
            batch.get("encoder_positions"),
            batch.get("decoder_positions"),
            deterministic=rng is None,
            rngs=rngs,
        )

    def targets_and_weights(self, batch: Batch) -> tuple[Array, Array]:
        targets = batch["decoder_target_tokens"]
        weights = batch.get("decoder_loss_weights")
        if weights is None:
            weights = (targets > 0).astype(jnp.float32)
        return targets, weights

    def _run_decoder(
        self, params: Params, tokens: Array, index: Array, state: dict[str, Any]
    ) -> tuple[Array, dict[str, Any]]:
        cache_len = decoding.cache_length(state["cache"])
        where = masks.Decoding(jnp.asarray(index, jnp.int32), state["start"], cache_len)
        with layers.decoding_products():
            logits, variables = self._decode_module().apply(
                {"params": params, "cache": state["cache"]},
                state["encoded"],
                tokens[:, None],
                state["encoder_segment_ids"],
                decoding=where,
                method="decode",
                mutable=["cache"],
            )
        return self._mask_padded_vocab(logits[:, -1]), {**state, "cache": variables["cache"]}

    def prefill(
        self, params: Params, inputs: Array, lengths: Array, config: decoding.DecodingConfig
    ) -> tuple[Array, dict[str, Any]]:
        # The encoder reads each input once; padding (segment 0) is never attended.
        segment_ids = (jnp.arange(inputs.shape[1])[None, :] < lengths[:, None]).astype(jnp.int32)
        module = self._decode_module()
        with layers.decoding_products():
            encoded = module.apply({"params": params}, inputs, segment_ids, method="encode")
        encoded, segment_ids = (
            jnp.repeat(x, config.num_beams, axis=0) for x in (encoded, segment_ids)
        )
        rows = encoded.shape[0]
        start = jnp.zeros((rows,), jnp.int32)
        cache_len = config.max_new_tokens  # the start token and all but the last new token

        def init_cache() -> Any:
            where = masks.Decoding(jnp.int32(0), start, cache_len)
            dummy = jnp.zeros((rows, cache_len), jnp.int32)
            variables = module.init(
                jax.random.PRNGKey(0), encoded, dummy, segment_ids, decoding=where, method="decode"
            )
            return variables["cache"]

        state = {"cache": decoding.empty_cache(init_cache), "start": start, "encoded": encoded}
        state["encoder_segment_ids"] = segment_ids
        # Decoding starts from the decoder start token (0, T5's pad id, as seqio shifts).
        return self._run_decoder(params, jnp.zeros((rows,), jnp.int32), jnp.int32(0), state)

    def decode_step(
        self,
        params: Params,
        token: Array,
        t: Array,
        state: dict[str, Any],
        config: decoding.DecodingConfig,
    ) -> tuple[Array, dict[str, Any]]:
        return self._run_decoder(params, token, t + 1, state)


@gin.configurable
class EncoderOnlyModel(_SingleStackModel):
    """A bidirectional encoder trained as a masked language model (RoBERTa).

    The module is called as `module(tokens, positions, segment_ids, deterministic=...)` and
    returns logits `[batch, length, vocab]` at every position; the loss counts only the
    positions `encoder_loss_weights` marks (the masked ones).
    """

    FEATURE_CONVERTER_CLS = batch_shapes.MASKED_LM_CONVERTER
    TASK_FEATURES = ("inputs", "targets")
    UNPACKED_FEATURES = batch_shapes.ENCODER_FEATURES
    STACK = "encoder"
