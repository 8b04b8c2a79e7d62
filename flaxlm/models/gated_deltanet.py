"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5 (Yang et al.,
"Gated Delta Networks", arXiv 2412.06464), as transformers' `Qwen3NextGatedDeltaNet`.

Each value head keeps a state `S` `[key_dim, value_dim]` that every token decays and corrects
toward its value (the delta rule):

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

with q, k L2-normalised (q also by key_dim^-0.5), `beta = sigmoid(b)` and `g = -exp(A_log)
softplus(a + dt_bias)`. Before it, q, k and v go through a short causal depthwise convolution
and its activation; after it, each head is RMS-normalised and gated by `silu(z)` (`GatedRMSNorm`)
and projected back to the width.

Training and prefill run the chunked form (`chunk_gated_delta_rule`: a `lax.scan` over chunks
of `chunk_size` positions, `scan_chunks`, the delta rule inside a chunk one unit triangular
system, solved by matmuls); decoding one token at a time runs the recurrent form
(`recurrent_gated_delta_rule`), carrying the state and the convolution's last inputs in the
Flax `cache` collection, each leaf `[batch, ...]` 4-D as every cache leaf
(`decoding.RECURRENT_STATE`); over the serving engine's paged cache, pools of state slots,
one a sequence (`state_slots`). Packed rows restart the state and the convolution at every
segment start (`segment_runs`). A sequence split over the mesh's `sequence` axis (context
parallelism, the load-balanced order too) is read where it lies, the state and the
convolution's inputs passed between its pieces (`linear_context_parallel`).

Kimi Delta Attention (`kimi_delta.py`: a decay a key channel) shares the layer's steps
(`DeltaRuleLayer`), the recurrent form, the chunks' loop and the gated norm.

Nothing here knows a mesh: activations carry logical axis names only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models import layers, linear_context_parallel, masks, state_slots
from flaxlm.models.layers import DenseGeneral, Dtype, as_dtype
from flaxlm.models.linear_context_parallel import Rule

Array = jax.Array

PROJECTIONS = ("grouped", "split")  # Qwen3-Next's fused in_proj_qkvz/ba; Qwen3.5's apart
# The rules' products in full float32 (no TF32 or bfloat16 passes): their errors would
# compound along the state the sequence carries.
EXACT = jax.lax.Precision.HIGHEST
L2_EPS = 1e-6  # the q/k L2 norm's epsilon (FLA's and HF's, whatever the config's)


# ---------------------------------------------------------------------------- the math


