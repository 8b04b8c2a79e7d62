"""Attention: positions (rotary, ALiBi), the KV cache, `dot_product_attention` (xla / jax /
chunked, whose kernels are `xla_attention.py` and `chunked_attention.py`; soft-capping,
attention sinks) and the rotary self-attention block; the masks live in `masks.py` and are
re-exported here.

Nothing here knows a mesh: activations carry logical axis names only.
"""

from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from flaxlm.models import context_parallel as cp
from flaxlm.models.chunked_attention import chunked_attention
from flaxlm.models.grouped_matmul import hopper
from flaxlm.models.layers import (
    HALF_DTYPES,
    HEAD_AXES,
    DenseGeneral,
    Dtype,
    LayerNorm,
    RMSNorm,
    as_dtype,
    constrain,
    gpu_without_one,
    kv_heads_axis,
    nvidia_gpu,
    qkv_projections,
    target_device,
)
from flaxlm.models.masks import Decoding, Mask, paged_mask, plain_causal, whole_self_attention
from flaxlm.models.paged_attention import (
    gather_pages,
    kernel_attention,
    use_kernel,
    write_pages,
)
from flaxlm.models.xla_attention import xla_attention

Array = jax.Array


# ---------------------------------------------------------------------------- rotary


def rotary_inv_freq(dim: int, theta: float = 10000.0) -> np.ndarray:
    """float32 inverse frequencies `[dim // 2]` of rotary embeddings over `dim` features."""
    return (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(np.float32)


def rotary_sin_cos(positions: Array, inv_freq: np.ndarray) -> tuple[Array, Array]:
    """sin/cos tables `[batch, length, len(inv_freq)]` in float32 for integer positions."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
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


# ---------------------------------------------------------------------------- attention


def write_cache(module: nn.Module, name: str, x: Array, decoding: Decoding, axes: tuple) -> Array:
    """`x` `[batch, q_len, X, width]` written at `decoding.index` into `module`'s cache
    variable `name`, held head-major, `[batch, X, slots, width]` (values, `name` "value":
    `[batch, X, width, slots]`), and the whole cache returned as `[batch, slots, X, width]`:
    a transposed view that XLA folds into the attention's dots. So held, each head's slots
    are an operand a batched matmul over (batch, head) reads in place, the keys' (scores:
    contracted over width) and, slots last, the values' (the output: contracted over slots)
    alike; held slot-major, XLA copies the whole cache into such a layout for every decoding
    step. `decoding.cache_length` reads the slots off the other arrays."""
    # The held layout as a permutation of `[batch, slots, X, width]`.
    order = (0, 2, 3, 1) if name == "value" else (0, 2, 1, 3)
    full = (x.shape[0], decoding.length, *x.shape[2:])
    var = module.variable("cache", name, jnp.zeros, tuple(full[i] for i in order), x.dtype)
    new = jnp.transpose(x, order).astype(var.value.dtype)
    start = tuple((0, decoding.index, 0, 0)[i] for i in order)
    updated = jax.lax.dynamic_update_slice(var.value, new, start)
    var.value = constrain(updated, tuple(axes[i] for i in order))
    return jnp.transpose(var.value, tuple(order.index(i) for i in range(4)))


class KVCache(nn.Module):
    """Keys and values of the tokens decoded so far (Flax collection `cache`).

    Outside decoding it returns its inputs. While decoding it writes the new keys and
    values at `decoding.index` (held `[batch, heads, cache_len, head_dim]` and `[batch,
    heads, head_dim, cache_len]`: `write_cache`) and returns the whole cache `[batch,
    cache_len, heads, head_dim]` (what `causal_mask` masks). Paged, it writes them into
    their pages of the pools (`paged_attention.write_pages`) and returns each row's pages
    gathered, or with `pools` the pools themselves (for `paged_attention.kernel_attention`).
    """

    axes: tuple[str | None, ...] = HEAD_AXES

    @nn.compact
    def __call__(
        self, key: Array, value: Array, decoding: Decoding | None, pools: bool = False
    ) -> tuple[Array, Array]:
        if decoding is None:
            return key, value
        if decoding.paged:
            out = [
                write_pages(self, name, x, decoding, self.axes)
                for name, x in (("key", key), ("value", value))
            ]
            if not pools:
                out = [gather_pages(pool, decoding, self.axes) for pool in out]
            return out[0], out[1]
        return (
            write_cache(self, "key", key, decoding, self.axes),
            write_cache(self, "value", value, decoding, self.axes),
        )


ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "jax", "chunked")
CUDNN_DTYPES = HALF_DTYPES  # what cuDNN's flash attention computes in
# The named scope of 'chunked' attention standing in for cuDNN's (`auto_choice`): the planner
# prices its loops as cuDNN's one kernel, not XLA's per block (`plan.flops.kernel_loop_runs`).
CUDNN_STAND_IN = "cudnn_stand_in"


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Mask | Array | None = None,
    *,
    bias: Array | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    dtype: Dtype = jnp.float32,
    implementation: str = "auto",
    chunk_size: int = 512,
    context_parallel: str = "ring",
    sinks: Array | None = None,
) -> Array:
    """Softmax attention in float32; grouped-query when key has fewer heads than query.

    query: [batch, q_len, heads, head_dim]; key, value: [batch, kv_len, kv_heads, head_dim];
    mask: a `Mask` or bool broadcastable to [batch, heads, q_len, kv_len]; bias: added to
    the scaled scores, broadcastable to [batch, heads, q_len, kv_len] (T5's relative
    positions); scale: default head_dim**-0.5 (T5 uses 1.0); softcap: scaled scores become
    `softcap * tanh(scores / softcap)` (Gemma 2); sinks: float [heads], a logit per head
    that joins each row's softmax and is then dropped (gpt-oss's attention sinks; 'jax'
    cannot take them, 'auto' runs 'xla'). Returns [batch, q_len, heads, head_dim] in `dtype`.

    implementation: 'auto' (the default: 'jax' where cuDNN computes it, `auto_choice`,
    else 'xla'), 'xla' (einsums with a flash-style backward), 'jax'
    (`jax.nn.dot_product_attention`: cuDNN flash attention on GPU where it applies, XLA
    elsewhere) or 'chunked' (blocks of `chunk_size` queries and keys with an online
    softmax: memory linear in the length, in training too: whole-sequence self-attention
    under a `Mask` goes to `context_parallel.attention`, whose custom VJP recomputes each
    block's scores; other masks and a bias take `chunked_attention.chunked_attention`, whose
    backward is JAX's own).

    context_parallel: how self-attention over a sequence split on the mesh's `sequence` axis
    gathers the other shards' keys: 'ring' or 'all_gather' (`context_parallel.attention`,
    blocks of `chunk_size` whatever the implementation). Decoding, cross-attention and a
    `bias` keep the kernels above.
    """
    check_implementation(implementation, softcap, sinks is not None)
    if implementation == "auto":
        implementation = "xla" if sinks is not None else auto_choice(mask, bias, softcap, dtype)
        if implementation == "chunked" and not cudnn_head_dim(query.shape[-1]):
            implementation = "xla"  # cuDNN would decline it: the GPU runs XLA's attention
        if implementation == "chunked":  # cuDNN's stand-in (`auto_choice`), named for the planner
            with jax.named_scope(CUDNN_STAND_IN):
                return dot_product_attention(
                    query, key, value, mask, scale=scale, dtype=dtype, chunk_size=chunk_size,
                    context_parallel=context_parallel, implementation="chunked",
                )  # fmt: skip
    if cp.applies(mask, bias) or (implementation == "chunked" and cp.whole_sequence(mask, bias)):
        return cp.attention(
            query,
            key,
            value,
            mask,
            scale=scale,
            softcap=softcap,
            dtype=as_dtype(dtype),
            chunk_size=chunk_size,
            strategy=context_parallel,
            sinks=sinks,
        )
    if implementation == "chunked":
        return chunked_attention(
            query, key, value, mask, bias, scale, softcap, as_dtype(dtype), chunk_size, sinks
        )
    if implementation == "jax":
        return _jax_attention(query, key, value, mask, bias, scale, dtype)
    if isinstance(mask, Mask):
        mask = mask.dense()
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return xla_attention(query, key, value, mask, bias, scale, softcap, as_dtype(dtype), sinks)


def auto_choice(
    mask: Mask | Array | None, bias: Array | None, softcap: float | None, dtype: Dtype
) -> str:
    """What 'auto' runs: 'jax' (cuDNN's flash attention) on an NVIDIA GPU for self-attention
    over a whole sequence (`whole_self_attention`: plain causal, told `is_causal`; packed or
    padded, given the dense mask) in bfloat16 or float16 without a bias or soft cap, 'xla'
    otherwise (decoding, cross-attention, CPU, TPU). On one H200 the Llama-3.2-1B step (L2048,
    the gin's remat) took 525 ms with `is_causal` against 1203 with 'xla'; cuDNN given a dense
    mask took 754 against 'xla''s 1308 at an earlier commit, and fit 8192 where 'xla' did not
    (benchmarks/HISTORY.md). Where cuDNN cannot be built (`layers.gpu_without_one`: the
    planner), 'chunked' stands in: its blocks hold what cuDNN's would, not 'xla''s scores."""
    gpu = nvidia_gpu(target := target_device()) or jax.default_backend() == "gpu"
    if not gpu or bias is not None or softcap is not None:
        return "xla"
    if as_dtype(dtype) not in CUDNN_DTYPES or not whole_self_attention(mask):
        return "xla"
    return "chunked" if gpu_without_one(target) else "jax"


def cudnn_head_dim(head_dim: int) -> bool:
    """Whether cuDNN takes heads this wide: a multiple of 8, <= 256 from Hopper on, else 128."""
    return head_dim % 8 == 0 and head_dim <= (256 if hopper() else 128)


def check_implementation(
    implementation: str, softcap: float | None = None, sinks: bool = False
) -> None:
    """A ValueError naming what to change when `implementation` cannot compute the
    attention asked for (a config calls this when it is built)."""
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {implementation!r}: expected one of "
            f"{ATTENTION_IMPLEMENTATIONS}."
        )
    if softcap is not None and implementation == "jax":
        raise ValueError(
            "attention='jax' (jax.nn.dot_product_attention, cuDNN) cannot soft-cap the "
            "attention scores this model needs: choose attention='xla' or 'chunked'."
        )
    if sinks and implementation == "jax":
        raise ValueError(
            "attention='jax' (jax.nn.dot_product_attention, cuDNN) cannot add the attention "
            "sinks this model needs: choose attention='xla' or 'chunked'."
        )


def capped(scores: Array, softcap: float | None) -> Array:
    """`softcap * tanh(scores / softcap)` (Gemma 2's logit soft-capping), or `scores`."""
    if softcap is None:
        return scores
    return jnp.tanh(scores / softcap) * softcap


def jax_attention_mask(mask: Mask | Array | None) -> dict:
    """How `jax.nn.dot_product_attention` is told `mask`: `is_causal` (with
    `local_window_size` for a sliding window) when it is plain causal self-attention, which
    cuDNN computes without a mask tensor and skips the hidden blocks of; otherwise the dense
    bool `mask` (packed segments, padding, decoding offsets)."""
    if plain_causal(mask):
        window = mask.sliding_window
        local = None if window is None else (window - 1, 0)
        return {"is_causal": True, "local_window_size": local}
    return {"mask": mask.dense() if isinstance(mask, Mask) else mask}


# Why cuDNN was passed over, each said once (a warning, not an error: the XLA attention
# computes the same thing, slower).
_CUDNN_DECLINED: set[str] = set()


def _jax_attention(query, key, value, mask, bias, scale, dtype) -> Array:
    """`jax.nn.dot_product_attention`: on a GPU cuDNN's flash attention where it takes the
    shapes and dtype (bf16 or fp16; head dim a multiple of 8, at most 128, 256 from Hopper
    on), else (and on CPU and TPU) JAX's XLA implementation."""
    dtype = as_dtype(dtype)
    b, q_len, heads, _ = query.shape
    kv_len = key.shape[1]
    how = jax_attention_mask(mask)
    if how.get("mask") is not None:
        how["mask"] = jnp.broadcast_to(how["mask"], (b, heads, q_len, kv_len))
    if bias is not None:
        bias = jnp.broadcast_to(bias, (b, heads, q_len, kv_len)).astype(dtype)
    args = (query.astype(dtype), key.astype(dtype), value.astype(dtype))
    if jax.default_backend() == "gpu":
        if dtype not in CUDNN_DTYPES:
            reason = f"attention in {jnp.dtype(dtype).name} (cuDNN takes bfloat16 or float16)"
        else:
            try:
                return jax.nn.dot_product_attention(
                    *args, bias=bias, scale=scale, implementation="cudnn", **how
                )
            except (NotImplementedError, ValueError, RuntimeError) as e:
                reason = str(e).split("\n")[0]
        if reason not in _CUDNN_DECLINED and jax.process_index() == 0:
            _CUDNN_DECLINED.add(reason)
            print(f"attention='jax': no cuDNN ({reason}); XLA's attention.", file=sys.stderr)
    return jax.nn.dot_product_attention(*args, bias=bias, scale=scale, implementation="xla", **how)


def check_heads(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int | None) -> None:
    """ValueErrors naming the field for rotary grouped-query heads that cannot be: a width
    that heads do not divide (with no `head_dim`), query heads that key/value heads do not
    divide, an odd head width."""
    if head_dim is None and hidden_size % num_heads:
        raise ValueError(
            f"hidden_size {hidden_size} must be a multiple of num_heads {num_heads} "
            "(or set head_dim)."
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}."
        )
    width = head_dim or hidden_size // num_heads
    if width % 2:
        raise ValueError(f"head_dim {width} must be even for rotary embeddings.")


QK_NORMS = ("rms", "rms_plus_one", "rms_whole", "layer")


class AttentionSinks(nn.Module):
    """gpt-oss's attention sinks: a learned logit per query head (`logits` [heads]) that
    joins every row's softmax beside the keys and takes no value, so a head can give the
    keys less than all of its weight (`dot_product_attention(sinks=...)`)."""

    num_heads: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self) -> Array:
        init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("heads",))
        return self.param("logits", init, (self.num_heads,), as_dtype(self.param_dtype))


