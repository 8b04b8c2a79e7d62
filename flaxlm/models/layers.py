"""Shared, logically-annotated building blocks: dense, embed, norms, rotary, attention, remat.

Every parameter carries logical axis names (`nn.with_logical_partitioning`); activations are
pinned with `nn.with_logical_constraint`. Nothing here knows a mesh.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array
Dtype = Any
Initializer = Callable[..., Array]

# Activations are pinned at block boundaries with these logical names.
ACTIVATION_AXES = ("batch", "length", "embed")
HEAD_AXES = ("batch", "length", "heads", "head_dim")


def as_dtype(dtype: Dtype) -> jnp.dtype:
    """Accepts 'bfloat16', jnp.bfloat16, ... (Gin binds strings)."""
    return jnp.dtype(dtype)


def constrain(x: Array, axes: Sequence[str | None]) -> Array:
    return nn.with_logical_constraint(x, tuple(axes))


def contract(x: Array, w: Array, axis: Sequence[int], w_start: int = 0) -> Array:
    """`x`'s dims `axis` contracted with `w`'s dims `w_start : w_start + len(axis)`; the
    result has `x`'s other dims, `w`'s first `w_start` dims, then `w`'s output dims.

    Same values as that `dot_general`; the point is the HLO. `w`'s output dims are flattened
    into one for the product, so a weight gradient such as q/k/v's stacked
    `[3, embed, heads, head_dim]` is computed as `[3, embed, heads * head_dim]`, which XLA's
    TPU pipeline turns into an FSDP reduce-scatter; the rank-4 one stayed an all-reduce of the
    whole gradient and a slice. (Flattening the contracted dims too changed nothing there and
    cost ~1.5% of a CPU train step.)
    """
    axis = tuple(a % x.ndim for a in axis)
    n = len(axis)
    out = w.shape[w_start + n :]
    w = w.reshape(*w.shape[: w_start + n], int(np.prod(out, dtype=np.int64)))
    y = jax.lax.dot_general(x, w, ((axis, tuple(range(w_start, w_start + n))), ((), ())))
    return y.reshape(*y.shape[:-1], *out)


class DenseGeneral(nn.Module):
    """A dense layer over the trailing `len(axis)` dims with logically named kernel axes.

    `kernel_axes` names the input dims followed by the output dims, e.g.
    `('embed', 'heads', 'head_dim')` for a query projection to `features=(heads, head_dim)`.

    When the params hold low-rank adapters beside the kernel (`lora_a`: in dims + [rank],
    already scaled; `lora_b`: [rank] + out dims; put there by `flaxlm.lora`), the layer adds
    `(dropout(x) A) B` to its output (`adapt`); the model's own init never creates them.
    """

    features: int | tuple[int, ...]
    kernel_axes: tuple[str, ...]
    axis: int | tuple[int, ...] = -1
    use_bias: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    kernel_init: Initializer = nn.initializers.normal(0.02)

    def _features(self) -> tuple[int, ...]:
        return (self.features,) if isinstance(self.features, int) else tuple(self.features)

    def contracted(self, ndim: int) -> tuple[int, ...]:
        """The dims of an `ndim`-dim input that the kernel contracts."""
        axis = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
        return tuple(a % ndim for a in axis)

    @nn.compact
    def weights(self, in_shape: tuple[int, ...]) -> tuple[Array, Array | None]:
        """`(kernel, bias or None)` in the param dtype, for inputs whose contracted dims have
        `in_shape` (created on first use)."""
        features = self._features()
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(self.kernel_init, self.kernel_axes),
            tuple(in_shape) + features,
            as_dtype(self.param_dtype),
        )
        bias = None
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(
                    nn.initializers.zeros, self.kernel_axes[len(in_shape) :]
                ),
                features,
                as_dtype(self.param_dtype),
            )
        return kernel, bias

    def __call__(self, x: Array) -> Array:
        axis = self.contracted(x.ndim)
        kernel, bias = self.weights(tuple(x.shape[a] for a in axis))
        dtype = as_dtype(self.dtype)
        y = contract(x.astype(dtype), kernel.astype(dtype), axis)
        if bias is not None:
            y = y + bias.astype(dtype)
        return self.adapt(x, y)

    def adapt(self, x: Array, y: Array) -> Array:
        """`y` plus the low-rank update `(dropout(x) A) B` when the params hold adapters for
        this layer; `y` unchanged otherwise."""
        if not self.has_variable("params", "lora_a"):
            return y
        a = self.get_variable("params", "lora_a")
        b = self.get_variable("params", "lora_b")
        dtype = as_dtype(self.dtype)
        rate = _LORA_DROPOUT[-1] if _LORA_DROPOUT else 0.0
        if rate > 0.0:
            keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - rate, x.shape)
            x = jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)
        xa = contract(x.astype(dtype), a.astype(dtype), self.contracted(x.ndim))
        update = contract(xa, b.astype(dtype), (-1,))
        return y + update.astype(y.dtype)


# Dropout rate on the input of LoRA's low-rank path while a train step is traced (a stack:
# `lora_dropout` nests); empty, i.e. no dropout, otherwise.
_LORA_DROPOUT: list[float] = []


@contextlib.contextmanager
def lora_dropout(rate: float) -> Iterator[None]:
    """Within this context, adapted `DenseGeneral`s drop their low-rank path's input with
    `rate` (needs a `dropout` rng in the model's apply)."""
    _LORA_DROPOUT.append(float(rate))
    try:
        yield
    finally:
        _LORA_DROPOUT.pop()


def parallel_dense(x: Array, projections: Sequence[DenseGeneral]) -> list[Array]:
    """`[p(x) for p in projections]`, with one matmul for each group of projections whose
    kernels have equal shapes and axes: their kernels are stacked on a new leading dim (local
    under any sharding) and contracted with `x` once.

    This is Megatron's fused QKV without changing the params (still one kernel per
    projection, as in HF checkpoints): under tensor parallelism the input gradient of a group
    is one partial sum over the sharded output dims, all-reduced once, instead of once per
    projection.
    """
    groups: dict[Any, list[int]] = {}
    for i, p in enumerate(projections):
        key = (
            p._features(),
            tuple(p.kernel_axes),
            p.contracted(x.ndim),
            p.use_bias,
            as_dtype(p.dtype),
        )
        groups.setdefault(key, []).append(i)
    out: list[Array | None] = [None] * len(projections)
    for (_, _, axis, _, dtype), members in groups.items():
        if len(members) == 1:
            out[members[0]] = projections[members[0]](x)
            continue
        weights = [projections[i].weights(tuple(x.shape[a] for a in axis)) for i in members]
        kernel = jnp.stack([k.astype(dtype) for k, _ in weights])  # [group, in..., out...]
        y = contract(x.astype(dtype), kernel, axis, w_start=1)
        group_dim = x.ndim - len(axis)  # y: x's free dims, group, out dims
        for j, i in enumerate(members):
            y_i = jax.lax.index_in_dim(y, j, group_dim, keepdims=False)
            bias = weights[j][1]
            if bias is not None:
                y_i = y_i + bias.astype(dtype)
            out[i] = projections[i].adapt(x, y_i)
    return out  # type: ignore[return-value]


class Embed(nn.Module):
    """Token embedding `[vocab, embed]`; `attend` gives tied-head logits."""

    num_embeddings: int
    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    embedding_init: Initializer = nn.initializers.normal(0.02)

    def setup(self) -> None:
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(self.embedding_init, ("vocab", "embed")),
            (self.num_embeddings, self.features),
            as_dtype(self.param_dtype),
        )

    def __call__(self, ids: Array) -> Array:
        # [batch, length] -> [batch, length, embed]
        return jnp.take(self.embedding, ids, axis=0).astype(as_dtype(self.dtype))

    def attend(self, x: Array) -> Array:
        # [batch, length, embed] x [vocab, embed] -> [batch, length, vocab]
        dtype = as_dtype(self.dtype)
        return jnp.einsum("ble,ve->blv", x.astype(dtype), self.embedding.astype(dtype))


