"""Hunyuan V1 (`hunyuan_v1_dense`: Tencent's Hunyuan-0.5B ... 7B; `hunyuan_v1_moe`:
Hunyuan-A13B): Llama's pre-normalised block whose query and key heads are RMS-normalised
after rotary, and for the MoE a softmax-routed mixture of experts beside a shared MLP.

Attention is grouped-query with biases on q, k, v and o (`attention_bias`), rotary over whole
heads (half-split pairs), then each query and key head RMS-normalised (`query_layernorm`,
`key_layernorm`, over `head_dim`): after rotary, where Qwen3 normalises before it (the
norm's scale is not rotation-invariant, so the order matters). The rotary is the Hub's
'dynamic' dict with an `alpha`: transformers' NTK-alpha rope (`ntk_alpha`), a fixed base of
`rope_theta * alpha ** (head_dim / (head_dim - 2))` whatever the sequence length
(`rope_alpha` here); or 'default', 'linear', 'llama3', 'yarn' as `olmo2.flat_rope_from_hf`
reads them (`rope_scaling` before `rope_parameters`). The MLP is a SwiGLU of
`intermediate_size` (no biases, whatever `mlp_bias` says, as HF); in the MoE every layer is a
`moe.MoE`: a float32 softmax over `num_experts` router logits (`mlp.gate.wg`), the top
`moe_topk` renormalised, the experts and one ungated shared MLP (`mlp.shared_mlp`) all
`intermediate_size` wide. Follows HuggingFace's `HunYuanDenseV1ForCausalLM` and
`HunYuanMoEV1ForCausalLM`.

Refused, naming the setting (where transformers fails, or the file is not the model
transformers builds): a `head_dim` missing or null (HF's attention then fails), 'dynamic'
rope without `alpha` (NTK scaling by the sequence length) or without `factor` (HF's rope
check fails), other rope types flaxlm lacks, a `partial_rotary_factor` other than 1 with a
scaled rope (HF fails; its default and NTK-alpha ropes ignore it, and so does flaxlm), a
`num_experts` list (HF's config takes an int), `moe_topk` differing between layers or
shorter than the layers, and keys HF ignores that describe another model (`use_qk_norm`
false, `use_rotary_pos_emb` false, `use_cla` true, `use_mixed_mlp_moe` false,
`moe_layer_num_skipped`, `kv_lora_rank`, a `norm_type` other than 'rms', a
`num_shared_expert` other than 1, a `moe_intermediate_size` or `attention_head_dim` unlike
`intermediate_size` / `head_dim`). `eod_token_id`, `sep_token_id` and `pretraining_tp` are
ignored, as HF ignores them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from flaxlm.models import (
    attention,
    exaone_moe,
    glm4_moe,
    layers,
    llama,
    masks,
    moe,
    olmo2,
    paged_attention,
    qwen,
    qwen_moe,
    rope,
)
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, linear, register_hf
from flaxlm.models.options import HeadShapes

Array = jax.Array

DENSE, MOE = "hunyuan_v1_dense", "hunyuan_v1_moe"
ARCHITECTURES = {DENSE: "HunYuanDenseV1ForCausalLM", MOE: "HunYuanMoEV1ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class HunyuanFields(HeadShapes, rope.RopeScaling):
    """Hunyuan V1 hyper-parameters both models share (HF's names where they exist); the
    defaults are Hunyuan-7B-Instruct's."""

    vocab_size: int = 128256  # 128167 padded to a multiple of 128
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 4096
    num_layers: int = 32  # HF: num_hidden_layers
    num_heads: int = 32  # HF: num_attention_heads
    num_kv_heads: int | None = 8  # HF: num_key_value_heads; None: num_heads
    head_dim: int | None = 128  # None: hidden_size // num_heads (HF needs it in config.json)
    intermediate_size: int = 14336
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF's 'dynamic' rope with an `alpha` (its `ntk_alpha`): the base becomes rope_theta *
    # alpha ** (d / (d - 2)), fixed; None: `rope_scaling_type` says.
    rope_alpha: float | None = 1000.0
    attention_bias: bool = False  # biases on q, k, v and o
    tie_word_embeddings: bool = True
    activation: str = "silu"  # HF: hidden_act

    # What llama.LlamaBlock, qwen.Qwen and the counts read beside the fields.
    mlp_bias: ClassVar[bool] = False
    norm_scale_plus_one: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = True  # per head, after rotary (this module's attention)
    model_type: ClassVar[str] = DENSE

    def __post_init__(self) -> None:
        super().__post_init__()
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
        alpha = self.rope_alpha
        if alpha is not None and (not alpha > 0 or self.rope_scaling_type is not None):
            raise ValueError(
                f"rope_alpha {alpha}: HF's NTK-alpha rope takes a positive alpha and no other "
                f"scaling (rope_scaling_type {self.rope_scaling_type!r}); set one of them."
            )
        if alpha is not None and self.dim_per_head <= 2:
            raise ValueError(
                f"head_dim {self.dim_per_head}: the NTK-alpha base is alpha ** (head_dim / "
                "(head_dim - 2)); it needs head_dim > 2."
            )

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def layer_windows(self) -> tuple[None, ...]:
        return (None,) * self.num_layers

    def attention_params(self) -> int:
        """One block's attention: q, k, v, o, their biases, the per-head q/k norms."""
        e, d = self.hidden_size, self.dim_per_head
        q, kv = self.num_heads * d, self.kv_heads * d
        bias = q + 2 * kv + e if self.attention_bias else 0
        return e * (q + 2 * kv) + q * e + bias + 2 * d


@gin.configurable
@dataclasses.dataclass(frozen=True)
class HunyuanDenseConfig(HunyuanFields):
    """Hunyuan V1 dense (`hunyuan_v1_dense`): `HunyuanFields`, Hunyuan-7B-Instruct's shapes."""

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates)."""
        e, v = self.hidden_size, self.vocab_size
        block = self.attention_params() + 3 * e * self.intermediate_size + 2 * e
        head = 0 if self.tie_word_embeddings else v * e
        return v * e + self.num_layers * block + e + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus the attention scores."""
        context = 12.0 * self.num_layers * self.num_heads * self.dim_per_head * seq_len
        return 6.0 * llama.matmul_params(self) + context

    def make_module(self) -> Hunyuan:
        return Hunyuan(self)


