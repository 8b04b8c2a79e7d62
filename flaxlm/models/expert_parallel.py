"""Expert parallelism: a mixture-of-experts layer's experts run on each device's own tokens in
a `shard_map`, split over the mesh's `expert` axis, and how the tokens reach them.

Under a mesh (JAX's context, as in `context_parallel`: this module never sees a Partitioner)
with an `expert` axis of size n > 1, the experts' weights are split over it (the logical axis
`expert`) and `dropless` runs in a `shard_map` over the mesh axes that split the tokens (the
batch's, and `sequence` under context parallelism; without an `expert` axis too, so that each
device runs its own tokens rather than XLA gathering them all; the routing and the router
statistics likewise, `on_own_tokens`). The batch rule includes `expert` (tokens enter the
layer already split over it), and the dispatch (`moe_dispatch`) takes each device's tokens
to the devices of its expert group that hold their experts:

- `all_gather`: the group's tokens are all-gathered over `expert`, each device runs its E/n
  experts on the assignments routed to them, and the partial outputs are summed and scattered
  back with one `psum_scatter` (its transpose, an all-gather, carries the gradient). No
  assignment is dropped, but each device sorts the whole group's n x tokens x k assignments:
  its buffers grow with n (DeepSeek-V3 at expert 64 on v5p: 90 GiB of temporaries for one
  layer, benchmarks/RESULTS.md).
- `all_to_all`: each device sends every assignment (a token's row, once per expert it is
  routed to) to the device holding that expert in a fixed buffer of `capacity_factor x k x
  tokens / n` rows per destination (`jax.lax.all_to_all`), the receivers run their experts
  on what arrived, and a second all-to-all brings the outputs back. Assignments past a
  destination's capacity are dropped (they contribute zero) and counted, as `capacity` does.
  Buffers are bounded by the capacity, not n; 2 x capacity_factor x k x tokens x embed bytes
  a layer move each way.
- `ragged` (MaxText's): each device sorts its assignments by the device holding their
  expert; the n x n matrix of how many each sends each (all-gathered: tiny) tells every
  sender where its chunk lands in each receiver's buffer (after the earlier senders' chunks
  to it) and every receiver what it gets. One `ragged_all_to_all` moves the rows (and their
  experts' local ids), the receivers run their experts on the `ragged_buffer_factor x k x
  tokens` rows of their buffer, and the reverse one brings the outputs back. Only a
  receiver's total is bounded, not what each sender sends it: rows that would land past its
  buffer (the last senders' last rows) are dropped and counted, as `all_to_all` does; at a
  factor of n nothing can drop. Only the rows sent move, not a padded buffer per pair.

`jax.lax.ragged_all_to_all` is XLA's `ragged-all-to-all`, which TPU and GPU have and XLA:CPU
has not (JAX 0.10: "HLO opcode ragged-all-to-all is not supported by XLA:CPU"), the tests'
platform. `ragged_all_to_all` chooses by the platform of the mesh in JAX's context (of the
devices compiled for, so a TPU slice compiled ahead of time on a CPU host gets the op):
the op on `RAGGED_PLATFORMS`, else `dense_ragged_all_to_all`, the same semantics through a
fixed-size all-to-all of n x the rows. The two give the same numbers: what the CPU tests
check is what the op computes.

The experts' weights enter the shard_map split as their params lie (`expert` on the experts,
fsdp on `embed`: `weight_spec`) and are all-gathered over fsdp inside it, fsdp's forward; the
gathers' transpose reduce-scatters their gradient back onto the shards, where weights taken
whole would have it all-reduced whole (twice the bytes over the ring; benchmarks/HISTORY.md,
issue 45).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from flaxlm.models import context_parallel, experts, grouped_matmul, layers

Array = jax.Array

EXPERT_AXIS = "expert"  # the mesh axis (and logical axis) that splits the experts
DISPATCHES = ("all_gather", "all_to_all", "ragged")
# The platforms whose XLA has `ragged-all-to-all` (`ragged_all_to_all`).
RAGGED_PLATFORMS = ("tpu", "gpu", "cuda", "rocm")


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


# ------------------------------------------------------------------ the shard_map


def run_experts(
    x: Array,
    wi: Array,
    wo: Array,
    weights: Array,
    ids: Array,
    act: experts.Glu,
    shards: int,
    bias: experts.Bias = None,
    *,
    dispatch: str = "all_gather",
    capacity_factor: float = 1.25,
    ragged_buffer_factor: float = 2.0,
    matmul: str = "auto",
) -> tuple[Array, Array | None] | None:
    """`experts.grouped_experts` on each device's tokens, in a `shard_map` over the mesh axes
    that split them (the batch's, and `sequence` under context parallelism), with the experts
    split over the mesh's `expert` axis when `shards` > 1 (x `[batch, length, embed]`,
    weights and ids `[batch, length, k]`). Left to XLA, the sort by expert over tokens split
    across devices gathers every token onto every device, which then runs them all. The
    experts' weights enter split as their params are (`weight_spec`) and are all-gathered
    inside; the tokens reach the experts' devices by `dispatch` (the module's docstring).

    Returns `y` `[batch, length, embed]` and, with the `all_to_all` or `ragged` dispatch, float32
    `[batch, length, k]`: 1 where an assignment was dropped (else None). None when no mesh
    splits the tokens or the experts (or the batch does not split evenly: a dummy batch),
    where XLA partitions the plain computation instead."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    rows, length = token_axes(mesh, x.shape[0], x.shape[1])
    gathered = shards > 1 and EXPERT_AXIS in rows
    manual = {*rows, *([length] if length else []), *([EXPERT_AXIS] if shards > 1 else [])}
    if not manual:
        return None
    # Without the batch split over `expert` each device of a group already holds the group's
    # tokens: nothing to send, each runs its experts and the outputs are summed.
    to_all = gathered and dispatch in ("all_to_all", "ragged")
    local = wi.shape[0] // shards
    logical = (experts.WI_AXES, experts.WO_AXES)
    if bias is not None:
        logical += (experts.BI_AXES, experts.BO_AXES)
    params = (wi, wo, *(bias or ()))
    specs = tuple(weight_spec(w.shape, a, manual, shards) for w, a in zip(params, logical))

    def body(x: Array, weights: Array, ids: Array, *params: Array) -> Any:
        wi, wo, *b = (local_experts(w, s, manual) for w, s in zip(params, specs, strict=True))
        xt, wt, it = (a.reshape(-1, a.shape[-1]) for a in (x, weights, ids))
        if to_all and dispatch == "ragged":
            rows = ragged_rows(xt.shape[0], it.shape[1], shards, ragged_buffer_factor)
            y, dropped = ragged_experts(
                xt, wi, wo, wt, it, act, rows, tuple(b) or None, matmul=matmul
            )
            return y.reshape(x.shape), dropped.reshape(ids.shape)
        if to_all:
            # Rows a device sends each device of its group: as `capacity`'s rows an expert.
            capacity = experts.expert_capacity(xt.shape[0], it.shape[1], shards, capacity_factor)
            y, dropped = all_to_all_experts(
                xt, wi, wo, wt, it, act, capacity, tuple(b) or None, matmul=matmul
            )
            return y.reshape(x.shape), dropped.reshape(ids.shape)
        if gathered:  # the expert group's tokens, on each of its devices
            xt, wt, it = (
                jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True) for a in (xt, wt, it)
            )
        first = jax.lax.axis_index(EXPERT_AXIS) * local if shards > 1 else 0
        y = experts.grouped_experts(
            xt, wi, wo, wt, it, act, first, tuple(b) or None, matmul, all_local=shards == 1
        )
        if gathered:
            y = jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        elif shards > 1:
            y = jax.lax.psum(y, EXPERT_AXIS)
        return y.reshape(x.shape), None

    token_spec = P(rows or None, length, None)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(token_spec,) * 3 + specs,
        out_specs=(token_spec, token_spec if to_all else None),
        axis_names=frozenset(manual),
    )(x, weights, ids, *params)


