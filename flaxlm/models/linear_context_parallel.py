"""Context parallelism for linear attention: the causal convolution and gated delta rule of
Gated DeltaNet and Kimi Delta Attention over a sequence split across the mesh's `sequence`
axis, equal to reading it whole.

Each device holds pieces of each row: one under a contiguous split, two (`i` and `2n - 1 - i`
of `2n`) in context parallelism's load-balanced order (`context_parallel.balanced_order`,
`Mask.slots`). Each piece learns, from every device, what comes before it in the row:

- the convolution reads the `K - 1` inputs before each piece: every piece's last inputs are
  all-gathered (a few positions a row) and each piece takes those before it;
- the delta rule's state is affine in the state a piece starts from, `S_end = A S_in + B`
  (each column of `S` evolves alone, linearly in itself and in the values, whether the decay
  is one a head, Gated DeltaNet's, or one a key channel, KDA's), and so are its outputs,
  `o_t = o0_t + S_in^T r_t`. One pass of the chunked rule over a state widened by
  `key_dim` columns, started from `[I | 0]` with values `[0 | v]`, gives `[A | B]` as its
  final state and `[r | o0]` as its outputs; the pieces' `[A | B]` are all-gathered and
  folded in the row's order, and each piece adds its incoming state's part to its outputs.

Packed segments restart the state and the convolution wherever the segment id changes,
inside a piece or at its first position (the fold then hands the piece a zero state).
Gradients go back through the same collectives (an all-gather's transpose sums and scatters).
The cost: the rule's work on the values grows by `key_dim / value_dim` (twice for
Qwen3-Next and Kimi Linear), and each device folds every piece's `[key_dim, key_dim +
value_dim]` maps per row and head, in the row's order (two small matmuls a piece).

Like `context_parallel`, the mesh comes from JAX's context (this module never sees a
Partitioner); the single-device kernels come from the caller (`gated_deltanet`,
`kimi_delta`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from flaxlm.models import context_parallel, masks

Array = jax.Array

SEQUENCE_AXIS = context_parallel.SEQUENCE_AXIS
EXACT = jax.lax.Precision.HIGHEST  # the fold's products: errors would compound along the row
NO_SEGMENT = -1  # the segment id of the positions before a row's start: no real segment's
# `causal_conv1d(x, kernel, context, runs) -> (out, last inputs)`, `segment_runs(ids) -> runs`
# and `chunk_gated_delta_rule(q, k, v, g, beta, *, initial_state, runs) -> (out, state)` (or
# `chunk_kimi_delta_rule`, its decays g a key channel each).
Conv = Callable[[Array, Array, Array, Array | None], tuple[Array, Array]]
SegmentRuns = Callable[[Array], Array]
Rule = Callable[..., tuple[Array, Array]]


def split(
    mask: masks.Mask | Array, decoding: masks.Decoding | None, length: int
) -> tuple[Array | None, Array | None] | None:
    """A linear layer's (segment ids, slots) (the arguments of `causal_conv1d` and
    `gated_delta_rule`) where it reads a whole training sequence of `length` in pieces: the
    context's mesh splits it (a length its `sequence` axis divides; another is left to XLA,
    which reads it whole, as `context_parallel.applies` does), or it comes in the
    load-balanced order (`mask`'s slots); None where it reads the sequence whole, or
    decodes."""
    slots = getattr(mask, "slots", None)
    shards = context_parallel.sequence_shards()
    if decoding is not None or (slots is None and (shards == 1 or length % shards)):
        return None
    return getattr(mask, "q_segment_ids", None), slots


@dataclasses.dataclass(frozen=True)
class _Pieces:
    """The pieces of each row one device holds (inside the shard_map): `count` of `size`
    positions, at places `index` int32 [count] in the row; `order` int32 [all pieces]: where
    the row's 0th, 1st, ... piece is among the gathered ones (device by device)."""

    shards: int
    count: int
    size: int
    index: Array
    order: Array

    def rows(self, x: Array) -> Array:
        """`[batch, count * size, ...]` -> `[batch * count, size, ...]`: a piece a row."""
        return x.reshape(-1, self.size, *x.shape[2:])

    def unrows(self, x: Array) -> Array:
        return x.reshape(-1, self.count * self.size, *x.shape[2:])

    def in_order(self, x: Array) -> Array:
        """`[batch, count, ...]` of this device's pieces -> `[batch, all pieces, ...]` of
        every device's, in the row's order."""
        if self.shards > 1:
            x = jax.lax.all_gather(x, SEQUENCE_AXIS, axis=1, tiled=True)
        return jnp.take(x, self.order, axis=1)

    def before(self, x: Array, width: int, fill: int) -> Array:
        """`[batch * count, width, ...]`: the `width` positions of the row before each piece
        of `x` `[batch, count * size, ...]` (`fill` before the row's start)."""
        batch = x.shape[0]
        tail = min(width, self.size)  # each piece's last positions (all of it if shorter)
        tails = x.reshape(batch, self.count, self.size, *x.shape[2:])[:, :, self.size - tail :]
        tails = self.in_order(tails)
        tails = tails.reshape(batch, -1, *x.shape[2:])  # the row's tails, end to end
        pad = [(0, 0), (width, 0)] + [(0, 0)] * (x.ndim - 2)
        tails = jnp.pad(tails, pad, constant_values=fill)
        # Piece j's: the tail of piece j - 1, or (pieces shorter than `width`) of all before.
        where = self.index[:, None] * tail + jnp.arange(width)  # [count, width]
        return tails[:, where.reshape(-1)].reshape(-1, width, *x.shape[2:])


def _on_pieces(
    local: Callable[..., Array],
    slots: Array | None,
    arrays: Sequence[tuple[Array, tuple[str | None, ...]]],
    out: tuple[tuple[int, ...], tuple[str | None, ...]],
) -> Array:
    """`local(pieces, *arrays)` on each device's pieces: in a shard_map over the context's
    mesh (each of `arrays` split by its logical axes, 'length' over `sequence`; the result
    of shape and logical axes `out`), or on this device when the mesh does not split
    sequences (the load-balanced order on one shard)."""
    shards = context_parallel.sequence_shards()
    count = 1 if slots is None else 2  # balanced_order: pieces i and 2n - 1 - i
    length = arrays[0][0].shape[1]
    if length % (shards * count):
        raise ValueError(
            f"Linear attention layers under context parallelism read a sequence of {length} "
            f"positions in {shards * count} equal pieces ('sequence' {shards} x {count} a "
            f"shard): make the length (TASK_FEATURE_LENGTHS) a multiple of {shards * count}."
        )
    slots = jnp.arange(length, dtype=jnp.int32) if slots is None else slots

    def body(slots: Array, *xs: Array) -> Array:
        size = slots.shape[0] // count
        index = slots[::size] // size
        everyone = jax.lax.all_gather(index, SEQUENCE_AXIS, tiled=True) if shards > 1 else index
        return local(_Pieces(shards, count, size, index, jnp.argsort(everyone)), *xs)

    xs = [x for x, _ in arrays]
    if shards == 1:
        return body(slots, *xs)
    mesh = jax.sharding.get_abstract_mesh()

    def spec(axes: tuple[str | None, ...], shape: tuple[int, ...]) -> P:
        return P(
            *(
                SEQUENCE_AXIS
                if a == "length"
                else None
                if a is None
                else context_parallel.mesh_axis(mesh, a, n)
                for a, n in zip(axes, shape, strict=True)
            )
        )

    out_shape, out_axes = out
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(SEQUENCE_AXIS), *(spec(axes, x.shape) for x, axes in arrays)),
        out_specs=spec(out_axes, out_shape),
        check_vma=False,
    )(slots, *xs)


