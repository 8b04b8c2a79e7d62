"""DeepSeek-V3 (and DeepSeek-R1, Kimi K2: the same architecture): Llama's pre-RMSNorm block
with multi-head latent attention (`mla.py`) and a mixture of experts routed by sigmoid scores.

Every layer from `first_k_dense_replace` on (here: every layer not in `mlp_only_layers`,
which must be the first ones) is a `moe.MoE`: a sigmoid score per expert, the top
`num_experts_per_tok` chosen within the `topk_group` best of `n_group` groups after adding
the per-expert `e_score_correction_bias` (which moves the choice, never the weights), the
chosen scores renormalised and scaled by `routed_scaling_factor`, plus `n_shared_experts`
ungated shared experts every token goes through. The first layers have a dense SwiGLU of
`intermediate_size`. Rotary embeddings cover `qk_rope_head_dim` features (YaRN with
DeepSeek's mscale for the 128k-context checkpoints). Follows HuggingFace's
`DeepseekV3ForCausalLM`; the multi-token-prediction layer that the Hub's DeepSeek-V3 files
carry (`model.layers.61`) is skipped on import, as transformers skips it, unless the config
asks for it (`num_mtp_layers`, `mtp.py`: then it is read, trained with `mtp_loss_weight` and
written back), and their FP8 weights (128 x 128 blocks of float8 with a scale each) are
dequantized to the param dtype (`checkpoints/fp8.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import jax

from flaxlm.models import llama, masks, mla, moe, mtp, mtp_hf, qwen_moe, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import (
    LLAVA_RENAMES,
    HFSpec,
    HFTensor,
    Multimodal,
    linear,
    register_hf,
)

Array = jax.Array

# Kimi K2's config.json names its own model type over DeepSeek-V3's modeling code.
MODEL_TYPES = ("deepseek_v3", "kimi_k2")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(
    moe.DenseFirstScan, qwen_moe.MoESizes, rope.RopeScaling, moe.MoEOptions, mtp.MtpOptions
):
    """DeepSeek-V3 hyper-parameters (HF's names where they exist; `num_experts` is HF's
    `n_routed_experts`, `mlp_only_layers` its first `first_k_dense_replace` layers); the
    defaults are DeepSeek-V3's (671B)."""

    vocab_size: int = 129280
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 7168
    num_layers: int = 61  # HF: num_hidden_layers
    num_heads: int = 128  # HF: num_attention_heads (= num_key_value_heads)
    intermediate_size: int = 18432  # the dense layers' MLP
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    q_lora_rank: int | None = 1536  # None: queries straight from the input (q_proj)
    kv_lora_rank: int = 512  # the latent each token's keys and values come from
    qk_nope_head_dim: int = 128  # each head's query/key features without position
    qk_rope_head_dim: int = 64  # ... with rotary position (the key's shared by all heads)
    v_head_dim: int = 128
    rope_interleave: bool = True  # rotary pairs (0, 1), (2, 3), ... (False: half-split)
    attention_bias: bool = False  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj
    tie_word_embeddings: bool = False
    activation: str = "silu"  # HF: hidden_act
    # What the decoding cache holds: 'latent' (kv_lora_rank + qk_rope_head_dim values per
    # token and layer) or 'full' (every head's key and value); see mla.py.
    mla_cache: str = "latent"
    num_experts: int = 256  # HF: n_routed_experts
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    router: str = "sigmoid_topk"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    score_correction_bias: bool = True
    n_group: int = 8
    topk_group: int = 4
    n_shared_experts: int = 1
    # The balance is the correction bias's (aux-loss-free); HF computes no aux loss.
    router_aux_loss_coef: float = 0.0
    mlp_only_layers: tuple[int, ...] = (0, 1, 2)  # HF: first_k_dense_replace = 3
    rope_scaling_type: str | None = "yarn"
    rope_scaling_factor: float = 40.0
    rope_original_max_position_embeddings: int = 4096
    rope_mscale: float | None = 1.0
    rope_mscale_all_dim: float | None = 1.0

    # What llama.Llama and qwen_moe.mlp_or_experts read beside the fields.
    scale_embedding: ClassVar[bool] = False
    norm_scale_plus_one: ClassVar[bool] = False
    sliding_window: ClassVar[None] = None
    # The latent attention rotates its qk_rope_head_dim features (Kimi Linear's does not).
    rotary: ClassVar[bool] = True
    # Whether `num_mtp_layers` builds MTP layers for this family (those whose Hub files lay
    # them out as DeepSeek-V3's, with an oracle in transformers); else it is refused.
    mtp_layers_built: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_moe()
        self.check_dense_layers()
        if self.mla_cache not in mla.MLA_CACHES:
            raise ValueError(f"mla_cache {self.mla_cache!r}: expected one of {mla.MLA_CACHES}.")
        dims = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for name in (*dims, "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be positive.")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank {self.q_lora_rank} must be None or positive.")
        if self.rotary and self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (rotary).")
        self.check_mtp()

    def check_mtp(self) -> None:
        super().check_mtp()
        if self.num_mtp_layers and not self.mtp_layers_built:
            raise ValueError(
                f"num_mtp_layers {self.num_mtp_layers}: multi-token prediction is built for "
                "DeepSeek-V3, Kimi K2, DeepSeek-V3.2 and GLM-5, not "
                f"{type(self).__name__}; set num_mtp_layers=0."
            )

    def check_dense_layers(self) -> None:
        """ValueErrors for dense layers HF's model cannot have: DeepSeek-V3's are its first
        `first_k_dense_replace` (`scan_layers` scans the MoE layers after them)."""
        k = self.first_k_dense_replace
        if self.mlp_only_layers != tuple(range(k)) or self.decoder_sparse_step != 1:
            raise ValueError(
                f"mlp_only_layers {self.mlp_only_layers} / decoder_sparse_step "
                f"{self.decoder_sparse_step}: DeepSeek-V3's dense layers are its first "
                "first_k_dense_replace ones, (0, 1, ..., k - 1), and every later layer is sparse."
            )

    @property
    def first_k_dense_replace(self) -> int:
        """HF's count of dense first layers."""
        return len(self.mlp_only_layers)

    @property
    def dim_per_head(self) -> int:
        """The rotary width (`rope.sin_cos` reads it): `qk_rope_head_dim`, as HF's head_dim."""
        return self.qk_rope_head_dim

    @property
    def kv_heads(self) -> int:
        return self.num_heads

    @property
    def layer_windows(self) -> tuple[None, ...]:
        return (None,) * self.num_layers

    def attention_params(self) -> int:
        """One block's latent attention: the query path, the key/value latent and its
        expansion, the output, their norms and biases."""
        e, h, r = self.hidden_size, self.num_heads, self.kv_lora_rank
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = self.attention_bias
        if self.q_lora_rank is None:
            q = e * h * qk
        else:
            ql = self.q_lora_rank
            q = e * ql + ql + ql * h * qk + (ql if bias else 0)
        kv_a = r + self.qk_rope_head_dim
        kv = e * kv_a + r + r * h * (self.qk_nope_head_dim + self.v_head_dim)
        kv += kv_a if bias else 0
        return q + kv + h * self.v_head_dim * e + (e if bias else 0)

    def param_counts(self) -> tuple[int, int]:
        """(all, active per token) params, the MTP layers' included."""
        (total, active), (mtp_all, mtp_active) = super().param_counts(), self.mtp_param_counts()
        return total + mtp_all, active + mtp_active

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x the active matmul params plus the attention scores
        (queries . keys `qk_head_dim` wide, probabilities . values `v_head_dim` wide); with
        MTP layers, each one's block and its pass through the head too."""
        lookup = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        widths = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        layers = self.num_layers + self.num_mtp_layers
        scores = 6.0 * self.num_heads * widths * seq_len * layers
        head = self.num_mtp_layers * self.vocab_size * self.hidden_size
        return 6.0 * (self.active_params() - lookup + head) + scores

    def make_module(self) -> Deepseek:
        return Deepseek(self)


