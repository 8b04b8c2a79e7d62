"""Llama 4 (text): Llama's blocks with interleaved mixture-of-experts layers, NoPE layers and
chunked local attention.

Each layer is a rotary layer or a NoPE layer (`no_rope_layers`: 1 rotary, 0 none; by default
every `no_rope_layer_interval`-th is NoPE). Rotary layers rotate queries and keys in the
complex form, consecutive pairs of features (HF's `apply_rotary_emb`: the interleaved
layout), then L2-normalise every query and key head (`use_qk_norm`, no weight); NoPE layers
scale their queries by `1 + attn_scale * log1p(floor((slot + 1) / floor_scale))`
(`attn_temperature_tuning`). A layer of type 'chunked_attention' (`layer_types`; by default
the rotary ones) lets a query see only the keys of its own chunk of `local_chunk_size`
positions (HF's `attention_chunk_size`, the chunk counted from each row's first token).

The MoE layers (`moe_layers`, or every `interleave_moe_layer_step`-th) route each token to
its `num_experts_per_tok` experts by a sigmoid of the top router logits, applied to the
expert's input (`MoEOptions.router_scales_input`), plus an ungated shared expert; the other
layers are a SwiGLU of HF's `intermediate_size_mlp` (`intermediate_size` here). Follows
HuggingFace's `Llama4ForCausalLM` (model type 'llama4_text').
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from flaxlm.models import (
    attention,
    layers,
    llama,
    masks,
    moe,
    paged_attention,
    qwen_moe,
    rope,
    stacks,
)
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.causal_lm import CausalLM
from flaxlm.models.hf_spec import HFSpec, HFTensor, Multimodal, linear, per_kind, register_hf
from flaxlm.models.options import HeadShapes

Array = jax.Array

MODEL_TYPES = ("llama4_text",)
CHUNKED, FULL = "chunked_attention", "full_attention"  # HF's layer_types entries
NO_CHUNK = masks.NO_WINDOW  # a chunk longer than any sequence: one chunk, no limit


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Llama4Config(
    HeadShapes, moe.DenseFirstScan, qwen_moe.MoESizes, rope.RopeScaling, moe.MoEOptions
):
    """Llama 4 text hyper-parameters (HF's names but where said); the defaults are
    Llama-4-Scout-17B-16E's. The experts and the shared expert are `moe_intermediate_size`
    wide (HF: intermediate_size), the dense layers `intermediate_size` (HF:
    intermediate_size_mlp)."""

    vocab_size: int = 202048
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 5120
    num_layers: int = 48  # HF: num_hidden_layers
    num_heads: int = 40  # HF: num_attention_heads
    num_kv_heads: int | None = 8  # HF: num_key_value_heads; None: num_heads
    head_dim: int | None = 128  # None: hidden_size // num_heads
    intermediate_size: int = 16384  # the dense layers' MLP (HF: intermediate_size_mlp)
    max_position_embeddings: int = 10485760
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    attention_bias: bool = False  # biases on q, k, v and o
    tie_word_embeddings: bool = False
    activation: str = "silu"  # HF: hidden_act
    # Per layer 1 (rotary) or 0 (NoPE); None: NoPE every `no_rope_layer_interval`-th.
    no_rope_layers: tuple[int, ...] | None = None
    no_rope_layer_interval: int = 4
    # Per layer 'chunked_attention' or 'full_attention'; None: the rotary layers chunked.
    layer_types: tuple[str, ...] | None = None
    # The chunk of positions a 'chunked_attention' layer's query sees (HF:
    # attention_chunk_size). Not ComputeOptions' `attention_chunk_size`, the blocks in which
    # attention='chunked' computes any attention, which does not change what a query sees.
    local_chunk_size: int | None = 8192
    use_qk_norm: bool = True  # L2-normalise each query and key head on the rotary layers
    attn_temperature_tuning: bool = True  # scale the NoPE layers' queries by their slot
    floor_scale: int = 8192
    attn_scale: float = 0.1
    # MoEOptions as Llama 4 has them: a sigmoid of the top logits weighting the experts'
    # input, one ungated shared expert as wide as an expert.
    num_experts: int = 16  # HF: num_local_experts
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 8192  # HF: intermediate_size
    router: str = "sigmoid_topk"
    router_scales_input: bool = True
    n_shared_experts: int = 1
    # HF's Llama4ForCausalLM adds no load-balance loss; flaxlm adds this times it.
    router_aux_loss_coef: float = 0.0

    model_type: ClassVar[str] = "llama4_text"
    # What qwen_moe.MoESizes counts: q/k/v/o biases together, no q/k norm params.
    qk_norm: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for name in ("no_rope_layers", "layer_types", "mlp_only_layers"):
            value = getattr(self, name)
            if value is not None:  # Gin and JSON give lists; the config stays hashable
                object.__setattr__(self, name, tuple(value))
        super().__post_init__()
        self.check_moe()
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, self.head_dim)
        self._check_llama4()

    def _check_llama4(self) -> None:
        """ValueErrors naming the Llama 4 field flaxlm cannot run (or HF would not)."""
        fixed = dict(
            router="sigmoid_topk", router_scales_input=True, n_shared_experts=1,
            norm_topk_prob=False, routed_scaling_factor=1.0, score_correction_bias=False,
            n_group=1, topk_group=1, shared_expert_intermediate_size=0, router_bias=False,
            expert_bias=False, swiglu_limit=None,
        )  # fmt: skip
        for name, value in fixed.items():
            if getattr(self, name) != value:
                raise ValueError(f"{name}={getattr(self, name)!r}: Llama 4 has {value!r}.")
        if self.no_rope_layer_interval < 1:
            raise ValueError(f"no_rope_layer_interval {self.no_rope_layer_interval} must be >= 1.")
        if self.no_rope_layers is not None and len(self.no_rope_layers) < self.num_layers:
            raise ValueError(
                f"no_rope_layers has {len(self.no_rope_layers)} entries for num_layers "
                f"{self.num_layers}."
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for num_layers "
                    f"{self.num_layers}."
                )
            unknown = sorted(set(self.layer_types) - {CHUNKED, FULL})
            if unknown:
                raise ValueError(f"layer_types {unknown}: expected {CHUNKED!r} or {FULL!r}.")
        chunk = self.local_chunk_size
        if chunk is not None and chunk < 1:
            raise ValueError(f"local_chunk_size (attention_chunk_size) {chunk} must be >= 1.")
        if chunk is None and any(self.chunked):
            raise ValueError(
                "local_chunk_size (attention_chunk_size) is None but layer_types has "
                f"{CHUNKED!r} layers: set a chunk size or make every layer {FULL!r}."
            )
        if self.floor_scale < 1:
            raise ValueError(f"floor_scale {self.floor_scale} must be >= 1.")

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def rotary(self) -> tuple[bool, ...]:
        """Whether each layer rotates its queries and keys (else NoPE)."""
        if self.no_rope_layers:
            return tuple(bool(r) for r in self.no_rope_layers[: self.num_layers])
        interval = self.no_rope_layer_interval
        return tuple((i + 1) % interval != 0 for i in range(self.num_layers))

    @property
    def attention_layer_types(self) -> tuple[str, ...]:
        """Every layer's HF layer type: `layer_types`, or the rotary layers chunked."""
        if self.layer_types is not None:
            return self.layer_types
        return tuple(CHUNKED if r else FULL for r in self.rotary)

    @property
    def chunked(self) -> tuple[bool, ...]:
        return tuple(t == CHUNKED for t in self.attention_layer_types)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """The most keys each layer's query sees (None: all), for the FLOP count."""
        return tuple(self.local_chunk_size if c else None for c in self.chunked)

    def make_module(self) -> Llama4:
        return Llama4(self)


def _choose(flag: Any, yes: Callable[[], Array], no: Callable[[], Array]) -> Array:
    """`yes()` or `no()` by a per-layer `flag`: a Python bool (unrolled layers) picks one, a
    traced one (scanned layers) selects between both."""
    if isinstance(flag, (bool, np.bool_)):
        return yes() if flag else no()
    return jnp.where(flag, yes(), no())


def l2_norm(x: Array, eps: float) -> Array:
    """HF's Llama4TextL2Norm: each head scaled to unit root-mean-square, in float32."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


def same_chunk(q_pos: Array, k_pos: Array, chunk: Array | int) -> Array:
    """bool `[batch, 1, q_len, kv_len]`: whether each key's position is in its query's chunk
    (q_pos `[batch, q_len]`, k_pos `[batch, kv_len]`)."""
    return (q_pos[:, :, None] // chunk == k_pos[:, None, :] // chunk)[:, None]


class Llama4Block(nn.Module):
    """Pre-RMSNorm block: Llama 4's attention (rotary or NoPE, chunked or full: this
    layer's), then the mixture of experts or a dense SwiGLU (`qwen_moe.mlp_or_experts`).

    Called `(x, layer_index, mask, decoding, sin, cos, positions)`."""

    config: Any  # a Llama4Config
    deterministic: bool = True

    def dropped(self, y: Array) -> Array:
        if not self.config.dropout_rate:
            return y
        return nn.Dropout(self.config.dropout_rate)(y, deterministic=self.deterministic)

    def per_layer(self, values: tuple[Any, ...], index: Array) -> Any:
        """This layer's entry of `values`: static when unrolled, looked up when scanned."""
        i = stacks.unrolled_layer(self)
        return values[i] if i is not None else jnp.asarray(values)[index]

    @nn.compact
    def __call__(
        self,
        x: Array,
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
        positions: Array,
    ) -> Array:
        cfg = self.config
        norm = dict(epsilon=cfg.rms_norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        x = layers.constrain(x, layers.ACTIVATION_AXES)
        h = layers.RMSNorm(name="input_layernorm", **norm)(x)
        attn = self.self_attention(h, index, mask, decoding, sin, cos, positions)
        x = layers.constrain(x + self.dropped(attn), layers.ACTIVATION_AXES)
        h = layers.RMSNorm(name="post_attention_layernorm", **norm)(x)
        mlp = qwen_moe.mlp_or_experts(self, cfg, h, mask)
        return layers.constrain(x + self.dropped(mlp), layers.ACTIVATION_AXES)

    def self_attention(
        self,
        h: Array,
        index: Array,
        mask: masks.Mask | Array,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
        positions: Array,
    ) -> Array:
        """Grouped-query attention as HF's Llama4TextAttention (the module docstring)."""
        cfg = self.config
        dtype, d = cfg.dtype, cfg.dim_per_head
        dense = dict(dtype=dtype, param_dtype=cfg.param_dtype, use_bias=cfg.attention_bias)
        kv_axis = layers.kv_heads_axis(cfg.kv_heads)
        kv_axes = ("batch", "length", kv_axis, "head_dim")
        q, k, v = layers.qkv_projections(h, cfg.num_heads, cfg.kv_heads, d, **dense)
        rotary = self.per_layer(cfg.rotary, index)

        def rotated(x: Array) -> Array:
            x = attention.apply_rotary(x, sin, cos, interleaved=True)
            return l2_norm(x, cfg.rms_norm_eps) if cfg.use_qk_norm else x

        q = _choose(rotary, lambda: rotated(q), lambda: q)
        k = _choose(rotary, lambda: rotated(k), lambda: k)
        if cfg.attn_temperature_tuning:
            # By position; while decoding a left-padded batch, by the cache's slot, as HF
            # counts a layer's cache (the padding included).
            slot = positions
            if decoding is not None and not decoding.paged:
                slot = decoding.index + jnp.arange(h.shape[1], dtype=jnp.int32)[None, :]
            slot = slot.astype(jnp.float32)
            scale = jnp.log1p(jnp.floor((slot + 1.0) / cfg.floor_scale)) * cfg.attn_scale + 1.0
            scaled = (q * scale[..., None, None]).astype(q.dtype)
            q = _choose(rotary, lambda: q, lambda: scaled)
        q = layers.constrain(q, layers.HEAD_AXES)
        k = layers.constrain(k, kv_axes)

        chunked = self.per_layer(cfg.chunked, index) if any(cfg.chunked) else False
        chunk = None if chunked is False else jnp.where(chunked, cfg.local_chunk_size, NO_CHUNK)
        if paged_attention.use_kernel(decoding, q, window=chunk):
            pools = attention.KVCache(kv_axes, name="cache")(k, v, decoding, pools=True)
            out = paged_attention.kernel_attention(q, *pools, decoding, dtype=dtype)
        else:
            k, v = attention.KVCache(kv_axes, name="cache")(k, v, decoding)
            if chunk is not None:
                mask = self.chunk_mask(mask, decoding, positions, chunk, k.shape[1])
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

    def chunk_mask(
        self,
        mask: masks.Mask | Array,
        decoding: masks.Decoding | None,
        positions: Array,
        chunk: Array,
        kv_len: int,
    ) -> masks.Mask | Array:
        """`mask` narrowed to this layer's chunks of positions. Over a whole sequence the
        chunks become segments (segment x chunk, 0 kept for padding), which every attention
        implementation and context parallelism already keep apart; while decoding, a dense
        mask of the cache: a key's position is its slot less the row's start."""
        if decoding is None:
            batch, length = positions.shape
            segments = mask.q_segment_ids
            if segments is None:
                segments = jnp.ones((batch, length), jnp.int32)
            # Chunk ids stay below `span`: positions are below max_position_embeddings.
            span = self.config.max_position_embeddings // self.config.local_chunk_size + 2
            ids = segments * span + positions // chunk
            return mask.replace(q_segment_ids=jnp.where(segments > 0, ids, 0))
        keys = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
        if decoding.paged:
            return mask & same_chunk(positions, jnp.broadcast_to(keys, (1, kv_len)), chunk)
        k_pos = keys - decoding.start[:, None]
        return mask.dense() & same_chunk(positions, k_pos, chunk)


class Llama4(CausalLM):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = Llama4Block
    layer_index = True  # each block looks up its own attention kind

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, Array, Array]]:
        return x, (*rope.sin_cos(positions, self.config), positions)

    def final_norm(self, x: Array) -> Array:
        cfg = self.config
        return layers.RMSNorm(
            cfg.rms_norm_eps, dtype=jnp.float32, param_dtype=cfg.param_dtype, name="norm"
        )(x)


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides: Any) -> Llama4Config:
    """A Llama4Config from a `llama4_text` config.json dict (+ field overrides)."""
    n = hf["num_hidden_layers"]
    step = hf.get("interleave_moe_layer_step", 1)
    moe_layers = hf.get("moe_layers")
    if moe_layers is None:
        if step < 1:
            raise ValueError(f"interleave_moe_layer_step {step} must be >= 1.")
        moe_layers = range(step - 1, n, step)
    layer_types = hf.get("layer_types")
    kwargs = dict(
        llama.shared_fields_from_hf(hf, rms_norm_eps=1e-5),
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        intermediate_size=hf.get("intermediate_size_mlp", 16384),
        moe_intermediate_size=hf.get("intermediate_size", 8192),
        attention_bias=hf.get("attention_bias", False),
        no_rope_layers=tuple(hf["no_rope_layers"]) if hf.get("no_rope_layers") else None,
        no_rope_layer_interval=hf.get("no_rope_layer_interval", 4),
        layer_types=tuple(layer_types) if layer_types is not None else None,
        local_chunk_size=hf.get("attention_chunk_size", 8192),
        use_qk_norm=hf.get("use_qk_norm", True),
        attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
        floor_scale=hf.get("floor_scale", 8192),
        attn_scale=hf.get("attn_scale", 0.1),
        num_experts=hf.get("num_local_experts", 16),
        num_experts_per_tok=hf.get("num_experts_per_tok", 1),
        decoder_sparse_step=1,
        mlp_only_layers=tuple(i for i in range(n) if i not in set(moe_layers)),
        **rope.from_hf({"rope_theta": 500000.0, **hf}),
    )
    kwargs.update(overrides)
    return Llama4Config(**kwargs)


