"""T5: encoder-decoder with bucketed relative position biases, unscaled attention, RMS norms.

Follows HuggingFace's `T5ForConditionalGeneration` (the PyTorch reference our logits must
match). One module covers both published generations: T5 v1.0 (ReLU MLP, head tied to the
shared embedding, decoder output scaled by d_model**-0.5) and T5 v1.1 / FLAN-T5 (gated-GELU
MLP, separate head, no scaling).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from flaxlm.models import attention, layers, masks, stacks
from flaxlm.models.base import EncoderDecoderModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, linear, register_hf
from flaxlm.models.options import ComputeOptions

Array = jax.Array


@gin.configurable
@dataclasses.dataclass(frozen=True)
class T5Config(ComputeOptions):
    """T5 hyper-parameters (HF names) and compute options."""

    vocab_size: int = 32128
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    d_model: int = 512
    d_kv: int = 64  # per-head width
    d_ff: int = 2048
    num_layers: int = 6  # encoder layers
    num_decoder_layers: int | None = None  # None: as many as the encoder
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    feed_forward_proj: str = "relu"  # "<act>" or "gated-<act>" (v1.1: "gated-gelu")
    tie_word_embeddings: bool = True  # the head reuses `shared` (v1.0)
    scale_decoder_outputs: bool = True  # multiply by d_model**-0.5 before the head (v1.0)
    layer_norm_epsilon: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("d_model", "d_kv", "d_ff", "num_layers", "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        if self.num_decoder_layers is not None and self.num_decoder_layers < 1:
            raise ValueError(
                f"num_decoder_layers must be positive (or None for num_layers), got "
                f"{self.num_decoder_layers}."
            )
        parts = self.feed_forward_proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise ValueError(
                f"feed_forward_proj {self.feed_forward_proj!r}: expected '<act>' or "
                "'gated-<act>', e.g. 'relu' or 'gated-gelu'."
            )
        if self.activation not in layers.ACTIVATIONS:
            raise ValueError(
                f"feed_forward_proj {self.feed_forward_proj!r}: activation {parts[-1]!r} is not "
                f"one of {sorted(layers.ACTIVATIONS)}."
            )
        buckets = self.relative_attention_num_buckets
        if buckets < 4 or buckets % 2:
            raise ValueError(
                f"relative_attention_num_buckets must be even and at least 4, got {buckets}."
            )
        if self.relative_attention_max_distance <= buckets // 2:
            raise ValueError(
                f"relative_attention_max_distance {self.relative_attention_max_distance} must "
                f"exceed relative_attention_num_buckets // 2 = {buckets // 2}."
            )
        super().__post_init__()

    @property
    def decoder_layers(self) -> int:
        return self.num_decoder_layers or self.num_layers

    @property
    def is_gated(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @property
    def activation(self) -> str:
        act = self.feed_forward_proj.split("-")[-1]
        # HF's "gated-gelu" means the tanh approximation (as the original Mesh TF code).
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else act

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.d_kv

    def num_params(self) -> int:
        """Parameter count (as HF counts it: a tied head once)."""
        e, v = self.d_model, self.vocab_size
        attention = 4 * e * self.inner_dim
        mlp = (3 if self.is_gated else 2) * e * self.d_ff
        encoder_block = attention + mlp + 2 * e
        decoder_block = 2 * attention + mlp + 3 * e
        tables = 2 * self.relative_attention_num_buckets * self.num_heads
        head = 0 if self.tie_word_embeddings else e * v
        return (
            v * e
            + self.num_layers * encoder_block
            + self.decoder_layers * decoder_block
            + tables
            + 2 * e
            + head
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per target token with an equally long input: 6N plus attention."""
        # Token lookups are free; the head is a matmul whether or not it reuses `shared`.
        lookups = 0 if self.tie_word_embeddings else self.vocab_size * self.d_model
        matmul_params = self.num_params() - lookups
        attention_layers = self.num_layers + 2 * self.decoder_layers  # self + cross
        return 6.0 * matmul_params + 12.0 * attention_layers * self.inner_dim * seq_len

    def make_module(self) -> T5:
        return T5(self)


# ------------------------------------------------------------------ relative positions


