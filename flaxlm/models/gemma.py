"""Gemma 2 and Gemma 3 (text): Gemma with sliding-window layers between global ones,
normalised sublayer outputs and soft-capped logits.

Both wrap attention and MLP in (1 + w) RMSNorms before and after (`input_layernorm`,
`post_attention_layernorm`, `pre_feedforward_layernorm`, `post_feedforward_layernorm`),
scale the scores by `query_pre_attn_scalar ** -0.5` and alternate sliding-window and global
layers (`layer_types`). Gemma 2 soft-caps the attention scores and the final logits and
alternates 1:1; Gemma 3 normalises each query and key head (`q_norm`, `k_norm`), has 5 local
layers to 1 global, and its own rotary base on local layers (`rope_local_base_freq`; a
linear scaling, 4B and up, applies to global layers only). Follows HuggingFace's
`Gemma2ForCausalLM` and `Gemma3ForCausalLM`; a `Gemma3ForConditionalGeneration` checkpoint
loads its text tower. Gemma 1 is `llama.LlamaConfig(model_type='gemma')`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from flaxlm.models import attention, layers, llama, masks, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.causal_lm import CausalLM
from flaxlm.models.hf_spec import (
    LLAVA_RENAMES,
    LLAVA_SKIP,
    HFSpec,
    HFTensor,
    Multimodal,
    register_hf,
    text_tower,
)
from flaxlm.models.options import ComputeOptions

Array = jax.Array

MODEL_TYPES = ("gemma2", "gemma3_text")
ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
SLIDING, GLOBAL = "sliding_attention", "full_attention"  # HF's layer_types
LAYER_TYPES = (SLIDING, GLOBAL)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class GemmaConfig(ComputeOptions):
    """Gemma 2 / Gemma 3 text hyper-parameters (HF names where they exist; defaults: Gemma 2
    2B)."""

    vocab_size: int = 256000
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 2304
    num_layers: int = 26  # HF: num_hidden_layers
    num_heads: int = 8  # HF: num_attention_heads
    num_kv_heads: int = 4  # HF: num_key_value_heads
    head_dim: int = 256
    intermediate_size: int = 9216
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # global layers (Gemma 2: every layer)
    rope_scaling_type: str | None = None  # None or 'linear' (global layers only in Gemma 3)
    rope_scaling_factor: float = 1.0
    # Gemma 3: the rotary base of sliding-window layers (unscaled); None (Gemma 2): as global.
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: int = 256  # scores are scaled by its inverse square root
    sliding_window: int | None = 4096  # a sliding layer's query sees this many latest positions
    # Each layer's 'sliding_attention' or 'full_attention'; None: every
    # `sliding_window_pattern`-th layer is global, the others sliding.
    layer_types: tuple[str, ...] | None = None
    sliding_window_pattern: int | None = None  # None: 2 (Gemma 2) or 6 (Gemma 3)
    attn_logit_softcapping: float | None = 50.0  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = 30.0  # logits -> cap * tanh(logits / cap)
    attention_bias: bool = False
    tie_word_embeddings: bool = True  # the head reuses the token embedding
    activation: str = "gelu_pytorch_tanh"  # HF: hidden_activation
    model_type: str = "gemma2"  # 'gemma2' or 'gemma3_text' (q/k norms, two rotary bases)

    def __post_init__(self) -> None:
        if self.layer_types is not None:  # a list from Gin or a JSON model record
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        super().__post_init__()
        attention.check_implementation(self.attention, self.attn_logit_softcapping)
        if self.model_type not in MODEL_TYPES:
            hint = " (Gemma 1 is llama.LlamaConfig)" if self.model_type == "gemma" else ""
            raise ValueError(
                f"model_type {self.model_type!r}: expected one of {MODEL_TYPES}{hint}."
            )
        attention.check_heads(self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim)
        if self.sliding_window_pattern is not None and self.sliding_window_pattern < 1:
            raise ValueError(f"sliding_window_pattern {self.sliding_window_pattern} must be >= 1.")
        types = self.layer_types
        if types is not None and (
            len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types)
        ):
            raise ValueError(
                f"layer_types {types}: expected num_layers ({self.num_layers}) entries, each one "
                f"of {LAYER_TYPES}."
            )
        if SLIDING in self.per_layer_types and (
            self.sliding_window is None or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window {self.sliding_window} must be positive: layer_types has "
                f"{SLIDING!r} layers."
            )
        if self.rope_scaling_type not in (None, "linear"):
            raise ValueError(
                f"rope_scaling_type {self.rope_scaling_type!r}: expected None or 'linear'."
            )
        positive = ("rope_scaling_factor", "query_pre_attn_scalar", "rope_theta")
        positive += ("attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} {value} must be positive.")
        gemma3 = self.model_type == "gemma3_text"
        if gemma3 and self.attn_logit_softcapping is not None:
            raise ValueError(
                "attn_logit_softcapping must be None with model_type='gemma3_text': HF's "
                "Gemma3ForCausalLM does not soft-cap attention scores."
            )
        if gemma3 != (self.rope_local_base_freq is not None):
            raise ValueError(
                f"rope_local_base_freq {self.rope_local_base_freq} with model_type="
                f"{self.model_type!r}: Gemma 3 sets it, Gemma 2 (one rotary base) leaves it None."
            )

    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """Each layer's type (`layer_types`, or from `sliding_window_pattern`)."""
        if self.layer_types is not None:
            return self.layer_types
        pattern = self.sliding_window_pattern or (6 if self.model_type == "gemma3_text" else 2)
        return tuple(GLOBAL if (i + 1) % pattern == 0 else SLIDING for i in range(self.num_layers))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: global attention)."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.per_layer_types)

    @property
    def qk_norm(self) -> str | None:
        return "rms_plus_one" if self.model_type == "gemma3_text" else None

    @property
    def dim_per_head(self) -> int:  # the name llama's rope and HF helpers read
        return self.head_dim

    @property
    def mlp_bias(self) -> bool:  # HF's Gemma MLPs have none
        return False

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates)."""
        e, v, d, f = self.hidden_size, self.vocab_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = e * (q + 2 * kv) + q * e + (q + 2 * kv + e if self.attention_bias else 0)
        block = attn + 3 * e * f + 4 * e + (2 * d if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else v * e
        return v * e + self.num_layers * block + e + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus the attention scores (a sliding
        layer's over its window)."""
        return llama.windowed_flops_per_token(self, seq_len)

    def make_module(self) -> Gemma:
        return Gemma(self)


