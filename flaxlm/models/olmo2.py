"""OLMo 2: OLMo 3's post-normalised blocks, every layer full attention, one rotary.

A block normalises the outputs of its attention and its MLP (`post_attention_layernorm`,
`post_feedforward_layernorm`) before adding them to the residual, with no norm on their
inputs; the query and key projections are each RMS-normalised as a whole (all heads at once,
`q_norm`, `k_norm`) before rotary; every layer attends to every earlier position. Biases on
q, k, v and o follow `attention_bias`; a `head_dim` in config.json is read (HF's attention
takes it). The rotary is one dict for every layer, as transformers resolves it: transformers
4's `rope_scaling` before `rope_parameters`, the base from the dict, else the top-level
`rope_theta`, else 1e4; 'default', 'linear', 'llama3' and 'yarn'. Refused, naming the
setting: other rope types ('dynamic', 'longrope'), a `partial_rotary_factor` other than 1, a
rope dict per layer type; on an `Olmo2Config`, OLMo 3's `sliding_window`, sliding
`layer_types` and `sliding_rope_parameters` (`olmo3.Olmo3Config` has them). config.json keys
HF's OLMo 2 does not read (`clip_qkv`, OLMo 1's) are ignored as it ignores them. Follows
HuggingFace's `Olmo2ForCausalLM`; the model is `olmo3.Olmo3`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin

from flaxlm.models import llama, olmo3, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, register_hf

MODEL_TYPES = ("olmo2",)
DEFAULT_THETA = 10000.0  # transformers' PreTrainedConfig.default_theta (Olmo2Config's)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Olmo2Config(olmo3.Olmo3Config):
    """OLMo 2 hyper-parameters: `olmo3.Olmo3Config`'s fields, no layer sliding; the defaults
    are OLMo-2-1124-7B's."""

    vocab_size: int = 100352
    max_position_embeddings: int = 4096
    sliding_window: int | None = None  # OLMo 3's: must stay None
    model_type: str = "olmo2"
    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

    def __post_init__(self) -> None:
        types = tuple(self.layer_types or ())
        if any(t != olmo3.FULL for t in types):
            raise ValueError(
                f"layer_types {types}: every OLMo 2 layer is {olmo3.FULL!r} (sliding layers "
                "are OLMo 3's: olmo3.Olmo3Config)."
            )
        for name in ("sliding_window", "sliding_rope_parameters"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name} {getattr(self, name)!r}: OLMo 2 has no sliding layers (OLMo 3 "
                    "has: olmo3.Olmo3Config); set None."
                )
        super().__post_init__()

    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """Every layer 'full_attention'."""
        return (olmo3.FULL,) * self.num_layers


# ------------------------------------------------------------------ HuggingFace


def flat_rope_from_hf(hf: dict[str, Any], family: str = "OLMo 2") -> dict[str, Any]:
    """`RopeScaling`'s fields and `rope_theta` from a config.json dict whose model has one
    rotary for all layers, as transformers' `convert_rope_params_to_dict` resolves it (OLMo 2,
    EXAONE 4): `rope_scaling` before `rope_parameters`; the base from that dict, else the
    top-level `rope_theta`, else 1e4; a llama3 or yarn dict without
    `original_max_position_embeddings` takes `max_position_embeddings` (a top-level
    `original_max_position_embeddings` is not read). A dict per layer type and a
    `partial_rotary_factor` other than 1 are refused."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(
            f"rope_parameters {params}: expected one rope dict for all layers ({family}'s "
            "rotary has no dict per layer type)."
        )
    params.setdefault("rope_theta", hf.get("rope_theta", DEFAULT_THETA))
    if hf.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    try:
        return olmo3.rope_fields(params, hf.get("max_position_embeddings", 2048))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"rope_parameters {params}: {e}") from None


def config_from_hf(hf: dict, **overrides: Any) -> Olmo2Config:
    """An Olmo2Config from an OLMo 2 config.json dict (+ field overrides), fields it leaves
    out at transformers' `Olmo2Config` defaults (OLMo 3's, but `rms_norm_eps` 1e-5 and
    `rope_theta` 1e4)."""
    hf = {**olmo3.HF_DEFAULTS, **hf}
    kwargs = dict(
        llama.shared_fields_from_hf(hf, rms_norm_eps=1e-5),
        head_dim=hf.get("head_dim"),
        attention_bias=hf.get("attention_bias", False),
        **flat_rope_from_hf(hf),
    )
    kwargs.update(overrides)
    return Olmo2Config(**kwargs)


def config_to_hf(cfg: Olmo2Config) -> dict:
    """The config.json dict (transformers 5's flat `rope_parameters`)."""
    return {
        "model_type": cfg.model_type,
        "architectures": ["Olmo2ForCausalLM"],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "attention_bias": cfg.attention_bias,
        "rope_parameters": rope.to_hf(cfg),
    }


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=Olmo2Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=olmo3.hf_tensors,  # OLMo 3 kept OLMo 2's names
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
    )
)
