"""Qwen3-Next (`qwen3_next`) and Qwen3.5 text (`qwen3_5_text` dense, `qwen3_5_moe_text`):
hybrids of Gated DeltaNet (linear attention) layers and gated full-attention layers.

Each layer is 'linear_attention' (`gated_deltanet.GatedDeltaNet`) or 'full_attention'
(`layer_types`; by default three linear layers, then a full one: `full_attention_interval`).
A full-attention layer is Qwen3's (grouped-query, each query and key head RMS-normalised)
with rotary over the first `partial_rotary_factor` of each head and an output gate: `q_proj`
gives each head its query and as many gates, and the head's output is multiplied by their
sigmoid. Every RMSNorm multiplies by (1 + w). The MLP is a mixture of experts with a
sigmoid-gated shared expert (Qwen2-MoE's; `decoder_sparse_step` / `mlp_only_layers` keep
dense MLPs on Qwen3-Next) or, in Qwen3.5 text, a dense SwiGLU. Qwen3.5's rotary is
multimodal (`mrope_section`: time, height and width streams); text has one position stream,
where it is plain rotary (the sections are kept for export). Qwen3-Next's projections of a
linear layer are fused per key head (`in_proj_qkvz`, `in_proj_ba`), Qwen3.5's apart.

Follows transformers' `Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM` and `Qwen3_5MoeForCausalLM`
(the HF mapping, and the Hub's multimodal Qwen3.5 files' text tower: `qwen3_next_hf.py`).
The Hub's files also hold one multi-token-prediction layer (`mtp.*`, which transformers
skips): read where `num_mtp_layers` is 1 (`mtp.py`: DeepSeek-V3's layer, as vLLM's
`Qwen3NextMultiTokenPredictor` runs it: the next token's embedding and the final hidden
state each normalised, joined embedding first by `fc`, one full-attention block, `norm`).
Decoding runs over a contiguous cache (`generate`) or the serving engine's paged one, each
sequence's Gated DeltaNet states in a state slot beside the pages (`state_slots`).
The hybrid's plumbing (`check_layer_types`, `holds_full_attention`, `linear_layer_settings`)
serves Kimi Linear's too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from flaxlm.models import (
    attention,
    gated_deltanet,
    glm4_moe,
    layers,
    masks,
    moe,
    mtp,
    options,
    qwen_moe,
    rope,
    stacks,
)
from flaxlm.models.causal_lm import CausalLM

Array = jax.Array

MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
ARCHITECTURES = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
LINEAR, FULL = "linear_attention", "full_attention"  # HF's layer_types entries


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(
    moe.DenseFirstScan,
    options.ParamCounts,
    glm4_moe.PartialRotary,
    rope.RopeScaling,
    moe.MoEOptions,
    mtp.MtpOptions,
):
    """Qwen3-Next / Qwen3.5 text hyper-parameters (HF's names where they exist); the
    defaults are Qwen3-Next-80B-A3B's. `num_experts` 0: dense MLPs only (Qwen3.5 text)."""

    vocab_size: int = 151936
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 2048
    num_layers: int = 48  # HF: num_hidden_layers
    num_heads: int = 16  # HF: num_attention_heads
    num_kv_heads: int | None = 2  # HF: num_key_value_heads; None: num_heads
    head_dim: int | None = 256  # None: hidden_size // num_heads
    intermediate_size: int = 5120  # the dense MLPs' (none in Qwen3.5 MoE)
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25  # rotary covers this fraction of each head
    attention_bias: bool = False  # biases on q, k, v and o
    tie_word_embeddings: bool = False
    activation: str = "silu"  # HF: hidden_act (the MLPs' and the convolution's)
    # Each layer's 'linear_attention' or 'full_attention'; None: every
    # `full_attention_interval`-th layer full, the others linear.
    layer_types: tuple[str, ...] | None = None
    full_attention_interval: int = 4
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # Positions per chunk of the chunked gated delta rule (training, prefill): memory and
    # work per chunk grow with its square, the sequential steps with length / chunk.
    linear_attention_chunk_size: int = 64
    # Qwen3.5's multimodal rotary sections (one text stream: plain rotary), kept for export.
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    model_type: str = "qwen3_next"  # one of MODEL_TYPES
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True

    # What llama.LlamaBlock reads beside the fields: (1 + w) RMSNorms, no MLP biases.
    norm_scale_plus_one: ClassVar[bool] = True
    mlp_bias: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for name in ("layer_types", "mrope_section", "mlp_only_layers"):  # Gin, JSON: lists
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        super().__post_init__()
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r}: expected one of {MODEL_TYPES}.")
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
        glm4_moe.check_rotary(self)
        self._check_layers()
        self._check_linear()
        self._check_moe()
        if self.model_type == "qwen3_next" and self.mrope_section is not None:
            raise ValueError("mrope_section is Qwen3.5's: set it None for model_type qwen3_next.")
        self.check_mtp()

    def check_mtp(self) -> None:
        """The Hub's files hold one MTP layer and one norm after it (`mtp.norm`)."""
        self.check_mtp_counts()
        if self.num_mtp_layers > 1:
            raise ValueError(
                f"num_mtp_layers {self.num_mtp_layers}: Qwen3-Next's and Qwen3.5's files hold "
                "one MTP layer (and one norm after it): set 1 or 0."
            )

    def mtp_block_fields(self) -> dict[str, Any]:
        """The MTP block: full attention (every layer full, whatever their number), the MLP
        of a sparse layer (vLLM's)."""
        return {"mlp_only_layers": (), "layer_types": None, "full_attention_interval": 1}

    def _check_layers(self) -> None:
        if self.full_attention_interval < 1:
            raise ValueError(
                f"full_attention_interval {self.full_attention_interval} must be >= 1."
            )
        check_layer_types(self)

    def _check_linear(self) -> None:
        for name in (
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_attention_chunk_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1.")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads {self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}."
            )

    def _check_moe(self) -> None:
        if self.model_type == "qwen3_5_text":
            if self.num_experts:
                raise ValueError(
                    f"num_experts {self.num_experts}: Qwen3.5 text (qwen3_5_text) is dense; "
                    "set 0, or model_type 'qwen3_5_moe_text'."
                )
            return
        if self.model_type == "qwen3_5_moe_text":
            # HF's Qwen3.5 MoE: every layer sparse, the top k renormalised.
            fixed = dict(decoder_sparse_step=1, mlp_only_layers=(), norm_topk_prob=True)
            glm4_moe.check_fixed(self, fixed, "Qwen3_5MoeForCausalLM")
            if not self.num_experts:
                raise ValueError("num_experts 0: qwen3_5_moe_text has experts in every layer.")
        if not self.num_experts:
            return
        self.check_moe()
        if self.router != "softmax_topk" or self.shared_expert_intermediate_size < 1:
            raise ValueError(
                f"router {self.router!r}, shared_expert_intermediate_size "
                f"{self.shared_expert_intermediate_size}: HF's {self.model_type} routes by "
                "'softmax_topk' and always has a shared expert (> 0)."
            )

    # ------------------------------------------------------------ derived

    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """Each layer's type: `layer_types`, or every `full_attention_interval`-th full."""
        if self.layer_types is not None:
            return self.layer_types
        every = self.full_attention_interval
        return tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(self.num_layers))

    def scan_kinds(self) -> list[tuple[str, bool]]:
        """Each layer's kind for the scan's cycle (`hybrid_kinds`): 4 layers a cycle for three
        linear layers and a full one (`full_attention_interval`)."""
        return hybrid_kinds(self)

    def sparse_layers(self, num_layers: int | None = None) -> tuple[bool, ...]:
        """Whether each layer's MLP is the mixture of experts (none without experts)."""
        num_layers = self.num_layers if num_layers is None else num_layers
        if not self.num_experts:
            return (False,) * num_layers
        return super().sparse_layers(num_layers)

    @property
    def projection(self) -> str:
        """How a linear layer projects (`gated_deltanet.PROJECTIONS`)."""
        return "grouped" if self.model_type == "qwen3_next" else "split"

    def linear_attention_params(self) -> int:
        """One linear layer's: projections, convolution, decay, norm, output."""
        e, hv = self.hidden_size, self.linear_num_value_heads
        kd = self.linear_num_key_heads * self.linear_key_head_dim
        vd = hv * self.linear_value_head_dim
        conv = (2 * kd + vd) * self.linear_conv_kernel_dim
        return e * (2 * kd + 2 * vd + 2 * hv) + conv + 2 * hv + self.linear_value_head_dim + vd * e

    def full_attention_params(self) -> int:
        """One full layer's: q (with its gates), k, v, o, their biases, the q/k norms."""
        e, d = self.hidden_size, self.dim_per_head
        q, kv = self.num_heads * d, self.kv_heads * d
        bias = 2 * q + 2 * kv + e if self.attention_bias else 0
        return e * (2 * q + 2 * kv) + q * e + bias + 2 * d

    def param_counts(self) -> tuple[int, int]:
        """(all, active per token) params."""
        e, v = self.hidden_size, self.vocab_size
        total = active = v * e + e + (0 if self.tie_word_embeddings else v * e)
        moe_all, moe_active = self.moe_params(e) if self.num_experts else (0, 0)
        dense = 3 * e * self.intermediate_size
        for kind, sparse in zip(self.per_layer_types, self.sparse_layers(), strict=True):
            mixer = (
                self.linear_attention_params() if kind == LINEAR else self.full_attention_params()
            )
            total += mixer + 2 * e + (moe_all if sparse else dense)
            active += mixer + 2 * e + (moe_active if sparse else dense)
        # An MTP layer: a full-attention block, three norms and the 2 x hidden -> hidden `fc`.
        extra = self.full_attention_params() + 2 * e + 3 * e + 2 * e * e
        total += self.num_mtp_layers * (extra + (moe_all if self.num_experts else dense))
        active += self.num_mtp_layers * (extra + (moe_active if self.num_experts else dense))
        return total, active

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x the active matmul params, the full layers' attention
        scores, and (an estimate) the chunked delta rule's: per value head the state's three
        products and the chunk's scores, system and solve, x 3 for the backward."""
        lookup = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        types = self.per_layer_types
        full_layers = types.count(FULL) + self.num_mtp_layers  # an MTP layer's is full
        full = 12.0 * self.num_heads * self.dim_per_head * seq_len * full_layers
        dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
        c = min(self.linear_attention_chunk_size, seq_len)
        rule = 3.0 * self.linear_num_value_heads * (6 * dk * dv + c * (5 * dk + 3 * dv))
        head = self.num_mtp_layers * self.vocab_size * self.hidden_size  # the MTP's logits
        return 6.0 * (self.active_params() - lookup + head) + full + rule * types.count(LINEAR)

    def make_module(self) -> Qwen3Next:
        return Qwen3Next(self)