class LayerNorm(nn.Module):
    """LayerNorm computed in float32 whatever the compute dtype."""

    epsilon: float = 1e-5
    use_bias: bool = True
    use_scale: bool = True  # False with use_bias=False: no params (torch's elementwise_affine)
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        features = x.shape[-1]
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        if self.use_scale:
            scale = self.param(
                "scale",
                nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                (features,),
                as_dtype(self.param_dtype),
            )
            y = y * scale.astype(jnp.float32)
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                (features,),
                as_dtype(self.param_dtype),
            )
            y = y + bias.astype(jnp.float32)
        return y.astype(as_dtype(self.dtype))


class RMSNorm(nn.Module):
    """RMS normalisation in float32 (Llama, T5, Gemma): no mean, no bias.

    `scale_plus_one` multiplies by `1 + scale` with the param initialised at zero (Gemma).
    """

    epsilon: float = 1e-6
    scale_plus_one: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.zeros if self.scale_plus_one else nn.initializers.ones
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(init, ("embed",)),
            (x.shape[-1],),
            as_dtype(self.param_dtype),
        )
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.epsilon)
        scale = scale.astype(jnp.float32)
        y = y * (1.0 + scale if self.scale_plus_one else scale)
        return y.astype(as_dtype(self.dtype))


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


