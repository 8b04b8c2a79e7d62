"""DeepSeek-V4's mixture of experts (HF's `DeepseekV4SparseMoeBlock`): every layer's MLP.

A router whose scores are `scoring_func`'s (sqrt(softplus) or sigmoid) of its logits chooses
`num_experts_per_tok` experts: on 'hash_moe' layers a fixed table of the token id does
(`tid2eid`, HF's `gate.tid2eid`), on 'moe' layers the top scores plus
`e_score_correction_bias`; the chosen scores, renormalised and scaled by
`routed_scaling_factor`, weight the experts' outputs, and one shared expert of the same width
adds its own. Experts and the shared expert clamp their SwiGLU (`swiglu_limit`: the gate from
above, the up projection both ways). The experts run as `moe.MoE`'s do (`experts.py`,
`expert_parallel.run_experts`), 'dense' or 'dropless'; each layer sows `routing`'s statistics
(HF's aux loss: a softmax of the logits).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from flaxlm.models import expert_parallel, experts, layers, routing

Array = jax.Array


def v4_swiglu(gate: Array, up: Array, limit: float | None, activation: str) -> Array:
    """HF's V4 gated unit: `act(min(gate, limit)) * clip(up, -limit, limit)`."""
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return layers.ACTIVATIONS[activation](gate) * up


def router_scores(logits: Array, scoring_func: str) -> Array:
    """float32 scores of the router's logits: sqrt(softplus) or sigmoid (HF's ACT2FN)."""
    if scoring_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    return jax.nn.sigmoid(logits)


class DeepseekV4MoE(nn.Module):
    """The mixture of experts (HF's `mlp`): `(x, tokens, real)` -> `[batch, length, embed]`.
    Params: `gate/kernel` (and `tid2eid` float32 `[vocab, k]` on a `hashed` layer, else
    `e_score_correction_bias`), `experts/wi`, `experts/wo` (`experts.Experts`) and the shared
    expert `shared_experts/{gate,up,down}_proj`."""

    config: Any
    hashed: bool

    @nn.compact
    def __call__(self, x: Array, tokens: Array, real: Array | None) -> Array:
        cfg = self.config
        b, length, d = x.shape
        e, k, f = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        dtype = layers.as_dtype(cfg.dtype)
        logits = layers.DenseGeneral(
            e, ("embed", None), out_dtype=jnp.float32, name="gate", **dense
        )(x)  # [batch, length, experts]
        scores = router_scores(logits, cfg.scoring_func)
        if self.hashed:  # float32 (exact to 2^24): no gradient, no weight decay, never moves
            table = self.param(
                "tid2eid",
                nn.with_logical_partitioning(nn.initializers.zeros, ("vocab", None)),
                (cfg.vocab_size, k),
                jnp.float32,
            )
            ids = jax.lax.stop_gradient(table)[tokens].astype(jnp.int32)
        else:
            bias = self.param(
                routing.CORRECTION_BIAS,
                nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                (e,),
                jnp.float32,
            )
            ids = jax.lax.top_k(scores + jax.lax.stop_gradient(bias), k)[1]
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
        glu = functools.partial(v4_swiglu, limit=cfg.swiglu_limit, activation=cfg.activation)
        wi, wo, _ = experts.Experts(
            e, d, f, layers.as_dtype(cfg.param_dtype), nn.initializers.normal(0.02),
            name="experts",
        )()  # fmt: skip
        wi, wo = wi.astype(dtype), wo.astype(dtype)
        xt = x.reshape(-1, d).astype(dtype)
        flat_weights, flat_ids = weights.reshape(-1, k), ids.reshape(-1, k)
        out = None
        if cfg.moe_impl == "dropless":  # the config refuses 'capacity'
            out = expert_parallel.run_experts(
                x.astype(dtype), wi, wo, weights, ids, glu, expert_parallel.expert_shards(e),
                dispatch=cfg.moe_dispatch, capacity_factor=cfg.capacity_factor,
                ragged_buffer_factor=cfg.ragged_buffer_factor, matmul=cfg.grouped_matmul,
            )  # fmt: skip
        if out is not None:
            y, dropped = out
        elif cfg.moe_impl == "dense":
            y, dropped = experts.dense_experts(xt, wi, wo, flat_weights, flat_ids, glu), None
        else:
            y = experts.grouped_experts(
                xt, wi, wo, flat_weights, flat_ids, glu, matmul=cfg.grouped_matmul, all_local=True
            )
            dropped = None
        y = y.reshape(b, length, d) + SharedExpert(cfg, name="shared_experts")(x)
        real = (jnp.ones((b, length)) if real is None else real > 0).astype(jnp.float32)
        stats = routing.router_stats(logits.reshape(-1, e), flat_ids, real.reshape(-1), e)
        if dropped is not None:  # the all-to-all or ragged dispatch's
            stats["dropped"] = jnp.sum(dropped.reshape(-1, k) * real.reshape(-1, 1))
        self.sow(routing.ROUTER_COLLECTION, routing.ROUTER_STATS, stats)
        return checkpoint_name(y.astype(dtype), "mlp_out")


class SharedExpert(nn.Module):
    """HF's `shared_experts` (`DeepseekV4MLP`): the clamped SwiGLU of `moe_intermediate_size`."""

    config: Any

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        proj = lambda n, axes, name: layers.DenseGeneral(n, axes, name=name, **dense)  # noqa: E731
        f = cfg.moe_intermediate_size
        gate = proj(f, ("embed", "mlp"), "gate_proj")(x)
        up = proj(f, ("embed", "mlp"), "up_proj")(x)
        hidden = v4_swiglu(gate, up, cfg.swiglu_limit, cfg.activation)
        return proj(cfg.hidden_size, ("mlp", "embed"), "down_proj")(hidden)
