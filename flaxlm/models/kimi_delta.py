"""Kimi Delta Attention (KDA): the linear-attention token mixer of Kimi Linear (Kimi Team,
"Kimi Linear", arXiv 2510.26692), as transformers' `KimiLinearDeltaAttention`.

Gated DeltaNet's delta rule (`gated_deltanet.py`) with a decay per key channel rather than
one per head: each head keeps a state `S` `[key_dim, value_dim]` that every token decays
row by row and corrects toward its value,

    S <- diag(exp(g_t)) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

with q, k L2-normalised (q also by head_dim^-0.5), `beta = sigmoid(b_proj(x))` and the
forget gate `g = -exp(A_log) softplus(f_b_proj(f_a_proj(x)) + dt_bias)` `[heads, head_dim]`
(a low-rank projection, `A_log` one per head, `dt_bias` one per channel). Queries, keys and
values share one head width and go through a short causal depthwise convolution and its
activation first; after the rule each head is RMS-normalised in float32 and gated by the
sigmoid of another low-rank projection (`g_a_proj`, `g_b_proj`), then projected back.

Training and prefill run the chunked form (`chunk_kimi_delta_rule`: a `lax.scan` over
chunks, `gated_deltanet.scan_chunks`, each chunk's writes one unit lower triangular system
solved by matmuls, `gated_deltanet.unit_lower_inverse`); decoding one token at a time runs
Gated DeltaNet's recurrent form (`gated_deltanet.recurrent_gated_delta_rule`, which takes a
decay a key channel), its state and the convolution's last inputs in the Flax `cache`
collection under `decoding.RECURRENT_STATE`'s names. Packed rows restart both at every
segment start (`gated_deltanet.segment_runs`). A sequence split over the mesh's `sequence`
axis (context parallelism, the load-balanced order too) is read where it lies, as Gated
DeltaNet's (`linear_context_parallel`: the state is affine in the state a piece starts from,
whatever the decay's shape). The layer's steps around its own projections and gates (the
convolution, the segment runs, the rule's dispatch) are `gated_deltanet.DeltaRuleLayer`'s.

Nothing here knows a mesh: activations carry logical axis names only.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models import gated_deltanet, layers, masks, mla
from flaxlm.models.gated_deltanet import dot
from flaxlm.models.layers import DenseGeneral, Dtype, as_dtype

Array = jax.Array

# Pairs of positions within one block of this many share no factor of their decay (each
# pair's exp(G_i - G_j) per channel, elementwise); across blocks the decay factors at the
# later block's start, and the products are matmuls (FLA's sub-chunks).
SUB_BLOCK = 16


# ---------------------------------------------------------------------------- the math


@functools.partial(jax.jit, static_argnames="chunk_size")
def chunk_kimi_delta_rule(
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
    """The rule over chunks of `chunk_size` positions (training, prefill): the same result
    as `gated_deltanet.recurrent_gated_delta_rule` (same arguments, the log decays `g` <= 0
    `[batch, length, heads, key_dim]`), each chunk's writes solved at once and the state
    carried by a `lax.scan`. A length the chunk does not divide is padded with writes of
    strength 0.

    Within a chunk of log decays cumulated `G` `[c, key_dim]` and the pairwise decays
    `D_ij = exp(G_i - G_j)` per channel (within a run, causal), the writes `delta` solve
    `(I + tril(sum_k beta_i k_i D_ij k_j, -1)) delta = beta v - beta (k exp(G)) S0`, the
    outputs are `(q exp(G)) S0 + (sum_k q_i D_ij k_j) delta` and the state leaves as
    `exp(G_last) S0 + (k exp(G_last - G))^T delta`; positions of another run than the
    chunk's entry see none of `S0`."""
    c = chunk_size
    causal = jnp.tril(jnp.ones((c, c), bool))
    strictly = jnp.tril(jnp.ones((c, c), bool), -1)

    def step(state, previous, q, k, v, g, beta, run):  # [b, h, c, dk] (v: dv), [b, h, c], [b, c]
        cum = jnp.cumsum(g, axis=-2)
        same = (run[:, :, None] == run[:, None, :])[:, None]  # [b, 1, c, c]
        entered = (run == previous[:, None])[:, None, :, None]  # [b, 1, c, 1]
        entry = jnp.where(entered, jnp.exp(cum), 0.0)  # each position's decay since S0
        k_beta = k * beta[..., None]
        system = decayed_products(k_beta, k, cum, same & strictly)
        inverse = gated_deltanet.unit_lower_inverse(system)  # (I + system)^-1
        values = dot("bhij,bhjv->bhiv", inverse, v * beta[..., None])
        keys_read = dot("bhij,bhjk->bhik", inverse, k_beta * entry)
        delta = values - dot("bhik,bhkv->bhiv", keys_read, state)  # [b, h, c, dv]
        scores = decayed_products(q, k, cum, same & causal)
        out = dot("bhik,bhkv->bhiv", q * entry, state)
        out = out + dot("bhij,bhjv->bhiv", scores, delta)
        with_last = same[..., -1, :, None]  # [b, 1, c, 1]: in the chunk's last run
        to_end = jnp.where(with_last, cum[..., -1:, :] - cum, 0.0)
        decayed = k * jnp.where(with_last, jnp.exp(to_end), 0.0)  # each key to the end
        state = entry[..., -1, :, None] * state + dot("bhjk,bhjv->bhkv", decayed, delta)
        return state, out

    return gated_deltanet.scan_chunks(step, (q, k, v, g, beta), c, initial_state, runs)