@functools.cache
def _bucket_of_distance(num_buckets: int, max_distance: int) -> np.ndarray:
    """Bucket of each distance 0..max_distance (larger distances take the last entry).

    Half the buckets are exact distances, the rest logarithmic up to `max_distance`; the
    float32 arithmetic is HF's (and Mesh TF's), so bucket edges agree exactly.
    """
    max_exact = num_buckets // 2
    distance = np.arange(max_distance + 1)
    ratio = np.maximum(distance, 1).astype(np.float32) / np.float32(max_exact)
    scaled = np.log(ratio) / np.float32(math.log(max_distance / max_exact))
    large = max_exact + (scaled * np.float32(num_buckets - max_exact)).astype(np.int32)
    return np.where(distance < max_exact, distance, np.minimum(large, num_buckets - 1))


def relative_position_buckets(
    q_positions: Array,
    k_positions: Array,
    *,
    bidirectional: bool,
    num_buckets: int,
    max_distance: int,
) -> Array:
    """int32 `[batch, q_len, kv_len]` bucket of each key position relative to each query.

    Bidirectional (encoder): half the buckets for keys after the query. Otherwise (decoder)
    all buckets describe keys at or before the query; later keys share bucket 0 (masked).
    """
    relative = k_positions[:, None, :] - q_positions[:, :, None]
    if bidirectional:
        num_buckets //= 2
        offset = jnp.where(relative > 0, num_buckets, 0)
        distance = jnp.abs(relative)
    else:
        offset = 0
        distance = jnp.maximum(-relative, 0)
    table = jnp.asarray(_bucket_of_distance(num_buckets, max_distance), jnp.int32)
    return offset + table[jnp.minimum(distance, max_distance)]


# ------------------------------------------------------------------ module


def _normal(std: float) -> layers.Initializer:
    return nn.initializers.normal(std)


class T5Attention(nn.Module):
    """Multi-head attention without score scaling (T5 folds it into the init); `kv=None` is
    self-attention."""

    config: T5Config

    @nn.compact
    def __call__(
        self,
        x: Array,
        kv: Array | None,
        mask: Array | None,
        bias: Array | None,
        decoding: masks.Decoding | None = None,
    ) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)

        def projection(name: str, std: float) -> layers.DenseGeneral:
            # [batch, length, embed] -> [batch, length, heads, head_dim]
            return layers.DenseGeneral(
                (cfg.num_heads, cfg.d_kv),
                ("embed", "heads", "head_dim"),
                kernel_init=_normal(std),
                name=name,
                **dense,
            )

        # HF's init: the query absorbs the missing 1/sqrt(d_kv).
        q_proj = projection("q", (cfg.d_model * cfg.d_kv) ** -0.5)
        kv_proj = [projection(n, cfg.d_model**-0.5) for n in ("k", "v")]
        if kv is None:  # self-attention: one fused projection of x
            q, k, v = layers.parallel_dense(x, [q_proj, *kv_proj])
        else:
            q = q_proj(x)
            k, v = layers.parallel_dense(kv, kv_proj)
        q, k, v = (layers.constrain(y, layers.HEAD_AXES) for y in (q, k, v))
        k, v = attention.KVCache(name="cache")(k, v, decoding)
        out = attention.dot_product_attention(
            q,
            k,
            v,
            mask,
            bias=bias,
            scale=1.0,
            dtype=cfg.dtype,
            implementation=cfg.attention,
            chunk_size=cfg.attention_chunk_size,
            context_parallel=cfg.context_parallel,
        )
        return layers.DenseGeneral(
            cfg.d_model,
            ("heads", "head_dim", "embed"),
            axis=(-2, -1),
            kernel_init=_normal(cfg.inner_dim**-0.5),
            name="o",
            **dense,
        )(out)


class T5MLP(nn.Module):
    """`wo(act(wi(x)))`, or `wo(act(wi_0(x)) * wi_1(x))` when gated."""

    config: T5Config
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        act = layers.ACTIVATIONS[cfg.activation]

        names = ("wi_0", "wi_1") if cfg.is_gated else ("wi",)
        wi = layers.parallel_dense(
            x,
            [
                layers.DenseGeneral(
                    cfg.d_ff,
                    ("embed", "mlp"),
                    kernel_init=_normal(cfg.d_model**-0.5),
                    name=name,
                    **dense,
                )
                for name in names
            ],
        )
        h = act(wi[0]) * wi[1] if cfg.is_gated else act(wi[0])
        h = layers.constrain(h, ("batch", "length", "mlp"))
        if cfg.dropout_rate:
            h = nn.Dropout(cfg.dropout_rate)(h, deterministic=self.deterministic)
        return layers.DenseGeneral(
            cfg.d_model, ("mlp", "embed"), kernel_init=_normal(cfg.d_ff**-0.5), name="wo", **dense
        )(h)