def _segments(segment_ids: Array | None, batch: int, length: int) -> Array:
    if segment_ids is None:
        return jnp.ones((batch, length), jnp.int32)
    return segment_ids.astype(jnp.int32)


def causal_conv1d(
    conv: Conv,
    segment_runs: SegmentRuns,
    x: Array,
    kernel: Array,
    segment_ids: Array | None,
    slots: Array | None,
    heads: str | None,
) -> Array:
    """`conv` (`gated_deltanet.causal_conv1d`) over a sequence read in pieces: float32 out
    `[batch, length, heads, dim]` of x `[batch, length, heads, dim]` (its heads the logical
    axis `heads`), kernel `[K, heads, dim]`, the row's `segment_ids` `[batch, length]` (None:
    one segment) and the load-balanced order's `slots` `[length]` (None: in order)."""
    width = kernel.shape[0] - 1
    batch, length = x.shape[:2]
    if width == 0:  # no position reads another
        return conv(x, kernel, x[:, :0], None)[0]

    def local(pieces: _Pieces, x: Array, kernel: Array, ids: Array) -> Array:
        context = pieces.before(x, width, 0)
        context_ids = pieces.before(ids, width, NO_SEGMENT)
        full = jnp.concatenate([context, pieces.rows(x)], axis=1)
        runs = segment_runs(jnp.concatenate([context_ids, pieces.rows(ids)], axis=1))
        out, _ = conv(full, kernel, jnp.zeros_like(context), runs)
        return pieces.unrows(out[:, width:])

    row_axes = ("batch", "length", heads, None)
    arrays = [(x, row_axes), (kernel, (None, heads, None))]
    arrays.append((_segments(segment_ids, batch, length), ("batch", "length")))
    return _on_pieces(local, slots, arrays, (x.shape, row_axes))


