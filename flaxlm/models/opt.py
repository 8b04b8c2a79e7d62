"""OPT: learned positions (offset 2), pre- or post-LN blocks, ReLU MLP, tied head.

Follows HuggingFace's `OPTForCausalLM` (the PyTorch reference our logits must match),
including OPT-350m's word-embedding projection and its post-LN blocks without a final norm.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from flaxlm.models import attention, layers, masks
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.causal_lm import CausalLM
from flaxlm.models.hf_spec import HFSpec, HFTensor, linear, register_hf
from flaxlm.models.options import ComputeOptions

Array = jax.Array

# OPT's position table has two extra rows: position p reads row p + 2 (a fairseq legacy).
POSITION_OFFSET = 2


@gin.configurable
@dataclasses.dataclass(frozen=True)
class OPTConfig(ComputeOptions):
    """OPT hyper-parameters (HF names where they exist) and compute options."""

    vocab_size: int = 50272
    real_vocab_size: int | None = None  # ids from here up are padding (None: all real)
    hidden_size: int = 768
    num_layers: int = 12  # HF: num_hidden_layers
    num_heads: int = 12  # HF: num_attention_heads
    ffn_dim: int = 3072
    max_position_embeddings: int = 2048
    word_embed_proj_dim: int | None = None  # token embedding width; hidden_size if None
    do_layer_norm_before: bool = True  # False: post-LN blocks and no final norm (OPT-350m)
    remove_final_layer_norm: bool = False  # HF: _remove_final_layer_norm (old fine-tunes)
    enable_bias: bool = True  # biases of the attention and MLP projections
    tie_word_embeddings: bool = True  # the head reuses the token embedding
    layer_norm_epsilon: float = 1e-5  # torch nn.LayerNorm's default; HF does not configure it
    layer_norm_elementwise_affine: bool = True  # False: the norms have no scale or bias
    activation: str = "relu"  # HF: activation_function

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}."
            )
        if self.word_embed_proj_dim is not None and self.word_embed_proj_dim <= 0:
            raise ValueError(
                f"word_embed_proj_dim {self.word_embed_proj_dim} must be positive "
                "(or None for hidden_size)."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding (and of the head's input)."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def projects(self) -> bool:
        """Whether project_in / project_out map between embed_dim and hidden_size."""
        return self.embed_dim != self.hidden_size

    @property
    def final_layer_norm(self) -> bool:
        return self.do_layer_norm_before and not self.remove_final_layer_norm

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates)."""
        e, f, n, v = self.hidden_size, self.ffn_dim, self.num_layers, self.vocab_size
        bias, affine = int(self.enable_bias), int(self.layer_norm_elementwise_affine)
        block = 4 * e * e + 2 * e * f + bias * (4 * e + f + e) + affine * 4 * e
        total = v * self.embed_dim + (self.max_position_embeddings + POSITION_OFFSET) * e
        total += n * block + affine * 2 * e * int(self.final_layer_norm)
        total += 2 * e * self.embed_dim * int(self.projects)
        return total + (0 if self.tie_word_embeddings else v * self.embed_dim)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls (head included) plus attention scores."""
        position_table = (self.max_position_embeddings + POSITION_OFFSET) * self.hidden_size
        matmul = self.num_params() - position_table
        if not self.tie_word_embeddings:
            matmul -= self.vocab_size * self.embed_dim  # the input lookup is not a matmul
        return 6.0 * matmul + 12.0 * self.num_layers * self.hidden_size * seq_len

    def make_module(self) -> OPT:
        return OPT(self)


def layer_norm(cfg: OPTConfig, name: str) -> layers.LayerNorm:
    """OPT's LayerNorm, in float32; without elementwise affine it has no params at all (so
    the param tree, like HF's state dict, has no entry for it)."""
    affine = cfg.layer_norm_elementwise_affine
    return layers.LayerNorm(
        cfg.layer_norm_epsilon,
        use_bias=affine,
        use_scale=affine,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        name=name,
    )


