"""Qwen2 / Qwen2.5 and Qwen3 (dense): Llama's blocks with Qwen's attention.

Qwen2 is Llama with biases on the q, k and v projections (none on o), rope_theta 1e6 and
a sliding window on the layers its config names (`use_sliding_window`, `max_window_layers`
or `layer_types`). Qwen3 drops the biases (unless `attention_bias`, which adds them to o
too), RMS-normalises each query and key head (`q_norm`, `k_norm`) before rotary and has a
`head_dim` independent of the width. Follows HuggingFace's `Qwen2ForCausalLM` and
`Qwen3ForCausalLM` (the PyTorch references our logits must match).

Qwen's vision-language files hold such a text tower whose multimodal rotary (MRoPE), on text,
rotates by one position stream: plain rotary. Qwen3-VL's (`qwen3_vl`, a `qwen3_vl_text`
tower) reads as a Qwen3, Qwen2-VL's and Qwen2.5-VL's (`qwen2_vl`, `qwen2_5_vl`: their
`*_text` towers, on the Hub a flat config.json and the text under `model.`) as a Qwen2, each
with its transformers text config's defaults; they export as that Qwen.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

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
)
from flaxlm.models.options import HeadShapes

Array = jax.Array

MODEL_TYPES = ("qwen2", "qwen3")
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types entries
# Qwen's vision-language text towers: the Qwen each computes as, and transformers' text
# config defaults for the keys a config.json omits (Qwen3-VL: head_dim 128 and 32 key/value
# heads whatever the width and heads).
VL_TEXTS = {"qwen3_vl_text": "qwen3", "qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2"}
QWEN2_VL_DEFAULTS = dict(
    vocab_size=152064,
    hidden_size=8192,
    intermediate_size=29568,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=80,
    rope_theta=1000000.0,
)
VL_DEFAULTS = {
    "qwen3_vl_text": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=128000,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
    ),
    "qwen2_vl_text": QWEN2_VL_DEFAULTS,
    "qwen2_5_vl_text": QWEN2_VL_DEFAULTS,
}


@dataclasses.dataclass(frozen=True)
class QwenFields(HeadShapes, rope.RopeScaling):
    """Qwen2 / Qwen2.5 / Qwen3 hyper-parameters (HF names where they exist); the defaults
    are Qwen2.5-7B's. `QwenConfig` is these; the Qwen MoE families (`qwen_moe.py`) build on
    them without being a QwenConfig (an HF mapping is found by its config's class)."""

    vocab_size: int = 152064
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 3584
    num_layers: int = 28  # HF: num_hidden_layers
    num_heads: int = 28  # HF: num_attention_heads
    num_kv_heads: int | None = 4  # HF: num_key_value_heads; None: num_heads
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int = 18944
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    # Qwen3: biases on q, k, v and o. Qwen2 always has them on q, k and v, never on o.
    attention_bias: bool = False
    # The windowed layers see only the `sliding_window` latest positions; without
    # `use_sliding_window` no layer is windowed (`sliding_window` is then ignored, as by HF).
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28  # layers from this index up are windowed (no layer_types)
    layer_types: tuple[str, ...] | None = None  # per layer 'full_attention'/'sliding_attention'
    tie_word_embeddings: bool = False  # the head reuses the token embedding
    activation: str = "silu"  # HF: hidden_act
    model_type: str = "qwen2"  # the HF model_type written on export: one of MODEL_TYPES

    # The model types this config class accepts (a subclass for more families sets its own).
    supported_model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    # Where llama.LlamaBlock reads a config: no MLP biases, plain (w, not 1 + w) RMSNorms.
    mlp_bias: ClassVar[bool] = False
    norm_scale_plus_one: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is not None:
            # Gin and JSON give lists; the config stays hashable.
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.model_type not in self.supported_model_types:
            raise ValueError(
                f"model_type {self.model_type!r}: expected one of {self.supported_model_types}."
            )
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
        if self.attention_bias and self.model_type == "qwen2":
            raise ValueError(
                "attention_bias=True is Qwen3's (biases on q, k, v and o): HF Qwen2 always has "
                "q, k and v biases and no o bias; set attention_bias=False or "
                "model_type='qwen3'."
            )
        self._check_windows()

    def _check_windows(self) -> None:
        """ValueErrors naming the sliding-window field that does not fit the others."""
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be None or positive.")
        if self.use_sliding_window and self.sliding_window is None:
            raise ValueError("use_sliding_window=True needs a sliding_window size.")
        if self.max_window_layers < 0:
            raise ValueError(f"max_window_layers {self.max_window_layers} must be >= 0.")
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for num_layers {self.num_layers}."
            )
        unknown = sorted(set(self.layer_types) - {FULL, SLIDING})
        if unknown:
            raise ValueError(f"layer_types {unknown}: expected {FULL!r} or {SLIDING!r}.")
        if SLIDING in self.layer_types and not self.use_sliding_window:
            raise ValueError(
                f"layer_types names {SLIDING!r} layers but use_sliding_window is False "
                "(HF then has no window to give them): set it True with a sliding_window."
            )

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """Whether each query and key head is RMS-normalised before rotary (Qwen3)."""
        return self.model_type == "qwen3"

    @property
    def attention_layer_types(self) -> tuple[str, ...]:
        """Every layer's HF layer type: `layer_types`, or as HF derives it from
        `use_sliding_window` and `max_window_layers`."""
        if self.layer_types is not None:
            return self.layer_types
        return tuple(
            SLIDING if self.use_sliding_window and i >= self.max_window_layers else FULL
            for i in range(self.num_layers)
        )

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's sliding window (None: global attention), for `masks.layer_window`."""
        return tuple(
            self.sliding_window if kind == SLIDING else None for kind in self.attention_layer_types
        )

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates)."""
        e, v, d, f = self.hidden_size, self.vocab_size, self.dim_per_head, self.intermediate_size
        q, kv = self.num_heads * d, self.kv_heads * d
        attn = e * (q + 2 * kv) + q * e
        attn += (q + 2 * kv if self.qkv_bias else 0) + (e if self.attention_bias else 0)
        attn += 2 * d if self.qk_norm else 0  # q_norm, k_norm
        block = attn + 3 * e * f + 2 * e
        head = 0 if self.tie_word_embeddings else v * e
        return v * e + self.num_layers * block + e + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus the attention scores (a windowed
        layer scores at most its window)."""
        return llama.windowed_flops_per_token(self, seq_len)

    def make_module(self) -> Qwen:
        return Qwen(self)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class QwenConfig(QwenFields):
    """Qwen2 / Qwen2.5 / Qwen3 (dense) hyper-parameters: `QwenFields`; the defaults are
    Qwen2.5-7B's."""


