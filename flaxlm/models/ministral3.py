"""Ministral 3 (`ministral3`: Ministral 3 3B, 8B and 14B, the text tower of their `mistral3`
multimodal files): Mistral's block whose queries are scaled by position after rotary.

What differs from Mistral (`llama.py`): each query is multiplied by Llama 4's attention scale
`1 + llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings))`
(HF's `get_llama_4_attn_scale`, as Mistral 4's; `rope.llama4_query_scale`), both read from
`rope_parameters`; the published rope is YaRN (factor 16 over an original 16,384 positions),
and a config.json that leaves out `head_dim` or `rope_parameters` gets transformers' defaults
(128; that YaRN). Follows HuggingFace's `Ministral3ForCausalLM`.

Refused (a ValueError naming the setting, where HF's model fails or differs): no
`llama_4_scaling_beta`; a 'default' or 'linear' rope without `original_max_position_embeddings`
in `rope_parameters` (HF divides by it); a `partial_rotary_factor` other than 1 (HF's Mistral
attention rotates whole heads); attention or MLP biases (HF's has none).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import jax

from flaxlm.models import llama, masks, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import LLAVA_RENAMES, LLAVA_SKIP, HFSpec, register_hf

Array = jax.Array

MODEL_TYPES = ("ministral3",)
# transformers' Ministral3Config defaults, for keys a config.json omits (head_dim too: 128,
# not hidden_size / heads).
HF_DEFAULTS = dict(
    vocab_size=131072,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=34,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=262144,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
)
# transformers' Ministral3Config rope_parameters where a config.json has none.
HF_ROPE = dict(
    type="yarn",
    rope_theta=1000000.0,
    factor=16.0,
    original_max_position_embeddings=16384,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale_all_dim=1.0,
    mscale=1.0,
    llama_4_scaling_beta=0.1,
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Ministral3Config(llama.LlamaConfig):
    """Ministral 3 hyper-parameters (LlamaConfig's, and the query scale's
    `llama_4_scaling_beta` over `rope_original_max_position_embeddings`); the defaults are
    Ministral 3 8B's."""

    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    vocab_size: int = 131072
    hidden_size: int = 4096
    num_layers: int = 34
    num_heads: int = 32
    num_kv_heads: int | None = 8
    head_dim: int | None = 128
    intermediate_size: int = 14336
    max_position_embeddings: int = 262144
    rope_theta: float = 1000000.0
    rope_scaling_type: str | None = "yarn"
    rope_scaling_factor: float = 16.0
    rope_original_max_position_embeddings: int = 16384
    rope_mscale: float | None = 1.0
    rope_mscale_all_dim: float | None = 1.0
    llama_4_scaling_beta: float = 0.1
    model_type: str = "ministral3"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rope_original_max_position_embeddings < 1:
            raise ValueError(
                f"rope_original_max_position_embeddings "
                f"{self.rope_original_max_position_embeddings}: the query scale steps every "
                "that many positions, so it must be >= 1."
            )

    def make_module(self) -> Ministral3:
        return Ministral3(self)


class Ministral3(llama.Llama):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`; Llama's
    block takes the query scale by position after sin and cos."""

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, Array, Array]]:
        x, (sin, cos) = super().block_inputs(x, positions, decoding)
        return x, (sin, cos, rope.llama4_query_scale(positions, self.config))


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides: Any) -> Ministral3Config:
    """A Ministral3Config from a `ministral3` config.json dict (+ field overrides), fields it
    leaves out at transformers' defaults."""
    hf = {**HF_DEFAULTS, **hf}
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or HF_ROPE)
    kind = params.get("rope_type", params.get("type", "default"))
    beta = params.get("llama_4_scaling_beta")
    if beta is None:
        raise ValueError(
            "rope_parameters has no llama_4_scaling_beta: HF's Ministral 3 scales every "
            "query by it (and fails without it)."
        )
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1.0):
        raise ValueError(
            f"partial_rotary_factor {partial} is not supported: HF's Ministral 3 rotates "
            "whole heads (and fails on a narrower rotary)."
        )
    # RopeScaling's own defaults where the rope leaves a field out (this config's are YaRN's).
    fields = dict(
        rope_scaling_type=None, rope_scaling_factor=1.0, rope_mscale=None, rope_mscale_all_dim=None
    )
    fields.update(rope.from_hf({**hf, "rope_parameters": params, "rope_scaling": None}))
    if kind not in ("llama3", "yarn"):  # theirs is set as transformers standardises it
        original = params.get("original_max_position_embeddings")
        if original is None:
            raise ValueError(
                f"rope_parameters of rope_type {kind!r} has no "
                "original_max_position_embeddings: HF's Ministral 3 scales its queries by "
                "steps of it (and fails without it)."
            )
        fields["rope_original_max_position_embeddings"] = int(original)
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{key}=True: HF's Ministral 3 has no biases.")
    kwargs = dict(
        llama.shared_fields_from_hf(hf, rms_norm_eps=1e-5),
        head_dim=hf["head_dim"],
        sliding_window=hf.get("sliding_window"),
        llama_4_scaling_beta=float(beta),
        **fields,
    )
    kwargs.update(overrides)
    return Ministral3Config(**kwargs)


def config_to_hf(cfg: Ministral3Config) -> dict:
    """The config.json dict; `rope_parameters` carries the query scale's two fields."""
    params = rope.to_hf(cfg)
    params.update(
        original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
        llama_4_scaling_beta=cfg.llama_4_scaling_beta,
    )
    return {
        "model_type": "ministral3",
        "architectures": ["Ministral3ForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "rope_parameters": params,
        "sliding_window": cfg.sliding_window,
    }


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=Ministral3Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=llama.hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        tied_head=llama.HF_SPEC.tied_head,
        # The Ministral 3 files are Mistral 3 multimodal ones in the llava layout
        # (`llama.MISTRAL3` registers the file type).
        renames=LLAVA_RENAMES,
        skip=LLAVA_SKIP,
    )
)