def l2_normalize(x: Array, eps: float = L2_EPS) -> Array:
    """float32 `x / sqrt(sum(x^2) + eps)` over the last axis (HF's `l2norm`)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def segment_runs(segment_ids: Array) -> Array:
    """int32 `[batch, length]`: which run of equal segment ids each position is in (0, 1, ...
    from each row's start). A new run starts wherever the id changes: there the state and
    the convolution restart."""
    starts = jnp.concatenate(
        [jnp.zeros_like(segment_ids[:, :1]), (segment_ids[:, 1:] != segment_ids[:, :-1])], axis=1
    )
    return jnp.cumsum(starts.astype(jnp.int32), axis=1)


# The kernels are jitted: called op by op (eager logits), each layer reuses one compilation.
@jax.jit
def causal_conv1d(
    x: Array, kernel: Array, context: Array, runs: Array | None = None
) -> tuple[Array, Array]:
    """The depthwise causal convolution over the length: `out[t] = sum_i kernel[i] *
    x[t - (K - 1) + i]` per channel, in float32.

    x: `[batch, length, *channels]`; kernel: `[K, *channels]`; context: the `K - 1` inputs
    before `x` `[batch, K - 1, *channels]` (zeros: none); runs: `segment_runs` of `x` (an input
    of another run is not seen; None: one run). Returns (out `[batch, length, *channels]`
    float32, the last `K - 1` inputs: the next call's context)."""
    width, length = kernel.shape[0], x.shape[1]
    full = jnp.concatenate([context.astype(x.dtype), x], axis=1)
    kernel = kernel.astype(jnp.float32)
    if runs is not None:  # the context has no runs: it is never another segment's
        padded = jnp.pad(runs, ((0, 0), (width - 1, 0)), constant_values=-1)
    out = jnp.zeros(x.shape, jnp.float32)
    for i in range(width):
        term = full[:, i : i + length].astype(jnp.float32) * kernel[i]
        if runs is not None and i < width - 1:
            same = padded[:, i : i + length] == runs
            term = term * same.reshape(*same.shape, *(1,) * (x.ndim - 2))
        out = out + term
    return out, full[:, length:]


@jax.jit
def recurrent_gated_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    initial_state: Array | None = None,
    runs: Array | None = None,
) -> tuple[Array, Array]:
    """The gated delta rule one token after another (decoding; the reference of the chunked
    forms), its decay one a head or (Kimi Delta Attention's) one a key channel.

    q, k: `[batch, length, heads, key_dim]` (normalised and scaled as the rule reads them);
    v: `[batch, length, heads, value_dim]`; g: log decays `[batch, length, heads]` or
    `[batch, length, heads, key_dim]`; beta: write strengths `[batch, length, heads]`;
    initial_state: `[batch, heads, key_dim, value_dim]` (None: zeros); runs: `segment_runs`
    (the state restarts where a run starts; None: one run). Returns (float32 out `[batch,
    length, heads, value_dim]`, the final state float32)."""
    b, length, h, dk = k.shape
    dv = v.shape[-1]
    state = _initial(initial_state, (b, h, dk, dv))
    runs = jnp.zeros((b, length), jnp.int32) if runs is None else runs
    g = g[..., None] if g.ndim == 3 else g  # one a head: each key channel's the same
    xs = [jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta)]
    xs.append(jnp.moveaxis(runs, 1, 0))

    def step(carry, x):
        state, previous = carry
        q_t, k_t, v_t, g_t, beta_t, run = x
        keep = (run == previous)[:, None, None, None]
        state = jnp.where(keep, state, 0.0) * jnp.exp(g_t)[..., None]
        memory = dot("bhkv,bhk->bhv", state, k_t)
        delta = (v_t - memory) * beta_t[..., None]
        state = state + k_t[..., None] * delta[..., None, :]
        return (state, run), dot("bhkv,bhk->bhv", state, q_t)

    (state, _), out = jax.lax.scan(step, (state, runs[:, 0]), xs)
    return jnp.moveaxis(out, 0, 1), state


@functools.partial(jax.jit, static_argnames="chunk_size")
def to_chunks(x: Array, chunk_size: int) -> Array:
    """`[b, length, ...]` -> `[chunks, b, (heads,) chunk_size, (width)]`, padded at the end
    (int32 segment runs continue the last one; the rest with zeros: no decay, no write)."""
    b, length = x.shape[:2]
    pad = -length % chunk_size
    widths = ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)
    x = jnp.pad(x, widths, mode="edge" if x.dtype == jnp.int32 else "constant")
    x = x.reshape(b, (length + pad) // chunk_size, chunk_size, *x.shape[2:])
    order = {3: (1, 0, 2), 4: (1, 0, 3, 2), 5: (1, 0, 3, 2, 4)}[x.ndim]
    return x.transpose(order)


def chunk_gated_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    *,
    chunk_size: int = 64,
    initial_state: Array | None = None,
    runs: Array | None = None,
) -> tuple[Array, Array]:
    """The gated delta rule over chunks of `chunk_size` positions (training, prefill): the
    same result as `recurrent_gated_delta_rule` (same arguments), each chunk's writes solved
    at once and the state carried by a `lax.scan`, so memory grows with the chunk, not the
    length. A length the chunk does not divide is padded with writes of strength 0.

    Within a chunk of log decays cumulated `G`, the writes `delta` solve the unit lower
    triangular system `(I + tril(beta k k^T * D, -1)) delta = beta v - beta exp(G) k S0`
    (`D[i, j] = exp(G_i - G_j)` within a run, 0 across one; `unit_lower_inverse`), the
    outputs are `exp(G) q S0 + (q k^T * D) delta`, and the state leaves as `exp(G_last) S0 +
    (k * D[last])^T delta`; positions of another run than the chunk's entry see none of `S0`."""
    c = chunk_size
    causal = jnp.tril(jnp.ones((c, c), bool))
    strictly_lower = jnp.tril(jnp.ones((c, c), jnp.float32), -1)

    def step(state, previous, q, k, v, g, beta, run):  # [b, h, c, d], [b, h, c], [b, c]
        cum = jnp.cumsum(g, axis=-1)
        keep = (causal & (run[:, :, None] == run[:, None, :]))[:, None]  # [b, 1, c, c]
        diff = cum[..., :, None] - cum[..., None, :]
        decay = jnp.where(keep, jnp.exp(jnp.where(keep, diff, 0.0)), 0.0)  # [b, h, c, c]
        entry = jnp.where((run == previous[:, None])[:, None], jnp.exp(cum), 0.0)  # [b, h, c]
        k_beta = k * beta[..., None]
        system = dot("bhik,bhjk->bhij", k_beta, k) * decay * strictly_lower
        inverse = unit_lower_inverse(system)  # (I + system)^-1
        values = dot("bhij,bhjv->bhiv", inverse, v * beta[..., None])
        keys_read = dot("bhij,bhjk->bhik", inverse, k_beta * entry[..., None])
        delta = values - dot("bhik,bhkv->bhiv", keys_read, state)  # [b, h, c, dv]
        scores = dot("bhik,bhjk->bhij", q, k) * decay
        out = dot("bhik,bhkv->bhiv", q * entry[..., None], state)
        out = out + dot("bhij,bhjv->bhiv", scores, delta)
        decayed = k * decay[..., -1, :, None]  # each key's decay to the chunk's end
        state = entry[..., -1, None, None] * state + dot("bhjk,bhjv->bhkv", decayed, delta)
        return state, out

    return scan_chunks(step, (q, k, v, g, beta), c, initial_state, runs)


