"""Gin-configurable optax optimizers and learning-rate schedules."""

from __future__ import annotations

from typing import Any

import gin
import jax
import jax.numpy as jnp
import optax

from flaxlm.parallel.pytrees import path_name

# Parameters whose leaf name is one of these get no weight decay (biases and norm scales).
# DeepSeek-V4's hash routing table (`tid2eid`): expert ids held as float32, never stepped.
NO_DECAY_NAMES = ("bias", "scale", "tid2eid")


@gin.configurable
def create_schedule(
    peak_learning_rate: float = 1e-3,
    warmup_steps: int = 100,
    decay: str = "cosine",
    total_steps: int = gin.REQUIRED,
    end_learning_rate_ratio: float = 0.1,
) -> optax.Schedule:
    """Linear warmup to `peak_learning_rate`, then `decay`.

    Args:
      decay: 'cosine' or 'linear' (to `end_learning_rate_ratio * peak` at `total_steps`),
        'rsqrt' (peak * sqrt(warmup / step)), or 'constant'.
    """
    for name, value in (
        ("peak_learning_rate (LEARNING_RATE)", peak_learning_rate),
        ("end_learning_rate_ratio", end_learning_rate_ratio),
    ):
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"{name}={value!r} must be a number >= 0, e.g. 1e-4 (no quotes).")
    warmup_steps = max(int(warmup_steps), 0)
    end = peak_learning_rate * end_learning_rate_ratio
    decay_steps = max(int(total_steps) - warmup_steps, 1)
    if decay == "cosine":
        after = optax.cosine_decay_schedule(
            peak_learning_rate, decay_steps, alpha=end_learning_rate_ratio
        )
    elif decay == "linear":
        after = optax.linear_schedule(peak_learning_rate, end, decay_steps)
    elif decay == "rsqrt":
        base = max(warmup_steps, 1)
        after = lambda step: peak_learning_rate * jax.lax.rsqrt((step + base) / base)
    elif decay == "constant":
        after = optax.constant_schedule(peak_learning_rate)
    else:
        raise ValueError(f"decay={decay!r}: expected 'cosine', 'linear', 'rsqrt' or 'constant'.")
    if warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, peak_learning_rate, warmup_steps)
    return optax.join_schedules([warmup, after], [warmup_steps])


def decay_mask(params: Any) -> Any:
    """True where weight decay applies: every param but biases and norm scales."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: path_name(path).split("/")[-1] not in NO_DECAY_NAMES, params
    )


@gin.configurable
def create_optimizer(
    name: str = "adamw",
    learning_rate: optax.ScalarOrSchedule = gin.REQUIRED,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    clip_norm: float | None = 1.0,
    adafactor_factored: bool = True,
    mu_dtype: str | None = None,
) -> optax.GradientTransformation:
    """AdamW, Adafactor or Lion with global-norm clipping and masked weight decay.

    Args:
      name: 'adamw', 'adafactor' (factored second moments) or 'lion' (sign of the
        interpolated momentum; use a learning rate ~3-10x smaller than AdamW's).
      clip_norm: global gradient-norm clip; None or 0 disables it.
      mu_dtype: dtype of the first moments (e.g. 'bfloat16' halves their memory); the
        params' dtype if None.
    """
    chain = []
    if clip_norm:
        chain.append(optax.clip_by_global_norm(clip_norm))
    mu = jnp.dtype(mu_dtype) if mu_dtype else None
    if name == "adamw":
        chain.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=mu))
    elif name == "lion":
        chain.append(optax.scale_by_lion(b1=b1, b2=b2, mu_dtype=mu))
    elif name == "adafactor":
        chain.append(
            optax.scale_by_factored_rms(factored=adafactor_factored, decay_rate=b2, epsilon=1e-30)
        )
        if b1:
            chain.append(optax.trace(decay=b1, accumulator_dtype=mu))
    else:
        raise ValueError(f"optimizer name={name!r}: expected 'adamw', 'adafactor' or 'lion'.")
    if weight_decay:
        chain.append(optax.add_decayed_weights(weight_decay, mask=decay_mask))
    chain.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*chain)