def all_to_all_experts(
    x: Array,
    wi: Array,
    wo: Array,
    weights: Array,
    ids: Array,
    act: experts.Glu,
    capacity: int,
    bias: experts.Bias = None,
    matmul: str = "auto",
) -> tuple[Array, Array]:
    """Inside `run_experts`' body, on one device of an expert group (the mesh's `expert`
    axis, n devices of E/n experts each): its assignments sent to the devices holding their
    experts, at most `capacity` to each (a token's best expert before its second, then in
    token order), run there and sent back.

    x `[tokens, embed]`, wi/wo (and `bias`) this device's experts', weights and ids
    `[tokens, k]` -> the output `[tokens, embed]` and float32 `[tokens, k]`: 1 where an
    assignment was dropped."""
    tokens, k = ids.shape
    local = wi.shape[0]
    n = jax.lax.axis_size(EXPERT_AXIS)
    rows = n * capacity  # the send (and receive) buffer: `capacity` rows a device
    flat = ids.T.reshape(-1)  # rank-major: every token's first choice before any second
    to = flat // local  # the device that holds the expert
    onehot = jax.nn.one_hot(to, n, dtype=jnp.int32)
    position = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=-1) - 1
    keep = position < capacity
    slot = jnp.where(keep, to * capacity + position, rows)  # dropped: past the buffer
    token = jnp.tile(jnp.arange(tokens), k)
    send = jnp.zeros((rows, x.shape[-1]), x.dtype).at[slot].set(x[token], mode="drop")
    # Each row's expert on its device; empty rows an id past the local experts (no group:
    # grouped_experts gives them zeros).
    expert = jnp.full((rows, 1), local, jnp.int32).at[slot, 0].set(flat % local, mode="drop")
    arrived, expert = (
        jax.lax.all_to_all(a, EXPERT_AXIS, 0, 0, tiled=True) for a in (send, expert)
    )  # [n x capacity, ...]: row block i from device i
    ones = jnp.ones((rows, 1), x.dtype)
    out = experts.grouped_experts(arrived, wi, wo, ones, expert, act, 0, bias, matmul)
    back = jax.lax.all_to_all(out, EXPERT_AXIS, 0, 0, tiled=True)  # to where each came from
    ys = jnp.where(keep[:, None], back[jnp.minimum(slot, rows - 1)], 0).reshape(k, tokens, -1)
    y = jnp.einsum("ktd,tk->td", ys, weights.astype(ys.dtype))
    return y, (~keep).reshape(k, tokens).T.astype(jnp.float32)


