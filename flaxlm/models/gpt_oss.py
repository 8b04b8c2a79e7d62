"""gpt-oss (OpenAI's gpt-oss-20b and gpt-oss-120b): Llama's block with attention sinks,
alternating sliding-window and full layers, and a mixture of experts with biases and a
clamped SwiGLU.

Each attention head has a learned sink logit that joins every row's softmax and is then
dropped (`attention.AttentionSinks`); q, k, v and o carry biases; even layers see the
`sliding_window` (128) latest positions, odd ones all (`layer_types`); YaRN rope. Every
layer's MLP is a `moe.MoE`: a router with a bias choosing the top k logits, then a softmax
over them (`router='topk_softmax'`), and experts with biases whose gate is clamped above at
`swiglu_limit`, their up projection to +-limit, giving `(up + 1) * gate * sigmoid(1.702 *
gate)` (`experts.clamped_swiglu`). Follows HuggingFace's `GptOssForCausalLM`.

transformers holds each layer's experts fused with gate and up interleaved
(`mlp.experts.gate_up_proj [E, D, 2F]`, gate = `[..., ::2]`, up = `[..., 1::2]`;
`down_proj [E, F, D]`, and their biases). The Hub's files store those two weights in MXFP4
(`*_blocks` / `*_scales`), which import dequantizes (`checkpoints/mxfp4.py`); export writes
them unquantized, in the dtype of the params or the one asked for (bf16 with
`save_pretrained(..., dtype='bfloat16')`), not in MXFP4.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import numpy as np

from flaxlm.models import attention, llama, moe, qwen, qwen_moe, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import LLAVA_RENAMES, LLAVA_SKIP, HFSpec, HFTensor, linear, register_hf

MODEL_TYPES = ("gpt_oss",)
# transformers' GptOssConfig's rope when config.json names none (its default_theta too).
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
DEFAULT_THETA = 150000.0


@gin.configurable
@dataclasses.dataclass(frozen=True)
class GptOssConfig(qwen_moe.MoESizes, qwen.QwenFields, moe.MoEOptions):
    """gpt-oss hyper-parameters: QwenFields' and MoEOptions' names (the experts' width is
    `moe_intermediate_size`, HF's `intermediate_size`; `num_experts` is HF's
    `num_local_experts`); the defaults are gpt-oss-20b's. `layer_types` None alternates
    sliding-window (even) and full (odd) layers, as HF's default."""

    vocab_size: int = 201088
    hidden_size: int = 2880
    num_layers: int = 24
    num_heads: int = 64
    num_kv_heads: int | None = 8
    head_dim: int | None = 64
    intermediate_size: int = 2880  # unused: every layer is sparse (HF's is the experts')
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float = DEFAULT_THETA
    rope_scaling_type: str | None = "yarn"
    rope_scaling_factor: float = 32.0
    rope_original_max_position_embeddings: int = 4096
    rope_truncate: bool = False
    attention_bias: bool = True  # biases on q, k, v and o
    use_sliding_window: bool = True
    sliding_window: int | None = 128
    model_type: str = "gpt_oss"
    num_experts: int = 32
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 2880
    router: str = "topk_softmax"
    router_bias: bool = True
    expert_bias: bool = True
    swiglu_limit: float | None = 7.0
    swiglu_alpha: float = 1.702

    supported_model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

    def __post_init__(self) -> None:
        if self.layer_types is None:
            sliding = qwen.SLIDING if self.use_sliding_window else qwen.FULL
            kinds = tuple(sliding if i % 2 == 0 else qwen.FULL for i in range(self.num_layers))
            object.__setattr__(self, "layer_types", kinds)
        super().__post_init__()
        self.check_moe()
        attention.check_implementation(self.attention, sinks=True)
        if self.router != "topk_softmax":
            raise ValueError(
                f"router {self.router!r}: gpt-oss chooses the top k logits, then softmaxes "
                "them; set router='topk_softmax'."
            )
        if self.swiglu_limit is None:
            raise ValueError("gpt-oss's experts clamp their SwiGLU: set swiglu_limit (7.0).")
        if not (self.router_bias and self.expert_bias):
            raise ValueError(
                "gpt-oss's router and experts have biases (HF's always do): set "
                "router_bias=True and expert_bias=True."
            )
        if (
            self.shared_expert_intermediate_size
            or self.n_shared_experts
            or not all(self.sparse_layers(self.num_layers))
        ):
            raise ValueError(
                "gpt-oss has no shared expert and no dense layers: set "
                "shared_expert_intermediate_size=0, n_shared_experts=0, decoder_sparse_step=1, "
                "mlp_only_layers=()."
            )

    def attention_params(self) -> int:
        """q, k, v, o, their biases and one sink per head."""
        e, d = self.hidden_size, self.dim_per_head
        q, kv = self.num_heads * d, self.kv_heads * d
        bias = q + 2 * kv + e if self.attention_bias else 0
        return e * (q + 2 * kv) + q * e + bias + self.num_heads

    def make_module(self) -> GptOss:
        return GptOss(self)