def config_to_hf(cfg: Llama4Config) -> dict:
    fields = llama.shared_hf_fields(cfg)
    return {
        "model_type": "llama4_text",
        "architectures": ["Llama4ForCausalLM"],
        **fields,
        "intermediate_size": cfg.moe_intermediate_size,
        "intermediate_size_mlp": cfg.intermediate_size,
        "head_dim": cfg.dim_per_head,
        "rope_parameters": rope.to_hf(cfg),
        "attention_bias": cfg.attention_bias,
        "no_rope_layers": [int(r) for r in cfg.rotary],
        "no_rope_layer_interval": cfg.no_rope_layer_interval,
        "layer_types": list(cfg.attention_layer_types),
        "attention_chunk_size": cfg.local_chunk_size,
        "use_qk_norm": cfg.use_qk_norm,
        "attn_temperature_tuning": cfg.attn_temperature_tuning,
        "floor_scale": cfg.floor_scale,
        "attn_scale": cfg.attn_scale,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "interleave_moe_layer_step": cfg.decoder_sparse_step,
        "moe_layers": [i for i, s in enumerate(cfg.sparse_layers(cfg.num_layers)) if s],
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }


def hf_tensors(cfg: Llama4Config) -> list[HFTensor]:
    """Llama's attention (with its biases), norms, embedding and head, then each layer's
    `feed_forward`: the router, the fused experts and the shared expert, or a SwiGLU."""
    table = llama.hf_tensors_but_mlp(cfg)
    sparse = cfg.sparse_layers(cfg.num_layers)
    prefix = "model.layers.{i}.feed_forward"
    n = cfg.num_layers
    return table + per_kind(sparse, lambda s: _mlp_records(cfg, "layers_{i}", prefix, s, n))


