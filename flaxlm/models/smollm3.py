"""SmolLM3: Llama's blocks with NoPE layers (no rotary) among the rotary ones.

Every `no_rope_layer_interval`-th layer (or each layer `no_rope_layers` marks 0) attends
without position embeddings; with `use_sliding_window` and a `sliding_window`, the NoPE layers
(or those `layer_types` names 'sliding_attention') see only the latest `sliding_window`
positions. Biases on the attention (`attention_bias`, q, k, v and o) and on the MLP
(`mlp_bias`) are optional, and the head is tied unless `tie_word_embeddings` is False.
Follows HuggingFace's `SmolLM3ForCausalLM`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import jax

from flaxlm.models import attention, llama, masks, qwen, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, register_hf
from flaxlm.models.options import HeadShapes

Array = jax.Array

MODEL_TYPES = ("smollm3",)
FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types entries
DEFAULT_THETA = 2000000.0  # transformers' SmolLM3Config.default_theta
# transformers' SmolLM3Config defaults of the config.json fields flaxlm reads.
HF_DEFAULTS = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    hidden_act="silu",
    tie_word_embeddings=True,
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SmolLM3Config(HeadShapes, rope.RopeScaling):
    """SmolLM3 hyper-parameters (HF names where they exist); the defaults are SmolLM3-3B's."""

    vocab_size: int = 128256
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 2048
    num_layers: int = 36  # HF: num_hidden_layers
    num_heads: int = 16  # HF: num_attention_heads
    num_kv_heads: int | None = 4  # HF: num_key_value_heads; None: num_heads
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int = 11008
    max_position_embeddings: int = 65536
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5000000.0
    # Per layer, 1: rotary, 0: NoPE (at least num_layers entries; the first num_layers
    # count). None: every `no_rope_layer_interval`-th layer is NoPE.
    no_rope_layers: tuple[int, ...] | None = None
    no_rope_layer_interval: int = 4
    # The windowed layers see only the `sliding_window` latest positions; without
    # `use_sliding_window` no layer is windowed.
    use_sliding_window: bool = False
    sliding_window: int | None = None
    # Per layer 'full_attention' / 'sliding_attention'; None: the NoPE layers are sliding
    # when `use_sliding_window` and `sliding_window` are set.
    layer_types: tuple[str, ...] | None = None
    attention_bias: bool = False  # biases on q, k, v and o
    mlp_bias: bool = False
    tie_word_embeddings: bool = True  # the head reuses the token embedding
    activation: str = "silu"  # HF: hidden_act
    model_type: str = "smollm3"

    # Where llama.LlamaBlock reads a config: no q/k norms, plain RMSNorms.
    qk_norm: ClassVar[bool] = False
    norm_scale_plus_one: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for name in ("no_rope_layers", "layer_types"):  # Gin and JSON give lists
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        super().__post_init__()
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r}: expected one of {MODEL_TYPES}.")
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
        if self.no_rope_layer_interval < 1:
            raise ValueError(f"no_rope_layer_interval {self.no_rope_layer_interval} must be >= 1.")
        if self.no_rope_layers is not None and len(self.no_rope_layers) < self.num_layers:
            raise ValueError(
                f"no_rope_layers has {len(self.no_rope_layers)} entries for num_layers "
                f"{self.num_layers}."
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be None or positive.")
        types = self.layer_types
        if types is None:
            return
        if len(types) != self.num_layers or any(t not in (FULL, SLIDING) for t in types):
            raise ValueError(
                f"layer_types {types}: expected num_layers ({self.num_layers}) entries, each "
                f"{FULL!r} or {SLIDING!r}."
            )
        if SLIDING in types and not (self.use_sliding_window and self.sliding_window):
            # HF's eager and SDPA attention window these layers by `sliding_window` whatever
            # `use_sliding_window` says, its flash attention only with it: no one answer.
            raise ValueError(
                f"layer_types names {SLIDING!r} layers: set use_sliding_window=True and a "
                f"sliding_window (now {self.use_sliding_window}, {self.sliding_window})."
            )

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def rope_layers(self) -> tuple[bool, ...]:
        """Whether each layer rotates its queries and keys (False: a NoPE layer)."""
        if self.no_rope_layers is not None:
            return tuple(bool(r) for r in self.no_rope_layers[: self.num_layers])
        interval = self.no_rope_layer_interval
        return tuple((i + 1) % interval != 0 for i in range(self.num_layers))

    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """Each layer's HF layer type: `layer_types`, or as HF derives it (the NoPE layers
        slide when a window is on)."""
        if self.layer_types is not None:
            return self.layer_types
        windowed = self.use_sliding_window and self.sliding_window is not None
        return tuple(SLIDING if windowed and not r else FULL for r in self.rope_layers)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's sliding window (None: global attention), for `masks.layer_window`."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.per_layer_types)

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates)."""
        e, v, d, f = self.hidden_size, self.vocab_size, self.dim_per_head, self.intermediate_size
        q, kv = self.num_heads * d, self.kv_heads * d
        attn = e * (q + 2 * kv) + q * e + (q + 2 * kv + e if self.attention_bias else 0)
        mlp = 3 * e * f + (2 * f + e if self.mlp_bias else 0)
        head = 0 if self.tie_word_embeddings else v * e
        return v * e + self.num_layers * (attn + mlp + 2 * e) + e + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus the attention scores (a windowed
        layer scores at most its window)."""
        return llama.windowed_flops_per_token(self, seq_len)

    def make_module(self) -> SmolLM3:
        return SmolLM3(self)


