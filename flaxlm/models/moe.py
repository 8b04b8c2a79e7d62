"""Mixture-of-experts MLP: its options and the layer.

`MoEOptions` holds the fields every MoE family config shares (`options_from_hf` /
`options_to_hf`: as config.json names them); `MoE` is the layer that replaces a block's MLP.
Each token goes to its `num_experts_per_tok` best experts by the router and comes back as
their outputs weighted by the router's weights (plus a sigmoid-gated shared expert,
Qwen2-MoE, or DeepSeek-V3's ungated shared experts). The experts, stacked `[expert, embed,
mlp]`, run one of three ways (`moe_impl`: dense, dropless, capacity; `experts.py`), dropless's
grouped matmul by `grouped_matmul` (XLA's, or JAX's Mosaic GPU kernels: `grouped_matmul.py`).

Under a mesh with an `expert` axis the experts are split over it, and `dropless` runs on each
device's own tokens in a `shard_map`, the tokens sent to their experts' devices by
`moe_dispatch` ('all_gather', the capacity-bounded 'all_to_all' or 'ragged'): `expert_parallel`.

Routing, the router statistics every layer sows and the load-balance losses are in `routing`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from flaxlm.models import expert_parallel, experts, grouped_matmul, layers, routing, stacks

Array = jax.Array

IMPLEMENTATIONS = ("dense", "dropless", "capacity")
# The MoEOptions fields every MoE model needs, and the config.json keys that hold them.
_HF_NAMES = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_experts_per_tok": ("num_experts_per_tok",),
    "moe_intermediate_size": ("moe_intermediate_size", "intermediate_size"),
}


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
    # How `dropless` tokens reach their experts' devices under an `expert` mesh axis
    # (expert_parallel.DISPATCHES): 'all_gather' (no drops, buffers grow with the axis),
    # 'all_to_all' (buffers of capacity_factor x the fair share to each device, the rest
    # dropped) or 'ragged' (`jax.lax.ragged_all_to_all`: a receive buffer of
    # ragged_buffer_factor x the fair share, the rest dropped).
    moe_dispatch: str = "all_gather"
    # How `dropless` runs its grouped matmuls (grouped_matmul.GROUPED_MATMULS): 'xla'
    # (`jax.lax.ragged_dot`), 'mosaic_gpu' (JAX's Pallas kernels for Hopper GPUs), 'auto'
    # (the kernels on an H100/H200 in bfloat16/float16, else 'xla').
    grouped_matmul: str = "auto"
    # `capacity`: assignments an expert takes / its fair share; the `all_to_all` dispatch:
    # assignments a device sends each device of its expert group / the fair share.
    capacity_factor: float = 1.25
    # The `ragged` dispatch: rows a device receives / the assignments each device sends
    # (tokens x k). The axis's size n (or more) never drops; 1 drops whatever routing
    # leaves unbalanced. 2 is what MaxText's large MoE recipes run (its default, -1, is
    # the worst case, n: at `expert` 64 as large as the all-gather's buffers).
    ragged_buffer_factor: float = 2.0
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in training
    # What the load-balancing loss balances (routing.AUX_LOSS_SCOPES): 'pooled', the loads of
    # all MoE layers at once (HF's), or 'per_layer', each layer's, averaged over the layers
    # (Switch Transformer's, MaxText's). A training choice: config.json has no such key.
    router_aux_loss_scope: str = "pooled"
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
    # Llama 4: each chosen expert runs on the token times its router weight, its output
    # summed unweighted (HF's Llama4TextMoe), where the others weight the output.
    router_scales_input: bool = False
    # Gemma 4: the chosen experts' weights times a learned scale per expert
    # (`per_expert_scale` [experts], HF's `router.per_expert_scale`).
    per_expert_scale: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def check_moe(self) -> None:
        """ValueErrors naming the MoE field flaxlm cannot run."""
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        for field, hf_names in _HF_NAMES.items():
            if getattr(self, field) is None:  # a config.json without it (options_from_hf)
                raise ValueError(
                    f"{field} is not set: an MoE model needs it (config.json's "
                    f"{' or '.join(hf_names)})."
                )
        if self.router not in routing.ROUTERS:
            raise ValueError(f"router {self.router!r}: expected one of {routing.ROUTERS}.")
        if self.router_aux_loss_scope not in routing.AUX_LOSS_SCOPES:
            raise ValueError(
                f"router_aux_loss_scope {self.router_aux_loss_scope!r}: expected one of "
                f"{routing.AUX_LOSS_SCOPES}."
            )
        if self.moe_impl not in IMPLEMENTATIONS:
            raise ValueError(f"moe_impl {self.moe_impl!r}: expected one of {IMPLEMENTATIONS}.")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, num_experts="
                f"{self.num_experts}]."
            )
        if self.moe_dispatch not in expert_parallel.DISPATCHES:
            raise ValueError(
                f"moe_dispatch {self.moe_dispatch!r}: expected one of {expert_parallel.DISPATCHES}."
            )
        if self.grouped_matmul not in grouped_matmul.GROUPED_MATMULS:
            raise ValueError(
                f"grouped_matmul {self.grouped_matmul!r}: expected one of "
                f"{grouped_matmul.GROUPED_MATMULS}."
            )
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor {self.capacity_factor} must be positive.")
        if self.ragged_buffer_factor <= 0:
            raise ValueError(f"ragged_buffer_factor {self.ragged_buffer_factor} must be positive.")
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
        router += self.num_experts if self.per_expert_scale else 0
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


def scan_start(sparse: Sequence[bool]) -> int | None:
    """The first layer a scan can stack, given whether each layer's MLP is the MoE: 0 when
    all are alike, k when the first k are dense and the rest MoE (DeepSeek-V3's
    `first_k_dense_replace`: those stay unrolled), None when they mix otherwise."""
    if not any(sparse):
        return 0
    k = list(sparse).index(True)
    return k if all(sparse[k:]) else None


class DenseFirstScan:
    """A config mixin (listed before the dataclass bases, so that it overrides
    `ComputeOptions`): `scan_layers` stacks the MoE layers after the dense first ones, or
    the cycle dense and MoE layers repeat (Llama 4 Maverick's dense, MoE; a Qwen-MoE's
    `decoder_sparse_step` or `mlp_only_layers` among its MoE layers)."""

    @property
    def first_scanned_layer(self) -> int:
        """The first MoE layer where every later one is MoE (0 when every layer is alike):
        the dense ones before it stay unrolled under `scan_layers`; where dense layers sit
        among the MoE ones, the first layer of the layout with the fewest distinct layers
        (`stacks.layout_of` of `scan_kinds`)."""
        start = scan_start(self.sparse_layers(self.num_layers))
        return start if start is not None else stacks.layout_of(self.scan_kinds())[0]

    def scan_kinds(self) -> Sequence[Hashable]:
        """Each layer's kind, what a scan's cycle repeats: dense or MoE MLP here (a hybrid's
        token mixer beside it in its config)."""
        return self.sparse_layers(self.num_layers)

    @property
    def scan_period(self) -> int:
        """The cycle of layer kinds (`scan_kinds`) from `first_scanned_layer` on
        (`stacks.cycle_of`)."""
        return stacks.cycle_of(self.scan_kinds()[self.first_scanned_layer :])[0]

    @property
    def scan_tail(self) -> int:
        """The layers after the cycle's last whole repeat, unrolled (`stacks.cycle_of`)."""
        return stacks.cycle_of(self.scan_kinds()[self.first_scanned_layer :])[1]


