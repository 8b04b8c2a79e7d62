"""Phi-3, Phi-3.5-mini, Phi-4 and Phi-4-mini: Llama's blocks with LongRoPE and partial rotary.

A Phi-3 block is a Llama block (pre-RMSNorm, grouped-query attention, SwiGLU) whose q/k/v and
gate/up projections HF stores fused (`qkv_proj`, `gate_up_proj`): the fusion lives only at
the HF boundary (`HFTensor.rows`), so inside flaxlm the projections stay separate and shard by
heads. What Phi adds: rotary over the first `partial_rotary_factor` of each head (Phi-4-mini)
and LongRoPE (Phi-3.5-mini, Phi-4-mini), whose per-frequency factors switch from the short
set to the long one once a forward call reaches past `original_max_position_embeddings`
(decoding recomputes its cache at that step, as HF's generate does).
Follows HuggingFace's `Phi3ForCausalLM` (the PyTorch reference our logits must match).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.models import attention, llama, masks
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.causal_lm import CausalLM
from flaxlm.models.hf_spec import HFSpec, HFTensor, register_hf
from flaxlm.models.options import ComputeOptions

Array = jax.Array

# HF rope type names -> ours: Phi-3's first long-context checkpoints said 'su' or 'yarn' for
# what transformers now calls 'longrope'.
ROPE_TYPES = {"default": None, "longrope": "longrope", "su": "longrope", "yarn": "longrope"}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Phi3Config(ComputeOptions):
    """Phi-3 / Phi-3.5 / Phi-4 hyper-parameters (HF names where they exist)."""

    vocab_size: int = 32064
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 3072
    num_layers: int = 32  # HF: num_hidden_layers
    num_heads: int = 32  # HF: num_attention_heads
    num_kv_heads: int | None = None  # HF: num_key_value_heads; None: num_heads
    intermediate_size: int = 8192
    max_position_embeddings: int = 4096
    # The context Phi was pretrained on: LongRoPE's switch point and attention scaling.
    original_max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0  # rotary covers this fraction of each head (Phi-4-mini)
    rope_scaling_type: str | None = None  # None (HF 'default') or 'longrope'
    # LongRoPE: one factor per rotary frequency dividing it, the short set while a forward
    # call stays within original_max_position_embeddings, the long set past it.
    rope_short_factor: tuple[float, ...] | None = None
    rope_long_factor: tuple[float, ...] | None = None
    # LongRoPE: HF's `factor` (None: max_position_embeddings / original_max_position_embeddings)
    # and `attention_factor` scaling sin and cos (None: sqrt(1 + ln factor / ln original)).
    rope_scaling_factor: float | None = None
    rope_attention_factor: float | None = None
    sliding_window: int | None = None  # a query sees this many latest positions (Phi-3-mini)
    tie_word_embeddings: bool = False  # the head reuses the token embedding (Phi-4-mini)
    activation: str = "silu"  # HF: hidden_act

    # Where llama.py's block, HF table and counts read a config: Phi-3 has no biases, no q/k
    # norms and plain (w, not 1 + w) RMSNorms; its window is the whole model's (the mask's).
    attention_bias: ClassVar[bool] = False
    qkv_bias: ClassVar[bool] = False
    mlp_bias: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = False
    norm_scale_plus_one: ClassVar[bool] = False
    layer_windows = llama.LlamaConfig.layer_windows

    def __post_init__(self) -> None:
        super().__post_init__()
        # Gin binds lists; a frozen config must hash.
        for name in ("rope_short_factor", "rope_long_factor"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(f) for f in value))
        attention.check_heads(self.hidden_size, self.num_heads, self.kv_heads, None)
        rotary = self.rotary_dim
        if not 0.0 < self.partial_rotary_factor <= 1.0 or rotary % 2 or not rotary:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1] and give "
                f"an even, non-zero number of rotary features of head_dim {self.dim_per_head} "
                f"(got {rotary})."
            )
        if self.original_max_position_embeddings < 1:
            raise ValueError(
                f"original_max_position_embeddings {self.original_max_position_embeddings} "
                "must be positive."
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be None or positive.")
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling_type not in (None, "longrope"):
            raise ValueError(
                f"rope_scaling_type {self.rope_scaling_type!r}: expected None or 'longrope'."
            )
        for name in ("rope_short_factor", "rope_long_factor"):
            value = getattr(self, name)
            if self.rope_scaling_type is None and value is not None:
                raise ValueError(f"{name} is LongRoPE's: set rope_scaling_type='longrope'.")
            if self.rope_scaling_type and (
                value is None or len(value) != self.rotary_dim // 2 or min(value) <= 0
            ):
                raise ValueError(
                    f"{name} {value}: LongRoPE needs {self.rotary_dim // 2} positive factors, "
                    "one per rotary frequency."
                )
        for name in ("rope_scaling_factor", "rope_attention_factor"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} {value} must be None or positive.")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """Features of each head that rotary rotates (the first ones)."""
        return int(self.dim_per_head * self.partial_rotary_factor)

    # Counted as Llama's: the same params (the fused HF tensors are the same numbers).
    num_params = llama.LlamaConfig.num_params
    flops_per_token = llama.LlamaConfig.flops_per_token

    def make_module(self) -> Phi3:
        return Phi3(self)


def rope_inv_freqs(cfg: Phi3Config) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 inverse frequencies `[rotary_dim // 2]`: (short, long), long None without
    LongRoPE. LongRoPE divides each default frequency by its factor."""
    if cfg.rope_scaling_type is None:
        return attention.rotary_inv_freq(cfg.rotary_dim, cfg.rope_theta), None
    exponents = np.arange(0, cfg.rotary_dim, 2, dtype=np.float32) / np.float32(cfg.rotary_dim)
    theta_powers = np.float32(cfg.rope_theta) ** exponents  # 1 / the default frequencies

    def scaled(factors: tuple[float, ...]) -> np.ndarray:
        return (1.0 / (np.asarray(factors, np.float32) * theta_powers)).astype(np.float32)

    return scaled(cfg.rope_short_factor), scaled(cfg.rope_long_factor)


