"""Cohere's Command models: `cohere` (Command R, Command R+) and `cohere2` (Command R7B,
Command A): one bias-free LayerNorm feeding attention and the MLP in parallel, rotary over
interleaved pairs, logits multiplied by `logit_scale`, a tied head by default.

A block is `x + attention(h) + mlp(h)` with `h = input_layernorm(x)`, a LayerNorm without a
bias (mean-subtracted, then scaled; HF's `CohereLayerNorm`), and so is the final norm; the
MLP is a SwiGLU (`hidden_act`); `attention_bias` puts biases on q, k, v and o. The rotary
rotates the pairs (0, 1), (2, 3), ... of each head (HF's cohere `rotate_half`); the logits are
the head's times `logit_scale`. `cohere` with `use_qk_norm` (Command R+) normalises each query
and key head before rotary by a bias-free LayerNorm with a scale per head (`[heads,
head_dim]`). `cohere2` has sliding-window layers (`sliding_window` positions) and full ones:
`layer_types`, or as transformers derives them, every `sliding_window_pattern`-th layer full;
only the sliding layers rotate, a full layer attends without position embeddings (NoPE), and
a model with no sliding layer rotates nowhere. A `head_dim` in config.json is honoured (HF
reads it in both); a rope dict of type 'default' ignores `partial_rotary_factor`, and
config.json's keys that one model does not read (`use_qk_norm` in cohere2, `sliding_window`
in cohere) are ignored, as HF's.

Refused, naming the setting: `logit_scale` or `layer_norm_eps` null (transformers' model
fails on them); 'dynamic', 'longrope' and other rope types than 'default', 'linear',
'llama3' and 'yarn', a rope dict per layer type, a `partial_rotary_factor` other than 1 with
scaled rope (HF fails there); a `sliding_window_pattern` that is 0, null or a string while
`layer_types` is absent, layer types other than full and sliding, a `sliding_window` null
(even with every layer full) or 0 (each of which HF's `Cohere2Config` or model fails on); in
a flaxlm config, sliding layers on `cohere` and `use_qk_norm` on `cohere2` (neither HF model
has them). Follows HuggingFace's `CohereForCausalLM` and `Cohere2ForCausalLM`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from flaxlm.models import attention, layers, llama, masks, olmo2, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.causal_lm import CausalLM
from flaxlm.models.hf_spec import HFSpec, HFTensor, register_hf
from flaxlm.models.options import HeadShapes

Array = jax.Array

COHERE, COHERE2 = "cohere", "cohere2"
FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types entries
LEGACY_TYPES = {"attention": FULL}  # transformers' remap_legacy_layer_types
ARCHITECTURES = {COHERE: "CohereForCausalLM", COHERE2: "Cohere2ForCausalLM"}
# transformers' CohereConfig / Cohere2Config defaults of the config.json fields flaxlm reads
# (the rotary base: CohereConfig's `default_theta`, PreTrainedConfig's for cohere2).
SHARED_DEFAULTS = dict(
    vocab_size=256000,
    hidden_size=8192,
    intermediate_size=22528,
    logit_scale=0.0625,
    num_hidden_layers=40,
    num_attention_heads=64,
    hidden_act="silu",
    max_position_embeddings=8192,
    layer_norm_eps=1e-5,
    tie_word_embeddings=True,
    attention_bias=False,
)
HF_DEFAULTS = {
    COHERE: dict(SHARED_DEFAULTS, rope_theta=500000.0, use_qk_norm=False),
    COHERE2: dict(SHARED_DEFAULTS, rope_theta=10000.0, sliding_window=4096),
}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CohereConfig(HeadShapes, rope.RopeScaling):
    """Command R / R+ hyper-parameters (HF names where they exist); the defaults are the
    shapes of c4ai-command-r-v01 (35B)."""

    vocab_size: int = 256000
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 8192
    num_layers: int = 40  # HF: num_hidden_layers
    num_heads: int = 64  # HF: num_attention_heads
    num_kv_heads: int | None = None  # HF: num_key_value_heads; None: num_heads
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int = 22528
    max_position_embeddings: int = 8192
    layer_norm_eps: float = 1e-5
    rope_theta: float = 8000000.0
    logit_scale: float = 0.0625  # the logits are the head's times this
    use_qk_norm: bool = False  # cohere: each query and key head LayerNormed (Command R+)
    attention_bias: bool = False  # biases on q, k, v and o
    # cohere2: a sliding layer's query sees this many latest positions (None: no window).
    sliding_window: int | None = None
    # cohere2 without `layer_types`: layer i is full where (i + 1) % pattern == 0.
    sliding_window_pattern: int | str | None = 4
    # cohere2: each layer's 'sliding_attention' or 'full_attention'; None: from the pattern.
    layer_types: tuple[str, ...] | None = None
    tie_word_embeddings: bool = True  # the head reuses the token embedding
    activation: str = "silu"  # HF: hidden_act
    model_type: str = COHERE

    model_types: ClassVar[tuple[str, ...]] = (COHERE,)
    # Where llama.LlamaBlock reads a config: no MLP biases.
    mlp_bias: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.layer_types is not None:  # Gin and JSON give lists; the config stays hashable
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        super().__post_init__()
        if self.model_type not in self.model_types:
            raise ValueError(f"model_type {self.model_type!r}: expected one of {self.model_types}.")
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
        for name in ("logit_scale", "layer_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} {value!r}: expected a number (HF fails on null).")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be None or positive.")
        self.check_layers()

    def check_layers(self) -> None:
        """`cohere`: no sliding layers (HF's Cohere has none)."""
        if self.sliding_window is not None or self.layer_types is not None:
            raise ValueError(
                f"sliding_window {self.sliding_window} / layer_types {self.layer_types}: HF's "
                "cohere has no sliding layers (model_type='cohere2' has)."
            )

    @property
    def rms_norm_eps(self) -> float:
        """The q/k norms' eps, where `llama.LlamaBlock` reads it (HF: `layer_norm_eps`)."""
        return self.layer_norm_eps

    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """Each layer's type: `layer_types`, or as HF's Cohere2Config derives it."""
        if self.model_type == COHERE:
            return (FULL,) * self.num_layers
        if self.layer_types is not None:
            return self.layer_types
        pattern = self.sliding_window_pattern
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(self.num_layers))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention), for `masks.layer_window`."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.per_layer_types)

    @property
    def rope_layers(self) -> tuple[bool, ...]:
        """Whether each layer rotates (cohere: all; cohere2: the sliding ones)."""
        return tuple(self.model_type == COHERE or t == SLIDING for t in self.per_layer_types)

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates)."""
        e, v, d, f = self.hidden_size, self.vocab_size, self.dim_per_head, self.intermediate_size
        q, kv = self.num_heads * d, self.kv_heads * d
        attn = e * (q + 2 * kv) + q * e + (q + 2 * kv + e if self.attention_bias else 0)
        attn += q + kv if self.use_qk_norm else 0  # a scale per head and feature
        block = attn + 3 * e * f + e  # one norm a block
        head = 0 if self.tie_word_embeddings else v * e
        return v * e + self.num_layers * block + e + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus the attention scores (a sliding
        layer's over its window)."""
        return llama.windowed_flops_per_token(self, seq_len)

    def make_module(self) -> Cohere:
        return Cohere(self)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Cohere2Config(CohereConfig):
    """Command R7B / Command A hyper-parameters: CohereConfig's; the defaults are the shapes
    of c4ai-command-r7b-12-2024."""

    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int | None = 8
    intermediate_size: int = 14336
    rope_theta: float = 50000.0
    logit_scale: float = 0.25
    sliding_window: int | None = 4096
    model_type: str = COHERE2

    model_types: ClassVar[tuple[str, ...]] = (COHERE2,)

    def check_layers(self) -> None:
        """Layer types HF derives or takes, each with what it needs; no q/k norms."""
        if self.use_qk_norm:
            raise ValueError("use_qk_norm=True: HF's cohere2 has no q/k norms.")
        pattern = self.sliding_window_pattern
        if self.layer_types is None and (
            isinstance(pattern, bool) or not isinstance(pattern, int) or pattern == 0
        ):
            raise ValueError(
                f"sliding_window_pattern {pattern!r}: without layer_types, HF derives each "
                "layer's type from a nonzero integer pattern only: set one or layer_types."
            )
        types = self.per_layer_types
        if len(types) != self.num_layers or any(t not in (FULL, SLIDING) for t in types):
            raise ValueError(
                f"layer_types {types}: expected num_layers ({self.num_layers}) entries, each "
                f"{FULL!r} or {SLIDING!r}."
            )
        if self.sliding_window is None:
            raise ValueError(
                "sliding_window None: HF's cohere2 builds a sliding-window mask whatever the "
                "layer types, and fails without a window."
            )