# ---------------------------------------------------------------------------- positions


def default_positions(tokens: Array, positions: Array | None) -> Array:
    """`positions`, or `0 .. length - 1` in every row of `tokens` [batch, length] if None."""
    if positions is not None:
        return positions
    batch, length = tokens.shape
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


# ---------------------------------------------------------------------------- rotary


def rotary_sin_cos(positions: Array, dim: int, theta: float = 10000.0) -> tuple[Array, Array]:
    """sin/cos tables `[batch, length, dim // 2]` in float32 for integer positions."""
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.sin(angles), jnp.cos(angles)


def apply_rotary(x: Array, sin: Array, cos: Array, *, interleaved: bool) -> Array:
    """Rotates the first `2 * sin.shape[-1]` features of each head of `x`.

    x: [batch, length, heads, head_dim]; sin, cos: [batch, length, rot_dim // 2].
    `interleaved` pairs features (0,1), (2,3), ... (GPT-J); otherwise (i, i + rot_dim/2)
    (GPT-NeoX / Llama).
    """
    rot_dim = 2 * sin.shape[-1]
    x_rot, x_pass = x[..., :rot_dim].astype(jnp.float32), x[..., rot_dim:]
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        out = out.reshape(x_rot.shape)
    else:
        x1, x2 = jnp.split(x_rot, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([out.astype(x.dtype), x_pass], axis=-1)


# ---------------------------------------------------------------------------- ALiBi


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's per-head slopes: 2^(-8/n), 2^(-16/n), ... for the largest power of two n
    <= num_heads, then every other slope of 2n for the remaining heads (Press et al.)."""

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    power = 2 ** int(np.floor(np.log2(num_heads)))
    slopes = geometric(power)
    if power < num_heads:
        slopes += geometric(2 * power)[0::2][: num_heads - power]
    return np.asarray(slopes, np.float32)


def alibi_bias(q_positions: Array, k_positions: Array, num_heads: int) -> Array:
    """float32 `[batch, heads, q_len, kv_len]`: -slope * (query position - key position)
    (keys after the query, masked anyway, get a positive distance's mirror image)."""
    distance = jnp.abs(q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)
    slopes = jnp.asarray(alibi_slopes(num_heads))
    return -slopes[None, :, None, None] * distance[:, None]


# ---------------------------------------------------------------------------- attention


@flax.struct.dataclass
class Mask:
    """Which keys each query may attend to, computed on demand for any block of queries and
    keys (`block`) or whole (`dense`, bool `[batch, 1, q_len, kv_len]`); the blockwise
    attention never holds the whole mask.

    Queries sit at slots `q_offset + i`, keys at slots `j`. `causal`: a key at a later slot
    is hidden; `sliding_window` W: only the W latest slots (the query's own included) are
    seen; `kv_start` (per row): keys before it are padding (left-padded decoding). Segment
    ids keep packed examples apart: with `cross` (keys are another sequence) a query sees
    keys of its own segment and never segment 0 (padding); otherwise queries and keys share
    `q_segment_ids`.
    """

    q_segment_ids: Array | None
    kv_segment_ids: Array | None
    kv_start: Array | None
    q_offset: Array | int
    kv_keep: Array | None = None  # bool [batch, kv_len]: False hides a key from every query
    batch: int = flax.struct.field(pytree_node=False, default=1)
    q_len: int = flax.struct.field(pytree_node=False, default=1)
    kv_len: int = flax.struct.field(pytree_node=False, default=1)
    causal: bool = flax.struct.field(pytree_node=False, default=True)
    sliding_window: int | None = flax.struct.field(pytree_node=False, default=None)
    cross: bool = flax.struct.field(pytree_node=False, default=False)

    def block(self, q_start: Array | int, q_size: int, k_start: Array | int, k_size: int) -> Array:
        """bool `[batch, 1, q_size, k_size]` for queries q_start.. and keys k_start.. (either
        start may be traced; rows and columns past the ends are False)."""
        q_idx = q_start + jnp.arange(q_size)
        k_idx = k_start + jnp.arange(k_size)
        q_slot = (self.q_offset + q_idx)[:, None]
        k_slot = k_idx[None, :]
        mask = (q_idx < self.q_len)[:, None] & (k_idx < self.kv_len)[None, :]
        if self.causal:
            mask = mask & (k_slot <= q_slot)
        if self.sliding_window is not None:
            mask = mask & (q_slot - k_slot < self.sliding_window)
        mask = jnp.broadcast_to(mask[None], (self.batch, q_size, k_size))
        if self.kv_start is not None:
            mask = mask & (k_slot[None] >= self.kv_start[:, None, None])
        if self.kv_keep is not None:
            keep = jnp.pad(self.kv_keep, ((0, 0), (0, k_size)))
            keep = jax.lax.dynamic_slice_in_dim(keep, k_start, k_size, axis=1)
            mask = mask & keep[:, None, :]

        def take(ids: Array, start: Array | int, size: int, length: int) -> Array:
            padded = jnp.pad(ids, ((0, 0), (0, size)))  # reads past the end see segment 0
            return jax.lax.dynamic_slice_in_dim(padded, start, size, axis=1)

        if self.cross:
            if self.q_segment_ids is None:
                q_seg = jnp.ones((self.batch, q_size), jnp.int32)
            else:
                q_seg = take(self.q_segment_ids, q_start, q_size, self.q_len)
            k_seg = take(self.kv_segment_ids, k_start, k_size, self.kv_len)
            mask = mask & (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg > 0)[:, None, :]
        elif self.q_segment_ids is not None:
            q_seg = take(self.q_segment_ids, q_start, q_size, self.q_len)
            k_seg = take(self.q_segment_ids, k_start, k_size, self.q_len)
            mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])
        return mask[:, None]

    def dense(self) -> Array:
        return self.block(0, self.q_len, 0, self.kv_len)


