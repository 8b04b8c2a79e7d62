"""GLM-4 (`glm4`: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1) and GLM (`glm`: GLM-4-9B-chat-hf):
Llama's block with rotary over interleaved pairs of each head's first half, q/k/v biases and a
fused gate/up projection; GLM-4 also normalises the attention's and the MLP's outputs before
each residual add (`post_self_attn_layernorm`, `post_mlp_layernorm`).

The rotary covers `partial_rotary_factor` (0.5 by default) of each head's features, its pairs
(0, 1), (2, 3), ... (HF's GLM `rotate_half`, in float32); `attention_bias` biases q, k and v
(never o); HF stores the MLP's gate and up projections as one `gate_up_proj` (gate rows
first). Follows HuggingFace's `Glm4ForCausalLM` and `GlmForCausalLM`.

GLM-4.1V's and GLM-4.6V-Flash's files (`glm4v`) hold a GLM-4 text tower (`glm4v_text`: q/k/v
biases always, heads width / heads wide, the whole head rotated unless `rope_parameters` says
otherwise; its multimodal rotary, on text, plain rotary): it reads as a GLM-4 and exports as
one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import gin
import jax

from flaxlm.models import glm4_moe, layers, llama, masks, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import (
    LANGUAGE_MODEL_RENAMES,
    HFSpec,
    HFTensor,
    Multimodal,
    register_hf,
)

Array = jax.Array

MODEL_TYPES = ("glm", "glm4")
ARCHITECTURES = {"glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM"}
# transformers' GlmConfig / Glm4Config defaults (alike), for keys a config.json omits.
HF_DEFAULTS = dict(
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=13696,
    num_hidden_layers=40,
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1.5625e-07,
    attention_bias=True,
    tie_word_embeddings=False,
)
POST_NORMS = ("post_self_attn_layernorm", "post_mlp_layernorm")  # GLM-4's (`output_norm`)
VL_TEXT = "glm4v_text"  # GLM-4.1V's text tower
# transformers' Glm4vTextConfig defaults where they are not Glm4Config's.
VL_DEFAULTS = dict(max_position_embeddings=32768, rms_norm_eps=1e-5, head_dim=None)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Glm4Config(llama.LlamaConfig):
    """GLM-4 / GLM hyper-parameters (LlamaConfig's, `attention_bias` the q/k/v biases only,
    `partial_rotary_factor` the rotated fraction of a head); the defaults are
    GLM-4-9B-0414's."""

    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    vocab_size: int = 151552
    hidden_size: int = 4096
    num_layers: int = 40
    num_heads: int = 32
    num_kv_heads: int | None = 2
    head_dim: int | None = 128
    intermediate_size: int = 13696
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1.5625e-07
    attention_bias: bool = True  # biases on q, k and v
    partial_rotary_factor: float = 0.5
    model_type: str = "glm4"

    @property
    def rotary_dim(self) -> int:
        """The rotated features of each head, as HF rounds them."""
        return int(self.dim_per_head * self.partial_rotary_factor)

    @property
    def post_norms(self) -> bool:
        """Whether the attention's and the MLP's outputs are normalised (GLM-4)."""
        return self.model_type == "glm4"

    def num_params(self) -> int:
        """Parameter count (for FLOP estimates): Llama's, whose `attention_bias` biases o
        too, without o's bias and with GLM-4's two more norms a layer."""
        e = self.hidden_size
        per_layer = 2 * e * self.post_norms - (e if self.attention_bias else 0)
        return super().num_params() + self.num_layers * per_layer

    def make_module(self) -> Glm4:
        return Glm4(self)


class Glm4Block(llama.LlamaBlock):
    """Llama's block, its rotary interleaved, no o bias, and with GLM-4's output norms."""

    def attention_options(self) -> dict[str, Any]:
        cfg = self.config
        return dict(
            qkv_bias=cfg.attention_bias, out_bias=False, qk_norm=None, rotary_interleaved=True
        )

    def output_norm(self, y: Array, name: str) -> Array:
        cfg = self.config
        if not cfg.post_norms:
            return y
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        return layers.RMSNorm(cfg.rms_norm_eps, name=name, **dense)(y)


class Glm4(llama.Llama):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`, rotary
    over each head's first `rotary_dim` features."""

    block_cls = Glm4Block

    def block_inputs(
        self, x: Array, positions: Array, decoding: masks.Decoding | None
    ) -> tuple[Array, tuple[Array, Array]]:
        return x, rope.sin_cos(positions, self.config, dim=self.config.rotary_dim)


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides: Any) -> Glm4Config:
    """A Glm4Config from a `glm4` or `glm` config.json dict (+ field overrides), fields it
    leaves out at transformers' defaults."""
    partial = 0.5  # Glm4Config's and GlmConfig's default
    if hf["model_type"] == VL_TEXT:  # q/k/v biases whatever config.json says; whole heads
        hf = {**VL_DEFAULTS, **hf, "model_type": "glm4", "attention_bias": True}
        partial = 1.0
    hf = {**HF_DEFAULTS, **hf}
    kwargs = dict(
        llama.shared_fields_from_hf(hf),
        head_dim=hf["head_dim"],
        attention_bias=bool(hf["attention_bias"]),
        partial_rotary_factor=glm4_moe.partial_rotary_factor(hf, partial),
        model_type=hf["model_type"],
        **rope.from_hf(hf),
    )
    kwargs.update(overrides)
    return Glm4Config(**kwargs)


def config_to_hf(cfg: Glm4Config) -> dict:
    return {
        "model_type": cfg.model_type,
        "architectures": [ARCHITECTURES[cfg.model_type]],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "rope_parameters": glm4_moe.rope_to_hf(cfg),
        "attention_bias": cfg.attention_bias,
    }


def hf_tensors(cfg: Glm4Config) -> list[HFTensor]:
    """GLM-4.5's attention table (q/k/v biases, `glm4_moe.attention_hf_tensors`), Llama's
    MLP names with the gate and up projections as rows of HF's `gate_up_proj`, and GLM-4's
    output norms."""
    ffn, n = cfg.intermediate_size, cfg.num_layers
    fused = {"gate_proj": (0, ffn), "up_proj": (ffn, 2 * ffn)}
    table = glm4_moe.attention_hf_tensors(cfg)
    for t in llama.hf_tensors(llama.LlamaConfig(num_layers=n)):
        name = t.param.split("/")[1] if t.layers else ""
        if ".mlp." in t.hf:
            rows = fused.get(name)
            hf_name = "model.layers.{i}.mlp.gate_up_proj.weight" if rows else t.hf
            table.append(dataclasses.replace(t, hf=hf_name, rows=rows))
    if cfg.post_norms:
        table += [
            HFTensor(f"layers_{{i}}/{p}/scale", f"model.layers.{{i}}.{p}.weight", layers=n)
            for p in POST_NORMS
        ]
    return table


HF_SPEC = register_hf(
    HFSpec(
        model_types=(*MODEL_TYPES, VL_TEXT),
        config_cls=Glm4Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        tied_head=llama.HF_SPEC.tied_head,
        # GLM-4.1V's / 4.6V-Flash's files: the text tower under `model.language_model.`, the
        # head the outer model's (tied by a pre-v5 save's text config too), `visual.` skipped.
        multimodal=(Multimodal("glm4v", VL_TEXT, tied=False, text_ties=True),),
        renames=LANGUAGE_MODEL_RENAMES,
        skip=(r"^model\.visual\.",),
    )
)
