"""Mistral 4 (`mistral4`, Mistral Small 4): DeepSeek-V3's block (multi-head latent attention,
`mla.py`, and a mixture of experts with shared experts) with softmax routing and queries
scaled by position.

What differs from `deepseek.py`: the router takes a softmax over the experts (no correction
bias), still limited to the `topk_group` best of `n_group` groups (a group rated by its two
best scores), the chosen scores renormalised with `norm_topk_prob` and scaled by
`routed_scaling_factor`; each query is multiplied by Llama 4's attention scale `1 +
llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings))` after
rotary (HF's `get_llama_4_attn_scale`); and the rotary width is HF's `int(head_dim *
partial_rotary_factor)` with `head_dim = qk_nope_head_dim + qk_rope_head_dim` (the
`qk_rope_head_dim` of the default factor). The rope is YaRN in the published files, with the
softmax scale times mscale(factor, mscale_all_dim) squared as DeepSeek-V3's; 'llama3' and
'linear' read too. Follows HuggingFace's `Mistral4ForCausalLM`.

Refused (a ValueError naming the setting, where HF's model fails or flaxlm cannot run it):
rope type 'default' (HF rotates every qk feature but applies that to the rotary part only),
no `llama_4_scaling_beta`, a 'linear' rope without `original_max_position_embeddings`, a
rotary width whose frequencies do not fit `qk_rope_head_dim`, groups of one expert (HF rates
a group by its best two), `num_key_value_heads` != `num_attention_heads`, quantized files
other than block FP8.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import jax

from flaxlm.models import deepseek, llama, masks, mla, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import LLAVA_RENAMES, LLAVA_SKIP, HFSpec, HFTensor, register_hf

Array = jax.Array

MODEL_TYPES = ("mistral4",)
ROPE_TYPES = ("yarn", "llama3", "linear")  # 'default' fails in HF's Mistral 4 (above)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Mistral4Config(deepseek.DeepseekV3Config):
    """Mistral 4 hyper-parameters: DeepSeek-V3's fields (HF's names where they exist) and
    the two Mistral 4 adds; the defaults are Mistral Small 4's (119B, transformers'
    `Mistral4Config` defaults)."""

    vocab_size: int = 131072
    hidden_size: int = 4096
    num_layers: int = 36
    num_heads: int = 32
    intermediate_size: int = 12288  # the dense first layers' MLP (first_k_dense_replace)
    max_position_embeddings: int = 1048576
    q_lora_rank: int | None = 1024
    kv_lora_rank: int = 256
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_experts: int = 128  # HF: n_routed_experts
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 2048
    router: str = "softmax_topk"  # HF's Mistral4TopkRouter: a softmax over the experts
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 1
    # HF's Mistral4ForCausalLM adds no load-balancing loss; set this to train with one.
    router_aux_loss_coef: float = 0.0
    mlp_only_layers: tuple[int, ...] = ()  # HF: first_k_dense_replace = 0
    rope_scaling_factor: float = 128.0
    rope_original_max_position_embeddings: int = 8192
    # Each query times 1 + beta * log(1 + floor(position / rope_original_max_position_
    # embeddings)): 1 within the original context, growing by steps of it.
    llama_4_scaling_beta: float = 0.1
    mtp_layers_built: ClassVar[bool] = False  # (Mistral 4's files carry none)
    # The rotated share of qk_nope_head_dim + qk_rope_head_dim (None: HF's default,
    # qk_rope_head_dim of it); HF rotates int(that product) features.
    partial_rotary_factor: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.router != "softmax_topk" or self.score_correction_bias:
            raise ValueError(
                f"router {self.router!r} / score_correction_bias {self.score_correction_bias}: "
                "HF's Mistral 4 routes by a softmax over the experts ('softmax_topk') with no "
                "correction bias."
            )
        if self.num_experts // self.n_group < 2:
            raise ValueError(
                f"n_group {self.n_group} leaves {self.num_experts // self.n_group} expert a "
                "group: HF's Mistral 4 rates each group by its two best scores (at least 2)."
            )
        if self.rope_scaling_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling_type {self.rope_scaling_type!r}: HF's Mistral 4 runs with "
                f"{ROPE_TYPES} ('default' rotates the whole qk head, wider than its rotary "
                "part, and fails)."
            )
        if self.rope_original_max_position_embeddings < 1:
            raise ValueError(
                f"rope_original_max_position_embeddings "
                f"{self.rope_original_max_position_embeddings} must be positive (the query "
                "scale's step)."
            )
        dim, rope_dim = self.rotary_dim, self.qk_rope_head_dim
        # HF takes frequencies 0, 2, ... < dim; YaRN's ramp has dim // 2 of them.
        fits = dim >= 1 and (dim + 1) // 2 == rope_dim // 2
        if not fits or (self.rope_scaling_type == "yarn" and dim != rope_dim):
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} rotates {dim} of the "
                f"{self.qk_nope_head_dim + rope_dim} qk features: HF's Mistral 4 runs only "
                f"when that gives the {rope_dim // 2} frequencies of qk_rope_head_dim "
                f"{rope_dim} (YaRN: exactly {rope_dim} features)."
            )

    @property
    def rotary_dim(self) -> int:
        """HF's rotary width: `int(head_dim * partial_rotary_factor)`, the frequencies'
        denominator (`rope.inv_freq`)."""
        head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        factor = self.partial_rotary_factor
        if factor is None:
            factor = self.qk_rope_head_dim / head_dim
        return int(head_dim * factor)

    @property
    def dim_per_head(self) -> int:
        """The width `rope.sin_cos` builds its frequencies over (`rotary_dim`)."""
        return self.rotary_dim

    def make_module(self) -> Mistral4:
        return Mistral4(self)


class Mistral4Block(deepseek.DeepseekBlock):
    """DeepSeek-V3's block whose latent attention scales its queries by position."""

    def self_attention(
        self,
        h: Array,
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
        scale: Array,
    ) -> Array:
        return mla.MultiHeadLatentAttention(self.config, name="self_attn")(
            h, sin, cos, mask, decoding, query_scale=scale
        )


