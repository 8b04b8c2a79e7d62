"""K-EXAONE (`exaone_moe`, LG's K-EXAONE-236B-A23B): EXAONE 4.0's attention in Llama's
pre-normalised block, with DeepSeek-V3's mixture of experts.

Unlike EXAONE 4.0's post-normalised blocks, a block RMS-normalises its input before the
attention (`input_layernorm`) and before the MLP (`post_attention_layernorm`), as OLMoE's and
Llama's do. The attention is EXAONE 4.0's: grouped-query, each query and key head
RMS-normalised (`q_norm`, `k_norm`, over `head_dim`) before rotary, no biases; each layer is
'sliding_attention' (a window of `sliding_window` positions, rotary) or 'full_attention'
(NoPE: no position embedding at all): `layer_types`, or as transformers derives them, every
`sliding_window_pattern`-th layer full. Each MLP is a dense SwiGLU of `intermediate_size`
('dense' in `mlp_layer_types`, by default the first `first_k_dense_replace` layers) or a
`moe.MoE` routed as DeepSeek-V3's ('sparse'): a sigmoid score per expert, the choice moved by
`e_score_correction_bias` and limited to the `topk_group` best of `n_group` groups, the chosen
scores renormalised with `norm_topk_prob` and scaled by `routed_scaling_factor`, plus one
ungated shared SwiGLU of `num_shared_experts` x `moe_intermediate_size`. The rotary is one dict
for all layers, read as OLMo 2's (`olmo2.flat_rope_from_hf`: 'default', 'linear', 'llama3',
'yarn'). Follows HuggingFace's `ExaoneMoeForCausalLM`. The Hub's files store the correction
bias as `mlp.e_score_correction_bias` (transformers renames it into the router, and so does
flaxlm) and carry multi-token-prediction layers (`mtp.*`), skipped as transformers skips them.

Refused, naming the setting (where transformers' `ExaoneMoeConfig` or model fails, or flaxlm
cannot run it): a `sliding_window` of None (HF's config takes an int only) or below 1,
`layer_types` left to a `sliding_window_pattern` that is 0, None or a string like 'LLLG'
(transformers' `int % str`), a null `head_dim`, layer types other than the two,
`mlp_layer_types` not one 'dense' or 'sparse' a layer, a Hub `is_moe_layer` that contradicts
them, `num_shared_experts` 0 (HF's shared MLP is then zero-wide), `n_group` not dividing the
experts or leaving one a group, 'dynamic' and other rope types flaxlm lacks, a
`partial_rotary_factor` other than 1 with a scaled rope (HF's default rope ignores it, and so
does flaxlm), a rope dict per layer type.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import jax

from flaxlm.models import (
    attention,
    deepseek,
    exaone4,
    glm4_moe,
    llama,
    moe,
    olmo2,
    qwen,
    qwen_moe,
    rope,
)
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, register_hf
from flaxlm.models.options import HeadShapes

Array = jax.Array

MODEL_TYPES = ("exaone_moe",)
FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types entries
LEGACY_TYPES = {"attention": FULL}  # transformers' remap_legacy_layer_types
MLP_KINDS = ("dense", "sparse")  # HF's mlp_layer_types entries
# HF's router and MoE block: what they hard-wire.
FIXED: dict[str, Any] = dict(
    glm4_moe.Glm4MoeConfig.FIXED, router_scales_input=False, per_expert_scale=False
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ExaoneMoeConfig(
    HeadShapes, moe.DenseFirstScan, qwen_moe.MoESizes, rope.RopeScaling, moe.MoEOptions
):
    """K-EXAONE hyper-parameters (HF's names where they exist; `n_shared_experts` is HF's
    `num_shared_experts`, `mlp_only_layers` its 'dense' `mlp_layer_types`); the defaults are
    K-EXAONE-236B-A23B's shapes (transformers' `ExaoneMoeConfig` defaults are in HF_DEFAULTS)."""

    vocab_size: int = 153600
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 6144
    num_layers: int = 48  # HF: num_hidden_layers
    num_heads: int = 64  # HF: num_attention_heads
    num_kv_heads: int | None = 8  # HF: num_key_value_heads; None: num_heads
    head_dim: int | None = 128  # None: hidden_size // num_heads
    intermediate_size: int = 18432  # the dense layers' MLP
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    # A sliding layer's query sees this many latest positions (rotary); the full layers are
    # NoPE. HF requires it.
    sliding_window: int = 128
    # Without `layer_types`: layer i is full where (i + 1) % pattern == 0, else sliding.
    sliding_window_pattern: int | str | None = 4
    # Each layer's 'sliding_attention' or 'full_attention'; None: from the pattern.
    layer_types: tuple[str, ...] | None = None
    tie_word_embeddings: bool = False
    activation: str = "silu"  # HF: hidden_act
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    router: str = "sigmoid_topk"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    score_correction_bias: bool = True
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 1  # HF: num_shared_experts
    # HF's ExaoneMoeForCausalLM computes no load-balance loss (the correction bias balances).
    router_aux_loss_coef: float = 0.0
    mlp_only_layers: tuple[int, ...] = (0,)  # HF: first_k_dense_replace = 1

    # What llama.LlamaBlock and qwen.Qwen read beside the fields: no biases, plain RMSNorms,
    # per-head q/k norms.
    attention_bias: ClassVar[bool] = False
    qkv_bias: ClassVar[bool] = False
    mlp_bias: ClassVar[bool] = False
    norm_scale_plus_one: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.layer_types is not None:  # Gin and JSON give lists; the config stays hashable
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        super().__post_init__()
        self.check_moe()
        glm4_moe.check_fixed(self, FIXED, "ExaoneMoeForCausalLM")
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
        if self.num_experts // self.n_group < 2:
            raise ValueError(
                f"n_group {self.n_group}: HF rates a group of experts by its two best, so each "
                f"of the {self.num_experts} experts' groups needs at least 2."
            )
        if self.n_shared_experts < 1:
            raise ValueError(
                f"n_shared_experts {self.n_shared_experts}: HF's K-EXAONE MoE then keeps a "
                "zero-wide shared expert MLP (empty tensors), which flaxlm does not build; "
                "num_shared_experts >= 1."
            )
        if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError(
                f"mlp_only_layers {self.mlp_only_layers}: layer numbers in [0, num_layers="
                f"{self.num_layers})."
            )
        if self.sliding_window is None or self.sliding_window < 1:
            raise ValueError(
                f"sliding_window {self.sliding_window} must be a positive int (HF's "
                "ExaoneMoeConfig takes no None: the full layers are NoPE, the sliding ones "
                "windowed)."
            )
        pattern = self.sliding_window_pattern
        bad = isinstance(pattern, bool) or not isinstance(pattern, int) or pattern == 0
        if self.layer_types is None and bad:
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

    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """Each layer's type: `layer_types`, or as HF derives it from the pattern."""
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
        """Whether each layer rotates its queries and keys: the sliding ones (the full ones
        are NoPE)."""
        return tuple(t == SLIDING for t in self.per_layer_types)

    @property
    def mlp_layer_types(self) -> tuple[str, ...]:
        """HF's per-layer MLP kinds, 'dense' or 'sparse'."""
        return tuple("sparse" if s else "dense" for s in self.sparse_layers(self.num_layers))

    def make_module(self) -> ExaoneMoe:
        return ExaoneMoe(self)


