"""Qwen2 / Qwen2.5 and Qwen3 from and to HuggingFace: every promise against transformers'
PyTorch models, the windowed layers, config errors and the gin model files."""

import dataclasses

import jax
import pytest
import transformers

from flaxlm.checkpoints import hf, hf_files
from flaxlm.models import base, options, qwen
from tests.hf_helpers import check_family, gin_config, random_hf_model, save_torch_model

VOCAB = 250
HF_CLASSES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}

# Prompts of up to 17 tokens + 30 generated outrun the windows (8 and 6 positions).
VARIANTS = {
    "qwen2_tied_gqa_window": dict(
        model_type="qwen2",
        num_hidden_layers=3,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_sliding_window=True,
        max_window_layers=1,
        sliding_window=8,
    ),
    "qwen2_untied_mqa_linear_rope": dict(
        model_type="qwen2",
        num_key_value_heads=1,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
    ),
    "qwen3_tied_gqa_head_dim_bias_layer_types": dict(
        model_type="qwen3",
        num_hidden_layers=3,
        head_dim=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        attention_bias=True,
        use_sliding_window=True,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
}
WINDOWS = {
    "qwen2_tied_gqa_window": (None, 8, 8),
    "qwen3_tied_gqa_head_dim_bias_layer_types": (6, None, 6),
}


def tiny_hf_qwen(tmp_path, model_type="qwen2", **overrides):
    """A random tiny torch Qwen (norm weights and biases perturbed), saved to tmp_path/hf."""
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        attention_dropout=0.0,
        initializer_range=0.1,  # sharp enough attention that positions visibly matter
    )
    kwargs.update(overrides)
    config_cls, model_cls = HF_CLASSES[model_type]
    model = random_hf_model(config_cls, model_cls, ("norm.weight", ".bias"), **kwargs)
    return model, save_torch_model(model, tmp_path / "hf")


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_checkpoint_keeps_every_promise(tmp_path, variant):
    torch_model, path = tiny_hf_qwen(tmp_path, **VARIANTS[variant])
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path)

    config = hf.config_from_hf_dict(hf_files.read_hf_config(path))[1]
    assert config.layer_windows == WINDOWS.get(variant, (None,) * config.num_layers)
    model = base.DecoderOnlyModel(config)
    shapes = model.example_batch_shapes(8, 1)
    params = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0), shapes))
    assert config.num_params() == sum(p.size for p in jax.tree.leaves(params))
    exported = transformers.AutoConfig.from_pretrained(str(tmp_path / "export"))
    assert exported.layer_types == torch_model.config.layer_types
    assert exported.sliding_window == torch_model.config.sliding_window


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_heads=4, num_kv_heads=3, hidden_size=32), "num_kv_heads"),
        (dict(model_type="qwen2", attention_bias=True), "attention_bias"),
        (dict(use_sliding_window=True), "sliding_window"),
        (dict(num_layers=2, layer_types=("full_attention",)), "layer_types"),
        (dict(num_layers=1, layer_types=["sliding_attention"]), "use_sliding_window"),
        (dict(rope_scaling_type="dynamic"), "rope_scaling_type"),
        (dict(model_type="qwen"), "model_type"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        qwen.QwenConfig(**kwargs)


# Published shapes; the parameter counts (billions, embeddings included) are the model cards'.
GIN_FILES = {
    "qwen_tiny": dict(vocab_size=384, hidden_size=256, model_type="qwen3"),
    "qwen2_5_0_5b": dict(hidden_size=896, num_layers=24, tie_word_embeddings=True, params=0.49),
    "qwen2_5_1_5b": dict(hidden_size=1536, num_layers=28, num_kv_heads=2, params=1.54),
    "qwen2_5_7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, params=7.61),
    "qwen2_5_72b": dict(num_layers=80, num_heads=64, num_kv_heads=8, params=72.7),
    "qwen3_0_6b": dict(head_dim=128, num_heads=16, tie_word_embeddings=True, params=0.6),
    "qwen3_4b": dict(hidden_size=2560, num_layers=36, intermediate_size=9728, params=4.0),
    "qwen3_8b": dict(hidden_size=4096, tie_word_embeddings=False, params=8.2),
    "qwen3_32b": dict(num_layers=64, num_heads=64, intermediate_size=25600, params=32.8),
}


@pytest.mark.parametrize("name", sorted(GIN_FILES))
def test_gin_model_file_builds_its_config(repo_dir, name):
    config = gin_config(repo_dir, name, qwen.QwenConfig)
    expected = dict(GIN_FILES[name])
    billions = expected.pop("params", None)
    for field, value in expected.items():
        assert getattr(config, field) == value, field
    assert config.vocab_size % 128 == 0
    if billions is not None:
        assert config.num_params() / 1e9 == pytest.approx(billions, rel=0.01)


# config.json as published (transformers 4 fields: top-level rope_theta, no layer_types).
PUBLISHED = {
    "qwen2_5_7b": {
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 152064,
    },
    "qwen3_8b": {
        "model_type": "qwen3",
        "attention_bias": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_json_reads_as_the_gin_file(repo_dir, name):
    from_gin = gin_config(repo_dir, name, qwen.QwenConfig)
    read = qwen.config_from_hf(PUBLISHED[name])
    assert read.layer_windows == from_gin.layer_windows == (None,) * read.num_layers
    # The window fields only matter through layer_windows; the compute options are the run's.
    ignored = {f.name for f in dataclasses.fields(options.ComputeOptions)}
    ignored |= {"sliding_window", "max_window_layers"}
    for field in dataclasses.fields(qwen.QwenConfig):
        if field.name not in ignored:
            assert getattr(read, field.name) == getattr(from_gin, field.name), field.name
