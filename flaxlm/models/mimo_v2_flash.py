"""MiMo-V2-Flash (`mimo_v2_flash`, Xiaomi's 309B-parameter MoE, 15B active): GLM-4.5's
block with hybrid sliding-window attention, attention sinks and DeepSeek-V3's router without
shared experts.

Each layer is 'full_attention' or 'sliding_attention' (`layer_types`; by default the first
layer and every 6th one full). A sliding layer sees the `sliding_window` latest positions
(its query included: 129, SGLang's window of 128 plus the query; a config.json's
`sliding_window_size` reads as that + 1, as transformers reads it), has twice the full
layers' key/value heads (`num_kv_heads`) and a learned sink logit per query head (gpt-oss's,
`attention.AttentionSinks`). Queries and keys are `head_dim` (192) wide and scored with
`head_dim ** -0.5`, values `v_head_dim` (128) wide and multiplied by `attention_value_scale`.
Each layer type has its own 'default' rotary (transformers' nested `rope_parameters`): its
base, over the first `int(head_dim * partial_rotary_factor)` features of each head
(half-split; an odd count rotates one more, as HF's frequencies do). q, k and v carry biases
with `attention_bias`, o never. The layers `mlp_layer_types` calls 'sparse' (by default all
but the first) are a `moe.MoE` routed as DeepSeek-V3's (sigmoid scores, the choice moved by
`e_score_correction_bias` within the `topk_group` best of `n_group` groups, renormalised with
`norm_topk_prob`, scaled by `routed_scaling_factor`, a null one reading as 1) with no shared
experts, the 'dense' ones a SwiGLU of `intermediate_size`. Follows HuggingFace's
`MiMoV2FlashForCausalLM`; the Hub's sinks (`self_attn.attention_sink_bias`) and per-expert
weights read as transformers' conversion reads them, its multi-token-prediction layers
(`model.mtp.`) are ignored, as transformers ignores them.

Refused (a ValueError naming the setting, where HF's model fails or flaxlm cannot run it):
`layer_types` / `mlp_layer_types` of other kinds or lengths; a `rope_parameters` without a
dict with a `rope_theta` for each layer type the layers use, a rope type other than
'default' there, or a `partial_rotary_factor` outside [0, 1]; query heads that the (doubled)
key/value heads do not divide; an odd `head_dim`; `n_group` leaving fewer than 2 experts a
group; `attention='jax'` with sliding layers (cuDNN cannot add the sinks). Keys transformers
does not read (the Hub's `hybrid_layer_pattern`, `moe_layer_freq`, `swa_*`, a top-level
`rope_theta`) are not read here either. `scan_layers` scans the cycle the layers' (attention,
MLP) kinds repeat, the layers around it unrolled (`stacks.layout_of`: the published shapes'
first layer, then seven cycles of six from layer 1, then the last five).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import gin
import jax

from flaxlm.models import attention, deepseek, glm4_moe, llama, masks, moe, qwen, qwen_moe, stacks
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, register_hf
from flaxlm.models.options import ComputeOptions

Array = jax.Array

MODEL_TYPES = ("mimo_v2_flash",)
FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types entries
LAYER_TYPES = (FULL, SLIDING)
MLP_KINDS = ("dense", "sparse")  # HF's mlp_layer_types entries
# Each layer type's rotary fields: its base, and the fraction of each head it rotates.
ROPE_FIELDS = {
    FULL: ("rope_theta", "partial_rotary_factor"),
    SLIDING: ("sliding_rope_theta", "sliding_partial_rotary_factor"),
}
DEFAULT_PARTIAL = 0.334  # HF's when a layer type's rope dict names none


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MiMoV2FlashConfig(moe.DenseFirstScan, qwen_moe.MoESizes, ComputeOptions, moe.MoEOptions):
    """MiMo-V2-Flash hyper-parameters (HF's names where they exist; `num_experts` is HF's
    `n_routed_experts`, `mlp_only_layers` its 'dense' `mlp_layer_types`, the `sliding_*`
    rope fields its `rope_parameters['sliding_attention']`); the defaults are transformers'
    `MiMoV2FlashConfig`'s (MiMo-V2-Flash's shapes)."""

    vocab_size: int = 152576
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 4096
    num_layers: int = 48  # HF: num_hidden_layers
    num_heads: int = 64  # HF: num_attention_heads
    num_kv_heads: int = 4  # HF: num_key_value_heads, the full layers' (sliding: twice)
    head_dim: int = 192  # queries' and keys'
    v_head_dim: int = 128  # values'
    intermediate_size: int = 16384  # the dense layers' MLP
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    sliding_window: int = 129  # a sliding layer's query sees this many latest positions
    # Each layer's 'full_attention' or 'sliding_attention'; None: HF's default (the first
    # layer and every 6th full).
    layer_types: tuple[str, ...] | None = None
    attention_value_scale: float | None = 0.707  # values x this (None: 1)
    rope_theta: float = 5e6  # full layers' rotary
    partial_rotary_factor: float = DEFAULT_PARTIAL
    sliding_rope_theta: float = 1e4  # sliding layers' rotary
    sliding_partial_rotary_factor: float = DEFAULT_PARTIAL
    attention_bias: bool = False  # biases on q, k and v (never on o)
    tie_word_embeddings: bool = False
    activation: str = "silu"  # HF: hidden_act
    num_experts: int = 256  # HF: n_routed_experts
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    router: str = "sigmoid_topk"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = True
    n_group: int = 1
    topk_group: int = 1
    # HF's MiMoV2FlashForCausalLM computes no load-balance loss (the correction bias balances).
    router_aux_loss_coef: float = 0.0
    mlp_only_layers: tuple[int, ...] = (0,)  # HF: the 'dense' mlp_layer_types

    # What llama.LlamaBlock and qwen_moe.mlp_or_experts read beside the fields.
    mlp_bias: ClassVar[bool] = False
    norm_scale_plus_one: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = False
    # HF's router and MoE block: what they hard-wire (no shared experts).
    FIXED: ClassVar[dict[str, Any]] = dict(
        router="sigmoid_topk",
        score_correction_bias=True,
        n_shared_experts=0,
        shared_expert_intermediate_size=0,
        decoder_sparse_step=1,
        router_bias=False,
        expert_bias=False,
        router_scales_input=False,
        per_expert_scale=False,
        swiglu_limit=None,
    )

    def __post_init__(self) -> None:
        if self.layer_types is not None:  # Gin and JSON give lists; the config stays hashable
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        super().__post_init__()
        self.check_moe()
        glm4_moe.check_fixed(self, self.FIXED, "MiMoV2FlashForCausalLM")
        types = self.layer_types
        if types is not None and (
            len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types)
        ):
            raise ValueError(
                f"layer_types {types}: expected num_layers ({self.num_layers}) entries, each one "
                f"of {LAYER_TYPES}."
            )
        for name in ("num_kv_heads", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be positive.")
        for heads in {self.layer_kv_heads(i) for i in range(self.num_layers)}:
            if self.num_heads % heads:
                raise ValueError(
                    f"num_kv_heads {self.num_kv_heads}: num_heads {self.num_heads} must be a "
                    f"multiple of every layer's key/value heads ({heads}: a sliding layer has "
                    "twice num_kv_heads)."
                )
        attention.check_heads(self.hidden_size, self.num_heads, 1, self.head_dim)
        if self.sliding_window is None or self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be positive.")
        for theta, factor in ROPE_FIELDS.values():
            if not getattr(self, theta) > 0:
                raise ValueError(f"{theta} {getattr(self, theta)} must be positive.")
            if not 0.0 <= getattr(self, factor) <= 1.0:
                raise ValueError(f"{factor} {getattr(self, factor)} must be in [0, 1].")
        if self.num_experts // self.n_group < 2:
            raise ValueError(
                f"n_group {self.n_group}: HF rates a group of experts by its two best, so each "
                f"of the {self.num_experts} experts' groups needs at least 2."
            )
        if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError(
                f"mlp_only_layers {self.mlp_only_layers}: layers of a {self.num_layers}-layer "
                "model (HF's 'dense' mlp_layer_types)."
            )
        attention.check_implementation(self.attention, sinks=SLIDING in self.per_layer_types)

    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """Each layer's type: `layer_types`, or HF's default (the first layer and every 6th
        one full, the others sliding)."""
        if self.layer_types is not None:
            return self.layer_types
        return tuple(
            FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(self.num_layers)
        )

    @property
    def mlp_layer_types(self) -> tuple[str, ...]:
        """HF's per-layer MLP kinds, 'dense' or 'sparse'."""
        return tuple("sparse" if s else "dense" for s in self.sparse_layers(self.num_layers))

    @property
    def kv_heads(self) -> int:
        """The full layers' key/value heads (HF's `num_key_value_heads`)."""
        return self.num_kv_heads

    def layer_kv_heads(self, i: int) -> int:
        """Layer `i`'s key/value heads: a sliding layer has twice the full layers'."""
        return self.num_kv_heads * (2 if self.per_layer_types[i] == SLIDING else 1)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    def rotary_dim(self, kind: str) -> int:
        """The features layer type `kind` rotates, as HF rounds them (`int(head_dim *
        factor)`; an odd count's frequencies rotate one feature more)."""
        return int(self.head_dim * getattr(self, ROPE_FIELDS[kind][1]))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention), for `masks.layer_window`."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.per_layer_types)

    def scan_kinds(self) -> Sequence[Hashable]:
        """Each layer's (attention type, MoE or not): what a scan's cycle repeats."""
        return tuple(zip(self.per_layer_types, self.sparse_layers(self.num_layers), strict=True))

    @property
    def first_scanned_layer(self) -> int:
        """The first layer of the layout with the fewest distinct layers to compile
        (`stacks.layout_of`); those before it stay unrolled."""
        return stacks.layout_of(self.scan_kinds())[0]

    def layer_attention_params(self, i: int) -> int:
        """Layer `i`'s attention: q, k, v (their biases), o, and a sliding layer's sinks."""
        e, h, d, dv = self.hidden_size, self.num_heads, self.head_dim, self.v_head_dim
        kv = self.layer_kv_heads(i)
        qkv = h * d + kv * d + kv * dv
        sinks = h if self.per_layer_types[i] == SLIDING else 0
        return e * qkv + h * dv * e + (qkv if self.attention_bias else 0) + sinks

    def param_counts(self) -> tuple[int, int]:
        """(all, active per token) params."""
        e, v = self.hidden_size, self.vocab_size
        total = active = v * e + e + (0 if self.tie_word_embeddings else v * e)
        moe_all, moe_active = self.moe_params(e)
        dense = 3 * e * self.intermediate_size
        for i, sparse in enumerate(self.sparse_layers(self.num_layers)):
            block = self.layer_attention_params(i) + 2 * e
            total += block + (moe_all if sparse else dense)
            active += block + (moe_active if sparse else dense)
        return total, active

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x the active matmul params plus the attention (scores
        `head_dim` wide, probabilities . values `v_head_dim` wide; a sliding layer's over its
        window)."""
        lookup = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        contexts = sum(min(seq_len, w or seq_len) for w in self.layer_windows)
        width = self.head_dim + self.v_head_dim
        return 6.0 * (self.active_params() - lookup) + 6.0 * self.num_heads * width * contexts

    def make_module(self) -> MiMoV2Flash:
        return MiMoV2Flash(self)


class MiMoV2FlashBlock(qwen_moe.QwenMoeBlock):
    """Llama's block whose attention has this layer's key/value heads, window, rotary and
    (sliding) sinks, values `v_head_dim` wide and scaled; the mixture of experts (a dense
    SwiGLU on `mlp_only_layers`) as its feed-forward.

    Called `(x, layer_index, mask, decoding, sin, cos, sliding_sin, sliding_cos)`."""

    def self_attention(
        self,
        h: Array,
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
        sliding_sin: Array,
        sliding_cos: Array,
    ) -> Array:
        cfg = self.config
        # The layer's shape: its own when unrolled, a cycle's block's (one kind) when scanned.
        i = stacks.layer_of(self, cfg.first_scanned_layer)
        sliding = cfg.per_layer_types[i] == SLIDING
        if sliding:
            sin, cos = sliding_sin, sliding_cos
        return attention.rotary_self_attention(
            h,
            sin,
            cos,
            mask,
            decoding,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.layer_kv_heads(i),
            head_dim=cfg.head_dim,
            v_head_dim=cfg.v_head_dim,
            value_scale=cfg.attention_value_scale,
            hidden_size=cfg.hidden_size,
            qkv_bias=cfg.attention_bias,
            out_bias=False,
            attention=cfg.attention,
            chunk_size=cfg.attention_chunk_size,
            context_parallel=cfg.context_parallel,
            window=masks.layer_window(cfg.layer_windows, index),
            sinks=sliding,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
        )


class MiMoV2Flash(qwen.Qwen):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = MiMoV2FlashBlock

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, ...]]:
        """The full layers' sin/cos tables, then the sliding layers' (each type's base and
        rotated features; a type no layer has takes the other's)."""
        cfg = self.config
        kinds = set(cfg.per_layer_types)
        tables = {}
        for kind in LAYER_TYPES:
            if kind in kinds:
                theta = getattr(cfg, ROPE_FIELDS[kind][0])
                inv_freq = attention.rotary_inv_freq(cfg.rotary_dim(kind), theta)
                tables[kind] = attention.rotary_sin_cos(positions, inv_freq)
        full = tables.get(FULL, tables.get(SLIDING))
        return x, (*full, *tables.get(SLIDING, full))


# ------------------------------------------------------------------ HuggingFace

# transformers' MiMoV2FlashConfig defaults, for keys a config.json omits.
HF_DEFAULTS = dict(
    vocab_size=152576,
    hidden_size=4096,
    intermediate_size=16384,
    num_hidden_layers=48,
    num_attention_heads=64,
    num_key_value_heads=4,
    hidden_act="silu",
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_bias=False,
    moe_intermediate_size=2048,
    num_experts_per_tok=8,
    n_routed_experts=256,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    head_dim=192,
    v_head_dim=128,
    sliding_window=129,
    attention_value_scale=0.707,
)
DEFAULT_ROPE = {
    FULL: {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": DEFAULT_PARTIAL},
    SLIDING: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": DEFAULT_PARTIAL},
}


def rope_from_hf(hf: dict, kinds: Sequence[str]) -> dict[str, float]:
    """The rotary fields of the layer types among `kinds` from config.json's nested
    `rope_parameters` (a legacy `rope_scaling` in its place, as transformers takes it;
    neither: HF's defaults). A type no layer has keeps the config's defaults."""
    params = hf.get("rope_parameters")
    params = hf.get("rope_scaling") if params is None else params
    params = DEFAULT_ROPE if params is None else params
    out: dict[str, float] = {}
    for kind in sorted(set(kinds) & set(ROPE_FIELDS)):  # another kind: the config refuses it
        own = params.get(kind) if isinstance(params, dict) else None
        if not isinstance(own, dict) or own.get("rope_theta") is None:
            raise ValueError(
                f"rope_parameters {params}: transformers' MiMo-V2-Flash reads a dict with a "
                f"rope_theta for each layer type its layers use ({kind!r} here)."
            )
        kind_of_rope = own.get("rope_type", own.get("type", "default"))
        if kind_of_rope != "default":
            raise ValueError(
                f"rope_parameters[{kind!r}] rope_type {kind_of_rope!r}: flaxlm runs "
                "MiMo-V2-Flash's 'default' rope (partial, per layer type) only."
            )
        factor = own.get("partial_rotary_factor", DEFAULT_PARTIAL)
        if factor is None:  # HF's int(head_dim * None) fails
            raise ValueError(f"rope_parameters[{kind!r}] partial_rotary_factor is null.")
        theta_field, factor_field = ROPE_FIELDS[kind]
        out[theta_field], out[factor_field] = float(own["rope_theta"]), float(factor)
    return out


def config_from_hf(hf: dict, **overrides: Any) -> MiMoV2FlashConfig:
    """A MiMoV2FlashConfig from a MiMo-V2-Flash config.json dict (+ field overrides), read as
    transformers reads it: its defaults where a key is missing, a `sliding_window_size` as
    that + 1, a null `routed_scaling_factor` as 1, `num_local_experts` before
    `n_routed_experts`."""
    hf = {**HF_DEFAULTS, **hf}
    n = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
        layer_types = [FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(n)]
    mlp_kinds = hf.get("mlp_layer_types")
    if mlp_kinds is None:
        mlp_kinds = ["dense"] + ["sparse"] * (n - 1)
    if len(mlp_kinds) != n or any(k not in MLP_KINDS for k in mlp_kinds):
        raise ValueError(
            f"mlp_layer_types {mlp_kinds}: expected num_hidden_layers ({n}) entries, each one "
            f"of {MLP_KINDS}."
        )
    window = hf.get("sliding_window")
    if hf.get("sliding_window_size") is not None:  # SGLang's window, the query not counted
        window = hf["sliding_window_size"] + 1
    scaling = hf.get("routed_scaling_factor")
    kwargs = dict(
        llama.shared_fields_from_hf(hf),
        head_dim=hf["head_dim"],
        v_head_dim=hf["v_head_dim"],
        sliding_window=window,
        layer_types=tuple(layer_types),
        attention_value_scale=hf["attention_value_scale"],
        attention_bias=bool(hf["attention_bias"]),
        num_experts=hf.get("num_local_experts", hf["n_routed_experts"]),
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        routed_scaling_factor=1.0 if scaling is None else float(scaling),
        n_group=hf["n_group"],
        topk_group=hf["topk_group"],
        mlp_only_layers=tuple(i for i, kind in enumerate(mlp_kinds) if kind == "dense"),
        **rope_from_hf(hf, layer_types),
    )
    kwargs.update(overrides)
    return MiMoV2FlashConfig(**kwargs)


def config_to_hf(cfg: MiMoV2FlashConfig) -> dict:
    """config.json as transformers' MiMoV2FlashConfig writes it: every layer's attention and
    MLP kind, each layer type's rope dict."""
    rope = {
        kind: {
            "rope_type": "default",
            "rope_theta": getattr(cfg, theta),
            "partial_rotary_factor": getattr(cfg, factor),
        }
        for kind, (theta, factor) in ROPE_FIELDS.items()
    }
    return {
        "model_type": "mimo_v2_flash",
        "architectures": ["MiMoV2FlashForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.head_dim,
        "v_head_dim": cfg.v_head_dim,
        "attention_bias": cfg.attention_bias,
        "attention_value_scale": cfg.attention_value_scale,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.per_layer_types),
        "mlp_layer_types": list(cfg.mlp_layer_types),
        "rope_parameters": rope,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
    }


def hf_tensors(cfg: MiMoV2FlashConfig) -> list[HFTensor]:
    """GLM-4.5's attention table (Llama's with q/k/v biases), the sliding layers' sinks, and
    each layer's MLP as DeepSeek-V3's: router, experts and correction bias, or the dense
    SwiGLU."""
    sliding = tuple(i for i, t in enumerate(cfg.per_layer_types) if t == SLIDING)
    sinks = [
        HFTensor(
            "layers_{i}/sinks/logits",
            "model.layers.{i}.self_attn.sinks",
            layers=cfg.num_layers,
            only=sliding,
        )
    ]
    return (
        glm4_moe.attention_hf_tensors(cfg)
        + (sinks if sliding else [])
        + deepseek.moe_hf_tensors(cfg)
    )


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=MiMoV2FlashConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        # The Hub's multi-token-prediction layers, as transformers'
        # _keys_to_ignore_on_load_unexpected.
        ignore=(r"rotary_emb\.", r"^lm_head\.weight$", r"^model\.mtp\."),
        base_model_prefix="model",
        tied_head=("lm_head.weight", "model.embed_tokens.weight"),
        # The Hub's name of the sinks (transformers' conversion mapping renames it).
        renames=((r"\.self_attn\.attention_sink_bias$", ".self_attn.sinks"),),
    )
)
