"""MiniMax-M2 (`minimax_m2`): Llama's block with partial rotary, q/k norms over the whole
projection and a mixture of experts on every layer, routed by sigmoid scores.

Attention is grouped-query, unbiased, with rotary over each head's first `rotary_dim`
features (HF: `partial_rotary_factor`, or the released files' `rotary_dim`), the query and
key projections each RMS-normalised as a whole (all heads at once, as OLMoE's) before rotary.
Every MLP is a `moe.MoE` of experts `intermediate_size` wide: a sigmoid score per expert,
the top `num_experts_per_tok` chosen after adding the per-expert `e_score_correction_bias`
(which moves the choice, never the weights), the chosen scores renormalised; no shared
expert, no groups, no scaling. Follows HuggingFace's `MiniMaxM2ForCausalLM`, whose files name
the MoE block `block_sparse_moe` and each expert's projections `w1`, `w3`, `w2` (Mixtral's
spelling): read in either spelling, written in that one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin

from flaxlm.models import attention, glm4_moe, llama, mixtral, moe, qwen_moe, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, register_hf

MODEL_TYPES = ("minimax_m2",)
DEFAULT_THETA = 5e6  # transformers' MiniMaxM2Config.default_theta


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MiniMaxM2Config(glm4_moe.PartialRotary, qwen_moe.MoESizes, rope.RopeScaling, moe.MoEOptions):
    """MiniMax-M2 hyper-parameters (HF's names where they exist; the experts' width
    `moe_intermediate_size` is HF's `intermediate_size`, `num_experts` its
    `num_local_experts`); the defaults are MiniMax-M2's (230B)."""

    vocab_size: int = 200064
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 3072
    num_layers: int = 62  # HF: num_hidden_layers
    num_heads: int = 48  # HF: num_attention_heads
    num_kv_heads: int | None = 8  # HF: num_key_value_heads; None: num_heads
    head_dim: int | None = 128  # None: hidden_size // num_heads
    max_position_embeddings: int = 196608
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_THETA
    partial_rotary_factor: float = 0.5  # rotary covers this fraction of each head
    tie_word_embeddings: bool = False
    activation: str = "silu"  # HF: hidden_act
    num_experts: int = 256  # HF: num_local_experts
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 1536  # HF: intermediate_size
    router: str = "sigmoid_topk"
    norm_topk_prob: bool = True
    score_correction_bias: bool = True
    # HF adds its balance loss only with output_router_logits (off in the released config).
    router_aux_loss_coef: float = 0.0

    # What llama.Llama and the block read beside the fields: no biases, whole q/k norms.
    scale_embedding: ClassVar[bool] = False
    norm_scale_plus_one: ClassVar[bool] = False
    sliding_window: ClassVar[None] = None
    mlp_bias: ClassVar[bool] = False
    attention_bias: ClassVar[bool] = False
    qkv_bias: ClassVar[bool] = False
    qk_norm: ClassVar[str] = "rms_whole"
    # HF's router and MoE block: what they hard-wire.
    FIXED: ClassVar[dict[str, Any]] = dict(
        router="sigmoid_topk",
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        score_correction_bias=True,
        n_group=1,
        topk_group=1,
        n_shared_experts=0,
        shared_expert_intermediate_size=0,
        decoder_sparse_step=1,
        mlp_only_layers=(),
        router_bias=False,
        expert_bias=False,
        swiglu_limit=None,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_moe()
        glm4_moe.check_fixed(self, self.FIXED, "MiniMaxM2ForCausalLM")
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
        glm4_moe.check_rotary(self)

    @property
    def intermediate_size(self) -> int:
        """The dense MLP width `qwen_moe`'s helpers read: none here (every layer is sparse)."""
        return self.moe_intermediate_size

    def attention_params(self) -> int:
        """One block's attention: q, k, v, o and the whole-projection q/k norms."""
        e, d = self.hidden_size, self.dim_per_head
        q, kv = self.num_heads * d, self.kv_heads * d
        return e * (q + 2 * kv) + q * e + q + kv

    def make_module(self) -> MiniMaxM2:
        return MiniMaxM2(self)


class MiniMaxM2(glm4_moe.Glm4Moe):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`: GLM-4.5's
    partial-rotary model and block, with this config's whole q/k norms and experts."""


# ------------------------------------------------------------------ HuggingFace

# transformers' MiniMaxM2Config defaults, for keys a config.json omits.
HF_DEFAULTS = dict(
    vocab_size=200064,
    hidden_size=3072,
    intermediate_size=1536,
    num_hidden_layers=62,
    num_attention_heads=48,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=196608,
    rms_norm_eps=1e-6,
    num_experts_per_tok=8,
    num_local_experts=256,
    router_aux_loss_coef=0.001,
    router_jitter_noise=0.0,
    output_router_logits=False,
)


def config_from_hf(hf: dict, **overrides: Any) -> MiniMaxM2Config:
    """A MiniMaxM2Config from a MiniMax-M2 config.json dict (+ field overrides)."""
    glm4_moe.check_quantization(hf, "MiniMax-M2")
    hf = {**HF_DEFAULTS, **hf}
    if hf["router_jitter_noise"]:
        raise ValueError(
            f"router_jitter_noise {hf['router_jitter_noise']}: flaxlm does not scale the MoE "
            "input by random noise in training; set it 0."
        )
    if hf["output_router_logits"] and hf["router_aux_loss_coef"]:
        raise ValueError(
            "output_router_logits=True: HF's MiniMax-M2 then adds a balance loss over "
            "softmax probabilities of its sigmoid router, which flaxlm does not compute; set "
            "output_router_logits false (flaxlm's router_aux_loss_coef is its own balance loss)."
        )
    head_dim = hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
    rotary = hf.get("rotary_dim")
    default_factor = 1.0 if rotary is None else rotary / head_dim
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = {} if "rope_theta" in params or "rope_theta" in hf else {"rope_theta": DEFAULT_THETA}
    kwargs = dict(
        llama.shared_fields_from_hf(hf),
        head_dim=hf["head_dim"],
        partial_rotary_factor=glm4_moe.partial_rotary_factor(hf, default_factor),
        num_experts=hf.get("num_local_experts", hf.get("num_experts")),
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["intermediate_size"],
        **{**rope.from_hf(hf), **theta},
    )
    del kwargs["intermediate_size"]  # the experts' (moe_intermediate_size)
    kwargs.update(overrides)
    return MiniMaxM2Config(**kwargs)


def config_to_hf(cfg: MiniMaxM2Config) -> dict:
    return {
        "model_type": "minimax_m2",
        "architectures": ["MiniMaxM2ForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "rope_parameters": glm4_moe.rope_to_hf(cfg),
        "rotary_dim": cfg.rotary_dim,  # the released files' spelling (vLLM reads it)
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
    }


PREFIX = "model.layers.{i}.block_sparse_moe"  # the MoE block as the Hub's files name it


def hf_tensors(cfg: MiniMaxM2Config) -> list[HFTensor]:
    """The attention table (whole q/k norms), then each layer's router, experts (Mixtral's
    names) and correction bias."""
    n = cfg.num_layers
    return [
        *glm4_moe.attention_hf_tensors(cfg),
        *qwen_moe.moe_hf_tensors(cfg, PREFIX, expert_names=mixtral.EXPERT_NAMES),
        HFTensor(
            "layers_{i}/mlp/e_score_correction_bias", f"{PREFIX}.e_score_correction_bias", layers=n
        ),
    ]


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=MiniMaxM2Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        renames=mixtral.HF_SPEC.renames,  # transformers 5's in-memory `mlp.` names
    )
)