class Mistral4(deepseek.Deepseek):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = Mistral4Block

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, Array, Array]]:
        x, (sin, cos) = super().block_inputs(x, positions, decoding)
        return x, (sin, cos, rope.llama4_query_scale(positions, self.config))


# ------------------------------------------------------------------ HuggingFace

# transformers' Mistral4Config defaults, for keys a config.json omits.
HF_DEFAULTS = dict(
    q_lora_rank=1024,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=128,
    num_experts_per_tok=4,
    moe_intermediate_size=2048,
    n_shared_experts=1,
    routed_scaling_factor=1.0,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=0,
    norm_topk_prob=True,
    rope_interleave=True,
    attention_bias=False,
)
# Keys HF's model cannot run without (a null one fails there): refused by name.
HF_REQUIRED = (
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
    "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group",
    "first_k_dense_replace",
)  # fmt: skip


def hf_default_rope() -> dict[str, Any]:
    """The `rope_parameters` transformers' Mistral4Config sets when config.json has none."""
    return dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=128.0,
        original_max_position_embeddings=8192,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale_all_dim=1.0,
        mscale=1.0,
        llama_4_scaling_beta=0.1,
    )


def config_from_hf(hf: dict, **overrides: Any) -> Mistral4Config:
    """A Mistral4Config from a Mistral 4 config.json dict (+ field overrides)."""
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        raise ValueError(
            f"num_key_value_heads {hf['num_key_value_heads']} != num_attention_heads {heads}: "
            "latent attention expands keys and values for every query head (HF's Mistral 4 "
            "fails otherwise)."
        )
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "fp8"):
        raise ValueError(
            f"config.json's quantization_config quant_method is {quant!r}: flaxlm reads "
            "Mistral 4 files unquantized or in block FP8 ('fp8', dequantized on import); "
            "load an unquantized copy."
        )
    for key in HF_REQUIRED:
        if key in hf and hf[key] is None:
            raise ValueError(f"{key} is null in config.json: HF's Mistral 4 needs a number.")
    get = lambda key: hf.get(key, HF_DEFAULTS[key])  # noqa: E731
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or hf_default_rope())
    kwargs = dict(
        llama.shared_fields_from_hf(hf),
        q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
        rope_interleave=bool(get("rope_interleave")),  # HF tests its truth
        attention_bias=bool(get("attention_bias")),
        num_experts=hf.get("n_routed_experts", hf.get("num_local_experts", 128)),
        num_experts_per_tok=get("num_experts_per_tok"),
        moe_intermediate_size=get("moe_intermediate_size"),
        norm_topk_prob=bool(get("norm_topk_prob")),
        routed_scaling_factor=float(get("routed_scaling_factor")),
        n_group=get("n_group"),
        topk_group=get("topk_group"),
        n_shared_experts=get("n_shared_experts"),
        mlp_only_layers=tuple(range(get("first_k_dense_replace"))),
        **rope_from_hf(hf, params),
    )
    del kwargs["num_kv_heads"]  # latent attention: every head has its own (checked above)
    kwargs.update(overrides)
    return Mistral4Config(**kwargs)