class GptOssBlock(qwen_moe.QwenMoeBlock):
    """Qwen-MoE's block (Llama's, the experts as its feed-forward) whose attention has
    sinks."""

    def attention_options(self) -> dict[str, Any]:
        return {**super().attention_options(), "sinks": True}


class GptOss(qwen_moe.QwenMoe):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = GptOssBlock


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides: Any) -> GptOssConfig:
    """A GptOssConfig from a gpt-oss config.json dict (+ field overrides). A config.json
    without rope parameters gets transformers' default (YaRN, factor 32, over 4096)."""
    hf = {"rope_theta": DEFAULT_THETA, **hf}
    if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
        hf["rope_parameters"] = dict(DEFAULT_ROPE)
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if window is None and layer_types is not None:  # HF windows no layer then
        layer_types = [qwen.FULL] * len(layer_types)
    kwargs = dict(
        llama.shared_fields_from_hf(hf, rms_norm_eps=1e-5),
        head_dim=hf.get("head_dim"),
        attention_bias=hf.get("attention_bias", True),
        use_sliding_window=window is not None,
        sliding_window=window,
        layer_types=tuple(layer_types) if layer_types is not None else None,
        num_experts=hf.get("num_local_experts", hf.get("num_experts")),
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["intermediate_size"],
        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        **rope.from_hf(hf),
    )
    kwargs.update(overrides)
    return GptOssConfig(**kwargs)


def config_to_hf(cfg: GptOssConfig) -> dict:
    """config.json as transformers' GptOssConfig writes it; no `quantization_config`: the
    experts are written unquantized."""
    return {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "intermediate_size": cfg.moe_intermediate_size,
        "head_dim": cfg.dim_per_head,
        "rope_parameters": rope.to_hf(cfg),
        "sliding_window": cfg.sliding_window if cfg.use_sliding_window else None,
        "layer_types": list(cfg.attention_layer_types),
        "attention_bias": cfg.attention_bias,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "swiglu_limit": cfg.swiglu_limit,
        "swiglu_alpha": cfg.swiglu_alpha,
    }


def wi_from_hf(gate_up: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`experts.gate_up_proj` `[experts, embed, 2 * mlp]`, gate and up interleaved ->
    `experts/wi` `[experts, embed, 2, mlp]`."""
    e, d, _, f = shape
    return gate_up.reshape(e, d, f, 2).transpose(0, 1, 3, 2)


def wi_to_hf(wi: np.ndarray) -> np.ndarray:
    e, d, _, f = wi.shape
    return wi.transpose(0, 1, 3, 2).reshape(e, d, 2 * f)


def bi_from_hf(bias: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`experts.gate_up_proj_bias` `[experts, 2 * mlp]` (interleaved) -> `experts/bi`
    `[experts, 2, mlp]`."""
    e, _, f = shape
    return bias.reshape(e, f, 2).transpose(0, 2, 1)


def bi_to_hf(bi: np.ndarray) -> np.ndarray:
    e, _, f = bi.shape
    return bi.transpose(0, 2, 1).reshape(e, 2 * f)


def as_is(array: np.ndarray, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """A tensor whose layout is the param's (`down_proj [E, F, D]`, its bias `[E, D]`)."""
    return array if shape is None else array.reshape(shape)


def hf_tensors(cfg: GptOssConfig) -> list[HFTensor]:
    """Llama's attention (with its biases) and norms, each head's sink, each layer's router
    (and its bias) and experts (fused, with their biases)."""
    n, mlp = cfg.num_layers, "model.layers.{i}.mlp"

    def experts(param: str, hf: str, to_flax: Any, to_hf: Any) -> HFTensor:
        return HFTensor(
            f"layers_{{i}}/mlp/experts/{param}",
            f"{mlp}.experts.{hf}",
            layers=n,
            to_flax=to_flax,
            to_hf=to_hf,
        )

    return llama.hf_tensors_but_mlp(cfg) + [
        HFTensor("layers_{i}/sinks/logits", "model.layers.{i}.self_attn.sinks", layers=n),
        linear("layers_{i}/mlp/gate/kernel", f"{mlp}.router.weight", layers=n),
        HFTensor("layers_{i}/mlp/gate/bias", f"{mlp}.router.bias", layers=n),
        experts("wi", "gate_up_proj", wi_from_hf, wi_to_hf),
        experts("bi", "gate_up_proj_bias", bi_from_hf, bi_to_hf),
        experts("wo", "down_proj", as_is, as_is),
        experts("bo", "down_proj_bias", as_is, as_is),
    ]


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=GptOssConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        # InternVL 3.5's gpt-oss files (`internvl`, registered by qwen.py), in llava's layout.
        renames=LLAVA_RENAMES,
        skip=LLAVA_SKIP,
    )
)