def pad_heads(x: Array, width: int) -> Array:
    """`x` [..., features] zero-padded to `width` features: zero query and key features add
    nothing to the scores, zero value features come out zero (and are cut off)."""
    if x.shape[-1] == width:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


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
    qkv_bias: bool,
    out_bias: bool,
    attention: str,
    chunk_size: int,
    dtype: Dtype,
    param_dtype: Dtype,
    qk_norm: str | None = None,
    norm_eps: float = 1e-6,
    scale: float | None = None,
    softcap: float | None = None,
    window: Array | None = None,
    context_parallel: str = "ring",
    clip_qkv: float | None = None,
    sinks: bool = False,
    output_gate: bool = False,
    query_scale: Array | None = None,
    rotary_interleaved: bool = False,
    v_head_dim: int | None = None,
    value_scale: float | None = None,
) -> Array:
    """Llama-style attention, built inside the calling block's scope (`q_proj`, `k_proj`,
    `v_proj`, `o_proj`, `cache`, `sinks`): rotary (half-split) queries and keys,
    grouped-query heads; `qkv_bias` / `out_bias`: biases on the q, k, v / o projections. A
    `sin`/`cos` narrower than `head_dim / 2` rotates the first features of each head only
    (partial rotary).

    qk_norm: 'rms' (Qwen3) or 'rms_plus_one' (Gemma 3) normalises each query and key head
    (`q_norm`, `k_norm`, eps `norm_eps`) before rotary, 'layer' each head by a bias-free
    LayerNorm with a scale per head (Command R+), 'rms_whole' all heads at once (OLMoE,
    then q, k, v clipped to +-`clip_qkv` if set). scale: of the scores (default head_dim**-0.5);
    softcap: of the scaled scores (Gemma 2); window: this layer's sliding window
    (`layer_window`); context_parallel: see `dot_product_attention`; sinks: a learned
    sink logit per head (`AttentionSinks`, gpt-oss); output_gate: `q_proj` gives each head
    its query and then as many gates, and the head's output is multiplied by their sigmoid
    before `o_proj` (Qwen3-Next's gated attention); query_scale: `[batch, length]`, each
    query multiplied by it after rotary, in the queries' dtype as HF (Ministral 3's
    `rope.llama4_query_scale`); rotary_interleaved: rotary over pairs (0, 1), (2, 3), ...
    (ERNIE 4.5's) rather than half-split ones; v_head_dim: the values' width where it is
    not `head_dim` (MiMo-V2-Flash's 128 beside 192), cached at it, the narrower side
    zero-padded for the kernels (`pad_heads`); value_scale: the values multiplied by it after
    `v_proj`, in their dtype (MiMo-V2-Flash's `attention_value_scale`).

    h: [batch, length, embed] -> [batch, length, embed], tagged `attn_out` for remat.
    """
    kv_axis = kv_heads_axis(num_kv_heads)
    v_dim = v_head_dim or head_dim
    q, k, v = qkv_projections(
        h, num_heads, num_kv_heads, head_dim, head_dim * (1 + output_gate), v_dim,
        dtype=dtype, param_dtype=param_dtype, use_bias=qkv_bias,
    )  # fmt: skip
    kv_axes = ("batch", "length", kv_axis, "head_dim")
    if output_gate:
        q, gate = jnp.split(q, 2, axis=-1)
    if qk_norm is not None:
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {qk_norm!r}: expected None or one of {QK_NORMS}.")
        norm = dict(epsilon=norm_eps, dtype=dtype, param_dtype=param_dtype)
        # The norm, the first of its scale's axes (1: over head_dim) and its own options.
        cls, first, own = RMSNorm, int(qk_norm != "rms_whole"), {}
        own["scale_plus_one"] = qk_norm == "rms_plus_one"
        if qk_norm == "layer":  # Cohere's: mean-subtracted, no bias, a scale [heads, head_dim]
            cls, first, own = LayerNorm, 0, dict(use_bias=False)
        q = cls(name="q_norm", axes=("heads", "head_dim")[first:], **norm, **own)(q)
        k = cls(name="k_norm", axes=(kv_axis, "head_dim")[first:], **norm, **own)(k)
    if clip_qkv is not None:  # after the norms, as HF's OLMoE
        q, k, v = (jnp.clip(x, -clip_qkv, clip_qkv) for x in (q, k, v))
    if value_scale is not None:
        v = v * jnp.asarray(value_scale, v.dtype)
    q = apply_rotary(q, sin, cos, interleaved=rotary_interleaved)
    if query_scale is not None:
        q = q * query_scale[:, :, None, None].astype(q.dtype)
    q = constrain(q, HEAD_AXES)
    k = constrain(apply_rotary(k, sin, cos, interleaved=rotary_interleaved), kv_axes)
    if use_kernel(decoding, q, window=window, sinks=sinks, value_dim=v_dim):
        pools = KVCache(kv_axes, name="cache")(k, v, decoding, pools=True)
        attn = kernel_attention(q, *pools, decoding, scale=scale, softcap=softcap, dtype=dtype)
    else:
        k, v = KVCache(kv_axes, name="cache")(k, v, decoding)
        if isinstance(mask, Mask):
            mask = mask.within(window)
        elif window is not None and decoding is not None and decoding.paged:
            mask = mask & paged_mask(decoding, window)
        width = max(head_dim, v_dim)
        if scale is None and width != head_dim:  # the padded queries' width is not the heads'
            scale = head_dim**-0.5
        attn = dot_product_attention(
            pad_heads(q, width),
            pad_heads(k, width),
            pad_heads(v, width),
            mask,
            scale=scale,
            softcap=softcap,
            dtype=dtype,
            implementation=attention,
            chunk_size=chunk_size,
            context_parallel=context_parallel,
            sinks=AttentionSinks(num_heads, param_dtype, name="sinks")() if sinks else None,
        )[..., :v_dim]
    if output_gate:
        attn = attn * jax.nn.sigmoid(gate).astype(attn.dtype)
    attn = DenseGeneral(
        hidden_size,
        ("heads", "head_dim", "embed"),
        axis=(-2, -1),
        use_bias=out_bias,
        name="o_proj",
        dtype=dtype,
        param_dtype=param_dtype,
    )(attn)
    return checkpoint_name(attn, "attn_out")
