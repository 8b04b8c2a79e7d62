"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's block (multi-head latent attention,
`mla.py`) with GLM-4.5's mixture of experts, dense layers wherever `mlp_layer_types` puts
them.

What differs from DeepSeek-V3 (`deepseek.py`): the defaults (GLM-4.7-Flash's 30B-A3B, 47
layers, transformers' `Glm4MoeLiteConfig`), and which layers are dense: HF's
`mlp_layer_types` names each layer 'sparse' (a `moe.MoE` routed as DeepSeek-V3's: a sigmoid
score per expert, the choice moved by `e_score_correction_bias` and limited to the
`topk_group` best of `n_group` groups, the chosen scores renormalised with `norm_topk_prob`
and scaled by `routed_scaling_factor`, plus `n_shared_experts` ungated shared experts) or
anything else (a dense SwiGLU of `intermediate_size`), by default the first layer dense and
the others sparse. HF's model ignores `first_k_dense_replace` (a config.json may carry
one), and so does flaxlm. The latent attention is DeepSeek-V3's, rotary pairs interleaved or
half-split (`rope_interleave`), YaRN with DeepSeek's mscale where config.json asks for it.
Follows HuggingFace's `Glm4MoeLiteForCausalLM`; quantized files read as DeepSeek-V3's (block
FP8, compressed-tensors: dequantized on import). The multi-token-prediction layer of the
Hub's files (`model.layers.47`) is skipped on import, as transformers' causal LM skips it;
it is never read: transformers' `Glm4MoeLiteConfig` has no `num_mtp_layers`, so no
`MtpModel` of this family checks one.

