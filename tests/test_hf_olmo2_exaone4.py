"""OLMo 2 and EXAONE 4.0 from and to HuggingFace: every promise against transformers'
`Olmo2ForCausalLM` (post-norms, whole-projection q/k norms, every layer full) and
`Exaone4ForCausalLM` (post-norms, per-head q/k norms, sliding layers with rotary between
global NoPE ones, or every layer global with rotary), the serving engine's paged cache,
config errors and the gin files."""

import copy

import jax
import numpy as np
import pytest
import torch
import transformers

from flaxlm.checkpoints import hf, hf_files
from flaxlm.models import exaone4, olmo2, olmo3
from tests.hf_helpers import (
    LIGHT,
    check_family,
    engine_greedy,
    gin_config,
    hf_greedy_batch,
    random_hf_model,
    save_torch_model,
)

VOCAB = 250
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    max_position_embeddings=64,
    attention_dropout=0.0,
    initializer_range=0.1,  # sharp enough attention that positions visibly matter
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF's min_new_tokens would otherwise forbid one
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 1e4,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
}
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
FULL, SLIDING = "full_attention", "sliding_attention"
# Prompts of up to 17 tokens + 30 generated outrun the windows (6 and 5 positions) and the
# scaled rotaries' original contexts (16).
VARIANTS = {
    # GQA, head_dim unlike the width's, biases on q, k, v and o, YaRN (transformers 5's
    # rope_parameters), eps unlike the default, an untied head.
    "olmo2_gqa_head_dim_bias_yarn": dict(
        COMMON,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        rms_norm_eps=1e-6,
        rope_parameters=dict(YARN),
    ),
    # MQA, a tied head, the default eps, transformers 4's top-level rope_theta + rope_scaling.
    "olmo2_mqa_tied_legacy_llama3": dict(
        COMMON,
        num_hidden_layers=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_theta=2e4,
        rope_scaling=dict(LLAMA3, original_max_position_embeddings=16),
    ),
    # Sliding, sliding, global (every 3rd layer, from the pattern): rotary on the sliding
    # layers only, GQA, head_dim unlike the width's, transformers 4's llama3 scaling, untied.
    "exaone4_hybrid_nope_gqa_llama3": dict(
        COMMON,
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,
        sliding_window_pattern=3,
        rope_theta=1e6,
        rope_scaling=dict(LLAMA3, original_max_position_embeddings=16),
    ),
    # No window (EXAONE-4.0-1.2B's layout): every layer global with rotary, layer_types
    # spelled out, MQA, YaRN, eps unlike the default, a tied head.
    "exaone4_global_rope_mqa_yarn_tied": dict(
        COMMON,
        num_hidden_layers=2,
        num_key_value_heads=1,
        sliding_window=None,
        layer_types=[FULL, FULL],
        rms_norm_eps=1e-6,
        rope_parameters=dict(YARN),
        tie_word_embeddings=True,
    ),
}
FIRST = ("olmo2_gqa_head_dim_bias_yarn", "exaone4_hybrid_nope_gqa_llama3")
LAYERS = {  # (window per layer, rotary per layer) of the EXAONE variants
    "exaone4_hybrid_nope_gqa_llama3": ((6, 6, None), (True, True, False)),
    "exaone4_global_rope_mqa_yarn_tied": ((None, None), (True, True)),
}


def tiny_hf_model(path, variant: str):
    """A random tiny torch model of `variant` (norm weights and biases perturbed), saved."""
    family = "Olmo2" if variant.startswith("olmo2") else "Exaone4"
    model = random_hf_model(
        getattr(transformers, f"{family}Config"),
        getattr(transformers, f"{family}ForCausalLM"),
        ("norm.weight", ".bias"),
        **VARIANTS[variant],
    )
    return model, save_torch_model(model, path)


@pytest.fixture(scope="module")
def first_models(tmp_path_factory):
    """Each family's first variant, saved: variant -> (torch model, path)."""
    root = tmp_path_factory.mktemp("olmo2_exaone4")
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
    if variant in LAYERS:
        assert (config.layer_windows, config.rope_layers) == LAYERS[variant]
    model = config.make_module()
    params = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
    )
    assert config.num_params() == sum(p.size for p in jax.tree.leaves(params))


