"""Gemma 2 and Gemma 3 (text) from and to HuggingFace: logits against transformers' PyTorch
models, and Gemma 3's multimodal checkpoints read for their text tower."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from flaxlm.checkpoints import hf
from flaxlm.models import gemma
from flaxlm.models.options import ComputeOptions
from tests.hf_helpers import (
    check_family,
    decoder_batch,
    gin_config,
    max_abs_diff,
    padded_batch,
    random_hf_model,
    save_torch_model,
    torch_logits,
)

VOCAB = 250
# head_dim 16 is not hidden_size / num_heads (8); a window of 8 is well inside prompt + 30
# generated tokens; a query_pre_attn_scalar unlike head_dim.
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=128,
    sliding_window=8,
    query_pre_attn_scalar=12,
    attention_dropout=0.0,
    initializer_range=0.1,  # sharp enough attention that positions visibly matter
)
# Global layers: linear scaling (as Gemma 3 4B and up) on their own base.
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
}
VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)


def tiny_gemma(family: str, **overrides):
    """A random tiny torch Gemma2ForCausalLM or Gemma3ForCausalLM, norm weights perturbed."""
    config_cls, model_cls = {
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[family]
    return random_hf_model(config_cls, model_cls, **{**TEXT, **overrides})


@pytest.mark.slow
def test_gemma2_keeps_every_promise(tmp_path):
    """Multi-query, soft caps small enough to bite, local and global layers in turn."""
    torch_model = tiny_gemma(
        "gemma2",
        num_hidden_layers=4,
        num_key_value_heads=1,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    )
    path = save_torch_model(torch_model, tmp_path / "gemma2")
    check_family(
        torch_model,
        path,
        VOCAB,
        implementations=("chunked",),
        refused=("jax",),
        tmp_path=tmp_path,
    )
    model, _ = hf.from_pretrained(path)
    assert model.config.layer_windows == (8, None, 8, None)
    assert model.config.attn_logit_softcapping == 5.0 and model.config.tie_word_embeddings


@pytest.mark.slow
def test_gemma3_text_keeps_every_promise(tmp_path):
    """Grouped-query, 5 local layers to 1 global, q/k norms, a rotary base per kind of layer
    (linear scaling on global ones), an untied head."""
    torch_model = tiny_gemma(
        "gemma3",
        num_hidden_layers=6,
        num_key_value_heads=2,
        rope_parameters=GEMMA3_ROPE,
        tie_word_embeddings=False,
    )
    path = save_torch_model(torch_model, tmp_path / "gemma3")
    check_family(torch_model, path, VOCAB, implementations=("jax", "chunked"), tmp_path=tmp_path)
    model, _ = hf.from_pretrained(path)
    config = model.config
    assert config.layer_windows == (8, 8, 8, 8, 8, None) and not config.tie_word_embeddings
    assert (config.rope_theta, config.rope_local_base_freq) == (1e5, 1e3)
    assert (config.rope_scaling_type, config.rope_scaling_factor) == ("linear", 8.0)
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["rope_parameters"] == torch_model.config.rope_parameters


def multimodal(text_model) -> transformers.Gemma3ForConditionalGeneration:
    """A Gemma3ForConditionalGeneration (tiny vision tower) holding `text_model`'s weights."""
    config = transformers.Gemma3Config(
        text_config=text_model.config.to_dict(), vision_config=VISION, mm_tokens_per_image=4
    )
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    return model