# HF's HunYuanMoEV1Moe: what it hard-wires (a softmax router renormalising its top k, one
# ungated shared MLP, every layer sparse).
FIXED: dict[str, Any] = dict(
    router="softmax_topk",
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    score_correction_bias=False,
    n_group=1,
    topk_group=1,
    shared_expert_intermediate_size=0,
    n_shared_experts=1,
    decoder_sparse_step=1,
    mlp_only_layers=(),
    router_bias=False,
    expert_bias=False,
    swiglu_limit=None,
    router_scales_input=False,
    per_expert_scale=False,
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class HunyuanMoeConfig(qwen_moe.MoESizes, HunyuanFields, moe.MoEOptions):
    """Hunyuan V1 MoE (`hunyuan_v1_moe`): `HunyuanFields` and MoEOptions' fields (HF's
    `moe_topk` is `num_experts_per_tok`); the experts and the shared MLP are
    `intermediate_size` wide (`moe_intermediate_size` None: the same; another width is
    refused). The defaults are Hunyuan-A13B's."""

    vocab_size: int = 128256  # 128167 padded to a multiple of 128
    intermediate_size: int = 3072
    max_position_embeddings: int = 32768
    num_experts: int = 64
    num_experts_per_tok: int = 8  # HF: moe_topk
    moe_intermediate_size: int | None = None
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    n_shared_experts: int = 1  # HF's shared_mlp

    model_type: ClassVar[str] = MOE

    def __post_init__(self) -> None:
        if self.moe_intermediate_size is None:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        super().__post_init__()
        self.check_moe()
        glm4_moe.check_fixed(self, FIXED, "HunYuanMoEV1ForCausalLM")
        if self.moe_intermediate_size != self.intermediate_size:
            raise ValueError(
                f"moe_intermediate_size {self.moe_intermediate_size}: HF's Hunyuan MoE experts "
                f"and shared MLP are intermediate_size ({self.intermediate_size}) wide."
            )

    def make_module(self) -> HunyuanMoe:
        return HunyuanMoe(self)


def rotary_then_norm_attention(
    cfg: Any, h: Array, mask: masks.Mask, decoding: masks.Decoding | None, sin: Array, cos: Array
) -> Array:
    """Hunyuan's attention, built in the calling block's scope (`q_proj`, `k_proj`, `v_proj`,
    `query_layernorm`, `key_layernorm`, `cache`, `o_proj`): grouped-query heads rotated, then
    each query and key head RMS-normalised; the keys cached as normalised."""
    dtype, d = cfg.dtype, cfg.dim_per_head
    dense = dict(dtype=dtype, param_dtype=cfg.param_dtype, use_bias=cfg.attention_bias)
    kv_axis = layers.kv_heads_axis(cfg.kv_heads)
    kv_axes = ("batch", "length", kv_axis, "head_dim")
    q, k, v = layers.qkv_projections(h, cfg.num_heads, cfg.kv_heads, d, **dense)
    norm = dict(
        epsilon=cfg.rms_norm_eps, axes=("head_dim",), dtype=dtype, param_dtype=cfg.param_dtype
    )
    q = attention.apply_rotary(q, sin, cos, interleaved=False)
    q = layers.constrain(layers.RMSNorm(name="query_layernorm", **norm)(q), layers.HEAD_AXES)
    k = attention.apply_rotary(k, sin, cos, interleaved=False)
    k = layers.constrain(layers.RMSNorm(name="key_layernorm", **norm)(k), kv_axes)
    if paged_attention.use_kernel(decoding, q):
        pools = attention.KVCache(kv_axes, name="cache")(k, v, decoding, pools=True)
        out = paged_attention.kernel_attention(q, *pools, decoding, dtype=dtype)
    else:
        k, v = attention.KVCache(kv_axes, name="cache")(k, v, decoding)
        out = attention.dot_product_attention(
            q, k, v, mask, dtype=dtype, implementation=cfg.attention,
            chunk_size=cfg.attention_chunk_size, context_parallel=cfg.context_parallel,
        )  # fmt: skip
    out = layers.DenseGeneral(
        cfg.hidden_size,
        ("heads", "head_dim", "embed"),
        axis=(-2, -1),
        use_bias=cfg.attention_bias,
        name="o_proj",
        dtype=dtype,
        param_dtype=cfg.param_dtype,
    )(out)
    return checkpoint_name(out, "attn_out")


class HunyuanAttention:
    """The blocks' attention (a mixin before the block class): rotary, then q/k norms."""

    def self_attention(
        self,
        h: Array,
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
    ) -> Array:
        return rotary_then_norm_attention(self.config, h, mask, decoding, sin, cos)


class HunyuanBlock(HunyuanAttention, llama.LlamaBlock):
    """Llama's pre-normalised block with Hunyuan's attention and a SwiGLU."""


class HunyuanMoeBlock(HunyuanAttention, qwen_moe.QwenMoeBlock):
    """Llama's pre-normalised block with Hunyuan's attention and the mixture of experts."""


def ntk_alpha_inv_freq(cfg: Any) -> np.ndarray:
    """float32 inverse frequencies of HF's NTK-alpha rope: those of the base
    `rope_theta * rope_alpha ** (d / (d - 2))` (a Python float, as HF computes it)."""
    d = cfg.dim_per_head
    return attention.rotary_inv_freq(d, cfg.rope_theta * cfg.rope_alpha ** (d / (d - 2)))


class Hunyuan(qwen.Qwen):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = HunyuanBlock

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, Array]]:
        if self.config.rope_alpha is None:
            return x, rope.sin_cos(positions, self.config)
        return x, attention.rotary_sin_cos(positions, ntk_alpha_inv_freq(self.config))


