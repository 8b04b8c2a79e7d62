"""Gemma: Llama-like blocks with a scaled embedding, (1 + w) RMSNorm, GeGLU and a tied head.

Follows HuggingFace's `GemmaForCausalLM` (the PyTorch reference our logits must match).
`head_dim` is independent of the width; the 2B model shares one key/value head (MQA).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from flaxlm.models import attention, layers
from flaxlm.models.base import ComputeOptions, DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, linear, register_hf

Array = jax.Array


@gin.configurable
@dataclasses.dataclass(frozen=True)
class GemmaConfig(ComputeOptions):
    """Gemma hyper-parameters (HF names where they exist) and compute options."""

    vocab_size: int = 256000
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 3072
    num_layers: int = 28  # HF: num_hidden_layers
    num_heads: int = 16  # HF: num_attention_heads
    num_kv_heads: int = 16  # HF: num_key_value_heads (1 for the 2B model)
    head_dim: int = 256
    intermediate_size: int = 24576
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = True  # the head reuses the token embedding
    activation: str = "gelu_pytorch_tanh"  # HF: hidden_act (older configs: hidden_activation)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads "
                f"{self.num_kv_heads}."
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings.")

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates)."""
        e, v, f = self.hidden_size, self.vocab_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = e * (q + 2 * kv) + q * e + (q + 2 * kv + e if self.attention_bias else 0)
        block = attn + 3 * e * f + 2 * e
        head = 0 if self.tie_word_embeddings else v * e
        return v * e + self.num_layers * block + e + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus the attention scores."""
        non_embedding = self.num_params() - self.vocab_size * self.hidden_size
        attn_width = self.num_heads * self.head_dim
        return 6.0 * non_embedding + 12.0 * self.num_layers * attn_width * seq_len

    def make_module(self) -> Gemma:
        return Gemma(self)


class GemmaBlock(nn.Module):
    config: GemmaConfig
    deterministic: bool = True

    @nn.compact
    def __call__(
        self,
        x: Array,
        sin: Array,
        cos: Array,
        mask: Array,
        decoding: attention.Decoding | None = None,
    ) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        norm = dict(epsilon=cfg.rms_norm_eps, scale_plus_one=True, **dense)
        x = layers.constrain(x, layers.ACTIVATION_AXES)
        h = layers.RMSNorm(name="input_layernorm", **norm)(x)

        attn = attention.rotary_self_attention(
            h,
            sin,
            cos,
            mask,
            decoding,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            hidden_size=cfg.hidden_size,
            use_bias=cfg.attention_bias,
            attention=cfg.attention,
            chunk_size=cfg.attention_chunk_size,
            **dense,
        )
        if cfg.dropout_rate:
            attn = nn.Dropout(cfg.dropout_rate)(attn, deterministic=self.deterministic)
        x = layers.constrain(x + attn, layers.ACTIVATION_AXES)

        # GeGLU MLP: down(gelu(gate(h)) * up(h))
        h = layers.RMSNorm(name="post_attention_layernorm", **norm)(x)
        m = layers.gated_mlp(
            h,
            intermediate_size=cfg.intermediate_size,
            hidden_size=cfg.hidden_size,
            activation=cfg.activation,
            use_bias=False,
            **dense,
        )
        if cfg.dropout_rate:
            m = nn.Dropout(cfg.dropout_rate)(m, deterministic=self.deterministic)
        return layers.constrain(x + m, layers.ACTIVATION_AXES)


class Gemma(nn.Module):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    config: GemmaConfig

    @nn.compact
    def __call__(
        self,
        tokens: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        *,
        deterministic: bool = True,
        decoding: attention.Decoding | None = None,
    ) -> Array:
        cfg = self.config
        batch, length = tokens.shape
        positions = attention.default_positions(tokens, positions)
        mask = attention.causal_mask(segment_ids, batch, length, decoding)
        sin, cos = attention.rotary_sin_cos(
            positions, attention.rotary_inv_freq(cfg.head_dim, cfg.rope_theta)
        )
        embed = layers.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="embed_tokens",
        )
        # HF rounds the sqrt(width) normaliser to the compute dtype before multiplying.
        x = embed(tokens) * jnp.asarray(cfg.hidden_size**0.5, layers.as_dtype(cfg.dtype))
        if cfg.dropout_rate:
            x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = layers.stack_blocks(
            GemmaBlock,
            cfg.num_layers,
            scan_layers=cfg.scan_layers,
            remat_policy=cfg.remat_policy,
            name="layers",
            config=cfg,
            deterministic=deterministic,
        )(x, sin, cos, mask, decoding)
        x = layers.RMSNorm(
            cfg.rms_norm_eps,
            scale_plus_one=True,
            dtype=jnp.float32,
            param_dtype=cfg.param_dtype,
            name="norm",
        )(x)
        if cfg.tie_word_embeddings:
            logits = jnp.einsum("ble,ve->blv", x, embed.embedding.astype(jnp.float32))
        else:
            logits = layers.DenseGeneral(
                cfg.vocab_size,
                ("embed", "vocab"),
                dtype=jnp.float32,
                param_dtype=cfg.param_dtype,
                name="lm_head",
            )(x)
        return layers.constrain(logits, ("batch", "length", "vocab"))


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides) -> GemmaConfig:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"config.json has rope type {kind!r}; flaxlm's Gemma has plain rotary.")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported: Gemma is causal here.")
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf["head_dim"],
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        attention_bias=hf.get("attention_bias", False),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        activation=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
    )
    kwargs.update(overrides)
    return GemmaConfig(**kwargs)


def config_to_hf(cfg: GemmaConfig) -> dict:
    return {
        "model_type": "gemma",
        "architectures": ["GemmaForCausalLM"],
        "vocab_size": cfg.real_vocab_size or cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.activation,
        "attention_dropout": 0.0,
    }


def hf_tensors(cfg: GemmaConfig) -> list[HFTensor]:
    n = cfg.num_layers
    attn = "model.layers.{i}.self_attn"
    block = [
        HFTensor(
            "layers_{i}/input_layernorm/scale", "model.layers.{i}.input_layernorm.weight", layers=n
        ),
        *(
            linear(f"layers_{{i}}/{p}/kernel", f"{attn}.{p}.weight", layers=n)
            for p in ("q_proj", "k_proj", "v_proj")
        ),
        linear("layers_{i}/o_proj/kernel", f"{attn}.o_proj.weight", 2, layers=n),
        HFTensor(
            "layers_{i}/post_attention_layernorm/scale",
            "model.layers.{i}.post_attention_layernorm.weight",
            layers=n,
        ),
        *(
            linear(f"layers_{{i}}/{p}/kernel", f"model.layers.{{i}}.mlp.{p}.weight", layers=n)
            for p in ("gate_proj", "up_proj", "down_proj")
        ),
    ]
    if cfg.attention_bias:
        block += [
            HFTensor(f"layers_{{i}}/{p}/bias", f"{attn}.{p}.bias", layers=n)
            for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        ]
    head = (
        []
        if cfg.tie_word_embeddings
        else [linear("lm_head/kernel", "lm_head.weight", vocab_axis=1)]
    )
    return [
        HFTensor("embed_tokens/embedding", "model.embed_tokens.weight", split=1, vocab_axis=0),
        *block,
        HFTensor("norm/scale", "model.norm.weight"),
        *head,
    ]


HF_SPEC = register_hf(
    HFSpec(
        model_types=("gemma",),
        config_cls=GemmaConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        # Buffers, and the head that a tied checkpoint may still carry.
        ignore=(r"rotary_emb\.inv_freq$", r"embed_scale$", r"^lm_head\.weight$"),
        tied_head=("lm_head.weight", "model.embed_tokens.weight"),
    )
)
