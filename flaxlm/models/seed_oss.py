"""Seed-OSS (`seed_oss`, ByteDance's Seed-OSS-36B): Llama's block with biases on the query,
key and value projections (`attention_bias`) apart from the output projection's
(`attention_out_bias`) and the MLP's (`mlp_bias`), and a `head_dim` independent of the width.

Its residual and attention dropouts (`residual_dropout`, `attention_dropout`) act in training
only: flaxlm's `dropout_rate` is the run's choice, and exports write both 0. Follows
HuggingFace's `SeedOssForCausalLM`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import jax

from flaxlm.models import llama, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, register_hf

Array = jax.Array

MODEL_TYPES = ("seed_oss",)
# transformers' SeedOssConfig defaults, for keys a config.json omits.
HF_DEFAULTS = dict(
    vocab_size=155136,
    hidden_size=4096,
    intermediate_size=27648,
    num_hidden_layers=64,
    num_attention_heads=80,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=524288,
    rms_norm_eps=1e-6,
    attention_bias=True,
    attention_out_bias=False,
    mlp_bias=False,
    tie_word_embeddings=False,
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SeedOssConfig(llama.LlamaConfig):
    """Seed-OSS hyper-parameters (LlamaConfig's, `attention_bias` the q/k/v biases only and
    `attention_out_bias` o's); the defaults are Seed-OSS-36B's."""

    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    vocab_size: int = 155136
    hidden_size: int = 5120
    num_layers: int = 64
    num_heads: int = 80
    num_kv_heads: int | None = 8
    head_dim: int | None = 128
    intermediate_size: int = 27648
    max_position_embeddings: int = 524288
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    attention_bias: bool = True  # biases on q, k and v
    attention_out_bias: bool = False  # a bias on o
    model_type: str = "seed_oss"

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates): Llama's, whose `attention_bias` biases o
        too, with o's bias as `attention_out_bias` says."""
        o_bias = int(self.attention_out_bias) - int(self.attention_bias)
        return super().num_params() + self.num_layers * self.hidden_size * o_bias

    def make_module(self) -> SeedOss:
        return SeedOss(self)


class SeedOssBlock(llama.LlamaBlock):
    """Llama's block, its output projection biased by `attention_out_bias`."""

    def attention_options(self) -> dict[str, Any]:
        cfg = self.config
        return dict(qkv_bias=cfg.attention_bias, out_bias=cfg.attention_out_bias, qk_norm=None)


class SeedOss(llama.Llama):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = SeedOssBlock


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides: Any) -> SeedOssConfig:
    """A SeedOssConfig from a `seed_oss` config.json dict (+ field overrides), fields it
    leaves out at transformers' defaults."""
    hf = {**HF_DEFAULTS, **hf}
    kwargs = dict(
        llama.shared_fields_from_hf(hf),
        head_dim=hf["head_dim"],
        attention_bias=bool(hf["attention_bias"]),
        attention_out_bias=bool(hf["attention_out_bias"]),
        mlp_bias=bool(hf["mlp_bias"]),
        **rope.from_hf(hf),
    )
    kwargs.update(overrides)
    return SeedOssConfig(**kwargs)


def config_to_hf(cfg: SeedOssConfig) -> dict:
    return {
        "model_type": "seed_oss",
        "architectures": ["SeedOssForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "rope_parameters": rope.to_hf(cfg),
        "attention_bias": cfg.attention_bias,
        "attention_out_bias": cfg.attention_out_bias,
        "mlp_bias": cfg.mlp_bias,
        "residual_dropout": 0.0,
    }


def hf_tensors(cfg: SeedOssConfig) -> list[HFTensor]:
    """Llama's names, the q/k/v biases and o's apart."""
    table = llama.hf_tensors(
        llama.LlamaConfig(
            num_layers=cfg.num_layers,
            mlp_bias=cfg.mlp_bias,
            tie_word_embeddings=cfg.tie_word_embeddings,
        )
    )
    n, attn = cfg.num_layers, "model.layers.{i}.self_attn"
    biased = ("q_proj", "k_proj", "v_proj") if cfg.attention_bias else ()
    biased += ("o_proj",) if cfg.attention_out_bias else ()
    return table + [
        HFTensor(f"layers_{{i}}/{p}/bias", f"{attn}.{p}.bias", layers=n) for p in biased
    ]


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=SeedOssConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        tied_head=llama.HF_SPEC.tied_head,
    )
)
