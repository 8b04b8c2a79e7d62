"""Gemma 4 (text): Gemma 3's sandwich-normed blocks with per-layer input embeddings, keys
and values shared across the last layers, global layers of their own head width, and
optionally experts beside every MLP.

Each block wraps attention and MLP in RMSNorms before and after (plain `w`, not Gemma 3's
`1 + w`), normalises each query and key head and each value head (the values without a
scale), and scores with scale 1. Sliding-window and global layers alternate (`layer_types`);
global layers have their own head width (`global_head_dim`), their own rotary table (by
default HF's 'proportional' rope: a quarter of the pairs rotate) and, with
`attention_k_eq_v`, their values are their keys before the key norm and rotary (with
`num_global_kv_heads` heads). Per-layer inputs (`hidden_size_per_layer_input`): a second
token embedding, packed `[vocab, layers * width]`, mixed with a projection of the embedded
tokens, gates a small residual branch after each block's MLP. The last
`num_kv_shared_layers` layers compute no keys or values: each reuses those of the last
earlier layer of its type. With `enable_moe_block` a `moe.MoE` (its router reading the
block's input normed apart, a learned scale per expert) runs beside the MLP on its own
normed input, the two outputs normed and summed. Every block ends scaled by its
`layer_scalar` (a buffer in HF, not trained here either). `scan_layers` scans the cycle the
layer types repeat (`scan_period`: 6 for HF's default pattern, each block of it one type;
layers after its last whole repeat unrolled); with KV-shared layers it scans those, the
layers before them unrolled (their keys and values carried into the scan). Follows
HuggingFace's `Gemma4ForCausalLM`; `gemma4_hf` reads and writes its config.json and tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.models import attention, layers, masks, moe, stacks
from flaxlm.models.causal_lm import CausalLM
from flaxlm.models.options import ComputeOptions

Array = jax.Array

SLIDING, GLOBAL = "sliding_attention", "full_attention"  # HF's layer_types
LAYER_TYPES = (SLIDING, GLOBAL)
ROPE_TYPES = ("default", "proportional")

# Each layer type's rotary fields (HF: rope_parameters[type]): type, theta, partial, factor.
ROPE_FIELDS = {
    GLOBAL: ("rope_type", "rope_theta", "partial_rotary_factor", "rope_factor"),
    SLIDING: (
        "local_rope_type",
        "local_rope_theta",
        "local_partial_rotary_factor",
        "local_rope_factor",
    ),
}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Gemma4Config(ComputeOptions, moe.MoEOptions):
    """Gemma 4 text hyper-parameters (HF names where they exist; defaults: HF's); with
    `enable_moe_block`, MoEOptions' fields (HF: num_experts, top_k_experts,
    moe_intermediate_size) size the experts beside each MLP."""

    vocab_size: int = 262144
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 2304
    num_layers: int = 30  # HF: num_hidden_layers
    num_heads: int = 8  # HF: num_attention_heads
    num_kv_heads: int = 4  # HF: num_key_value_heads (sliding layers; global ones unless k_eq_v)
    head_dim: int = 256  # sliding layers' head width
    global_head_dim: int = 512  # global layers' head width
    # Global layers' key/value heads with attention_k_eq_v (None: num_kv_heads).
    num_global_kv_heads: int | None = None
    intermediate_size: int = 9216
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    sliding_window: int = 512  # a sliding layer's query sees this many latest positions
    # Each layer's 'sliding_attention' or 'full_attention' (the last must be global); None:
    # every 6th layer global, and the last.
    layer_types: tuple[str, ...] | None = None
    # Rotary tables per layer type: 'default' or HF's 'proportional' (the first
    # `partial_rotary_factor` of the pairs rotate, frequencies over the whole head, / factor).
    rope_type: str = "proportional"  # global layers
    rope_theta: float = 1e6
    partial_rotary_factor: float = 0.25
    rope_factor: float = 1.0
    local_rope_type: str = "default"  # sliding layers
    local_rope_theta: float = 1e4
    local_partial_rotary_factor: float = 1.0
    local_rope_factor: float = 1.0
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    activation: str = "gelu_pytorch_tanh"  # HF: hidden_activation
    # Per-layer inputs: width per layer (0: none) and the vocabulary of their embedding.
    hidden_size_per_layer_input: int = 256
    vocab_size_per_layer_input: int = 262144
    attention_k_eq_v: bool = False  # global layers: values are the keys (no v_proj)
    num_kv_shared_layers: int = 0  # the last layers reuse an earlier layer's keys/values
    use_double_wide_mlp: bool = False  # KV-shared layers' MLPs twice intermediate_size
    enable_moe_block: bool = False  # every layer: experts beside its MLP
    # Gemma 4's router: softmax, the top k renormalised, times a learned scale per expert;
    # no load-balancing loss in HF's training.
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    per_expert_scale: bool = True
    router_aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.layer_types is not None:  # a list from Gin or a JSON model record
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        super().__post_init__()
        if self.enable_moe_block:
            self.check_moe()
            theirs = dict(router="softmax_topk", norm_topk_prob=True, per_expert_scale=True)
            for name, value in theirs.items():
                if getattr(self, name) != value:
                    raise ValueError(f"{name} {getattr(self, name)!r}: Gemma 4's is {value!r}.")
        for heads, width in (
            (self.num_kv_heads, self.head_dim),
            (self.global_kv_heads, self.global_head_dim),
        ):
            attention.check_heads(self.hidden_size, self.num_heads, heads, width)
        types = self.layer_types
        if types is not None and (
            len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types)
        ):
            raise ValueError(
                f"layer_types {types}: expected num_layers ({self.num_layers}) entries, each one "
                f"of {LAYER_TYPES}."
            )
        if types is not None and types[-1] != GLOBAL:
            raise ValueError(f"layer_types {types}: the last layer must be {GLOBAL!r}.")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be positive.")
        for name in ("rope_type", "local_rope_type"):
            if getattr(self, name) not in ROPE_TYPES:
                raise ValueError(f"{name} {getattr(self, name)!r}: expected one of {ROPE_TYPES}.")
        positive = ("rope_theta", "local_rope_theta", "rope_factor", "local_rope_factor")
        positive += ("final_logit_softcapping", "rms_norm_eps")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} {value} must be positive.")
        for name in ("partial_rotary_factor", "local_partial_rotary_factor"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} {getattr(self, name)} must be in [0, 1].")
        if self.hidden_size_per_layer_input < 0 or self.vocab_size_per_layer_input < 1:
            raise ValueError(
                f"hidden_size_per_layer_input {self.hidden_size_per_layer_input} must be >= 0 "
                f"and vocab_size_per_layer_input {self.vocab_size_per_layer_input} >= 1."
            )
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ValueError(
                f"num_kv_shared_layers {self.num_kv_shared_layers} must be in [0, num_layers="
                f"{self.num_layers})."
            )
        producers = set(self.per_layer_types[: self.num_layers - self.num_kv_shared_layers])
        if self.num_kv_shared_layers and producers != set(self.per_layer_types):
            raise ValueError(
                f"num_kv_shared_layers {self.num_kv_shared_layers}: a shared layer's type has "
                "no earlier layer of its type to take keys and values from (layer_types "
                f"{self.per_layer_types})."
            )

    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """Each layer's type (`layer_types`, or HF's default: 5 sliding to 1 global, the last
        global)."""
        if self.layer_types is not None:
            return self.layer_types
        types = [GLOBAL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_layers)]
        return (*types[:-1], GLOBAL)

    @property
    def first_scanned_layer(self) -> int:
        """0; with KV-shared layers the first of them: the layers whose keys and values they
        reuse stay unrolled, and the scan carries those keys and values to the shared ones."""
        return self.num_layers - self.num_kv_shared_layers if self.num_kv_shared_layers else 0

    @property
    def scan_period(self) -> int:
        """The cycle of layer types a scan repeats from `first_scanned_layer` on
        (`stacks.cycle_of`: HF's default pattern, 5 sliding and 1 global, 6); each block of it
        is one type."""
        return stacks.cycle_of(self.per_layer_types[self.first_scanned_layer :])[0]

    @property
    def scan_tail(self) -> int:
        """The layers after the cycle's last whole repeat, unrolled (`stacks.cycle_of`)."""
        return stacks.cycle_of(self.per_layer_types[self.first_scanned_layer :])[1]

    @property
    def global_kv_heads(self) -> int:
        """Key/value heads of global layers."""
        if self.attention_k_eq_v and self.num_global_kv_heads is not None:
            return self.num_global_kv_heads
        return self.num_kv_heads

    def layer_shape(self, i: int) -> tuple[int, int]:
        """(kv heads, head width) of layer `i`."""
        if self.per_layer_types[i] == GLOBAL:
            return self.global_kv_heads, self.global_head_dim
        return self.num_kv_heads, self.head_dim

    @property
    def kv_sources(self) -> tuple[int, ...]:
        """Each layer's source of keys and values: itself, or (KV-shared layers) the last
        earlier non-shared layer of its type."""
        first_shared = self.num_layers - self.num_kv_shared_layers
        types = self.per_layer_types
        last = {t: i for i, t in enumerate(types[:first_shared])}
        return tuple(i if i < first_shared else last[types[i]] for i in range(self.num_layers))

    def mlp_width(self, i: int) -> int:
        shared = self.kv_sources[i] != i
        return self.intermediate_size * (2 if shared and self.use_double_wide_mlp else 1)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.sliding_window if t == SLIDING else None for t in self.per_layer_types)

    def num_params(self) -> int:
        """Parameter count (every tensor of the HF checkpoint but the layer scalars)."""
        e, v, h = self.hidden_size, self.vocab_size, self.num_heads
        p, n = self.hidden_size_per_layer_input, self.num_layers
        total = v * e + e + (0 if self.tie_word_embeddings else v * e)
        if p:
            total += self.vocab_size_per_layer_input * n * p + e * n * p + p
        bias = self.attention_bias
        for i in range(n):
            kv, d = self.layer_shape(i)
            total += 2 * h * d * e + d + 4 * e + 3 * e * self.mlp_width(i)
            total += (h * d + e) if bias else 0
            if self.kv_sources[i] == i:
                k_eq_v = self.attention_k_eq_v and self.per_layer_types[i] == GLOBAL
                kv_mats = 1 if k_eq_v else 2
                total += kv_mats * kv * d * (e + (1 if bias else 0)) + d
            total += (2 * e * p + e) if p else 0
            total += (self.moe_params(e)[0] + 4 * e) if self.enable_moe_block else 0
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus the attention scores (a sliding
        layer's over its window)."""
        p = self.hidden_size_per_layer_input
        matmul = self.num_params() - self.vocab_size_per_layer_input * self.num_layers * p
        if not self.tie_word_embeddings:  # the head is a matmul, the embedding a lookup
            matmul -= self.vocab_size * self.hidden_size
        if self.enable_moe_block:  # a token goes through its k experts only
            moe_all, moe_active = self.moe_params(self.hidden_size)
            matmul -= self.num_layers * (moe_all - moe_active)
        scores = sum(
            min(seq_len, w or seq_len) * self.layer_shape(i)[1]
            for i, w in enumerate(self.layer_windows)
        )
        return 6.0 * matmul + 12.0 * self.num_heads * scores

    def make_module(self) -> Gemma4:
        return Gemma4(self)


def rope_inv_freq(head_dim: int, rope_type: str, theta: float, partial: float, factor: float):
    """float32 inverse frequencies `[head_dim // 2]` as HF computes them: 'default' over the
    whole head; 'proportional' the first `partial` of the pairs over the whole head's
    exponents, the others 0 (unrotated), all / `factor`."""
    if rope_type == "default":
        return attention.rotary_inv_freq(head_dim, theta)
    angles = int(partial * head_dim // 2)
    exponents = np.arange(0, 2 * angles, 2, dtype=np.float32) / np.float32(head_dim)
    rotated = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    inv = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, np.float32)])
    return (inv / np.float32(factor)).astype(np.float32)


