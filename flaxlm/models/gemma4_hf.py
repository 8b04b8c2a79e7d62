"""Gemma 4 (text) as HuggingFace's `Gemma4ForCausalLM` holds it: config.json <->
`gemma4.Gemma4Config` (transformers' defaults for the fields a file leaves out, settings
flaxlm cannot run refused naming them) and the tensor table (records per kind of layer,
stacked when the layers scan)."""

from __future__ import annotations

from typing import Any

from flaxlm.models import llama, qwen_moe
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.gemma4 import GLOBAL, LAYER_TYPES, ROPE_FIELDS, ROPE_TYPES, SLIDING, Gemma4Config
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

ARCHITECTURE = "Gemma4ForCausalLM"
# transformers' defaults of the fields a config.json may leave out.
HF_DEFAULTS = dict(
    vocab_size=262144,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    sliding_window=512,
    final_logit_softcapping=None,
    attention_bias=False,
    tie_word_embeddings=True,
    vocab_size_per_layer_input=262144,
    hidden_size_per_layer_input=256,
    attention_k_eq_v=False,
    num_kv_shared_layers=0,
    use_double_wide_mlp=False,
    enable_moe_block=False,
)
# config.json field -> Gemma4Config field, for those that map one to one.
HF_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "sliding_window": "sliding_window",
    "final_logit_softcapping": "final_logit_softcapping",
    "attention_bias": "attention_bias",
    "tie_word_embeddings": "tie_word_embeddings",
    "vocab_size_per_layer_input": "vocab_size_per_layer_input",
    "hidden_size_per_layer_input": "hidden_size_per_layer_input",
    "attention_k_eq_v": "attention_k_eq_v",
    "num_kv_shared_layers": "num_kv_shared_layers",
    "use_double_wide_mlp": "use_double_wide_mlp",
    "enable_moe_block": "enable_moe_block",
}
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    GLOBAL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
}


def layer_types_from_hf(hf: dict) -> tuple[str, ...]:
    """HF's layer types: given or 5 sliding to 1 global, the last forced global (as HF)."""
    n = hf["num_hidden_layers"]
    types = list(hf.get("layer_types") or [])
    if not types:
        types = [GLOBAL if (i + 1) % 6 == 0 else SLIDING for i in range(n)]
    types[-1] = GLOBAL
    return tuple(types)


def global_shape_from_hf(hf: dict, types: tuple[str, ...]) -> dict[str, Any]:
    """global_head_dim and num_global_kv_heads from `global_head_dim` /
    `num_global_key_value_heads`, or from the `per_layer_config` transformers 5.23 writes
    (overrides of head_dim / num_key_value_heads, those equal to the globals left out): every
    global layer must come out alike, every sliding one as the globals."""
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        heads = hf.get("num_global_key_value_heads") if hf["attention_k_eq_v"] else None
        return dict(global_head_dim=hf.get("global_head_dim", 512), num_global_kv_heads=heads)
    plain = {"head_dim": hf["head_dim"], "num_key_value_heads": hf["num_key_value_heads"]}
    # Keyed by layer index, zero-padded to the widest where transformers writes 10 or more
    # layers ("05"); it reads them back with int().
    by_layer = {int(k): v for k, v in per_layer.items()}
    shapes = {t: set() for t in LAYER_TYPES}
    for i, kind in enumerate(types):
        override = dict(by_layer.get(i, {}))
        if set(override) - set(plain):
            raise ValueError(
                f"per_layer_config {per_layer}: only head_dim and num_key_value_heads are "
                "supported."
            )
        shapes[kind].add(tuple({**plain, **override}.values()))
    if len(shapes[GLOBAL]) > 1 or shapes[SLIDING] - {tuple(plain.values())}:
        raise ValueError(
            f"per_layer_config {per_layer}: flaxlm's Gemma 4 takes one shape for every "
            "full_attention layer and the config's own for sliding ones."
        )
    (head_dim, heads), *_ = shapes[GLOBAL] or [tuple(plain.values())]
    if heads != hf["num_key_value_heads"] and not hf["attention_k_eq_v"]:
        raise ValueError(
            f"per_layer_config {per_layer}: other key/value heads on global layers need "
            "attention_k_eq_v."
        )
    return dict(global_head_dim=head_dim, num_global_kv_heads=heads)