def norm(cfg: GemmaConfig, name: str, dtype: Any = None) -> layers.RMSNorm:
    """A Gemma (1 + w) RMSNorm, built in the calling module's scope."""
    return layers.RMSNorm(
        cfg.rms_norm_eps,
        scale_plus_one=True,
        dtype=dtype or cfg.dtype,
        param_dtype=cfg.param_dtype,
        name=name,
    )


class GemmaBlock(nn.Module):
    config: GemmaConfig
    deterministic: bool = True

    @nn.compact
    def __call__(
        self,
        x: Array,
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
        *local_sin_cos: Array,
    ) -> Array:
        """`local_sin_cos`: the rotary tables of sliding layers where they differ (Gemma 3),
        picked by this layer's (possibly traced) `index`."""
        cfg = self.config
        if local_sin_cos:
            local = jnp.asarray([t == SLIDING for t in cfg.per_layer_types])[index]
            local_sin, local_cos = local_sin_cos
            sin, cos = jnp.where(local, local_sin, sin), jnp.where(local, local_cos, cos)

        def residual(x: Array, out: Array, name: str) -> Array:
            out = norm(cfg, name)(out)
            if cfg.dropout_rate:
                out = nn.Dropout(cfg.dropout_rate)(out, deterministic=self.deterministic)
            return layers.constrain(x + out, layers.ACTIVATION_AXES)

        x = layers.constrain(x, layers.ACTIVATION_AXES)
        attn = attention.rotary_self_attention(
            norm(cfg, "input_layernorm")(x),
            sin,
            cos,
            mask,
            decoding,
            window=masks.layer_window(cfg.layer_windows, index),
            scale=cfg.query_pre_attn_scalar**-0.5,
            softcap=cfg.attn_logit_softcapping,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.rms_norm_eps,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            hidden_size=cfg.hidden_size,
            qkv_bias=cfg.attention_bias,
            out_bias=cfg.attention_bias,
            attention=cfg.attention,
            chunk_size=cfg.attention_chunk_size,
            context_parallel=cfg.context_parallel,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
        )
        x = residual(x, attn, "post_attention_layernorm")
        m = layers.gated_mlp(
            norm(cfg, "pre_feedforward_layernorm")(x),
            intermediate_size=cfg.intermediate_size,
            hidden_size=cfg.hidden_size,
            activation=cfg.activation,
            use_bias=False,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
        )
        return residual(x, m, "post_feedforward_layernorm")


class Gemma(CausalLM):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = GemmaBlock
    layer_index = True

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, ...]]:
        cfg = self.config
        # HF rounds the sqrt(width) normaliser to the dtype before multiplying.
        x = x * jnp.asarray(cfg.hidden_size**0.5, layers.as_dtype(cfg.dtype))
        tables = attention.rotary_sin_cos(positions, rope.inv_freq(cfg))
        if cfg.rope_local_base_freq is not None and SLIDING in cfg.per_layer_types:
            local = attention.rotary_inv_freq(cfg.head_dim, cfg.rope_local_base_freq)
            tables += attention.rotary_sin_cos(positions, local)
        return x, tables

    def final_norm(self, x: Array) -> Array:
        return norm(self.config, "norm", jnp.float32)(x)


# ------------------------------------------------------------------ HuggingFace

# transformers' defaults of the fields a config.json may leave out (a multimodal Gemma 3's
# text_config keeps only those that differ from them).
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        vocab_size=256000,
        max_position_embeddings=8192,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        sliding_window_pattern=2,
    ),
    "gemma3_text": dict(
        vocab_size=262208,
        max_position_embeddings=131072,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        sliding_window_pattern=6,
    ),
}
SHARED_DEFAULTS = dict(
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=256,
    attention_bias=False,
    tie_word_embeddings=True,
)


def rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """GemmaConfig's rope fields from a Gemma 2 or Gemma 3 text config.json: transformers 5's
    `rope_parameters` (Gemma 3: one per layer type) or transformers 4's `rope_theta`,
    `rope_scaling` and (Gemma 3) `rope_local_base_freq`."""
    if hf["model_type"] == "gemma2":
        out = rope.from_hf(hf)
    else:
        params = hf.get("rope_parameters") or {}
        if any(t in params for t in LAYER_TYPES):
            full, local = params.get(GLOBAL) or {}, params.get(SLIDING) or {}
        else:
            full = {
                "rope_theta": hf.get("rope_theta", 1e6),
                **(params or hf.get("rope_scaling") or {}),
            }
            local = {"rope_theta": hf.get("rope_local_base_freq", 1e4)}
        out = rope.from_hf({"rope_parameters": {"rope_theta": 1e6, **full}})
        local_rope = rope.from_hf({"rope_parameters": {"rope_theta": 1e4, **local}})
        if len(local_rope) > 1:
            raise ValueError(
                f"config.json scales the rope of sliding layers ({local}): not supported."
            )
        out["rope_local_base_freq"] = local_rope["rope_theta"]
    if out.get("rope_scaling_type", "linear") != "linear":
        raise ValueError(
            f"config.json has rope type {out['rope_scaling_type']!r}; flaxlm's Gemma supports "
            "'default' and 'linear'."
        )
    return out


# config.json field -> GemmaConfig field, for those that map one to one.
HF_FIELDS = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "query_pre_attn_scalar": "query_pre_attn_scalar",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "attention_bias": "attention_bias",
    "tie_word_embeddings": "tie_word_embeddings",
    "sliding_window_pattern": "sliding_window_pattern",
}


def config_from_hf(hf: dict, **overrides) -> GemmaConfig:
    """The config of a Gemma 2, Gemma 3 text or (its text tower) Gemma 3 multimodal
    config.json, fields it leaves out at transformers' defaults."""
    hf = text_tower(hf)  # Gemma3ForConditionalGeneration's: its text_config
    model_type = hf["model_type"]
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported: Gemma is causal here.")
    # Early Gemma 2 files name the window sliding_window_size.
    window = hf.get("sliding_window", hf.get("sliding_window_size", 4096))
    hf = {**SHARED_DEFAULTS, **HF_DEFAULTS[model_type], **hf}
    kwargs = {ours: hf[theirs] for theirs, ours in HF_FIELDS.items()}
    kwargs.update(
        vocab_size=hf["vocab_size"],
        sliding_window=window,
        layer_types=tuple(hf["layer_types"]) if hf.get("layer_types") else None,
        # transformers' Gemma 2 and 3 read `hidden_activation` alone (`hidden_act` ignored)
        activation=hf.get("hidden_activation") or "gelu_pytorch_tanh",
        model_type=model_type,
        **rope_from_hf(hf),
    )
    kwargs.update(overrides)
    return GemmaConfig(**kwargs)


def config_to_hf(cfg: GemmaConfig) -> dict:
    """A Gemma2ForCausalLM or Gemma3ForCausalLM config.json (layer types spelled out)."""
    rope_parameters = rope.to_hf(cfg)
    if cfg.model_type == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq}
        rope_parameters = {GLOBAL: rope_parameters, SLIDING: local}
    out = {theirs: getattr(cfg, ours) for theirs, ours in HF_FIELDS.items()}
    del out["sliding_window_pattern"]  # layer_types says it all
    out.update(
        model_type=cfg.model_type,
        architectures=[ARCHITECTURES[cfg.model_type]],
        vocab_size=cfg.real_vocab_size or cfg.vocab_size,
        rope_parameters=rope_parameters,
        sliding_window=cfg.sliding_window,
        layer_types=list(cfg.per_layer_types),
        attention_dropout=0.0,
        hidden_activation=cfg.activation,
    )
    return out


def hf_tensors(cfg: GemmaConfig) -> list[HFTensor]:
    """Llama's table plus the norms after attention and around the MLP (and Gemma 3's q/k
    norms)."""
    norms = ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if cfg.qk_norm:
        norms += ["self_attn.q_norm", "self_attn.k_norm"]
    return llama.hf_tensors(cfg) + [
        HFTensor(
            f"layers_{{i}}/{n.split('.')[-1]}/scale",
            f"model.layers.{{i}}.{n}.weight",
            layers=cfg.num_layers,
        )
        for n in norms
    ]


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        # Gemma3ForConditionalGeneration: its LM head its own, tied by default.
        multimodal=(
            Multimodal("gemma3", "gemma3_text", tied=True, unapplied=("final_logit_softcapping",)),
        ),
        config_cls=GemmaConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        tied_head=llama.HF_SPEC.tied_head,
        # Gemma3ForConditionalGeneration's files: the llava layout.
        renames=LLAVA_RENAMES,
        skip=LLAVA_SKIP,
    )
)
