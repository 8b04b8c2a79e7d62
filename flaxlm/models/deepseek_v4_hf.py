"""DeepSeek-V4 (`deepseek_v4.py`) from and to HuggingFace files: config.json and the
tensor table.

Tensors are written with transformers' in-memory names (the experts as the Hub's pieces,
`mlp.experts.{e}.w1/w3/w2`), which transformers reads; files in DeepSeek's own spelling (the
Hub's, and what transformers' `save_pretrained` writes back: `attn.wq_a`, `ffn.experts.{e}.w1`,
`hc_attn_fn`, ...) are read through `STORED_NAMES`. The Hub's multi-token-prediction layers
(`mtp.{k}.*`, in DeepSeek's spelling only: transformers skips them) are skipped unless the
config asks for them (`num_mtp_layers`, e.g. `hf.from_pretrained(path, num_mtp_layers=1)`),
then read and written back in that spelling (`mtp_tensors`); their attention kinds come from
config.json's `mtp_layer_types`, else the tail of its `compress_ratios`, else sliding-window.

Refused (a ValueError naming the key): settings HF's model ignores or hard-wires where
config.json says otherwise (`num_key_value_heads` other than 1, `n_shared_experts` other than
1, `norm_topk_prob` false, `attention_bias`, `mlp_bias`, `router_jitter_noise`), a
`scoring_func` HF's router cannot run, a 'main' rotary with scaling, a `quantization_config`
(load a dequantized copy), `attention_dropout` (no dropout in flaxlm's V4).
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from flaxlm.models import deepseek_v4, mtp_hf, qwen_moe, rope
from flaxlm.models.deepseek_v4_attention import CSA, HCA, SLIDING
from flaxlm.models.hf_spec import HFSpec, HFTensor, linear, per_kind, register_hf

# transformers' DeepseekV4Config defaults, for keys a config.json omits.
HF_DEFAULTS = dict(
    vocab_size=129280,
    hidden_size=4096,
    moe_intermediate_size=2048,
    num_hidden_layers=43,
    num_attention_heads=64,
    head_dim=512,
    q_lora_rank=1024,
    num_experts_per_tok=6,
    n_routed_experts=256,
    scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    max_position_embeddings=1048576,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    swiglu_limit=10.0,
    sliding_window=128,
    o_groups=8,
    o_lora_rank=1024,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
COMPRESS_RATES = {CSA: 4, HCA: 128}
# Keys whose config.json value must be HF's hard-wired one (HF ignores any other).
FIXED = dict(
    num_key_value_heads=1,
    n_shared_experts=1,
    norm_topk_prob=True,
    attention_bias=False,
    mlp_bias=False,
    router_jitter_noise=0.0,
    attention_dropout=0.0,
)
LEGACY_RATIOS = {0: SLIDING, 4: CSA, 128: HCA}  # `compress_ratios`, per layer

# DeepSeek's names (the Hub's files, transformers' save_pretrained) -> transformers' in-memory
# names, under `layers.{i}.` (transformers' `conversion_mapping` for deepseek_v4, resolved).
_INDEXER = "self_attn.compressor.indexer"
_LAYER_NAMES = {
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.norm.weight": "self_attn.kv_norm.weight",  # transformers' save_pretrained
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",  # the Hub's release (written back)
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.indexer.wq_b.weight": f"{_INDEXER}.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": f"{_INDEXER}.scorer.weights_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
for _ours, _theirs in (
    ("self_attn.compressor", "attn.compressor"),
    (_INDEXER, "attn.indexer.compressor"),
):
    _LAYER_NAMES.update(
        {
            f"{_theirs}.wkv.weight": f"{_ours}.kv_proj.weight",
            f"{_theirs}.wgate.weight": f"{_ours}.gate_proj.weight",
            f"{_theirs}.ape": f"{_ours}.position_bias",
            f"{_theirs}.norm.weight": f"{_ours}.kv_norm.weight",
        }
    )
for _hc, _theirs in (("attn_hc", "hc_attn"), ("ffn_hc", "hc_ffn")):
    _LAYER_NAMES.update({f"{_theirs}_{p}": f"{_hc}.{p}" for p in ("fn", "base", "scale")})
LAYER = r"^(?:model\.)?layers\.(\d+)\."
STORED_NAMES = (
    *(
        (LAYER + theirs.replace(".", r"\.") + "$", rf"model.layers.\1.{ours}")
        for theirs, ours in _LAYER_NAMES.items()
    ),
    (
        LAYER + r"ffn\.experts\.(\d+)\.(w[123])\.weight$",
        r"model.layers.\1.mlp.experts.\2.\3.weight",
    ),
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    *((rf"^(?:model\.)?hc_head_{p}$", f"model.hc_head.hc_{p}") for p in ("fn", "base", "scale")),
)


# transformers' in-memory names under `layers.{i}.` -> DeepSeek's (the release's, where two
# spellings read: the Hub's `mtp.{k}.` names).
_DEEPSEEK_NAMES = {ours: theirs for theirs, ours in _LAYER_NAMES.items()}


def deepseek_name(ours: str) -> str:
    """A layer's tensor name (after `layers.{i}.`) in DeepSeek's spelling."""
    if ours.startswith("mlp.experts."):
        return "ffn." + ours[len("mlp.") :]
    return _DEEPSEEK_NAMES[ours]


def mtp_layer_types_from_hf(hf: dict, n: int, depths: int) -> tuple[str, ...] | None:
    """The MTP layers' attention kinds: config.json's `mtp_layer_types`, or the entries of
    its `compress_ratios` after the `n` decoder layers' (DeepSeek's files hold one more, 0,
    for the MTP layer); None (sliding-window) where neither says."""
    kinds = hf.get("mtp_layer_types")
    ratios = hf.get("compress_ratios") or []
    if kinds is None and len(ratios) >= n + depths:
        kinds = [LEGACY_RATIOS[r] for r in ratios[n : n + depths]]
    return None if kinds is None or not depths else tuple(kinds[:depths])


def layer_types_from_hf(hf: dict, n: int) -> tuple[str, ...] | None:
    """`layer_types`, or the legacy per-layer `compress_ratios` (0 / 4 / 128); None: HF's
    default pattern (the config resolves it)."""
    kinds = hf.get("layer_types")
    if kinds is None and hf.get("compress_ratios") is not None:
        ratios = hf["compress_ratios"]
        if not set(ratios) <= set(LEGACY_RATIOS):
            raise ValueError(f"compress_ratios {ratios}: each one of {sorted(LEGACY_RATIOS)}.")
        kinds = [LEGACY_RATIOS[r] for r in ratios]
    return None if kinds is None else tuple(kinds[:n])


def rope_fields_from_hf(hf: dict, rope_dim: int, head_dim: int) -> dict[str, Any]:
    """The rotaries' fields: the 'main' one's theta (no scaling), the 'compress' one's theta
    and scaling (YaRN's attention factor 1, as HF's config forces)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    nested = isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)
    compress_theta = hf.get("compress_rope_theta", HF_DEFAULTS["compress_rope_theta"])
    if nested:
        main, compress = params["main"], dict(params["compress"])
        compress.setdefault("rope_theta", compress_theta)
    else:  # HF: the flat dict is the compress rotary's scaling, at compress_rope_theta
        main = {"rope_type": "default"}
        compress = {**params, "rope_theta": compress_theta}
    for label, sub in (("main", main), ("compress", compress)):
        factor = sub.get("partial_rotary_factor")
        if factor is not None and int(head_dim * factor) != rope_dim:
            raise ValueError(
                f"rope_parameters[{label!r}] partial_rotary_factor {factor}: both rotaries "
                f"cover qk_rope_head_dim ({rope_dim}) features in flaxlm."
            )
    if main.get("rope_type", main.get("type", "default")) != "default":
        raise ValueError("rope_parameters['main'] rope_type: HF's V4 'main' rotary is unscaled.")
    theta = main.get("rope_theta", hf.get("rope_theta", HF_DEFAULTS["rope_theta"]))
    if compress.get("rope_type", compress.get("type")) == "yarn":
        compress.setdefault("attention_factor", 1.0)
    fields = rope.from_hf(
        {
            "rope_parameters": compress,
            "max_position_embeddings": hf.get(
                "max_position_embeddings", HF_DEFAULTS["max_position_embeddings"]
            ),
        }
    )
    fields["compress_rope_theta"] = fields.pop("rope_theta")
    return dict(fields, rope_theta=float(theta))


