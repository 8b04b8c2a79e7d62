"""GLM-4.5 / GLM-4.6 (`glm4_moe`): Llama's block with partial rotary, optional per-head q/k
norms and q/k/v biases, and DeepSeek-V3's mixture of experts.

Attention is grouped-query with rotary over the first `partial_rotary_factor` of each head's
features (half-split pairs; the rest pass unrotated), q, k and v biased with
`attention_bias` (o never), and with `use_qk_norm` each query and key head RMS-normalised
before rotary. The first `first_k_dense_replace` layers have a dense SwiGLU of
`intermediate_size`; every later one is a `moe.MoE` routed as DeepSeek-V3 routes (a sigmoid
score per expert, the choice moved by `e_score_correction_bias` and limited to the
`topk_group` best of `n_group` groups, the chosen scores renormalised with `norm_topk_prob`
and scaled by `routed_scaling_factor`) plus `n_shared_experts` ungated shared experts.
Follows HuggingFace's `Glm4MoeForCausalLM`; the multi-token-prediction layer the Hub's files
carry (`model.layers.92` / `.46`) is skipped on import, as transformers skips it, unless the
config asks for it (`num_mtp_layers`, `mtp.py`: read, trained with `mtp_loss_weight`, written
back).

GLM-4.5V's and GLM-4.6V's files (`glm4v_moe`) hold such a text tower (`glm4v_moe_text`: no q/k
norms, its own vocabulary, context and biases by default; its multimodal rotary, on text,
plain rotary): it reads as a GLM-4.5 and exports as one.

`Glm4Moe` (the model with partial rotary) and `Glm4MoeBlock` (attention options read off the
config) also carry MiniMax-M2 (`minimax_m2.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import jax

from flaxlm.models import attention, deepseek, llama, masks, moe, mtp, mtp_hf, qwen_moe, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import (
    LANGUAGE_MODEL_RENAMES,
    HFSpec,
    HFTensor,
    Multimodal,
    register_hf,
)
from flaxlm.models.options import HeadShapes

Array = jax.Array

MODEL_TYPES = ("glm4_moe",)


def check_fixed(cfg: Any, fixed: dict[str, Any], family: str) -> None:
    """ValueError naming the first field of `cfg` that is not its `fixed` value (what the
    family's HF modeling code hard-wires)."""
    for name, value in fixed.items():
        if getattr(cfg, name) != value:
            raise ValueError(
                f"{name} {getattr(cfg, name)!r}: HF's {family} has {value!r} only; flaxlm "
                "reads and writes that."
            )


def check_rotary(cfg: Any) -> None:
    """ValueError naming `partial_rotary_factor` when it leaves no, or an odd number of,
    rotated features (HF's `int(head_dim * partial_rotary_factor)`)."""
    factor, dim = cfg.partial_rotary_factor, cfg.rotary_dim
    if not 0.0 < factor <= 1.0 or dim < 2 or dim % 2:
        raise ValueError(
            f"partial_rotary_factor {factor} must be in (0, 1] and rotate an even number of "
            f"each head's {cfg.dim_per_head} features (it rotates {dim})."
        )


def check_quantization(hf: dict, family: str) -> None:
    """ValueError naming config.json's `quant_method` unless the weights are plain, block FP8
    or compressed-tensors' (`checkpoints/fp8.py`, `compressed.py` dequantize those)."""
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "fp8", "compressed-tensors"):
        raise ValueError(
            f"config.json's quantization_config quant_method is {quant!r}: flaxlm reads "
            f"{family} files unquantized, in block FP8 ('fp8') or compressed-tensors' formats; "
            "load an unquantized copy."
        )


