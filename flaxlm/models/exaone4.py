"""EXAONE 4.0: OLMo 2's post-normalised blocks with per-head q/k norms, sliding-window layers
between global ones, and no rotary on the global layers of a model that slides.

A block normalises the outputs of its attention and its MLP (`post_attention_layernorm`,
`post_feedforward_layernorm`) before adding them to the residual, with no norm on their
inputs; each query and key head is RMS-normalised (`q_norm`, `k_norm`, over `head_dim`)
before rotary; no biases anywhere. Each layer is 'sliding_attention' (a window of
`sliding_window` positions) or 'full_attention': `layer_types`, or as transformers derives
them, every `sliding_window_pattern`-th layer full. While `sliding_window` is set, the full
layers attend without position embeddings (NoPE) and only the sliding ones rotate, whether or
not any layer slides; with `sliding_window` None every layer rotates.

The rotary is one dict for all layers, read as OLMo 2's (`olmo2.flat_rope_from_hf`: 'default',
'linear', 'llama3', 'yarn'). Refused, naming the setting: what transformers' `Exaone4Config`
or model fails on (`layer_types` left to a `sliding_window_pattern` that is 0, None or a
string like 'LLLG' (transformers' `int % str`), or to a `sliding_window` of None; sliding
layers without a `sliding_window`; layer types other than the two; a rope dict per layer
type), 'dynamic' and other rope types, a `partial_rotary_factor` other than 1. An
`Exaone4Config` with neither `layer_types` nor `sliding_window` has every layer full.
Follows HuggingFace's `Exaone4ForCausalLM`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import jax

from flaxlm.models import attention, llama, masks, olmo2, olmo3, qwen, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, register_hf
from flaxlm.models.options import HeadShapes

Array = jax.Array

MODEL_TYPES = ("exaone4",)
FULL, SLIDING = olmo3.FULL, olmo3.SLIDING  # HF's layer_types entries
LEGACY_TYPES = {"attention": FULL}  # transformers' remap_legacy_layer_types
# transformers' Exaone4Config defaults of the config.json fields flaxlm reads.
HF_DEFAULTS = dict(
    vocab_size=102400,
    hidden_size=4096,
    intermediate_size=16384,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=2048,
    hidden_act="silu",
    tie_word_embeddings=False,
    sliding_window=4096,
    sliding_window_pattern=4,
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Exaone4Config(HeadShapes, rope.RopeScaling):
    """EXAONE 4.0 hyper-parameters (HF names where they exist); the defaults are the shapes
    of EXAONE-4.0-32B (its llama3 rope scaling is in gin/models/exaone4_32b.gin)."""

    vocab_size: int = 102400
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 5120
    num_layers: int = 64  # HF: num_hidden_layers
    num_heads: int = 40  # HF: num_attention_heads
    num_kv_heads: int | None = 8  # HF: num_key_value_heads; None: num_heads
    head_dim: int | None = 128  # None: hidden_size // num_heads
    intermediate_size: int = 27392
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    # A sliding layer's query sees this many latest positions; while set, the full layers
    # are NoPE. None: no layer slides, every layer rotates.
    sliding_window: int | None = 4096
    # Without `layer_types`: layer i is full where (i + 1) % pattern == 0, else sliding.
    sliding_window_pattern: int | str | None = 4
    # Each layer's 'sliding_attention' or 'full_attention'; None: from the pattern.
    layer_types: tuple[str, ...] | None = None
    tie_word_embeddings: bool = False  # the head reuses the token embedding
    activation: str = "silu"  # HF: hidden_act
    model_type: str = "exaone4"

    # Where llama.LlamaBlock reads a config: no biases, plain RMSNorms, per-head q/k norms.
    attention_bias: ClassVar[bool] = False
    qkv_bias: ClassVar[bool] = False
    mlp_bias: ClassVar[bool] = False
    norm_scale_plus_one: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.layer_types is not None:  # Gin and JSON give lists; the config stays hashable
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        super().__post_init__()
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r}: expected one of {MODEL_TYPES}.")
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be None or positive.")
        pattern = self.sliding_window_pattern
        if self.layer_types is None and self.sliding_window is not None:
            if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern == 0:
                raise ValueError(
                    f"sliding_window_pattern {pattern!r}: without layer_types, HF derives each "
                    "layer's type from a nonzero integer pattern only (a string such as 'LLLG' "
                    "fails there): set an integer or layer_types."
                )
        types = self.per_layer_types
        if len(types) != self.num_layers or any(t not in (FULL, SLIDING) for t in types):
            raise ValueError(
                f"layer_types {types}: expected num_layers ({self.num_layers}) entries, each "
                f"{FULL!r} or {SLIDING!r}."
            )
        if SLIDING in types and self.sliding_window is None:
            raise ValueError(
                f"sliding_window None: layer_types has {SLIDING!r} layers (HF has no window to "
                "give them)."
            )

    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """Each layer's type: `layer_types`, or as HF derives it from the pattern (no
        `sliding_window`: every layer full)."""
        if self.layer_types is not None:
            return self.layer_types
        if self.sliding_window is None:
            return (FULL,) * self.num_layers
        pattern = self.sliding_window_pattern
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(self.num_layers))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention), for `masks.layer_window`."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.per_layer_types)

    @property
    def rope_layers(self) -> tuple[bool, ...]:
        """Whether each layer rotates its queries and keys (HF: every layer without a
        `sliding_window`, else the sliding ones; the full layers are NoPE)."""
        return tuple(self.sliding_window is None or t == SLIDING for t in self.per_layer_types)

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates)."""
        e, v, d, f = self.hidden_size, self.vocab_size, self.dim_per_head, self.intermediate_size
        q, kv = self.num_heads * d, self.kv_heads * d
        block = e * (q + 2 * kv) + q * e + 2 * d + 3 * e * f + 2 * e  # q/k norms, post-norms
        head = 0 if self.tie_word_embeddings else v * e
        return v * e + self.num_layers * block + e + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus the attention scores (a sliding
        layer's over its window)."""
        return llama.windowed_flops_per_token(self, seq_len)

    def make_module(self) -> Exaone4:
        return Exaone4(self)


class Exaone4Attention:
    """EXAONE 4's attention, mixed into a block (EXAONE 4.0's and K-EXAONE's): Qwen3's
    per-head q/k norms and no biases; a NoPE layer's attention takes sin 0 and cos 1 (rotary
    becomes the identity, exactly), so scanned layers stay one program."""

    def self_attention(
        self,
        h: Array,
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
    ) -> Array:
        sin, cos = rope.nope_where(self.config.rope_layers, index, sin, cos)
        return super().self_attention(h, index, mask, decoding, sin, cos)

    def attention_options(self) -> dict[str, Any]:
        """No biases; each query and key head RMS-normalised."""
        return dict(qkv_bias=False, out_bias=False, qk_norm="rms")


class Exaone4Block(Exaone4Attention, olmo3.Olmo3Block):
    """OLMo 3's post-normalised block with EXAONE 4's attention."""


class Exaone4(qwen.Qwen):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = Exaone4Block


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides: Any) -> Exaone4Config:
    """An Exaone4Config from an EXAONE 4 config.json dict (+ field overrides), fields it
    leaves out at transformers' `Exaone4Config` defaults; what transformers' config fails on
    is refused naming the field."""
    hf = {**HF_DEFAULTS, **hf}
    layer_types = hf.get("layer_types")
    if layer_types is None and hf["sliding_window"] is None:
        raise ValueError(
            "layer_types missing with sliding_window None: HF then sets sliding_window_pattern "
            "to 0 and fails deriving layer_types; give layer_types."
        )
    if layer_types is not None:
        layer_types = tuple(LEGACY_TYPES.get(t, t) for t in layer_types)
    kwargs = dict(
        llama.shared_fields_from_hf(hf, rms_norm_eps=1e-5),
        head_dim=hf.get("head_dim"),
        sliding_window=hf["sliding_window"],
        sliding_window_pattern=hf["sliding_window_pattern"],  # (read only with a window)
        layer_types=layer_types,
        **olmo2.flat_rope_from_hf(hf, "EXAONE 4"),
    )
    kwargs.update(overrides)
    return Exaone4Config(**kwargs)


def config_to_hf(cfg: Exaone4Config) -> dict:
    """The config.json dict: every layer's type spelled out."""
    return {
        "model_type": cfg.model_type,
        "architectures": ["Exaone4ForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "rope_parameters": rope.to_hf(cfg),
        "sliding_window": cfg.sliding_window,
        "sliding_window_pattern": cfg.sliding_window_pattern,
        "layer_types": list(cfg.per_layer_types),
    }


def hf_tensors(cfg: Exaone4Config) -> list[HFTensor]:
    """OLMo 3's tensor names (no input norms; q/k norms, here a head wide; the norm after the
    MLP), without biases."""
    return olmo3.hf_tensors(cfg)


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=Exaone4Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
    )
)
