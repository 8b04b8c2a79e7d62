"""Llama 1/2/3, Mistral and Gemma: pre-RMSNorm blocks, rotary (half layout), gated MLP,
grouped-query attention.

Mistral is Llama with sliding-window attention. Gemma is Llama with its embedding scaled by
sqrt(hidden_size), (1 + w) RMSNorms, GeGLU (`gelu_pytorch_tanh`), a `head_dim` independent of
the width and a tied head. Follows HuggingFace's `LlamaForCausalLM`, `MistralForCausalLM` and
`GemmaForCausalLM` (the PyTorch references our logits must match). Qwen (`qwen.py`) and Phi-3
(`phi3.py`) run on the same block, with the options their configs set (`LlamaBlockConfig`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from flaxlm.models import attention, layers, masks, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.causal_lm import CausalLM
from flaxlm.models.hf_spec import (
    LLAVA_RENAMES,
    LLAVA_SKIP,
    HFSpec,
    HFTensor,
    Multimodal,
    linear,
    register_hf,
)
from flaxlm.models.options import HeadShapes

Array = jax.Array

MODEL_TYPES = ("llama", "mistral", "gemma")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma": "GemmaForCausalLM",
}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LlamaConfig(HeadShapes, rope.RopeScaling):
    """Llama / Mistral / Gemma hyper-parameters (HF names where they exist; rope scaling's
    in `rope.RopeScaling`)."""

    vocab_size: int = 32000
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 4096
    num_layers: int = 32  # HF: num_hidden_layers
    num_heads: int = 32  # HF: num_attention_heads
    num_kv_heads: int | None = None  # HF: num_key_value_heads; None: num_heads
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int = 11008
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int | None = None  # a query sees this many latest positions (Mistral)
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False  # the head reuses the token embedding
    activation: str = "silu"  # HF: hidden_act (Gemma: gelu_pytorch_tanh)
    # Gemma: the token embedding is multiplied by sqrt(hidden_size), rounded to the dtype.
    scale_embedding: bool = False
    # Gemma: RMSNorms multiply by (1 + w), their params initialised at zero.
    norm_scale_plus_one: bool = False
    model_type: str = "llama"  # the HF model_type written on export: one of model_types
    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES  # a subclass's own (Ministral 3)

    def __post_init__(self) -> None:
        super().__post_init__()
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be None or positive.")
        if self.model_type not in self.model_types:
            raise ValueError(f"model_type {self.model_type!r}: expected one of {self.model_types}.")
        if self.model_type == "llama" and self.sliding_window is not None:
            raise ValueError(
                "sliding_window is a Mistral feature (HF Llama ignores it): set "
                "model_type='mistral' or sliding_window=None."
            )
        if self.model_type in ("mistral", "ministral3") and (self.attention_bias or self.mlp_bias):
            raise ValueError(
                "HF Mistral has no attention_bias or mlp_bias: set both False or "
                "model_type='llama'."
            )
        gemma = self.model_type == "gemma"
        for flag in ("scale_embedding", "norm_scale_plus_one"):
            if getattr(self, flag) != gemma:
                raise ValueError(
                    f"{flag}={getattr(self, flag)} with model_type={self.model_type!r}: "
                    f"HF's {self.model_type} model has it {gemma}."
                )
        if gemma and (self.sliding_window is not None or self.mlp_bias):
            raise ValueError("HF Gemma has no sliding_window or mlp_bias: set None and False.")

    # LlamaBlock's options that Llama, Mistral and Gemma 1 share: q, k, v biased as o is, no
    # q/k norms, no per-layer windows (Mistral's window is the whole model's, in its mask).
    qk_norm: ClassVar[bool] = False

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def layer_windows(self) -> tuple[None, ...]:
        return (None,) * self.num_layers

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates)."""
        e, v, d, f = self.hidden_size, self.vocab_size, self.dim_per_head, self.intermediate_size
        q, kv = self.num_heads * d, self.kv_heads * d
        attn = e * (q + 2 * kv) + q * e + (q + 2 * kv + e if self.attention_bias else 0)
        mlp = 3 * e * f + (2 * f + e if self.mlp_bias else 0)
        block = attn + mlp + 2 * e
        head = 0 if self.tie_word_embeddings else v * e
        return v * e + self.num_layers * block + e + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus the attention scores."""
        matmul = matmul_params(self)
        context = min(seq_len, self.sliding_window or seq_len)
        attn_width = self.num_heads * self.dim_per_head
        return 6.0 * matmul + 12.0 * self.num_layers * attn_width * context

    def make_module(self) -> Llama:
        return Llama(self)


def windowed_flops_per_token(config: Any, seq_len: int, matmul: int | None = None) -> float:
    """Training FLOPs per token: 6 x the `matmul` params (None: `matmul_params`) plus the
    attention scores, each layer's over at most its window (`layer_windows`)."""
    if matmul is None:
        matmul = matmul_params(config)
    contexts = sum(min(seq_len, w or seq_len) for w in config.layer_windows)
    return 6.0 * matmul + 12.0 * config.num_heads * config.dim_per_head * contexts


