"""Command R / R+ (`cohere`) and Command R7B / Command A (`cohere2`) from and to HuggingFace:
every promise against transformers' `CohereForCausalLM` (the parallel LayerNorm block,
interleaved rotary, per-head q/k LayerNorms, `logit_scale`) and `Cohere2ForCausalLM`
(sliding layers with rotary between full NoPE ones), the serving engine's paged cache,
config errors and the gin files."""

import copy

import jax
import numpy as np
import pytest
import torch
import transformers

from flaxlm.checkpoints import hf, hf_files
from flaxlm.models import cohere
from tests.hf_helpers import (
    LIGHT,
    TINY_DENSE,
    check_family,
    engine_greedy,
    gin_config,
    hf_greedy_batch,
    random_hf_model,
    save_torch_model,
)

VOCAB = TINY_DENSE["vocab_size"]
FULL, SLIDING = cohere.FULL, cohere.SLIDING
YARN = {
    "rope_type": "yarn",
    "rope_theta": 1e4,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
}
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# Prompts of up to 17 tokens + 30 generated outrun the windows (6 and 5 positions) and the
# scaled rotaries' original contexts (16).
VARIANTS = {
    # Command R+'s per-head q/k LayerNorms, GQA, head_dim unlike the width's, biases on q, k,
    # v and o, YaRN (transformers 5's rope_parameters), an untied head, eps and logit scale
    # unlike the defaults.
    "cohere_qk_norm_gqa_bias_yarn": dict(
        TINY_DENSE,
        use_qk_norm=True,
        head_dim=16,
        attention_bias=True,
        tie_word_embeddings=False,
        layer_norm_eps=1e-4,
        logit_scale=0.5,
        rope_parameters=dict(YARN),
    ),
    # Command R's layout: every head its own keys (num_key_value_heads null), no q/k norms, a
    # tied head, GELU, transformers 4's top-level rope_theta + legacy linear rope_scaling.
    "cohere_mha_tied_legacy_linear": dict(
        TINY_DENSE,
        num_key_value_heads=None,
        hidden_act="gelu",
        logit_scale=0.8333333333333334,
        rope_theta=2e4,
        rope_scaling={"type": "linear", "factor": 2.0},
    ),
    # Sliding, sliding, full (every 3rd layer, from the pattern): rotary on the sliding layers
    # only, GQA, biases, transformers 4's llama3 scaling, an untied head.
    "cohere2_hybrid_gqa_bias_llama3": dict(
        TINY_DENSE,
        num_hidden_layers=3,
        sliding_window=6,
        sliding_window_pattern=3,
        attention_bias=True,
        tie_word_embeddings=False,
        logit_scale=0.5,
        rope_theta=1e6,
        rope_scaling=dict(LLAMA3, original_max_position_embeddings=16),
    ),
    # layer_types spelled out (a full layer by its legacy name 'attention'), MQA, head_dim
    # unlike the width's, YaRN, eps unlike the default, a tied head.
    "cohere2_layer_types_mqa_yarn_tied": dict(
        TINY_DENSE,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=5,
        layer_types=[SLIDING, "attention"],
        layer_norm_eps=1e-4,
        logit_scale=2.0,
        rope_parameters=dict(YARN),
    ),
}
FIRST = ("cohere_qk_norm_gqa_bias_yarn", "cohere2_hybrid_gqa_bias_llama3")
LAYERS = {  # (window per layer, rotary per layer)
    "cohere_qk_norm_gqa_bias_yarn": ((None, None), (True, True)),
    "cohere_mha_tied_legacy_linear": ((None, None), (True, True)),
    "cohere2_hybrid_gqa_bias_llama3": ((6, 6, None), (True, True, False)),
    "cohere2_layer_types_mqa_yarn_tied": ((5, None), (True, False)),
}


def tiny_hf_model(path, variant: str):
    """A random tiny torch model of `variant` (norm weights and biases perturbed), saved."""
    family = "Cohere2" if variant.startswith("cohere2") else "Cohere"
    model = random_hf_model(
        getattr(transformers, f"{family}Config"),
        getattr(transformers, f"{family}ForCausalLM"),
        ("norm.weight", ".bias"),
        **copy.deepcopy(VARIANTS[variant]),
    )
    return model, save_torch_model(model, path)