class PartialRotary(HeadShapes):
    """What a config with `head_dim`, `partial_rotary_factor` and grouped-query heads gives
    the block: head widths and the rotated features."""

    @property
    def rotary_dim(self) -> int:
        """The rotated features of each head, as HF rounds them."""
        return int(self.dim_per_head * self.partial_rotary_factor)

    @property
    def layer_windows(self) -> tuple[None, ...]:
        return (None,) * self.num_layers


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Glm4MoeConfig(
    moe.DenseFirstScan,
    PartialRotary,
    qwen_moe.MoESizes,
    rope.RopeScaling,
    moe.MoEOptions,
    mtp.MtpOptions,
):
    """GLM-4.5 / 4.6 hyper-parameters (HF's names where they exist; `num_experts` is HF's
    `n_routed_experts`, `mlp_only_layers` its first `first_k_dense_replace` layers); the
    defaults are GLM-4.5's (355B)."""

    vocab_size: int = 151552
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 5120
    num_layers: int = 92  # HF: num_hidden_layers
    num_heads: int = 96  # HF: num_attention_heads
    num_kv_heads: int | None = 8  # HF: num_key_value_heads; None: num_heads
    head_dim: int | None = 128  # None: hidden_size // num_heads
    intermediate_size: int = 12288  # the dense first layers' MLP
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    partial_rotary_factor: float = 0.5  # rotary covers this fraction of each head
    attention_bias: bool = True  # biases on q, k and v (never on o)
    use_qk_norm: bool = True  # each query and key head RMS-normalised before rotary
    tie_word_embeddings: bool = False
    activation: str = "silu"  # HF: hidden_act
    num_experts: int = 160  # HF: n_routed_experts
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 1536
    router: str = "sigmoid_topk"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    score_correction_bias: bool = True
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 1
    # HF's Glm4MoeForCausalLM computes no load-balance loss (the correction bias balances).
    router_aux_loss_coef: float = 0.0
    mlp_only_layers: tuple[int, ...] = (0, 1, 2)  # HF: first_k_dense_replace = 3

    # What llama.Llama and the block read beside the fields.
    scale_embedding: ClassVar[bool] = False
    norm_scale_plus_one: ClassVar[bool] = False
    sliding_window: ClassVar[None] = None
    mlp_bias: ClassVar[bool] = False
    # HF's router and MoE block: what they hard-wire.
    FIXED: ClassVar[dict[str, Any]] = dict(
        router="sigmoid_topk",
        score_correction_bias=True,
        shared_expert_intermediate_size=0,
        decoder_sparse_step=1,
        router_bias=False,
        expert_bias=False,
        swiglu_limit=None,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_moe()
        self.check_mtp()
        check_fixed(self, self.FIXED, "Glm4MoeForCausalLM")
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
        check_rotary(self)
        k = self.first_k_dense_replace
        if self.mlp_only_layers != tuple(range(k)):
            raise ValueError(
                f"mlp_only_layers {self.mlp_only_layers}: GLM-4.5's dense layers are its first "
                "first_k_dense_replace ones, (0, 1, ..., k - 1)."
            )
        if self.num_experts // self.n_group < 2:
            raise ValueError(
                f"n_group {self.n_group}: HF rates a group of experts by its two best, so each "
                f"of the {self.num_experts} experts' groups needs at least 2."
            )
        if self.n_shared_experts < 1:
            raise ValueError(
                f"n_shared_experts {self.n_shared_experts}: HF's GLM-4.5 MoE always has a "
                "shared expert MLP (n_shared_experts >= 1)."
            )

    @property
    def first_k_dense_replace(self) -> int:
        """HF's count of dense first layers."""
        return len(self.mlp_only_layers)

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def qk_norm(self) -> str | None:
        """`rotary_self_attention`'s q/k norm: per head, or none."""
        return "rms" if self.use_qk_norm else None

    def attention_params(self) -> int:
        """One block's attention: q, k, v (and their biases), o, the per-head q/k norms."""
        e, d = self.hidden_size, self.dim_per_head
        q, kv = self.num_heads * d, self.kv_heads * d
        bias = q + 2 * kv if self.attention_bias else 0
        return e * (q + 2 * kv) + q * e + bias + (2 * d if self.use_qk_norm else 0)

    def param_counts(self) -> tuple[int, int]:
        """(all, active per token) params, the MTP layers' included."""
        (total, active), (mtp_all, mtp_active) = super().param_counts(), self.mtp_param_counts()
        return total + mtp_all, active + mtp_active

    def make_module(self) -> Glm4Moe:
        return Glm4Moe(self)


class Glm4MoeBlock(qwen_moe.QwenMoeBlock):
    """Llama's block with the config's q/k/v biases and q/k norm (`qk_norm`: 'rms' per head,
    'rms_whole' over the whole projection), no o bias, and the mixture of experts (a dense
    SwiGLU on `mlp_only_layers`)."""

    def attention_options(self) -> dict[str, Any]:
        cfg = self.config
        return dict(qkv_bias=cfg.qkv_bias, out_bias=False, qk_norm=cfg.qk_norm)


class Glm4Moe(llama.Llama):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`, rotary
    over each head's first `rotary_dim` features."""

    block_cls = Glm4MoeBlock
    after_trunk = mtp.after_trunk  # MTP layers where the config has them

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, Array]]:
        return x, rope.sin_cos(positions, self.config, dim=self.config.rotary_dim)


# ------------------------------------------------------------------ HuggingFace

# transformers' Glm4MoeConfig defaults, for keys a config.json omits.
HF_DEFAULTS = dict(
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=10944,
    num_hidden_layers=46,
    num_attention_heads=96,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    attention_bias=False,
    moe_intermediate_size=1408,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_routed_experts=128,
    routed_scaling_factor=1.0,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    use_qk_norm=False,
)


def partial_rotary_factor(hf: dict, default: float) -> float:
    """`partial_rotary_factor` where transformers looks first: `rope_parameters`, then the
    top level, then the family's `default`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    return float(default if value is None else value)


VL_TEXT = "glm4v_moe_text"  # GLM-4.5V's text tower
# transformers' Glm4vMoeTextConfig defaults where they are not Glm4MoeConfig's (it has no
# q/k norms whatever config.json says).
VL_DEFAULTS = dict(vocab_size=151424, max_position_embeddings=65536, attention_bias=True)
VL_SKIP = (r"^model\.visual\.",)  # its vision tower


def config_from_hf(hf: dict, **overrides: Any) -> Glm4MoeConfig:
    """A Glm4MoeConfig from a GLM-4.5 / 4.6 config.json dict, or GLM-4.5V's text tower's
    (+ field overrides)."""
    check_quantization(hf, "GLM-4.5")
    if hf.get("model_type") == VL_TEXT:
        hf = {**VL_DEFAULTS, **hf, "use_qk_norm": False}
    hf = {**HF_DEFAULTS, **hf}
    experts = hf.get("n_routed_experts", hf.get("num_local_experts"))
    kwargs = dict(
        llama.shared_fields_from_hf(hf),
        head_dim=hf.get("head_dim"),
        partial_rotary_factor=partial_rotary_factor(hf, 0.5),  # Glm4MoeConfig's default
        attention_bias=bool(hf["attention_bias"]),
        use_qk_norm=bool(hf["use_qk_norm"]),
        num_experts=experts,
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        n_group=hf["n_group"],
        topk_group=hf["topk_group"],
        n_shared_experts=hf["n_shared_experts"],
        mlp_only_layers=tuple(range(hf["first_k_dense_replace"])),
        **rope.from_hf(hf),
    )
    kwargs.update(overrides)
    return Glm4MoeConfig(**kwargs)


def rope_to_hf(cfg: Any) -> dict[str, Any]:
    """`rope_parameters` with the partial rotary factor (where transformers keeps it)."""
    return {**rope.to_hf(cfg), "partial_rotary_factor": cfg.partial_rotary_factor}


def config_to_hf(cfg: Glm4MoeConfig) -> dict:
    return {
        "model_type": "glm4_moe",
        "architectures": ["Glm4MoeForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "rope_parameters": rope_to_hf(cfg),
        "attention_bias": cfg.attention_bias,
        "use_qk_norm": cfg.use_qk_norm,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "n_shared_experts": cfg.n_shared_experts,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "num_nextn_predict_layers": cfg.num_mtp_layers,
    }


def attention_hf_tensors(cfg: Any) -> list[HFTensor]:
    """Llama's embedding, attention, norms and head with q/k/v biases (`qkv_bias`, never
    o's) and q/k norms (`qk_norm`, their scales per head or whole, HF's shape either way)."""
    table = llama.hf_tensors_but_mlp(
        llama.LlamaConfig(num_layers=cfg.num_layers, tie_word_embeddings=cfg.tie_word_embeddings)
    )
    n, attn = cfg.num_layers, "model.layers.{i}.self_attn"
    if cfg.qkv_bias:
        table += [
            HFTensor(f"layers_{{i}}/{p}/bias", f"{attn}.{p}.bias", layers=n)
            for p in ("q_proj", "k_proj", "v_proj")
        ]
    if cfg.qk_norm:
        table += [
            HFTensor(f"layers_{{i}}/{p}/scale", f"{attn}.{p}.weight", layers=n)
            for p in ("q_norm", "k_norm")
        ]
    return table


def hf_tensors(cfg: Glm4MoeConfig) -> list[HFTensor]:
    """The attention table, then each layer's MLP as DeepSeek-V3's: router, experts, shared
    experts and correction bias, or the dense SwiGLU."""
    return attention_hf_tensors(cfg) + deepseek.moe_hf_tensors(cfg) + mtp_hf.tables(cfg, hf_tensors)


HF_IGNORE = (*llama.HF_SPEC.ignore, r"^model\.layers\.(46|92)\.")
HF_SPEC = register_hf(
    HFSpec(
        model_types=(*MODEL_TYPES, VL_TEXT),
        config_cls=Glm4MoeConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        # The multi-token-prediction layer of GLM-4.5's (92-layer) and GLM-4.5-Air's
        # (46-layer) files, as transformers' _keys_to_ignore_on_load_unexpected: ignored
        # only where no layer of this config claims it (num_mtp_layers reads it).
        ignore=HF_IGNORE,
        config_fields=lambda cfg: mtp_hf.spec_fields(cfg, HF_IGNORE, VL_SKIP),
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        # GLM-4.5V's / 4.6V's files: the text tower under `model.language_model.`, the head
        # the outer model's (tied by a pre-v5 save's text config too, as transformers reads
        # it), the vision tower skipped.
        multimodal=(Multimodal("glm4v_moe", VL_TEXT, tied=False, text_ties=True),),
        renames=LANGUAGE_MODEL_RENAMES,
        skip=VL_SKIP,
    )
)