class OPTBlock(nn.Module):
    config: OPTConfig
    deterministic: bool = True

    def _dropout(self, x: Array) -> Array:
        if self.config.dropout_rate:
            x = nn.Dropout(self.config.dropout_rate)(x, deterministic=self.deterministic)
        return x

    @nn.compact
    def __call__(self, x: Array, mask: masks.Mask, decoding: masks.Decoding | None) -> Array:
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        pre = cfg.do_layer_norm_before
        x = layers.constrain(x, layers.ACTIVATION_AXES)

        # Attention: [batch, length, heads, head_dim]
        h = layer_norm(cfg, "self_attn_layer_norm")(x) if pre else x
        names = ("q_proj", "k_proj", "v_proj")
        projections = [
            layers.DenseGeneral(
                (cfg.num_heads, cfg.head_dim),
                ("embed", "heads", "head_dim"),
                use_bias=cfg.enable_bias,
                name=n,
                **dense,
            )
            for n in names
        ]
        qkv = dict(zip(names, layers.parallel_dense(h, projections)))
        # HF scales the query before the product; doing the same keeps rounding identical.
        q = layers.constrain(qkv["q_proj"] * cfg.head_dim**-0.5, layers.HEAD_AXES)
        k = layers.constrain(qkv["k_proj"], layers.HEAD_AXES)
        k, v = attention.KVCache(name="cache")(k, qkv["v_proj"], decoding)
        attn = attention.dot_product_attention(
            q,
            k,
            v,
            mask,
            scale=1.0,
            dtype=cfg.dtype,
            implementation=cfg.attention,
            chunk_size=cfg.attention_chunk_size,
            context_parallel=cfg.context_parallel,
        )
        attn = layers.DenseGeneral(
            cfg.hidden_size,
            ("heads", "head_dim", "embed"),
            axis=(-2, -1),
            use_bias=cfg.enable_bias,
            name="out_proj",
            **dense,
        )(attn)
        attn = checkpoint_name(attn, "attn_out")
        x = x + self._dropout(attn)
        if not pre:
            x = layer_norm(cfg, "self_attn_layer_norm")(x)
        x = layers.constrain(x, layers.ACTIVATION_AXES)

        # MLP
        h = layer_norm(cfg, "final_layer_norm")(x) if pre else x
        m = layers.DenseGeneral(
            cfg.ffn_dim, ("embed", "mlp"), use_bias=cfg.enable_bias, name="fc1", **dense
        )(h)
        m = layers.constrain(layers.ACTIVATIONS[cfg.activation](m), ("batch", "length", "mlp"))
        m = layers.DenseGeneral(
            cfg.hidden_size, ("mlp", "embed"), use_bias=cfg.enable_bias, name="fc2", **dense
        )(m)
        m = checkpoint_name(m, "mlp_out")
        x = x + self._dropout(m)
        if not pre:
            x = layer_norm(cfg, "final_layer_norm")(x)
        return layers.constrain(x, layers.ACTIVATION_AXES)


class OPT(CausalLM):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = OPTBlock

    @property
    def embed_width(self) -> int:
        return self.config.embed_dim

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[()]]:
        cfg = self.config
        if cfg.projects:
            x = layers.DenseGeneral(
                cfg.hidden_size,
                (None, "embed"),
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                name="project_in",
            )(x)
        # The position table is small and never split over its rows.
        table = self.param(
            "embed_positions",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "embed")),
            (cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size),
            layers.as_dtype(cfg.param_dtype),
        )
        return x + jnp.take(table, positions + POSITION_OFFSET, axis=0).astype(x.dtype), ()

    def final_norm(self, x: Array) -> Array:
        cfg = self.config
        if cfg.final_layer_norm:
            x = layer_norm(cfg, "final_layer_norm")(x)
        if cfg.projects:
            x = layers.DenseGeneral(
                cfg.embed_dim,
                ("embed", None),
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                name="project_out",
            )(x)
        return x


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides) -> OPTConfig:
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        ffn_dim=hf["ffn_dim"],
        max_position_embeddings=hf["max_position_embeddings"],
        word_embed_proj_dim=hf.get("word_embed_proj_dim"),
        do_layer_norm_before=hf.get("do_layer_norm_before", True),
        remove_final_layer_norm=hf.get("_remove_final_layer_norm", False),
        enable_bias=hf.get("enable_bias", True),
        layer_norm_elementwise_affine=hf.get("layer_norm_elementwise_affine", True),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        activation=hf.get("activation_function", "relu"),
    )
    kwargs.update(overrides)
    return OPTConfig(**kwargs)