@pytest.fixture(scope="module")
def first_models(tmp_path_factory):
    """Each family's first variant, saved: variant -> (torch model, path)."""
    root = tmp_path_factory.mktemp("cohere")
    return {v: tiny_hf_model(root / v, v) for v in FIRST}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_checkpoint_keeps_every_promise(tmp_path, first_models, variant):
    if variant in first_models:
        torch_model, path = first_models[variant]
    else:
        torch_model, path = tiny_hf_model(tmp_path / "hf", variant)
    # The kernels and meshes once per family, on its first variant.
    light = {} if variant in FIRST else LIGHT
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, **light)

    config = hf.config_from_hf_dict(hf_files.read_hf_config(path))[1]
    assert (config.layer_windows, config.rope_layers) == LAYERS[variant]
    model = config.make_module()
    params = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
    )
    assert config.num_params() == sum(p.size for p in jax.tree.leaves(params))


@pytest.mark.slow
@pytest.mark.parametrize("variant", FIRST)
def test_engine_pages_as_hf_generates(first_models, variant):
    """The serving engine's paged cache (cohere2: windows, NoPE layers): HF's greedy tokens."""
    torch_model, path = first_models[variant]
    model, params = hf.from_pretrained(path)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (9, 3, 14)]
    assert model.paged_refusal() is None
    assert engine_greedy(model, params, prompts, 12) == hf_greedy_batch(torch_model, prompts, 12)


@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (cohere.CohereConfig, dict(model_type="cohere2"), "model_type"),
        (cohere.CohereConfig, dict(sliding_window=4096), "sliding_window"),
        (cohere.CohereConfig, dict(num_layers=1, layer_types=(FULL,)), "layer_types"),
        (cohere.CohereConfig, dict(logit_scale=None), "logit_scale"),
        (cohere.CohereConfig, dict(layer_norm_eps=None), "layer_norm_eps"),
        (cohere.CohereConfig, dict(num_heads=4, num_kv_heads=3, hidden_size=32), "num_kv_heads"),
        (cohere.CohereConfig, dict(activation="swish"), "activation"),
        (cohere.CohereConfig, dict(rope_scaling_type="dynamic"), "rope_scaling_type"),
        (cohere.Cohere2Config, dict(model_type="cohere"), "model_type"),
        (cohere.Cohere2Config, dict(use_qk_norm=True), "use_qk_norm"),
        (cohere.Cohere2Config, dict(sliding_window=None), "sliding_window"),
        (cohere.Cohere2Config, dict(sliding_window=0), "sliding_window"),
        (cohere.Cohere2Config, dict(sliding_window_pattern=0), "sliding_window_pattern"),
        (cohere.Cohere2Config, dict(sliding_window_pattern="LLLG"), "sliding_window_pattern"),
        (cohere.Cohere2Config, dict(sliding_window_pattern=None), "sliding_window_pattern"),
        (cohere.Cohere2Config, dict(num_layers=2, layer_types=(FULL,)), "layer_types"),
        (
            cohere.Cohere2Config,
            dict(num_layers=1, layer_types=("chunked_attention",)),
            "layer_types",
        ),
    ],
)
def test_bad_config_names_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


