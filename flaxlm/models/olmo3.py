"""OLMo 3: OLMo 2's post-normalised blocks with sliding-window layers between full ones.

A block normalises the outputs of its attention and its MLP (`post_attention_layernorm`,
`post_feedforward_layernorm`) before adding them to the residual, with no norm on their
inputs; the query and key projections are each RMS-normalised as a whole (all heads at
once, `q_norm`, `k_norm`) before rotary. Each layer is 'sliding_attention' (a window of
`sliding_window` positions) or 'full_attention' (`layer_types`; by default three sliding
layers, then a full one), and each layer type has its own rotary parameters (HF's nested
`rope_parameters`: the published checkpoints scale the full layers' with YaRN, not the
sliding ones'). Follows HuggingFace's `Olmo3ForCausalLM`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from flaxlm.models import attention, layers, llama, masks, qwen, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, register_hf
from flaxlm.models.options import HeadShapes

Array = jax.Array

MODEL_TYPES = ("olmo3",)
FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types entries
LAYER_TYPES = (FULL, SLIDING)
DEFAULT_THETA = 500000.0  # transformers' Olmo3Config.default_theta
# RopeScaling's own fields (the rope beyond its base, `rope_theta`).
ROPE_FIELDS = tuple(
    f.name for f in dataclasses.fields(rope.RopeScaling) if f.name.startswith("rope_")
)
# transformers' Olmo3Config defaults of the config.json fields flaxlm reads.
HF_DEFAULTS = dict(
    vocab_size=50304,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    max_position_embeddings=2048,
    hidden_act="silu",
    tie_word_embeddings=False,
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Olmo3Config(HeadShapes, rope.RopeScaling):
    """OLMo 3 hyper-parameters (HF names where they exist); the defaults are Olmo-3-7B's.

    The `rope_*` fields are the full-attention layers' rotary; `sliding_rope_parameters`
    the sliding layers' as HF's dict (e.g. `{'rope_type': 'default', 'rope_theta': 5e5}`;
    None: the same as the full layers')."""

    vocab_size: int = 100352
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 4096
    num_layers: int = 32  # HF: num_hidden_layers
    num_heads: int = 32  # HF: num_attention_heads
    num_kv_heads: int | None = None  # HF: num_key_value_heads; None: num_heads
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int = 11008
    max_position_embeddings: int = 65536
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_THETA
    # HF's dict (Gin's and JSON's spelling; held as its sorted items) or None.
    sliding_rope_parameters: tuple[tuple[str, Any], ...] | None = None
    sliding_window: int | None = 4096  # a sliding layer's query sees this many latest positions
    # Each layer's 'sliding_attention' or 'full_attention'; None: every 4th layer full.
    layer_types: tuple[str, ...] | None = None
    attention_bias: bool = False  # biases on q, k, v and o
    tie_word_embeddings: bool = False  # the head reuses the token embedding
    activation: str = "silu"  # HF: hidden_act
    model_type: str = "olmo3"

    # Where llama.LlamaBlock reads a config: no MLP biases, plain RMSNorms; the q/k norms are
    # Olmo3Block's own (whole projections).
    mlp_bias: ClassVar[bool] = False
    norm_scale_plus_one: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = False
    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES  # a subclass's own (OLMo 2)

    def __post_init__(self) -> None:
        if self.layer_types is not None:  # Gin and JSON give lists; the config stays hashable
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.sliding_rope_parameters, dict | list | tuple):
            items = dict(self.sliding_rope_parameters).items()
            object.__setattr__(self, "sliding_rope_parameters", tuple(sorted(items)))
        super().__post_init__()
        if self.model_type not in self.model_types:
            raise ValueError(f"model_type {self.model_type!r}: expected one of {self.model_types}.")
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
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
        if self.sliding_rope_parameters is not None:
            self.sliding_rope()  # a ValueError naming what it cannot read

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """Each layer's type: `layer_types`, or HF's default (every 4th layer full)."""
        if self.layer_types is not None:
            return self.layer_types
        return tuple(FULL if (i + 1) % 4 == 0 else SLIDING for i in range(self.num_layers))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention), for `masks.layer_window`."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.per_layer_types)

    def sliding_rope(self) -> Olmo3Config:
        """This config with the sliding layers' rotary in its `rope_*` fields (what
        `rope.sin_cos` reads)."""
        if self.sliding_rope_parameters is None:
            return self
        params = dict(self.sliding_rope_parameters)
        reset = {name: getattr(rope.RopeScaling, name) for name in ROPE_FIELDS}
        try:
            fields = {**reset, **rope_fields(params, self.max_position_embeddings)}
            return dataclasses.replace(self, **fields, sliding_rope_parameters=None)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"sliding_rope_parameters {params}: {e}") from None

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates)."""
        e, v, d, f = self.hidden_size, self.vocab_size, self.dim_per_head, self.intermediate_size
        q, kv = self.num_heads * d, self.kv_heads * d
        attn = e * (q + 2 * kv) + q * e + (q + 2 * kv + e if self.attention_bias else 0)
        block = attn + q + kv + 3 * e * f + 2 * e  # q_norm, k_norm and the two post-norms
        head = 0 if self.tie_word_embeddings else v * e
        return v * e + self.num_layers * block + e + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus the attention scores (a sliding
        layer's over its window)."""
        return llama.windowed_flops_per_token(self, seq_len)

    def make_module(self) -> Olmo3:
        return Olmo3(self)


