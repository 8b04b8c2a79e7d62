"""Mixture-of-experts MLP: a router, experts stacked `[expert, embed, mlp]`, three ways to run
them, the expert-parallel dispatch and the load-balance losses.

`MoEOptions` holds the fields every MoE family config shares; `MoE` is the layer that replaces a
block's MLP. Each token goes to its `num_experts_per_tok` best experts by the router and comes
back as their outputs weighted by the router's weights (plus a sigmoid-gated shared expert,
Qwen2-MoE, or DeepSeek-V3's ungated shared experts). The experts run one of three ways
(`moe_impl`), equal up to float rounding:

- `dense`: every expert over every token, weighted (zero weight off the token's top k): the
  reference, at E/k times the FLOPs;
- `dropless`: the (token, expert) assignments sorted by expert, one grouped matmul
  (`jax.lax.ragged_dot`) per projection, unsorted and summed; no token dropped;
- `capacity`: each expert takes at most `capacity_factor * tokens * k / E` assignments (in
  token order), the rest dropped (their contribution is zero) and counted.

Expert parallelism: under a mesh (JAX's context, as in `context_parallel`: this module never
sees a Partitioner) with an `expert` axis of size n > 1, the experts' weights are split over it
(the logical axis `expert`) and `dropless` runs in a `shard_map` over the mesh axes that split
the batch. The batch rule includes `expert` (tokens enter the layer already split over it): in
each group of n devices, the tokens are all-gathered over `expert`, each device runs its E/n
experts on the assignments routed to them, and the partial outputs are summed and scattered
back with one `psum_scatter` (its transpose, an all-gather, carries the gradient). That is
2 x tokens x embed bytes per device and layer, against 2 x k x tokens / n x embed for a
ragged all-to-all; but `jax.lax.ragged_all_to_all` does not run on CPU (JAX 0.10: "HLO opcode
`ragged-all-to-all` is not supported by XLA:CPU"), the tests' and the planner's platform, so
the all-gather form is the one kept (the ragged all-to-all is the step for GPU and TPU).

Routing, the router statistics every layer sows and the load-balance losses are in `routing`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from flaxlm.models import context_parallel, layers, routing

Array = jax.Array

IMPLEMENTATIONS = ("dense", "dropless", "capacity")
EXPERT_AXIS = "expert"  # the mesh axis (and logical axis) that splits the experts


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEOptions:
    """The fields an MoE family's config adds (HF names where they exist). A family config
    inherits them and calls `check_moe()` in its `__post_init__`."""

    num_experts: int = 8  # HF: num_experts (Mixtral: num_local_experts)
    num_experts_per_tok: int = 2  # k: experts each token is routed to
    moe_intermediate_size: int = 1408  # each expert's MLP width
    # 'softmax_topk': softmax over all experts, then the top k (HF's routers);
    # 'topk_softmax': the top k logits, then a softmax over them (= softmax_topk renormalised);
    # 'sigmoid_topk': a sigmoid per expert, then the top k (DeepSeek-V3). See routing.route.
    router: str = "softmax_topk"
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum to 1 (Mixtral: always)
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this (DeepSeek-V3)
    # DeepSeek-V3: a float32 per-expert bias (`e_score_correction_bias`, outside the
    # optimizer) added to the scores to choose the experts, not to weight them.
    score_correction_bias: bool = False
    # Group-limited routing (DeepSeek-V3): experts in `n_group` equal groups, a token's k
    # chosen from its `topk_group` best groups only (topk_group == n_group: no limit).
    n_group: int = 1
    topk_group: int = 1
    # Qwen2-MoE: a SwiGLU expert every token goes through, scaled by sigmoid(x . w); 0: none.
    shared_expert_intermediate_size: int = 0
    # DeepSeek-V3: a SwiGLU of n_shared_experts x moe_intermediate_size every token goes
    # through, ungated (HF's `shared_experts`); 0: none.
    n_shared_experts: int = 0
    moe_impl: str = "dropless"  # one of IMPLEMENTATIONS
    capacity_factor: float = 1.25  # `capacity` only: assignments an expert takes / fair share
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in training
    router_z_loss_coef: float = 0.0  # weight of the router z-loss (ST-MoE)
    # Which layers are sparse: every `decoder_sparse_step`-th (HF: layer i is sparse if
    # (i + 1) % step == 0), except those in `mlp_only_layers` (dense MLP of intermediate_size).
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def check_moe(self) -> None:
        """ValueErrors naming the MoE field flaxlm cannot run."""
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.router not in routing.ROUTERS:
            raise ValueError(f"router {self.router!r}: expected one of {routing.ROUTERS}.")
        if self.moe_impl not in IMPLEMENTATIONS:
            raise ValueError(f"moe_impl {self.moe_impl!r}: expected one of {IMPLEMENTATIONS}.")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, num_experts="
                f"{self.num_experts}]."
            )
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor {self.capacity_factor} must be positive.")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step {self.decoder_sparse_step} must be >= 1.")
        self._check_choice()

    def _check_choice(self) -> None:
        """ValueErrors naming the group-routing or correction-bias field that cannot be."""
        e, k = self.num_experts, self.num_experts_per_tok
        groups, best = self.n_group, self.topk_group
        if groups < 1 or e % groups:
            raise ValueError(f"n_group {groups} must be >= 1 and divide num_experts {e}.")
        if not 1 <= best <= groups or best * (e // groups) < k:
            raise ValueError(
                f"topk_group {best} must be in [1, n_group={groups}] and its groups hold at "
                f"least num_experts_per_tok={k} experts ({e // groups} a group)."
            )
        if self.router == "topk_softmax" and (self.score_correction_bias or best < groups):
            raise ValueError(
                "router='topk_softmax' chooses by the logits: score_correction_bias and "
                "topk_group < n_group need router='softmax_topk' or 'sigmoid_topk'."
            )
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts {self.n_shared_experts} must be >= 0.")

    def sparse_layers(self, num_layers: int) -> tuple[bool, ...]:
        """Whether each layer's MLP is the mixture of experts (HF's rule)."""
        step = self.decoder_sparse_step
        return tuple(
            i not in self.mlp_only_layers and (i + 1) % step == 0 for i in range(num_layers)
        )

    def moe_params(self, hidden_size: int) -> tuple[int, int]:
        """(all, active per token) params of one MoE MLP: router (and its correction bias),
        experts, shared experts."""
        e, f = hidden_size, self.moe_intermediate_size
        router = e * self.num_experts + (self.num_experts if self.score_correction_bias else 0)
        shared = 3 * e * (self.shared_expert_intermediate_size + self.n_shared_experts * f)
        shared += e if self.shared_expert_intermediate_size else 0
        expert = 3 * e * f
        return (
            router + self.num_experts * expert + shared,
            router + self.num_experts_per_tok * expert + shared,
        )


def has_experts(config: Any) -> bool:
    """Whether a family config has MoE layers (so its loss adds the router losses)."""
    return isinstance(config, MoEOptions) and any(config.sparse_layers(config.num_layers))


def expert_shards(num_experts: int) -> int:
    """Into how many shards the mesh in JAX's context splits the experts (1: no `expert`
    axis); a ValueError naming both numbers if they do not divide."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return 1
    n = int(mesh.shape[EXPERT_AXIS])
    if num_experts % n:
        raise ValueError(
            f"num_experts {num_experts} is not divisible by the mesh's 'expert' axis ({n}): "
            "change Partitioner.mesh_shape or the model's num_experts."
        )
    return n