def ragged_rows(tokens: int, k: int, shards: int, factor: float) -> int:
    """A receiver's buffer under the `ragged` dispatch: `factor` x the `tokens x k`
    assignments of each device (its fair share), at most the `shards x tokens x k` the whole
    expert group can send it (where nothing can drop)."""
    return min(shards * tokens * k, max(1, math.ceil(factor * tokens * k)))


def ragged_experts(
    x: Array,
    wi: Array,
    wo: Array,
    weights: Array,
    ids: Array,
    act: experts.Glu,
    rows: int,
    bias: experts.Bias = None,
    matmul: str = "auto",
) -> tuple[Array, Array]:
    """Inside `run_experts`' body, on one device of an expert group (the mesh's `expert`
    axis, n devices of E/n experts each): its assignments sorted by the device holding
    their expert (then a token's best expert before its second, then in token order), sent
    by `ragged_all_to_all` into each receiver's buffer of `rows` rows, the senders' chunks
    in device order; what would land past it is dropped (the later senders' last rows).
    The receivers run their experts on their buffers and send the outputs back the same way.

    x `[tokens, embed]`, wi/wo (and `bias`) this device's experts', weights and ids
    `[tokens, k]` -> the output `[tokens, embed]` and float32 `[tokens, k]`: 1 where an
    assignment was dropped."""
    tokens, k = ids.shape
    local = wi.shape[0]
    me = jax.lax.axis_index(EXPERT_AXIS)
    n = jax.lax.axis_size(EXPERT_AXIS)
    flat = ids.T.reshape(-1)  # rank-major: every token's first choice before any second
    to = flat // local  # the device that holds the expert
    order = jnp.argsort(to, stable=True)  # by destination, then rank, then token
    sent = jax.lax.all_gather(jnp.bincount(to, length=n).astype(jnp.int32), EXPERT_AXIS)
    # [sender, receiver]: where a chunk starts in the sender's sorted rows (`begin`) and in
    # the receiver's buffer (`start`), and how much of it fits there (`fits`).
    begin = jnp.cumsum(sent, axis=1) - sent
    start = jnp.cumsum(sent, axis=0) - sent
    fits = jnp.clip(rows - start, 0, sent)
    start = jnp.minimum(start, rows)
    there = (begin[me], fits[me], start[me], fits[:, me])  # as sender: to each receiver
    back = (start[:, me], fits[:, me], begin[:, me], fits[me])  # as receiver: to each sender
    token = jnp.tile(jnp.arange(tokens), k)[order]
    arrived = ragged_all_to_all(x[token], jnp.zeros((rows, x.shape[-1]), x.dtype), *there)
    # Each row's expert on this device; empty rows an id past the local experts (no group:
    # grouped_experts gives them zeros).
    expert = (flat % local)[order].astype(jnp.int32)
    expert = ragged_all_to_all(expert, jnp.full((rows,), local, jnp.int32), *there)
    ones = jnp.ones((rows, 1), x.dtype)
    out = experts.grouped_experts(arrived, wi, wo, ones, expert[:, None], act, 0, bias, matmul)
    ys = ragged_all_to_all(out, jnp.zeros((tokens * k, out.shape[-1]), out.dtype), *back)
    # A sorted row was kept if its place in its chunk is within what of the chunk fit.
    dest = to[order]
    kept = jnp.arange(tokens * k) - begin[me][dest] < fits[me][dest]
    unsort = jnp.argsort(order)
    kept = kept.at[unsort].get(unique_indices=True)
    ys = ys.at[unsort].get(unique_indices=True)
    ys = jnp.where(kept[:, None], ys, 0).reshape(k, tokens, -1)
    y = jnp.einsum("ktd,tk->td", ys, weights.astype(ys.dtype))
    return y, (~kept).reshape(k, tokens).T.astype(jnp.float32)