def rope_from_hf(hf: dict, types: tuple[str, ...]) -> dict[str, Any]:
    params = hf.get("rope_parameters") or DEFAULT_ROPE
    out: dict[str, Any] = {}
    for kind, fields in ROPE_FIELDS.items():
        rope = params.get(kind)
        if rope is None:
            if kind in types:
                raise ValueError(f"rope_parameters {params}: no entry for {kind!r} layers.")
            continue
        if rope.get("rope_type", "default") not in ROPE_TYPES:
            raise ValueError(
                f"rope_parameters[{kind!r}] {rope}: rope_type must be one of {ROPE_TYPES}."
            )
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default" and (rope.get("factor", 1.0) != 1.0):
            raise ValueError(f"rope_parameters[{kind!r}] {rope}: 'default' takes no factor.")
        values = (
            rope_type,
            rope["rope_theta"],
            rope.get("partial_rotary_factor", 1.0) if rope_type == "proportional" else 1.0,
            rope.get("factor", 1.0),
        )
        out.update(zip(fields, values))
    return out


def config_from_hf(hf: dict, **overrides: Any) -> Gemma4Config:
    """The config of a Gemma 4 text config.json (a multimodal `gemma4` one: its text_config),
    fields it leaves out at transformers' defaults."""
    hf = text_tower(hf)  # Gemma4ForConditionalGeneration's: its text_config
    # 'vision' makes image tokens see each other: text alone is causal all the same.
    if hf.get("use_bidirectional_attention") not in (None, "vision"):
        raise ValueError(
            f"use_bidirectional_attention={hf['use_bidirectional_attention']!r} is not "
            "supported: Gemma 4 text is causal here (None or 'vision')."
        )
    hf = {**HF_DEFAULTS, **hf}
    types = layer_types_from_hf(hf)
    kwargs = {ours: hf[theirs] for theirs, ours in HF_FIELDS.items()}
    kwargs.update(
        layer_types=types,
        activation=hf.get("hidden_activation") or "gelu_pytorch_tanh",
        **global_shape_from_hf(hf, types),
        **rope_from_hf(hf, types),
    )
    if hf["enable_moe_block"]:
        kwargs.update(
            num_experts=hf["num_experts"],
            num_experts_per_tok=hf["top_k_experts"],
            moe_intermediate_size=hf["moe_intermediate_size"],
        )
    kwargs.update(overrides)
    return Gemma4Config(**kwargs)


def config_to_hf(cfg: Gemma4Config) -> dict:
    """A Gemma4ForCausalLM config.json (layer types spelled out)."""
    out = {theirs: getattr(cfg, ours) for theirs, ours in HF_FIELDS.items()}
    rope = {}
    for kind, fields in ROPE_FIELDS.items():
        rope_type, theta, partial, factor = (getattr(cfg, f) for f in fields)
        rope[kind] = {"rope_type": rope_type, "rope_theta": theta}
        if rope_type == "proportional":
            rope[kind]["partial_rotary_factor"] = partial
            if factor != 1.0:
                rope[kind]["factor"] = factor
    out.update(
        model_type="gemma4_text",
        architectures=[ARCHITECTURE],
        vocab_size=cfg.real_vocab_size or cfg.vocab_size,
        rope_parameters=rope,
        layer_types=list(cfg.per_layer_types),
        global_head_dim=cfg.global_head_dim,
        attention_dropout=0.0,
        hidden_activation=cfg.activation,
    )
    if cfg.enable_moe_block:
        out.update(
            num_experts=cfg.num_experts,
            top_k_experts=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
        )
    if cfg.attention_k_eq_v and cfg.num_global_kv_heads is not None:
        out["num_global_key_value_heads"] = cfg.num_global_kv_heads
    return out


def hf_tensors(cfg: Gemma4Config) -> list[HFTensor]:
    """The embeddings, the per-layer input projection, the final norm, then each kind of
    layer's records (its type, whether it has keys and values of its own; `per_kind`), which
    a scan of the types' cycle stacks."""
    out = [HFTensor("embed_tokens/embedding", "model.embed_tokens.weight", 1, vocab_axis=0)]
    out.append(HFTensor("norm/scale", "model.norm.weight"))
    if not cfg.tie_word_embeddings:
        out.append(linear("lm_head/kernel", "lm_head.weight", vocab_axis=1))
    if cfg.hidden_size_per_layer_input:
        out += [
            HFTensor("embed_tokens_per_layer/embedding", "model.embed_tokens_per_layer.weight", 1),
            linear("per_layer_model_projection/kernel", "model.per_layer_model_projection.weight"),
            HFTensor("per_layer_projection_norm/scale", "model.per_layer_projection_norm.weight"),
        ]
    types, sources = cfg.per_layer_types, cfg.kv_sources
    kinds = [(types[i], sources[i] == i) for i in range(cfg.num_layers)]
    return out + per_kind(kinds, lambda kind: layer_tensors(cfg, *kind))