def attention_mask(
    segment_ids: Array | None,
    batch: int,
    length: int,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    kv_segment_ids: Array | None = None,
    kv_length: int | None = None,
) -> Mask:
    """Causal (optionally), and never across packed segments.

    `sliding_window` W lets a query see only the W most recent positions (itself included,
    Mistral). `kv_segment_ids` / `kv_length` describe keys that are not the queries
    (cross-attention); then segment ids pair queries with keys of the same segment, and
    padding (segment 0) is never attended.
    """
    return Mask(
        q_segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids,
        kv_start=None,
        q_offset=0,
        batch=batch,
        q_len=length,
        kv_len=length if kv_length is None else kv_length,
        causal=causal,
        sliding_window=sliding_window,
        cross=kv_segment_ids is not None,
    )


@flax.struct.dataclass
class Decoding:
    """Where incremental decoding is: the cache slot of the first query token (`index`), the
    first slot of each row that holds a real token (`start`; prompts are left-padded so
    every row writes the same slot), and the cache size (`length`, static)."""

    index: Array  # int32 scalar
    start: Array  # int32 [batch]
    length: int = flax.struct.field(pytree_node=False, default=0)


def forgetful_causal_mask(
    mask: Mask, rng: Array, positions: Array, min_ratio: float, max_ratio: float
) -> Mask:
    """Forgetful Causal Masking (Liu et al. 2022, as EasyLM trains GPT-J): each row draws a
    ratio in [min_ratio, max_ratio] and hides that fraction of its keys from every query;
    the first token of each sequence (position 0) always stays visible."""
    ratio_rng, keep_rng = jax.random.split(rng)
    batch, length = positions.shape
    ratio = jax.random.uniform(ratio_rng, (batch, 1), minval=min_ratio, maxval=max_ratio)
    keep = (jax.random.uniform(keep_rng, (batch, length)) >= ratio) | (positions == 0)
    return mask.replace(kv_keep=keep)