# ------------------------------------------------------------------ the experts


def _swiglu(h_gate: Array, h_up: Array, activation: str) -> Array:
    return layers.ACTIVATIONS[activation](h_gate) * h_up


def dense_experts(x: Array, wi: Array, wo: Array, weights: Array, ids: Array, act: str) -> Array:
    """Every expert over every token: x `[tokens, embed]`, wi `[experts, embed, 2, mlp]`, wo
    `[experts, mlp, embed]` -> `[tokens, embed]` weighted by the router."""
    combine = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(ids, wi.shape[0], dtype=x.dtype))
    h = jnp.einsum("td,edgf->tegf", x, wi)
    y = jnp.einsum("tef,efd->ted", _swiglu(h[:, :, 0], h[:, :, 1], act), wo)
    return jnp.einsum("ted,te->td", y, combine.astype(y.dtype))


def grouped_experts(
    x: Array, wi: Array, wo: Array, weights: Array, ids: Array, act: str, first: Array | int = 0
) -> Array:
    """Dropless: the assignments to experts `first .. first + wi.shape[0]` (the local ones
    under expert parallelism; all by default) sorted by expert, one `ragged_dot` per
    projection, unsorted and weighted; other assignments contribute zero.

    x `[tokens, embed]`, wi `[local experts, embed, 2, mlp]`, wo `[local experts, mlp,
    embed]`, weights, ids `[tokens, k]` -> `[tokens, embed]`."""
    tokens, k = ids.shape
    local = wi.shape[0]
    # Local experts first, in order; the others after them (their rows are in no group,
    # and ragged_dot gives them zeros).
    slot = ids.reshape(-1) - first
    slot = jnp.where((slot >= 0) & (slot < local), slot, local)
    order = jnp.argsort(slot, stable=True)
    sizes = jnp.bincount(slot, length=local + 1)[:local].astype(jnp.int32)
    xs = x[order // k]  # [tokens * k, embed], grouped by expert
    gate = jax.lax.ragged_dot(xs, wi[:, :, 0], sizes)
    up = jax.lax.ragged_dot(xs, wi[:, :, 1], sizes)
    ys = jax.lax.ragged_dot(_swiglu(gate, up, act), wo, sizes)
    kept = (jnp.arange(tokens * k) < jnp.sum(sizes))[:, None]
    ys = jnp.where(kept, ys, 0)  # rows past the groups: zero however ragged_dot leaves them
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(tokens, k, -1)
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


def expert_capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """Assignments each expert takes under `capacity`: `factor` times its fair share."""
    return max(1, math.ceil(factor * tokens * k / experts))


def capacity_experts(
    x: Array, wi: Array, wo: Array, weights: Array, ids: Array, act: str, capacity: int
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
    out = jnp.einsum("ecf,efd->ecd", _swiglu(h[:, :, 0], h[:, :, 1], act), wo)
    ys = out.at[flat, jnp.minimum(position, capacity - 1)].get()
    ys = jnp.where(keep[:, None], ys, 0).reshape(k, tokens, -1)
    y = jnp.einsum("ktd,tk->td", ys, weights.astype(ys.dtype))
    return y, (~keep).reshape(k, tokens).T.astype(jnp.float32)


def expert_parallel(
    x: Array, wi: Array, wo: Array, weights: Array, ids: Array, act: str, shards: int
) -> Array | None:
    """`grouped_experts` with the experts split over the mesh's `expert` axis, in a
    `shard_map` over the axes that split the batch (x `[batch, length, embed]`, weights and
    ids `[batch, length, k]`); None when the batch does not split evenly (a dummy batch),
    where XLA partitions the plain computation instead."""
    mesh = jax.sharding.get_abstract_mesh()
    rows = context_parallel.mesh_axis(mesh, "batch", x.shape[0])
    rows = () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)
    gathered = EXPERT_AXIS in rows
    manual = rows if gathered else (*rows, EXPERT_AXIS)
    local = wi.shape[0] // shards

    def body(x: Array, wi: Array, wo: Array, weights: Array, ids: Array) -> Array:
        if gathered:  # the expert group's tokens, on each of its devices
            x, weights, ids = (
                jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True) for a in (x, weights, ids)
            )
        first = jax.lax.axis_index(EXPERT_AXIS) * local
        xt, wt, it = (a.reshape(-1, a.shape[-1]) for a in (x, weights, ids))
        y = grouped_experts(xt, wi, wo, wt, it, act, first).reshape(x.shape)
        if gathered:
            return jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, EXPERT_AXIS)

    token_spec = P(rows or None, None, None)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(token_spec, P(EXPERT_AXIS), P(EXPERT_AXIS), token_spec, token_spec),
        out_specs=token_spec,
        axis_names=frozenset(manual),
    )(x, wi, wo, weights, ids)


