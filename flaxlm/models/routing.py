"""Routing for the mixture of experts (`moe.MoE`): the router's top-k choice, the statistics
each MoE layer sows, and the load-balance losses and telemetry made from them.

The choice: scores from the router's logits (a softmax over the experts, or DeepSeek-V3's
independent sigmoids), the top k of them, their scores the weights (renormalised with
`norm_topk_prob`, times `routed_scaling_factor`); or Mixtral's top-k logits then a softmax
over them. DeepSeek-V3 adds two things that change which experts are chosen, never the
weights: a per-expert `e_score_correction_bias` (the aux-loss-free load balance moves it)
added to the scores before the top k, and group-limited routing: the experts fall into
`n_group` groups, each group rated by the sum of its two best scores, and only the
`topk_group` best groups' experts may be chosen.

Load balance: every layer sows (Flax `intermediates`, collection `ROUTER_COLLECTION`) its
router statistics over the real tokens (segment id > 0): the top-k assignment count and the
probability sum per expert, the token count, the squared log-normaliser sum (router z-loss) and
the dropped assignments. `router_losses` turns the sown statistics of all layers into
the load-balancing loss (by `router_aux_loss_scope`: transformers' `load_balancing_loss_func`,
Switch Transformer's auxiliary loss over all layers' logits at once, or the same loss within
each layer, averaged over the layers) and the telemetry; `DecoderOnlyModel.loss_fn` adds
`router_aux_loss_coef * aux + router_z_loss_coef * z` to the loss when the config has experts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.models import stacks

Array = jax.Array

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_topk")
AUX_LOSS_SCOPES = ("pooled", "per_layer")  # what `router_losses` balances the loads over
ROUTER_COLLECTION = "intermediates"
ROUTER_STATS = "router_stats"


def route(
    logits: Array,
    k: int,
    router: str,
    norm_topk_prob: bool,
    *,
    correction_bias: Array | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling_factor: float = 1.0,
) -> tuple[Array, Array]:
    """float32 router logits `[tokens, experts]` -> (weights float32 `[tokens, k]`, expert
    ids int32 `[tokens, k]`).

    router: 'softmax_topk' (softmax over the experts, the top k: HF's Qwen/OLMoE routers),
    'sigmoid_topk' (a sigmoid per expert, the top k: DeepSeek-V3's) or 'topk_softmax' (the
    top k logits, then a softmax over them: Mixtral's, = softmax_topk renormalised).
    correction_bias `[experts]`, n_group / topk_group: what changes the choice only (the
    module docstring); the weights are the chosen experts' own scores.
    """
    if router == "topk_softmax":
        top, ids = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1) * scaling_factor, ids
    scores = router_scores(logits, router)
    choice = scores if correction_bias is None else scores + correction_bias
    if topk_group < n_group:
        choice = limit_to_groups(choice, n_group, topk_group)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        # HF's guard (DeepSeek-V3): below float32's resolution for any real sum of scores.
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling_factor, ids


def router_scores(logits: Array, router: str) -> Array:
    """The scores `[tokens, experts]` a router chooses by: softmax or per-expert sigmoid."""
    if router == "sigmoid_topk":
        return jax.nn.sigmoid(logits)
    if router in ("softmax_topk", "topk_softmax"):
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(f"router {router!r}: expected one of {ROUTERS}.")


def limit_to_groups(choice: Array, n_group: int, topk_group: int) -> Array:
    """`choice` `[tokens, experts]` with -inf outside each token's `topk_group` best groups
    of experts (a group rated by the sum of its two best scores, DeepSeek-V3's rule)."""
    tokens, experts = choice.shape
    grouped = choice.reshape(tokens, n_group, experts // n_group)
    best = jax.lax.top_k(grouped, min(2, experts // n_group))[0].sum(-1)  # [tokens, groups]
    _, groups = jax.lax.top_k(best, topk_group)
    keep = jax.nn.one_hot(groups, n_group, dtype=jnp.int32).sum(1) > 0  # [tokens, groups]
    keep = jnp.repeat(keep, experts // n_group, axis=1)
    return jnp.where(keep, choice, -jnp.inf)


def router_stats(
    logits: Array,
    ids: Array,
    real: Array,
    num_experts: int,
    dropped: Array | None = None,
    router: str = "softmax_topk",
) -> dict[str, Array]:
    """One layer's statistics over the real tokens (`real` float32 `[tokens]`, 0 or 1),
    summed: what `router_losses` needs, and what adds up across microbatches. The
    probabilities of a sigmoid router are its scores normalised to sum to 1 per token (as
    DeepSeek-V3's sequence-wise balance loss takes them)."""
    probs = router_scores(logits, router)
    if router == "sigmoid_topk":
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    assigned = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32).sum(1)  # [tokens, experts]
    log_z = jax.nn.logsumexp(logits, axis=-1)
    return {
        "expert_counts": jnp.einsum("te,t->e", assigned, real),
        "prob_sums": jnp.einsum("te,t->e", probs, real),
        "tokens": jnp.sum(real),
        "z_sum": jnp.sum(jnp.square(log_z) * real),
        "dropped": jnp.zeros((), jnp.float32) if dropped is None else jnp.sum(dropped),
    }


def collect_router_stats(intermediates: Mapping[str, Any]) -> dict[str, Array] | None:
    """The sown statistics of every MoE layer of a `mutable=[ROUTER_COLLECTION]` apply,
    stacked: `expert_counts`, `prob_sums` `[layers, experts]`, the rest `[layers]` (None if
    no layer sowed any). Scanned layers sow one stacked entry, unrolled ones one each."""
    found: list[dict[str, Array]] = []

    def visit(tree: Any) -> None:
        if isinstance(tree, Mapping):
            for key in sorted(tree, key=_layer_order):
                if key == ROUTER_STATS:
                    found.extend(tree[key])  # sow appends to a tuple
                else:
                    visit(tree[key])

    visit(intermediates)
    if not found:
        return None
    experts = found[0]["expert_counts"].shape[-1]

    def stack(name: str) -> Array:
        per_expert = name in ("expert_counts", "prob_sums")
        shape = (-1, experts) if per_expert else (-1,)
        return jnp.concatenate([s[name].reshape(shape) for s in found])

    return {name: stack(name) for name in found[0]}


def walk_rows(config: Any, rows: int) -> np.ndarray:
    """For each of the `rows` rows of `collect_router_stats`' output, which come in the
    walk's order (unrolled layers by number, then a scanned stack's cycle block by block:
    `stacks.walk_order`), its row in layer order; rows past the trunk's MoE layers (the
    multi-token-prediction layers', whose scopes sort after the trunk's) keep their place."""
    n = config.num_layers
    sparse = config.sparse_layers(n)
    met = [i for i in stacks.walk_order(n, stacks.scan_layout(config)) if sparse[i]]
    if rows < len(met):
        raise ValueError(
            f"{rows} MoE layers sowed router statistics, but the config has {len(met)}."
        )
    return np.concatenate([np.argsort(np.argsort(met)), np.arange(len(met), rows)])


CORRECTION_BIAS = "e_score_correction_bias"  # the MoE layer's param (`moe.MoE`)


def update_correction_bias(
    old: Any, new: Any, counts: Array, rate: float, rows: Sequence[int]
) -> Any:
    """`new` params with every MoE layer's `e_score_correction_bias` set to its value in
    `old` (before the optimizer's step: the bias has no gradient, and no weight decay or
    other optimizer rule may move it) plus `rate * sign(mean load - load)`: an expert that
    got fewer than the mean assignments rises, a busier one falls (DeepSeek-V3's
    aux-loss-free balance).

    `counts`: float32 `[moe layers, experts]`, the assignments of the whole batch (the
    summed `moe_expert_counts` of `loss_terms`, microbatches added), in layer order; `rows`
    (`walk_rows`): the row of `counts` of each layer this walk of the params meets, in the
    order `collect_router_stats` met them (a scanned stack's bias `[cycles, experts]` takes
    that many)."""
    step = rate * jnp.sign(counts.mean(-1, keepdims=True) - counts)
    rows = np.asarray(rows)
    used = 0

    def visit(before: Any, after: Any) -> Any:
        nonlocal used
        if not isinstance(after, Mapping):
            return after
        out = dict(after)
        for key in sorted(after, key=_layer_order):
            if key == CORRECTION_BIAS:
                bias = before[key]
                count = 1 if bias.ndim == 1 else bias.shape[0]
                taken = step[rows[used : used + count]]
                out[key] = bias + taken.reshape(bias.shape).astype(bias.dtype)
                used += count
            else:
                out[key] = visit(before[key], after[key])
        return out

    updated = visit(old, new)
    if used != counts.shape[0]:
        raise ValueError(
            f"{used} layers hold {CORRECTION_BIAS} but the router statistics count "
            f"{counts.shape[0]} MoE layers: the bias update needs score_correction_bias on "
            "every MoE layer."
        )
    return updated


def _layer_order(key: str) -> tuple[str, float]:
    """Sort key putting `layers_10` after `layers_9`, and a scanned stack `layers` after the
    unrolled layers (those before it, `first_scanned_layer`, and after it, `scan_tail`): the
    statistics and the correction biases visited in the same order."""
    stem, _, number = key.rpartition("_")
    return (stem, int(number)) if number.isdigit() else (key, float("inf"))


def router_losses(
    stats: Mapping[str, Array], num_experts: int, k: int, scope: str = "pooled"
) -> dict[str, Array]:
    """The load-balance losses from `collect_router_stats`' output (`summarize` gives the
    telemetry). `aux`: `E * sum_e f_e * p_e`, where f_e is the share of top-k assignments and
    p_e the mean router probability of expert e, over the real tokens of

    - `scope='pooled'`: all layers at once: transformers' `load_balancing_loss_func` on the
      same logits (with the attention mask). A layer that sends its tokens to a few experts
      pays little while the other layers send theirs to the rest.
    - `scope='per_layer'`: each layer apart, the losses averaged over the layers (Switch
      Transformer's, MaxText's): every layer's own imbalance pays.

    Both read k at perfect balance. `z`: the mean squared log-normaliser over layers and
    tokens."""
    del k  # the counts already hold k assignments a token
    counts, probs = stats["expert_counts"], stats["prob_sums"]  # [layers, experts]
    rows = jnp.maximum(jnp.sum(stats["tokens"]), 1.0)
    if scope == "pooled":
        aux = num_experts * jnp.sum((counts.sum(0) / rows) * (probs.sum(0) / rows))
    elif scope == "per_layer":
        per_layer = jnp.maximum(stats["tokens"], 1.0)[:, None]  # [layers, 1]
        aux = num_experts * jnp.sum((counts / per_layer) * (probs / per_layer), -1).mean()
    else:
        raise ValueError(f"router_aux_loss_scope {scope!r}: expected one of {AUX_LOSS_SCOPES}.")
    return {"aux": aux, "z": jnp.sum(stats["z_sum"]) / rows}


def loss_terms(
    config: Any, sown: Mapping[str, Any], weight_sum: Array
) -> tuple[Array, dict[str, Array]]:
    """What a mixture of experts adds to its loss, from an apply's mutable variables
    (`sown[ROUTER_COLLECTION]`): `router_aux_loss_coef * aux + router_z_loss_coef * z`, and
    metric sums that add across microbatches (`summarize` turns them into the telemetry):
    the aux and z losses times `weight_sum` (the batch's loss weights), the per-layer expert
    assignment counts `[layers, experts]` (in layer order, the trunk's then the MTP layers')
    and the dropped assignments."""
    stats = collect_router_stats(sown.get(ROUTER_COLLECTION, {}))
    if stats is None:
        zero = jnp.zeros((), jnp.float32)
        return zero, {}
    order = np.argsort(walk_rows(config, stats["tokens"].shape[0]))  # layer order
    stats = {name: value[order] for name, value in stats.items()}
    terms = router_losses(
        stats, config.num_experts, config.num_experts_per_tok, config.router_aux_loss_scope
    )
    loss = config.router_aux_loss_coef * terms["aux"] + config.router_z_loss_coef * terms["z"]
    return loss, {
        "moe_aux_loss_sum": terms["aux"] * weight_sum,
        "moe_z_loss_sum": terms["z"] * weight_sum,
        "moe_expert_counts": stats["expert_counts"],
        "moe_dropped": jnp.sum(stats["dropped"]),
    }


def summarize(sums: Mapping[str, Array]) -> dict[str, Array]:
    """The telemetry of `loss_terms`' metric sums (over a batch or a log period), all scalars
    (what metrics.jsonl and TensorBoard take): the mean aux and z losses; each MoE layer's
    busiest expert's assignments over the mean expert's (`moe_max_load_{i}`, the i-th MoE
    layer: 1 is perfect balance, E/k all tokens to k experts; no `/`, which names a task's
    metric), the highest of them (`moe_max_load`) and the idlest expert's over the mean of
    any layer (`moe_min_load`: 0 is an expert no token reached); the dropped fraction."""
    if "moe_expert_counts" not in sums:
        return {}
    counts = sums["moe_expert_counts"]  # [moe layers, experts]
    denom = jnp.maximum(sums["weight_sum"], 1.0)
    mean = jnp.maximum(counts.mean(-1), 1e-9)
    max_load = counts.max(-1) / mean  # [moe layers]
    return {
        "moe_aux_loss": sums["moe_aux_loss_sum"] / denom,
        "moe_z_loss": sums["moe_z_loss_sum"] / denom,
        "moe_max_load": max_load.max(),
        "moe_min_load": (counts.min(-1) / mean).min(),
        "moe_dropped_fraction": sums["moe_dropped"] / jnp.maximum(counts.sum(), 1.0),
        **{f"moe_max_load_{i}": load for i, load in enumerate(max_load)},
    }
