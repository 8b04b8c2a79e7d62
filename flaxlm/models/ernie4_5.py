"""ERNIE 4.5 (`ernie4_5`: ERNIE-4.5-0.3B; `ernie4_5_moe`: ERNIE-4.5-21B-A3B and 300B-A47B):
Llama's block with rotary over interleaved pairs of features, and in the MoE a softmax router.

What differs from Llama (`llama.py`): the rotary rotates pairs (0, 1), (2, 3), ... of each
head, in float32 (HF's GLM-style `rotate_half`). The MoE's layers from
`moe_layer_start_index` to `moe_layer_end_index`, every `moe_layer_interval`-th, are a
mixture of `moe_num_experts` (`moe_k` a token): a float32 softmax over the experts, the top k
chosen by it plus a per-expert bias (`moe_statics.e_score_correction_bias`, the choice only),
their probabilities renormalised, plus `moe_num_shared_experts` x `moe_intermediate_size`
ungated shared experts; the other layers a dense SwiGLU of `intermediate_size`. The dense
model's heads are `head_dim` wide (128 by default), the MoE's width / heads. Both tie their
head by default. Follows HuggingFace's `Ernie4_5ForCausalLM` and `Ernie4_5_MoeForCausalLM`.

Refused (a ValueError naming the setting): `use_bias` (biases on every projection and, in the
MoE, the head: the published files have none, and flaxlm's experts and head carry none); MoE
layers no (start, end, interval) gives back on export.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import jax
import numpy as np

from flaxlm.models import deepseek, llama, qwen_moe, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, register_hf

Array = jax.Array

DENSE, MOE = "ernie4_5", "ernie4_5_moe"
# transformers' Ernie4_5Config / Ernie4_5_MoeConfig defaults, for keys a config.json omits
# (alike but for the sizes and the MoE's).
SHARED_DEFAULTS = dict(
    vocab_size=103424,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)
HF_DEFAULTS = {
    DENSE: dict(
        SHARED_DEFAULTS,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=18,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
    ),
    MOE: dict(
        SHARED_DEFAULTS,
        hidden_size=2560,
        intermediate_size=12288,
        num_hidden_layers=28,
        num_attention_heads=20,
        num_key_value_heads=4,
        moe_intermediate_size=1536,
        moe_k=6,
        moe_num_experts=64,
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        moe_layer_end_index=-1,
        moe_layer_interval=1,
        router_aux_loss_coef=0.001,
    ),
}


class InterleavedRotary:
    """A block whose attention rotates interleaved pairs of features (`attention_options`)."""

    def attention_options(self) -> dict[str, Any]:
        return {**super().attention_options(), "rotary_interleaved": True}


class ErnieBlock(InterleavedRotary, llama.LlamaBlock):
    """Llama's block, interleaved rotary."""


class ErnieMoeBlock(InterleavedRotary, qwen_moe.QwenMoeBlock):
    """The MoE block (a dense SwiGLU off the MoE layers), interleaved rotary."""


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Ernie45Config(llama.LlamaConfig):
    """ERNIE 4.5 (dense) hyper-parameters: LlamaConfig's; the defaults are ERNIE-4.5-0.3B's."""

    model_types: ClassVar[tuple[str, ...]] = (DENSE,)
    vocab_size: int = 103424
    hidden_size: int = 1024
    num_layers: int = 18
    num_heads: int = 16
    num_kv_heads: int | None = 2
    head_dim: int | None = 128
    intermediate_size: int = 3072
    max_position_embeddings: int = 131072
    rope_theta: float = 500000.0
    tie_word_embeddings: bool = True
    model_type: str = DENSE

    def make_module(self) -> Ernie:
        return Ernie(self)


class Ernie(llama.Llama):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = ErnieBlock


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Ernie45MoeConfig(qwen_moe.QwenMoeConfig):
    """ERNIE 4.5 MoE hyper-parameters (QwenMoeConfig's fields: the MoE layers are the ones
    `mlp_only_layers` leaves out, `score_correction_bias` the choice's bias); the defaults
    are ERNIE-4.5-21B-A3B's."""

    supported_model_types: ClassVar[tuple[str, ...]] = (MOE,)
    vocab_size: int = 103424
    hidden_size: int = 2560
    num_layers: int = 28
    num_heads: int = 20
    num_kv_heads: int | None = 4
    head_dim: int | None = None
    intermediate_size: int = 12288
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_word_embeddings: bool = True
    num_experts: int = 64
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 1536
    norm_topk_prob: bool = True
    score_correction_bias: bool = True
    n_shared_experts: int = 2
    mlp_only_layers: tuple[int, ...] = (0,)
    model_type: str = MOE

    def make_module(self) -> ErnieMoe:
        return ErnieMoe(self)


class ErnieMoe(qwen_moe.QwenMoe):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = ErnieMoeBlock


