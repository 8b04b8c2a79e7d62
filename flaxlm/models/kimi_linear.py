"""Kimi Linear (`kimi_linear`): a hybrid of Kimi Delta Attention (linear attention,
`kimi_delta.py`) and multi-head latent attention without rotary, on DeepSeek-V3's MoE.

Each layer is 'linear_attention' (`kimi_delta.KimiDeltaAttention`) or 'full_attention'
(`layer_types`; by default every fourth from the fifth full, HF's; the published 48B-A3B
file lists its own: `gin/models/kimi_linear_48b_a3b.gin`). A full layer is DeepSeek-V3's
latent attention (`mla.py`) with no position encoding at all (NoPE): the shared key part of
`qk_rope_head_dim` features is not rotated, so `qk_rope_head_dim` may be odd. Its MLP is
DeepSeek-V3's mixture of experts (sigmoid scores, `e_score_correction_bias`, group-limited
choice, `routed_scaling_factor`, `n_shared_experts` ungated shared experts) or a dense SwiGLU
on the layers `mlp_only_layers` names (HF's dense `mlp_layer_types`, by default the first).
RMSNorms multiply by w (eps `rms_norm_eps`; the latent norms at HF's 1e-6).

Follows transformers' `KimiLinearForCausalLM` (the HF mapping: `kimi_linear_hf.py`). Its
head is never tied to the embedding (HF's model keeps both, whatever tie_word_embeddings
says). Decoding runs over a contiguous cache or the serving engine's paged one (each
sequence's Kimi Delta Attention states in a state slot beside the pages: `state_slots`).
Under context parallelism (a `sequence` mesh axis) the linear layers pass their state
between the pieces of a row (`linear_context_parallel`) and the full ones attend across
them (`context_parallel`; no rotary to place). `scan_layers` stacks the cycle the layers'
(token mixer, MLP) kinds repeat after the dense first ones, the layers after its last whole
repeat unrolled (`scan_kinds`). The hybrid's plumbing is Qwen3-Next's
(`qwen3_next.check_layer_types`, `holds_full_attention`, `hybrid_kinds`,
`linear_layer_settings`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import jax

from flaxlm.models import deepseek, glm4_moe, kimi_delta, masks, qwen3_next

Array = jax.Array

MODEL_TYPE = "kimi_linear"
ARCHITECTURE = "KimiLinearForCausalLM"
LINEAR, FULL = "linear_attention", "full_attention"  # HF's layer_types entries
# What HF's KimiLinear hard-wires among the options DeepSeek-V3's config holds (no rotary:
# no rope scaling, whose YaRN would scale the scores).
FIXED = dict(
    rope_scaling_type=None,
    router="sigmoid_topk",
    score_correction_bias=True,
    shared_expert_intermediate_size=0,
    router_bias=False,
    expert_bias=False,
    router_scales_input=False,
    per_expert_scale=False,
    swiglu_limit=None,
    tie_word_embeddings=False,
)


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """HF's `layer_types` when config.json names none: layer i full if i > 0 and i % 4 == 0."""
    return tuple(FULL if i and i % 4 == 0 else LINEAR for i in range(num_layers))


