"""Qwen4-Exp text from and to HuggingFace (`qwen4_exp.py`'s family): the config.json fields
as transformers' `Qwen4ExpTextConfig` resolves them ('full_attention' layers read as
'indexed_attention', the first of a list of EOS ids PLE's), each layer's tensors (Qwen3.5's
Gated DeltaNet and gated attention records, the indexer's, the hyper-connections', the PLE
layers'), the final `hyper_connection_mixer`. Each PLE table is read and written as the Hub
keeps it, in `split_ngram_parts` shards along its rows (`ngram_embedding.shard_{k}`, as
transformers' `save_pretrained` chunks it and its loading concatenates it); its buffers
(multipliers, head sizes and offsets) are derived from the config, ignored on import and
written on export (`buffers`). The multimodal `qwen4_exp` files load their text tower (its
`text_config`, its tensors under `model.language_model.`); the vision tower is skipped and
the multi-token-prediction layer (`mtp.`) ignored, as transformers' causal LM does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flaxlm.models import llama, qwen3_next_hf, qwen_moe, rope
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
from flaxlm.models.qwen3_next import FULL, LINEAR
from flaxlm.models.qwen4_exp import ARCHITECTURE, MODEL_TYPE, Qwen4ExpConfig
from flaxlm.models.qwen4_exp_ple import buffers, ngram_tables, shard_rows

INDEXED = "indexed_attention"  # HF's name of a full-attention layer with its indexer
# transformers' Qwen4ExpTextConfig defaults of the config.json fields flaxlm reads.
HF_DEFAULTS = dict(
    qwen3_next_hf.HF_DEFAULTS["qwen3_5_moe_text"],
    num_experts=512,
    num_experts_per_tok=10,
    hc_count=4,
    hc_lowrank=320,
    ple_conv_kernel_size=4,
    ngram_size=3,
    heads_per_ngram=8,
    ngram_vocab_size_base=20_000_000,
    make_ngram_vocab_size_divisible_by=128,
    seed=1234,
    split_ngram_parts=512,
    norm_topk_prob=True,
)
_OWN = (
    "hc_count",
    "hc_lowrank",
    "ple_conv_kernel_size",
    "ngram_size",
    "heads_per_ngram",
    "ngram_vocab_size_base",
    "make_ngram_vocab_size_divisible_by",
    "seed",
    "split_ngram_parts",
    "indexer_n_heads",
    "indexer_kv_heads",
    "indexer_head_dim",
    "indexer_budget",
    "indexer_compress_ratio",
    "output_gate_type",
    "norm_topk_prob",
    *qwen3_next_hf.MOE_COPIED,
)
MULTIMODAL = (Multimodal(MODEL_TYPE.removesuffix("_text"), MODEL_TYPE, tied=False),)


def config_from_hf(hf: dict, **overrides: Any) -> Qwen4ExpConfig:
    """A Qwen4ExpConfig from a Qwen4-Exp config.json dict (+ field overrides), the fields it
    leaves out at transformers' defaults."""
    hf = {**HF_DEFAULTS, **text_tower(hf)}
    if hf.get("attention_dropout"):
        raise ValueError(f"attention_dropout {hf['attention_dropout']}: flaxlm reads 0 only.")
    params = dict(hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": 1e4})
    every = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or [
        INDEXED if (i + 1) % every == 0 else LINEAR for i in range(hf["num_hidden_layers"])
    ]
    eos = hf.get("eos_token_id")
    kwargs: dict[str, Any] = {ours: hf[theirs] for ours, theirs in qwen3_next_hf.COPIED}
    kwargs.update({name: hf.get(name) for name in _OWN})
    section = params.get("mrope_section")
    kwargs.update(
        model_type=MODEL_TYPE,
        layer_types=tuple(FULL if t in (INDEXED, FULL) else t for t in types),
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
        mrope_section=tuple(section) if section is not None else None,
        mrope_interleaved=bool(params.get("mrope_interleaved", False)),
        ple_layer_ids=tuple(hf.get("ple_layer_ids") or ()),
        ple_embed_dim=hf.get("ple_embed_dim"),
        eos_token_id=(eos[0] if eos else None) if isinstance(eos, list) else eos,
        **rope.from_hf({**hf, "rope_parameters": params}),
    )
    kwargs.update(overrides)
    return Qwen4ExpConfig(**kwargs)


def config_to_hf(cfg: Qwen4ExpConfig) -> dict:
    """The config.json dict of the text model (`Qwen4ExpForCausalLM`)."""
    out = {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        **{theirs: getattr(cfg, ours) for ours, theirs in qwen3_next_hf.COPIED},
        **{name: getattr(cfg, name) for name in _OWN},
        "vocab_size": cfg.real_vocab_size or cfg.vocab_size,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_per_head,
        "attention_dropout": 0.0,
        "layer_types": [INDEXED if t == FULL else t for t in cfg.per_layer_types],
        "rope_parameters": rope.to_hf(cfg),
        "ple_layer_ids": list(cfg.ple_layer_ids),
        "ple_embed_dim": cfg.ple_embed_dim,
    }
    if cfg.partial_rotary_factor != 1.0:  # HF's default
        out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.mrope_section is not None:
        out["rope_parameters"].update(
            mrope_section=list(cfg.mrope_section), mrope_interleaved=cfg.mrope_interleaved
        )
    if cfg.eos_token_id is not None:
        out["eos_token_id"] = cfg.eos_token_id
    return out


def conv_to_hf(kernel: np.ndarray) -> np.ndarray:
    """PLE's `conv1d` `[taps, channels]` -> HF's `[channels, 1, taps]`."""
    return kernel.T[:, None, :]


def conv_from_hf(weight: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return weight[:, 0, :].T.reshape(shape)


def _hyper(scope: str, prefix: str, n: int, combine: bool = True) -> list[HFTensor]:
    names = ("input_mix_weight_down", "input_mix_weight_up")
    names += ("block_inject_weight",) if combine else ()
    out = [HFTensor(f"{scope}/hc_norm/scale", f"{prefix}.hc_norm.weight", layers=n)]
    return out + [linear(f"{scope}/{p}/kernel", f"{prefix}.{p}.weight", layers=n) for p in names]


def _mixer(cfg: Qwen4ExpConfig, kind: str, n: int) -> list[HFTensor]:
    out = qwen3_next_hf.mixer_records(cfg, kind, "layers_{i}", "model.layers.{i}", n)
    if kind == FULL:
        mine, theirs = "layers_{i}/indexer", "model.layers.{i}.self_attn.indexer"
        out += [
            linear(f"{mine}/index_qk_proj/kernel", f"{theirs}.index_qk_proj.weight", layers=n),
            HFTensor(f"{mine}/q_layernorm/scale", f"{theirs}.q_layernorm.weight", layers=n),
            HFTensor(f"{mine}/k_layernorm/scale", f"{theirs}.k_layernorm.weight", layers=n),
        ]
    return out


def _ple(cfg: Qwen4ExpConfig) -> list[HFTensor]:
    out: list[HFTensor] = []
    for index, layer in enumerate(cfg.ple_layers):
        mine, theirs = f"layers_{layer}/ple", f"model.layers.{layer}.ple"
        rows = shard_rows(ngram_tables(cfg, index).rows, cfg.split_ngram_parts)
        table = f"{theirs}.ple_embedding.ngram_embedding"
        out += [
            HFTensor(f"{mine}/ngram_shard_{k}", f"{table}.shard_{k}.weight", split=1)
            for k in range(len(rows))
        ]
        out += [
            linear(f"{mine}/{p}/kernel", f"{theirs}.{p}.weight") for p in ("key_proj", "value_proj")
        ]
        out += [
            HFTensor(f"{mine}/{p}/scale", f"{theirs}.{p}.weight")
            for p in ("norm_key", "norm_query", "norm_conv")
        ]
        out.append(
            HFTensor(
                f"{mine}/conv1d", f"{theirs}.conv1d.weight", to_hf=conv_to_hf, to_flax=conv_from_hf
            )
        )
    return out


def hf_tensors(cfg: Qwen4ExpConfig) -> list[HFTensor]:
    """The embedding, each layer's token mixer, hyper-connections, MLP and PLE, the final
    mixer and the head."""
    n = cfg.num_layers
    out = [HFTensor("embed_tokens/embedding", "model.embed_tokens.weight", split=1, vocab_axis=0)]
    if not cfg.tie_word_embeddings:
        out.append(linear("lm_head/kernel", "lm_head.weight", vocab_axis=1))
    out += per_kind(cfg.per_layer_types, lambda kind: _mixer(cfg, kind, n))
    for name in ("attn_hyper_connection", "mlp_hyper_connection"):
        out += _hyper(f"layers_{{i}}/{name}", f"model.layers.{{i}}.{name}", n)
    out += _hyper("hyper_connection_mixer", "model.hyper_connection_mixer", 0, combine=False)
    return out + qwen_moe.moe_hf_tensors(cfg, "model.layers.{i}.mlp") + _ple(cfg)


HF_SPEC = register_hf(
    HFSpec(
        model_types=(MODEL_TYPE,),
        multimodal=MULTIMODAL,
        config_cls=Qwen4ExpConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        # The PLE buffers (derived from the config: `buffers`) and the MTP layer.
        ignore=(
            *llama.HF_SPEC.ignore,
            r"^mtp\.",
            r"\.ple_embedding\.(layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets)$",
        ),
        buffers=lambda cfg: buffers(cfg, "model.layers.{i}"),
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        renames=LANGUAGE_MODEL_RENAMES,
        skip=(r"^model\.visual\.",),
    )
)