def matmul_params(config: Any) -> int:
    """The params each token is multiplied by (6 FLOPs apiece in training): all but the
    input embedding's lookup; the LM head is a matmul whether or not it reuses the embedding
    (Llama, Qwen, Gemma configs)."""
    lookup = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return config.num_params() - lookup


class LlamaBlockConfig(Protocol):
    """What `LlamaBlock` reads of a family config beyond `ComputeOptions` (Llama, Mistral,
    Gemma 1, Qwen, Phi-3; what a family does not vary is a constant of its config class)."""

    num_heads: int
    kv_heads: int
    dim_per_head: int
    intermediate_size: int
    rms_norm_eps: float
    activation: str
    attention_bias: bool  # a bias on o (and on q, k, v unless qkv_bias says otherwise)
    qkv_bias: bool  # biases on q, k and v
    mlp_bias: bool
    qk_norm: bool  # each query and key head RMS-normalised before rotary (Qwen3)
    norm_scale_plus_one: bool  # RMSNorms multiply by (1 + w) (Gemma)
    # Every layer's own sliding window (None: none beyond the mask's `sliding_window`).
    layer_windows: tuple[int | None, ...]


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: grouped-query rotary attention (this layer's window), gated MLP.

    Called `(x, layer_index, mask, decoding, sin, cos, *rest)` (`CausalLM.layer_index`);
    `rest`: what else a family's `block_inputs` gives its `self_attention` (Mistral 4's
    query scale by position)."""

    config: Any  # a LlamaBlockConfig
    deterministic: bool = True

    def dropped(self, y: Array) -> Array:
        if not self.config.dropout_rate:
            return y
        return nn.Dropout(self.config.dropout_rate)(y, deterministic=self.deterministic)

    @nn.compact
    def __call__(
        self,
        x: Array,
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
        *rest: Array,
    ) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        norm = dict(epsilon=cfg.rms_norm_eps, scale_plus_one=cfg.norm_scale_plus_one, **dense)
        x = layers.constrain(x, layers.ACTIVATION_AXES)
        h = layers.RMSNorm(name="input_layernorm", **norm)(x)
        attn = self.self_attention(h, index, mask, decoding, sin, cos, *rest)
        attn = self.output_norm(attn, "post_self_attn_layernorm")
        x = layers.constrain(x + self.dropped(attn), layers.ACTIVATION_AXES)
        h = layers.RMSNorm(name="post_attention_layernorm", **norm)(x)
        out = self.output_norm(self.feed_forward(h, mask), "post_mlp_layernorm")
        return layers.constrain(x + self.dropped(out), layers.ACTIVATION_AXES)

    def output_norm(self, y: Array, name: str) -> Array:
        """The attention's or the MLP's output before its residual add: as it is (GLM-4
        normalises it, scoped `name`). Called inside `__call__`."""
        return y

    def self_attention(
        self,
        h: Array,
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
        query_scale: Array | None = None,
    ) -> Array:
        """Grouped-query rotary attention with this layer's window and the family's
        `attention_options` (`query_scale`: Ministral 3's by position); DeepSeek-V3 overrides
        it with latent attention. Called inside `__call__`."""
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        return attention.rotary_self_attention(
            h,
            sin,
            cos,
            mask,
            decoding,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.kv_heads,
            head_dim=cfg.dim_per_head,
            hidden_size=cfg.hidden_size,
            attention=cfg.attention,
            chunk_size=cfg.attention_chunk_size,
            context_parallel=cfg.context_parallel,
            norm_eps=cfg.rms_norm_eps,
            window=masks.layer_window(cfg.layer_windows, index),
            query_scale=query_scale,
            **self.attention_options(),
            **dense,
        )

    def attention_options(self) -> dict[str, Any]:
        """`rotary_self_attention`'s family options: biases and per-head q/k norms (OLMoE
        overrides them with its whole-projection norm)."""
        cfg = self.config
        return dict(
            qkv_bias=cfg.qkv_bias,
            out_bias=cfg.attention_bias,
            qk_norm="rms" if cfg.qk_norm else None,
        )

    def feed_forward(self, h: Array, mask: masks.Mask) -> Array:
        """The gated MLP, down(act(gate(h)) * up(h)) (SwiGLU, Gemma's GeGLU); a mixture of
        experts overrides it (`qwen_moe.QwenMoeBlock`). Called inside `__call__`."""
        cfg = self.config
        return layers.gated_mlp(
            h,
            intermediate_size=cfg.intermediate_size,
            hidden_size=cfg.hidden_size,
            activation=cfg.activation,
            use_bias=cfg.mlp_bias,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
        )


class Llama(CausalLM):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = LlamaBlock
    layer_index = True  # LlamaBlock takes its index (for Qwen's per-layer windows)

    def mask(
        self,
        segment_ids: Array | None,
        positions: Array,
        decoding: masks.Decoding | None,
        deterministic: bool,
    ) -> masks.Mask:
        batch, length = positions.shape
        return masks.causal_mask(
            segment_ids, batch, length, decoding, sliding_window=self.config.sliding_window
        )

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, Array]]:
        cfg = self.config
        if cfg.scale_embedding:
            # HF rounds the sqrt(width) normaliser to the compute dtype before multiplying.
            x = x * jnp.asarray(cfg.hidden_size**0.5, layers.as_dtype(cfg.dtype))
        return x, rope.sin_cos(positions, cfg)

    def final_norm(self, x: Array) -> Array:
        cfg = self.config
        return layers.RMSNorm(
            cfg.rms_norm_eps,
            scale_plus_one=cfg.norm_scale_plus_one,
            dtype=jnp.float32,
            param_dtype=cfg.param_dtype,
            name="norm",
        )(x)


# ------------------------------------------------------------------ HuggingFace


def gemma_activation(hf: dict) -> str:
    """Gemma 1's MLP activation: `hidden_act`, its legacy "gelu" meaning the tanh
    approximation (transformers' `GemmaConfig.__post_init__`)."""
    act = hf.get("hidden_act") or "gelu_pytorch_tanh"
    return "gelu_pytorch_tanh" if act == "gelu" else act


def config_from_hf(hf: dict, **overrides) -> LlamaConfig:
    gemma = hf["model_type"] == "gemma"
    if gemma and hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported: Gemma is causal here.")
    kwargs = dict(
        shared_fields_from_hf(hf),
        head_dim=hf.get("head_dim"),
        # (MistralConfig's default where config.json has no key; a null is no window)
        sliding_window=hf.get("sliding_window", 4096) if hf["model_type"] == "mistral" else None,
        attention_bias=hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False),
        # Read apart from the shared fields: Gemma ties its head unless config.json says
        # otherwise, and reads `hidden_act` "gelu" (its releases' legacy value) as the tanh
        # approximation, as transformers' GemmaConfig does (a `hidden_activation` key, read by
        # transformers 4, is ignored as transformers 5 ignores it).
        tie_word_embeddings=hf.get("tie_word_embeddings", gemma),
        activation=gemma_activation(hf) if gemma else hf.get("hidden_act") or "silu",
        scale_embedding=gemma,
        norm_scale_plus_one=gemma,
        model_type=hf["model_type"],
        **rope.from_hf(hf),
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def shared_fields_from_hf(hf: dict, rms_norm_eps: float = 1e-6) -> dict[str, Any]:
    """The config fields (LlamaConfig's names) that the families built on Llama's block
    (Llama, Mistral, Gemma 1, Qwen and its MoEs, Mixtral, OLMoE, gpt-oss, DeepSeek-V3) read
    alike from a config.json dict: the import twin of `shared_hf_fields`. `rms_norm_eps` is
    the family's when config.json has none (its transformers config class's default)."""
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads"),
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"],
        rms_norm_eps=hf.get("rms_norm_eps", rms_norm_eps),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        activation=hf.get("hidden_act", "silu"),
    )


def shared_hf_fields(cfg: Any) -> dict[str, Any]:
    """The config.json fields the families built on Llama's block (Llama, Mistral, Gemma 1,
    Qwen, Phi-3) write alike, from a config with LlamaConfig's field names."""
    return {
        "vocab_size": cfg.real_vocab_size or cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.activation,
        "attention_dropout": 0.0,
    }


def config_to_hf(cfg: LlamaConfig) -> dict:
    out = {
        "model_type": cfg.model_type,
        "architectures": [ARCHITECTURES[cfg.model_type]],
        **shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "rope_parameters": rope.to_hf(cfg),
    }
    if cfg.model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window
    elif cfg.model_type == "gemma":
        out["attention_bias"] = cfg.attention_bias
    else:
        out.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
    return out


def hf_tensors(cfg: LlamaConfig) -> list[HFTensor]:
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
    if cfg.mlp_bias:
        block += [
            HFTensor(f"layers_{{i}}/{p}/bias", f"model.layers.{{i}}.mlp.{p}.bias", layers=n)
            for p in ("gate_proj", "up_proj", "down_proj")
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


def hf_tensors_but_mlp(cfg: Any) -> list[HFTensor]:
    """`hf_tensors`' records but the MLP's (the embedding, attention with its biases, norms
    and head) for a config with LlamaConfig's `num_layers`, `attention_bias` and
    `tie_word_embeddings`: what the mixture-of-experts families keep of Llama's table."""
    table = hf_tensors(
        LlamaConfig(
            num_layers=cfg.num_layers,
            attention_bias=cfg.attention_bias,
            tie_word_embeddings=cfg.tie_word_embeddings,
        )
    )
    return [t for t in table if ".mlp." not in t.hf]


# Mistral 3's multimodal files (Mistral3ForConditionalGeneration: Mistral Small 3.1 and 3.2,
# and Mistral Small 4, whose text tower is a `mistral4`), in the llava layout; the LM head the
# outer model's, tied by default.
MISTRAL3 = Multimodal("mistral3", "mistral", tied=True)
# LLaVA-1.5 and LLaVA-NeXT (1.6): a Llama, Mistral, ... text tower (whichever family its
# text_config names), untied unless the outer config ties it, or for LLaVA-1.5 its text_config
# (transformers' LlavaConfig forwards that setting, LlavaNextConfig does not).
LLAVA = (
    Multimodal("llava", "llama", False, text_ties=True),
    Multimodal("llava_next", "llama", False),
)

HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=LlamaConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        # Buffers, and the head that a tied checkpoint may still carry.
        ignore=(r"rotary_emb\.inv_freq$", r"embed_scale$", r"^lm_head\.weight$"),
        tied_head=("lm_head.weight", "model.embed_tokens.weight"),
        multimodal=(MISTRAL3, *LLAVA),
        renames=LLAVA_RENAMES,
        skip=LLAVA_SKIP,
    )
)