@gin.configurable
@dataclasses.dataclass(frozen=True)
class KimiLinearConfig(deepseek.DeepseekV3Config):
    """Kimi Linear hyper-parameters: DeepSeek-V3's fields (HF's names where they exist;
    `num_experts` is HF's `num_local_experts`, `mlp_only_layers` its dense `mlp_layer_types`)
    and the linear layers'; the defaults are transformers' `KimiLinearConfig`'s
    (Kimi-Linear-48B-A3B's shapes, HF's default layer placement)."""

    vocab_size: int = 163840
    hidden_size: int = 2304
    num_layers: int = 27
    num_heads: int = 32  # HF: num_attention_heads (= num_key_value_heads)
    intermediate_size: int = 9216
    max_position_embeddings: int = 1048576  # HF: model_max_length
    rms_norm_eps: float = 1e-5
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 1024
    routed_scaling_factor: float = 2.446
    n_group: int = 1
    topk_group: int = 1
    mlp_only_layers: tuple[int, ...] = (0,)  # HF: first_k_dense_replace = 1
    rope_scaling_type: str | None = None  # no rotary: the rope fields are unused
    rope_scaling_factor: float = 1.0
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    # Each layer's 'linear_attention' or 'full_attention' (None: `default_layer_types`).
    layer_types: tuple[str, ...] | None = None
    linear_num_heads: int = 32
    linear_head_dim: int = 128  # queries', keys' and values' alike
    linear_conv_kernel_dim: int = 4
    # Positions per chunk of the chunked delta rule (training, prefill): memory and work
    # per chunk grow with its square, the sequential steps with length / chunk.
    linear_attention_chunk_size: int = 64

    rotary: ClassVar[bool] = False
    mtp_layers_built: ClassVar[bool] = False  # (Kimi Linear's files carry none)

    def __post_init__(self) -> None:
        if self.layer_types is not None:  # Gin, JSON: lists
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        super().__post_init__()
        glm4_moe.check_fixed(self, FIXED, ARCHITECTURE)
        if self.n_shared_experts < 1:
            raise ValueError(
                f"n_shared_experts {self.n_shared_experts}: HF's {ARCHITECTURE} always has "
                "its shared experts (n_shared_experts x moe_intermediate_size wide); >= 1."
            )
        qwen3_next.check_layer_types(self)
        for name in (
            "linear_num_heads",
            "linear_head_dim",
            "linear_conv_kernel_dim",
            "linear_attention_chunk_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1.")

    def check_dense_layers(self) -> None:
        """Dense layers anywhere (HF's `mlp_layer_types`): `scan_layers` stacks the cycle of
        (token mixer, MLP) kinds after dense first ones (`scan_kinds`)."""
        if self.decoder_sparse_step != 1:
            raise ValueError(
                f"decoder_sparse_step {self.decoder_sparse_step}: HF's {ARCHITECTURE} names "
                "its dense layers (mlp_only_layers); 1 only."
            )

    # ------------------------------------------------------------ derived

    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """Each layer's type: `layer_types`, or HF's default."""
        return self.layer_types or default_layer_types(self.num_layers)

    @property
    def mlp_layer_types(self) -> tuple[str, ...]:
        """HF's per-layer MLP kinds, 'dense' or 'sparse'."""
        return tuple("sparse" if s else "dense" for s in self.sparse_layers(self.num_layers))

    def scan_kinds(self) -> list[tuple[str, bool]]:
        """Each layer's kind for the scan's cycle: the published 27 layers, a dense first one
        unrolled, then six cycles of (linear, linear, full, linear) and two layers unrolled."""
        return qwen3_next.hybrid_kinds(self)

    def linear_attention_params(self) -> int:
        """One linear layer's: q, k, v and their convolution, the forget gate, beta, the
        output gate, norm and projection."""
        e, h, d = self.hidden_size, self.linear_num_heads, self.linear_head_dim
        width = h * d
        qkv = 3 * (e * width + width * self.linear_conv_kernel_dim)
        gates = 2 * (e * d + d * width)  # f_a, f_b, g_a, g_b
        return qkv + gates + width + h + e * h + d + width * e  # dt_bias, A_log, b, o_norm, o

    def param_counts(self) -> tuple[int, int]:
        """(all, active per token) params (the head never tied)."""
        e, v = self.hidden_size, self.vocab_size
        total = active = 2 * v * e + e
        moe_all, moe_active = self.moe_params(e)
        dense = 3 * e * self.intermediate_size
        kinds = zip(self.per_layer_types, self.sparse_layers(self.num_layers), strict=True)
        for kind, sparse in kinds:
            mixer = self.linear_attention_params() if kind == LINEAR else self.attention_params()
            total += mixer + 2 * e + (moe_all if sparse else dense)
            active += mixer + 2 * e + (moe_active if sparse else dense)
        return total, active

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x the active matmul params, the full layers' scores
        (queries . keys `qk_head_dim` wide, probabilities . values `v_head_dim` wide) and (an
        estimate) the chunked delta rule's: per head the state's three products and the
        chunk's scores, system and solve, x 3 for the backward."""
        types = self.per_layer_types
        widths = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        full = 6.0 * self.num_heads * widths * seq_len * types.count(FULL)
        d = self.linear_head_dim
        c = min(self.linear_attention_chunk_size, seq_len)
        rule = 3.0 * self.linear_num_heads * (6 * d * d + 8 * c * d)
        lookup = self.vocab_size * self.hidden_size
        return 6.0 * (self.active_params() - lookup) + full + rule * types.count(LINEAR)

    def make_module(self) -> KimiLinear:
        return KimiLinear(self)


class KimiLinearBlock(deepseek.DeepseekBlock):
    """DeepSeek-V3's block whose token mixer is this layer's type: Kimi Delta Attention or
    latent attention without rotary (both scoped `self_attn`, as HF's)."""

    def self_attention(
        self,
        h: Array,
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array | None,
        cos: Array | None,
    ) -> Array:
        if qwen3_next.holds_full_attention(self):
            return super().self_attention(h, index, mask, decoding, sin, cos)
        cfg = self.config
        return kimi_delta.KimiDeltaAttention(
            num_heads=cfg.linear_num_heads,
            head_dim=cfg.linear_head_dim,
            name="self_attn",
            **qwen3_next.linear_layer_settings(cfg),
        )(h, mask, decoding)


class KimiLinear(deepseek.Deepseek):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = KimiLinearBlock

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Any, ...]]:
        return x, (None, None)  # no sin and cos: nothing is rotated (NoPE)