def hybrid_kinds(config: Any) -> list[tuple[str, bool]]:
    """Each layer's (token mixer, MoE MLP or not): the kinds a hybrid's scan cycles through
    (`moe.DenseFirstScan.scan_kinds`)."""
    sparse = config.sparse_layers(config.num_layers)
    return list(zip(config.per_layer_types, sparse, strict=True))


def check_layer_types(cfg: Any) -> None:
    """A hybrid's `layer_types` (None: its family's default): `num_layers` entries, each
    LINEAR or FULL (Qwen3-Next's and Kimi Linear's)."""
    types = cfg.layer_types
    if types is not None and (
        len(types) != cfg.num_layers or any(t not in (LINEAR, FULL) for t in types)
    ):
        raise ValueError(
            f"layer_types {types}: expected num_layers ({cfg.num_layers}) entries, each "
            f"{LINEAR!r} or {FULL!r}."
        )


def holds_full_attention(block: nn.Module) -> bool:
    """Whether a hybrid's block (Qwen3-Next's, Kimi Linear's) holds full attention, not a
    linear layer: its config's `per_layer_types` at the layer it stands for (a scanned
    block's first; the scan's cycle repeats it)."""
    cfg = block.config
    return cfg.per_layer_types[stacks.layer_of(block, cfg.first_scanned_layer)] == FULL


