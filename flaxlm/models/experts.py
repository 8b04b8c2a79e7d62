"""The experts of a mixture-of-experts layer (`moe.MoE`) on one device: their stacked weights
(`Experts`), what each applies to its gate and up projections (a gated unit of the family's
activation, or gpt-oss's clamped SwiGLU) and the three ways to run them (`moe_impl`), equal up
to float rounding:

- `dense`: every expert over every token, weighted (zero weight off the token's top k): the
  reference, at E/k times the FLOPs;
- `dropless`: the (token, expert) assignments sorted by expert, one grouped matmul
  (`grouped_matmul.ragged_dot`: XLA's `ragged_dot`, or JAX's Mosaic GPU kernels on Hopper)
  per projection, unsorted and summed; no token dropped;
- `capacity`: each expert takes at most `capacity_factor * tokens * k / E` assignments (in
  token order), the rest dropped (their contribution is zero) and counted.

Biases (gpt-oss) are added after each projection, each expert its own. The expert-parallel
dispatch that runs `grouped_experts` on a mesh's `expert` axis is `expert_parallel.run_experts`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models import grouped_matmul, layers

Array = jax.Array

Glu = str | Callable[[Array, Array], Array]  # an activation's name, or (gate, up) -> hidden
Bias = tuple[Array, Array] | None  # the experts' (bi [experts, 2, mlp], bo [experts, embed])

# The stacked weights' logical axes: how their params are split, and so how
# `expert_parallel.run_experts` passes them into its shard_map.
WI_AXES = ("expert", "embed", None, "mlp")
WO_AXES = ("expert", "mlp", "embed")
BI_AXES = ("expert", None, "mlp")
BO_AXES = ("expert", "embed")


def _swiglu(h_gate: Array, h_up: Array, activation: Glu) -> Array:
    if callable(activation):
        return activation(h_gate, h_up)
    return layers.ACTIVATIONS[activation](h_gate) * h_up


def clamped_swiglu(gate: Array, up: Array, limit: float, alpha: float) -> Array:
    """gpt-oss's expert activation: the gate clamped above at `limit`, the up projection to
    +-`limit`, then `(up + 1) * gate * sigmoid(alpha * gate)` (transformers' GptOssExperts)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def expert_glu(cfg: Any) -> Glu:
    """What each routed expert applies to its gate and up projections: `cfg.activation`'s
    gated unit, or the clamped SwiGLU when `cfg.swiglu_limit` is set."""
    if cfg.swiglu_limit is None:
        return cfg.activation
    return functools.partial(clamped_swiglu, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)


def dense_experts(
    x: Array, wi: Array, wo: Array, weights: Array, ids: Array, act: Glu, bias: Bias = None
) -> Array:
    """Every expert over every token: x `[tokens, embed]`, wi `[experts, embed, 2, mlp]`, wo
    `[experts, mlp, embed]` (and `bias`) -> `[tokens, embed]` weighted by the router."""
    combine = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(ids, wi.shape[0], dtype=x.dtype))
    h = jnp.einsum("td,edgf->tegf", x, wi)
    h = h if bias is None else h + bias[0]
    y = jnp.einsum("tef,efd->ted", _swiglu(h[:, :, 0], h[:, :, 1], act), wo)
    y = y if bias is None else y + bias[1]
    return jnp.einsum("ted,te->td", y, combine.astype(y.dtype))


def grouped_experts(
    x: Array,
    wi: Array,
    wo: Array,
    weights: Array,
    ids: Array,
    act: Glu,
    first: Array | int = 0,
    bias: Bias = None,
    matmul: str = "auto",
    all_local: bool = False,
) -> Array:
    """Dropless: the assignments to experts `first .. first + wi.shape[0]` (the local ones
    under expert parallelism; all by default) sorted by expert, one grouped matmul per
    projection (`grouped_matmul.ragged_dot` by `matmul`), unsorted and weighted; other
    assignments contribute zero. `all_local`: every id is a local expert's (no expert
    parallelism), so no row lies past the groups and none is zeroed.

    x `[tokens, embed]`, wi `[local experts, embed, 2, mlp]`, wo `[local experts, mlp,
    embed]`, weights, ids `[tokens, k]` -> `[tokens, embed]`; `bias`: the local experts'."""
    tokens, k = ids.shape
    local = wi.shape[0]
    # Local experts first, in order; the others after them (their rows are in no group,
    # and ragged_dot gives them zeros).
    slot = ids.reshape(-1) - first
    slot = jnp.where((slot >= 0) & (slot < local), slot, local)
    order = jnp.argsort(slot, stable=True)
    sizes = jnp.bincount(slot, length=local + 1)[:local].astype(jnp.int32)
    # Permutations as gathers of distinct rows: their transposes are scatters without
    # collisions (a token's k rows are summed by the repeat's transpose, not by atomics).
    xs = jnp.repeat(x, k, axis=0).at[order].get(unique_indices=True)  # grouped by expert
    ragged_dot = functools.partial(grouped_matmul.ragged_dot, impl=matmul, all_grouped=all_local)
    # gate and up in one product: wi's `[embed, 2, mlp]` is `[embed, 2 x mlp]` in memory.
    mlp = wi.shape[-1]
    h = ragged_dot(xs, wi.reshape(local, wi.shape[1], 2 * mlp), sizes)
    gate, up = h[:, :mlp], h[:, mlp:]
    if bias is not None:  # each sorted row's expert's (rows past the groups: zeroed below)
        expert = jnp.minimum(slot[order], local - 1)
        gate, up = gate + bias[0][expert, 0], up + bias[0][expert, 1]
    ys = ragged_dot(_swiglu(gate, up, act), wo, sizes)
    ys = ys if bias is None else ys + bias[1][expert]
    if not all_local:
        kept = (jnp.arange(tokens * k) < jnp.sum(sizes))[:, None]
        ys = jnp.where(kept, ys, 0)  # rows past the groups: zero however they were left
    back = jnp.argsort(order)  # where each assignment's row went
    y = ys.at[back].get(unique_indices=True).reshape(tokens, k, -1)
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


