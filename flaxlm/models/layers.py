"""Shared, logically-annotated building blocks: dense, embed, norms, activations, MLPs, remat
policies (`stacks.py` applies blocks with them).

Every parameter carries logical axis names (`nn.with_logical_partitioning`); activations are
pinned with `nn.with_logical_constraint`. Nothing here knows a mesh.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from flaxlm.models import context_parallel

Array = jax.Array
Dtype = Any
Initializer = Callable[..., Array]

# Activations are pinned at block boundaries with these logical names.
ACTIVATION_AXES = ("batch", "length", "embed")
HEAD_AXES = ("batch", "length", "heads", "head_dim")
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The named scopes of a train step's outer loops, the microbatches' and the scanned layers'.
# The planner prices these from calibration compiles, so it counts their bodies once; every
# other loop (a chunked scan inside a layer) it counts as many times as it runs (`plan.flops`).
MICROBATCH_LOOP = "microbatches"
LAYER_LOOP = "scanned_layers"


def nvidia_gpu(device: Any) -> bool:
    """Whether `device` (attached, or a mesh's abstract one) is an NVIDIA GPU."""
    return device.platform in ("gpu", "cuda")


def gpu_without_one(device: Any) -> bool:
    """Whether `device` is an NVIDIA GPU compiled for from a host without one (the planner's
    programs), where what needs the GPU's libraries (cuDNN) cannot be built."""
    return nvidia_gpu(device) and jax.default_backend() != "gpu"


def target_device() -> Any:
    """The device a computation is compiled for: the abstract device of the mesh in JAX's
    context (a slice or a cluster compiled for ahead of time from another host included),
    else JAX's default device. The experts' kernels and dispatch choose by it, not by
    `jax.default_backend()`: the planner compiles for GPUs from a host of CPUs (where
    attention's 'auto' has no cuDNN to build and takes a stand-in, `attention.auto_choice`)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return jax.devices()[0] if device is None else device


def as_dtype(dtype: Dtype) -> jnp.dtype:
    """Accepts 'bfloat16', jnp.bfloat16, ... (Gin binds strings)."""
    return jnp.dtype(dtype)


def constrain(x: Array, axes: Sequence[str | None]) -> Array:
    return nn.with_logical_constraint(x, tuple(axes))


def dot_general(x: Array, w: Array, dims: Any, out_dtype: Dtype | None = None) -> Array:
    """`jax.lax.dot_general(x, w, dims)`, its result in `out_dtype` (default: the operands').

    A wider `out_dtype` (float32 logits from a bfloat16 head) is accumulated and written in
    that dtype, while the gradients stay dots in the operands' dtype, as autodiff of the
    plain dot gives. (Autodiff of `preferred_element_type=float32` would upcast both operands
    of the two gradient dots to float32: TF32 on an NVIDIA GPU at half the bfloat16 rate.)
    """
    compute = jnp.result_type(x, w)
    if out_dtype is None or as_dtype(out_dtype) == compute:
        return jax.lax.dot_general(x, w, dims)
    return _wide_dot(x, w, dims, as_dtype(out_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _wide_dot(x: Array, w: Array, dims: Any, out_dtype: jnp.dtype) -> Array:
    return jax.lax.dot_general(x, w, dims, preferred_element_type=out_dtype)


def _wide_dot_fwd(x: Array, w: Array, dims: Any, out_dtype: jnp.dtype) -> tuple[Array, Any]:
    return _wide_dot(x, w, dims, out_dtype), (x, w)


def _wide_dot_bwd(dims: Any, out_dtype: jnp.dtype, res: Any, g: Array) -> tuple[Array, Array]:
    x, w = res
    g = g.astype(jnp.result_type(x, w))
    (dx,) = jax.linear_transpose(lambda a: jax.lax.dot_general(a, w, dims), x)(g)
    (dw,) = jax.linear_transpose(lambda b: jax.lax.dot_general(x, b, dims), w)(g)
    return dx, dw


_wide_dot.defvjp(_wide_dot_fwd, _wide_dot_bwd)


def contract(
    x: Array, w: Array, axis: Sequence[int], w_start: int = 0, out_dtype: Dtype | None = None
) -> Array:
    """`x`'s dims `axis` contracted with `w`'s dims `w_start : w_start + len(axis)`; the
    result has `x`'s other dims, `w`'s first `w_start` dims, then `w`'s output dims.

    Same values as that `dot_general`; the point is the HLO. `w`'s output dims are flattened
    into one for the product, so a weight gradient such as q/k/v's stacked
    `[3, embed, heads, head_dim]` is computed as `[3, embed, heads * head_dim]`, which XLA's
    TPU pipeline turns into an FSDP reduce-scatter; the rank-4 one stayed an all-reduce of the
    whole gradient and a slice. (Flattening the contracted dims too changed nothing there and
    cost ~1.5% of a CPU train step.) `out_dtype`: as `dot_general`'s.
    """
    axis = tuple(a % x.ndim for a in axis)
    n = len(axis)
    out = w.shape[w_start + n :]
    w = w.reshape(*w.shape[: w_start + n], int(np.prod(out, dtype=np.int64)))
    y = dot_general(x, w, ((axis, tuple(range(w_start, w_start + n))), ((), ())), out_dtype)
    return y.reshape(*y.shape[:-1], *out)


class DenseGeneral(nn.Module):
    """A dense layer over the trailing `len(axis)` dims with logically named kernel axes.

    `kernel_axes` names the input dims followed by the output dims, e.g.
    `('embed', 'heads', 'head_dim')` for a query projection to `features=(heads, head_dim)`.

    When the params hold low-rank adapters beside the kernel (`lora_a`: in dims + [rank],
    already scaled; `lora_b`: [rank] + out dims; put there by `flaxlm.training.lora`), the layer
    adds `(dropout(x) A) B` to its output (`adapt`); the model's own init never creates them.
    """

    features: int | tuple[int, ...]
    kernel_axes: tuple[str, ...]
    axis: int | tuple[int, ...] = -1
    use_bias: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    kernel_init: Initializer = nn.initializers.normal(0.02)
    out_dtype: Dtype | None = None  # a wider result than `dtype` (`dot_general`'s)

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
        out_dtype = self.out_dtype
        vector = x.size == np.prod([x.shape[a] for a in axis])  # one row: a matrix-vector product
        if out_dtype is None and vector and dtype in HALF_DTYPES and decoding_products_on():
            out_dtype = jnp.float32  # `decoding_products`: cast back below
        y = contract(x.astype(dtype), kernel.astype(dtype), axis, out_dtype=out_dtype)
        if self.out_dtype is None:
            y = y.astype(dtype)
        if bias is not None:
            y = y + bias.astype(y.dtype)
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


def with_lora(module: nn.Module, name: str, w: Array) -> Array:
    """Param `w` (`[stack, in, out...]`, e.g. the experts' `[expert, embed, 2, mlp]`) plus
    its low-rank update when the params hold adapters `{name}_lora_a` `[stack, in, r]` and
    `{name}_lora_b` `[stack, r, out...]` beside it (one pair per leading index: per expert);
    `w` unchanged otherwise. The update is built weight-sized (the stacked weights feed a
    grouped matmul), so LoRA dropout does not apply to it."""
    if not module.has_variable("params", f"{name}_lora_a"):
        return w
    a = module.get_variable("params", f"{name}_lora_a").astype(jnp.float32)
    b = module.get_variable("params", f"{name}_lora_b").astype(jnp.float32)
    stack, rank = a.shape[0], a.shape[-1]
    update = jnp.einsum(
        "sir,sro->sio", a.reshape(stack, -1, rank), b.reshape(stack, rank, -1)
    ).reshape(w.shape)
    return (w.astype(jnp.float32) + update).astype(w.dtype)


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


# Set in the thread that traces a decoding step (`decoding_products`; per thread, as a
# server's engine may trace while a trainer's thread traces its step).
_DECODING_PRODUCTS = threading.local()


@contextlib.contextmanager
def decoding_products() -> Iterator[None]:
    """Within this context the dense layers compute as a decoding step reads its weights
    best (the decoding methods, `cached_decoding` and the encoder-decoder's, trace under it):

    - `parallel_dense` stacks no kernels, one product per projection. What the stack buys,
      one all-reduce of the input gradient under tensor parallelism, a forward-only trace
      never uses; what it costs, a copy of the group's kernels made at every call, it paid at
      every token (XLA did not hoist it out of the decoding loop): each step read the gated
      MLP's gate and up kernels twice and wrote them once (benchmarks/HISTORY.md,
      "Seventeenth session").
    - A `DenseGeneral` in bfloat16 or float16 of one row (batch 1: a matrix-vector product)
      takes its product in float32 and casts it. XLA:GPU computes a matrix-vector product
      as a multiply and a reduction; asked for a half-precision result it did not fuse them
      and wrote the weight-sized product between them (3x the weight's bytes for
      Llama-3.2-1B's q and o projections, read off the H100's compiled program); in float32
      it fuses them. Two rows or more are matmuls either way (float32 would only widen
      their output)."""
    before = getattr(_DECODING_PRODUCTS, "on", False)
    _DECODING_PRODUCTS.on = True
    try:
        yield
    finally:
        _DECODING_PRODUCTS.on = before


def decoding_products_on() -> bool:
    """Whether this thread traces under `decoding_products`."""
    return getattr(_DECODING_PRODUCTS, "on", False)


def parallel_dense(x: Array, projections: Sequence[DenseGeneral]) -> list[Array]:
    """`[p(x) for p in projections]`, with one matmul for each group of projections whose
    kernels have equal shapes and axes: their kernels are stacked on a new leading dim (local
    under any sharding) and contracted with `x` once; one product per projection within
    `decoding_products` (decoding).

    This is Megatron's fused QKV without changing the params (still one kernel per
    projection, as in HF checkpoints): under tensor parallelism the input gradient of a group
    is one partial sum over the sharded output dims, all-reduced once, instead of once per
    projection.
    """
    if decoding_products_on():
        return [p(x) for p in projections]
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
        # [batch, length] -> [batch, length, embed]. Under context parallelism the table is
        # gathered whole over `embed` first (as FSDP gathers every kernel it uses): XLA cannot
        # otherwise take a lookup split on `embed` to activations split on `batch` and
        # `length` but by replicating it.
        table = self.embedding
        if context_parallel.sequence_shards() > 1:
            table = constrain(table, ("vocab", None))
        return jnp.take(table, ids, axis=0).astype(as_dtype(self.dtype))

    def attend(self, x: Array, out_dtype: Dtype | None = None) -> Array:
        """Tied-head logits computed in the module's dtype, returned in `out_dtype` (default:
        that dtype; a wider one is accumulated in it, `dot_general`).

        [batch, length, embed] x [vocab, embed] -> [batch, length, vocab]
        """
        dtype = as_dtype(self.dtype)
        dims = (((x.ndim - 1,), (1,)), ((), ()))
        return dot_general(x.astype(dtype), self.embedding.astype(dtype), dims, out_dtype)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, computed in float32 whatever the compute dtype; its scale
    and bias span the last `len(axes)` dims (Cohere's per-head q/k norms: a scale per head)."""

    epsilon: float = 1e-5
    use_bias: bool = True
    use_scale: bool = True  # False with use_bias=False: no params (torch's elementwise_affine)
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    axes: tuple[str | None, ...] = ("embed",)  # the logical axes of the scale and bias

    @nn.compact
    def __call__(self, x: Array) -> Array:
        shape = x.shape[-len(self.axes) :]
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        if self.use_scale:
            scale = self.param(
                "scale",
                nn.with_logical_partitioning(nn.initializers.ones, self.axes),
                shape,
                as_dtype(self.param_dtype),
            )
            y = y * scale.astype(jnp.float32)
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, self.axes),
                shape,
                as_dtype(self.param_dtype),
            )
            y = y + bias.astype(jnp.float32)
        return y.astype(as_dtype(self.dtype))


