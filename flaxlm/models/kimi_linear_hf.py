"""Kimi Linear from and to HuggingFace (`kimi_linear.py`'s family): the config.json fields as
transformers' `KimiLinearConfig` resolves them, and each layer's tensors as the Hub's files
(and transformers' `save_pretrained`) store them: a linear layer's `q_conv1d`, `k_conv1d`,
`v_conv1d` apart and its forget gate's `f_a_proj`, `f_b_proj`, `A_log`, `dt_bias` under
`self_attn`; every MLP under `block_sparse_moe`, the experts one by one (`w1`, `w3`, `w2`).
transformers' in-memory names of the MLPs (`mlp.`, the experts fused) and of the forget gate
(`forget_gate.`) read too; its fused `conv1d` does not (no file stores it).

Refused where HF's model would run other math than the file's, or fail: `num_key_value_heads`
other than `num_attention_heads`; a `linear_attn_config` key HF does not read (a lower bound
of the gate, a full-rank gate: other models' settings) or a layer it names out of range;
`mla_use_nope` false, `moe_router_activation_func` other than sigmoid and `moe_layer_freq`
other than 1 (the Hub's own code honours them, HF's does not); quantized files but FP8.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flaxlm.models import deepseek, deepseek_v32, llama, qwen3_next_hf
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, linear, per_kind, register_hf
from flaxlm.models.kimi_linear import (
    ARCHITECTURE,
    FULL,
    LINEAR,
    MODEL_TYPE,
    KimiLinearConfig,
    default_layer_types,
)

# transformers' KimiLinearConfig defaults of the config.json fields flaxlm reads.
HF_DEFAULTS = dict(
    vocab_size=163840,
    hidden_size=2304,
    intermediate_size=9216,
    moe_intermediate_size=1024,
    num_hidden_layers=27,
    num_attention_heads=32,
    num_key_value_heads=None,  # None: num_attention_heads
    n_shared_experts=1,
    routed_scaling_factor=2.446,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=1048576,
    rms_norm_eps=1e-5,
    attention_bias=False,
    num_local_experts=256,
    linear_head_dim=128,
    linear_num_heads=32,
    linear_conv_kernel_dim=4,
)
# transformers' attribute_map: the name config.json stores (and transformers writes) a field
# under.
STORED_AS = {
    "max_position_embeddings": "model_max_length",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
}
# The Hub's `linear_attn_config` keys transformers reads (the first three over the fields).
LINEAR_ATTN = {
    "head_dim": "linear_head_dim",
    "num_heads": "linear_num_heads",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
}
LAYER_LISTS = ("full_attn_layers", "kda_layers")  # 1-indexed layers of each kind
# Keys of the Hub's config.json that its own modeling code honours and transformers'
# ignores: the values transformers' math has.
HUB_ONLY = {"mla_use_nope": True, "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1}
EXPERTS = ("w1", "w3", "w2")  # the Hub's names of each expert's gate, up and down


def hf_value(hf: dict, name: str) -> Any:
    """Field `name` of a config.json dict: under its stored name, its own, or the default."""
    stored = STORED_AS.get(name)
    if stored is not None and stored in hf:
        return hf[stored]
    return hf.get(name, HF_DEFAULTS[name])


def check_hub_settings(hf: dict) -> None:
    """ValueErrors naming the config.json setting transformers' model would not honour."""
    for key, value in HUB_ONLY.items():
        if hf.get(key, value) != value:
            raise ValueError(
                f"{key} {hf[key]!r} in config.json: transformers' {ARCHITECTURE} (and flaxlm) "
                f"runs {key} {value!r} only."
            )
    extra = sorted(set(hf.get("linear_attn_config") or {}) - {*LINEAR_ATTN, *LAYER_LISTS})
    if extra:
        raise ValueError(
            f"linear_attn_config's {extra} in config.json: transformers' {ARCHITECTURE} reads "
            f"only {sorted({*LINEAR_ATTN, *LAYER_LISTS})} (and flaxlm runs its math)."
        )
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "fp8", "compressed-tensors"):
        raise ValueError(
            f"config.json's quantization_config quant_method is {quant!r}: flaxlm reads Kimi "
            "Linear files unquantized, in block FP8 or compressed-tensors' formats; load an "
            "unquantized copy."
        )
    heads = hf_value(hf, "num_attention_heads")
    kv_heads = hf_value(hf, "num_key_value_heads") or heads
    if kv_heads != heads:
        raise ValueError(
            f"num_key_value_heads {kv_heads} != num_attention_heads {heads}: latent attention "
            "expands keys and values for every query head (HF's model fails otherwise)."
        )