def scan_chunks(
    step: Callable[..., tuple[Array, Array]],
    inputs: tuple[Array, ...],
    chunk_size: int,
    initial_state: Array | None,
    runs: Array | None,
) -> tuple[Array, Array]:
    """The chunked rules' loop (`chunk_gated_delta_rule`'s, `kimi_delta.chunk_kimi_delta_rule`'s:
    their q, k, v, g, beta `inputs` and arguments): `step(state, previous run, q, k, v, g, beta,
    run) -> (state, out)` scanned from `initial_state` over the chunks (`to_chunks`: `[batch,
    heads, chunk, ...]`; the runs `[batch, chunk]`) -> (float32 out, the final state). Steps
    are rematerialised: the backward keeps a chunk's inputs and state, not its products."""
    (b, length, h, dk), dv = inputs[1].shape, inputs[2].shape[-1]
    runs = jnp.zeros((b, length), jnp.int32) if runs is None else runs
    xs = [to_chunks(x.astype(jnp.float32), chunk_size) for x in inputs]
    xs.append(to_chunks(runs, chunk_size))

    @jax.checkpoint
    def scanned(carry, x):
        state, out = step(*carry, *x)
        return (state, x[-1][:, -1]), out

    state = _initial(initial_state, (b, h, dk, dv))
    (state, _), out = jax.lax.scan(scanned, (state, runs[:, 0]), xs)
    out = out.transpose(1, 0, 3, 2, 4)  # [chunks, b, h, c, dv] -> [b, chunks, c, h, dv]
    return out.reshape(b, -1, h, dv)[:, :length], state


SOLVE_BLOCK = 16  # the diagonal blocks `unit_lower_inverse` inverts by forward substitution


def unit_lower_inverse(lower: Array) -> Array:
    """`(I + lower)^-1` for strictly lower triangular `lower` `[..., n, n]` (any n), by
    matmuls: diagonal blocks of `SOLVE_BLOCK` inverted by forward substitution, then pairs of
    inverted blocks merged, `[[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]` (FLA's
    `solve_tril`). XLA's own ops on every backend: no LAPACK call in the program."""
    n = lower.shape[-1]
    size = SOLVE_BLOCK
    while size < n:
        size *= 2
    padded = jnp.pad(lower, [(0, 0)] * (lower.ndim - 2) + [(0, size - n)] * 2)
    return _inverse(padded)[..., :n, :n]


def _inverse(lower: Array) -> Array:
    n = lower.shape[-1]
    if n <= SOLVE_BLOCK:
        # Row i: e_i - lower[i] @ inverse (its rows i.. are still e_j, times 0); a rolled loop.
        def substitute(i: Array, inverse: Array) -> Array:
            row = jax.lax.dynamic_index_in_dim(lower, i, -2, keepdims=False)
            return inverse.at[..., i, :].add(-dot("...j,...jk->...k", row, inverse))

        eye = jnp.broadcast_to(jnp.eye(n, dtype=lower.dtype), lower.shape)
        return jax.lax.fori_loop(1, n, substitute, eye)
    m = n // 2
    halves = _inverse(jnp.stack([lower[..., :m, :m], lower[..., m:, m:]]))
    upper_left, lower_right = halves[0], halves[1]
    product = dot("...ij,...jk->...ik", lower[..., m:, :m], upper_left)
    lower_left = -dot("...ij,...jk->...ik", lower_right, product)
    zeros = jnp.zeros_like(lower_left)
    top = jnp.concatenate([upper_left, zeros], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([lower_left, lower_right], axis=-1)], axis=-2)