@pytest.mark.slow
def test_gemma3_multimodal_checkpoint_loads_its_text_tower(tmp_path, capsys):
    """The text tower of a Gemma3ForConditionalGeneration keeps every promise of the
    Gemma3ForCausalLM with its weights (the export is one); the vision tower is skipped with a
    note. The text_config's final_logit_softcapping is one the multimodal model does not
    apply (transformers' Gemma3ForConditionalGeneration caps nothing): neither does flaxlm."""
    text_model = tiny_gemma(
        "gemma3",
        num_hidden_layers=4,
        num_key_value_heads=1,
        sliding_window_pattern=2,
        final_logit_softcapping=4.0,
    )
    whole = multimodal(text_model)
    path = save_torch_model(whole, tmp_path / "multimodal")
    text_model.config.final_logit_softcapping = None  # the text model the file's model runs
    ids, mask = padded_batch(VOCAB, (12, 7))
    # (O(1) logits through two torch code paths: float32 rounding, ~1e-7; the cap of 4 would
    # move a logit of 0.5 by 5e-3)
    np.testing.assert_allclose(
        torch_logits(whole, input_ids=ids, attention_mask=mask),
        torch_logits(text_model, input_ids=ids, attention_mask=mask),
        rtol=0,
        atol=1e-5,
    )
    names = set(load_file(f"{path}/model.safetensors"))
    # transformers saves the names of the hub's files (transformers 4.50's).
    assert "language_model.model.layers.0.self_attn.q_norm.weight" in names
    assert any(n.startswith("vision_tower.") for n in names)
    check_family(text_model, path, VOCAB, implementations=(), tmp_path=tmp_path)
    assert "tensors the model does not use" in capsys.readouterr().out
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == (
        "gemma3_text"
    )


def test_gemma3_multimodal_checkpoint_with_module_names_and_transformers_4_config(tmp_path):
    """Tensors named as the modules are (`model.language_model.*`, `model.vision_tower.*`,
    `lm_head`) and transformers 4's config.json: a sparse text_config (HF defaults left out),
    rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern in place of
    rope_parameters and layer_types."""
    text_model = tiny_gemma(
        "gemma3",
        num_hidden_layers=4,
        num_key_value_heads=2,
        rope_parameters=GEMMA3_ROPE,
        sliding_window_pattern=2,
    )
    state = multimodal(text_model).state_dict()
    tensors = {name: value.numpy() for name, value in state.items() if name != "lm_head.weight"}
    assert "model.language_model.layers.0.self_attn.q_norm.weight" in tensors
    old = tmp_path / "old"
    old.mkdir()
    save_file(tensors, str(old / "model.safetensors"), metadata={"format": "pt"})
    text_config = {k: TEXT[k] for k in ("vocab_size", "hidden_size", "intermediate_size")}
    text_config.update(
        model_type="gemma3_text",
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=12,
        sliding_window=8,
        sliding_window_pattern=2,
        max_position_embeddings=128,
        rope_theta=1e5,
        rope_local_base_freq=1e3,
        rope_scaling={"factor": 8.0, "rope_type": "linear"},
    )
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}
    config.update(text_config=text_config, vision_config={"model_type": "siglip_vision_model"})
    (old / "config.json").write_text(json.dumps(config))

    model, params = hf.from_pretrained(old, scan_layers=True)
    assert model.config.layer_windows == (8, None, 8, None)
    assert model.config.final_logit_softcapping is None
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    theirs = torch_logits(text_model, input_ids=ids, attention_mask=mask)
    assert (
        max_abs_diff(jax.jit(model.compute_logits)(params, decoder_batch(ids, mask)), theirs, mask)
        < 1e-4
    )


GIN_FILES = {
    "gemma2_tiny": dict(vocab_size=384, model_type="gemma2", sliding_window=128),
    "gemma2_2b": dict(hidden_size=2304, num_layers=26, num_kv_heads=4, head_dim=256),
    "gemma2_9b": dict(hidden_size=3584, num_layers=42, intermediate_size=14336),
    "gemma2_27b": dict(hidden_size=4608, num_layers=46, head_dim=128, query_pre_attn_scalar=144),
    "gemma3_tiny": dict(vocab_size=384, model_type="gemma3_text", num_layers=6),
    "gemma3_1b": dict(vocab_size=262144, hidden_size=1152, num_kv_heads=1, sliding_window=512),
    "gemma3_4b": dict(real_vocab_size=262208, hidden_size=2560, rope_scaling_factor=8.0),
    "gemma3_12b": dict(hidden_size=3840, num_layers=48, num_heads=16, num_kv_heads=8),
    "gemma3_27b": dict(hidden_size=5376, num_layers=62, head_dim=128, query_pre_attn_scalar=168),
}


