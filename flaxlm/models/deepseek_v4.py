"""DeepSeek-V4 (`deepseek_v4`): its config and `DeepseekV4LM`, the model that decodes it; a
residual of `hc_mult` streams mixed by hyper-connections around each attention and
mixture-of-experts sublayer (the modules: `deepseek_v4_streams.py`).

Attention is `deepseek_v4_attention`'s, of the kind `layer_types` gives each layer; every
MLP is `deepseek_v4_moe`'s mixture of experts, hash-routed or top-k by `mlp_layer_types`.
Follows HuggingFace's `DeepseekV4ForCausalLM`.

Multi-token prediction (`num_mtp_layers`, `mtp.py`'s loss; the Hub's files keep one layer,
`mtp.0.*`, which transformers skips and the import reads only when asked): depth k at
position i RMS-normalises the embedding of token i + k (`enorm`) and each of the previous
depth's streams (`hnorm`; depth 0: the trunk's, before its `HyperHead`), adds `e_proj` of the
one to `h_proj` of each of the others, runs one block of the kind `mtp_layer_types` gives
(sliding-window attention and a top-k routed MoE in the release) over those streams, and
collapses them with its own `HyperHead` and `norm` into the hidden state the model's head
reads; depth k + 1 reads its streams. This is DeepSeek's reference `MTPBlock` (transformers
has no V4 MTP), run over whole sequences with the rotary at token i + k's position, as
`mtp.py` does for DeepSeek-V3.

`DeepseekV4LM` decodes over a contiguous cache of its own (`deepseek_v4_attention`'s module
docstring: each layer's sliding window of keys, its compressors' open windows and their
compressed entries), its rows right-padded so that each row's windows count from its first
token: `generate`'s greedy, sampling and beam search. The serving engine holds the same
caches in state slots (no pages: `DeepseekV4LM.paged_cache`) and reads a dispatch in one
pass, each row from its own position (`paged_logits`: a chunk of a prompt, fresh or resuming
a sequence, or a step); its prefix cache resumes a prompt from the state snapshot after a
cached prefix. A plain `DecoderOnlyModel` of the family refuses
both the left-padded and the paged KV cache of the other families
(`deepseek_v4_streams.LEFT_PADDED`, `NO_PAGED`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import jax
import jax.numpy as jnp

from flaxlm.models import (
    decoding,
    deepseek_v4_streams,
    glm4_moe,
    layers,
    masks,
    moe,
    mtp,
    options,
    rope,
    stacks,
)
from flaxlm.models import state_slots as slot_pools
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.deepseek_v4_attention import CSA, HCA, LAYER_TYPES, SLIDING

Array = jax.Array

MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")  # HF's ACT2FN has no 'softmax' for V4's router


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DeepseekV4Config(options.ParamCounts, rope.RopeScaling, moe.MoEOptions, mtp.MtpOptions):
    """DeepSeek-V4 hyper-parameters (HF's names where they exist; `num_experts` is HF's
    `n_routed_experts`, `csa_compress_rate` / `hca_compress_rate` its `compress_rates`; the
    RopeScaling fields scale the 'compress' rotary only); the defaults are transformers'
    `DeepseekV4Config`'s (DeepSeek-V4-Flash's shapes)."""

    vocab_size: int = 129280
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 4096
    num_layers: int = 43  # HF: num_hidden_layers
    num_heads: int = 64  # HF: num_attention_heads (one shared key-value head)
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64  # HF: head_dim x partial_rotary_factor, the last features
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # the 'main' rotary (sliding-window layers)
    compress_rope_theta: float = 160000.0  # the 'compress' rotary (CSA / HCA layers)
    # Each layer's attention, one of LAYER_TYPES (None: HF's default, two HCA then CSA / HCA).
    layer_types: tuple[str, ...] | None = None
    csa_compress_rate: int = 4
    hca_compress_rate: int = 128
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Each layer's MoE, one of MLP_LAYER_TYPES (None: HF's default, three 'hash_moe' first).
    mlp_layer_types: tuple[str, ...] | None = None
    scoring_func: str = "sqrtsoftplus"
    tie_word_embeddings: bool = False
    activation: str = "silu"  # HF: hidden_act
    num_experts: int = 256
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    score_correction_bias: bool = True  # on 'moe' layers ('hash_moe' choose by the table)
    n_shared_experts: int = 1
    swiglu_limit: float | None = 10.0
    # HF adds the aux loss only with output_router_logits (False by default): none here.
    router_aux_loss_coef: float = 0.0
    # The attention of each MTP layer the files hold (at least `num_mtp_layers`, the ones
    # built: mtp.MtpOptions), one of LAYER_TYPES; None: sliding-window, the release's
    # (config.json's `compress_ratios` ends with a 0 for it). `mtp_kinds()` reads it.
    mtp_layer_types: tuple[str, ...] | None = None

    model_type: ClassVar[str] = "deepseek_v4"
    architecture: ClassVar[str] = "DeepseekV4ForCausalLM"

    def __post_init__(self) -> None:
        n = self.num_layers
        if self.layer_types is None:
            mixed = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            object.__setattr__(self, "layer_types", (HCA,) * min(n, 2) + tuple(mixed))
        if self.mlp_layer_types is None:
            kinds = ("hash_moe",) * min(n, 3) + ("moe",) * max(n - 3, 0)
            object.__setattr__(self, "mlp_layer_types", kinds)
        if self.mtp_layer_types is not None:
            object.__setattr__(self, "mtp_layer_types", tuple(self.mtp_layer_types))
        for name in ("layer_types", "mlp_layer_types"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        super().__post_init__()
        self.check_moe()
        fixed = dict(
            router="softmax_topk", n_group=1, topk_group=1, norm_topk_prob=True,
            score_correction_bias=True, n_shared_experts=1, shared_expert_intermediate_size=0,
            decoder_sparse_step=1, mlp_only_layers=(), router_bias=False, expert_bias=False,
            router_scales_input=False, per_expert_scale=False, swiglu_alpha=1.702,
            dropout_rate=0.0,
        )  # fmt: skip
        glm4_moe.check_fixed(self, fixed, self.architecture)
        self.check_mtp()
        self.check_kinds()
        self.check_shapes()

    def check_kinds(self) -> None:
        """ValueErrors naming `layer_types`, `mlp_layer_types`, `scoring_func` or the
        settings their kinds rule out."""
        for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            kinds = getattr(self, name)
            if len(kinds) != self.num_layers or not set(kinds) <= set(allowed):
                raise ValueError(
                    f"{name} {list(kinds)}: one of {allowed} for each of the "
                    f"{self.num_layers} layers."
                )
        kinds = self.mtp_layer_types
        if kinds is not None and (
            len(kinds) < self.num_mtp_layers or not set(kinds) <= set(LAYER_TYPES)
        ):
            raise ValueError(
                f"mtp_layer_types {list(kinds)}: one of {LAYER_TYPES} for each of the "
                f"{self.num_mtp_layers} MTP layers (num_mtp_layers) at least."
            )
        if self.attention not in ("auto", "xla"):
            raise ValueError(
                f"attention {self.attention!r}: DeepSeek-V4's attention (sinks, compressed "
                "entries) runs XLA's einsums only: 'auto' or 'xla'."
            )
        if self.moe_impl not in ("dense", "dropless"):
            raise ValueError(f"moe_impl {self.moe_impl!r}: DeepSeek-V4 runs 'dense' or 'dropless'.")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func {self.scoring_func!r}: expected one of {SCORING_FUNCS}."
            )
        if self.correction_bias_update_rate and "hash_moe" in self.mlp_layer_types:
            raise ValueError(
                "correction_bias_update_rate > 0 moves every MoE layer's correction bias, but "
                "'hash_moe' layers (mlp_layer_types) have none: set it 0."
            )

    @property
    def first_scanned_layer(self) -> int:
        """`scan_layers`' layout (`stacks.layout_of` each layer's (attention, MoE) kinds):
        DeepSeek-V4-Flash's three hash-routed layers unrolled, then cycles of (HCA, CSA)."""
        return stacks.layout_of(self.scan_kinds())[0]

    @property
    def scan_period(self) -> int:
        """The layers of the scan's cycle (`first_scanned_layer`'s layout)."""
        return stacks.layout_of(self.scan_kinds())[1]

    @property
    def scan_tail(self) -> int:
        """The last layers, unrolled after the cycles (`first_scanned_layer`'s layout)."""
        return stacks.layout_of(self.scan_kinds())[2]

    def scan_kinds(self) -> list[tuple[str, str]]:
        """Each layer's (attention, MoE) kind: what a scan's cycle repeats."""
        return list(zip(self.layer_types, self.mlp_layer_types, strict=True))

    def mtp_kinds(self) -> tuple[str, ...]:
        """The attention kind of each of the `num_mtp_layers` MTP layers."""
        kinds = self.mtp_layer_types or (SLIDING,) * self.num_mtp_layers
        return tuple(kinds[: self.num_mtp_layers])

    def mtp_block_config(self, k: int) -> DeepseekV4Config:
        """The config MTP layer `k` (from 0) is built with: one layer of its attention kind
        (`mtp_layer_types`), top-k routed."""
        return dataclasses.replace(
            self,
            num_layers=1,
            layer_types=(self.mtp_kinds()[k],),
            mlp_layer_types=("moe",),
            num_mtp_layers=0,
            mtp_loss_weight=0.0,
            mtp_layer_types=None,
            scan_layers=False,
        )

    def check_shapes(self) -> None:
        """ValueErrors naming the width that cannot be."""
        sizes = (
            "head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "hc_mult",
            "hc_sinkhorn_iters",
            "csa_compress_rate",
            "hca_compress_rate",
            "sliding_window",
            "num_heads",
        )
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be positive.")
        rot = self.qk_rope_head_dim
        if rot < 2 or rot % 2 or rot > min(self.head_dim, self.index_head_dim):
            raise ValueError(
                f"qk_rope_head_dim {rot} must be even, >= 2 and at most head_dim "
                f"{self.head_dim} and index_head_dim {self.index_head_dim}."
            )
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError(
                f"o_groups {self.o_groups} must divide num_heads x head_dim "
                f"({self.num_heads * self.head_dim})."
            )

    def param_counts(self) -> tuple[int, int]:
        """(all, active per token) params; the hash tables count, as they are params here."""
        e, v, f, hc = self.hidden_size, self.vocab_size, self.moe_intermediate_size, self.hc_mult
        h, d, ql, r, g = (
            self.num_heads,
            self.head_dim,
            self.q_lora_rank,
            self.o_lora_rank,
            self.o_groups,
        )
        mix = (2 + hc) * hc
        attn = e * ql + ql + ql * h * d + e * d + d + h * d * r + g * r * e + h
        hi, di = self.index_n_heads, self.index_head_dim
        pooled = {
            SLIDING: 0,
            HCA: 2 * e * d + self.hca_compress_rate * d + d,
            CSA: 4 * e * d + 2 * self.csa_compress_rate * d + d
            + 4 * e * di + 2 * self.csa_compress_rate * di + di + ql * hi * di + e * hi,
        }  # fmt: skip
        hyper = 2 * (mix * hc * e + mix + 3) + 2 * e
        router = {"moe": e * self.num_experts + self.num_experts, "hash_moe": e * self.num_experts}
        router["hash_moe"] += v * self.num_experts_per_tok
        head = hc * hc * e + hc + 1 + e  # a HyperHead and the norm after it
        total = active = v * e * (1 if self.tie_word_embeddings else 2) + head
        blocks = list(zip(self.layer_types, self.mlp_layer_types, strict=True))
        # An MTP layer: its block (top-k routed), enorm, hnorm, e_proj, h_proj, head and norm.
        blocks += [(kind, "moe") for kind in self.mtp_kinds()]
        total += self.num_mtp_layers * (2 * e + 2 * e * e + head)
        active += self.num_mtp_layers * (2 * e + 2 * e * e + head)
        for kind, mlp in blocks:
            block = attn + pooled[kind] + hyper + router[mlp] + 3 * e * f
            total += block + self.num_experts * 3 * e * f
            active += block + self.num_experts_per_tok * 3 * e * f
        return total, active

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x the active matmul params (not the lookups: the
        embedding's, the hash tables') plus the attention over each layer's keys (its window
        and the compressed entries it reads); with MTP layers, each one's block and its pass
        through the head too."""
        lookup = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        lookup += (
            self.mlp_layer_types.count("hash_moe") * self.vocab_size * self.num_experts_per_tok
        )
        keys = {
            SLIDING: 0,
            HCA: seq_len // self.hca_compress_rate,
            CSA: min(self.index_topk, seq_len // self.csa_compress_rate),
        }
        kinds = (*self.layer_types, *self.mtp_kinds())
        context = sum(min(seq_len, self.sliding_window) + keys[k] for k in kinds)
        head = self.num_mtp_layers * self.vocab_size * self.hidden_size  # each depth's logits
        return (
            6.0 * (self.active_params() - lookup + head)
            + 12.0 * self.num_heads * self.head_dim * context
        )

    def make_module(self) -> deepseek_v4_streams.DeepseekV4:
        return deepseek_v4_streams.DeepseekV4(self)


@gin.configurable
class DeepseekV4LM(DecoderOnlyModel):
    """A decoder-only model of DeepSeek-V4 with its own contiguous decoding cache
    (`deepseek_v4_attention`): the prompts right-padded and read whole, each row's tokens
    from position 0 (`masks.Decoding.slots`: each token's position, -1 past the row's end),
    then one token a step at each row's own position. Greedy, sampling and beam search; the
    serving engine's cache in state slots (`paged_cache`, `paged_logits`); training,
    evaluation and scoring run as any family's."""

    def paged_refusal(self) -> str | None:
        return None

    def paged_cache(
        self, num_pages: int, page_size: int, max_rows: int = 1, max_seq_len: int | None = None
    ) -> Any:
        """The serving engine's cache: no pages (nothing here is paged), every layer's cache
        (the module docstring's, each leaf a `decoding.RECURRENT_STATE`) as a pool of
        `max_rows + 1` state slots, slot 0 the padding rows' scratch, the compressed entries
        sized for `max_seq_len` positions (None: `num_pages x page_size`)."""
        length = max_seq_len or num_pages * page_size
        rows = max_rows + 1

        def init_cache() -> Any:
            one = jnp.zeros((rows, 1), jnp.int32)
            where = masks.Decoding(jnp.int32(0), one[:, 0], length, slots=one)
            module = self._decode_module()
            return module.init(jax.random.PRNGKey(0), one, one, None, decoding=where)["cache"]

        return decoding.empty_cache(init_cache)

    def paged_logits(
        self,
        params: Any,
        cache: Any,
        tokens: Array,
        slots: Array,
        page_table: Array,
        last: Array,
        paged_attention: str = "gather",
        state_slots: Array | None = None,
    ) -> tuple[Array, Any]:
        """The serving engine's read (`CachedDecoding.paged_logits`) over `paged_cache`'s
        pools: each row's cache gathered from its state slot (zeros where the row starts
        its sequence at position 0), its tokens read in one pass from its own first slot on
        (`deepseek_v4_cache`: a prompt's chunk, fresh or resuming, or a decoding step;
        padding, slot -1, after a row's tokens or filling a row, writes nothing), the caches
        scattered back. `page_table` and `paged_attention` have nothing to read here."""
        del page_table, paged_attention
        if state_slots is None:
            raise ValueError(
                "DeepSeek-V4 decodes over the engine's state slots: state_slots is None."
            )
        rows, length = tokens.shape
        # Each row's slot, zeros where it starts its sequence (`state_slots.gather`); length
        # 0: the cache exists, the read continues it.
        where = masks.Decoding(
            jnp.int32(0), jnp.zeros((rows,), jnp.int32), 0, slots=slots, state_slots=state_slots
        )
        own = jax.tree.map(lambda pool: slot_pools.gather(pool, where), cache)
        positions = jnp.maximum(slots[:, :1], 0) + jnp.arange(length, dtype=jnp.int32)
        real = (slots >= 0).astype(jnp.int32)
        hidden, own = self._read(params, own, tokens, positions, real, where)
        hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
        cache = jax.tree.map(lambda pool, x: slot_pools.scatter(pool, where, x), cache, own)
        return self._logits_of(params, hidden), cache

    def prefill(
        self, params: Any, inputs: Array, lengths: Array, config: decoding.DecodingConfig
    ) -> tuple[Array, dict[str, Any]]:
        inputs, lengths = (jnp.repeat(x, config.num_beams, axis=0) for x in (inputs, lengths))
        rows, prompt_len = inputs.shape
        positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), inputs.shape)
        real = positions < lengths[:, None]
        where = masks.Decoding(
            jnp.int32(0),
            jnp.zeros((rows,), jnp.int32),
            prompt_len + config.max_new_tokens,
            slots=jnp.where(real, positions, -1),
        )
        hidden, cache = self._read(params, {}, inputs, positions, real.astype(jnp.int32), where)
        last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)
        return self._logits_of(params, last), {"cache": cache, "lengths": lengths}

    def decode_step(
        self,
        params: Any,
        token: Array,
        t: Array,
        state: dict[str, Any],
        config: decoding.DecodingConfig,
    ) -> tuple[Array, dict[str, Any]]:
        # Beams of one row share its length: reordering them leaves `lengths` right.
        lengths = state["lengths"]
        rows = token.shape[0]
        # length 0: the cache prefill made gives the sizes.
        where = masks.Decoding(
            jnp.int32(0), jnp.zeros((rows,), jnp.int32), 0, slots=lengths[:, None]
        )
        hidden, cache = self._read(
            params, state["cache"], token[:, None], lengths[:, None], None, where
        )
        return self._logits_of(params, hidden), {"cache": cache, "lengths": lengths + 1}

    def _read(
        self,
        params: Any,
        cache: Any,
        tokens: Array,
        positions: Array,
        segment_ids: Array | None,
        where: masks.Decoding,
    ) -> tuple[Array, Any]:
        """The final hidden states of `tokens` at `positions` and the cache after them."""
        with layers.decoding_products():
            hidden, variables = self._decode_module().apply(
                {"params": params, "cache": cache}, tokens, positions, segment_ids,
                decoding=where, return_hidden=True, mutable=["cache"],
            )  # fmt: skip
        return hidden, variables["cache"]

    def _logits_of(self, params: Any, hidden: Array) -> Array:
        """float32 `[rows, vocab]` of the final hidden states `hidden` `[rows, 1, embed]`."""
        return self._mask_padded_vocab(self._decode_module().head_logits(params, hidden)[:, 0])