@pytest.mark.slow
@pytest.mark.parametrize("variant", FIRST)
def test_engine_pages_as_hf_generates(first_models, variant):
    """The serving engine's paged cache (EXAONE: windows, NoPE layers): HF's greedy tokens."""
    torch_model, path = first_models[variant]
    model, params = hf.from_pretrained(path)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (9, 3, 14)]
    assert model.paged_refusal() is None
    assert engine_greedy(model, params, prompts, 12) == hf_greedy_batch(torch_model, prompts, 12)


@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (olmo2.Olmo2Config, dict(sliding_window=4096), "sliding_window"),
        (olmo2.Olmo2Config, dict(num_layers=1, layer_types=(SLIDING,)), "layer_types"),
        (olmo2.Olmo2Config, dict(sliding_rope_parameters={"rope_type": "default"}), "sliding_rope"),
        (olmo2.Olmo2Config, dict(model_type="olmo3"), "model_type"),
        (olmo2.Olmo2Config, dict(num_heads=4, num_kv_heads=3, hidden_size=32), "num_kv_heads"),
        (olmo2.Olmo2Config, dict(rope_scaling_type="dynamic"), "rope_scaling_type"),
        (exaone4.Exaone4Config, dict(sliding_window_pattern="LLLG"), "sliding_window_pattern"),
        (exaone4.Exaone4Config, dict(sliding_window_pattern=0), "sliding_window_pattern"),
        (exaone4.Exaone4Config, dict(sliding_window_pattern=None), "sliding_window_pattern"),
        (exaone4.Exaone4Config, dict(sliding_window=0), "sliding_window"),
        (exaone4.Exaone4Config, dict(num_layers=2, layer_types=(FULL,)), "layer_types"),
        (
            exaone4.Exaone4Config,
            dict(num_layers=1, layer_types=("chunked_attention",)),
            "layer_types",
        ),
        (
            exaone4.Exaone4Config,
            dict(num_layers=1, layer_types=(SLIDING,), sliding_window=None),
            "sliding_window",
        ),
        (exaone4.Exaone4Config, dict(model_type="exaone"), "model_type"),
        (exaone4.Exaone4Config, dict(activation="swish"), "activation"),
    ],
)
def test_bad_config_names_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


@pytest.mark.parametrize(
    "hf_fields, field",
    [
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
        (dict(rope_parameters={FULL: {"rope_type": "default"}}), "rope_parameters"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "longrope"),
    ],
)
@pytest.mark.parametrize("model_type", ["olmo2", "exaone4"])
def test_bad_rope_in_config_json_is_refused(model_type, hf_fields, field):
    hf_config = {"model_type": model_type, "num_hidden_layers": 2, **hf_fields}
    with pytest.raises(ValueError, match=field):
        hf.config_from_hf_dict(hf_config)


@pytest.mark.parametrize(
    "hf_fields, field",
    [
        # transformers' Exaone4Config fails on each (0 % 0, int % str, int % None).
        (dict(sliding_window=None), "layer_types"),
        (dict(sliding_window_pattern="LLLG"), "sliding_window_pattern"),
        (dict(sliding_window_pattern=None), "sliding_window_pattern"),
        # transformers' model fails building the sliding layers' mask.
        (dict(sliding_window=None, layer_types=[SLIDING, FULL]), "sliding_window"),
    ],
)
def test_exaone4_config_json_transformers_fails_on_is_refused(hf_fields, field):
    with pytest.raises(ValueError, match=field):
        exaone4.config_from_hf({"model_type": "exaone4", "num_hidden_layers": 2, **hf_fields})