def dot(subscripts: str, a: Array, b: Array) -> Array:
    """`jnp.einsum` of two operands at `EXACT` precision."""
    return jnp.einsum(subscripts, a, b, precision=EXACT)


def _initial(state: Array | None, shape: tuple[int, ...]) -> Array:
    return jnp.zeros(shape, jnp.float32) if state is None else state.astype(jnp.float32)


# ---------------------------------------------------------------------------- the layer


class GatedRMSNorm(nn.Module):
    """Each head's output RMS-normalised in float32, times `scale` (initialised at one) and
    gated by `silu(gate)` (HF's `Qwen3NextRMSNormGated`, norm before gate)."""

    epsilon: float = 1e-6
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, gate: Array) -> Array:
        init = nn.with_logical_partitioning(nn.initializers.ones, ("head_dim",))
        scale = self.param("scale", init, (x.shape[-1],), as_dtype(self.param_dtype))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        return self.gated(y, scale, gate.astype(jnp.float32))

    def gated(self, y: Array, scale: Array, gate: Array) -> Array:
        """float32 `y` (normalised) scaled in the compute dtype, times float32 `silu(gate)`."""
        dtype = as_dtype(self.dtype)
        y = (scale.astype(dtype) * y.astype(dtype)).astype(jnp.float32)
        return (y * jax.nn.silu(gate)).astype(dtype)