def causal_mask(
    segment_ids: Array | None,
    batch: int,
    length: int,
    decoding: Decoding | None = None,
    *,
    sliding_window: int | None = None,
) -> Mask:
    """A decoder's self-attention mask: `attention_mask` over the sequence itself, or while
    decoding over the cache: slots written so far, at or after the row's `start`, within
    the sliding window."""
    if decoding is None:
        return attention_mask(
            segment_ids, batch, length, causal=True, sliding_window=sliding_window
        )
    return Mask(
        q_segment_ids=None,
        kv_segment_ids=None,
        kv_start=decoding.start,
        q_offset=decoding.index,
        batch=batch,
        q_len=length,
        kv_len=decoding.length,
        causal=True,
        sliding_window=sliding_window,
    )


def decoding_positions(decoding: Decoding, batch: int, length: int) -> Array:
    """int32 `[batch, length]` positions of the query tokens while decoding (a left-padded
    row counts from its first real token)."""
    slots = decoding.index + jnp.arange(length, dtype=jnp.int32)[None, :]
    return jnp.broadcast_to(jnp.maximum(slots - decoding.start[:, None], 0), (batch, length))


class KVCache(nn.Module):
    """Keys and values of the tokens decoded so far (Flax collection `cache`).

    Outside decoding it returns its inputs. While decoding it writes the new keys and
    values at `decoding.index` and returns the whole cache `[batch, cache_len, heads,
    head_dim]` (what `causal_mask` masks).
    """

    axes: tuple[str | None, ...] = HEAD_AXES

    @nn.compact
    def __call__(self, key: Array, value: Array, decoding: Decoding | None) -> tuple[Array, Array]:
        if decoding is None:
            return key, value
        shape = (key.shape[0], decoding.length, *key.shape[2:])
        cached = {
            name: self.variable("cache", name, jnp.zeros, shape, x.dtype)
            for name, x in (("key", key), ("value", value))
        }
        out = []
        for name, x in (("key", key), ("value", value)):
            var = cached[name]
            updated = jax.lax.dynamic_update_slice(
                var.value, x.astype(var.value.dtype), (0, decoding.index, 0, 0)
            )
            var.value = constrain(updated, self.axes)
            out.append(var.value)
        return out[0], out[1]


ATTENTION_IMPLEMENTATIONS = ("xla", "jax", "chunked")