def decayed_products(a: Array, b: Array, cum: Array, keep: Array) -> Array:
    """`[..., c, c]`: `sum_k a_ik b_jk exp(cum_ik - cum_jk)` where `keep` (`[..., c, c]`,
    lower triangular), else 0; a, b, cum `[..., c, key_dim]`, cum non-increasing along c.

    In blocks of `SUB_BLOCK` positions: pairs within a block elementwise (their decay in one
    exponent), pairs across blocks by matmuls of `a` decayed to its block's start and `b`
    decayed from there, `exp(cum_i - cum_r) exp(cum_r - cum_j)`: both factors at most 1,
    where `exp(cum_i) exp(-cum_j)` would overflow across a long or steep chunk."""
    c = a.shape[-2]
    s = max(d for d in range(1, min(c, SUB_BLOCK) + 1) if c % d == 0)
    n = c // s
    blocks = lambda x: x.reshape(*x.shape[:-2], n, s, x.shape[-1])  # noqa: E731
    a_, b_, cum_ = blocks(a), blocks(b), blocks(cum)
    lower = jnp.tril(jnp.ones((s, s), bool))[..., None]
    diff = jnp.where(lower, cum_[..., :, None, :] - cum_[..., None, :, :], 0.0)
    within = jnp.sum(a_[..., :, None, :] * b_[..., None, :, :] * jnp.exp(diff), axis=-1)
    out = (within[..., :, :, None, :] * jnp.eye(n)[:, None, :, None]).reshape(*a.shape[:-2], c, c)
    if n > 1:
        start = cum_[..., :1, :]  # [..., n, 1, dk]: each block's first position
        left = a_ * jnp.exp(cum_ - start)
        before = (jnp.arange(c)[None, :] < jnp.arange(0, c, s)[:, None])[..., None]  # [n, c, 1]
        exponent = jnp.where(before, start - cum[..., None, :, :], 0.0)  # [..., n, c, dk]
        right = jnp.where(before, b[..., None, :, :] * jnp.exp(exponent), 0.0)
        out = out + dot("...nik,...njk->...nij", left, right).reshape(out.shape)
    return jnp.where(keep, out, 0.0)


# ---------------------------------------------------------------------------- the layer


class SigmoidGatedRMSNorm(gated_deltanet.GatedRMSNorm):
    """Gated DeltaNet's `GatedRMSNorm` gated by `sigmoid(gate)` and scaled in float32 (HF's
    `KimiLinearRMSNormGated`)."""

    epsilon: float = 1e-5

    def gated(self, y: Array, scale: Array, gate: Array) -> Array:
        """float32 `y` (normalised) times `scale` and `sigmoid(gate)` in float32."""
        y = scale.astype(jnp.float32) * y * jax.nn.sigmoid(gate)
        return y.astype(as_dtype(self.dtype))