class DeepseekBlock(qwen_moe.QwenMoeBlock):
    """Llama's block with multi-head latent attention and the mixture of experts (a dense
    SwiGLU on the first layers)."""

    def self_attention(
        self,
        h: Array,
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
    ) -> Array:
        return mla.MultiHeadLatentAttention(self.config, name="self_attn")(
            h, sin, cos, mask, decoding
        )


class Deepseek(llama.Llama):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`, and
    the MTP layers' hidden states sown where the config has them (`mtp.py`)."""

    block_cls = DeepseekBlock

    after_trunk = mtp.after_trunk


# ------------------------------------------------------------------ HuggingFace

HF_DEFAULTS = dict(  # transformers' DeepseekV3Config defaults, for keys a config.json omits
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=3,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
    norm_topk_prob=True,
    rope_interleave=True,
)


def config_from_hf(hf: dict, **overrides: Any) -> DeepseekV3Config:
    """A DeepseekV3Config from a DeepSeek-V3 (or Kimi K2) config.json dict (+ overrides)."""
    kwargs = fields_from_hf(hf)
    kwargs.update(overrides)
    return DeepseekV3Config(**kwargs)


def fields_from_hf(
    hf: dict, defaults: dict[str, Any] = HF_DEFAULTS, rms_norm_eps: float = 1e-6
) -> dict[str, Any]:
    """DeepseekV3Config's fields from a config.json dict of a model on DeepSeek-V3's
    modeling code (DeepSeek-V3, Kimi K2; DeepSeek-V3.2 and GLM-5 add theirs): `defaults`
    (its transformers config class's, as HF_DEFAULTS) for the keys it omits."""
    get = lambda key: hf.get(key, defaults[key])  # noqa: E731
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        raise ValueError(
            f"num_key_value_heads {hf['num_key_value_heads']} != num_attention_heads {heads}: "
            "latent attention expands keys and values for every query head."
        )
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "fp8", "compressed-tensors"):
        raise ValueError(
            f"config.json's quantization_config quant_method is {quant!r}: flaxlm reads "
            "DeepSeek-V3 and Kimi K2 files unquantized, in block FP8 ('fp8', the Hub's files) "
            "or compressed-tensors' formats (Kimi K2 Thinking's), dequantized on import; load "
            "an unquantized copy."
        )
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(
            f"moe_layer_freq {hf['moe_layer_freq']}: transformers' DeepSeek-V3 (and flaxlm) "
            "make every layer from first_k_dense_replace on sparse; 1 only."
        )
    kwargs = dict(
        llama.shared_fields_from_hf(hf, rms_norm_eps),
        q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
        rope_interleave=bool(get("rope_interleave")),
        attention_bias=hf.get("attention_bias", False),
        num_experts=hf.get("n_routed_experts", hf.get("num_local_experts", 256)),
        num_experts_per_tok=hf.get("num_experts_per_tok", 8),
        moe_intermediate_size=hf.get("moe_intermediate_size", 2048),
        norm_topk_prob=bool(get("norm_topk_prob")),
        routed_scaling_factor=float(get("routed_scaling_factor")),
        n_group=get("n_group") or 1,
        topk_group=get("topk_group") or 1,
        n_shared_experts=get("n_shared_experts") or 0,
        mlp_only_layers=tuple(range(get("first_k_dense_replace") or 0)),
        **rope_from_hf(hf),
    )
    del kwargs["num_kv_heads"]  # latent attention: every head has its own (checked above)
    return kwargs


def rope_from_hf(hf: dict) -> dict[str, Any]:
    """`rope.from_hf`, with every RopeScaling field set (the config's defaults are
    DeepSeek-V3's YaRN, which a checkpoint without scaling must clear)."""
    out: dict[str, Any] = dict(
        rope_scaling_type=None, rope_scaling_factor=1.0, rope_mscale=None, rope_mscale_all_dim=None
    )
    out.update(rope.from_hf(hf))
    return out


def config_to_hf(cfg: DeepseekV3Config) -> dict:
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "num_key_value_heads": cfg.num_heads,
        "rope_parameters": rope.to_hf(cfg),
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
        "num_nextn_predict_layers": cfg.num_mtp_layers,
    }


def hf_tensors(cfg: DeepseekV3Config) -> list[HFTensor]:
    """Llama's embedding, norms and head; each layer's latent attention; the MLPs as the
    Qwen-line MoEs map them, plus the shared experts and the router's correction bias; the
    MTP layers after the decoder layers (`mtp_hf.tables`)."""
    table = [t for t in llama.hf_tensors_but_mlp(cfg) if ".self_attn." not in t.hf]
    table += mla_hf_tensors(
        cfg, "layers_{i}/self_attn", "model.layers.{i}.self_attn", cfg.num_layers
    )
    return table + moe_hf_tensors(cfg) + mtp_hf.tables(cfg, hf_tensors)


def mla_hf_tensors(cfg: DeepseekV3Config, scope: str, attn: str, n: int) -> list[HFTensor]:
    """One latent attention's records: params under `scope`, HF tensors under the module
    `attn` (`n` layers alike with `{i}` in both, else 0: one layer)."""
    names = ["kv_a_proj_with_mqa"] + (["q_a_proj"] if cfg.q_lora_rank else [])
    table = [linear(f"{scope}/{p}/kernel", f"{attn}.{p}.weight", layers=n) for p in names]
    table += [
        linear(f"{scope}/{p}/kernel", f"{attn}.{p}.weight", layers=n)
        for p in ("q_b_proj" if cfg.q_lora_rank else "q_proj", "kv_b_proj")
    ]
    table.append(linear(f"{scope}/o_proj/kernel", f"{attn}.o_proj.weight", 2, layers=n))
    norms = ["kv_a_layernorm"] + (["q_a_layernorm"] if cfg.q_lora_rank else [])
    table += [HFTensor(f"{scope}/{p}/scale", f"{attn}.{p}.weight", layers=n) for p in norms]
    if cfg.attention_bias:
        table += [
            HFTensor(f"{scope}/{p}/bias", f"{attn}.{p}.bias", layers=n) for p in (*names, "o_proj")
        ]
    return table


def moe_hf_tensors(
    cfg: DeepseekV3Config,
    prefix: str = "model.layers.{i}.mlp",
    expert_names: tuple[str, str, str] = qwen_moe.SWIGLU,
) -> list[HFTensor]:
    """Every layer's MLP under the HF module `prefix` (with `{i}`): the router, the experts
    (fused in memory, per expert on the Hub, named `expert_names`) or a dense SwiGLU
    (`qwen_moe.moe_hf_tensors`), and on the sparse layers the shared experts and
    `e_score_correction_bias`."""
    out = qwen_moe.moe_hf_tensors(cfg, prefix, expert_names=expert_names)
    if not any(cfg.sparse_layers(cfg.num_layers)):
        return out
    n, only = cfg.num_layers, qwen_moe.sparse_only(cfg)
    if cfg.n_shared_experts:
        out += [
            linear(
                f"layers_{{i}}/mlp/shared_experts/{p}/kernel",
                f"{prefix}.shared_experts.{p}.weight",
                layers=n,
                only=only,
            )
            for p in qwen_moe.SWIGLU
        ]
    if cfg.score_correction_bias:
        bias = f"{prefix}.gate.e_score_correction_bias"
        out.append(HFTensor("layers_{i}/mlp/e_score_correction_bias", bias, layers=n, only=only))
    return out


K25_SKIP = (r"^(model\.)?(vision_tower|mm_projector)\.",)
HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=DeepseekV3Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        # The multi-token-prediction layer of DeepSeek-V3's 61-layer files (as transformers'
        # _keys_to_ignore_on_load_unexpected), unless the config holds MTP layers; Kimi
        # K2.5's files (`kimi_k25`): a Kimi K2 text tower under `language_model.` (llava's
        # layout; its layers `blocks` where transformers 5.23 saved the file, as its
        # conversion mapping renames the vision tower's), the vision tower and projector
        # skipped.
        skip=(r"^model\.layers\.61\.", *K25_SKIP),
        config_fields=lambda cfg: mtp_hf.spec_fields(cfg, llama.HF_SPEC.ignore, K25_SKIP),
        multimodal=(Multimodal("kimi_k25", "deepseek_v3", tied=True),),
        renames=((r"^language_model\.model\.blocks\.", "model.layers."), *LLAVA_RENAMES),
    )
)
