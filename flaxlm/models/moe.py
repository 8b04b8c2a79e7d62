"""Mixture-of-experts MLP: its options, the layer and the expert-parallel dispatch.

`MoEOptions` holds the fields every MoE family config shares (`options_from_hf` /
`options_to_hf`: as config.json names them); `MoE` is the layer that replaces a block's MLP.
Each token goes to its `num_experts_per_tok` best experts by the router and comes back as
their outputs weighted by the router's weights (plus a sigmoid-gated shared expert,
Qwen2-MoE, or DeepSeek-V3's ungated shared experts). The experts, stacked `[expert, embed,
mlp]`, run one of three ways (`moe_impl`: dense, dropless, capacity; `experts.py`).

Expert parallelism: under a mesh (JAX's context, as in `context_parallel`: this module never
sees a Partitioner) with an `expert` axis of size n > 1, the experts' weights are split over it
(the logical axis `expert`) and `dropless` runs in a `shard_map` over the mesh axes that split
the tokens (the batch's, and `sequence` under context parallelism; without an `expert` axis
too, so that each device runs its own tokens rather than XLA gathering them all; the routing
and the router statistics likewise, `on_own_tokens`). The batch rule includes `expert`
(tokens enter the layer already split over it): in each group of n devices, the tokens are
all-gathered over `expert`, each device runs its E/n experts on the assignments routed to
them, and the partial outputs are summed and scattered back with one `psum_scatter` (its
transpose, an all-gather, carries the gradient). The experts' weights enter the shard_map
split as their params lie (`expert` on the experts, fsdp on `embed`: `weight_spec`) and are
all-gathered over fsdp inside it, fsdp's forward; the gathers' transpose reduce-scatters
their gradient back onto the shards, where weights taken whole would have it all-reduced
whole (twice the bytes over the ring; benchmarks/RESULTS.md, issue 45). The token dispatch
is 2 x tokens x embed bytes per device and layer, against 2 x k x tokens / n x embed for a
ragged all-to-all; but `jax.lax.ragged_all_to_all` does not run on CPU (JAX 0.10: "HLO opcode
`ragged-all-to-all` is not supported by XLA:CPU"), the tests' and the planner's platform, so
the all-gather form is the one kept (the ragged all-to-all is the step for GPU and TPU).

Routing, the router statistics every layer sows and the load-balance losses are in `routing`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from flaxlm.models import context_parallel, experts, layers, routing

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
    # Aux-loss-free load balance (DeepSeek-V3's gamma, 0.001 in its pre-training): after each
    # train step every layer's bias moves by this x sign(mean load - load), the loads counted
    # over the global batch (`routing.update_correction_bias`); 0: the bias stays.
    correction_bias_update_rate: float = 0.0
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
    # gpt-oss: biases on the router's logits (`gate/bias`) and on each expert's projections
    # (`experts/bi` [experts, 2, mlp], `experts/bo` [experts, embed]); its clamped SwiGLU
    # (`clamped_swiglu`) in the experts when `swiglu_limit` is set (None: `activation`).
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

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
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit {self.swiglu_limit} must be None or positive.")
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
        rate = self.correction_bias_update_rate
        if rate < 0 or (rate and not self.score_correction_bias):
            raise ValueError(
                f"correction_bias_update_rate {rate} must be >= 0, and > 0 only with "
                "score_correction_bias=True (the bias it moves)."
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
        router += self.num_experts if self.router_bias else 0
        shared = 3 * e * (self.shared_expert_intermediate_size + self.n_shared_experts * f)
        shared += e if self.shared_expert_intermediate_size else 0
        expert = 3 * e * f + (2 * f + e if self.expert_bias else 0)
        return (
            router + self.num_experts * expert + shared,
            router + self.num_experts_per_tok * expert + shared,
        )


def options_from_hf(hf: dict) -> dict[str, Any]:
    """MoEOptions' fields from an HF MoE config.json dict, as the Qwen-MoE line names them
    (Qwen2-MoE, Qwen3-MoE; Mixtral and OLMoE read the experts' width from
    `intermediate_size`)."""
    return dict(
        # transformers 5 writes Qwen3-MoE's and Mixtral's as num_local_experts.
        num_experts=hf.get("num_experts", hf.get("num_local_experts")),
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf.get("moe_intermediate_size", hf["intermediate_size"]),
        norm_topk_prob=hf.get("norm_topk_prob", False),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
    )


def options_to_hf(cfg: MoEOptions, experts_key: str = "num_experts") -> dict[str, Any]:
    """MoEOptions' fields as the Qwen-MoE line names them in config.json (`experts_key`: the
    name of num_experts that transformers 5 writes for the family): `options_from_hf`'s
    twin."""
    return {
        experts_key: cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
    }


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


# ------------------------------------------------------------------ expert parallelism


def expert_parallel(
    x: Array,
    wi: Array,
    wo: Array,
    weights: Array,
    ids: Array,
    act: experts.Glu,
    shards: int,
    bias: experts.Bias = None,
) -> Array | None:
    """`experts.grouped_experts` on each device's tokens, in a `shard_map` over the mesh axes
    that split them (the batch's, and `sequence` under context parallelism), with the experts
    split over the mesh's `expert` axis when `shards` > 1 (x `[batch, length, embed]`,
    weights and ids `[batch, length, k]`). Left to XLA, the sort by expert over tokens split
    across devices gathers every token onto every device, which then runs them all. The
    experts' weights enter split as their params are (`weight_spec`) and are all-gathered
    inside. None when no mesh splits the tokens or the experts (or the batch does not split
    evenly: a dummy batch), where XLA partitions the plain computation instead."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    rows, length = token_axes(mesh, x.shape[0], x.shape[1])
    gathered = shards > 1 and EXPERT_AXIS in rows
    manual = {*rows, *([length] if length else []), *([EXPERT_AXIS] if shards > 1 else [])}
    if not manual:
        return None
    local = wi.shape[0] // shards
    logical = (experts.WI_AXES, experts.WO_AXES)
    if bias is not None:
        logical += (experts.BI_AXES, experts.BO_AXES)
    params = (wi, wo, *(bias or ()))
    specs = tuple(weight_spec(w.shape, a, manual, shards) for w, a in zip(params, logical))

    def body(x: Array, weights: Array, ids: Array, *params: Array) -> Array:
        if gathered:  # the expert group's tokens, on each of its devices
            x, weights, ids = (
                jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True) for a in (x, weights, ids)
            )
        wi, wo, *b = (local_experts(w, s, manual) for w, s in zip(params, specs, strict=True))
        first = jax.lax.axis_index(EXPERT_AXIS) * local if shards > 1 else 0
        xt, wt, it = (a.reshape(-1, a.shape[-1]) for a in (x, weights, ids))
        y = experts.grouped_experts(xt, wi, wo, wt, it, act, first, tuple(b) or None)
        y = y.reshape(x.shape)
        if gathered:
            return jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, EXPERT_AXIS) if shards > 1 else y

    token_spec = P(rows or None, length, None)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(token_spec,) * 3 + specs,
        out_specs=token_spec,
        axis_names=frozenset(manual),
    )(x, weights, ids, *params)


