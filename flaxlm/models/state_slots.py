"""A linear-attention layer's recurrent state over the serving engine's paged cache: each
sequence's state and convolution inputs in a state slot of a pool beside the KV pages.

In paged decoding (`masks.Decoding` with a page table) a delta-rule layer
(`gated_deltanet.DeltaRuleLayer`) keeps each of its `decoding.RECURRENT_STATE` leaves as a
pool `[num_state_slots, ...]`: row b reads and writes slot `state_slots[b]`, slot 0 the
scratch of padding rows (as page 0 is the KV pool's). A dispatch gathers its rows' states,
runs the rule from them over the rows' real tokens (a prefill chunk: the chunked rule; a
decode step: the recurrent one), and scatters the new states back. A row whose first token
is at position 0 starts a sequence: it reads zeros, whatever its slot held, so the
scheduler never clears a slot. Padding tokens (slot -1, after a row's real ones) leave the
state as it was: they write with strength 0 and do not decay it, and the convolution keeps
the last `K - 1` real inputs.

The scheduler hands out the slots (`inference/scheduler.py`); `CachedDecoding.paged_copy`
copies one onto another (a follower of an identical prompt starts from its leader's, a
prompt found in the prefix cache from the snapshot kept after its cached pages).

Nothing here knows a mesh.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models import masks

Array = jax.Array


def pool(
    module: nn.Module, name: str, shape: tuple, dtype: jnp.dtype, decoding: masks.Decoding
) -> nn.Variable:
    """`module`'s cache variable `name`: a pool `[num_state_slots, *shape]` (zeros at first)."""
    if decoding.state_slots is None:
        raise ValueError(
            f"{type(module).__name__} decodes over the paged cache from each row's state slot: "
            "masks.Decoding.state_slots is None."
        )
    return module.variable("cache", name, jnp.zeros, (decoding.num_state_slots, *shape), dtype)


def real(decoding: masks.Decoding) -> Array:
    """bool `[rows, length]`: the real tokens (padding's slot is -1)."""
    return decoding.slots >= 0


def gather(states: Array, decoding: masks.Decoding) -> Array:
    """Each row's state `[rows, ...]` from the pool `states`: its slot's, zeros where the
    row starts its sequence (its first token at position 0)."""
    rows = states[decoding.state_slots]
    fresh = decoding.slots[:, 0] == 0
    return jnp.where(fresh.reshape(-1, *(1,) * (rows.ndim - 1)), jnp.zeros_like(rows), rows)


def scatter(states: Array, decoding: masks.Decoding, rows: Array) -> Array:
    """The pool `states` with each row's slot set to its state in `rows` `[rows, ...]`."""
    return states.at[decoding.state_slots].set(rows.astype(states.dtype))


def convolve(
    module: nn.Module,
    name: str,
    conv: Callable[[Array, Array, Array], tuple[Array, Array]],
    x: Array,
    kernel: Array,
    decoding: masks.Decoding,
) -> Array:
    """float32 `conv(x, kernel, context)` (`gated_deltanet.causal_conv1d`) of x `[rows,
    length, *channels]`, each row's context the last `K - 1` inputs its slot holds in the
    pool `name`, which then holds the last `K - 1` real inputs (padding comes after them)."""
    width = kernel.shape[0] - 1
    var = pool(module, name, (width, *x.shape[2:]), x.dtype, decoding)
    context = gather(var.value, decoding)
    out, _ = conv(x, kernel, context)
    full = jnp.concatenate([context.astype(x.dtype), x], axis=1)  # [rows, K - 1 + length, ...]
    index = real(decoding).sum(axis=1)[:, None] + jnp.arange(width)  # after the real inputs
    last = jnp.take_along_axis(full, index.reshape(*index.shape, *(1,) * (x.ndim - 2)), axis=1)
    var.value = scatter(var.value, decoding, last)
    return out


def delta_rule(
    module: nn.Module,
    rules: tuple[Callable[..., tuple[Array, Array]], Callable[..., tuple[Array, Array]], int],
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    decoding: masks.Decoding,
) -> Array:
    """float32 out `[rows, length, heads, value_dim]` of the rule (q, k, v, g, beta as
    `gated_deltanet.recurrent_gated_delta_rule`'s) from each row's state in the pool
    `recurrent_state`, which then holds the state after the row's real tokens. `rules`:
    the recurrent rule, which one token a row (a decode step) runs, the chunked one, which
    a prefill chunk runs, and its `chunk_size`."""
    rows, length, heads, key_dim = k.shape
    shape = (heads, key_dim, v.shape[-1])
    var = pool(module, "recurrent_state", shape, jnp.float32, decoding)
    keep = real(decoding)
    beta = jnp.where(keep[..., None], beta, 0.0)  # padding writes nothing ...
    g = jnp.where(keep.reshape(*keep.shape, *(1,) * (g.ndim - 2)), g, 0.0)  # ... nor decays
    recurrent, chunked, chunk_size = rules
    initial = gather(var.value, decoding)
    if length == 1:
        out, final = recurrent(q, k, v, g, beta, initial_state=initial)
    else:
        out, final = chunked(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial)
    var.value = scatter(var.value, decoding, final)
    return out