def ragged_all_to_all(
    operand: Array,
    output: Array,
    input_offsets: Array,
    send_sizes: Array,
    output_offsets: Array,
    recv_sizes: Array,
) -> Array:
    """`jax.lax.ragged_all_to_all` over the `expert` axis, one chunk to each device, where
    the platform of the mesh in JAX's context has the op (`RAGGED_PLATFORMS`), else
    `dense_ragged_all_to_all` (XLA:CPU); a mesh that names no platform: JAX's default
    backend's."""
    if layers.target_device().platform not in RAGGED_PLATFORMS:
        return dense_ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes
        )
    # The op types its result as `output` is typed; a buffer of zeros made here would be
    # invariant over the axes the rows vary over, and the backward would sum the devices'
    # cotangents over them (JAX 0.10: a psum_invariant per op).
    output = grouped_matmul.vary(output, grouped_matmul.varying(operand))
    return jax.lax.ragged_all_to_all(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
        axis_name=EXPERT_AXIS,
    )  # fmt: skip


def dense_ragged_all_to_all(
    operand: Array,
    output: Array,
    input_offsets: Array,
    send_sizes: Array,
    output_offsets: Array,
    recv_sizes: Array,
) -> Array:
    """`jax.lax.ragged_all_to_all`'s semantics over `expert`, one chunk to each of its n
    devices, through a fixed-size `all_to_all`: each sender's chunks padded to `operand`'s
    rows (n x `operand` a device), the received rows placed at the offsets their senders
    name, `output` elsewhere. For platforms without the op (XLA:CPU); differentiable as
    plain gathers and scatters are."""
    rows = operand.shape[0]
    place = jnp.arange(rows)
    chunks = operand.at[input_offsets[:, None] + place].get(mode="fill", fill_value=0)
    arrived = jax.lax.all_to_all(chunks, EXPERT_AXIS, 0, 0, tiled=True)  # [sender, rows, ...]
    offsets = jax.lax.all_to_all(output_offsets, EXPERT_AXIS, 0, 0, tiled=True)
    at = jnp.where(place < recv_sizes[:, None], offsets[:, None] + place, output.shape[0])
    flat = arrived.reshape(-1, *arrived.shape[2:])
    return output.at[at.reshape(-1)].set(flat, mode="drop")


def weight_spec(
    shape: tuple[int, ...], logical: tuple[str | None, ...], manual: set[str], shards: int
) -> P:
    """How `run_experts`' `shard_map` takes a stacked expert weight of logical axes
    `logical`: as its param lies under the rules in force, `expert` on dim 0 when `shards` >
    1 and each other dim over the mesh axes that split it (fsdp on `embed`) where all of
    them are the shard_map's (`manual`) and divide it; the body gathers them
    (`local_experts`). Rules that split the experts over `expert` and then fsdp
    (`experts_over_fsdp`) keep dim 0 so, the body gathering a device's experts over fsdp.
    Taken whole (`P()`) instead, the weight's gradient would leave the shard_map summed over
    the fsdp axes: an all-reduce of every expert's weights where a reduce-scatter onto the
    shards is enough."""
    mesh = jax.sharding.get_abstract_mesh()

    def takes(names: tuple[str, ...], dim: int) -> bool:
        size = math.prod(int(mesh.shape[a]) for a in names)
        return bool(names) and set(names) <= manual and not shape[dim] % size

    spec = []
    for dim, axes in enumerate(nn.logical_to_mesh_axes(logical)):
        names = _names(axes)
        if dim == 0:
            keep = names[:1] == (EXPERT_AXIS,) and takes(names, 0)
            names = names if keep else (EXPERT_AXIS,) if shards > 1 else ()
        elif not takes(names, dim):
            names = ()
        spec.append(names[0] if len(names) == 1 else names or None)
    return P(*spec)


def _names(axes: str | Sequence[str] | None) -> tuple[str, ...]:
    """A PartitionSpec entry's mesh axes as a tuple."""
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def local_experts(w: Array, spec: P, manual: set[str]) -> Array:
    """Inside `run_experts`' body: this device's experts of a weight taken as `spec`
    (`weight_spec`), whole. Its gradient, per device, is summed back onto the shards by the
    transposes: the gathers' (a reduce-scatter over fsdp), then the cast's (an all-reduce of
    the shard over the axes it is replicated on, `data`), in that order so that the
    all-reduce moves the shard and not the whole weight."""
    named = {a for entry in spec for a in _names(entry)}
    replicated = tuple(sorted(manual - named))
    if replicated:
        w = jax.lax.pcast(w, replicated, to="varying")
    for dim, axes in enumerate(spec):
        names = tuple(a for a in _names(axes) if a != EXPERT_AXIS or dim)  # its experts' shards
        if names:
            w = jax.lax.all_gather(w, names[0] if len(names) == 1 else names, axis=dim, tiled=True)
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