def weight_spec(
    shape: tuple[int, ...], logical: tuple[str | None, ...], manual: set[str], shards: int
) -> P:
    """How `expert_parallel`'s `shard_map` takes a stacked expert weight of logical axes
    `logical`: as its param lies under the rules in force, `expert` on dim 0 when `shards` >
    1 and each other dim over the mesh axes that split it (fsdp on `embed`) where all of
    them are the shard_map's (`manual`) and divide it; the body gathers them
    (`local_experts`). Taken whole (`P()`) instead, the weight's gradient would leave the
    shard_map summed over the fsdp axes: an all-reduce of every expert's weights where a
    reduce-scatter onto the shards is enough."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = [EXPERT_AXIS if shards > 1 else None]
    for dim, axes in enumerate(tuple(nn.logical_to_mesh_axes(logical))[1:], start=1):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        split = bool(names) and set(names) <= manual
        split = split and not shape[dim] % math.prod(int(mesh.shape[a]) for a in names)
        spec.append((names[0] if len(names) == 1 else names) if split else None)
    return P(*spec)


def local_experts(w: Array, spec: P, manual: set[str]) -> Array:
    """Inside `expert_parallel`'s body: this device's experts of a weight taken as `spec`
    (`weight_spec`), whole. Its gradient, per device, is summed back onto the shards by the
    transposes: the gathers' (a reduce-scatter over fsdp), then the cast's (an all-reduce of
    the shard over the axes it is replicated on, `data`), in that order so that the
    all-reduce moves the shard and not the whole weight."""
    named = {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}
    replicated = tuple(sorted(manual - named))
    if replicated:
        w = jax.lax.pcast(w, replicated, to="varying")
    for dim, axes in enumerate(spec):
        if dim and axes:
            w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
    return w


def token_axes(mesh: Any, batch: int, length: int) -> tuple[tuple[str, ...], str | None]:
    """The mesh axes that split `[batch, length]` tokens under the rules in force: the
    batch's (none if they do not divide `batch`), and `sequence` if it splits `length`
    (context parallelism) and divides it (else None)."""
    rows = context_parallel.mesh_axis(mesh, "batch", batch)
    rows = () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)
    axis = context_parallel.SEQUENCE_AXIS
    if context_parallel.sequence_shards() == 1 or length % int(mesh.shape[axis]):
        return rows, None
    (axes,) = nn.logical_to_mesh_axes(("length",))
    return rows, axis if axes in (axis, (axis,)) else None


def on_own_tokens(
    fn: Callable[..., Any],
    tokens: tuple[Array, ...],
    shared: tuple[Any, ...] = (),
    *,
    summed: bool = False,
) -> Any:
    """`fn(*tokens, *shared)`, `tokens` `[batch, length, ...]` alike, on each device's own
    tokens in a `shard_map` over the mesh axes that split them (`token_axes`), `shared`
    whole on every device. fn's outputs are `[batch, length, ...]` split like the tokens,
    or with `summed` sums over the tokens (added over the devices). Without a mesh that
    splits the tokens, fn of the whole arrays. XLA left alone gathers a top-k over split
    rows (XLA:CPU), and a row-major flattening of a sequence split over `sequence`, onto
    every device, which then works on every token."""
    mesh = jax.sharding.get_abstract_mesh()
    b, length = tokens[0].shape[:2]
    rows, seq = ((), None) if mesh.empty else token_axes(mesh, b, length)
    manual = (*rows, *([seq] if seq else []))
    if not manual:
        return fn(*tokens, *shared)

    def body(*args: Any) -> Any:
        out = fn(*args)
        return jax.tree.map(lambda a: jax.lax.psum(a, manual), out) if summed else out

    spec = P(rows or None, seq)  # a prefix: the trailing dims whole
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(spec,) * len(tokens) + (P(),) * len(shared),
        out_specs=P() if summed else spec,
        axis_names=frozenset(manual),
    )(*tokens, *shared)


# ------------------------------------------------------------------ the layer


class MoE(nn.Module):
    """The mixture-of-experts MLP: `[batch, length, embed]` -> `[batch, length, embed]`.

    Params (HF's module names): `gate/kernel` `[embed, experts]` (the router; `gate/bias`
    with `router_bias`), the experts' (`experts.Experts`: `experts/wi` `[experts, embed, 2,
    mlp]`, `experts/wo` `[experts, mlp, embed]`, with `expert_bias` `bi`, `bo`), and with a
    shared expert `shared_expert/{gate,up,down}_proj` and `shared_expert_gate/kernel`
    `[embed, 1]`; DeepSeek-V3's ungated `shared_experts/{gate,up,down}_proj` and the
    router's float32 `e_score_correction_bias` `[experts]`.
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
            e, ("embed", None), use_bias=cfg.router_bias, dtype=self.dtype,
            param_dtype=self.param_dtype, out_dtype=jnp.float32, name="gate",
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

        def choose(z: Array, bias: Array | None) -> tuple[Array, Array]:
            out = routing.route(
                z.reshape(-1, e), k, cfg.router, cfg.norm_topk_prob,
                correction_bias=bias, n_group=cfg.n_group, topk_group=cfg.topk_group,
                scaling_factor=cfg.routed_scaling_factor,
            )  # fmt: skip
            return tuple(a.reshape(*z.shape[:2], k) for a in out)

        # [batch, length, k], each device routing its own tokens
        weights3, ids3 = on_own_tokens(choose, (logits,), (bias,))
        weights, ids = weights3.reshape(-1, k), ids3.reshape(-1, k)

        init = nn.initializers.normal(0.02)
        pdtype = layers.as_dtype(self.param_dtype)
        weights_of = experts.Experts(e, d, f, pdtype, init, cfg.expert_bias, name="experts")
        wi, wo, expert_bias = weights_of()
        wi, wo, expert_bias = jax.tree.map(lambda w: w.astype(dtype), (wi, wo, expert_bias))
        xt = x.reshape(-1, d).astype(dtype)
        dropped = None
        act, glu = cfg.activation, experts.expert_glu(cfg)
        if cfg.moe_impl == "dense":
            y = experts.dense_experts(xt, wi, wo, weights, ids, glu, expert_bias)
        elif cfg.moe_impl == "capacity":
            capacity = experts.expert_capacity(xt.shape[0], k, e, cfg.capacity_factor)
            y, dropped = experts.capacity_experts(
                xt, wi, wo, weights, ids, glu, capacity, expert_bias
            )
        else:
            y = expert_parallel(x.astype(dtype), wi, wo, weights3, ids3, glu, shards, expert_bias)
            y = None if y is None else y.reshape(-1, d)
            if y is None:
                y = experts.grouped_experts(xt, wi, wo, weights, ids, glu, bias=expert_bias)
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
        real = (real > 0).astype(jnp.float32)  # [batch, length]

        def count(logits: Array, ids: Array, real: Array) -> dict[str, Array]:
            flat = (a.reshape(-1, *a.shape[2:]) for a in (logits, ids, real))
            return routing.router_stats(*flat, e, router=cfg.router)

        stats = on_own_tokens(count, (logits, ids3, real), summed=True)
        if dropped is not None:  # capacity's, over the whole batch
            stats["dropped"] = jnp.sum(dropped * real.reshape(-1, 1))
        self.sow(routing.ROUTER_COLLECTION, routing.ROUTER_STATS, stats)
        return checkpoint_name(y.astype(dtype), "mlp_out")


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