def rope_fields(params: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """`RopeScaling`'s fields and `rope_theta` from one layer type's HF rope dict (a YaRN or
    llama3 dict without `original_max_position_embeddings` takes the model's context, as
    transformers' `standardize_rope_params`); a `partial_rotary_factor` is refused (HF's
    OLMo 3 rotates whole heads with default rope and part of them with scaled rope)."""
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor {params['partial_rotary_factor']} is not supported."
        )
    params = dict(params)
    if params.get("rope_type", params.get("type")) in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
    hf = {"rope_parameters": params, "max_position_embeddings": max_position_embeddings}
    return rope.from_hf(hf)


class Olmo3Block(llama.LlamaBlock):
    """Attention and MLP, each output RMS-normalised before the residual add; the sliding
    layers with their window and, where it differs, their own rotary.

    Called `(x, layer_index, mask, decoding, sin, cos, *sliding_sin_cos)`."""

    @nn.compact
    def __call__(
        self,
        x: Array,
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
        *sliding_sin_cos: Array,
    ) -> Array:
        cfg = self.config
        if sliding_sin_cos:  # picked by this layer's (possibly traced) index
            sliding = jnp.asarray([t == SLIDING for t in cfg.per_layer_types])[index]
            sin = jnp.where(sliding, sliding_sin_cos[0], sin)
            cos = jnp.where(sliding, sliding_sin_cos[1], cos)
        norm = dict(epsilon=cfg.rms_norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        x = layers.constrain(x, layers.ACTIVATION_AXES)
        attn = self.self_attention(x, index, mask, decoding, sin, cos)
        attn = layers.RMSNorm(name="post_attention_layernorm", **norm)(attn)
        x = layers.constrain(x + self.dropped(attn), layers.ACTIVATION_AXES)
        mlp = layers.RMSNorm(name="post_feedforward_layernorm", **norm)(self.feed_forward(x, mask))
        return layers.constrain(x + self.dropped(mlp), layers.ACTIVATION_AXES)

    def attention_options(self) -> dict[str, Any]:
        """Biases as `attention_bias` says; q and k normalised over all heads at once."""
        bias = self.config.attention_bias
        return dict(qkv_bias=bias, out_bias=bias, qk_norm="rms_whole")


class Olmo3(qwen.Qwen):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = Olmo3Block

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, ...]]:
        cfg = self.config
        tables = rope.sin_cos(positions, cfg)
        sliding = cfg.sliding_rope()
        if SLIDING in cfg.per_layer_types and any(
            getattr(sliding, name) != getattr(cfg, name) for name in ("rope_theta", *ROPE_FIELDS)
        ):
            tables += rope.sin_cos(positions, sliding)
        return x, tables


# ------------------------------------------------------------------ HuggingFace


def rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Olmo3Config's rope fields as transformers' `Olmo3Config` resolves them: the nested
    `rope_parameters` (per layer type), an older top-level `rope_scaling` applying to the
    full layers only, and a top-level `rope_theta` that only the full layers take (the
    sliding ones keep the default base unless their own dict sets one)."""
    params = hf.get("rope_parameters") or {}
    full = dict(params.get(FULL) or {"rope_type": "default"})
    full.update(hf.get("rope_scaling") or {})
    full.setdefault("rope_theta", hf.get("rope_theta", DEFAULT_THETA))
    sliding = dict(params.get(SLIDING) or {"rope_type": "default"})
    sliding.setdefault("rope_theta", DEFAULT_THETA)
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {hf['partial_rotary_factor']} is not supported.")
    context = hf.get("max_position_embeddings", 2048)
    try:
        out = rope_fields(full, context)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"rope_parameters[{FULL!r}] {full}: {e}") from None
    return dict(out, sliding_rope_parameters=sliding)


def config_from_hf(hf: dict, **overrides: Any) -> Olmo3Config:
    """An Olmo3Config from an OLMo 3 config.json dict (+ field overrides), fields it leaves
    out at transformers' defaults."""
    kwargs = dict(
        llama.shared_fields_from_hf({**HF_DEFAULTS, **hf}, rms_norm_eps=1e-5),
        head_dim=hf.get("head_dim"),
        attention_bias=hf.get("attention_bias", False),
        sliding_window=hf.get("sliding_window", 4096),
        layer_types=tuple(hf["layer_types"]) if hf.get("layer_types") else None,
        **rope_from_hf(hf),
    )
    kwargs.update(overrides)
    return Olmo3Config(**kwargs)


def config_to_hf(cfg: Olmo3Config) -> dict:
    """The config.json dict: every layer's type, and each type's rope dict."""
    sliding = rope.to_hf(cfg.sliding_rope())
    return {
        "model_type": cfg.model_type,
        "architectures": ["Olmo3ForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "attention_bias": cfg.attention_bias,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.per_layer_types),
        "rope_parameters": {FULL: rope.to_hf(cfg), SLIDING: sliding},
    }


def hf_tensors(cfg: Olmo3Config) -> list[HFTensor]:
    """Llama's tensors but `input_layernorm` (OLMo 3 has none), the whole-projection q/k
    norms and the norm after the MLP."""
    n = cfg.num_layers
    table = llama.hf_tensors(
        llama.LlamaConfig(
            num_layers=n,
            attention_bias=cfg.attention_bias,
            tie_word_embeddings=cfg.tie_word_embeddings,
        )
    )
    names = ("self_attn.q_norm", "self_attn.k_norm", "post_feedforward_layernorm")
    return [t for t in table if "input_layernorm" not in t.hf] + [
        HFTensor(
            f"layers_{{i}}/{name.split('.')[-1]}/scale",
            f"model.layers.{{i}}.{name}.weight",
            layers=n,
        )
        for name in names
    ]


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=Olmo3Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
    )
)