class Qwen(CausalLM):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = llama.LlamaBlock
    layer_index = True  # each block looks up its own sliding window

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, Array]]:
        return x, rope.sin_cos(positions, self.config)

    def final_norm(self, x: Array) -> Array:
        cfg = self.config
        norm = layers.RMSNorm(
            cfg.rms_norm_eps, dtype=jnp.float32, param_dtype=cfg.param_dtype, name="norm"
        )
        return norm(x)


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides: Any) -> QwenConfig:
    """A QwenConfig from a Qwen2 or Qwen3 config.json dict, or a Qwen vision-language text
    tower's (`VL_TEXTS`) (+ field overrides)."""
    if hf["model_type"] in VL_TEXTS:
        hf = vl_text(hf)
    layer_types = hf.get("layer_types")
    window = hf.get("sliding_window")
    kwargs = dict(
        llama.shared_fields_from_hf(hf),
        head_dim=hf.get("head_dim"),
        attention_bias=hf.get("attention_bias", False) if hf["model_type"] == "qwen3" else False,
        # HF windows no layer when the size is missing, whatever use_sliding_window says.
        use_sliding_window=bool(hf.get("use_sliding_window")) and window is not None,
        sliding_window=window,
        max_window_layers=hf.get("max_window_layers", 28),
        layer_types=tuple(layer_types) if layer_types is not None else None,
        model_type=hf["model_type"],
        **rope.from_hf(hf),
    )
    kwargs.update(overrides)
    return QwenConfig(**kwargs)


