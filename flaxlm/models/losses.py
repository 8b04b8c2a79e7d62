"""Token cross-entropy: whole, or a block of positions at a time (the chunked loss).

`chunked_cross_entropy` never holds the float32 logits of the whole batch: it computes them
`chunk_size` positions at a time in a loop, in the forward and (recomputed) in the backward
pass. Under a mesh (JAX's context, as in `context_parallel`; this module never sees a
Partitioner) the loop runs on each device's own rows and positions, in a `shard_map` over the
mesh axes that split them, so that the head's weights are gathered once on the way in and
their gradient summed once on the way out, not once per block; the vocabulary stays split as
Flax's rules say (on `tensor`), where XLA computes the log-normaliser across its shards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from flaxlm.models import context_parallel
from flaxlm.models.context_parallel import SEQUENCE_AXIS

Array = jax.Array
Sums = tuple[Array, Array, Array]


def check_chunk_size(chunk_size: Any, supported: bool, model: str) -> None:
    """A ValueError unless `chunk_size` (a model's `loss_chunk_size`) is a positive int and
    `model` (its description) can compute its loss in chunks (`supported`)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise ValueError(f"loss_chunk_size must be an int, got {chunk_size!r}.")
    if chunk_size < 1:
        raise ValueError(f"loss_chunk_size must be positive, got {chunk_size}.")
    if not supported:
        raise ValueError(
            f"loss_chunk_size={chunk_size}: {model} computes its loss over all positions at "
            "once; a chunked loss needs a DecoderOnlyModel on causal_lm.CausalLM. Unset "
            "loss_chunk_size."
        )


def select_tokens(values: Array, ids: Array) -> Array:
    """Each position's entry for its token: `[..., vocab]` values (e.g. `[batch, length,
    vocab]`) and int `[...]` ids -> `[...]`."""
    return jnp.take_along_axis(values, ids[..., None], axis=-1)[..., 0]


def cross_entropy(logits: Array, targets: Array, weights: Array, z_loss: float = 0.0) -> Sums:
    """Summed token cross-entropy (+ z-loss) in float32.

    Returns (loss_sum, z_loss_sum, correct_sum), each weighted by `weights`.
    """
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = select_tokens(logits, targets)
    xent = log_z - target_logit
    z = z_loss * jnp.square(log_z) if z_loss else jnp.zeros_like(log_z)
    weights = weights.astype(jnp.float32)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum((xent + z) * weights), jnp.sum(z * weights), jnp.sum(correct * weights)


def chunked_cross_entropy(
    hidden: Array,
    head: Callable[[Any, Array, Array], Array],
    head_params: Any,
    targets: Array,
    weights: Array,
    chunk_size: int,
    z_loss: float = 0.0,
) -> Sums:
    """`cross_entropy(head(head_params, hidden), ...)` computed `chunk_size` positions at a
    time, so that only one block of logits `[batch, chunk_size, vocab]` exists at once, in the
    forward and in the backward pass (each block's logits are recomputed there, not saved).

    Args:
      hidden: the final hidden states `[batch, length, embed]`.
      head: `(head_params, hidden block [rows, chunk_size, embed], block number) -> float32
        logits [rows, chunk_size, vocab]`; the block number (an int32 scalar, different for
        every block of every device's rows) is for folding into an rng.
      head_params: the arrays `head` reads (its weights): passed in, not closed over, so that
        they cross into the per-device loop once.
      targets, weights: `[batch, length]`.
      chunk_size: positions per block (at most the length). A length it does not divide
        is padded with positions of weight 0 (the last block computes some logits for
        nothing).

    Returns (loss_sum, z_loss_sum, correct_sum) as `cross_entropy`, up to float rounding.
    """
    mesh = jax.sharding.get_abstract_mesh()
    batch, length = targets.shape
    rows = None if mesh.empty else context_parallel.mesh_axis(mesh, "batch", batch)
    rows = () if rows is None else (rows,) if isinstance(rows, str) else rows
    shards = context_parallel.sequence_shards()
    positions = SEQUENCE_AXIS if shards > 1 and length % shards == 0 else None
    manual = (*rows, *([positions] if positions else []))
    if not manual:
        return _blocks_loss(hidden, head, head_params, targets, weights, chunk_size, z_loss)

    def local(params: Any, h: Array, t: Array, w: Array) -> Sums:
        # Made per-device here, outside the loop, the weights' gradient is a per-device sum
        # over the blocks, summed across devices once (the transpose of this cast), not per
        # block (where JAX would cast them, at their use).
        params = jax.tree.map(lambda x: jax.lax.pcast(x, manual, to="varying"), params)
        # Inside, the rules split nothing over the manual axes: each device's rows are whole.
        rules = [(name, _without(axes, manual)) for name, axes in nn.get_logical_axis_rules()]
        offset = jax.lax.axis_index(manual) * -(-t.shape[1] // min(chunk_size, t.shape[1]))
        with nn.logical_axis_rules(rules):
            sums = _blocks_loss(
                h,
                lambda p, x, i: head(p, x, offset + i),
                params,
                t,
                w,
                chunk_size,
                z_loss,
            )
        return tuple(jax.lax.psum(s, manual) for s in sums)

    row_spec = P(rows or None, positions)
    # Not saved for the backward pass, the gathered head is gathered again there (it would
    # otherwise stay whole on every device until then, beside the gradient's accumulator).
    return jax.checkpoint(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P(rows or None, positions, None), row_spec, row_spec),
            out_specs=(P(), P(), P()),
            axis_names=frozenset(manual),
        )
    )(head_params, hidden, targets, weights)


def _without(axes: Any, manual: tuple[str, ...]) -> Any:
    """A rule's mesh axes without `manual` (None if nothing is left)."""
    if axes is None:
        return None
    kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a not in manual)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def _blocks_loss(
    hidden: Array,
    head: Callable[[Any, Array, Array], Array],
    head_params: Any,
    targets: Array,
    weights: Array,
    chunk_size: int,
    z_loss: float,
) -> Sums:
    """The loop over blocks of positions of `chunked_cross_entropy` (its args)."""
    batch, length = targets.shape
    chunk_size = min(chunk_size, length)
    chunks = -(-length // chunk_size)
    pad = chunks * chunk_size - length

    def blocks(x: Array) -> Array:
        # [batch, length, ...] -> [chunks, batch, chunk_size, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, chunks, chunk_size, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    # Saves only its inputs for the backward pass; inside a scan, CSE cannot undo that.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def block_sums(params: Any, h: Array, t: Array, w: Array, i: Array) -> Sums:
        h = nn.with_logical_constraint(h, ("batch", "length", "embed"))
        return cross_entropy(head(params, h, i), t, w, z_loss)

    def step(sums: Sums, xs: tuple[Array, ...]) -> tuple[Sums, None]:
        new = block_sums(head_params, *xs)
        return tuple(a + b for a, b in zip(sums, new, strict=True)), None

    xs = (blocks(hidden), blocks(targets), blocks(weights), jnp.arange(chunks, dtype=jnp.int32))
    zero = jnp.zeros_like(targets[0, 0], jnp.float32)  # varying over a shard_map's axes
    sums, _ = jax.lax.scan(step, (zero, zero, zero), xs)
    return sums