@pytest.mark.parametrize(
    "model_type, hf_fields, field",
    [
        # transformers' model fails on each.
        ("cohere", dict(logit_scale=None), "logit_scale"),
        ("cohere", dict(layer_norm_eps=None), "layer_norm_eps"),
        (
            "cohere",
            dict(rope_parameters={"rope_type": "linear", "factor": 2.0}, partial_rotary_factor=0.5),
            "partial_rotary_factor",
        ),
        ("cohere2", dict(sliding_window=None, layer_types=[FULL, FULL]), "sliding_window"),
        ("cohere2", dict(sliding_window_pattern=0), "sliding_window_pattern"),
        ("cohere2", dict(sliding_window_pattern="LLLG"), "sliding_window_pattern"),
        ("cohere2", dict(sliding_window_pattern=None), "sliding_window_pattern"),
        ("cohere2", dict(layer_types=["chunked_attention"] * 2), "layer_types"),
        ("cohere2", dict(rope_parameters={FULL: {"rope_type": "default"}}), "rope_parameters"),
        # Rotaries flaxlm does not compute.
        ("cohere", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
        ("cohere2", dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "longrope"),
    ],
)
def test_bad_config_json_is_refused(model_type, hf_fields, field):
    with pytest.raises(ValueError, match=field):
        hf.config_from_hf_dict({"model_type": model_type, "num_hidden_layers": 2, **hf_fields})


@pytest.mark.parametrize(
    "fields",
    [
        {},  # transformers' defaults: every 4th layer full
        dict(sliding_window_pattern=3, use_qk_norm=True),  # (cohere2's model ignores it)
        dict(sliding_window_pattern=-2),
        dict(sliding_window_pattern=1),  # every layer full: none rotates
        dict(sliding_window_pattern="LLLG", layer_types=["attention", SLIDING] * 3),
        dict(partial_rotary_factor=0.5, rope_theta=3e4),  # the default rotary ignores it
    ],
)
def test_read_as_transformers_resolves_it(fields):
    """Layer types (HF's pattern arithmetic, its legacy 'attention' name), which layers rotate
    and the rotary base, against transformers' Cohere2Config and its attention modules."""
    hf_config = {**TINY_DENSE, "num_hidden_layers": 6, **fields}
    theirs = transformers.Cohere2Config(**copy.deepcopy(hf_config))
    with torch.device("meta"):
        attn = [layer.self_attn for layer in transformers.Cohere2Model(theirs).layers]
    ours = hf.config_from_hf_dict({"model_type": "cohere2", **hf_config})[1]
    assert list(ours.per_layer_types) == theirs.layer_types
    assert ours.rope_layers == tuple(a.sliding_window is not None for a in attn)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert not ours.use_qk_norm


@pytest.mark.parametrize("model_type", ["cohere", "cohere2"])
def test_defaults_as_transformers_fills_them(model_type):
    """A config.json with nothing but its model type: transformers' defaults (a tied head,
    the logit scale, each family's rotary base: CohereConfig's 5e5, Cohere2Config's 1e4)."""
    theirs = transformers.AutoConfig.for_model(model_type)
    ours = hf.config_from_hf_dict({"model_type": model_type})[1]
    assert ours.tie_word_embeddings and theirs.tie_word_embeddings
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert (ours.logit_scale, ours.kv_heads) == (theirs.logit_scale, theirs.num_key_value_heads)
    assert ours.per_layer_types == tuple(getattr(theirs, "layer_types", None) or [FULL] * 40)


# Published shapes; the parameter counts (billions, embeddings included) are the model cards'.
GIN_FILES = {
    "cohere_tiny": (cohere.CohereConfig, dict(vocab_size=384, use_qk_norm=True), None),
    "cohere2_tiny": (cohere.Cohere2Config, dict(vocab_size=384, sliding_window=128), None),
    "command_r_35b": (cohere.CohereConfig, dict(hidden_size=8192, num_kv_heads=64), 35.0),
    "command_r_plus_104b": (cohere.CohereConfig, dict(hidden_size=12288, use_qk_norm=True), 104),
    "command_r7b": (cohere.Cohere2Config, dict(hidden_size=4096, sliding_window=4096), 8.03),
    "command_a_111b": (cohere.Cohere2Config, dict(hidden_size=12288, num_layers=64), 111),
}


@pytest.mark.parametrize("name", sorted(GIN_FILES))
def test_gin_model_file_builds_its_config(repo_dir, name):
    """The gin file's config: its shapes, the model card's size, and exactly the params of
    transformers' model of its export (built on the meta device); a tiny one's count is its
    built model's."""
    cls, expected, billions = GIN_FILES[name]
    config = gin_config(repo_dir, name, cls)
    for field, value in expected.items():
        assert getattr(config, field) == value, field
    assert config.vocab_size % 128 == 0
    if billions is not None:
        assert config.num_params() / 1e9 == pytest.approx(billions, rel=0.01)
    else:
        model = config.make_module()
        params = jax.eval_shape(
            lambda: model.init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
        )
        assert config.num_params() == sum(p.size for p in jax.tree.leaves(params))
    exported = hf.spec_for_config(config).config_to_hf(config)
    theirs = transformers.AutoConfig.for_model(**exported)
    with torch.device("meta"):
        torch_model = transformers.AutoModelForCausalLM.from_config(theirs)
    assert config.num_params() == sum(p.numel() for p in torch_model.parameters())