def config_to_hf(cfg: OPTConfig) -> dict:
    return {
        "model_type": "opt",
        "architectures": ["OPTForCausalLM"],
        "vocab_size": cfg.real_vocab_size or cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "ffn_dim": cfg.ffn_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "word_embed_proj_dim": cfg.embed_dim,
        "do_layer_norm_before": cfg.do_layer_norm_before,
        "_remove_final_layer_norm": cfg.remove_final_layer_norm,
        "enable_bias": cfg.enable_bias,
        "layer_norm_elementwise_affine": cfg.layer_norm_elementwise_affine,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "activation_function": cfg.activation,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "layerdrop": 0.0,
    }


def hf_tensors(cfg: OPTConfig) -> list[HFTensor]:
    n = cfg.num_layers
    hf = "model.decoder.layers.{i}"
    block = []
    for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
        split = 2 if p == "out_proj" else 1
        block.append(
            linear(f"layers_{{i}}/{p}/kernel", f"{hf}.self_attn.{p}.weight", split, layers=n)
        )
        if cfg.enable_bias:
            block.append(HFTensor(f"layers_{{i}}/{p}/bias", f"{hf}.self_attn.{p}.bias", layers=n))
    for p in ("fc1", "fc2"):
        block.append(linear(f"layers_{{i}}/{p}/kernel", f"{hf}.{p}.weight", layers=n))
        if cfg.enable_bias:
            block.append(HFTensor(f"layers_{{i}}/{p}/bias", f"{hf}.{p}.bias", layers=n))
    if cfg.layer_norm_elementwise_affine:  # otherwise the norms have no tensors
        for p in ("self_attn_layer_norm", "final_layer_norm"):
            block.append(HFTensor(f"layers_{{i}}/{p}/scale", f"{hf}.{p}.weight", layers=n))
            block.append(HFTensor(f"layers_{{i}}/{p}/bias", f"{hf}.{p}.bias", layers=n))

    out = [
        HFTensor("embed_tokens/embedding", "model.decoder.embed_tokens.weight", 1, vocab_axis=0),
        HFTensor("embed_positions", "model.decoder.embed_positions.weight", 1),
        *block,
    ]
    if cfg.final_layer_norm and cfg.layer_norm_elementwise_affine:
        out.append(HFTensor("final_layer_norm/scale", "model.decoder.final_layer_norm.weight"))
        out.append(HFTensor("final_layer_norm/bias", "model.decoder.final_layer_norm.bias"))
    if cfg.projects:
        out.append(linear("project_in/kernel", "model.decoder.project_in.weight"))
        out.append(linear("project_out/kernel", "model.decoder.project_out.weight"))
    if not cfg.tie_word_embeddings:
        out.append(linear("lm_head/kernel", "lm_head.weight", vocab_axis=1))
    return out


HF_SPEC = register_hf(
    HFSpec(
        model_types=("opt",),
        config_cls=OPTConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        base_model_prefix="model",
        # A tied model's file may still hold the head (a copy of embed_tokens).
        ignore=(r"^lm_head\.weight$",),
        tied_head=("lm_head.weight", "model.decoder.embed_tokens.weight"),
    )
)