def rope_from_hf(hf: dict, params: dict[str, Any]) -> dict[str, Any]:
    """The rope fields, `llama_4_scaling_beta` and `partial_rotary_factor` from
    `rope_parameters`, as transformers standardises them (YaRN's and llama3's original
    context from there; a 'linear' one must name it for the query scale)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        raise ValueError(
            "rope_parameters rope_type 'default': HF's Mistral 4 then rotates every qk "
            "feature but applies that to the rotary ones only, and fails; flaxlm reads "
            f"{ROPE_TYPES}."
        )
    beta = params.get("llama_4_scaling_beta")
    if beta is None:
        raise ValueError(
            "rope_parameters has no llama_4_scaling_beta: HF's Mistral 4 scales every query "
            "by it (and fails without it)."
        )
    out = deepseek.rope_from_hf({**hf, "rope_parameters": params, "rope_scaling": None})
    if kind == "linear":
        original = params.get("original_max_position_embeddings")
        if original is None:
            raise ValueError(
                "rope_parameters of rope_type 'linear' has no original_max_position_embeddings:"
                " HF's Mistral 4 scales its queries by steps of it (and fails without it)."
            )
        out["rope_original_max_position_embeddings"] = int(original)
    if kind != "yarn" and params.get("mscale_all_dim"):
        # HF's softmax scale reads it under any scaled rope (mla.softmax_scale).
        out["rope_mscale_all_dim"] = float(params["mscale_all_dim"])
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    out.update(
        llama_4_scaling_beta=float(beta),
        partial_rotary_factor=None if factor is None else float(factor),
    )
    return out


def config_to_hf(cfg: Mistral4Config) -> dict:
    params = rope.to_hf(cfg)
    head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    params.update(
        original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
        llama_4_scaling_beta=cfg.llama_4_scaling_beta,
        partial_rotary_factor=(
            cfg.qk_rope_head_dim / head_dim
            if cfg.partial_rotary_factor is None
            else cfg.partial_rotary_factor
        ),
    )
    if cfg.rope_scaling_type != "yarn" and cfg.rope_mscale_all_dim:
        params["mscale_all_dim"] = cfg.rope_mscale_all_dim
    return {
        "model_type": "mistral4",
        "architectures": ["Mistral4ForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "num_key_value_heads": cfg.num_heads,
        "rope_parameters": params,
        "rope_interleave": cfg.rope_interleave,
        "attention_bias": cfg.attention_bias,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "n_shared_experts": cfg.n_shared_experts,
        "first_k_dense_replace": cfg.first_k_dense_replace,
    }


def hf_tensors(cfg: Mistral4Config) -> list[HFTensor]:
    """DeepSeek-V3's table (`deepseek.hf_tensors`; no correction bias), the experts fused
    both ways: transformers keeps Mistral 4's `experts.gate_up_proj` / `down_proj` as they
    are in memory (no per-expert conversion, which DeepSeek-V3's files have)."""
    return [
        dataclasses.replace(t, pieces=(), experts=0) if t.pieces else t
        for t in deepseek.hf_tensors(cfg)
    ]


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=Mistral4Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        # With n_shared_experts = 0 transformers still saves the shared experts' Linears,
        # 0 features wide (they add nothing): no param holds them.
        ignore=(*llama.HF_SPEC.ignore, r"\.mlp\.shared_experts\.(gate|up|down)_proj\.weight$"),
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        # Mistral Small 4's files: Mistral 3 multimodal ones in the llava layout
        # (`llama.MISTRAL3` registers the file type, 'mistral' where a text_config names none).
        renames=LLAVA_RENAMES,
        skip=LLAVA_SKIP,
    )
)