@pytest.mark.parametrize("name", sorted(GIN_FILES))
def test_gin_model_file_builds_its_config(repo_dir, name):
    config = gin_config(repo_dir, name, gemma.GemmaConfig)
    for field, value in GIN_FILES[name].items():
        assert getattr(config, field) == value, field
    assert config.vocab_size % 128 == 0
    gemma3 = config.model_type == "gemma3_text"
    global_layers = [t == "full_attention" for t in config.per_layer_types]
    assert sum(global_layers) == config.num_layers // (6 if gemma3 else 2)
    assert (config.attn_logit_softcapping is None) == gemma3
    # Past the window, only global layers see more keys.
    w = config.sliding_window
    grown = config.flops_per_token(2 * w) - config.flops_per_token(w)
    assert grown == 12.0 * config.num_heads * config.head_dim * w * sum(global_layers)


# The published config.json files (transformers 4 spellings; the multimodal 4B and 27B keep
# in text_config only what differs from transformers' defaults).
PUBLISHED = {
    "gemma2_2b": {
        "model_type": "gemma2",
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "max_position_embeddings": 8192,
        "num_attention_heads": 8,
        "num_hidden_layers": 26,
        "num_key_value_heads": 4,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "vocab_size": 256000,
    },
    "gemma3_1b": {
        "model_type": "gemma3_text",
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "vocab_size": 262144,
    },
    "gemma3_4b": {
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    },
    "gemma3_27b": {
        "model_type": "gemma3",
        "text_config": {
            "head_dim": 128,
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "model_type": "gemma3_text",
            "num_attention_heads": 32,
            "num_hidden_layers": 62,
            "num_key_value_heads": 16,
            "query_pre_attn_scalar": 168,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    },
}


def architecture(config: gemma.GemmaConfig) -> dict:
    """The fields that shape the model (not how it computes), layer types resolved."""
    skip = {f.name for f in dataclasses.fields(ComputeOptions)}
    skip |= {"vocab_size", "real_vocab_size", "layer_types", "sliding_window_pattern"}
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    out = {k: v for k, v in out.items() if k not in skip}
    return {
        **out,
        "vocab": config.real_vocab_size or config.vocab_size,
        "layers": config.per_layer_types,
    }


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_gin_model_file_matches_the_published_config(repo_dir, name):
    config = gin_config(repo_dir, name, gemma.GemmaConfig)
    assert architecture(config) == architecture(gemma.config_from_hf(PUBLISHED[name]))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
        (dict(layer_types=("sliding_attention",) * 3, num_layers=4), "layer_types"),
        (dict(layer_types=("local",), num_layers=1), "layer_types"),
        (dict(sliding_window=None), "sliding_window"),
        (dict(rope_scaling_type="llama3"), "rope_scaling_type"),
        (dict(final_logit_softcapping=0.0), "final_logit_softcapping"),
        (dict(model_type="gemma3_text", rope_local_base_freq=1e4), "attn_logit_softcapping"),
        (dict(model_type="gemma3_text", attn_logit_softcapping=None), "rope_local_base_freq"),
        (dict(model_type="gemma"), "model_type"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        gemma.GemmaConfig(**kwargs)


def test_soft_capped_attention_refuses_jax_when_the_config_is_built():
    with pytest.raises(ValueError, match="'jax'"):
        gemma.GemmaConfig(attention="jax")
    gemma.GemmaConfig(attention="jax", attn_logit_softcapping=None)


# What transformers' MLP reads: Gemma 1's `hidden_act` ("gelu", the releases' legacy value,
# read as the tanh approximation), Gemma 2's and 3's `hidden_activation` (`hidden_act` unread).
ACTIVATION_KEYS = {
    "release": {"hidden_act": "gelu"},
    "both": {"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"},
    "exact_gelu": {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu"},
    "neither": {},
}


@pytest.mark.parametrize("keys", ACTIVATION_KEYS.values(), ids=ACTIVATION_KEYS.keys())
@pytest.mark.parametrize(
    "model_type, read_by_hf",
    [
        ("gemma", "hidden_act"),
        ("gemma2", "hidden_activation"),
        ("gemma3_text", "hidden_activation"),
    ],
)
def test_the_activation_is_the_one_transformers_runs(model_type, read_by_hf, keys):
    config_json = transformers.AutoConfig.for_model(model_type, vocab_size=64).to_dict()
    for key in ("hidden_act", "hidden_activation"):
        config_json.pop(key, None)
    config_json.update(keys)
    theirs = getattr(transformers.AutoConfig.for_model(**config_json), read_by_hf)
    _, config = hf.config_from_hf_dict(config_json)
    assert config.activation == theirs
