"""RoBERTa: a post-LN bidirectional encoder with a masked-LM head (tied to the embeddings
unless the config says otherwise).

Follows HuggingFace's `RobertaForMaskedLM`. Positions are learned and offset by the padding
index: HF numbers real tokens `pad_token_id + 1, pad_token_id + 2, ...`, so our position p
(0-based within its segment) reads row `p + pad_token_id + 1` of the table.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from flaxlm.models import attention, layers, masks, stacks
from flaxlm.models.base import EncoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, linear, register_hf
from flaxlm.models.options import ComputeOptions

Array = jax.Array


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RobertaConfig(ComputeOptions):
    """RoBERTa hyper-parameters (HF names in comments) and compute options."""

    vocab_size: int = 50265
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 768
    num_layers: int = 12  # HF: num_hidden_layers
    num_heads: int = 12  # HF: num_attention_heads
    intermediate_size: int = 3072
    max_position_embeddings: int = 514  # rows of the position table (offset included)
    type_vocab_size: int = 1
    pad_token_id: int = 1  # the position offset: real positions start at pad + 1
    layer_norm_epsilon: float = 1e-5  # HF: layer_norm_eps
    activation: str = "gelu"  # HF: hidden_act (the encoder's; the LM head's is always GELU)
    tie_word_embeddings: bool = True  # the LM head's decoder reuses the word embeddings

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}."
            )
        if self.max_position_embeddings <= self.pad_token_id + 1:
            raise ValueError(
                f"max_position_embeddings {self.max_position_embeddings} leaves no positions "
                f"after the offset pad_token_id + 1 = {self.pad_token_id + 1}."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_length(self) -> int:
        """The longest sequence the position table covers."""
        return self.max_position_embeddings - self.pad_token_id - 1

    def num_params(self) -> int:
        e, f, n, v = self.hidden_size, self.intermediate_size, self.num_layers, self.vocab_size
        block = 4 * e * e + 4 * e + 2 * e * f + f + e + 4 * e
        embeddings = (v + self.max_position_embeddings + self.type_vocab_size) * e + 2 * e
        head = 0 if self.tie_word_embeddings else v * e
        return embeddings + n * block + e * e + e + 2 * e + v + head

    def flops_per_token(self, seq_len: int) -> float:
        non_embedding = self.num_params() - self.vocab_size * self.hidden_size
        return (
            6.0 * (non_embedding + self.vocab_size * self.hidden_size)
            + 12.0 * self.num_layers * self.hidden_size * seq_len
        )

    def make_module(self) -> Roberta:
        return Roberta(self)


class RobertaLayer(nn.Module):
    config: RobertaConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: Array, mask: Array) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        norm = dict(epsilon=cfg.layer_norm_epsilon, param_dtype=cfg.param_dtype)
        x = layers.constrain(x, layers.ACTIVATION_AXES)
        names = ("query", "key", "value")
        projections = [
            layers.DenseGeneral(
                (cfg.num_heads, cfg.head_dim),
                ("embed", "heads", "head_dim"),
                use_bias=True,
                name=n,
                **dense,
            )
            for n in names
        ]
        qkv = dict(zip(names, layers.parallel_dense(x, projections)))
        q = layers.constrain(qkv["query"], layers.HEAD_AXES)
        k = layers.constrain(qkv["key"], layers.HEAD_AXES)
        attn = attention.dot_product_attention(
            q,
            k,
            qkv["value"],
            mask,
            dtype=cfg.dtype,
            implementation=cfg.attention,
            chunk_size=cfg.attention_chunk_size,
            context_parallel=cfg.context_parallel,
        )
        attn = layers.DenseGeneral(
            cfg.hidden_size,
            ("heads", "head_dim", "embed"),
            axis=(-2, -1),
            use_bias=True,
            name="attention_output",
            **dense,
        )(attn)
        attn = checkpoint_name(attn, "attn_out")
        if cfg.dropout_rate:
            attn = nn.Dropout(cfg.dropout_rate)(attn, deterministic=self.deterministic)
        x = layers.LayerNorm(name="attention_layer_norm", dtype=cfg.dtype, **norm)(x + attn)

        h = layers.DenseGeneral(
            cfg.intermediate_size, ("embed", "mlp"), use_bias=True, name="intermediate", **dense
        )(x)
        h = layers.constrain(layers.ACTIVATIONS[cfg.activation](h), ("batch", "length", "mlp"))
        h = layers.DenseGeneral(
            cfg.hidden_size, ("mlp", "embed"), use_bias=True, name="output", **dense
        )(h)
        h = checkpoint_name(h, "mlp_out")
        if cfg.dropout_rate:
            h = nn.Dropout(cfg.dropout_rate)(h, deterministic=self.deterministic)
        x = layers.LayerNorm(name="output_layer_norm", dtype=cfg.dtype, **norm)(x + h)
        return layers.constrain(x, layers.ACTIVATION_AXES)


class Roberta(nn.Module):
    """`(tokens, positions, segment_ids) -> float32 masked-LM logits [batch, length, vocab]`.

    Attention is bidirectional within a segment; segment id 0 (padding) is never attended
    by real tokens.
    """

    config: RobertaConfig

    @nn.compact
    def __call__(
        self,
        tokens: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        *,
        deterministic: bool = True,
    ) -> Array:
        cfg = self.config
        batch, length = tokens.shape
        positions = masks.default_positions(tokens, positions)
        mask = masks.attention_mask(segment_ids, batch, length, causal=False)
        embed = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        word = layers.Embed(cfg.vocab_size, cfg.hidden_size, name="word_embeddings", **embed)
        position_table = self.param(
            "position_embeddings",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "embed")),
            (cfg.max_position_embeddings, cfg.hidden_size),
            layers.as_dtype(cfg.param_dtype),
        )
        type_table = self.param(
            "token_type_embeddings",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "embed")),
            (cfg.type_vocab_size, cfg.hidden_size),
            layers.as_dtype(cfg.param_dtype),
        )
        dtype = layers.as_dtype(cfg.dtype)
        x = (
            word(tokens)
            + jnp.take(position_table, positions + cfg.pad_token_id + 1, axis=0).astype(dtype)
            + type_table[0].astype(dtype)
        )
        x = layers.LayerNorm(
            cfg.layer_norm_epsilon,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="embeddings_layer_norm",
        )(x)
        if cfg.dropout_rate:
            x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = stacks.stack_blocks(
            RobertaLayer,
            cfg.num_layers,
            scan_layers=cfg.scan_layers,
            remat_policy=cfg.remat_policy,
            name="layer",
            config=cfg,
            deterministic=deterministic,
        )(x, mask)

        # Masked-LM head: dense -> exact GELU (HF's RobertaLMHead, whatever hidden_act says)
        # -> layer norm -> decoder (tied, or its own kernel) + bias.
        h = layers.DenseGeneral(
            cfg.hidden_size,
            ("embed", None),
            use_bias=True,
            name="lm_head_dense",
            dtype=jnp.float32,
            param_dtype=cfg.param_dtype,
        )(x)
        h = layers.ACTIVATIONS["gelu"](h)
        h = layers.LayerNorm(
            cfg.layer_norm_epsilon, param_dtype=cfg.param_dtype, name="lm_head_layer_norm"
        )(h)
        if cfg.tie_word_embeddings:
            logits = word.attend(h.astype(dtype)).astype(jnp.float32)
        else:
            logits = layers.DenseGeneral(
                cfg.vocab_size,
                ("embed", "vocab"),
                use_bias=False,
                name="lm_head_decoder",
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
            )(h.astype(dtype)).astype(jnp.float32)
        bias = self.param(
            "lm_head_bias",
            nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
            (cfg.vocab_size,),
            layers.as_dtype(cfg.param_dtype),
        )
        logits = logits + bias.astype(jnp.float32)
        return layers.constrain(logits, ("batch", "length", "vocab"))


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides) -> RobertaConfig:
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"RoBERTa config.json sets position_embedding_type="
            f"{hf['position_embedding_type']!r}; flaxlm supports only 'absolute'."
        )
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise ValueError("RoBERTa config.json describes a decoder; flaxlm's RoBERTa is an encoder.")
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"],
        type_vocab_size=hf.get("type_vocab_size", 1),
        pad_token_id=hf.get("pad_token_id", 1),
        layer_norm_epsilon=hf.get("layer_norm_eps", 1e-12),
        activation=hf.get("hidden_act", "gelu"),
        tie_word_embeddings=hf.get("tie_word_embeddings", True) is not False,
    )
    kwargs.update(overrides)
    return RobertaConfig(**kwargs)


def config_to_hf(cfg: RobertaConfig) -> dict:
    return {
        "model_type": "roberta",
        "architectures": ["RobertaForMaskedLM"],
        "vocab_size": cfg.real_vocab_size or cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "type_vocab_size": cfg.type_vocab_size,
        "pad_token_id": cfg.pad_token_id,
        "layer_norm_eps": cfg.layer_norm_epsilon,
        "hidden_act": cfg.activation,
        "position_embedding_type": "absolute",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def hf_tensors(cfg: RobertaConfig) -> list[HFTensor]:
    n = cfg.num_layers
    hf = "roberta.encoder.layer.{i}"

    def norm(param: str, name: str, **kw) -> list[HFTensor]:
        return [
            HFTensor(f"{param}/scale", f"{name}.weight", **kw),
            HFTensor(f"{param}/bias", f"{name}.bias", **kw),
        ]

    def dense(param: str, name: str, split: int = 1, **kw) -> list[HFTensor]:
        return [
            linear(f"{param}/kernel", f"{name}.weight", split, **kw),
            HFTensor(f"{param}/bias", f"{name}.bias", **kw),
        ]

    tensors = [
        HFTensor(
            "word_embeddings/embedding",
            "roberta.embeddings.word_embeddings.weight",
            split=1,
            vocab_axis=0,
        ),
        HFTensor("position_embeddings", "roberta.embeddings.position_embeddings.weight", 1),
        HFTensor("token_type_embeddings", "roberta.embeddings.token_type_embeddings.weight", 1),
        *norm("embeddings_layer_norm", "roberta.embeddings.LayerNorm"),
    ]
    for p in ("query", "key", "value"):
        tensors += dense(f"layer_{{i}}/{p}", f"{hf}.attention.self.{p}", layers=n)
    tensors += [
        *dense("layer_{i}/attention_output", f"{hf}.attention.output.dense", 2, layers=n),
        *norm("layer_{i}/attention_layer_norm", f"{hf}.attention.output.LayerNorm", layers=n),
        *dense("layer_{i}/intermediate", f"{hf}.intermediate.dense", layers=n),
        *dense("layer_{i}/output", f"{hf}.output.dense", layers=n),
        *norm("layer_{i}/output_layer_norm", f"{hf}.output.LayerNorm", layers=n),
        *dense("lm_head_dense", "lm_head.dense"),
        *norm("lm_head_layer_norm", "lm_head.layer_norm"),
    ]
    if cfg.tie_word_embeddings:
        tensors.append(HFTensor("lm_head_bias", "lm_head.bias", vocab_axis=0))
    else:
        # Untied, HF's logits add `lm_head.decoder.bias`; its `lm_head.bias` is unused but
        # still a parameter, so an export writes the same values there.
        tensors += [
            linear("lm_head_decoder/kernel", "lm_head.decoder.weight", vocab_axis=1),
            HFTensor(
                "lm_head_bias", "lm_head.decoder.bias", vocab_axis=0, copies=("lm_head.bias",)
            ),
        ]
    return tensors


HF_SPEC = register_hf(
    HFSpec(
        model_types=("roberta",),
        config_cls=RobertaConfig,
        model_cls=EncoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        # Tied, the decoder is the word embeddings and its bias lm_head.bias; a file saved
        # from RobertaModel may carry the pooler, which masked-LM does not use.
        ignore=(r"^lm_head\.decoder\.(weight|bias)$", r"(^|\.)pooler\.", r"position_ids$"),
        auto_class="AutoModelForMaskedLM",
        base_model_prefix="roberta",
        tied_head=("lm_head.decoder.weight", "roberta.embeddings.word_embeddings.weight"),
    )
)