class T5Block(nn.Module):
    """Pre-norm self-attention, cross-attention (decoder only) and MLP, each residual."""

    config: T5Config
    is_decoder: bool = False
    deterministic: bool = True

    @nn.compact
    def __call__(
        self,
        x: Array,
        bias: Array,
        mask: Array | None,
        encoded: Array | None = None,
        cross_mask: Array | None = None,
        decoding: masks.Decoding | None = None,
    ) -> Array:
        cfg = self.config
        norm = dict(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, param_dtype=cfg.param_dtype)

        def residual(x: Array, y: Array, name: str) -> Array:
            y = checkpoint_name(y, name)
            if cfg.dropout_rate:
                y = nn.Dropout(cfg.dropout_rate)(y, deterministic=self.deterministic)
            return layers.constrain(x + y, layers.ACTIVATION_AXES)

        x = layers.constrain(x, layers.ACTIVATION_AXES)
        h = layers.RMSNorm(**norm, name="self_attention_norm")(x)
        x = residual(
            x, T5Attention(cfg, name="SelfAttention")(h, None, mask, bias, decoding), "attn_out"
        )
        if self.is_decoder:
            h = layers.RMSNorm(**norm, name="cross_attention_norm")(x)
            attn = T5Attention(cfg, name="EncDecAttention")(h, encoded, cross_mask, None)
            x = residual(x, attn, "attn_out")
        h = layers.RMSNorm(**norm, name="mlp_norm")(x)
        mlp = T5MLP(cfg, deterministic=self.deterministic, name="DenseReluDense")(h)
        return residual(x, mlp, "mlp_out")


class T5Stack(nn.Module):
    """The encoder or the decoder: position-bias table, blocks, final norm.

    The table (HF keeps it in the first block) gives one bias that every block adds.
    """

    config: T5Config
    is_decoder: bool = False

    @nn.compact
    def __call__(
        self,
        x: Array,
        segment_ids: Array | None,
        positions: Array | None,
        encoded: Array | None = None,
        encoder_segment_ids: Array | None = None,
        *,
        deterministic: bool = True,
        decoding: masks.Decoding | None = None,
    ) -> Array:
        cfg = self.config
        batch, length = x.shape[:2]
        if decoding is not None:
            # The queries sit at cache slots index.., the keys at every slot of the cache.
            positions = decoding.index + jnp.arange(length, dtype=jnp.int32)[None]
            key_positions = jnp.arange(decoding.length, dtype=jnp.int32)[None]
        elif positions is None:
            positions = jnp.arange(length, dtype=jnp.int32)[None]
        if decoding is None:
            key_positions = positions
        table = self.param(
            "relative_attention_bias",
            nn.with_logical_partitioning(_normal(cfg.d_model**-0.5), (None, "heads")),
            (cfg.relative_attention_num_buckets, cfg.num_heads),
            layers.as_dtype(cfg.param_dtype),
        )
        buckets = relative_position_buckets(
            positions,
            key_positions,
            bidirectional=not self.is_decoder,
            num_buckets=cfg.relative_attention_num_buckets,
            max_distance=cfg.relative_attention_max_distance,
        )
        # [batch or 1, q_len, kv_len, heads] -> [batch or 1, heads, q_len, kv_len]
        bias = jnp.take(table.astype(jnp.float32), buckets, axis=0).transpose(0, 3, 1, 2)

        args: tuple[Array | None, ...]
        if self.is_decoder:
            mask = masks.causal_mask(segment_ids, batch, length, decoding)
            cross_mask = None
            if encoder_segment_ids is not None:
                cross_mask = masks.attention_mask(
                    segment_ids,
                    batch,
                    length,
                    causal=False,
                    kv_segment_ids=encoder_segment_ids,
                    kv_length=encoded.shape[1],
                )
            args = (bias, mask, encoded, cross_mask, decoding)
        else:
            mask = None
            if segment_ids is not None:
                mask = masks.attention_mask(segment_ids, batch, length, causal=False)
            args = (bias, mask)

        if cfg.dropout_rate:
            x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = stacks.stack_blocks(
            T5Block,
            cfg.decoder_layers if self.is_decoder else cfg.num_layers,
            scan_layers=cfg.scan_layers,
            remat_policy=cfg.remat_policy,
            name="block",
            config=cfg,
            is_decoder=self.is_decoder,
            deterministic=deterministic,
        )(x, *args)
        x = layers.RMSNorm(
            cfg.layer_norm_epsilon,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="final_layer_norm",
        )(x)
        if cfg.dropout_rate:
            x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        return layers.constrain(x, layers.ACTIVATION_AXES)