Refused (a ValueError naming the setting, where HF's model fails or flaxlm cannot run it):
`partial_rotary_factor` narrowing the rotary tables below `qk_rope_head_dim` (HF rotates
every rotary feature with them and fails), `num_mtp_layers`, fewer `mlp_layer_types` than
layers, `n_shared_experts` 0 (HF's shared MLP is then zero-wide, its empty tensors in the
files), `n_group` not dividing the experts or leaving one a group (HF's grouping mixes
tokens, or fails), `decoder_sparse_step` other than 1, and what DeepSeek-V3 refuses
(`deepseek.fields_from_hf`: `num_key_value_heads` != `num_attention_heads`, quantized files
other than block FP8 or compressed-tensors'; rope types flaxlm lacks, 'dynamic' among them:
`rope.from_hf`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin

from flaxlm.models import deepseek, deepseek_v32, glm4_moe
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, register_hf

MODEL_TYPES = ("glm4_moe_lite",)
# HF's router and MoE block (GLM-4.5's): what they hard-wire.
FIXED: dict[str, Any] = dict(
    glm4_moe.Glm4MoeConfig.FIXED, router_scales_input=False, per_expert_scale=False
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Glm4MoeLiteConfig(deepseek.DeepseekV3Config):
    """GLM-4.7-Flash hyper-parameters: DeepSeek-V3's fields (HF's names where they exist;
    `mlp_only_layers` are HF's dense `mlp_layer_types`); the defaults are transformers'
    `Glm4MoeLiteConfig`'s (GLM-4.7-Flash's shapes)."""

    vocab_size: int = 154880
    hidden_size: int = 2048
    num_layers: int = 47
    num_heads: int = 20
    intermediate_size: int = 10240  # the dense layers' MLP
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    q_lora_rank: int | None = 768
    qk_nope_head_dim: int = 192
    v_head_dim: int = 256
    num_experts: int = 64  # HF: n_routed_experts
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 1536
    routed_scaling_factor: float = 1.8
    n_group: int = 1
    topk_group: int = 1
    mlp_only_layers: tuple[int, ...] = (0,)  # HF: mlp_layer_types' default, the first dense
    rope_scaling_type: str | None = None
    rope_scaling_factor: float = 1.0
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None

    model_type: ClassVar[str] = "glm4_moe_lite"
    architecture: ClassVar[str] = "Glm4MoeLiteForCausalLM"
    mtp_layers_built: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        glm4_moe.check_fixed(self, FIXED, self.architecture)
        if self.num_experts // self.n_group < 2:
            raise ValueError(
                f"n_group {self.n_group}: HF rates a group of experts by its two best, so each "
                f"of the {self.num_experts} experts' groups needs at least 2."
            )
        if self.n_shared_experts < 1:
            raise ValueError(
                f"n_shared_experts {self.n_shared_experts}: HF's {self.architecture} then "
                "keeps a zero-wide shared expert MLP (empty tensors), which flaxlm does not "
                "build; n_shared_experts >= 1."
            )

    def check_mtp(self) -> None:
        self.check_mtp_counts()
        if self.num_mtp_layers:
            raise ValueError(
                f"num_mtp_layers {self.num_mtp_layers}: transformers' Glm4MoeLiteConfig has no "
                "num_mtp_layers (no MtpModel of this family to check an MTP layer against), so "
                "flaxlm skips the Hub's model.layers.47; set num_mtp_layers=0."
            )

    def check_dense_layers(self) -> None:
        """Dense layers anywhere (HF's `mlp_layer_types`); a scan stacks the MoE layers
        after dense first ones, or the cycle dense and MoE layers repeat
        (`moe.DenseFirstScan`)."""
        if self.decoder_sparse_step != 1:
            raise ValueError(
                f"decoder_sparse_step {self.decoder_sparse_step}: HF's {self.architecture} "
                "names its dense layers (mlp_only_layers); 1 only."
            )
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(
                f"mlp_only_layers {self.mlp_only_layers}: {outside} are no layers of "
                f"{self.num_layers}."
            )

    @property
    def mlp_layer_types(self) -> tuple[str, ...]:
        """HF's per-layer MLP kinds, 'dense' or 'sparse'."""
        return tuple("sparse" if s else "dense" for s in self.sparse_layers(self.num_layers))


# ------------------------------------------------------------------ HuggingFace

# transformers' Glm4MoeLiteConfig defaults, for keys a config.json omits
# (`first_k_dense_replace` is none of its keys: `deepseek.fields_from_hf` reads it, and
# `mlp_layer_types` replaces what it gives).
HF_DEFAULTS = dict(
    vocab_size=154880,
    hidden_size=2048,
    intermediate_size=10240,
    moe_intermediate_size=1536,
    num_hidden_layers=47,
    num_attention_heads=20,
    num_key_value_heads=20,
    n_shared_experts=1,
    n_routed_experts=64,
    routed_scaling_factor=1.8,
    kv_lora_rank=512,
    q_lora_rank=768,
    qk_rope_head_dim=64,
    v_head_dim=256,
    qk_nope_head_dim=192,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=202752,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_interleave=True,
    attention_bias=False,
    first_k_dense_replace=1,
)
# Other names transformers reads for its fields (Glm4MoeLiteConfig.attribute_map).
ALIASES = {"num_local_experts": "n_routed_experts", "head_dim": "qk_rope_head_dim"}
# The multi-token-prediction layer of the Hub's 47-layer files (transformers'
# _keys_to_ignore_on_load_unexpected).
MTP_LAYER = 47


def config_from_hf(hf: dict, **overrides: Any) -> Glm4MoeLiteConfig:
    """A Glm4MoeLiteConfig from a GLM-4.7-Flash config.json dict (+ field overrides)."""
    hf = dict(hf)
    for alias, key in ALIASES.items():
        if alias in hf and key not in hf:
            hf[key] = hf.pop(alias)
    hf = {**HF_DEFAULTS, **hf}
    rope_dim = hf["qk_rope_head_dim"]
    factor = glm4_moe.partial_rotary_factor(hf, 1.0)
    if int(rope_dim * factor) != rope_dim:
        raise ValueError(
            f"partial_rotary_factor {factor}: HF's Glm4MoeLite builds rotary tables of "
            f"int(qk_rope_head_dim * factor) = {int(rope_dim * factor)} features but rotates "
            f"all {rope_dim} rotary features with them (it fails); 1.0 only."
        )
    kwargs = deepseek.fields_from_hf(hf, HF_DEFAULTS, HF_DEFAULTS["rms_norm_eps"])
    n = kwargs["num_layers"]
    kinds = hf.get("mlp_layer_types")
    if kinds is None:  # HF's default, whatever first_k_dense_replace says
        kinds = ["dense"] + ["sparse"] * (n - 1)
    kwargs["mlp_only_layers"] = deepseek_v32.dense_layers({"mlp_layer_types": kinds}, n, 1)
    kwargs.update(overrides)
    return Glm4MoeLiteConfig(**kwargs)


def config_to_hf(cfg: Glm4MoeLiteConfig) -> dict:
    out = deepseek.config_to_hf(cfg)
    # Not keys of transformers' Glm4MoeLiteConfig: `mlp_layer_types` says which layers are
    # dense, and no MTP layer is written.
    del out["first_k_dense_replace"], out["num_nextn_predict_layers"]
    out.update(
        model_type=cfg.model_type,
        architectures=[cfg.architecture],
        mlp_layer_types=list(cfg.mlp_layer_types),
    )
    return out


def skip_mtp_layer(cfg: Glm4MoeLiteConfig) -> dict[str, Any]:
    """`HFSpec.config_fields`: the Hub's MTP layer skipped where it is no layer of `cfg`
    (transformers ignores those tensors only as unexpected ones)."""
    return {"skip": (rf"^model\.layers\.{MTP_LAYER}\.",) if cfg.num_layers <= MTP_LAYER else ()}


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=Glm4MoeLiteConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        # DeepSeek-V3's table: latent attention, the MLPs (dense where `mlp_only_layers`
        # says), shared experts and correction biases.
        tensors=deepseek.hf_tensors,
        ignore=deepseek.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=deepseek.HF_SPEC.tied_head,
        skip=(rf"^model\.layers\.{MTP_LAYER}\.",),
        config_fields=skip_mtp_layer,
    )
)