# ------------------------------------------------------------------ HuggingFace


def moe_layers(start: int, end: int, interval: int, layers: int) -> tuple[bool, ...]:
    """Whether each layer is a mixture of experts, as HF's decoder layer decides."""
    end = layers - 1 if end == -1 else end
    return tuple((i + 1) % interval == 0 and start <= i <= end for i in range(layers))


def config_from_hf(hf: dict, **overrides: Any) -> Ernie45Config | Ernie45MoeConfig:
    """The config of an `ernie4_5` or `ernie4_5_moe` config.json dict (+ field overrides),
    fields it leaves out at transformers' defaults."""
    kind = hf["model_type"]
    hf = {**HF_DEFAULTS[kind], **hf}
    if hf.get("use_bias"):
        raise ValueError(
            "use_bias=True: flaxlm reads ERNIE 4.5 files without biases (the published ones; "
            "its experts and head carry none)."
        )
    fields = dict(llama.shared_fields_from_hf(hf, rms_norm_eps=1e-5), **rope.from_hf(hf))
    if kind == DENSE:
        return Ernie45Config(**{**fields, "head_dim": hf["head_dim"], **overrides})
    layers = hf["num_hidden_layers"]
    sparse = moe_layers(
        hf["moe_layer_start_index"], hf["moe_layer_end_index"], hf["moe_layer_interval"], layers
    )
    fields.update(
        head_dim=hf.get("head_dim"),
        num_experts=hf.get("moe_num_experts", hf.get("num_experts")),
        num_experts_per_tok=hf.get("moe_k", hf.get("num_experts_per_tok")),
        moe_intermediate_size=hf["moe_intermediate_size"],
        n_shared_experts=hf["moe_num_shared_experts"],
        mlp_only_layers=tuple(i for i, s in enumerate(sparse) if not s),
        router_aux_loss_coef=hf["router_aux_loss_coef"],
    )
    return Ernie45MoeConfig(**{**fields, **overrides})


def layer_pattern(cfg: Ernie45MoeConfig) -> dict[str, int]:
    """`moe_layer_start_index`, `_end_index` and `_interval` giving `cfg`'s MoE layers, or a
    ValueError where none does."""
    sparse = cfg.sparse_layers(cfg.num_layers)
    ids = [i for i, s in enumerate(sparse) if s]
    for interval in range(1, cfg.num_layers + 1):
        start = ids[0] if ids else cfg.num_layers
        end = ids[-1] if ids else -1
        if moe_layers(start, end, interval, cfg.num_layers) == sparse:
            return dict(
                moe_layer_start_index=start, moe_layer_end_index=end, moe_layer_interval=interval
            )
    raise ValueError(
        f"MoE layers {ids}: no moe_layer_start_index / _end_index / _interval gives them "
        "(HF's ERNIE 4.5 MoE places its MoE layers so)."
    )


def config_to_hf(cfg: Ernie45Config | Ernie45MoeConfig) -> dict:
    out = {
        "model_type": cfg.model_type,
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "rope_parameters": rope.to_hf(cfg),
        "use_bias": False,
    }
    if cfg.model_type == DENSE:
        return {**out, "architectures": ["Ernie4_5ForCausalLM"]}
    return {
        **out,
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "moe_num_experts": cfg.num_experts,
        "moe_k": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "moe_num_shared_experts": cfg.n_shared_experts,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        **layer_pattern(cfg),
    }


def dense_hf_tensors(cfg: Ernie45Config) -> list[HFTensor]:
    return llama.hf_tensors(cfg)


def moe_hf_tensors(cfg: Ernie45MoeConfig) -> list[HFTensor]:
    """Llama's attention and norms, then DeepSeek-V3's MLP records (router, experts, shared
    experts), the choice's bias as HF holds it, `[1, experts]` under `gate.moe_statics`."""
    table = llama.hf_tensors_but_mlp(cfg) + deepseek.moe_hf_tensors(cfg)
    bias = "layers_{i}/mlp/e_score_correction_bias"
    return [
        dataclasses.replace(
            t,
            hf="model.layers.{i}.mlp.gate.moe_statics.e_score_correction_bias",
            to_hf=lambda a: np.reshape(a, (1, -1)),
            to_flax=lambda a, shape: np.reshape(a, shape),
        )
        if t.param == bias
        else t
        for t in table
    ]


DENSE_SPEC = register_hf(
    HFSpec(
        model_types=(DENSE,),
        config_cls=Ernie45Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=dense_hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        tied_head=llama.HF_SPEC.tied_head,
    )
)
MOE_SPEC = register_hf(
    HFSpec(
        model_types=(MOE,),
        config_cls=Ernie45MoeConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=moe_hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        # The Hub's files hold the choice's bias under the MoE block, not its router.
        renames=((r"\.mlp\.moe_statics\.", ".mlp.gate.moe_statics."),),
    )
)