def layer_types_from_hf(hf: dict, num_layers: int) -> tuple[Any, ...]:
    """Each layer's type as transformers resolves it: `layer_types` (its first
    `num_layers`), else `linear_attn_config`'s 1-indexed `full_attn_layers` and
    `kda_layers` (a layer neither names stays None, which the config refuses), else HF's
    default."""
    if hf.get("layer_types") is not None:
        return tuple(hf["layer_types"][:num_layers])
    linear = hf.get("linear_attn_config") or {}
    if not all(key in linear for key in LAYER_LISTS):
        return default_layer_types(num_layers)
    types: list[str | None] = [None] * num_layers
    for key, kind in zip(LAYER_LISTS, (FULL, LINEAR), strict=True):
        for layer in linear[key]:
            if not 1 <= layer <= num_layers:
                raise ValueError(
                    f"linear_attn_config's {key} names layer {layer}: layers count from 1 to "
                    f"num_hidden_layers ({num_layers})."
                )
            types[layer - 1] = kind
    return tuple(types)


def config_from_hf(hf: dict, **overrides: Any) -> KimiLinearConfig:
    """A KimiLinearConfig from a Kimi Linear config.json dict (+ field overrides), the fields
    it leaves out at transformers' defaults."""
    check_hub_settings(hf)
    get = lambda name: hf_value(hf, name)  # noqa: E731
    linear = hf.get("linear_attn_config") or {}
    n = get("num_hidden_layers")
    kwargs: dict[str, Any] = dict(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        num_layers=n,
        num_heads=get("num_attention_heads"),
        intermediate_size=get("intermediate_size"),
        max_position_embeddings=get("max_position_embeddings"),
        rms_norm_eps=get("rms_norm_eps"),
        activation=get("hidden_act"),
        attention_bias=bool(get("attention_bias")),
        q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
        num_experts=get("num_local_experts"),
        num_experts_per_tok=get("num_experts_per_tok"),
        moe_intermediate_size=get("moe_intermediate_size"),
        norm_topk_prob=bool(get("norm_topk_prob")),
        routed_scaling_factor=float(get("routed_scaling_factor")),
        n_group=get("n_group") or 1,
        topk_group=get("topk_group") or 1,
        n_shared_experts=get("n_shared_experts"),
        # HF's default: the first first_k_dense_replace (1) layers dense.
        mlp_only_layers=deepseek_v32.dense_layers(hf, n, 1),
        layer_types=layer_types_from_hf(hf, n),
        **{ours: linear.get(key, get(ours)) for key, ours in LINEAR_ATTN.items()},
    )
    kwargs.update(overrides)
    return KimiLinearConfig(**kwargs)