def config_from_hf(hf: dict, **overrides: Any) -> deepseek_v4.DeepseekV4Config:
    """A DeepseekV4Config from a config.json dict (+ field overrides)."""
    get = lambda key: hf.get(key, HF_DEFAULTS[key])  # noqa: E731
    for key, value in FIXED.items():
        if hf.get(key, value) != value:
            raise ValueError(
                f"{key} {hf[key]!r} in config.json: HF's DeepseekV4ForCausalLM has {value!r} "
                "only (it ignores the key)."
            )
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method")
        raise ValueError(
            f"config.json's quantization_config ({method!r}): flaxlm reads DeepSeek-V4 files "
            "unquantized only; load a dequantized copy."
        )
    n, head_dim = get("num_hidden_layers"), get("head_dim")
    factor = hf.get("partial_rotary_factor")
    rope_dim = int(head_dim * factor) if factor else hf.get("qk_rope_head_dim", head_dim // 8)
    rates = {**COMPRESS_RATES, **(hf.get("compress_rates") or {})}
    rates[CSA] = hf.get("compress_rate_csa", rates[CSA])
    rates[HCA] = hf.get("compress_rate_hca", rates[HCA])
    mlp_kinds = hf.get("mlp_layer_types")
    if mlp_kinds is None and hf.get("num_hash_layers") is not None:
        k = hf["num_hash_layers"]
        mlp_kinds = ["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k)
    coef = hf.get("router_aux_loss_coef", 0.001) if hf.get("output_router_logits") else 0.0
    kwargs = dict(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        num_layers=n,
        num_heads=get("num_attention_heads"),
        head_dim=head_dim,
        q_lora_rank=get("q_lora_rank"),
        qk_rope_head_dim=rope_dim,
        max_position_embeddings=get("max_position_embeddings"),
        rms_norm_eps=get("rms_norm_eps"),
        layer_types=layer_types_from_hf(hf, n),
        csa_compress_rate=rates[CSA],
        hca_compress_rate=rates[HCA],
        sliding_window=get("sliding_window"),
        **{k: get(k) for k in ("o_groups", "o_lora_rank", "index_n_heads", "index_head_dim")},
        **{k: get(k) for k in ("index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps")},
        mlp_layer_types=None if mlp_kinds is None else tuple(mlp_kinds[:n]),
        scoring_func=get("scoring_func"),
        tie_word_embeddings=get("tie_word_embeddings"),
        activation=get("hidden_act"),
        num_experts=hf.get("n_routed_experts", hf.get("num_local_experts", 256)),
        num_experts_per_tok=get("num_experts_per_tok"),
        moe_intermediate_size=get("moe_intermediate_size"),
        routed_scaling_factor=float(get("routed_scaling_factor")),
        swiglu_limit=get("swiglu_limit"),
        router_aux_loss_coef=coef,
        **rope_fields_from_hf(hf, rope_dim, head_dim),
    )
    nextn = hf.get("num_nextn_predict_layers", 1)  # HF's default; read where asked for
    kwargs["mtp_layer_types"] = mtp_layer_types_from_hf(hf, n, nextn)
    kwargs.update(overrides)
    return deepseek_v4.DeepseekV4Config(**kwargs)


def config_to_hf(cfg: deepseek_v4.DeepseekV4Config) -> dict:
    """config.json for `cfg` (its MTP layers' count and kinds included)."""
    compress = rope.to_hf(dataclass_view(cfg))
    compress["partial_rotary_factor"] = cfg.qk_rope_head_dim / cfg.head_dim
    if cfg.rope_scaling_type == "yarn":
        compress.setdefault("attention_factor", cfg.rope_attention_factor or 1.0)
    main = dict(rope_type="default", rope_theta=cfg.rope_theta)
    main["partial_rotary_factor"] = compress["partial_rotary_factor"]
    return {
        "model_type": cfg.model_type,
        "architectures": [cfg.architecture],
        "vocab_size": cfg.real_vocab_size or cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "partial_rotary_factor": compress["partial_rotary_factor"],
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta,
        "rope_parameters": {"main": main, "compress": compress},
        "layer_types": list(cfg.layer_types),
        "compress_rates": {CSA: cfg.csa_compress_rate, HCA: cfg.hca_compress_rate},
        "mlp_layer_types": list(cfg.mlp_layer_types),
        **{k: getattr(cfg, k) for k in ("sliding_window", "o_groups", "o_lora_rank")},
        **{k: getattr(cfg, k) for k in ("index_n_heads", "index_head_dim", "index_topk")},
        **{k: getattr(cfg, k) for k in ("hc_mult", "hc_sinkhorn_iters", "hc_eps")},
        "scoring_func": cfg.scoring_func,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "swiglu_limit": cfg.swiglu_limit,
        "hidden_act": cfg.activation,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "output_router_logits": bool(cfg.router_aux_loss_coef),
        "router_aux_loss_coef": cfg.router_aux_loss_coef or 0.001,
        "num_nextn_predict_layers": cfg.num_mtp_layers,
        **({"mtp_layer_types": list(cfg.mtp_kinds())} if cfg.num_mtp_layers else {}),
    }


def dataclass_view(cfg: deepseek_v4.DeepseekV4Config) -> Any:
    """`cfg` as `rope.to_hf` reads the 'compress' rotary (its theta as `rope_theta`)."""
    fields = {name: getattr(cfg, name) for name in dir(cfg) if name.startswith("rope_")}
    return types.SimpleNamespace(**{**fields, "rope_theta": cfg.compress_rope_theta})


def o_a_to_hf(kernel: np.ndarray) -> np.ndarray:
    """`o_a_proj/kernel` `[groups, in, rank]` -> HF's `[groups x rank, in]`."""
    g, i, r = kernel.shape
    return kernel.transpose(0, 2, 1).reshape(g * r, i)


def o_a_from_hf(weight: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    g, i, r = shape
    return weight.reshape(g, r, i).transpose(0, 2, 1)


def pooled_tensors(scope: str, module: str, n: int) -> list[HFTensor]:
    """A compression's params (`deepseek_v4_attention.pooled_windows`)."""
    table = [
        linear(f"{scope}/{p}/kernel", f"{module}.{p}.weight", layers=n)
        for p in ("kv_proj", "gate_proj")
    ]
    return table + [
        HFTensor(f"{scope}/position_bias", f"{module}.position_bias", split=1, layers=n),
        HFTensor(f"{scope}/kv_norm/scale", f"{module}.kv_norm.weight", layers=n),
    ]


def layer_tensors(
    cfg: deepseek_v4.DeepseekV4Config, i: str, kind: str, mlp: str, n: int
) -> list[HFTensor]:
    """One layer's records (`i`: its number, or '{i}' for `n` layers alike)."""
    scope, prefix = f"layers_{i}", f"model.layers.{i}"
    attn, a = f"{scope}/self_attn", f"{prefix}.self_attn"
    table = [
        linear(f"{attn}/{p}/kernel", f"{a}.{p}.weight", layers=n)
        for p in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")
    ]
    table += [
        HFTensor(f"{attn}/{p}/scale", f"{a}.{p}.weight", layers=n) for p in ("q_a_norm", "kv_norm")
    ]
    table += [
        HFTensor(f"{attn}/sinks/logits", f"{a}.sinks", layers=n),
        HFTensor(
            f"{attn}/o_a_proj/kernel",
            f"{a}.o_a_proj.weight",
            layers=n,
            to_hf=o_a_to_hf,
            to_flax=o_a_from_hf,
        ),
    ]
    if kind != SLIDING:
        table += pooled_tensors(f"{attn}/compressor", f"{a}.compressor", n)
    if kind == CSA:
        ours, theirs = f"{attn}/compressor/indexer", f"{a}.compressor.indexer"
        table += pooled_tensors(ours, theirs, n)
        table += [
            linear(f"{ours}/q_b_proj/kernel", f"{theirs}.q_b_proj.weight", layers=n),
            linear(
                f"{ours}/scorer/weights_proj/kernel",
                f"{theirs}.scorer.weights_proj.weight",
                layers=n,
            ),
        ]
    for hc in ("attn_hc", "ffn_hc"):
        table += [
            linear(f"{scope}/{hc}/mix/fn/kernel", f"{prefix}.{hc}.fn", layers=n),
            *(
                HFTensor(f"{scope}/{hc}/mix/{p}", f"{prefix}.{hc}.{p}", layers=n)
                for p in ("base", "scale")
            ),
        ]
    table += [
        HFTensor(f"{scope}/{p}/scale", f"{prefix}.{p}.weight", layers=n)
        for p in ("input_layernorm", "post_attention_layernorm")
    ]
    m, ours = f"{prefix}.mlp", f"{scope}/mlp"
    table += [
        linear(f"{ours}/gate/kernel", f"{m}.gate.weight", layers=n),
        HFTensor(
            f"{ours}/experts/wi",
            f"{m}.experts.gate_up_proj",
            layers=n,
            to_hf=qwen_moe.wi_to_hf,
            to_flax=qwen_moe.wi_from_hf,
            pieces=(f"{m}.experts.{{e}}.w1.weight", f"{m}.experts.{{e}}.w3.weight"),
            experts=cfg.num_experts,
        ),
        HFTensor(
            f"{ours}/experts/wo",
            f"{m}.experts.down_proj",
            layers=n,
            to_hf=qwen_moe.wo_to_hf,
            to_flax=qwen_moe.wo_from_hf,
            pieces=(f"{m}.experts.{{e}}.w2.weight",),
            experts=cfg.num_experts,
        ),
        *(
            linear(f"{ours}/shared_experts/{p}/kernel", f"{m}.shared_experts.{p}.weight", layers=n)
            for p in qwen_moe.SWIGLU
        ),
    ]
    if mlp == "hash_moe":
        table.append(
            HFTensor(
                f"{ours}/tid2eid",
                f"{m}.gate.tid2eid",
                split=1,
                layers=n,
                vocab_axis=0,
                to_hf=lambda t: t.astype(np.int64),
                to_flax=lambda t, shape: t.astype(np.float32).reshape(shape),
            )
        )
    else:
        table.append(
            HFTensor(
                f"{ours}/e_score_correction_bias", f"{m}.gate.e_score_correction_bias", layers=n
            )
        )
    return table


def hf_tensors(cfg: deepseek_v4.DeepseekV4Config) -> list[HFTensor]:
    """The embedding, head, final hyper-head and norm, and every layer's records (one
    record a tensor for the layers of each (attention, MoE) kind, `HFTensor.only`, so a
    scanned stack reads)."""
    table = [
        HFTensor("embed_tokens/embedding", "model.embed_tokens.weight", split=1, vocab_axis=0),
        HFTensor("norm/scale", "model.norm.weight"),
        linear("hc_head/mix/fn/kernel", "model.hc_head.hc_fn"),
        HFTensor("hc_head/mix/base", "model.hc_head.hc_base"),
        HFTensor("hc_head/mix/scale", "model.hc_head.hc_scale"),
    ]
    if not cfg.tie_word_embeddings:
        table.append(linear("lm_head/kernel", "lm_head.weight", vocab_axis=1))
    table += per_kind(
        cfg.scan_kinds(), lambda kind: layer_tensors(cfg, "{i}", *kind, cfg.num_layers)
    )
    return table + mtp_tensors(cfg)


def mtp_tensors(cfg: deepseek_v4.DeepseekV4Config) -> list[HFTensor]:
    """The records of `cfg`'s MTP layers in DeepSeek's spelling (`mtp.{k}.attn.wq_a.weight`,
    `mtp.{k}.e_proj.weight`, `mtp.{k}.hc_head_fn`, ...): each one's block as a decoder layer's
    (`layer_tensors`), its norms, projections and hyper-head."""
    out = []
    for k in range(cfg.num_mtp_layers):
        scope, prefix = f"mtp_{k}", f"mtp.{k}"
        spelled = lambda name, k=k: f"mtp.{k}." + deepseek_name(name.split(".", 3)[3])  # noqa: E731
        block = cfg.mtp_block_config(k)
        table = layer_tensors(block, "{i}", block.layer_types[0], "moe", 1)
        out += mtp_hf.relayered(table, f"{scope}/block", 0, spelled)
        out += [
            *(HFTensor(f"{scope}/{p}/scale", f"{prefix}.{p}.weight") for p in NORMS),
            *(linear(f"{scope}/{p}/kernel", f"{prefix}.{p}.weight") for p in ("e_proj", "h_proj")),
            linear(f"{scope}/hc_head/mix/fn/kernel", f"{prefix}.hc_head_fn"),
            HFTensor(f"{scope}/hc_head/mix/base", f"{prefix}.hc_head_base"),
            HFTensor(f"{scope}/hc_head/mix/scale", f"{prefix}.hc_head_scale"),
        ]
    return out


NORMS = ("enorm", "hnorm", "norm")  # an MTP layer's, beside its block's
MTP_FILES = r"^(?:model\.)?mtp\."


HF_SPEC = register_hf(
    HFSpec(
        model_types=("deepseek_v4",),
        config_cls=deepseek_v4.DeepseekV4Config,
        model_cls=deepseek_v4.DeepseekV4LM,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=(r"rotary_emb\.", r"^lm_head\.weight$"),
        base_model_prefix="model",
        tied_head=("lm_head.weight", "model.embed_tokens.weight"),
        renames=STORED_NAMES,
        skip=(MTP_FILES,),
        # The MTP layers are read where the config has them (`num_mtp_layers`).
        config_fields=lambda cfg: {"skip": ()} if cfg.num_mtp_layers else {},
    )
)