def check_options(config: Any) -> None:
    """The checks every family config shares (called from its `__post_init__`, so a bad
    value fails before any device work): attention, activation and remat choices."""
    attention = getattr(config, "attention", "xla")
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention {attention!r}: expected one of {ATTENTION_IMPLEMENTATIONS}.")
    if getattr(config, "attention_chunk_size", 1) < 1:
        raise ValueError(
            f"attention_chunk_size must be positive, got {config.attention_chunk_size}."
        )
    activation = getattr(config, "activation", None)
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: expected one of {sorted(ACTIVATIONS)}.")
    remat = getattr(config, "remat_policy", "none")
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat_policy {remat!r}: expected one of {sorted(REMAT_POLICIES)}.")


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Mask | Array | None = None,
    *,
    bias: Array | None = None,
    scale: float | None = None,
    dtype: Dtype = jnp.float32,
    implementation: str = "xla",
    chunk_size: int = 512,
) -> Array:
    """Softmax attention in float32; grouped-query when key has fewer heads than query.

    query: [batch, q_len, heads, head_dim]; key, value: [batch, kv_len, kv_heads, head_dim];
    mask: a `Mask` or bool broadcastable to [batch, heads, q_len, kv_len]; bias: added to
    the scaled scores, broadcastable to [batch, heads, q_len, kv_len] (T5's relative
    positions); scale: default head_dim**-0.5 (T5 uses 1.0). Returns [batch, q_len, heads,
    head_dim] in `dtype`.

    implementation: 'xla' (einsums, the default), 'jax' (`jax.nn.dot_product_attention`:
    cuDNN flash attention on GPU where it applies, XLA elsewhere) or 'chunked' (blocks of
    `chunk_size` queries and keys with an online softmax: memory linear in the length).
    """
    if implementation == "chunked":
        return _chunked_attention(query, key, value, mask, bias, scale, dtype, chunk_size)
    if isinstance(mask, Mask):
        mask = mask.dense()
    if implementation == "jax":
        return _jax_attention(query, key, value, mask, bias, scale, dtype)
    if implementation != "xla":
        raise ValueError(
            f"attention implementation {implementation!r}: expected one of "
            f"{ATTENTION_IMPLEMENTATIONS}."
        )
    b, q_len, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    groups = heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    q = query.reshape(b, q_len, kv_heads, groups, head_dim)
    # [batch, kv_heads, groups, q_len, kv_len]
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, key, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32) * scale
    if bias is not None:
        bias = jnp.broadcast_to(bias.astype(jnp.float32), (b, heads, q_len, key.shape[1]))
        scores = scores + bias.reshape(b, kv_heads, groups, q_len, key.shape[1])
    if mask is not None:
        mask = jnp.broadcast_to(mask, (b, heads, q_len, key.shape[1]))
        mask = mask.reshape(b, kv_heads, groups, q_len, key.shape[1])
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(as_dtype(dtype))
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, value.astype(as_dtype(dtype)))
    return out.reshape(b, q_len, heads, head_dim)


def _jax_attention(query, key, value, mask, bias, scale, dtype) -> Array:
    dtype = as_dtype(dtype)
    b, q_len, heads, _ = query.shape
    kv_len = key.shape[1]
    if mask is not None:
        mask = jnp.broadcast_to(mask, (b, heads, q_len, kv_len))
    if bias is not None:
        bias = jnp.broadcast_to(bias, (b, heads, q_len, kv_len)).astype(dtype)
    return jax.nn.dot_product_attention(
        query.astype(dtype),
        key.astype(dtype),
        value.astype(dtype),
        bias=bias,
        mask=mask,
        scale=scale,
    )