class ExaoneMoeBlock(exaone4.Exaone4Attention, qwen_moe.QwenMoeBlock):
    """Llama's pre-normalised block with EXAONE 4.0's attention (`exaone4.Exaone4Attention`)
    and the mixture of experts (a dense SwiGLU on `mlp_only_layers`)."""


class ExaoneMoe(qwen.Qwen):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = ExaoneMoeBlock


# ------------------------------------------------------------------ HuggingFace

# transformers' ExaoneMoeConfig defaults of the config.json fields flaxlm reads.
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
    first_k_dense_replace=1,
    moe_intermediate_size=1024,
    num_experts=64,
    num_experts_per_tok=8,
    num_shared_experts=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
)


def dense_layers(hf: dict, num_layers: int) -> tuple[int, ...]:
    """The 'dense' layers of `mlp_layer_types` (HF validates one 'dense' or 'sparse' a
    layer), else the first `first_k_dense_replace` (HF's default); a Hub `is_moe_layer`
    list (older runtimes' spelling, which HF ignores) must agree."""
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        k = hf["first_k_dense_replace"]
        kinds = ["dense" if i < k else "sparse" for i in range(num_layers)]
    if len(kinds) != num_layers or any(kind not in MLP_KINDS for kind in kinds):
        raise ValueError(
            f"mlp_layer_types {kinds}: HF's ExaoneMoeConfig takes one of {MLP_KINDS} for each "
            f"of the {num_layers} layers."
        )
    moe_layers = hf.get("is_moe_layer")
    if moe_layers is not None and [bool(m) for m in moe_layers] != [k == "sparse" for k in kinds]:
        raise ValueError(
            f"is_moe_layer {moe_layers} contradicts mlp_layer_types {kinds} (transformers "
            "builds the MLPs the latter names, first_k_dense_replace by default): the file's "
            "MLPs would not be the model's."
        )
    return tuple(i for i, kind in enumerate(kinds) if kind == "dense")


