"""Qwen4-Exp text (`qwen4_exp_text`, and the text tower of the multimodal `qwen4_exp`
files): Qwen3.5-MoE's hybrid of Gated DeltaNet and gated full-attention layers on a residual
of `hc_count` streams (hyper-connections), the full-attention layers reading only the keys a
QSA indexer picks, Per-Layer Embeddings of hashed n-grams on the layers `ple_layer_ids` names.

Each layer is 'linear_attention' (`gated_deltanet.GatedDeltaNet`, its output gate
`output_gate_type`: silu or sigmoid) or 'indexed_attention' (HF's name; 'full_attention' in a
file reads as it): Qwen3-Next's gated attention ((1 + w) q/k norms, partial rotary, a
sigmoid output gate from `q_proj`) over the keys `qwen4_exp_layers.Indexer` selects. The
residual is `hc_count` copies of the embedding; before each token mixer and each MLP a
`GatedResidual` mixes the normalised streams into the sublayer's input and weights its
output back into every stream; `hyper_connection_mixer` mixes them into the head's input
(there is no final norm). A PLE layer (`qwen4_exp_ple`) adds to the streams before its layer.
Every MLP is a mixture of experts with a sigmoid-gated shared expert (Qwen2-MoE's). The
rotary is multimodal in HF (`mrope_section`); text has one position stream: plain rotary.

Follows transformers' `Qwen4ExpForCausalLM` (the HF mapping: `qwen4_exp_hf.py`). Decoding
runs over a contiguous cache (`generate`) or the serving engine's paged one (its 'gather'
attention: `PAGED`): each attention layer's keys and values and its indexer's raw keys in
slots (pages), each linear layer's Gated DeltaNet states and each PLE layer's last n-gram
context and convolution inputs carried per row (state slots beside the pages). Refused:
scanned layers (each PLE layer's hash constants are its own) and a multi-token-prediction
layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from flaxlm.models import attention, gated_deltanet, glm4_moe, masks, qwen_moe, rope, stacks
from flaxlm.models import qwen3_next as q3
from flaxlm.models.causal_lm import CausalLM
from flaxlm.models.qwen4_exp_layers import (
    GatedResidual,
    Indexer,
    SigmoidGatedDeltaNet,
    inject,
)
from flaxlm.models.qwen4_exp_ple import MAX_HEAD_VOCAB, PLELayer, ngram_tables, run_starts

Array = jax.Array

MODEL_TYPE = "qwen4_exp_text"
ARCHITECTURE = "Qwen4ExpForCausalLM"
PAGED = (
    "paged_attention: Qwen4-Exp's attention reads the keys its QSA indexer selects through "
    "a dense mask, which the paged cache's 'gather' attention takes (its kernel does not)."
)
_QSA = (
    "indexer_n_heads",
    "indexer_kv_heads",
    "indexer_head_dim",
    "indexer_budget",
    "indexer_compress_ratio",
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Qwen4ExpConfig(q3.Qwen3NextConfig):
    """Qwen4-Exp text hyper-parameters (HF's names where they exist); Qwen3NextConfig's
    fields with transformers' Qwen4ExpTextConfig defaults, and the family's own."""

    vocab_size: int = 248320
    num_layers: int = 40
    max_position_embeddings: int = 32768
    rope_theta: float = 1e4
    partial_rotary_factor: float = 1.0
    model_type: str = MODEL_TYPE
    num_experts_per_tok: int = 10
    hc_count: int = 4  # residual streams
    hc_lowrank: int = 320
    ple_layer_ids: tuple[int, ...] = ()  # one-indexed, HF's
    ple_embed_dim: int | None = None  # None: hidden_size
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    eos_token_id: int | None = None  # HF's first eos id: PLE's n-gram boundary
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    output_gate_type: str | None = None  # the linear layers' output gate; None: activation

    def __post_init__(self) -> None:
        for name in ("layer_types", "mrope_section", "mlp_only_layers", "ple_layer_ids"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "ple_layer_ids", tuple(sorted(set(self.ple_layer_ids))))
        if self.ple_embed_dim is None:
            object.__setattr__(self, "ple_embed_dim", self.hidden_size)
        if self.model_type != MODEL_TYPE:
            raise ValueError(f"model_type {self.model_type!r}: expected {MODEL_TYPE!r}.")
        super(q3.Qwen3NextConfig, self).__post_init__()  # the mixins': not Qwen3-Next's own
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
        glm4_moe.check_rotary(self)
        self._check_layers()
        self._check_linear()
        fixed = dict(decoder_sparse_step=1, mlp_only_layers=(), num_mtp_layers=0)
        glm4_moe.check_fixed(self, fixed, ARCHITECTURE)
        if not self.num_experts:
            raise ValueError("num_experts 0: Qwen4-Exp has experts in every layer.")
        self._check_moe()
        self._check_streams()
        self._check_qsa()
        self._check_ple()

    def _check_streams(self) -> None:
        gate = self.output_gate_type or self.activation
        if gate not in ("silu", "sigmoid"):
            raise ValueError(f"output_gate_type {gate!r}: HF's Qwen4-Exp has silu or sigmoid.")
        if self.hc_count < 2 or self.hc_lowrank < 1:
            raise ValueError(
                f"hc_count {self.hc_count}, hc_lowrank {self.hc_lowrank}: Qwen4-Exp needs "
                "hc_count > 1 and hc_lowrank >= 1."
            )
        if self.scan_layers:
            raise ValueError(
                "scan_layers=True: Qwen4-Exp's layers are unrolled (each PLE layer's hash "
                "constants and tables are its own); set it False."
            )

    def _check_qsa(self) -> None:
        values = {name: getattr(self, name) for name in _QSA}
        if q3.FULL not in self.per_layer_types and all(v is None for v in values.values()):
            return
        missing = [name for name, value in values.items() if value is None]
        if missing:
            raise ValueError(f"{missing[0]} is None: Qwen4-Exp's indexed attention needs {_QSA}.")
        for name, value in values.items():
            if value < 1:
                raise ValueError(f"{name} {value} must be >= 1.")
        if self.indexer_kv_heads != 1:
            raise ValueError(f"indexer_kv_heads {self.indexer_kv_heads}: Qwen4-Exp has 1.")
        if self.indexer_budget % self.indexer_compress_ratio:
            raise ValueError(
                f"indexer_budget {self.indexer_budget} must be a multiple of "
                f"indexer_compress_ratio {self.indexer_compress_ratio}."
            )
        if self.rotary_dim > self.indexer_head_dim:
            raise ValueError(
                f"indexer_head_dim {self.indexer_head_dim} is narrower than the rotary "
                f"({self.rotary_dim} features)."
            )

    def _check_ple(self) -> None:
        if not self.ple_layer_ids:
            return
        heads = (self.ngram_size - 1) * self.heads_per_ngram
        if heads < 1 or self.ple_embed_dim < 1 or self.ple_embed_dim % heads:
            raise ValueError(
                f"ple_embed_dim {self.ple_embed_dim} must be a positive multiple of the n-gram "
                f"heads ((ngram_size - 1) * heads_per_ngram = {heads})."
            )
        bad = [i for i in self.ple_layer_ids if not 1 <= i <= self.num_layers]
        if bad or any(self.per_layer_types[i - 1] != q3.LINEAR for i in self.ple_layer_ids):
            raise ValueError(
                f"ple_layer_ids {self.ple_layer_ids}: one-indexed linear_attention layers only."
            )
        if self.eos_token_id is None:
            raise ValueError("eos_token_id is None: Qwen4-Exp's PLE layers need it.")
        for name in ("ple_conv_kernel_size", "split_ngram_parts", "seed"):
            if getattr(self, name) < (0 if name == "seed" else 1):
                raise ValueError(f"{name} {getattr(self, name)} is out of range.")
        if self.make_ngram_vocab_size_divisible_by < 1 or self.ngram_vocab_size_base < 2:
            raise ValueError("make_ngram_vocab_size_divisible_by, ngram_vocab_size_base: >= 1.")
        tables = ngram_tables(self, len(self.ple_layer_ids) - 1)
        if tables.sizes[-1] >= MAX_HEAD_VOCAB or tables.rows >= 2**31:
            raise ValueError(
                f"ngram_vocab_size_base {self.ngram_vocab_size_base}: flaxlm hashes exactly "
                f"with head vocabularies below 2**28 and tables below 2**31 rows."
            )

    # ------------------------------------------------------------ derived

    @property
    def ple_layers(self) -> tuple[int, ...]:
        """The zero-indexed layers with PLE."""
        return tuple(i - 1 for i in self.ple_layer_ids)

    @property
    def vocab_size_for_ple(self) -> int:
        """HF's `vocab_size` (the real one): the multipliers' bound."""
        return self.real_vocab_size or self.vocab_size

    @property
    def ple_eos_id(self) -> int:
        return int(self.eos_token_id)

    def hyper_params(self, combine: bool) -> int:
        width = self.hc_count * self.hidden_size
        inject = width * self.hc_count if combine else 0
        return width + 2 * width * self.hc_lowrank + inject

    def ple_params(self, index: int) -> int:
        width, e = self.hc_count * self.hidden_size, self.ple_embed_dim
        heads = (self.ngram_size - 1) * self.heads_per_ngram
        table = ngram_tables(self, index).rows * (e // heads)
        return (
            table + e * (width + self.hidden_size) + 3 * width + width * self.ple_conv_kernel_size
        )

    def indexer_params(self) -> int:
        if self.indexer_n_heads is None:
            return 0
        d = self.indexer_head_dim
        return self.hidden_size * (self.indexer_n_heads + 1) * d + 2 * d

    def param_counts(self) -> tuple[int, int]:
        """(all, active per token) params: Qwen3.5-MoE's less its norms, plus the streams',
        the indexers' and the PLE layers'."""
        total, active = super().param_counts()
        e, n = self.hidden_size, self.num_layers
        extra = 2 * n * self.hyper_params(True) + self.hyper_params(False) - (2 * n + 1) * e
        extra += self.per_layer_types.count(q3.FULL) * self.indexer_params()
        ple = sum(self.ple_params(k) for k in range(len(self.ple_layer_ids)))
        # Each token reads one row of each head's table.
        heads = (self.ngram_size - 1) * self.heads_per_ngram
        rows = sum(ngram_tables(self, k).rows for k in range(len(self.ple_layer_ids)))
        ple_active = ple - (rows - heads * len(self.ple_layer_ids)) * (
            self.ple_embed_dim // max(heads, 1)
        )
        return total + extra + ple, active + extra + ple_active

    def make_module(self) -> Qwen4Exp:
        return Qwen4Exp(self)


class Qwen4ExpBlock(nn.Module):
    """One layer on the streams: `(streams, mask, decoding, sin, cos, tokens)` -> streams
    (the module docstring); padding (segment 0) reads as HF's masked padding."""

    config: Any
    deterministic: bool = True

    @nn.compact
    def __call__(
        self,
        streams: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
        tokens: Array,
    ) -> Array:
        cfg = self.config
        if decoding is not None and decoding.paged and decoding.paged_attention != "gather":
            raise ValueError(PAGED)
        i = stacks.layer_of(self, cfg.first_scanned_layer)
        segment_ids = getattr(mask, "q_segment_ids", None)  # a paged mask: an array
        starts = run_starts(segment_ids, *tokens.shape)
        if decoding is not None and decoding.paged:  # a row's padding: after its tokens
            real = decoding.slots >= 0
        elif decoding is not None:  # a left-padded row's padding: before its start
            slots = decoding.index + jnp.arange(tokens.shape[1])
            real = slots[None, :] >= decoding.start[:, None]
        elif segment_ids is None:
            real = jnp.ones(tokens.shape, bool)
        else:
            real = segment_ids > 0
        if i in cfg.ple_layers:
            ple = PLELayer(cfg, cfg.ple_layers.index(i), name="ple")
            tokens = jnp.where(real, tokens, cfg.ple_eos_id)  # HF reads padding as EOS
            streams = streams + ple(streams, tokens, starts, real, decoding)
        h, weights = GatedResidual(cfg, name="attn_hyper_connection")(streams)
        if cfg.per_layer_types[i] == q3.LINEAR:
            gate = cfg.output_gate_type or cfg.activation
            mixer = SigmoidGatedDeltaNet if gate == "sigmoid" else gated_deltanet.GatedDeltaNet
            out = mixer(
                num_key_heads=cfg.linear_num_key_heads,
                num_value_heads=cfg.linear_num_value_heads,
                key_dim=cfg.linear_key_head_dim,
                value_dim=cfg.linear_value_head_dim,
                projection="split",
                name="linear_attn",
                **q3.linear_layer_settings(cfg),
            )(h * real[..., None].astype(h.dtype), mask, decoding)
        else:
            visible = (mask.dense() if isinstance(mask, masks.Mask) else mask)[:, 0]
            indexer = Indexer(cfg, name="indexer")
            selected = indexer(h, sin, cos, visible, segment_ids, decoding)
            out = attention.rotary_self_attention(
                h, sin, cos, selected, decoding,
                num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.dim_per_head,
                hidden_size=cfg.hidden_size, qkv_bias=cfg.attention_bias,
                out_bias=cfg.attention_bias, attention=cfg.attention,
                chunk_size=cfg.attention_chunk_size, dtype=cfg.dtype,
                param_dtype=cfg.param_dtype, qk_norm="rms_plus_one", norm_eps=cfg.rms_norm_eps,
                output_gate=True,
            )  # fmt: skip
        streams = inject(streams, out, weights)
        h, weights = GatedResidual(cfg, name="mlp_hyper_connection")(streams)
        return inject(streams, qwen_moe.mlp_or_experts(self, cfg, h, mask), weights)


class Qwen4Exp(CausalLM):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = Qwen4ExpBlock

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, Array]]:
        cfg = self.config
        streams = jnp.tile(x, (1, 1, cfg.hc_count))
        return streams, rope.sin_cos(positions, cfg, dim=cfg.rotary_dim)

    def token_inputs(self, tokens: Array, x: Array) -> tuple[Any, ...]:
        return (tokens,)

    def final_norm(self, streams: Array) -> Array:
        mixed, _ = GatedResidual(self.config, combine=False, name="hyper_connection_mixer")(streams)
        return mixed