def _mlp_records(cfg: Llama4Config, scope: str, prefix: str, sparse: bool, n: int) -> list:
    swiglu = ("gate_proj", "up_proj", "down_proj")
    mlp = f"{scope}/mlp"
    if not sparse:
        return [linear(f"{mlp}/{p}/kernel", f"{prefix}.{p}.weight", layers=n) for p in swiglu]
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return [
        linear(f"{mlp}/gate/kernel", f"{prefix}.router.weight", layers=n),
        # HF's gate_up_proj `[experts, embed, 2 x mlp]` (gate, then up) is wi's memory
        # layout `[experts, embed, 2, mlp]`; its down_proj is wo's.
        HFTensor(
            f"{mlp}/experts/wi",
            f"{prefix}.experts.gate_up_proj",
            layers=n,
            to_hf=lambda w: w.reshape(e, d, 2 * f),
            to_flax=lambda w, shape: w.reshape(shape),
        ),
        HFTensor(
            f"{mlp}/experts/wo",
            f"{prefix}.experts.down_proj",
            layers=n,
            to_hf=lambda w: w,
            to_flax=lambda w, shape: w.reshape(shape),
        ),
        *(
            linear(
                f"{mlp}/shared_experts/{p}/kernel", f"{prefix}.shared_expert.{p}.weight", layers=n
            )
            for p in swiglu
        ),
    ]


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=Llama4Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        # The Hub's files (Llama4ForConditionalGeneration): the text tower, its LM head
        # included, under `language_model.`; the vision tower and projector skipped.
        multimodal=(Multimodal("llama4", "llama4_text", None, "language_model.model."),),
        renames=((r"^language_model\.", ""),),
        skip=(r"^(vision_model|multi_modal_projector)\.",),
    )
)