def linear_layer_settings(cfg: Any) -> dict[str, Any]:
    """The settings of a hybrid's linear layer (`gated_deltanet.DeltaRuleLayer`'s, the width
    and the norm's epsilon) that Qwen3-Next's and Kimi Linear's configs name alike."""
    return dict(
        hidden_size=cfg.hidden_size,
        conv_kernel_size=cfg.linear_conv_kernel_dim,
        activation=cfg.activation,
        norm_eps=cfg.rms_norm_eps,
        chunk_size=cfg.linear_attention_chunk_size,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
    )


class Qwen3NextBlock(qwen_moe.QwenMoeBlock):
    """Llama's pre-norm block ((1 + w) RMSNorms) whose token mixer is this layer's type:
    `GatedDeltaNet` (`linear_attn`) or gated rotary attention; its MLP the mixture of
    experts or a dense SwiGLU (`mlp`, `qwen_moe.QwenMoeBlock`'s)."""

    def self_attention(
        self,
        h: Array,
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
    ) -> Array:
        if holds_full_attention(self):
            return super().self_attention(h, index, mask, decoding, sin, cos)
        cfg = self.config
        return gated_deltanet.GatedDeltaNet(
            num_key_heads=cfg.linear_num_key_heads,
            num_value_heads=cfg.linear_num_value_heads,
            key_dim=cfg.linear_key_head_dim,
            value_dim=cfg.linear_value_head_dim,
            projection=cfg.projection,
            name="linear_attn",
            **linear_layer_settings(cfg),
        )(h, mask, decoding)

    def attention_options(self) -> dict[str, Any]:
        bias = self.config.attention_bias
        return dict(qkv_bias=bias, out_bias=bias, qk_norm="rms_plus_one", output_gate=True)


class Qwen3Next(CausalLM):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = Qwen3NextBlock
    layer_index = True

    after_trunk = mtp.after_trunk  # the MTP layer where the config has it

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, Array]]:
        return x, rope.sin_cos(positions, self.config, dim=self.config.rotary_dim)

    def final_norm(self, x: Array) -> Array:
        cfg = self.config
        return layers.RMSNorm(
            cfg.rms_norm_eps,
            scale_plus_one=True,
            dtype=jnp.float32,
            param_dtype=cfg.param_dtype,
            name="norm",
        )(x)