# ------------------------------------------------------------------ the layer


class MoE(nn.Module):
    """The mixture-of-experts MLP: `[batch, length, embed]` -> `[batch, length, embed]`.

    Params (HF's module names): `gate/kernel` `[embed, experts]` (the router), `experts/wi`
    `[experts, embed, 2, mlp]` (each expert's gate and up projections), `experts/wo`
    `[experts, mlp, embed]`, and with a shared expert `shared_expert/{gate,up,down}_proj` and
    `shared_expert_gate/kernel` `[embed, 1]`; DeepSeek-V3's ungated `shared_experts/{gate,up,
    down}_proj` and the router's float32 `e_score_correction_bias` `[experts]`.
    """

    config: Any  # a family config with MoEOptions' fields, hidden_size, activation
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array, real: Array | None = None) -> Array:
        """`real`: `[batch, length]`, nonzero at real tokens (the statistics' weights)."""
        cfg = self.config
        b, length, d = x.shape
        e, k, f = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        dtype = layers.as_dtype(self.dtype)
        shards = expert_shards(e)
        router = layers.DenseGeneral(
            e, ("embed", None), dtype=self.dtype, param_dtype=self.param_dtype,
            out_dtype=jnp.float32, name="gate",
        )  # fmt: skip
        logits = router(x)  # [batch, length, experts], float32
        bias = None
        if cfg.score_correction_bias:  # float32 whatever param_dtype: small steps move it
            bias = self.param(
                "e_score_correction_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                (e,),
                jnp.float32,
            )
            bias = jax.lax.stop_gradient(bias)  # chooses, never weights: no gradient
        weights, ids = routing.route(
            logits.reshape(-1, e), k, cfg.router, cfg.norm_topk_prob,
            correction_bias=bias, n_group=cfg.n_group, topk_group=cfg.topk_group,
            scaling_factor=cfg.routed_scaling_factor,
        )  # fmt: skip

        init = nn.initializers.normal(0.02)
        pdtype = layers.as_dtype(self.param_dtype)
        experts = _Experts(e, d, f, pdtype, init, name="experts")
        wi, wo = (w.astype(dtype) for w in experts())
        xt = x.reshape(-1, d).astype(dtype)
        dropped = None
        act = cfg.activation
        if cfg.moe_impl == "dense":
            y = dense_experts(xt, wi, wo, weights, ids, act)
        elif cfg.moe_impl == "capacity":
            capacity = expert_capacity(xt.shape[0], k, e, cfg.capacity_factor)
            y, dropped = capacity_experts(xt, wi, wo, weights, ids, act, capacity)
        else:
            y = None
            if shards > 1:
                split = lambda a: a.reshape(b, length, -1)  # noqa: E731
                y = expert_parallel(
                    x.astype(dtype), wi, wo, split(weights), split(ids), act, shards
                )
                y = None if y is None else y.reshape(-1, d)
            if y is None:
                y = grouped_experts(xt, wi, wo, weights, ids, act)
        y = y.reshape(b, length, d)

        if cfg.shared_expert_intermediate_size:
            dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
            shared = GatedMLP(
                cfg.shared_expert_intermediate_size, d, act, name="shared_expert", **dense
            )(x)
            gate = layers.DenseGeneral(1, ("embed", None), name="shared_expert_gate", **dense)(x)
            y = y + jax.nn.sigmoid(gate.astype(jnp.float32)).astype(shared.dtype) * shared
        if cfg.n_shared_experts:
            shared_experts = GatedMLP(
                cfg.n_shared_experts * f, d, act, name="shared_experts",
                dtype=self.dtype, param_dtype=self.param_dtype,
            )  # fmt: skip
            y = y + shared_experts(x)

        real = jnp.ones((b, length)) if real is None else real
        real = (real.reshape(-1) > 0).astype(jnp.float32)
        if dropped is not None:
            dropped = dropped * real[:, None]
        stats = routing.router_stats(logits.reshape(-1, e), ids, real, e, dropped, cfg.router)
        self.sow(routing.ROUTER_COLLECTION, routing.ROUTER_STATS, stats)
        return checkpoint_name(y.astype(dtype), "mlp_out")