def expert_capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """Assignments each expert takes under `capacity`: `factor` times its fair share."""
    return max(1, math.ceil(factor * tokens * k / experts))


def capacity_experts(
    x: Array,
    wi: Array,
    wo: Array,
    weights: Array,
    ids: Array,
    act: Glu,
    capacity: int,
    bias: Bias = None,
) -> tuple[Array, Array]:
    """Each expert takes its first `capacity` assignments in token order (a token's best
    expert before its second); the rest are dropped. Returns the output `[tokens, embed]`
    and float32 `[tokens, k]`: 1 where an assignment was dropped."""
    tokens, k = ids.shape
    experts = wi.shape[0]
    flat = ids.T.reshape(-1)  # rank-major: every token's first choice before any second
    onehot = jax.nn.one_hot(flat, experts, dtype=jnp.int32)
    position = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=-1) - 1
    keep = position < capacity
    token = jnp.tile(jnp.arange(tokens), k)
    buffer = jnp.zeros((experts, capacity, x.shape[-1]), x.dtype)
    buffer = buffer.at[flat, position].set(x[token], mode="drop")  # dropped: out of range
    h = jnp.einsum("ecd,edgf->ecgf", buffer, wi)
    h = h if bias is None else h + bias[0][:, None]
    out = jnp.einsum("ecf,efd->ecd", _swiglu(h[:, :, 0], h[:, :, 1], act), wo)
    out = out if bias is None else out + bias[1][:, None]
    ys = out.at[flat, jnp.minimum(position, capacity - 1)].get()
    ys = jnp.where(keep[:, None], ys, 0).reshape(k, tokens, -1)
    y = jnp.einsum("ktd,tk->td", ys, weights.astype(ys.dtype))
    return y, (~keep).reshape(k, tokens).T.astype(jnp.float32)


class Experts(nn.Module):
    """The experts' stacked weights, created with their logical axes: `wi` `[experts, embed,
    2, mlp]` (each expert's gate and up projections), `wo` `[experts, mlp, embed]`, and with
    `bias` (gpt-oss) `bi` `[experts, 2, mlp]` and `bo` `[experts, embed]`, zeros at init.
    Returns `(wi, wo, (bi, bo) or None)`, LoRA's low-rank updates added to `wi` and `wo`."""

    experts: int
    embed: int
    mlp: int
    param_dtype: Any
    init: Any
    bias: bool = False

    @nn.compact
    def __call__(self) -> tuple[Array, Array, Bias]:
        wi = self.param(
            "wi",
            nn.with_logical_partitioning(self.init, WI_AXES),
            (self.experts, self.embed, 2, self.mlp),
            self.param_dtype,
        )
        wo = self.param(
            "wo",
            nn.with_logical_partitioning(self.init, WO_AXES),
            (self.experts, self.mlp, self.embed),
            self.param_dtype,
        )
        bias = None
        if self.bias:
            zeros = nn.initializers.zeros
            bi = self.param(
                "bi",
                nn.with_logical_partitioning(zeros, BI_AXES),
                (self.experts, 2, self.mlp),
                self.param_dtype,
            )
            bo = self.param(
                "bo",
                nn.with_logical_partitioning(zeros, BO_AXES),
                (self.experts, self.embed),
                self.param_dtype,
            )
            bias = (bi, bo)
        return layers.with_lora(self, "wi", wi), layers.with_lora(self, "wo", wo), bias
