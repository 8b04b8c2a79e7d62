"""GPT-2: learned positions, pre-LN blocks with a fused qkv projection, gelu-new, tied head.

Follows HuggingFace's `GPT2LMHeadModel` (the PyTorch reference our logits must match). HF
stores GPT-2's projections as `Conv1D` weights, `[in, out]`, so they map without transposes.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from flaxlm.models import attention, layers, masks
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.causal_lm import CausalLM
from flaxlm.models.hf_spec import HFSpec, HFTensor, linear, register_hf
from flaxlm.models.options import ComputeOptions

Array = jax.Array


@gin.configurable
@dataclasses.dataclass(frozen=True)
class GPT2Config(ComputeOptions):
    """GPT-2 hyper-parameters (HF names where they exist) and compute options."""

    vocab_size: int = 50257
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 768  # HF: n_embd
    num_layers: int = 12  # HF: n_layer
    num_heads: int = 12  # HF: n_head
    intermediate_size: int | None = None  # HF: n_inner; 4 * hidden_size if None
    max_position_embeddings: int = 1024  # HF: n_positions
    layer_norm_epsilon: float = 1e-5
    activation: str = "gelu_new"  # HF: activation_function
    scale_attn_weights: bool = True  # scores / sqrt(head_dim); False: unscaled
    # Layer i (from 0) also divides its scores by i + 1 (a mixed-precision stabiliser).
    scale_attn_by_inverse_layer_idx: bool = False
    # HF computes the scores in float32 whatever the dtype (its eager attention only). Kept
    # so exports say the same; flaxlm's attention already takes them in float32 ('xla',
    # 'chunked'), so it changes nothing here.
    reorder_and_upcast_attn: bool = False
    tie_word_embeddings: bool = True  # the head reuses wte
    # 'learned' (GPT-2's wpe table) or 'alibi' (no table: a per-head linear bias on the
    # distance, Press et al. 2022, which extrapolates to longer sequences than trained).
    position_embedding: str = "learned"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.position_embedding not in ("learned", "alibi"):
            raise ValueError(
                f"position_embedding {self.position_embedding!r}: expected 'learned' or 'alibi'."
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_limit(self) -> int | None:
        """The longest sequence the model can read (ALiBi: no limit)."""
        return None if self.position_embedding == "alibi" else self.max_position_embeddings

    @property
    def position_table_size(self) -> int:
        return 0 if self.position_embedding == "alibi" else self.max_position_embeddings

    @property
    def mlp_dim(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates)."""
        e, f, n, v = self.hidden_size, self.mlp_dim, self.num_layers, self.vocab_size
        block = 4 * e * e + 4 * e + 2 * e * f + f + e + 4 * e
        total = v * e + self.position_table_size * e + n * block + 2 * e
        return total + (0 if self.tie_word_embeddings else v * e)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls (head included) plus attention scores."""
        matmul = self.num_params() - self.position_table_size * self.hidden_size
        if not self.tie_word_embeddings:
            matmul -= self.vocab_size * self.hidden_size  # the input lookup is not a matmul
        return 6.0 * matmul + 12.0 * self.num_layers * self.hidden_size * seq_len

    def make_module(self) -> GPT2:
        return GPT2(self)


class GPT2Attention(nn.Module):
    config: GPT2Config

    @nn.compact
    def __call__(
        self,
        x: Array,
        layer_index: Array,
        mask: Array,
        decoding: masks.Decoding | None = None,
        bias: Array | None = None,
    ) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        # One kernel for q, k and v, laid out as HF's c_attn: [embed, 3, heads, head_dim].
        qkv = layers.DenseGeneral(
            (3, cfg.num_heads, cfg.head_dim),
            ("embed", None, "heads", "head_dim"),
            use_bias=True,
            name="c_attn",
            **dense,
        )(x)
        q, k, v = (qkv[:, :, i] for i in range(3))  # each [batch, length, heads, head_dim]
        if cfg.scale_attn_by_inverse_layer_idx:
            # Dividing q rather than passing a per-layer `scale` keeps that a Python float
            # (cuDNN attention needs one) while the index is traced inside nn.scan.
            q = q / (layer_index + 1).astype(q.dtype)
        q = layers.constrain(q, layers.HEAD_AXES)
        k = layers.constrain(k, layers.HEAD_AXES)
        k, v = attention.KVCache(name="cache")(k, v, decoding)
        scale = cfg.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        out = attention.dot_product_attention(
            q,
            k,
            v,
            mask,
            bias=bias,
            scale=scale,
            dtype=cfg.dtype,
            implementation=cfg.attention,
            chunk_size=cfg.attention_chunk_size,
            context_parallel=cfg.context_parallel,
        )
        return layers.DenseGeneral(
            cfg.hidden_size,
            ("heads", "head_dim", "embed"),
            axis=(-2, -1),
            use_bias=True,
            name="c_proj",
            **dense,
        )(out)


class GPT2MLP(nn.Module):
    config: GPT2Config

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        h = layers.DenseGeneral(cfg.mlp_dim, ("embed", "mlp"), use_bias=True, name="c_fc", **dense)(
            x
        )
        h = layers.constrain(layers.ACTIVATIONS[cfg.activation](h), ("batch", "length", "mlp"))
        return layers.DenseGeneral(
            cfg.hidden_size, ("mlp", "embed"), use_bias=True, name="c_proj", **dense
        )(h)


class GPT2Block(nn.Module):
    config: GPT2Config
    deterministic: bool = True

    def _dropout(self, x: Array) -> Array:
        if self.config.dropout_rate:
            x = nn.Dropout(self.config.dropout_rate)(x, deterministic=self.deterministic)
        return x

    @nn.compact
    def __call__(
        self,
        x: Array,
        layer_index: Array,
        mask: Array,
        decoding: masks.Decoding | None = None,
        bias: Array | None = None,
    ) -> Array:
        cfg = self.config
        norm = dict(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        x = layers.constrain(x, layers.ACTIVATION_AXES)
        attn = GPT2Attention(cfg, name="attn")(
            layers.LayerNorm(name="ln_1", **norm)(x), layer_index, mask, decoding, bias
        )
        x = x + self._dropout(checkpoint_name(attn, "attn_out"))
        x = layers.constrain(x, layers.ACTIVATION_AXES)
        m = GPT2MLP(cfg, name="mlp")(layers.LayerNorm(name="ln_2", **norm)(x))
        x = x + self._dropout(checkpoint_name(m, "mlp_out"))
        return layers.constrain(x, layers.ACTIVATION_AXES)


class GPT2(CausalLM):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = GPT2Block
    embed_name = "wte"
    layers_name = "h"
    layer_index = True  # for scale_attn_by_inverse_layer_idx

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array | None]]:
        cfg = self.config
        if cfg.position_embedding == "alibi":
            key_positions = positions
            if decoding is not None:  # keys are the cache's slots, counted from each row's start
                slots = jnp.arange(decoding.length, dtype=jnp.int32)[None]
                key_positions = jnp.maximum(slots - decoding.start[:, None], 0)
            return x, (alibi_bias(positions, key_positions, cfg.num_heads),)
        # The position table is small and never split over its rows.
        wpe = self.param(
            "wpe",
            nn.with_logical_partitioning(nn.initializers.normal(0.01), (None, "embed")),
            (cfg.max_position_embeddings, cfg.hidden_size),
            layers.as_dtype(cfg.param_dtype),
        )
        return x + jnp.take(wpe, positions, axis=0).astype(x.dtype), (None,)

    def final_norm(self, x: Array) -> Array:
        cfg = self.config
        return layers.LayerNorm(
            cfg.layer_norm_epsilon, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="ln_f"
        )(x)


# ------------------------------------------------------------------ ALiBi


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


# ------------------------------------------------------------------ HuggingFace

# HF options this module does not implement, with the only value it accepts.
_REQUIRED_HF = {"add_cross_attention": False}


def config_from_hf(hf: dict, **overrides) -> GPT2Config:
    for key, value in _REQUIRED_HF.items():
        if hf.get(key, value) != value:
            raise ValueError(
                f"GPT-2 config.json sets {key}={hf[key]!r}; flaxlm's GPT-2 supports only {value!r}."
            )
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["n_embd"],
        num_layers=hf["n_layer"],
        num_heads=hf["n_head"],
        intermediate_size=hf.get("n_inner"),
        max_position_embeddings=hf["n_positions"],
        layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        activation=hf.get("activation_function", "gelu_new"),
        scale_attn_weights=hf.get("scale_attn_weights", True),
        scale_attn_by_inverse_layer_idx=hf.get("scale_attn_by_inverse_layer_idx", False),
        reorder_and_upcast_attn=hf.get("reorder_and_upcast_attn", False),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
    )
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def config_to_hf(cfg: GPT2Config) -> dict:
    if cfg.position_embedding != "learned":
        raise ValueError(
            f"A GPT-2 with position_embedding={cfg.position_embedding!r} has no HuggingFace "
            "GPT2LMHeadModel equivalent (HF's GPT-2 has learned positions only)."
        )
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.real_vocab_size or cfg.vocab_size,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_inner": cfg.intermediate_size,
        "n_positions": cfg.max_position_embeddings,
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "activation_function": cfg.activation,
        "scale_attn_weights": cfg.scale_attn_weights,
        "scale_attn_by_inverse_layer_idx": cfg.scale_attn_by_inverse_layer_idx,
        "reorder_and_upcast_attn": cfg.reorder_and_upcast_attn,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


def conv1d(param: str, hf: str, split: int | None = 1, **kw) -> HFTensor:
    """A HF `Conv1D` weight: already `[in, out]`, so reshaped but not transposed."""
    return HFTensor(param, hf, split=split, transpose=False, **kw)


def hf_tensors(cfg: GPT2Config) -> list[HFTensor]:
    n = cfg.num_layers
    block = [
        conv1d("h_{i}/attn/c_attn/kernel", "transformer.h.{i}.attn.c_attn.weight", layers=n),
        conv1d("h_{i}/attn/c_attn/bias", "transformer.h.{i}.attn.c_attn.bias", None, layers=n),
        conv1d("h_{i}/attn/c_proj/kernel", "transformer.h.{i}.attn.c_proj.weight", 2, layers=n),
        conv1d("h_{i}/mlp/c_fc/kernel", "transformer.h.{i}.mlp.c_fc.weight", layers=n),
        conv1d("h_{i}/mlp/c_proj/kernel", "transformer.h.{i}.mlp.c_proj.weight", layers=n),
        *(
            HFTensor(f"h_{{i}}/{m}/{p}/bias", f"transformer.h.{{i}}.{m}.{p}.bias", layers=n)
            for m, p in (("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj"))
        ),
        *(
            HFTensor(f"h_{{i}}/{ln}/{ours}", f"transformer.h.{{i}}.{ln}.{theirs}", layers=n)
            for ln in ("ln_1", "ln_2")
            for ours, theirs in (("scale", "weight"), ("bias", "bias"))
        ),
    ]
    out = [
        HFTensor("wte/embedding", "transformer.wte.weight", split=1, vocab_axis=0),
        HFTensor("wpe", "transformer.wpe.weight", split=1),
        *block,
        HFTensor("ln_f/scale", "transformer.ln_f.weight"),
        HFTensor("ln_f/bias", "transformer.ln_f.bias"),
    ]
    if not cfg.tie_word_embeddings:
        out.append(linear("lm_head/kernel", "lm_head.weight", vocab_axis=1))
    return out


HF_SPEC = register_hf(
    HFSpec(
        model_types=("gpt2",),
        config_cls=GPT2Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        base_model_prefix="transformer",
        # Old files keep the causal-mask buffers; a tied model's file may hold the head copy.
        ignore=(r"\.attn\.(bias|masked_bias)$", r"^lm_head\.weight$"),
        tied_head=("lm_head.weight", "transformer.wte.weight"),
    )
)