def has_experts(config: Any) -> bool:
    """Whether a family config has MoE layers (so its loss adds the router losses)."""
    return isinstance(config, MoEOptions) and any(config.sparse_layers(config.num_layers))


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
    def __call__(
        self, x: Array, real: Array | None = None, router_input: Array | None = None
    ) -> Array:
        """`real`: `[batch, length]`, nonzero at real tokens (the statistics' weights);
        `router_input`: what the router reads in place of `x` (Gemma 4's, normed apart)."""
        cfg = self.config
        b, length, d = x.shape
        e, k, f = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        dtype = layers.as_dtype(self.dtype)
        shards = expert_parallel.expert_shards(e)
        router = layers.DenseGeneral(
            e, ("embed", None), use_bias=cfg.router_bias, dtype=self.dtype,
            param_dtype=self.param_dtype, out_dtype=jnp.float32, name="gate",
        )  # fmt: skip
        logits = router(x if router_input is None else router_input)  # [b, len, experts], f32
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
        weights3, ids3 = expert_parallel.on_own_tokens(choose, (logits,), (bias,))
        if cfg.per_expert_scale:
            init = nn.with_logical_partitioning(nn.initializers.ones, (None,))
            scale = self.param("per_expert_scale", init, (e,), layers.as_dtype(self.param_dtype))
            weights3 = weights3 * scale.astype(weights3.dtype)[ids3]

        init = nn.initializers.normal(0.02)
        pdtype = layers.as_dtype(self.param_dtype)
        weights_of = experts.Experts(e, d, f, pdtype, init, cfg.expert_bias, name="experts")
        wi, wo, expert_bias = weights_of()
        wi, wo, expert_bias = jax.tree.map(lambda w: w.astype(dtype), (wi, wo, expert_bias))
        act, glu = cfg.activation, experts.expert_glu(cfg)

        def run(x: Array, weights3: Array, ids3: Array) -> tuple[Array, Array | None]:
            """The experts' weighted sum `[batch, length, embed]` and the dropped
            assignments (float32 `[tokens, k]`, or None) by `moe_impl`."""
            k = ids3.shape[-1]
            weights, ids = weights3.reshape(-1, k), ids3.reshape(-1, k)
            xt = x.reshape(-1, d).astype(dtype)
            dropped = None
            if cfg.moe_impl == "dense":
                y = experts.dense_experts(xt, wi, wo, weights, ids, glu, expert_bias)
            elif cfg.moe_impl == "capacity":
                capacity = experts.expert_capacity(xt.shape[0], k, e, cfg.capacity_factor)
                y, dropped = experts.capacity_experts(
                    xt, wi, wo, weights, ids, glu, capacity, expert_bias
                )
            else:
                out = expert_parallel.run_experts(
                    x.astype(dtype), wi, wo, weights3, ids3, glu, shards, expert_bias,
                    dispatch=cfg.moe_dispatch, capacity_factor=cfg.capacity_factor,
                    ragged_buffer_factor=cfg.ragged_buffer_factor, matmul=cfg.grouped_matmul,
                )  # fmt: skip
                if out is None:
                    y = experts.grouped_experts(
                        xt, wi, wo, weights, ids, glu, bias=expert_bias,
                        matmul=cfg.grouped_matmul, all_local=True,
                    )  # fmt: skip
                else:
                    y, dropped = out
                    dropped = None if dropped is None else dropped.reshape(-1, k)
            return y.reshape(b, length, d), dropped

        if cfg.router_scales_input:
            # One pass per rank r: every token's r-th expert on the token scaled by its
            # weight, unweighted after (the expert is not linear: the two orders differ).
            ones = jnp.ones_like(weights3[..., :1])
            passes = [
                run(x * weights3[..., r : r + 1].astype(x.dtype), ones, ids3[..., r : r + 1])
                for r in range(k)
            ]
            y = sum(p[0] for p in passes)
            dropped = None
            if passes[0][1] is not None:
                dropped = jnp.concatenate([p[1] for p in passes], axis=-1)
        else:
            y, dropped = run(x, weights3, ids3)

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

        stats = expert_parallel.on_own_tokens(count, (logits, ids3, real), summed=True)
        if dropped is not None:  # capacity's, or the all_to_all or ragged dispatch's
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