class CohereBlock(llama.LlamaBlock):
    """One bias-free LayerNorm feeding attention and the MLP side by side; interleaved rotary
    (sin 0 and cos 1 on a NoPE layer, so scanned layers stay one program)."""

    @nn.compact
    def __call__(
        self,
        x: Array,
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
    ) -> Array:
        cfg = self.config
        sin, cos = rope.nope_where(cfg.rope_layers, index, sin, cos)
        x = layers.constrain(x, layers.ACTIVATION_AXES)
        h = layers.LayerNorm(
            cfg.layer_norm_eps,
            use_bias=False,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="input_layernorm",
        )(x)
        attn = self.dropped(self.self_attention(h, index, mask, decoding, sin, cos))
        mlp = self.dropped(self.feed_forward(h, mask))
        return layers.constrain(x + attn + mlp, layers.ACTIVATION_AXES)

    def attention_options(self) -> dict[str, Any]:
        """Biases as `attention_bias` says; per-head LayerNorms on q and k with
        `use_qk_norm`; interleaved rotary."""
        cfg = self.config
        return dict(
            qkv_bias=cfg.attention_bias,
            out_bias=cfg.attention_bias,
            qk_norm="layer" if cfg.use_qk_norm else None,
            rotary_interleaved=True,
        )


class Cohere(CausalLM):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = CohereBlock
    layer_index = True  # each block looks up its window and whether it rotates

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, Array]]:
        return x, rope.sin_cos(positions, self.config)

    def final_norm(self, x: Array) -> Array:
        cfg = self.config
        return layers.LayerNorm(
            cfg.layer_norm_eps,
            use_bias=False,
            dtype=jnp.float32,
            param_dtype=cfg.param_dtype,
            name="norm",
        )(x)

    @nn.nowrap
    def _head(self, head: nn.Module, x: Array) -> Array:
        """The skeleton's float32 logits times `logit_scale` (as HF, after the head)."""
        return super()._head(head, x) * jnp.float32(self.config.logit_scale)