def rope_attention_factor(cfg: Phi3Config) -> float:
    """What sin and cos are multiplied by (LongRoPE's attention scaling; 1 otherwise)."""
    if cfg.rope_scaling_type is None:
        return 1.0
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor
    original = cfg.original_max_position_embeddings
    factor = cfg.rope_scaling_factor or cfg.max_position_embeddings / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1.0 + math.log(factor) / math.log(original))


class Phi3(llama.Llama):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`.

    Llama's skeleton and blocks; rotary as `block_inputs` says. With LongRoPE, decoding keeps
    the tokens it has read (cache variable `tokens`) to recompute the cache where HF does.
    """

    @nn.compact
    def __call__(
        self,
        tokens: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        *,
        deterministic: bool = True,
        decoding: masks.Decoding | None = None,
        return_hidden: bool = False,
        slots: Array | None = None,
    ) -> Array:
        if decoding is None or self.config.rope_scaling_type is None:
            return super().__call__(
                tokens,
                positions,
                segment_ids,
                deterministic=deterministic,
                decoding=decoding,
                return_hidden=return_hidden,
                slots=slots,
            )
        # The first call whose positions reach past the original context switches to the
        # long factors; HF's generate then recomputes its whole cache (every layer's keys and
        # values of every earlier token change), and so does this call.
        batch, length = tokens.shape
        positions = masks.default_positions(tokens, positions)
        read = self.variable(
            "cache", "tokens", jnp.zeros, (batch, decoding.length, 1, 1), jnp.int32
        )
        # [batch, cache slots, 1, 1]: 4-D, so beam search reorders it with the keys and values.
        read.value = jax.lax.dynamic_update_slice(
            read.value, tokens[:, :, None, None].astype(jnp.int32), (0, decoding.index, 0, 0)
        )
        # This call reaches past the original context and the previous one did not.
        last, original = jnp.max(positions), self.config.original_max_position_embeddings
        crossing = (decoding.index > 0) & (last >= original) & (last - length < original)

        def step(module: Phi3, tokens: Array, positions: Array, history: Array) -> Array:
            return CausalLM.__call__(
                module, tokens, positions, decoding=decoding, return_hidden=return_hidden
            )

        def recompute(module: Phi3, tokens: Array, positions: Array, history: Array) -> Array:
            whole = masks.Decoding(jnp.int32(0), decoding.start, decoding.length)
            every = masks.decoding_positions(whole, batch, decoding.length)
            # Slots past this call's hold zeros until their own step writes them; masked here.
            out = CausalLM.__call__(
                module, history, every, decoding=whole, return_hidden=return_hidden
            )
            return jax.lax.dynamic_slice_in_dim(out, decoding.index, length, axis=1)

        return nn.cond(crossing, recompute, step, self, tokens, positions, read.value[..., 0, 0])

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, Array]]:
        cfg = self.config
        short, long = rope_inv_freqs(cfg)
        if long is None:
            return x, attention.rotary_sin_cos(positions, short)
        # As HF's Phi3RotaryEmbedding: one set of factors for the whole call, the long one
        # once the call's largest position is past the original context.
        past = jnp.max(positions) + 1 > cfg.original_max_position_embeddings
        sin, cos = attention.rotary_sin_cos(positions, jnp.where(past, long, short))
        scale = rope_attention_factor(cfg)
        return x, (sin * scale, cos * scale)


# ------------------------------------------------------------------ HuggingFace


def rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Phi3Config's rope fields from `rope_parameters` (transformers 5) or the older
    top-level `rope_theta`, `partial_rotary_factor` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"config.json has rope type {kind!r}; Phi-3 supports {sorted(ROPE_TYPES)} ('su' "
            "and 'yarn' are Phi-3's old names of 'longrope')."
        )
    out: dict[str, Any] = {
        "rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 1e4))),
        "partial_rotary_factor": float(
            params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        ),
    }
    if ROPE_TYPES[kind] is None:
        return out
    missing = [k for k in ("short_factor", "long_factor") if k not in params]
    if missing:
        raise ValueError(f"config.json's longrope rope parameters lack {missing}.")
    out.update(
        rope_scaling_type="longrope",
        rope_short_factor=tuple(float(f) for f in params["short_factor"]),
        rope_long_factor=tuple(float(f) for f in params["long_factor"]),
        rope_scaling_factor=params.get("factor"),
        rope_attention_factor=params.get("attention_factor"),
    )
    return out


def rope_to_hf(cfg: Phi3Config) -> dict[str, Any]:
    params: dict[str, Any] = {
        "rope_type": cfg.rope_scaling_type or "default",
        "rope_theta": cfg.rope_theta,
        "partial_rotary_factor": cfg.partial_rotary_factor,
    }
    if cfg.rope_scaling_type:
        params.update(
            short_factor=list(cfg.rope_short_factor),
            long_factor=list(cfg.rope_long_factor),
            original_max_position_embeddings=cfg.original_max_position_embeddings,
        )
        optional = {
            "factor": cfg.rope_scaling_factor,
            "attention_factor": cfg.rope_attention_factor,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
    return params


def config_from_hf(hf: dict, **overrides) -> Phi3Config:
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise ValueError(
            f"config.json has head_dim {hf['head_dim']}; HF's Phi-3 heads are hidden_size / "
            f"num_attention_heads = {hf['hidden_size'] // heads} wide."
        )
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads"),
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"],
        # HF prefers the top-level field (default 4096) to the rope parameters' copy.
        original_max_position_embeddings=hf.get("original_max_position_embeddings", 4096),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        sliding_window=hf.get("sliding_window"),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        activation=hf.get("hidden_act", "silu"),
        **rope_from_hf(hf),
    )
    kwargs.update(overrides)
    return Phi3Config(**kwargs)


def config_to_hf(cfg: Phi3Config) -> dict:
    return {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "original_max_position_embeddings": cfg.original_max_position_embeddings,
        "rope_parameters": rope_to_hf(cfg),
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "sliding_window": cfg.sliding_window,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    }


def hf_tensors(cfg: Phi3Config) -> list[HFTensor]:
    """Llama's table with q/k/v and gate/up as rows of HF's fused `qkv_proj` and
    `gate_up_proj` (in that order)."""
    q, kv, ffn = (
        cfg.num_heads * cfg.dim_per_head,
        cfg.kv_heads * cfg.dim_per_head,
        cfg.intermediate_size,
    )
    fused = {
        "q_proj": ("self_attn.qkv_proj", (0, q)),
        "k_proj": ("self_attn.qkv_proj", (q, q + kv)),
        "v_proj": ("self_attn.qkv_proj", (q + kv, q + 2 * kv)),
        "gate_proj": ("mlp.gate_up_proj", (0, ffn)),
        "up_proj": ("mlp.gate_up_proj", (ffn, 2 * ffn)),
    }
    out = []
    for t in llama.hf_tensors(cfg):
        name = t.param.split("/")[1] if t.layers else ""
        if name in fused:
            hf_name, rows = fused[name]
            t = dataclasses.replace(t, hf=f"model.layers.{{i}}.{hf_name}.weight", rows=rows)
        out.append(t)
    return out


HF_SPEC = register_hf(
    HFSpec(
        model_types=("phi3",),
        config_cls=Phi3Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        # Buffers, and the head that a tied checkpoint may still carry.
        ignore=(r"rotary_emb\.\w*inv_freq$", r"^lm_head\.weight$"),
        tied_head=("lm_head.weight", "model.embed_tokens.weight"),
    )
)
