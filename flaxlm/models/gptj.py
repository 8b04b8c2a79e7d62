"""GPT-J: parallel attention + MLP residual, partial interleaved rotary, gelu-new, untied head.

Follows HuggingFace's `GPTJForCausalLM` (the PyTorch reference our logits must match).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from flaxlm.models import attention, layers, masks
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.causal_lm import CausalLM
from flaxlm.models.hf_spec import HFSpec, HFTensor, linear, register_hf
from flaxlm.models.options import ComputeOptions

Array = jax.Array


@gin.configurable
@dataclasses.dataclass(frozen=True)
class GPTJConfig(ComputeOptions):
    """GPT-J hyper-parameters (HF names where they exist) and compute options."""

    vocab_size: int = 50400  # HF pads GPT-J's 50257 tokens to 50400
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 4096  # HF: n_embd
    num_layers: int = 28  # HF: n_layer
    num_heads: int = 16  # HF: n_head
    rotary_dim: int = 64  # features of each head that are rotated
    intermediate_size: int | None = None  # HF: n_inner; 4 * hidden_size if None
    max_position_embeddings: int = 2048  # HF: n_positions
    layer_norm_epsilon: float = 1e-5
    activation: str = "gelu_new"
    # Forgetful Causal Masking during training (EasyLM): hide a fraction drawn from
    # [fcm_min_ratio, fcm_max_ratio] of each row's past tokens; 0 disables it.
    fcm_min_ratio: float = 0.0
    fcm_max_ratio: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.fcm_min_ratio <= self.fcm_max_ratio < 1.0:
            raise ValueError(
                f"FCM ratios must satisfy 0 <= fcm_min_ratio ({self.fcm_min_ratio}) <= "
                f"fcm_max_ratio ({self.fcm_max_ratio}) < 1."
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}."
            )
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ValueError(
                f"rotary_dim {self.rotary_dim} must be even and at most head_dim {self.head_dim}."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_dim(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates)."""
        e, v, n = self.hidden_size, self.vocab_size, self.num_layers
        block = 4 * e * e + 2 * e * self.mlp_dim + self.mlp_dim + e + 2 * e
        return v * e + n * block + 2 * e + e * v + v

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus the attention scores."""
        non_embedding = self.num_params() - self.vocab_size * self.hidden_size
        return 6.0 * non_embedding + 12.0 * self.num_layers * self.hidden_size * seq_len

    def make_module(self) -> GPTJ:
        return GPTJ(self)


class GPTJBlock(nn.Module):
    config: GPTJConfig
    deterministic: bool = True

    @nn.compact
    def __call__(
        self, x: Array, mask: masks.Mask, decoding: masks.Decoding | None, positions: Array
    ) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        x = layers.constrain(x, layers.ACTIVATION_AXES)
        h = layers.LayerNorm(cfg.layer_norm_epsilon, name="ln_1", **dense)(x)

        # Attention: [batch, length, heads, head_dim]
        names = ("q_proj", "k_proj", "v_proj")
        projections = [
            layers.DenseGeneral(
                (cfg.num_heads, cfg.head_dim), ("embed", "heads", "head_dim"), name=n, **dense
            )
            for n in names
        ]
        qkv = dict(zip(names, layers.parallel_dense(h, projections)))
        sin, cos = attention.rotary_sin_cos(positions, attention.rotary_inv_freq(cfg.rotary_dim))
        q = attention.apply_rotary(qkv["q_proj"], sin, cos, interleaved=True)
        k = attention.apply_rotary(qkv["k_proj"], sin, cos, interleaved=True)
        q = layers.constrain(q, layers.HEAD_AXES)
        k = layers.constrain(k, layers.HEAD_AXES)
        k, v = attention.KVCache(name="cache")(k, qkv["v_proj"], decoding)
        attn = attention.dot_product_attention(
            q,
            k,
            v,
            mask,
            dtype=cfg.dtype,
            implementation=cfg.attention,
            chunk_size=cfg.attention_chunk_size,
            context_parallel=cfg.context_parallel,
        )
        attn = layers.DenseGeneral(
            cfg.hidden_size, ("heads", "head_dim", "embed"), axis=(-2, -1), name="out_proj", **dense
        )(attn)
        attn = checkpoint_name(attn, "attn_out")

        # MLP on the same normalised input (GPT-J's parallel residual).
        m = layers.DenseGeneral(
            cfg.mlp_dim, ("embed", "mlp"), use_bias=True, name="fc_in", **dense
        )(h)
        m = layers.constrain(layers.ACTIVATIONS[cfg.activation](m), ("batch", "length", "mlp"))
        m = layers.DenseGeneral(
            cfg.hidden_size, ("mlp", "embed"), use_bias=True, name="fc_out", **dense
        )(m)
        m = checkpoint_name(m, "mlp_out")

        out = attn + m
        if cfg.dropout_rate:
            out = nn.Dropout(cfg.dropout_rate)(out, deterministic=self.deterministic)
        return layers.constrain(x + out, layers.ACTIVATION_AXES)


class GPTJ(CausalLM):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = GPTJBlock
    embed_name = "wte"
    layers_name = "h"
    head_bias = True

    def mask(
        self,
        segment_ids: Array | None,
        positions: Array,
        decoding: masks.Decoding | None,
        deterministic: bool,
    ) -> masks.Mask:
        cfg = self.config
        mask = super().mask(segment_ids, positions, decoding, deterministic)
        if cfg.fcm_max_ratio > 0 and not deterministic and decoding is None:
            mask = masks.forgetful_causal_mask(
                mask, self.make_rng("dropout"), positions, cfg.fcm_min_ratio, cfg.fcm_max_ratio
            )
        return mask

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array]]:
        return x, (positions,)  # each block rotates its own queries and keys

    def final_norm(self, x: Array) -> Array:
        cfg = self.config
        return layers.LayerNorm(
            cfg.layer_norm_epsilon, dtype=jnp.float32, param_dtype=cfg.param_dtype, name="ln_f"
        )(x)


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides) -> GPTJConfig:
    if hf.get("tie_word_embeddings"):
        raise ValueError(
            "config.json sets tie_word_embeddings true: flaxlm's GPT-J has its own head "
            "(lm_head.weight and its bias, as the published GPT-J files have); load a file "
            "with tie_word_embeddings false."
        )
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["n_embd"],
        num_layers=hf["n_layer"],
        num_heads=hf["n_head"],
        rotary_dim=hf.get("rotary_dim") or hf["n_embd"] // hf["n_head"],
        intermediate_size=hf.get("n_inner"),
        max_position_embeddings=hf["n_positions"],
        layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        activation=hf.get("activation_function", "gelu_new"),
    )
    kwargs.update(overrides)
    return GPTJConfig(**kwargs)


def config_to_hf(cfg: GPTJConfig) -> dict:
    return {
        "model_type": "gptj",
        "architectures": ["GPTJForCausalLM"],
        "vocab_size": cfg.real_vocab_size or cfg.vocab_size,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "rotary_dim": cfg.rotary_dim,
        "n_inner": cfg.intermediate_size,
        "n_positions": cfg.max_position_embeddings,
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "activation_function": cfg.activation,
        "tie_word_embeddings": False,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


def hf_tensors(cfg: GPTJConfig) -> list[HFTensor]:
    n = cfg.num_layers
    block = [
        HFTensor("h_{i}/ln_1/scale", "transformer.h.{i}.ln_1.weight", layers=n),
        HFTensor("h_{i}/ln_1/bias", "transformer.h.{i}.ln_1.bias", layers=n),
        *(
            linear(f"h_{{i}}/{p}/kernel", f"transformer.h.{{i}}.attn.{p}.weight", layers=n)
            for p in ("q_proj", "k_proj", "v_proj")
        ),
        linear("h_{i}/out_proj/kernel", "transformer.h.{i}.attn.out_proj.weight", 2, layers=n),
        linear("h_{i}/fc_in/kernel", "transformer.h.{i}.mlp.fc_in.weight", layers=n),
        HFTensor("h_{i}/fc_in/bias", "transformer.h.{i}.mlp.fc_in.bias", layers=n),
        linear("h_{i}/fc_out/kernel", "transformer.h.{i}.mlp.fc_out.weight", layers=n),
        HFTensor("h_{i}/fc_out/bias", "transformer.h.{i}.mlp.fc_out.bias", layers=n),
    ]
    return [
        HFTensor("wte/embedding", "transformer.wte.weight", split=1, vocab_axis=0),
        *block,
        HFTensor("ln_f/scale", "transformer.ln_f.weight"),
        HFTensor("ln_f/bias", "transformer.ln_f.bias"),
        linear("lm_head/kernel", "lm_head.weight", vocab_axis=1),
        HFTensor("lm_head/bias", "lm_head.bias", vocab_axis=0),
    ]


HF_SPEC = register_hf(
    HFSpec(
        model_types=("gptj",),
        config_cls=GPTJConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=(r"\.attn\.(bias|masked_bias)$",),
    )
)