def conv_init(key: Array, shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> Array:
    """torch's `Conv1d` default init for a depthwise kernel of `shape[0]` taps."""
    bound = shape[0] ** -0.5
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def a_log_init(key: Array, shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> Array:
    """HF's `A_log`: the log of a uniform draw in [0.01, 16) per head."""
    return jnp.log(jax.random.uniform(key, shape, dtype, 0.01, 16.0))


class Reading(NamedTuple):
    """How a delta-rule layer's call reads its positions (`DeltaRuleLayer.start`)."""

    decoding: masks.Decoding | None  # where a contiguous cache's decoding is (None: training)
    runs: Array | None  # `segment_runs` of a packed training row (None: one run, or decoding)
    split: tuple[Array | None, Array | None] | None  # `linear_context_parallel.split`'s

    @property
    def paged(self) -> bool:
        """Whether it decodes over the paged cache (the state in slots: `state_slots`)."""
        return self.decoding is not None and self.decoding.paged


class DeltaRuleLayer(nn.Module, kw_only=True):
    """The steps of the delta-rule token mixers (`GatedDeltaNet`, `kimi_delta.KimiDeltaAttention`)
    around their own projections and gates. Called `(h, mask, decoding)` (the normed hidden
    states `[batch, length, embed]`, the block's mask, where a contiguous cache's decoding is:
    None in training), their `__call__` takes `start`, projects, `convolve`s q, k and v, gates,
    takes `delta_rule`, norms and projects. Settings: keywords, after the layer's own. Cache
    (decoding): `conv_q`, `conv_k`, `conv_v` `[batch, K - 1, heads, dim]` (the convolution's last
    inputs), `recurrent_state` `[batch, heads, key_dim, value_dim]` float32; paged, pools of
    them `[num_state_slots, ...]` (`state_slots`)."""

    conv_kernel_size: int = 4
    activation: str = "silu"  # the convolution's (HF: hidden_act)
    chunk_size: int = 64
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def start(
        self, h: Array, mask: masks.Mask | Array, decoding: masks.Decoding | None
    ) -> tuple[Array, Reading]:
        """h `[batch, length, embed]` as the layer reads it (a left-padded prompt's padding
        zeroed: it writes nothing, as HF zeroes its hidden states), and how (`__call__`'s
        arguments: `mask`'s segment ids restart the state)."""
        runs = None
        if decoding is None:
            segment_ids = getattr(mask, "q_segment_ids", None)
            runs = None if segment_ids is None else segment_runs(segment_ids)
        elif not decoding.paged:  # paged: a row's padding comes after its real tokens
            slots = decoding.index + jnp.arange(h.shape[1])
            h = jnp.where((slots[None, :] >= decoding.start[:, None])[..., None], h, 0)
        split = linear_context_parallel.split(mask, decoding, h.shape[1])  # None: read whole
        return h, Reading(decoding, runs, split)

    def convolve(self, name: str, x: Array, heads: str | None, reading: Reading) -> Array:
        """The activation of the causal convolution of x `[batch, length, heads, dim]` (its
        heads the logical axis `heads`), in the compute dtype: its kernel the param
        `conv_{name}` `[K, heads, dim]`, the inputs before x the cache's `conv_{name}`."""
        dtype, taps, channels = as_dtype(self.dtype), self.conv_kernel_size, x.shape[2:]
        init = nn.with_logical_partitioning(conv_init, (None, None, None))
        kernel = self.param(f"conv_{name}", init, (taps, *channels), as_dtype(self.param_dtype))
        context = self._cache(f"conv_{name}", (x.shape[0], taps - 1, *channels), dtype, reading)
        if reading.split is not None:
            out = linear_context_parallel.causal_conv1d(
                causal_conv1d, segment_runs, x, kernel, *reading.split, heads
            )
        elif reading.paged:
            conv = (self, f"conv_{name}", causal_conv1d)
            out = state_slots.convolve(*conv, x, kernel, reading.decoding)
        else:
            start = jnp.zeros((x.shape[0], taps - 1, *channels), dtype)
            start = start if context is None else context.value
            out, last = causal_conv1d(x, kernel, start, reading.runs)
            if context is not None:
                context.value = last.astype(dtype)
        return layers.ACTIVATIONS[self.activation](out).astype(dtype)

    def delta_rule(
        self, chunked: Rule, q: Array, k: Array, v: Array, g: Array, beta: Array, reading: Reading
    ) -> Array:
        """float32 out `[batch, length, heads, value_dim]` of the rule (q, k, v, g, beta as
        `recurrent_gated_delta_rule`'s): a decoded token's recurrent from the cache's
        `recurrent_state`, else `chunked`'s at `chunk_size` (a split sequence in pieces; over
        the paged cache from each row's state slot, `state_slots.delta_rule`)."""
        batch, length, heads, key_dim = k.shape
        if reading.paged:  # a prefill chunk shorter than a rule chunk: one of its length
            rules = (recurrent_gated_delta_rule, chunked, min(self.chunk_size, length))
            return state_slots.delta_rule(self, rules, q, k, v, g, beta, reading.decoding)
        chunked = functools.partial(chunked, chunk_size=self.chunk_size)
        shape = (batch, heads, key_dim, v.shape[-1])
        state = self._cache("recurrent_state", shape, jnp.float32, reading)
        initial = None if state is None else state.value
        if state is not None and length == 1:
            out, final = recurrent_gated_delta_rule(q, k, v, g, beta, initial)
        elif reading.split is not None:
            return linear_context_parallel.gated_delta_rule(
                chunked, segment_runs, q, k, v, g, beta, *reading.split
            )
        else:
            out, final = chunked(q, k, v, g, beta, initial_state=initial, runs=reading.runs)
        if state is not None:
            state.value = final
        return out

    def _cache(self, name: str, shape: tuple, dtype: Dtype, reading: Reading) -> nn.Variable | None:
        """The cache variable `name` while decoding (zeros at first), else None."""
        decoding = reading.decoding is not None and not reading.paged
        return self.variable("cache", name, jnp.zeros, shape, dtype) if decoding else None


class GatedDeltaNet(DeltaRuleLayer):
    """The linear-attention token mixer: `[batch, length, embed]` -> `[batch, length, embed]`.

    Params (HF's names): the projections (`projection` 'grouped': Qwen3-Next's
    `in_proj_qkvz` `[embed, key_heads, 2 key_dim + 2 (value_heads / key_heads) value_dim]`
    and `in_proj_ba` `[embed, key_heads, 2 (value_heads / key_heads)]`, each key head's
    queries, keys, values and gates together; 'split': Qwen3.5's `in_proj_q`, `in_proj_k`,
    `in_proj_v` (rows of HF's `in_proj_qkv`), `in_proj_z`, `in_proj_b`, `in_proj_a`), the
    convolution's kernels `conv_q`, `conv_k`, `conv_v` `[K, heads, dim]` (rows of HF's
    `conv1d.weight`), `A_log` and `dt_bias` `[value_heads]`, `norm` and `out_proj`.

    Cache (while decoding): `DeltaRuleLayer`'s, `recurrent_state` `[batch, value_heads,
    key_dim, value_dim]`.
    """

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_dim: int
    value_dim: int
    norm_eps: float = 1e-6
    projection: str = "grouped"  # one of PROJECTIONS
    norm_cls = GatedRMSNorm  # the gated norm's class (Qwen4-Exp's sigmoid gate: a subclass)

    @nn.compact
    def __call__(
        self, h: Array, mask: masks.Mask | Array, decoding: masks.Decoding | None
    ) -> Array:
        h, reading = self.start(h, mask, decoding)
        q, k, v, z, b, a = self._project(h)
        key_heads = layers.kv_heads_axis(self.num_key_heads)
        q = self.convolve("q", q, key_heads, reading)
        k = self.convolve("k", k, key_heads, reading)
        v = self.convolve("v", v, "heads", reading)

        param_dtype, heads = as_dtype(self.param_dtype), (self.num_value_heads,)
        a_log = self.param(
            "A_log", nn.with_logical_partitioning(a_log_init, (None,)), heads, param_dtype
        )
        ones = nn.with_logical_partitioning(nn.initializers.ones, (None,))
        dt_bias = self.param("dt_bias", ones, heads, param_dtype)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        # float32 whatever the params: a float16 A_log could give an infinite decay.
        decay = jnp.exp(a_log.astype(jnp.float32))
        g = -decay * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
        group = self.num_value_heads // self.num_key_heads
        q = jnp.repeat(l2_normalize(q) * self.key_dim**-0.5, group, axis=2)
        k = jnp.repeat(l2_normalize(k), group, axis=2)

        out = self.delta_rule(chunk_gated_delta_rule, q, k, v, g, beta, reading)
        norm = self.norm_cls(self.norm_eps, self.dtype, self.param_dtype, name="norm")
        out = layers.constrain(norm(out.astype(as_dtype(self.dtype)), z), layers.HEAD_AXES)
        return DenseGeneral(
            self.hidden_size, ("heads", "head_dim", "embed"), axis=(-2, -1), name="out_proj",
            dtype=self.dtype, param_dtype=self.param_dtype,
        )(out)  # fmt: skip

    def _project(self, h: Array) -> tuple[Array, ...]:
        """q, k `[batch, length, key_heads, key_dim]`; v, z `[batch, length, value_heads,
        value_dim]`; b, a `[batch, length, value_heads]`, by `projection`."""
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        hk, hv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_dim, self.value_dim
        group = hv // hk
        batch, length, _ = h.shape
        if self.projection == "grouped":
            width = 2 * dk + 2 * group * dv
            axes = ("embed", layers.kv_heads_axis(hk), None)  # one key head: unsplit
            qkvz = DenseGeneral((hk, width), axes, name="in_proj_qkvz", **dense)(h)
            ba = DenseGeneral((hk, 2 * group), axes, name="in_proj_ba", **dense)(h)
            q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + group * dv], axis=-1)
            v, z = (x.reshape(batch, length, hv, dv) for x in (v, z))
            b, a = (x.reshape(batch, length, hv) for x in jnp.split(ba, 2, axis=-1))
            return q, k, v, z, b, a
        if self.projection != "split":
            raise ValueError(f"projection {self.projection!r}: expected one of {PROJECTIONS}.")
        key_axes = ("embed", layers.kv_heads_axis(hk), "head_dim")
        value_axes = ("embed", "heads", "head_dim")
        q, k, v, z, b, a = layers.parallel_dense(
            h,
            [
                DenseGeneral((hk, dk), key_axes, name="in_proj_q", **dense),
                DenseGeneral((hk, dk), key_axes, name="in_proj_k", **dense),
                DenseGeneral((hv, dv), value_axes, name="in_proj_v", **dense),
                DenseGeneral((hv, dv), value_axes, name="in_proj_z", **dense),
                DenseGeneral(hv, ("embed", "heads"), name="in_proj_b", **dense),
                DenseGeneral(hv, ("embed", "heads"), name="in_proj_a", **dense),
            ],
        )
        return q, k, v, z, b, a
