"""Mixtral: Mistral's attention with a mixture-of-experts MLP on every layer.

Every layer's MLP is a `moe.MoE` of `num_local_experts` SwiGLU experts, each token routed to
its `num_experts_per_tok` best by a softmax router whose top-k weights are always
renormalised; no shared expert, no dense layers; an optional sliding window on every layer.
The block is Qwen-MoE's (`qwen_moe.QwenMoeBlock`) with no biases and no q/k norms. Follows
HuggingFace's `MixtralForCausalLM`, whose files on the Hub (and its `save_pretrained`) name
the experts `block_sparse_moe.experts.{e}.w1/w2/w3`, while transformers 5 holds them fused
under `mlp.`: both are read, the first written.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin

from flaxlm.models import llama, moe, qwen, qwen_moe, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, register_hf

MODEL_TYPES = ("mixtral",)
EXPERT_NAMES = ("w1", "w3", "w2")  # each expert's gate, up and down projections on the Hub


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MixtralConfig(qwen_moe.MoESizes, qwen.QwenFields, moe.MoEOptions):
    """Mixtral hyper-parameters: QwenFields' and MoEOptions' names (the experts' width is
    `moe_intermediate_size`, HF's `intermediate_size`); the defaults are Mixtral 8x7B's.
    A window (`sliding_window`) applies to every layer."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int | None = 8
    intermediate_size: int = 14336  # unused: every layer is sparse (HF's is the experts')
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-5
    max_window_layers: int = 0  # every layer windowed when sliding_window is set
    model_type: str = "mixtral"
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 14336
    norm_topk_prob: bool = True  # Mixtral renormalises always
    router_aux_loss_coef: float = 0.02

    supported_model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

    def __post_init__(self) -> None:
        object.__setattr__(self, "use_sliding_window", self.sliding_window is not None)
        super().__post_init__()
        self.check_moe()
        if self.router == "softmax_topk" and not self.norm_topk_prob:
            raise ValueError(
                "Mixtral renormalises its top-k weights: set norm_topk_prob=True (or "
                "router='topk_softmax')."
            )
        if self.shared_expert_intermediate_size or not all(self.sparse_layers(self.num_layers)):
            raise ValueError(
                "Mixtral has no shared expert and no dense layers: set "
                "shared_expert_intermediate_size=0, decoder_sparse_step=1, mlp_only_layers=()."
            )
        if self.attention_bias or self.layer_types is not None or self.max_window_layers:
            raise ValueError(
                "Mixtral has no attention_bias, layer_types or max_window_layers (a window "
                "applies to every layer): leave them at their defaults."
            )

    def make_module(self) -> qwen_moe.QwenMoe:
        return qwen_moe.QwenMoe(self)


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides: Any) -> MixtralConfig:
    """A MixtralConfig from a Mixtral config.json dict (+ field overrides)."""
    kwargs = dict(
        llama.shared_fields_from_hf(hf, rms_norm_eps=1e-5),
        head_dim=hf.get("head_dim"),
        sliding_window=hf.get("sliding_window"),
        **rope.from_hf(hf),
    )
    # The experts are HF's intermediate_size wide, always renormalised, on every layer.
    kwargs.update(
        moe.options_from_hf(hf),
        moe_intermediate_size=hf["intermediate_size"],
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
    )
    kwargs.update(overrides)
    return MixtralConfig(**kwargs)


def config_to_hf(cfg: MixtralConfig) -> dict:
    return {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "intermediate_size": cfg.moe_intermediate_size,
        "head_dim": cfg.dim_per_head,
        "rope_parameters": rope.to_hf(cfg),
        "sliding_window": cfg.sliding_window,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }


def hf_tensors(cfg: MixtralConfig) -> list[HFTensor]:
    """Llama's attention and norms, then each layer's router and experts."""
    prefix = "model.layers.{i}.block_sparse_moe"
    return llama.hf_tensors_but_mlp(cfg) + qwen_moe.moe_hf_tensors(
        cfg, prefix, expert_names=EXPERT_NAMES
    )


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=MixtralConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        # transformers 5's in-memory names (its state dict): the MoE under `mlp.`.
        renames=((r"^((?:model\.)?layers\.\d+)\.mlp\.", r"\1.block_sparse_moe."),),
    )
)