def _chunked_attention(query, key, value, mask, bias, scale, dtype, chunk_size) -> Array:
    """Flash-attention-style blocks: for each block of queries, scan over blocks of keys
    keeping the running max, normaliser and weighted sum in float32."""
    dtype = as_dtype(dtype)
    b, q_len, heads, head_dim = query.shape
    kv_len, kv_heads = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    qc, kc = min(chunk_size, q_len), min(chunk_size, kv_len)
    q_blocks, k_blocks = -(-q_len // qc), -(-kv_len // kc)

    def pad(x: Array, size: int, axis: int) -> Array:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, size - x.shape[axis])
        return jnp.pad(x, widths)

    q = pad(query, q_blocks * qc, 1).reshape(b, q_blocks * qc, kv_heads, groups, head_dim)
    k = pad(key, k_blocks * kc, 1)
    v = pad(value.astype(dtype), k_blocks * kc, 1)
    if bias is not None:
        bias = jnp.broadcast_to(bias.astype(jnp.float32), (b, heads, q_len, kv_len))
        bias = pad(pad(bias, q_blocks * qc, 2), k_blocks * kc, 3)
    dense_mask = None
    if mask is not None and not isinstance(mask, Mask):
        dense_mask = jnp.broadcast_to(mask, (b, heads, q_len, kv_len))
        dense_mask = pad(pad(dense_mask, q_blocks * qc, 2), k_blocks * kc, 3)
    neg = jnp.finfo(jnp.float32).min

    def query_block(qi: Array) -> Array:
        q_blk = jax.lax.dynamic_slice_in_dim(q, qi * qc, qc, axis=1)

        def key_block(carry, ki):
            m, norm, acc = carry
            k_blk = jax.lax.dynamic_slice_in_dim(k, ki * kc, kc, axis=1)
            v_blk = jax.lax.dynamic_slice_in_dim(v, ki * kc, kc, axis=1)
            s = jnp.einsum("bqhgd,bkhd->bhgqk", q_blk, k_blk, preferred_element_type=jnp.float32)
            s = s.astype(jnp.float32) * scale
            if bias is not None:
                blk = jax.lax.dynamic_slice(bias, (0, 0, qi * qc, ki * kc), (b, heads, qc, kc))
                s = s + blk.reshape(b, kv_heads, groups, qc, kc)
            if isinstance(mask, Mask):
                keep = jnp.broadcast_to(mask.block(qi * qc, qc, ki * kc, kc), (b, heads, qc, kc))
            elif dense_mask is not None:
                keep = jax.lax.dynamic_slice(
                    dense_mask, (0, 0, qi * qc, ki * kc), (b, heads, qc, kc)
                )
            else:
                keep = jnp.broadcast_to((ki * kc + jnp.arange(kc)) < kv_len, (b, heads, qc, kc))
            keep = keep.reshape(b, kv_heads, groups, qc, kc)
            s = jnp.where(keep, s, neg)
            m_new = jnp.maximum(m, s.max(-1))
            correction = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            norm_new = norm * correction + p.sum(-1)
            acc = acc * correction[..., None] + jnp.einsum(
                "bhgqk,bkhd->bhgqd", p.astype(dtype), v_blk, preferred_element_type=jnp.float32
            )
            return (m_new, norm_new, acc), None

        init = (
            jnp.full((b, kv_heads, groups, qc), neg, jnp.float32),
            jnp.zeros((b, kv_heads, groups, qc), jnp.float32),
            jnp.zeros((b, kv_heads, groups, qc, head_dim), jnp.float32),
        )
        (_, norm, acc), _ = jax.lax.scan(key_block, init, jnp.arange(k_blocks))
        out = acc / norm[..., None]  # [b, kv_heads, groups, qc, head_dim]
        return out.transpose(0, 3, 1, 2, 4).reshape(b, qc, heads, head_dim)

    blocks = jax.lax.map(query_block, jnp.arange(q_blocks))  # [q_blocks, b, qc, heads, hd]
    out = blocks.transpose(1, 0, 2, 3, 4).reshape(b, q_blocks * qc, heads, head_dim)
    return out[:, :q_len].astype(dtype)


# ---------------------------------------------------------------------------- remat

REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Keep only the two sublayer outputs (tagged with checkpoint_name in each block).
    "minimal": jax.checkpoint_policies.save_only_these_names("attn_out", "mlp_out"),
}


def kv_heads_axis(num_kv_heads: int) -> str | None:
    """Logical name of the key/value heads axis; one shared head (MQA) is never split."""
    return "kv_heads" if num_kv_heads > 1 else None


def rotary_self_attention(
    h: Array,
    sin: Array,
    cos: Array,
    mask: Mask | Array,
    decoding: Decoding | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    use_bias: bool,
    attention: str,
    chunk_size: int,
    dtype: Dtype,
    param_dtype: Dtype,
) -> Array:
    """Llama-style attention, built inside the calling block's scope (`q_proj`, `k_proj`,
    `v_proj`, `o_proj`, `cache`): rotary (half-split) queries and keys, grouped-query heads.

    h: [batch, length, embed] -> [batch, length, embed], tagged `attn_out` for remat.
    """
    dense = dict(dtype=dtype, param_dtype=param_dtype, use_bias=use_bias)
    kv_axis = kv_heads_axis(num_kv_heads)
    q, k, v = parallel_dense(
        h,
        [
            DenseGeneral(
                (num_heads, head_dim), ("embed", "heads", "head_dim"), name="q_proj", **dense
            ),
            *(
                DenseGeneral(
                    (num_kv_heads, head_dim), ("embed", kv_axis, "head_dim"), name=n, **dense
                )
                for n in ("k_proj", "v_proj")
            ),
        ],
    )
    kv_axes = ("batch", "length", kv_axis, "head_dim")
    q = constrain(apply_rotary(q, sin, cos, interleaved=False), HEAD_AXES)
    k = constrain(apply_rotary(k, sin, cos, interleaved=False), kv_axes)
    k, v = KVCache(kv_axes, name="cache")(k, v, decoding)
    attn = dot_product_attention(
        q, k, v, mask, dtype=dtype, implementation=attention, chunk_size=chunk_size
    )
    attn = DenseGeneral(
        hidden_size, ("heads", "head_dim", "embed"), axis=(-2, -1), name="o_proj", **dense
    )(attn)
    return checkpoint_name(attn, "attn_out")


