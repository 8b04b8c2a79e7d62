"""Solar Open (`solar_open`, Upstage's Solar-Open-100B): Llama's attention and GLM-4.5's
mixture of experts on every layer.

Attention is grouped-query with rotary over every feature of each head (half-split pairs),
q, k and v biased with `attention_bias` (o never), no q/k norms. Every MLP is a `moe.MoE`
routed as GLM-4.5's (`glm4_moe.py`): a sigmoid score per expert, the choice moved by
`e_score_correction_bias` and limited to the `topk_group` best of `n_group` groups, the chosen
scores renormalised with `norm_topk_prob` and scaled by `routed_scaling_factor`, plus
`n_shared_experts` ungated shared experts. Follows HuggingFace's `SolarOpenForCausalLM`, whose
config is GLM-4.5's less `intermediate_size`, `first_k_dense_replace`, `use_qk_norm` and
`num_mtp_layers`: keys transformers' model ignores in a config.json, and flaxlm too (no
layer is dense, no q/k norm, no MTP layer: its files carry none, and transformers skips no
tensor of them). `rope_theta` defaults to 1e6 (transformers' `SolarOpenConfig.default_theta`)
and `head_dim` to 128, whatever the width.

Refused (a ValueError naming the setting, where HF's model fails or flaxlm cannot run it):
`partial_rotary_factor` leaving features unrotated (HF's rotary tables narrow with it, but
its attention rotates whole heads with them and fails), `n_shared_experts` 0 (HF's shared
MLP is then zero-wide, its empty tensors in the files), `n_group` not dividing the experts or
leaving one a group (HF's grouping mixes tokens, or fails), query heads that key/value heads
do not divide, an odd or null `head_dim`, quantized files other than block FP8 or
compressed-tensors', rope types flaxlm lacks ('dynamic' among them: `rope.from_hf`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin

from flaxlm.models import attention, deepseek, glm4_moe, llama, moe, qwen_moe, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, register_hf

MODEL_TYPES = ("solar_open",)
DEFAULT_THETA = 1e6  # transformers' SolarOpenConfig.default_theta


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SolarOpenConfig(glm4_moe.PartialRotary, qwen_moe.MoESizes, rope.RopeScaling, moe.MoEOptions):
    """Solar Open hyper-parameters (HF's names where they exist; `num_experts` is HF's
    `n_routed_experts`); the defaults are transformers' `SolarOpenConfig`'s (Solar-Open-100B's
    shapes)."""

    vocab_size: int = 196608
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 4096
    num_layers: int = 48  # HF: num_hidden_layers
    num_heads: int = 64  # HF: num_attention_heads
    num_kv_heads: int | None = 8  # HF: num_key_value_heads; None: num_heads
    head_dim: int | None = 128  # None: hidden_size // num_heads
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float = DEFAULT_THETA
    attention_bias: bool = False  # biases on q, k and v (never on o)
    tie_word_embeddings: bool = False
    activation: str = "silu"  # HF: hidden_act
    num_experts: int = 128  # HF: n_routed_experts
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 1280
    router: str = "sigmoid_topk"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = True
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 1
    # HF's SolarOpenForCausalLM computes no load-balance loss (the correction bias balances).
    router_aux_loss_coef: float = 0.0

    # What llama.Llama and the block read beside the fields: rotary over whole heads, no q/k
    # norms, no MLP biases.
    scale_embedding: ClassVar[bool] = False
    norm_scale_plus_one: ClassVar[bool] = False
    sliding_window: ClassVar[None] = None
    mlp_bias: ClassVar[bool] = False
    partial_rotary_factor: ClassVar[float] = 1.0
    qk_norm: ClassVar[None] = None
    # HF's router and MoE block: what they hard-wire (every layer sparse).
    FIXED: ClassVar[dict[str, Any]] = dict(
        glm4_moe.Glm4MoeConfig.FIXED,
        mlp_only_layers=(),
        router_scales_input=False,
        per_expert_scale=False,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_moe()
        glm4_moe.check_fixed(self, self.FIXED, "SolarOpenForCausalLM")
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
        if self.num_experts // self.n_group < 2:
            raise ValueError(
                f"n_group {self.n_group}: HF rates a group of experts by its two best, so each "
                f"of the {self.num_experts} experts' groups needs at least 2."
            )
        if self.n_shared_experts < 1:
            raise ValueError(
                f"n_shared_experts {self.n_shared_experts}: HF's Solar Open MoE then keeps a "
                "zero-wide shared expert MLP (empty tensors), which flaxlm does not build; "
                "n_shared_experts >= 1."
            )

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def intermediate_size(self) -> int:
        """The dense MLP width `qwen_moe`'s helpers read: none here (every layer is sparse)."""
        return self.moe_intermediate_size

    def attention_params(self) -> int:
        """One block's attention: q, k, v (and their biases) and o."""
        e, d = self.hidden_size, self.dim_per_head
        q, kv = self.num_heads * d, self.kv_heads * d
        return e * (q + 2 * kv) + q * e + (q + 2 * kv if self.attention_bias else 0)

    def make_module(self) -> SolarOpen:
        return SolarOpen(self)


