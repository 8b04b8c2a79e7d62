"""OLMoE: Llama's block with a mixture-of-experts MLP on every layer, whole-projection q/k
norms and optional clipping of q, k and v.

The query and key projections are each RMS-normalised as a whole (all heads at once, before
rotary), then q, k and v clipped to `clip_qkv` when it is set; every layer's MLP is a
`moe.MoE` (softmax over the experts, then the top k, renormalised if `norm_topk_prob`).
Follows HuggingFace's `OlmoeForCausalLM`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin

from flaxlm.models import llama, moe, qwen, qwen_moe, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, register_hf

MODEL_TYPES = ("olmoe",)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class OlmoeConfig(qwen_moe.MoESizes, qwen.QwenFields, moe.MoEOptions):
    """OLMoE hyper-parameters: QwenFields' and MoEOptions' names (the experts' width is
    `moe_intermediate_size`, HF's `intermediate_size`), and `clip_qkv`; the defaults are
    OLMoE-1B-7B's."""

    vocab_size: int = 50304
    hidden_size: int = 2048
    num_layers: int = 16
    num_heads: int = 16
    num_kv_heads: int | None = 16
    intermediate_size: int = 1024  # unused: every layer is sparse (HF's is the experts')
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    model_type: str = "olmoe"
    # q, k and v clipped to [-clip_qkv, clip_qkv] after the q/k norms (None: not clipped).
    clip_qkv: float | None = None
    num_experts: int = 64
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 1024
    router_aux_loss_coef: float = 0.01

    supported_model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_moe()
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"clip_qkv {self.clip_qkv} must be None or positive.")
        if self.shared_expert_intermediate_size or not all(self.sparse_layers(self.num_layers)):
            raise ValueError(
                "OLMoE has no shared expert and no dense layers: set "
                "shared_expert_intermediate_size=0, decoder_sparse_step=1, mlp_only_layers=()."
            )
        if self.use_sliding_window or self.layer_types is not None:
            raise ValueError("OLMoE has no sliding window: set use_sliding_window=False.")
        if self.head_dim not in (None, self.hidden_size // self.num_heads):
            # HF's OLMoE sizes its q/k norms by hidden_size: no other head_dim runs there.
            raise ValueError(
                f"OLMoE's heads are hidden_size // num_heads "
                f"({self.hidden_size // self.num_heads}) wide: head_dim {self.head_dim} "
                "is not supported; leave head_dim unset."
            )

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    def attention_params(self) -> int:
        """Llama's attention (biases on q, k, v and o with `attention_bias`) and the
        whole-projection q/k norms."""
        e, d = self.hidden_size, self.dim_per_head
        q, kv = self.num_heads * d, self.kv_heads * d
        bias = q + 2 * kv + e if self.attention_bias else 0
        return e * (q + 2 * kv) + q * e + bias + q + kv

    def make_module(self) -> Olmoe:
        return Olmoe(self)


class OlmoeBlock(qwen_moe.QwenMoeBlock):
    """Qwen-MoE's block with OLMoE's attention: whole-projection q/k norms, clipping."""

    def attention_options(self) -> dict[str, Any]:
        cfg = self.config
        return dict(
            qkv_bias=cfg.attention_bias,
            out_bias=cfg.attention_bias,
            qk_norm="rms_whole",
            clip_qkv=cfg.clip_qkv,
        )


class Olmoe(qwen_moe.QwenMoe):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = OlmoeBlock


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides: Any) -> OlmoeConfig:
    """An OlmoeConfig from an OLMoE config.json dict (+ field overrides)."""
    kwargs = dict(
        llama.shared_fields_from_hf(hf, rms_norm_eps=1e-5),
        attention_bias=hf.get("attention_bias", False),
        head_dim=hf.get("head_dim"),  # (read, so that another width is refused, not ignored)
        clip_qkv=hf.get("clip_qkv"),
        **{**moe.options_from_hf(hf), "moe_intermediate_size": hf["intermediate_size"]},
        **rope.from_hf(hf),
    )
    kwargs.update(overrides)
    return OlmoeConfig(**kwargs)


def config_to_hf(cfg: OlmoeConfig) -> dict:
    return {
        "model_type": "olmoe",
        "architectures": ["OlmoeForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "intermediate_size": cfg.moe_intermediate_size,
        "rope_parameters": rope.to_hf(cfg),
        "attention_bias": cfg.attention_bias,
        "clip_qkv": cfg.clip_qkv,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }


def hf_tensors(cfg: OlmoeConfig) -> list[HFTensor]:
    """Llama's attention (and its biases) and norms, the q/k norms, each layer's router and
    experts."""
    n, attn = cfg.num_layers, "model.layers.{i}.self_attn"
    table = llama.hf_tensors_but_mlp(cfg) + [
        HFTensor(f"layers_{{i}}/{p}/scale", f"{attn}.{p}.weight", layers=n)
        for p in ("q_norm", "k_norm")
    ]
    return table + qwen_moe.moe_hf_tensors(cfg, "model.layers.{i}.mlp")


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=OlmoeConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
    )
)
