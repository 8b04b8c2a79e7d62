"""Qwen3-Next and Qwen3.5 text from and to HuggingFace (`qwen3_next.py`'s families): the
config.json fields as transformers' config classes resolve them, and each layer's tensors
(the Gated DeltaNet's fused rows of `in_proj_qkv` and `conv1d.weight` split per q, k, v).
The Hub's multimodal Qwen3.5 files (`qwen3_5`, `qwen3_5_moe`) load their text tower: its
`text_config`, its tensors under `model.language_model.`; the vision tower is skipped and the
multi-token-prediction layer (`mtp.`) ignored, as transformers' causal LM does, unless the
config reads it (`num_mtp_layers`: `mtp_tensors`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flaxlm.models import glm4_moe, llama, mtp_hf, qwen_moe, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import (
    LANGUAGE_MODEL_RENAMES,
    HFSpec,
    HFTensor,
    Multimodal,
    linear,
    per_kind,
    register_hf,
    text_tower,
)
from flaxlm.models.qwen3_next import ARCHITECTURES, FULL, MODEL_TYPES, Qwen3NextConfig

# transformers' config classes' defaults of the config.json fields flaxlm reads.
_LINEAR_DEFAULTS = dict(
    head_dim=256,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    router_aux_loss_coef=0.001,
)
HF_DEFAULTS = {
    "qwen3_next": dict(
        _LINEAR_DEFAULTS,
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        norm_topk_prob=True,
        decoder_sparse_step=1,
    ),
    "qwen3_5_text": dict(
        _LINEAR_DEFAULTS,
        vocab_size=248320,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
    "qwen3_5_moe_text": dict(
        _LINEAR_DEFAULTS,
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    ),
}
# The Hub's multimodal Qwen3.5 files (their LM head outside the text tower, untied by
# default): the model type of their text tower.
MULTIMODAL = (
    Multimodal("qwen3_5", "qwen3_5_text", tied=False),
    Multimodal("qwen3_5_moe", "qwen3_5_moe_text", tied=False),
)
COPIED = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "hidden_size"),
    ("num_layers", "num_hidden_layers"),
    ("num_heads", "num_attention_heads"),
    ("num_kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("max_position_embeddings", "max_position_embeddings"),
    ("rms_norm_eps", "rms_norm_eps"),
    ("tie_word_embeddings", "tie_word_embeddings"),
    ("activation", "hidden_act"),
    ("attention_bias", "attention_bias"),
    ("linear_conv_kernel_dim", "linear_conv_kernel_dim"),
    ("linear_key_head_dim", "linear_key_head_dim"),
    ("linear_value_head_dim", "linear_value_head_dim"),
    ("linear_num_key_heads", "linear_num_key_heads"),
    ("linear_num_value_heads", "linear_num_value_heads"),
)
MOE_COPIED = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "router_aux_loss_coef",
)


def config_from_hf(hf: dict, **overrides: Any) -> Qwen3NextConfig:
    """A Qwen3NextConfig from a Qwen3-Next or Qwen3.5 config.json dict (+ field overrides),
    fields it leaves out at transformers' defaults."""
    hf = text_tower(hf)
    model_type = hf["model_type"]
    hf = {**HF_DEFAULTS[model_type], **hf}
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if params.get("rope_type", params.get("type")) == "mrope":  # Qwen2-VL's spelling
        params["rope_type"] = "default"
    kwargs: dict[str, Any] = {ours: hf[theirs] for ours, theirs in COPIED}
    kwargs.update(
        model_type=model_type,
        intermediate_size=hf.get("intermediate_size", hf.get("moe_intermediate_size", 512)),
        layer_types=tuple(hf["layer_types"]) if hf.get("layer_types") else None,
        full_attention_interval=hf.get("full_attention_interval", 4),
        partial_rotary_factor=glm4_moe.partial_rotary_factor(hf, 0.25),
        **rope.from_hf({**hf, "rope_parameters": params}),
    )
    if model_type != "qwen3_next":
        section = params.get("mrope_section")
        kwargs.update(
            mrope_section=tuple(section) if section is not None else None,
            mrope_interleaved=bool(params.get("mrope_interleaved", False)),
        )
    if model_type == "qwen3_5_text":
        kwargs.update(num_experts=0)
    else:
        kwargs.update({name: hf[name] for name in MOE_COPIED})
    if model_type == "qwen3_next":
        kwargs.update(
            norm_topk_prob=bool(hf["norm_topk_prob"]),
            decoder_sparse_step=hf["decoder_sparse_step"],
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        )
    kwargs.update(overrides)
    return Qwen3NextConfig(**kwargs)


def config_to_hf(cfg: Qwen3NextConfig) -> dict:
    """The config.json dict of the text model: every layer's type, the rope with its partial
    factor (and Qwen3.5's sections)."""
    out = {
        "model_type": cfg.model_type,
        "architectures": [ARCHITECTURES[cfg.model_type]],
        **{theirs: getattr(cfg, ours) for ours, theirs in COPIED},
        "vocab_size": cfg.real_vocab_size or cfg.vocab_size,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_per_head,
        "attention_dropout": 0.0,
        "layer_types": list(cfg.per_layer_types),
        "rope_parameters": glm4_moe.rope_to_hf(cfg),
    }
    if cfg.mrope_section is not None:
        out["rope_parameters"].update(
            mrope_section=list(cfg.mrope_section), mrope_interleaved=cfg.mrope_interleaved
        )
    if cfg.model_type != "qwen3_5_moe_text":
        out["intermediate_size"] = cfg.intermediate_size
    if cfg.model_type != "qwen3_5_text":
        out.update({name: getattr(cfg, name) for name in MOE_COPIED})
    if cfg.model_type == "qwen3_next":
        out.update(
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
        )
    if cfg.num_mtp_layers:  # the Hub's Qwen3.5 key (and an MTP layer of its embedding)
        out.update(mtp_num_hidden_layers=cfg.num_mtp_layers, mtp_use_dedicated_embeddings=False)
    return out