class T5(nn.Module):
    """`(encoder_tokens, decoder_tokens, encoder_segment_ids, decoder_segment_ids,
    encoder_positions, decoder_positions) -> float32 logits [batch, target_len, vocab]`.

    Segment ids (0 = padding) keep packed examples apart and hide padding; positions (which
    restart in each packed segment) default to 0..length-1. `encode` and `decode` are the
    two halves, for decoding with a fixed encoder output.
    """

    config: T5Config

    def setup(self) -> None:
        cfg = self.config
        self.shared = layers.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            embedding_init=_normal(1.0),
        )
        self.encoder = T5Stack(cfg, is_decoder=False)
        self.decoder = T5Stack(cfg, is_decoder=True)
        if not cfg.tie_word_embeddings:
            self.lm_head = layers.DenseGeneral(
                cfg.vocab_size,
                ("embed", "vocab"),
                dtype=cfg.dtype,
                out_dtype=jnp.float32,
                param_dtype=cfg.param_dtype,
                # t5x's fan-in init (HF's std 1.0 starts from logits of std sqrt(d_model)).
                kernel_init=_normal(cfg.d_model**-0.5),
            )

    def encode(
        self,
        tokens: Array,
        segment_ids: Array | None = None,
        positions: Array | None = None,
        *,
        deterministic: bool = True,
    ) -> Array:
        """`[batch, input_len]` tokens -> `[batch, input_len, embed]` encoder output."""
        x = self.shared(tokens)
        return self.encoder(x, segment_ids, positions, deterministic=deterministic)

    def decode(
        self,
        encoded: Array,
        tokens: Array,
        encoder_segment_ids: Array | None = None,
        segment_ids: Array | None = None,
        positions: Array | None = None,
        *,
        deterministic: bool = True,
        decoding: masks.Decoding | None = None,
    ) -> Array:
        """Shifted targets `[batch, target_len]` over an encoder output -> float32 logits.

        With `decoding`, `tokens` are the next ones to decode and the decoder's self-attention
        reads and extends the `cache` collection."""
        cfg = self.config
        x = self.shared(tokens)
        x = self.decoder(
            x,
            segment_ids,
            positions,
            encoded,
            encoder_segment_ids,
            deterministic=deterministic,
            decoding=decoding,
        )
        x = x.astype(jnp.float32)
        if cfg.scale_decoder_outputs:
            x = x * cfg.d_model**-0.5
        if cfg.tie_word_embeddings:
            # The head in the compute dtype, float32 logits (`layers.dot_general`).
            logits = self.shared.attend(x, out_dtype=jnp.float32)
        else:
            logits = self.lm_head(x)
        return layers.constrain(logits, ("batch", "length", "vocab"))

    def __call__(
        self,
        encoder_tokens: Array,
        decoder_tokens: Array,
        encoder_segment_ids: Array | None = None,
        decoder_segment_ids: Array | None = None,
        encoder_positions: Array | None = None,
        decoder_positions: Array | None = None,
        *,
        deterministic: bool = True,
    ) -> Array:
        encoded = self.encode(
            encoder_tokens, encoder_segment_ids, encoder_positions, deterministic=deterministic
        )
        return self.decode(
            encoded,
            decoder_tokens,
            encoder_segment_ids,
            decoder_segment_ids,
            decoder_positions,
            deterministic=deterministic,
        )


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides) -> T5Config:
    # Two spellings. transformers 4 (the Hub's T5, v1.1, Flan-T5 files): one flag,
    # `tie_word_embeddings`, true for v1.0 (head tied, decoder output scaled by
    # d_model**-0.5) and false for v1.1 / Flan-T5 / mT5 (neither). transformers 5 records the
    # scaling as `scale_decoder_outputs` and always writes `tie_word_embeddings: true`: the
    # head is untied exactly when the file stores an `lm_head.weight` of its own, which
    # hf.from_pretrained checks (HFSpec.tied_head).
    tie = hf.get("tie_word_embeddings", True) is not False
    scale = hf.get("scale_decoder_outputs")
    if scale is None:
        scale = tie
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["d_model"],
        d_kv=hf["d_kv"],
        d_ff=hf["d_ff"],
        num_layers=hf["num_layers"],
        num_decoder_layers=hf.get("num_decoder_layers"),
        num_heads=hf["num_heads"],
        relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
        feed_forward_proj=hf.get("feed_forward_proj", "relu"),
        tie_word_embeddings=tie,
        scale_decoder_outputs=bool(scale),
        layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-6),
        dropout_rate=hf.get("dropout_rate", 0.0),
    )
    kwargs.update(overrides)
    return T5Config(**kwargs)