class SmolLM3Block(llama.LlamaBlock):
    """Llama's block; a NoPE layer's attention takes sin 0 and cos 1 (rotary becomes the
    identity, exactly), so scanned layers stay one program."""

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


class SmolLM3(qwen.Qwen):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = SmolLM3Block


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides: Any) -> SmolLM3Config:
    """A SmolLM3Config from a SmolLM3 config.json dict (+ field overrides), fields it leaves
    out at transformers' defaults."""
    hf = {**HF_DEFAULTS, **hf}
    # HF reads rope_scaling before rope_parameters, and the base from the dict first.
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if params.get("rope_type", params.get("type")) in ("llama3", "yarn"):
        # As transformers' standardize_rope_params: a top-level value first, then the context.
        original = hf.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original or params.get(
            "original_max_position_embeddings", hf["max_position_embeddings"]
        )
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1.0):
        raise ValueError(
            f"partial_rotary_factor {partial} is not supported (SmolLM3 rotates whole heads)."
        )
    rope_hf = {
        "rope_theta": hf.get("rope_theta", DEFAULT_THETA),
        "rope_scaling": params,
        "max_position_embeddings": hf["max_position_embeddings"],
    }
    no_rope = hf.get("no_rope_layers")
    layer_types = hf.get("layer_types")
    kwargs = dict(
        llama.shared_fields_from_hf(hf),
        head_dim=hf.get("head_dim"),
        no_rope_layers=tuple(no_rope) if no_rope is not None else None,
        no_rope_layer_interval=hf.get("no_rope_layer_interval", 4),
        use_sliding_window=bool(hf.get("use_sliding_window", False)),
        sliding_window=hf.get("sliding_window"),
        layer_types=tuple(layer_types) if layer_types is not None else None,
        attention_bias=hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False),
        **rope.from_hf(rope_hf),
    )
    kwargs.update(overrides)
    return SmolLM3Config(**kwargs)


def config_to_hf(cfg: SmolLM3Config) -> dict:
    """The config.json dict, every layer's rotary flag and type spelled out."""
    return {
        "model_type": cfg.model_type,
        "architectures": ["SmolLM3ForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "rope_parameters": rope.to_hf(cfg),
        "no_rope_layers": [int(r) for r in cfg.rope_layers],
        "no_rope_layer_interval": cfg.no_rope_layer_interval,
        "use_sliding_window": cfg.use_sliding_window,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.per_layer_types),
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
    }


def hf_tensors(cfg: SmolLM3Config) -> list[HFTensor]:
    """Llama's tensor names, with its attention and MLP biases and tying."""
    return llama.hf_tensors(
        llama.LlamaConfig(
            num_layers=cfg.num_layers,
            attention_bias=cfg.attention_bias,
            mlp_bias=cfg.mlp_bias,
            tie_word_embeddings=cfg.tie_word_embeddings,
        )
    )


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=SmolLM3Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
    )
)