def rms(x: Array, eps: float) -> Array:
    """An RMSNorm without a scale over the last axis (HF's `with_scale=False`), float32."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)).astype(x.dtype)


def norm(cfg: Gemma4Config, name: str, axes: tuple[str, ...] = ("embed",), dtype: Any = None):
    return layers.RMSNorm(
        cfg.rms_norm_eps,
        dtype=dtype or cfg.dtype,
        param_dtype=cfg.param_dtype,
        axes=axes,
        name=name,
    )


class LayerScalar(nn.Module):
    """HF's `layer_scalar` buffer: a block's output times it; not trained (param `scale`
    so weight decay passes it by)."""

    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.with_logical_partitioning(nn.initializers.ones, (None,))
        scale = self.param("scale", init, (1,), layers.as_dtype(self.param_dtype))
        return x * jax.lax.stop_gradient(scale).astype(x.dtype)


class RouterInput(nn.Module):
    """What Gemma 4's router reads: the block's input RMS-normed (no scale), times a learned
    `scale` [embed] and 1 / sqrt(width)."""

    epsilon: float = 1e-6
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
        scale = self.param("scale", init, x.shape[-1:], layers.as_dtype(self.param_dtype))
        return rms(x, self.epsilon) * scale.astype(x.dtype) * x.shape[-1] ** -0.5


class Gemma4Block(nn.Module):
    """Called `(carry, index, mask, decoding, rope, per_layer_inputs)`, `index` the layer's
    number (traced when scanned: it picks the layer's slice of the per-layer inputs); the
    carry is the hidden states `[batch, length, embed]`, or with KV-shared layers
    `(hidden states, shared)` after the first block, `shared` the keys and values of the
    layers a later KV-shared layer reuses, by layer (those stay unrolled; a scan of the
    KV-shared layers carries them unchanged)."""

    config: Gemma4Config
    deterministic: bool = True

    @nn.compact
    def __call__(
        self,
        carry: Array | tuple[Array, dict[int, tuple[Array, Array]]],
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        rope: dict[str, tuple[Array, Array]],
        per_layer_inputs: Array | None,
    ) -> Array | tuple[Array, dict[int, tuple[Array, Array]]]:
        cfg = self.config
        # The layer's shape: its own when unrolled, a cycle's block's (one type) when scanned.
        i = stacks.layer_of(self, cfg.first_scanned_layer)
        x, shared = carry if isinstance(carry, tuple) else (carry, {})
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)

        def residual(x: Array, out: Array, name: str) -> Array:
            out = norm(cfg, name)(out)
            if cfg.dropout_rate:
                out = nn.Dropout(cfg.dropout_rate)(out, deterministic=self.deterministic)
            return layers.constrain(x + out, layers.ACTIVATION_AXES)

        x = layers.constrain(x, layers.ACTIVATION_AXES)
        source = cfg.kv_sources[i]
        h = norm(cfg, "input_layernorm")(x)
        kind = cfg.per_layer_types[i]
        attn, kv = self.attention(h, mask, decoding, *rope[kind], shared.get(source), i)
        if source == i and i in cfg.kv_sources[i + 1 :]:
            shared = {**shared, i: kv}
        x = residual(x, attn, "post_attention_layernorm")
        m = layers.gated_mlp(
            norm(cfg, "pre_feedforward_layernorm")(x),
            intermediate_size=cfg.mlp_width(i),
            hidden_size=cfg.hidden_size,
            activation=cfg.activation,
            use_bias=False,
            **dense,
        )
        if cfg.enable_moe_block:  # experts beside the MLP, each output normed, both summed
            m = norm(cfg, "post_feedforward_layernorm_1")(m)
            y = moe.MoE(cfg, name="moe", **dense)(
                norm(cfg, "pre_feedforward_layernorm_2")(x),
                moe.real_tokens(mask, x.shape[1]),
                router_input=RouterInput(cfg.rms_norm_eps, cfg.param_dtype, name="router")(x),
            )
            m = m + norm(cfg, "post_feedforward_layernorm_2")(y)
        x = residual(x, m, "post_feedforward_layernorm")
        if per_layer_inputs is not None:
            p = cfg.hidden_size_per_layer_input
            g = layers.DenseGeneral(p, ("embed", None), name="per_layer_input_gate", **dense)(x)
            own = jax.lax.dynamic_index_in_dim(per_layer_inputs, index, 2, keepdims=False)
            g = layers.ACTIVATIONS[cfg.activation](g) * own.astype(g.dtype)
            g = layers.DenseGeneral(
                cfg.hidden_size, (None, "embed"), name="per_layer_projection", **dense
            )(g)
            x = residual(x, g, "post_per_layer_input_norm")
        x = LayerScalar(cfg.param_dtype, name="layer_scalar")(x)
        return (x, shared) if cfg.num_kv_shared_layers else x

    def attention(self, h, mask, decoding, sin, cos, shared_kv, i):
        """Layer `i`'s, scoped `q_proj`, `q_norm`, (own keys) `k_proj`, `v_proj`, `k_norm`,
        `cache`, and `o_proj`: `[batch, length, embed]` -> (same, (keys, values) as the
        scores saw them: the cache's while decoding); `shared_kv`: those it reuses."""
        cfg = self.config
        kv_heads, d = cfg.layer_shape(i)
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, use_bias=cfg.attention_bias)
        kv_axis = layers.kv_heads_axis(kv_heads)
        kv_axes = ("batch", "length", kv_axis, "head_dim")
        q = layers.DenseGeneral(
            (cfg.num_heads, d), ("embed", "heads", "head_dim"), name="q_proj", **dense
        )(h)
        q = norm(cfg, "q_norm", ("head_dim",))(q)
        q = layers.constrain(
            attention.apply_rotary(q, sin, cos, interleaved=False), layers.HEAD_AXES
        )
        if shared_kv is None:
            proj = lambda name: layers.DenseGeneral(  # noqa: E731
                (kv_heads, d), ("embed", kv_axis, "head_dim"), name=name, **dense
            )(h)
            k = proj("k_proj")
            k_eq_v = cfg.attention_k_eq_v and cfg.per_layer_types[i] == GLOBAL
            v = rms(k if k_eq_v else proj("v_proj"), cfg.rms_norm_eps)
            k = norm(cfg, "k_norm", ("head_dim",))(k)
            k = layers.constrain(attention.apply_rotary(k, sin, cos, interleaved=False), kv_axes)
            k, v = attention.KVCache(kv_axes, name="cache")(k, v, decoding)
        else:
            k, v = shared_kv
        window = cfg.layer_windows[i]
        if isinstance(mask, masks.Mask):
            mask = mask.within(window)
        elif window is not None and decoding is not None and decoding.paged:
            mask = mask & masks.paged_mask(decoding, window)
        out = attention.dot_product_attention(
            q,
            k,
            v,
            mask,
            scale=1.0,
            dtype=cfg.dtype,
            implementation=cfg.attention,
            chunk_size=cfg.attention_chunk_size,
            context_parallel=cfg.context_parallel,
        )
        out = layers.DenseGeneral(
            cfg.hidden_size,
            ("heads", "head_dim", "embed"),
            axis=(-2, -1),
            use_bias=cfg.attention_bias,
            name="o_proj",
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
        )(out)
        return out, (k, v)


class Gemma4(CausalLM):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = Gemma4Block
    layer_index = True

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Any, ...]]:
        """The scaled embedding and the rotary tables of each layer type."""
        cfg = self.config
        # HF rounds the sqrt(width) normaliser to the dtype before multiplying.
        x = x * jnp.asarray(cfg.hidden_size**0.5, layers.as_dtype(cfg.dtype))
        rope = {}
        for kind, fields in ROPE_FIELDS.items():
            rope_type, theta, partial, factor = (getattr(cfg, f) for f in fields)
            width = cfg.global_head_dim if kind == GLOBAL else cfg.head_dim
            inv_freq = rope_inv_freq(width, rope_type, theta, partial, factor)
            rope[kind] = attention.rotary_sin_cos(positions, inv_freq)
        return x, (rope,)

    def token_inputs(self, tokens: Array, x: Array) -> tuple[Array | None]:
        """The per-layer inputs `[batch, length, layers, width]` (None without): a second
        embedding of the tokens, each layer its slice, mixed with a normed projection of the
        scaled embedding `x`."""
        cfg = self.config
        if not cfg.hidden_size_per_layer_input:
            return (None,)
        n, p = cfg.num_layers, cfg.hidden_size_per_layer_input
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        table = layers.Embed(
            cfg.vocab_size_per_layer_input, n * p, name="embed_tokens_per_layer", **dense
        )
        own = table(tokens) * jnp.asarray(p**0.5, layers.as_dtype(cfg.dtype))
        proj = layers.DenseGeneral(
            (n, p), ("embed", None, None), name="per_layer_model_projection", **dense
        )(x)
        proj = norm(cfg, "per_layer_projection_norm", (None,))(proj * cfg.hidden_size**-0.5)
        return ((proj + own.reshape(*tokens.shape, n, p)) * 2.0**-0.5,)

    def final_norm(self, x: Any) -> Array:
        x = x[0] if isinstance(x, tuple) else x  # the last block's carry
        return norm(self.config, "norm", dtype=jnp.float32)(x)