class HunyuanMoe(Hunyuan):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = HunyuanMoeBlock


# ------------------------------------------------------------------ HuggingFace

# transformers' HunYuanDenseV1Config / HunYuanMoEV1Config defaults of the keys flaxlm reads.
HF_DEFAULTS = dict(
    vocab_size=290943,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    max_position_embeddings=2048,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
    num_experts=1,
    moe_topk=1,
)
# Keys transformers ignores, at the values of the model it builds (another value describes a
# model whose weights it would not read).
IGNORED_AS = dict(
    use_qk_norm=True,
    use_rotary_pos_emb=True,
    use_cla=False,
    use_mixed_mlp_moe=True,
    moe_layer_num_skipped=0,
    kv_lora_rank=None,
    norm_type="rms",
)


def check_ignored(hf: dict) -> None:
    """ValueError naming a key transformers ignores whose value is not its model's."""
    per_layer = dict(
        num_shared_expert=1,
        moe_intermediate_size=hf["intermediate_size"],
        attention_head_dim=hf["head_dim"],
    )
    for key, value in {**IGNORED_AS, **per_layer}.items():
        got = hf.get(key, value)
        if any(g != value for g in (got if isinstance(got, list) else [got])):
            raise ValueError(
                f"{key} {got!r}: transformers' Hunyuan ignores it, building the model of "
                f"{key}={value!r} (a checkpoint of this one is not that model's)."
            )