class SolarOpen(glm4_moe.Glm4Moe):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`: GLM-4.5's
    model and block with this config's biases, whole-head rotary and experts."""


# ------------------------------------------------------------------ HuggingFace

# transformers' SolarOpenConfig defaults, for keys a config.json omits.
HF_DEFAULTS = dict(
    vocab_size=196608,
    hidden_size=4096,
    num_hidden_layers=48,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_bias=False,
    moe_intermediate_size=1280,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_routed_experts=128,
    routed_scaling_factor=1.0,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
)


def config_from_hf(hf: dict, **overrides: Any) -> SolarOpenConfig:
    """A SolarOpenConfig from a Solar Open config.json dict (+ field overrides)."""
    glm4_moe.check_quantization(hf, "Solar Open")
    hf = dict(hf)
    if "num_local_experts" in hf and "n_routed_experts" not in hf:  # HF's attribute_map
        hf["n_routed_experts"] = hf.pop("num_local_experts")
    hf = {**HF_DEFAULTS, **hf}
    head_dim, factor = hf["head_dim"], glm4_moe.partial_rotary_factor(hf, 1.0)
    if head_dim is None:
        raise ValueError("head_dim is null: HF's SolarOpenConfig needs it (an int; default 128).")
    if int(head_dim * factor) != head_dim:
        raise ValueError(
            f"partial_rotary_factor {factor}: HF's Solar Open builds rotary tables of "
            f"int(head_dim * factor) = {int(head_dim * factor)} features but rotates all "
            f"{head_dim} features of each head with them (it fails); 1.0 only."
        )
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = {} if "rope_theta" in params or "rope_theta" in hf else {"rope_theta": DEFAULT_THETA}
    kwargs = dict(
        llama.shared_fields_from_hf({**hf, "intermediate_size": None}),
        head_dim=head_dim,
        attention_bias=bool(hf["attention_bias"]),
        num_experts=hf["n_routed_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        n_group=hf["n_group"],
        topk_group=hf["topk_group"],
        n_shared_experts=hf["n_shared_experts"],
        **{**rope.from_hf(hf), **theta},
    )
    del kwargs["intermediate_size"]  # none: every layer is the mixture of experts
    kwargs.update(overrides)
    return SolarOpenConfig(**kwargs)


def config_to_hf(cfg: SolarOpenConfig) -> dict:
    out = {
        "model_type": "solar_open",
        "architectures": ["SolarOpenForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "rope_parameters": rope.to_hf(cfg),
        "attention_bias": cfg.attention_bias,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "n_shared_experts": cfg.n_shared_experts,
    }
    del out["intermediate_size"]  # not a key of transformers' SolarOpenConfig
    return out


def hf_tensors(cfg: SolarOpenConfig) -> list[HFTensor]:
    """Llama's table with q/k/v biases (`attention_bias`), then each layer's MoE as
    DeepSeek-V3's: router, experts, shared experts and correction bias."""
    return glm4_moe.attention_hf_tensors(cfg) + deepseek.moe_hf_tensors(cfg)


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=SolarOpenConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
    )
)