@pytest.mark.parametrize(
    "fields",
    [
        dict(sliding_window_pattern=3),
        dict(sliding_window_pattern=-2),
        dict(sliding_window_pattern=1),  # every layer global, none rotates
        dict(sliding_window_pattern="LLLG", layer_types=["attention", SLIDING] * 3),
        dict(sliding_window=None, layer_types=[FULL] * 6),  # every layer rotates
    ],
)
def test_exaone4_layers_as_transformers_derives_them(fields):
    """Layer types (HF's pattern arithmetic, its legacy 'attention' name) and which layers
    rotate, against transformers' config and its attention modules."""
    hf_config = {**COMMON, "num_hidden_layers": 6, "num_key_value_heads": 2, "sliding_window": 5}
    hf_config.update(fields)
    theirs = transformers.Exaone4Config(**hf_config)
    with torch.device("meta"):
        attn = [layer.self_attn for layer in transformers.Exaone4Model(theirs).layers]
    ours = exaone4.config_from_hf({"model_type": "exaone4", **hf_config})
    assert list(ours.per_layer_types) == theirs.layer_types
    assert ours.rope_layers == tuple(a.sliding_window is None or a.is_sliding for a in attn)


@pytest.mark.parametrize("model_type", ["olmo2", "exaone4"])
def test_rope_as_transformers_resolves_it(model_type):
    """transformers 4's rope_scaling wins over rope_parameters, the top-level rope_theta fills
    in the base, a llama3 dict without its original context takes max_position_embeddings;
    read from config.json as transformers' config class resolves it."""
    cls = getattr(transformers, f"{model_type.capitalize()}Config")
    spec = hf.spec_for_model_type(model_type)
    fields = dict(num_hidden_layers=2, max_position_embeddings=64)
    legacy = dict(
        fields, rope_theta=3e4, rope_scaling=dict(LLAMA3), rope_parameters={"rope_type": "x"}
    )
    names = ("rope_theta", *olmo3.ROPE_FIELDS)
    for fields_json, expected in ((legacy, (3e4, "llama3", 64)), (fields, (1e4, None, 8192))):
        read = spec.config_from_hf({"model_type": model_type, **fields_json})
        # (transformers fills the rope dict it is given in place: a copy)
        resolved = spec.config_from_hf(cls(**copy.deepcopy(fields_json)).to_dict())
        assert [getattr(read, n) for n in names] == [getattr(resolved, n) for n in names]
        got = (read.rope_theta, read.rope_scaling_type, read.rope_original_max_position_embeddings)
        assert got == expected


# Published shapes; the parameter counts (billions, embeddings included) are the model cards'.
GIN_FILES = {
    "olmo2_tiny": (olmo2.Olmo2Config, dict(vocab_size=384, hidden_size=256), None),
    "olmo2_1b": (olmo2.Olmo2Config, dict(hidden_size=2048, num_layers=16), 1.48),
    "olmo2_7b": (olmo2.Olmo2Config, dict(hidden_size=4096, num_layers=32), 7.3),
    "exaone4_tiny": (exaone4.Exaone4Config, dict(vocab_size=384, sliding_window=128), None),
    "exaone4_1_2b": (exaone4.Exaone4Config, dict(hidden_size=2048, sliding_window=None), 1.28),
    "exaone4_32b": (exaone4.Exaone4Config, dict(hidden_size=5120, num_kv_heads=8), 32.0),
}


@pytest.mark.parametrize("name", sorted(GIN_FILES))
def test_gin_model_file_builds_its_config(repo_dir, name):
    """The gin file's config: its shapes, the model card's size, and exactly the params of
    transformers' model of its export (built on the meta device)."""
    cls, expected, billions = GIN_FILES[name]
    config = gin_config(repo_dir, name, cls)
    for field, value in expected.items():
        assert getattr(config, field) == value, field
    assert config.vocab_size % 128 == 0
    if billions is not None:
        assert config.num_params() / 1e9 == pytest.approx(billions, rel=0.01)
    exported = hf.spec_for_config(config).config_to_hf(config)
    theirs = transformers.AutoConfig.for_model(**exported)
    with torch.device("meta"):
        torch_model = transformers.AutoModelForCausalLM.from_config(theirs)
    assert config.num_params() == sum(p.numel() for p in torch_model.parameters())