def layer_tensors(cfg: Gemma4Config, kind: str, own_kv: bool) -> list[HFTensor]:
    """The `{i}` records of a layer of type `kind` (`own_kv`: not KV-shared)."""
    ours, hf, n = "layers_{i}", "model.layers.{i}", cfg.num_layers
    out: list[HFTensor] = []
    names = ["q_proj"]
    if own_kv:
        names.append("k_proj")
        if not (cfg.attention_k_eq_v and kind == GLOBAL):
            names.append("v_proj")
    for p in names:
        out.append(linear(f"{ours}/{p}/kernel", f"{hf}.self_attn.{p}.weight", layers=n))
        if cfg.attention_bias:
            out.append(HFTensor(f"{ours}/{p}/bias", f"{hf}.self_attn.{p}.bias", layers=n))
    out.append(linear(f"{ours}/o_proj/kernel", f"{hf}.self_attn.o_proj.weight", 2, layers=n))
    if cfg.attention_bias:
        out.append(HFTensor(f"{ours}/o_proj/bias", f"{hf}.self_attn.o_proj.bias", layers=n))
    norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"]
    norms += ["post_feedforward_layernorm", "self_attn.q_norm"]
    norms += ["self_attn.k_norm"] if own_kv else []
    mlp = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    if cfg.hidden_size_per_layer_input:
        norms.append("post_per_layer_input_norm")
        mlp += ["per_layer_input_gate", "per_layer_projection"]
    for name in norms:
        out.append(HFTensor(f"{ours}/{name.split('.')[-1]}/scale", f"{hf}.{name}.weight", layers=n))
    for p in mlp:
        out.append(linear(f"{ours}/{p.split('.')[-1]}/kernel", f"{hf}.{p}.weight", layers=n))
    out.append(HFTensor(f"{ours}/layer_scalar/scale", f"{hf}.layer_scalar", layers=n))
    return out + (moe_tensors(ours, hf, n) if cfg.enable_moe_block else [])


def moe_tensors(ours: str, hf: str, n: int) -> list[HFTensor]:
    """A layer's router, experts (fused, as transformers 5 holds them) and their norms."""
    out = [
        HFTensor(f"{ours}/router/scale", f"{hf}.router.scale", layers=n),
        HFTensor(f"{ours}/moe/per_expert_scale", f"{hf}.router.per_expert_scale", layers=n),
        linear(f"{ours}/moe/gate/kernel", f"{hf}.router.proj.weight", layers=n),
        HFTensor(
            f"{ours}/moe/experts/wi",
            f"{hf}.experts.gate_up_proj",
            layers=n,
            to_hf=qwen_moe.wi_to_hf,
            to_flax=qwen_moe.wi_from_hf,
        ),
        HFTensor(
            f"{ours}/moe/experts/wo",
            f"{hf}.experts.down_proj",
            layers=n,
            to_hf=qwen_moe.wo_to_hf,
            to_flax=qwen_moe.wo_from_hf,
        ),
    ]
    norms = ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2")
    norms += ("pre_feedforward_layernorm_2",)
    return out + [HFTensor(f"{ours}/{m}/scale", f"{hf}.{m}.weight", layers=n) for m in norms]


HF_SPEC = register_hf(
    HFSpec(
        model_types=("gemma4_text",),
        # Gemma4ForConditionalGeneration: its LM head its own, tied by default.
        multimodal=(Multimodal("gemma4", "gemma4_text", tied=True),),
        config_cls=Gemma4Config,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        # Gemma4ForConditionalGeneration: the text tower, as its modules name it; the vision
        # and audio towers and their embedders are skipped.
        renames=LANGUAGE_MODEL_RENAMES,
        skip=(r"^model\.(vision_tower|audio_tower|embed_vision|embed_audio)\.",),
    )
)