def vl_text(hf: dict) -> dict:
    """A Qwen vision-language text tower's config.json dict as its Qwen's: transformers'
    defaults where it is silent, no windows for Qwen3-VL (its model has none), Qwen2-VL's
    'mrope' rope type read as the 'default' it is (as its config class does)."""
    qwen_type = VL_TEXTS[hf["model_type"]]
    hf = {**VL_DEFAULTS[hf["model_type"]], **hf, "model_type": qwen_type}
    if qwen_type == "qwen3":
        for key in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"):
            hf.pop(key, None)
    params = dict(hf.pop("rope_parameters", None) or hf.pop("rope_scaling", None) or {})
    if params.pop("type", None) == "mrope" or params.get("rope_type") == "mrope":
        params["rope_type"] = "default"
    hf["rope_parameters"] = params
    return hf


def config_to_hf(cfg: QwenConfig) -> dict:
    """The config.json dict; the window fields written out with every layer's type, so
    transformers windows the same layers."""
    out = {
        "model_type": cfg.model_type,
        "architectures": [ARCHITECTURES[cfg.model_type]],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "rope_parameters": rope.to_hf(cfg),
        "use_sliding_window": cfg.use_sliding_window,
        "sliding_window": cfg.sliding_window,
        "max_window_layers": cfg.max_window_layers,
        "layer_types": list(cfg.attention_layer_types),
    }
    if cfg.model_type == "qwen3":
        out["attention_bias"] = cfg.attention_bias
    return out


def hf_tensors(cfg: QwenConfig) -> list[HFTensor]:
    """Llama's tensor names (Qwen kept them) for the same layers, biases and tying, plus
    Qwen2's q/k/v biases and Qwen3's per-head q/k norms."""
    table = llama.hf_tensors(
        llama.LlamaConfig(
            num_layers=cfg.num_layers,
            attention_bias=cfg.attention_bias,
            tie_word_embeddings=cfg.tie_word_embeddings,
        )
    )
    n, attn = cfg.num_layers, "model.layers.{i}.self_attn"
    if cfg.qkv_bias and not cfg.attention_bias:
        table += [
            HFTensor(f"layers_{{i}}/{p}/bias", f"{attn}.{p}.bias", layers=n)
            for p in ("q_proj", "k_proj", "v_proj")
        ]
    if cfg.model_type == "qwen3":
        table += [
            HFTensor(f"layers_{{i}}/{p}/scale", f"{attn}.{p}.weight", layers=n)
            for p in ("q_norm", "k_norm")
        ]
    return table


HF_SPEC = register_hf(
    HFSpec(
        model_types=(*MODEL_TYPES, *VL_TEXTS),
        config_cls=QwenConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        # Qwen's vision-language files: the text tower under `model.language_model.` (the
        # Hub's Qwen2-VL / 2.5-VL files: `model.`; InternVL's `language_model.`), the head the
        # outer model's, the vision tower skipped.
        multimodal=(
            Multimodal("qwen3_vl", "qwen3_vl_text", tied=False),
            # InternVL's (InternVL3: a Qwen2 tower, 3.5: Qwen3, Qwen3-MoE or gpt-oss; llava's
            # layout, tied by default): whichever family its text_config names reads it.
            Multimodal("internvl", "qwen2", tied=True),
            # LLaVA-OneVision's (a Qwen2 tower in LLaVA-NeXT's layout).
            Multimodal("llava_onevision", "qwen2", False, text_ties=True),
            *(
                Multimodal(f"{kind}_vl", f"{kind}_vl_text", False, flat=True, text_ties=True)
                for kind in ("qwen2", "qwen2_5")
            ),
        ),
        renames=LLAVA_RENAMES,
        skip=(r"^(model\.)?visual\.", *LLAVA_SKIP),
    )
)