def a_log_init(key: Array, shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> Array:
    """HF's (FLA's) `A_log`: the log of a uniform draw in [1, 16) per head."""
    return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def dt_bias_init(key: Array, shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> Array:
    """HF's (FLA's) `dt_bias`: the inverse softplus of a log-uniform draw in [1e-3, 0.1)."""
    dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, math.log(1e-3), math.log(1e-1)))
    dt = jnp.maximum(dt, 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class KimiDeltaAttention(gated_deltanet.DeltaRuleLayer):
    """The linear-attention token mixer: `[batch, length, embed]` -> `[batch, length, embed]`.

    Params (HF's names): `q_proj`, `k_proj`, `v_proj` `[embed, heads, head_dim]`, the
    convolution's kernels `conv_q`, `conv_k`, `conv_v` `[K, heads, head_dim]` (HF's
    `q_conv1d` ...), the forget gate's `f_a_proj` `[embed, head_dim]`, `f_b_proj` `[head_dim,
    heads, head_dim]`, `A_log` `[heads]` and `dt_bias` `[heads, head_dim]`, `b_proj`
    `[embed, heads]`, the output gate's `g_a_proj`, `g_b_proj`, `o_norm` and `o_proj`.

    Cache (while decoding): `gated_deltanet.DeltaRuleLayer`'s, `recurrent_state` `[batch,
    heads, head_dim, head_dim]`.
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    norm_eps: float = 1e-5

    @nn.compact
    def __call__(
        self, h: Array, mask: masks.Mask | Array, decoding: masks.Decoding | None
    ) -> Array:
        heads, dk = self.num_heads, self.head_dim
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h, reading = self.start(h, mask, decoding)
        head_axes = ("embed", "heads", "head_dim")
        q, k, v, b = layers.parallel_dense(
            h,
            [
                DenseGeneral((heads, dk), head_axes, name="q_proj", **dense),
                DenseGeneral((heads, dk), head_axes, name="k_proj", **dense),
                DenseGeneral((heads, dk), head_axes, name="v_proj", **dense),
                DenseGeneral(heads, ("embed", "heads"), name="b_proj", **dense),
            ],
        )
        q, k, v = (self.convolve(name, x, "heads", reading) for name, x in zip("qkv", (q, k, v)))
        q = gated_deltanet.l2_normalize(q) * dk**-0.5
        k = gated_deltanet.l2_normalize(k)
        g = self._forget_gate(h)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))

        out = self.delta_rule(chunk_kimi_delta_rule, q, k, v, g, beta, reading)
        gate = self._low_rank(h, "g")
        norm = SigmoidGatedRMSNorm(self.norm_eps, name="o_norm", **dense)
        out = layers.constrain(norm(out.astype(as_dtype(self.dtype)), gate), layers.HEAD_AXES)
        return DenseGeneral(
            self.hidden_size, ("heads", "head_dim", "embed"), axis=(-2, -1), name="o_proj",
            **dense,
        )(out)  # fmt: skip

    def _low_rank(self, h: Array, name: str) -> Array:
        """`{name}_b_proj({name}_a_proj(h))` `[batch, length, heads, head_dim]`: the
        forget gate's (`f`) or the output gate's (`g`) projection through `head_dim`."""
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        down = DenseGeneral(self.head_dim, ("embed", None), name=f"{name}_a_proj", **dense)(h)
        up_axes = (mla.LATENT_IN, "heads", "head_dim")
        up = DenseGeneral((self.num_heads, self.head_dim), up_axes, name=f"{name}_b_proj", **dense)
        return up(down)

    def _forget_gate(self, h: Array) -> Array:
        """float32 log decays `[batch, length, heads, head_dim]` (HF's `KimiLinearForgetGate`,
        float32 whatever the params: a float16 A_log could give an infinite decay)."""
        param_dtype = as_dtype(self.param_dtype)
        heads, dk = self.num_heads, self.head_dim
        a_log = self.param(
            "A_log", nn.with_logical_partitioning(a_log_init, (None,)), (heads,), param_dtype
        )
        init = nn.with_logical_partitioning(dt_bias_init, (None, None))
        dt_bias = self.param("dt_bias", init, (heads, dk), param_dtype)
        x = self._low_rank(h, "f").astype(jnp.float32) + dt_bias.astype(jnp.float32)
        return -jnp.exp(a_log.astype(jnp.float32))[:, None] * jax.nn.softplus(x)