def gated_delta_rule(
    rule: Rule,
    segment_runs: SegmentRuns,
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    segment_ids: Array | None,
    slots: Array | None,
) -> Array:
    """`rule` (`gated_deltanet.chunk_gated_delta_rule` or `kimi_delta.chunk_kimi_delta_rule`
    at its chunk size: its arguments, the heads those of the logical axis 'heads') over a
    sequence read in pieces, each row starting from a zero state: float32 out `[batch,
    length, heads, value_dim]`. g may carry a trailing axis (KDA's decay a key channel, `[batch,
    length, heads, key_dim]`). segment_ids, slots: as `causal_conv1d`'s."""
    batch, length = q.shape[:2]
    key_dim = k.shape[-1]

    def local(pieces: _Pieces, q, k, v, g, beta, ids) -> Array:
        first = pieces.rows(ids)[:, 0]
        keep = (first == pieces.before(ids, 1, NO_SEGMENT)[:, 0]).astype(jnp.int32)
        q, k, v, g, beta, ids = (pieces.rows(x) for x in (q, k, v, g, beta, ids))
        rows, _, heads, value_dim = v.shape
        eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (rows, heads, key_dim, key_dim))
        start = jnp.concatenate([eye, jnp.zeros((*eye.shape[:-1], value_dim))], axis=-1)
        widened = jnp.concatenate(
            [jnp.zeros((*v.shape[:-1], key_dim)), v.astype(jnp.float32)], axis=-1
        )
        out, maps = rule(q, k, widened, g, beta, initial_state=start, runs=segment_runs(ids))
        incoming = _incoming(pieces, maps, keep, key_dim)  # [rows, heads, key_dim, value_dim]
        reads = out[..., :key_dim]
        out = out[..., key_dim:] + jnp.einsum("bthk,bhkv->bthv", reads, incoming, precision=EXACT)
        return pieces.unrows(out)

    head_axes = ("batch", "length", "heads")
    arrays = [(x, head_axes + (None,) * (x.ndim - 3)) for x in (q, k, v, g, beta)]
    arrays.append((_segments(segment_ids, batch, length), ("batch", "length")))
    return _on_pieces(local, slots, arrays, (v.shape, (*head_axes, None)))


def _incoming(pieces: _Pieces, maps: Array, keep: Array, key_dim: int) -> Array:
    """The state each of this device's pieces starts from `[batch * count, heads, key_dim,
    value_dim]`, folding every piece's `maps` `[A | B]` `[batch * count, heads, key_dim,
    key_dim + value_dim]` in the row's order; `keep` int32 [batch * count]: 0 where a piece
    starts a segment (its state is zero)."""
    maps = pieces.in_order(maps.reshape(-1, pieces.count, *maps.shape[1:]))
    keep = pieces.in_order(keep.reshape(-1, pieces.count))
    batch, _, heads = maps.shape[:3]

    def step(state: Array, x: tuple[Array, Array]) -> tuple[Array, Array]:
        m, kept = x
        state = jnp.where(kept[:, None, None, None] > 0, state, 0.0)  # the piece's start
        out = jnp.einsum("bhij,bhjv->bhiv", m[..., :key_dim], state, precision=EXACT)
        return out + m[..., key_dim:], state

    zero = jnp.zeros((batch, heads, key_dim, maps.shape[-1] - key_dim), jnp.float32)
    _, starts = jax.lax.scan(step, zero, (jnp.moveaxis(maps, 1, 0), jnp.moveaxis(keep, 1, 0)))
    mine = jnp.take(starts, pieces.index, axis=0)  # [count, batch, heads, key_dim, value_dim]
    return jnp.moveaxis(mine, 0, 1).reshape(-1, *mine.shape[2:])