def config_to_hf(cfg: KimiLinearConfig) -> dict:
    """The config.json dict under transformers' stored names, with every layer's type and
    MLP kind, and the Hub's `linear_attn_config` beside them."""
    types = cfg.per_layer_types
    out = {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "vocab_size": cfg.real_vocab_size or cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "topk_group": cfg.topk_group,
        "hidden_act": cfg.activation,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": False,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "layer_types": list(types),
        "mlp_layer_types": list(cfg.mlp_layer_types),
        STORED_AS["max_position_embeddings"]: cfg.max_position_embeddings,
        STORED_AS["norm_topk_prob"]: cfg.norm_topk_prob,
        STORED_AS["n_group"]: cfg.n_group,
        STORED_AS["num_local_experts"]: cfg.num_experts,
        STORED_AS["num_experts_per_tok"]: cfg.num_experts_per_tok,
        STORED_AS["n_shared_experts"]: cfg.n_shared_experts,
        **{ours: getattr(cfg, ours) for ours in LINEAR_ATTN.values()},
        "linear_attn_config": {
            **{key: getattr(cfg, ours) for key, ours in LINEAR_ATTN.items()},
            **{
                key: [i + 1 for i, t in enumerate(types) if t == kind]
                for key, kind in zip(LAYER_LISTS, (FULL, LINEAR), strict=True)
            },
        },
    }
    dense = cfg.mlp_only_layers
    if dense == tuple(range(len(dense))):  # the Hub's spelling, where it can say it
        out["first_k_dense_replace"] = len(dense)
    return out


def a_log_to_hf(a_log: np.ndarray) -> np.ndarray:
    """`A_log` `[heads]` -> HF's `[1, 1, heads, 1]`."""
    return a_log.reshape(1, 1, -1, 1)


def mixer_hf_tensors(
    cfg: KimiLinearConfig, kind: str, scope: str, attn: str, n: int
) -> list[HFTensor]:
    """The token mixer of `kind`: params under `scope`, HF tensors under the module `attn`
    (`{i}` in both for `n` layers, else 0: one layer)."""
    if kind == FULL:
        return deepseek.mla_hf_tensors(cfg, scope, attn, n)
    projections = ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "f_b_proj")
    out = [
        linear(f"{scope}/{p}/kernel", f"{attn}.{p}.weight", layers=n)
        for p in (*projections, "g_a_proj", "g_b_proj")
    ]
    out.append(linear(f"{scope}/o_proj/kernel", f"{attn}.o_proj.weight", 2, layers=n))
    conv = dict(to_hf=qwen3_next_hf.conv_to_hf, to_flax=qwen3_next_hf.conv_from_hf, layers=n)
    out += [HFTensor(f"{scope}/conv_{x}", f"{attn}.{x}_conv1d.weight", **conv) for x in "qkv"]
    return out + [
        HFTensor(f"{scope}/A_log", f"{attn}.A_log", to_hf=a_log_to_hf, layers=n),
        HFTensor(f"{scope}/dt_bias", f"{attn}.dt_bias", layers=n),
        HFTensor(f"{scope}/o_norm/scale", f"{attn}.o_norm.weight", layers=n),
    ]


def hf_tensors(cfg: KimiLinearConfig) -> list[HFTensor]:
    """The embedding, each layer's norms, token mixer and MLP, the final norm and head."""
    table = [t for t in llama.hf_tensors_but_mlp(cfg) if ".self_attn." not in t.hf]
    scope, attn = "layers_{i}/self_attn", "model.layers.{i}.self_attn"
    n = cfg.num_layers
    table += per_kind(cfg.per_layer_types, lambda k: mixer_hf_tensors(cfg, k, scope, attn, n))
    return table + deepseek.moe_hf_tensors(cfg, "model.layers.{i}.block_sparse_moe", EXPERTS)


HF_SPEC = register_hf(
    HFSpec(
        model_types=(MODEL_TYPE,),
        config_cls=KimiLinearConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        base_model_prefix="model",
        # transformers' in-memory names (its state dict): the MLPs under `mlp.`, the forget
        # gate's params under `self_attn.forget_gate.`.
        renames=(
            (r"^((?:model\.)?layers\.\d+)\.mlp\.", r"\1.block_sparse_moe."),
            (r"^((?:model\.)?layers\.\d+\.self_attn)\.forget_gate\.", r"\1."),
        ),
    )
)