class _Experts(nn.Module):
    """The experts' stacked weights, created with their logical axes."""

    experts: int
    embed: int
    mlp: int
    param_dtype: Any
    init: Any

    @nn.compact
    def __call__(self) -> tuple[Array, Array]:
        wi = self.param(
            "wi",
            nn.with_logical_partitioning(self.init, ("expert", "embed", None, "mlp")),
            (self.experts, self.embed, 2, self.mlp),
            self.param_dtype,
        )
        wo = self.param(
            "wo",
            nn.with_logical_partitioning(self.init, ("expert", "mlp", "embed")),
            (self.experts, self.mlp, self.embed),
            self.param_dtype,
        )
        return layers.with_lora(self, "wi", wi), layers.with_lora(self, "wo", wo)


class GatedMLP(nn.Module):
    """A SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`) in its own scope: Qwen2-MoE's shared
    expert, and the dense MLP of an MoE family's dense layers."""

    intermediate_size: int
    hidden_size: int
    activation: str
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        return layers.gated_mlp(
            x,
            intermediate_size=self.intermediate_size,
            hidden_size=self.hidden_size,
            activation=self.activation,
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )


def real_tokens(mask: Any, length: int) -> Array | None:
    """`[batch, length]` nonzero at real tokens, from a block's attention `Mask` (its
    segment ids; None when it has none or is a decoding step's)."""
    segments = getattr(mask, "q_segment_ids", None)
    if segments is None or segments.shape[-1] != length:
        return None
    return segments