def drop_unread_partial_rotary(hf: dict) -> dict:
    """`hf` without `partial_rotary_factor` where its rope is the default one, whose tables
    transformers' K-EXAONE and Hunyuan build over whole heads whatever the factor says (their
    scaled ropes narrow the tables by it, and their attention then fails: refused later)."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if params.get("rope_type", params.get("type", "default")) != "default":
        return hf
    out = {k: v for k, v in hf.items() if k != "partial_rotary_factor"}
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(out.get(key), dict):
            out[key] = {k: v for k, v in out[key].items() if k != "partial_rotary_factor"}
    return out


def config_from_hf(hf: dict, **overrides: Any) -> ExaoneMoeConfig:
    """An ExaoneMoeConfig from a K-EXAONE config.json dict (+ field overrides), fields it
    leaves out at transformers' `ExaoneMoeConfig` defaults; what transformers' config or model
    fails on is refused naming the field."""
    hf = {**HF_DEFAULTS, **hf}
    if "head_dim" in hf and hf["head_dim"] is None:
        raise ValueError(
            "head_dim is null in config.json: HF's K-EXAONE attention then has no head width "
            "(and fails); give it or leave it out (hidden_size // num_attention_heads)."
        )
    if hf["sliding_window"] is None:
        raise ValueError(
            "sliding_window is null: HF's ExaoneMoeConfig takes an int only (its full layers "
            "are NoPE beside windowed rotary ones)."
        )
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        layer_types = tuple(LEGACY_TYPES.get(t, t) for t in layer_types)
    fields = llama.shared_fields_from_hf(hf, rms_norm_eps=1e-5)
    kwargs = dict(
        fields,
        head_dim=hf.get("head_dim"),
        sliding_window=hf["sliding_window"],
        sliding_window_pattern=hf["sliding_window_pattern"],
        layer_types=layer_types,
        num_experts=hf["num_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        n_group=hf["n_group"],
        topk_group=hf["topk_group"],
        n_shared_experts=hf["num_shared_experts"],
        mlp_only_layers=dense_layers(hf, fields["num_layers"]),
        **olmo2.flat_rope_from_hf(drop_unread_partial_rotary(hf), "K-EXAONE"),
    )
    kwargs.update(overrides)
    return ExaoneMoeConfig(**kwargs)


def config_to_hf(cfg: ExaoneMoeConfig) -> dict:
    """The config.json dict: every layer's attention and MLP kind spelled out."""
    kinds = cfg.mlp_layer_types
    return {
        "model_type": "exaone_moe",
        "architectures": ["ExaoneMoeForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "rope_parameters": rope.to_hf(cfg),
        "sliding_window": cfg.sliding_window,
        "sliding_window_pattern": cfg.sliding_window_pattern,
        "layer_types": list(cfg.per_layer_types),
        "mlp_layer_types": list(kinds),
        "first_k_dense_replace": next(
            (i for i, k in enumerate(kinds) if k == "sparse"), len(kinds)
        ),
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_shared_experts": cfg.n_shared_experts,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
    }


def hf_tensors(cfg: ExaoneMoeConfig) -> list[HFTensor]:
    """Llama's embedding, attention, norms and head with per-head q/k norms, then each
    layer's MLP as DeepSeek-V3's: router, experts, shared experts and correction bias, or
    the dense SwiGLU."""
    return glm4_moe.attention_hf_tensors(cfg) + deepseek.moe_hf_tensors(cfg)


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=ExaoneMoeConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        # The Hub's spelling of the correction bias (transformers' conversion renames it into
        # the router), and its multi-token-prediction layers (transformers'
        # _keys_to_ignore_on_load_unexpected `mtp.*`).
        renames=((r"\.mlp\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),),
        skip=(r"(^|\.)mtp[._]",),
    )
)