# ------------------------------------------------------------------ HuggingFace


def rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope fields as transformers resolves them for one rotary (`olmo2.flat_rope_from_hf`);
    HF's Cohere computes a 'default' rotary over whole heads whatever `partial_rotary_factor`
    says, so there it is dropped."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if params.get("rope_type", params.get("type", "default")) == "default":
        params.pop("partial_rotary_factor", None)
        hf = {k: v for k, v in hf.items() if k != "partial_rotary_factor"}
    return olmo2.flat_rope_from_hf({**hf, "rope_scaling": params or None}, "Cohere")


def config_from_hf(hf: dict, **overrides: Any) -> CohereConfig:
    """A CohereConfig or Cohere2Config from a config.json dict (+ field overrides), fields it
    leaves out at transformers' defaults; what transformers fails on is refused naming the
    field."""
    kind = hf["model_type"]
    hf = {**HF_DEFAULTS[kind], **hf}
    for name in ("logit_scale", "layer_norm_eps"):
        if hf[name] is None:
            raise ValueError(f"{name} null: HF's {kind} model fails on it.")
    fields = llama.shared_fields_from_hf(hf)
    del fields["rms_norm_eps"]
    fields.update(
        head_dim=hf.get("head_dim"),
        layer_norm_eps=hf["layer_norm_eps"],
        logit_scale=hf["logit_scale"],
        attention_bias=bool(hf["attention_bias"]),
        **rope_from_hf(hf),
    )
    if kind == COHERE:
        return CohereConfig(**fields, use_qk_norm=bool(hf["use_qk_norm"]), **overrides)
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        layer_types = tuple(LEGACY_TYPES.get(t, t) for t in layer_types)
    fields.update(
        sliding_window=hf["sliding_window"],
        sliding_window_pattern=hf.get("sliding_window_pattern", 4),
        layer_types=layer_types,
    )
    return Cohere2Config(**{**fields, **overrides})


def config_to_hf(cfg: CohereConfig) -> dict:
    """The config.json dict (cohere2: every layer's type spelled out)."""
    out = {
        "model_type": cfg.model_type,
        "architectures": [ARCHITECTURES[cfg.model_type]],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "layer_norm_eps": cfg.layer_norm_eps,
        "logit_scale": cfg.logit_scale,
        "attention_bias": cfg.attention_bias,
        "rope_parameters": rope.to_hf(cfg),
    }
    del out["rms_norm_eps"]
    if cfg.model_type == COHERE:
        return {**out, "use_qk_norm": cfg.use_qk_norm}
    return {**out, "sliding_window": cfg.sliding_window, "layer_types": list(cfg.per_layer_types)}


def hf_tensors(cfg: CohereConfig) -> list[HFTensor]:
    """Llama's tensor names but the norm after attention (one norm a block), and the q/k
    norms' `[heads, head_dim]` scales with `use_qk_norm`."""
    n = cfg.num_layers
    table = llama.hf_tensors(
        llama.LlamaConfig(
            num_layers=n,
            attention_bias=cfg.attention_bias,
            tie_word_embeddings=cfg.tie_word_embeddings,
        )
    )
    table = [t for t in table if "post_attention_layernorm" not in t.hf]
    if cfg.use_qk_norm:
        table += [
            HFTensor(
                f"layers_{{i}}/{p}/scale", f"model.layers.{{i}}.self_attn.{p}.weight", 1, layers=n
            )
            for p in ("q_norm", "k_norm")
        ]
    return table


SPECS = tuple(
    register_hf(
        HFSpec(
            model_types=(kind,),
            config_cls=cls,
            model_cls=DecoderOnlyModel,
            config_from_hf=config_from_hf,
            config_to_hf=config_to_hf,
            tensors=hf_tensors,
            ignore=llama.HF_SPEC.ignore,
            base_model_prefix="model",
            tied_head=llama.HF_SPEC.tied_head,
        )
    )
    for kind, cls in ((COHERE, CohereConfig), (COHERE2, Cohere2Config))
)