class RMSNorm(nn.Module):
    """RMS normalisation in float32 (Llama, T5, Gemma): no mean, no bias, over the last
    `len(axes)` dims (OLMoE's q/k norms: all heads' features at once).

    `scale_plus_one` multiplies by `1 + scale` with the param initialised at zero (Gemma).
    """

    epsilon: float = 1e-6
    scale_plus_one: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    axes: tuple[str, ...] = ("embed",)  # the scale's logical axes (per-head norms: head_dim)

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.zeros if self.scale_plus_one else nn.initializers.ones
        dims = tuple(range(-len(self.axes), 0))
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(init, self.axes),
            x.shape[-len(self.axes) :],
            as_dtype(self.param_dtype),
        )
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(dims, keepdims=True) + self.epsilon)
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


# ---------------------------------------------------------------------------- remat

REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Keep only the two sublayer outputs (tagged with checkpoint_name in each block).
    "minimal": jax.checkpoint_policies.save_only_these_names("attn_out", "mlp_out"),
}


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


def kv_heads_axis(num_kv_heads: int) -> str | None:
    """Logical name of the key/value heads axis; one shared head (MQA) is never split."""
    return "kv_heads" if num_kv_heads > 1 else None


def qkv_projections(
    h: Array,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_width: int | None = None,
    v_width: int | None = None,
    **dense: Any,
) -> tuple[Array, Array, Array]:
    """Queries `[..., num_heads, q_width]`, keys and values `[..., num_kv_heads, head_dim |
    v_width]` from `h` in one pass (`q_proj`, `k_proj`, `v_proj` in the caller's scope;
    `dense`: DenseGeneral's dtype, param_dtype, use_bias)."""
    kv_axis = kv_heads_axis(num_kv_heads)
    q_axes, kv_axes = ("embed", "heads", "head_dim"), ("embed", kv_axis, "head_dim")
    projections = [DenseGeneral((num_heads, q_width or head_dim), q_axes, name="q_proj", **dense)]
    for name, width in (("k_proj", head_dim), ("v_proj", v_width or head_dim)):
        projections.append(DenseGeneral((num_kv_heads, width), kv_axes, name=name, **dense))
    q, k, v = parallel_dense(h, projections)
    return q, k, v