def conv_to_hf(kernel: np.ndarray) -> np.ndarray:
    """`conv_{q,k,v}` `[K, heads, dim]` -> rows of HF's `conv1d.weight` `[heads * dim, 1, K]`."""
    return kernel.reshape(kernel.shape[0], -1).T[:, None, :]


def conv_from_hf(rows: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return rows[:, 0, :].T.reshape(shape)


def mixer_records(
    cfg: Qwen3NextConfig, kind: str, scope: str, prefix: str, n: int
) -> list[HFTensor]:
    if kind == FULL:
        attn = f"{prefix}.self_attn"
        out = [
            linear(f"{scope}/{p}/kernel", f"{attn}.{p}.weight", 2 if p == "o_proj" else 1, layers=n)
            for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        ]
        out += [
            HFTensor(f"{scope}/{p}/scale", f"{attn}.{p}.weight", layers=n)
            for p in ("q_norm", "k_norm")
        ]
        if cfg.attention_bias:
            out += [
                HFTensor(f"{scope}/{p}/bias", f"{attn}.{p}.bias", layers=n)
                for p in ("q_proj", "k_proj", "v_proj", "o_proj")
            ]
        return out
    mine, theirs = f"{scope}/linear_attn", f"{prefix}.linear_attn"
    kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    rows = {"q": (0, kd), "k": (kd, 2 * kd), "v": (2 * kd, 2 * kd + vd)}
    if cfg.projection == "grouped":
        out = [
            linear(f"{mine}/{p}/kernel", f"{theirs}.{p}.weight", layers=n)
            for p in ("in_proj_qkvz", "in_proj_ba")
        ]
    else:
        out = [
            linear(f"{mine}/in_proj_{x}/kernel", f"{theirs}.in_proj_qkv.weight", layers=n, rows=r)
            for x, r in rows.items()
        ]
        out += [
            linear(f"{mine}/in_proj_{x}/kernel", f"{theirs}.in_proj_{x}.weight", layers=n)
            for x in ("z", "b", "a")
        ]
    conv = dict(to_hf=conv_to_hf, to_flax=conv_from_hf, layers=n)
    out += [
        HFTensor(f"{mine}/conv_{x}", f"{theirs}.conv1d.weight", rows=r, **conv)
        for x, r in rows.items()
    ]
    out += [HFTensor(f"{mine}/{p}", f"{theirs}.{p}", layers=n) for p in ("A_log", "dt_bias")]
    out += [
        HFTensor(f"{mine}/norm/scale", f"{theirs}.norm.weight", layers=n),
        linear(f"{mine}/out_proj/kernel", f"{theirs}.out_proj.weight", 2, layers=n),
    ]
    return out


def hf_tensors(cfg: Qwen3NextConfig) -> list[HFTensor]:
    """The embedding, each layer's norms, token mixer and MLP, the final norm and head."""
    n, kinds = cfg.num_layers, cfg.per_layer_types
    out = [
        HFTensor("embed_tokens/embedding", "model.embed_tokens.weight", split=1, vocab_axis=0),
        HFTensor("norm/scale", "model.norm.weight"),
    ]
    if not cfg.tie_word_embeddings:
        out.append(linear("lm_head/kernel", "lm_head.weight", vocab_axis=1))
    out += [
        HFTensor(f"layers_{{i}}/{p}/scale", f"model.layers.{{i}}.{p}.weight", layers=n)
        for p in ("input_layernorm", "post_attention_layernorm")
    ]
    out += per_kind(kinds, lambda k: mixer_records(cfg, k, "layers_{i}", "model.layers.{i}", n))
    return out + qwen_moe.moe_hf_tensors(cfg, "model.layers.{i}.mlp") + mtp_tensors(cfg)


def mtp_tensors(cfg: Qwen3NextConfig) -> list[HFTensor]:
    """The MTP layer's records where the config has it, as the Hub's files name them
    (`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` a
    decoder layer's, `mtp.norm`)."""
    if not cfg.num_mtp_layers:
        return []
    out = [
        linear("mtp_0/eh_proj/kernel", "mtp.fc.weight"),
        HFTensor("mtp_0/enorm/scale", "mtp.pre_fc_norm_embedding.weight"),
        HFTensor("mtp_0/hnorm/scale", "mtp.pre_fc_norm_hidden.weight"),
        HFTensor("mtp_0/post_norm/scale", "mtp.norm.weight"),
    ]
    block = mtp_hf.block_table(cfg, hf_tensors)
    rename = lambda name: name.replace("model.layers.0.", "mtp.layers.0.")  # noqa: E731
    return out + mtp_hf.relayered(block, "mtp_0/block", 0, rename)


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        multimodal=MULTIMODAL,
        config_cls=Qwen3NextConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        # The multi-token-prediction layer the Hub's files carry, as transformers ignores it,
        # unless the config reads it (`num_mtp_layers`).
        ignore=(*llama.HF_SPEC.ignore, r"^mtp\."),
        config_fields=lambda cfg: {"ignore": llama.HF_SPEC.ignore} if cfg.num_mtp_layers else {},
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        # Qwen3.5's multimodal files: the text tower under `model.language_model.`.
        renames=LANGUAGE_MODEL_RENAMES,
        skip=(r"^model\.visual\.",),
    )
)