def gated_mlp(
    h: Array,
    *,
    intermediate_size: int,
    hidden_size: int,
    activation: str,
    use_bias: bool,
    dtype: Dtype,
    param_dtype: Dtype,
) -> Array:
    """`down_proj(act(gate_proj(h)) * up_proj(h))` in the calling block's scope (SwiGLU,
    GeGLU); tagged `mlp_out` for remat."""
    dense = dict(dtype=dtype, param_dtype=param_dtype, use_bias=use_bias)
    gate, up = parallel_dense(
        h,
        [
            DenseGeneral(intermediate_size, ("embed", "mlp"), name=n, **dense)
            for n in ("gate_proj", "up_proj")
        ],
    )
    m = constrain(ACTIVATIONS[activation](gate) * up, ("batch", "length", "mlp"))
    m = DenseGeneral(hidden_size, ("mlp", "embed"), name="down_proj", **dense)(m)
    return checkpoint_name(m, "mlp_out")


def remat_block(block_cls: type[nn.Module], policy: str, static_argnums: tuple[int, ...] = ()):
    """`block_cls` wrapped in `nn.remat` with the named policy ('none' returns it as is)."""
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={policy!r}: expected one of {sorted(REMAT_POLICIES)}.")
    if policy == "none":
        return block_cls
    return nn.remat(
        block_cls,
        policy=REMAT_POLICIES[policy],
        prevent_cse=True,
        static_argnums=static_argnums,
    )


def stack_blocks(
    block_cls: type[nn.Module],
    num_layers: int,
    *,
    scan_layers: bool,
    remat_policy: str,
    name: str = "layers",
    layer_index: bool = False,
    **block_kwargs: Any,
) -> Callable[..., Any]:
    """Applies `num_layers` blocks `(x, *args) -> x`, scanned (params gain a `layers` axis)
    or unrolled (`layers_0`, `layers_1`, ...). Returns a callable `(x, *args) -> x`.

    layer_index: call the blocks as `(x, index, *args)`, index an int32 scalar counting
    from 0 (traced when scanned, so blocks must use it arithmetically, not in Python `if`s).
    """
    block = remat_block(block_cls, remat_policy)
    if scan_layers:

        class _ScanBody(nn.Module):
            @nn.compact
            def __call__(self, x: Array, index: Array, args: tuple) -> tuple[Array, None]:
                b = block(**block_kwargs, name="block")
                return (b(x, index, *args) if layer_index else b(x, *args)), None

        # The index differs per layer, so it is scanned over; the other arguments are shared.
        scanned = nn.scan(
            _ScanBody,
            variable_axes={"params": 0, "cache": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(0, nn.broadcast),
            length=num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(name=name)
        indices = jnp.arange(num_layers, dtype=jnp.int32)
        return lambda x, *args: scanned(x, indices, args)[0]

    blocks = [block(**block_kwargs, name=f"{name}_{i}") for i in range(num_layers)]

    def apply(x: Array, *args: Any) -> Array:
        for i, b in enumerate(blocks):
            # An array, as when scanned, so a block behaves the same either way.
            x = b(x, jnp.asarray(i, jnp.int32), *args) if layer_index else b(x, *args)
        return x

    return apply
