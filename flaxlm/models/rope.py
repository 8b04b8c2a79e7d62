"""Rope scaling of the families on Llama's block (Llama, Mistral, Gemma 1, Qwen, the Qwen-line
MoEs): the config fields, the inverse frequencies and sin/cos tables they give, and HF's
`rope_parameters` they come from and go back to.

'linear' divides every frequency by `factor`; 'llama3' slows the long wavelengths and keeps
the short ones; 'yarn' (YaRN, arXiv 2309.00071) blends interpolated and original
frequencies along a ramp between the dimensions that turn `beta_fast` and `beta_slow` times
over the original context, and scales sin and cos by an attention factor. Follows
transformers' `modeling_rope_utils` (`_compute_*_parameters`) number for number.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.models import attention
from flaxlm.models.options import ComputeOptions

Array = jax.Array

SCALING_TYPES = ("linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling(ComputeOptions):
    """HF's `rope_parameters` beyond `rope_theta`, as config fields: the base of the configs
    whose rotary `inv_freq` and `sin_cos` read (their `rope_theta` and `dim_per_head` too)."""

    rope_scaling_type: str | None = None  # None (HF 'default') or one of SCALING_TYPES
    rope_scaling_factor: float = 1.0  # how many times the original context is stretched
    rope_original_max_position_embeddings: int = 8192  # pretraining context (llama3, yarn)
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_beta_fast: float = 32.0  # yarn: dims turning more often than this keep their freq
    rope_beta_slow: float = 1.0  # yarn: dims turning less often than this are interpolated
    rope_truncate: bool = True  # yarn: the ramp's ends rounded outward to whole dims
    # yarn: sin and cos scale by this (None: 0.1 ln(factor) + 1, or DeepSeek's
    # mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim) when both are set).
    rope_attention_factor: float | None = None
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        kind = self.rope_scaling_type
        if kind not in (None, *SCALING_TYPES):
            raise ValueError(
                f"rope_scaling_type {kind!r}: expected None or one of {SCALING_TYPES}."
            )
        if kind is not None and not self.rope_scaling_factor > 0:
            raise ValueError(f"rope_scaling_factor {self.rope_scaling_factor} must be positive.")
        if kind in ("llama3", "yarn") and self.rope_original_max_position_embeddings < 1:
            raise ValueError(
                f"rope_original_max_position_embeddings "
                f"{self.rope_original_max_position_embeddings} must be positive."
            )
        low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
        # Equal factors (Llama 4 Scout's 1 and 1): no band between, every wavelength past
        # the context slowed, as HF computes it.
        if kind == "llama3" and not high >= low > 0:
            raise ValueError(
                f"llama3 rope scaling needs rope_high_freq_factor ({high}) >= "
                f"rope_low_freq_factor ({low}) > 0."
            )
        if kind == "yarn" and not self.rope_beta_fast >= self.rope_beta_slow > 0:
            raise ValueError(
                f"yarn rope scaling needs rope_beta_fast ({self.rope_beta_fast}) >= "
                f"rope_beta_slow ({self.rope_beta_slow}) > 0."
            )
        scale = self.rope_attention_factor
        if scale is not None and not scale > 0:
            raise ValueError(f"rope_attention_factor {scale} must be positive.")


def inv_freq(cfg: Any, dim: int | None = None) -> np.ndarray:
    """float32 inverse frequencies `[dim // 2]`, scaled as `rope_scaling_type` says. `dim`:
    the rotated features of each head (None: `dim_per_head`; fewer: partial rotary, whose
    frequencies HF computes over the rotated features only)."""
    dim = dim or cfg.dim_per_head
    base = attention.rotary_inv_freq(dim, cfg.rope_theta)
    factor = cfg.rope_scaling_factor
    if cfg.rope_scaling_type == "linear":
        # Dividing the frequencies is dividing the positions by `factor`.
        return base / np.float32(factor)
    if cfg.rope_scaling_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        context = cfg.rope_original_max_position_embeddings
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelen = np.float32(2 * math.pi) / base
        scaled = np.where(wavelen > context / low, base / np.float32(factor), base)
        if high == low:
            return scaled.astype(np.float32)
        smooth = (np.float32(context) / wavelen - np.float32(low)) / np.float32(high - low)
        blended = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        medium = (wavelen >= context / high) & (wavelen <= context / low)
        return np.where(medium, blended, scaled).astype(np.float32)
    if cfg.rope_scaling_type == "yarn":
        return yarn_inv_freq(cfg, dim)
    return base


def yarn_inv_freq(cfg: Any, dim: int | None = None) -> np.ndarray:
    """YaRN's blend: dims below the ramp keep their frequency (extrapolate), dims above it
    are divided by `factor` (interpolate), linearly in between."""
    dim, theta = dim or cfg.dim_per_head, cfg.rope_theta
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolated = np.float32(1) / pos_freqs
    interpolated = np.float32(1) / (np.float32(cfg.rope_scaling_factor) * pos_freqs)

    def correction_dim(rotations: float) -> float:
        # The dim whose wavelength fits `rotations` times in the original context.
        context = cfg.rope_original_max_position_embeddings
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (np.float32(1) - ramp.astype(np.float32)).astype(np.float32)
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)


def attention_factor(cfg: Any) -> float:
    """What sin and cos are multiplied by (1 but for yarn)."""
    if cfg.rope_scaling_type != "yarn":
        return 1.0
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = cfg.rope_scaling_factor, cfg.rope_mscale, cfg.rope_mscale_all_dim
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def sin_cos(positions: Array, cfg: Any, dim: int | None = None) -> tuple[Array, Array]:
    """float32 sin/cos tables `[batch, length, dim // 2]` for `positions` (`dim` as
    `inv_freq` reads it), scaled by the attention factor as HF scales its cos/sin."""
    sin, cos = attention.rotary_sin_cos(positions, inv_freq(cfg, dim))
    scale = attention_factor(cfg)
    if scale == 1.0:
        return sin, cos
    return sin * scale, cos * scale


def nope_where(
    rope_layers: tuple[bool, ...], index: Array, sin: Array, cos: Array
) -> tuple[Array, Array]:
    """The rotary of layer `index` (a traced int where layers scan) where `rope_layers` says it
    rotates, else sin 0 and cos 1: rotary becomes the identity, exactly (a NoPE layer:
    SmolLM3's, EXAONE 4's), so scanned layers stay one program."""
    if all(rope_layers):
        return sin, cos
    rotates = jnp.asarray(rope_layers)[index]
    return jnp.where(rotates, sin, 0.0), jnp.where(rotates, cos, 1.0)


def llama4_query_scale(positions: Array, cfg: Any) -> Array:
    """float32 `[batch, length]`: HF's `get_llama_4_attn_scale` at `positions` in its order
    of float32 operations, `1 + llama_4_scaling_beta * log(1 + floor(position /
    original_max_position_embeddings))`: what Mistral 4 and Ministral 3 multiply each query
    by after rotary (`cfg`: a RopeScaling with a `llama_4_scaling_beta`)."""
    steps = jnp.floor(
        positions.astype(jnp.float32) / jnp.float32(cfg.rope_original_max_position_embeddings)
    )
    return 1.0 + jnp.float32(cfg.llama_4_scaling_beta) * jnp.log(1.0 + steps)


# ------------------------------------------------------------------ HuggingFace


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """`RopeScaling`'s fields and `rope_theta` from `rope_parameters` (transformers 5) or the
    older top-level `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 1e4)))}
    if kind == "default":
        return out
    if kind not in SCALING_TYPES:
        raise ValueError(
            f"config.json has rope type {kind!r}; flaxlm supports 'default' and "
            f"{SCALING_TYPES} ('dynamic' NTK scaling changes with the sequence length and "
            "is not supported)."
        )
    # As transformers' standardize_rope_params: a top-level field first, then the context.
    original = hf.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", hf.get("max_position_embeddings")
    )
    factor = params.get("factor")
    if factor is None and kind == "yarn":  # DeepSeek-V3's configs: the ratio of the contexts
        factor = hf["max_position_embeddings"] / original
    out.update(rope_scaling_type=kind, rope_scaling_factor=float(factor))
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(params["low_freq_factor"]),
            rope_high_freq_factor=float(params["high_freq_factor"]),
            rope_original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    if kind == "yarn":
        optional = {"attention_factor": "rope_attention_factor", "mscale": "rope_mscale"}
        optional["mscale_all_dim"] = "rope_mscale_all_dim"
        out.update(
            rope_original_max_position_embeddings=int(original),
            # HF reads `or`: a 0 or None beta is its default.
            rope_beta_fast=float(params.get("beta_fast") or 32),
            rope_beta_slow=float(params.get("beta_slow") or 1),
            rope_truncate=bool(params.get("truncate", True)),
            **{ours: float(params[k]) for k, ours in optional.items() if params.get(k)},
        )
    return out


def to_hf(cfg: Any) -> dict[str, Any]:
    """HF's `rope_parameters` for `cfg`."""
    params: dict[str, Any] = {"rope_type": cfg.rope_scaling_type or "default"}
    params["rope_theta"] = cfg.rope_theta
    if cfg.rope_scaling_type:
        params["factor"] = cfg.rope_scaling_factor
    if cfg.rope_scaling_type == "llama3":
        params.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
        )
    if cfg.rope_scaling_type == "yarn":
        params.update(
            original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
            beta_fast=cfg.rope_beta_fast,
            beta_slow=cfg.rope_beta_slow,
            truncate=cfg.rope_truncate,
        )
        optional = {
            "attention_factor": cfg.rope_attention_factor,
            "mscale": cfg.rope_mscale,
            "mscale_all_dim": cfg.rope_mscale_all_dim,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
    return params