def config_to_hf(cfg: T5Config) -> dict:
    return {
        "model_type": "t5",
        "architectures": ["T5ForConditionalGeneration"],
        "vocab_size": cfg.real_vocab_size or cfg.vocab_size,
        "d_model": cfg.d_model,
        "d_kv": cfg.d_kv,
        "d_ff": cfg.d_ff,
        "num_layers": cfg.num_layers,
        "num_decoder_layers": cfg.decoder_layers,
        "num_heads": cfg.num_heads,
        "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
        "relative_attention_max_distance": cfg.relative_attention_max_distance,
        "feed_forward_proj": cfg.feed_forward_proj,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "scale_decoder_outputs": cfg.scale_decoder_outputs,
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "dropout_rate": cfg.dropout_rate,
        "is_encoder_decoder": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    }


def _stack_tensors(cfg: T5Config, stack: str) -> list[HFTensor]:
    decoder = stack == "decoder"
    n = cfg.decoder_layers if decoder else cfg.num_layers
    p, h = f"{stack}/block_{{i}}", f"{stack}.block.{{i}}.layer"
    sublayers = [(0, "SelfAttention", "self_attention_norm")]
    if decoder:
        sublayers.append((1, "EncDecAttention", "cross_attention_norm"))
    out = []
    for index, sublayer, norm in sublayers:
        out.append(HFTensor(f"{p}/{norm}/scale", f"{h}.{index}.layer_norm.weight", layers=n))
        out += [
            linear(f"{p}/{sublayer}/{w}/kernel", f"{h}.{index}.{sublayer}.{w}.weight", layers=n)
            for w in ("q", "k", "v")
        ]
        out.append(
            linear(f"{p}/{sublayer}/o/kernel", f"{h}.{index}.{sublayer}.o.weight", 2, layers=n)
        )
    mlp = len(sublayers)
    out.append(HFTensor(f"{p}/mlp_norm/scale", f"{h}.{mlp}.layer_norm.weight", layers=n))
    for w in ("wi_0", "wi_1", "wo") if cfg.is_gated else ("wi", "wo"):
        out.append(
            linear(
                f"{p}/DenseReluDense/{w}/kernel", f"{h}.{mlp}.DenseReluDense.{w}.weight", layers=n
            )
        )
    return [
        HFTensor(
            f"{stack}/relative_attention_bias",
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            split=1,
        ),
        *out,
        HFTensor(f"{stack}/final_layer_norm/scale", f"{stack}.final_layer_norm.weight"),
    ]


def hf_tensors(cfg: T5Config) -> list[HFTensor]:
    tensors = [
        HFTensor("shared/embedding", "shared.weight", split=1, vocab_axis=0),
        *_stack_tensors(cfg, "encoder"),
        *_stack_tensors(cfg, "decoder"),
    ]
    if not cfg.tie_word_embeddings:
        tensors.append(linear("lm_head/kernel", "lm_head.weight", vocab_axis=1))
    return tensors


HF_SPEC = register_hf(
    HFSpec(
        model_types=("t5",),
        config_cls=T5Config,
        model_cls=EncoderDecoderModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        # Copies of `shared` that older checkpoints store, and a table HF never uses.
        ignore=(
            r"^(encoder|decoder)\.embed_tokens\.weight$",
            r"^lm_head\.weight$",
            r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$",
        ),
        auto_class="AutoModelForSeq2SeqLM",
        tied_head=("lm_head.weight", "shared.weight"),
    )
)