def rope_from_hf(hf: dict) -> dict[str, Any]:
    """The rope fields: the Hub's 'dynamic' dict with an `alpha` as `rope_alpha` (HF's
    `ntk_alpha`), else `olmo2.flat_rope_from_hf`'s (which refuses 'dynamic' without one)."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if params.get("rope_type", params.get("type")) == "dynamic" and params.get("alpha"):
        if params.get("factor") is None:
            raise ValueError(
                f"rope_parameters {params}: HF checks a 'dynamic' dict for a factor (and "
                "fails without one), though NTK-alpha does not read it."
            )
        theta = params.get("rope_theta", hf.get("rope_theta", olmo2.DEFAULT_THETA))
        return dict(rope_theta=float(theta), rope_alpha=float(params["alpha"]))
    hf = exaone_moe.drop_unread_partial_rotary(hf)
    return dict(olmo2.flat_rope_from_hf(hf, "Hunyuan"), rope_alpha=None)


def fields_from_hf(hf: dict) -> dict[str, Any]:
    """The fields both configs read from a config.json dict (transformers' defaults where
    it is silent)."""
    hf = {**HF_DEFAULTS, **hf}
    if hf.get("head_dim") is None:
        raise ValueError(
            "head_dim is missing or null in config.json: HF's Hunyuan attention reads it "
            "(and fails on None); give it."
        )
    check_ignored(hf)
    return dict(
        llama.shared_fields_from_hf(hf, rms_norm_eps=1e-5),
        head_dim=hf["head_dim"],
        attention_bias=bool(hf["attention_bias"]),
        **rope_from_hf(hf),
    )


def config_from_hf(hf: dict, **overrides: Any) -> HunyuanFields:
    """A HunyuanDenseConfig or HunyuanMoeConfig (by `model_type`) from a config.json dict
    (+ field overrides)."""
    kwargs = fields_from_hf(hf)
    if hf.get("model_type") == MOE:
        experts = hf.get("num_experts", hf.get("num_local_experts", HF_DEFAULTS["num_experts"]))
        if not isinstance(experts, int):
            raise ValueError(f"num_experts {experts!r}: HF's HunYuanMoEV1Config takes an int.")
        topk = hf.get("moe_topk", hf.get("num_experts_per_tok", HF_DEFAULTS["moe_topk"]))
        if isinstance(topk, list):
            n = kwargs["num_layers"]
            if len(topk) < n or len(set(topk[:n])) != 1:
                raise ValueError(
                    f"moe_topk {topk}: flaxlm routes every layer to as many experts (one k "
                    f"for all {n} layers)."
                )
            topk = topk[0]
        kwargs.update(num_experts=experts, num_experts_per_tok=topk)
    kwargs.update(overrides)
    return (HunyuanMoeConfig if hf.get("model_type") == MOE else HunyuanDenseConfig)(**kwargs)


def config_to_hf(cfg: HunyuanFields) -> dict:
    """The config.json dict (transformers 5's `rope_parameters`; NTK-alpha as the Hub's
    'dynamic' dict with its alpha)."""
    if cfg.rope_alpha is None:
        params = rope.to_hf(cfg)
    else:
        params = dict(rope_type="dynamic", alpha=cfg.rope_alpha, factor=1.0)
        params["rope_theta"] = cfg.rope_theta
    out = {
        "model_type": cfg.model_type,
        "architectures": [ARCHITECTURES[cfg.model_type]],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "attention_bias": cfg.attention_bias,
        "rope_parameters": params,
    }
    if isinstance(cfg, HunyuanMoeConfig):
        out.update(num_experts=cfg.num_experts, moe_topk=cfg.num_experts_per_tok)
    return out


def hf_tensors(cfg: HunyuanFields) -> list[HFTensor]:
    """Llama's table (its biases with `attention_bias`) with the per-head q/k norms; for the
    MoE each layer's router (`mlp.gate.wg`), experts and shared MLP."""
    n, attn = cfg.num_layers, "model.layers.{i}.self_attn"
    base = llama.LlamaConfig(
        num_layers=n,
        attention_bias=cfg.attention_bias,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    table = llama.hf_tensors(base) if cfg.model_type == DENSE else llama.hf_tensors_but_mlp(base)
    table += [
        HFTensor(f"layers_{{i}}/{p}/scale", f"{attn}.{p}.weight", layers=n)
        for p in ("query_layernorm", "key_layernorm")
    ]
    if cfg.model_type == MOE:
        prefix = "model.layers.{i}.mlp"
        table += qwen_moe.moe_hf_tensors(cfg, prefix, gate="gate.wg")
        table += [
            linear(
                f"layers_{{i}}/mlp/shared_experts/{p}/kernel",
                f"{prefix}.shared_mlp.{p}.weight",
                layers=n,
            )
            for p in qwen_moe.SWIGLU
        ]
    return table


HF_SPEC = register_hf(
    HFSpec(
        model_types=(DENSE,),
        config_cls=HunyuanDenseConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
    )
)
MOE_SPEC = register_hf(
    dataclasses.replace(HF_SPEC, model_types=(MOE,), config_cls=HunyuanMoeConfig)
)
