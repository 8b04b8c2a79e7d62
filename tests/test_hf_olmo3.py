"""OLMo 3 from and to HuggingFace: every promise against transformers' `Olmo3ForCausalLM`
(post-norms, whole-projection q/k norms, sliding layers between full ones, a rotary per
layer type), the serving engine's paged cache, LoRA, config errors and the gin files."""

import dataclasses

import jax
import numpy as np
import pytest
import transformers

from flaxlm.checkpoints import hf, hf_files
from flaxlm.models import olmo3, options
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import lora, steps
from tests.helpers import adamw
from tests.hf_helpers import (
    LIGHT,
    check_family,
    decoder_batch,
    engine_greedy,
    gin_config,
    hf_greedy_batch,
    padded_batch,
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
    rms_norm_eps=1e-6,
    attention_dropout=0.0,
    initializer_range=0.1,  # sharp enough attention that positions visibly matter
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF's min_new_tokens would otherwise forbid one
)
# Prompts of up to 17 tokens + 30 generated outrun the windows (6 and 5 positions) and YaRN's
# original context (16).
VARIANTS = {
    # Sliding, full, sliding: head_dim unlike the width's, GQA, YaRN on the full layers and
    # linear scaling of another base on the sliding ones (transformers 5's nested
    # rope_parameters), untied.
    "gqa_head_dim_rope_per_layer_type": dict(
        COMMON,
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e3},
        },
    ),
    # Full, sliding: MQA, biases on q, k, v and o, a tied head, and transformers 4's
    # top-level rope_theta + rope_scaling (the full layers' only).
    "mqa_bias_tied_legacy_linear_rope": dict(
        COMMON,
        num_hidden_layers=2,
        num_key_value_heads=1,
        attention_bias=True,
        tie_word_embeddings=True,
        sliding_window=5,
        layer_types=["full_attention", "sliding_attention"],
        rope_theta=2e4,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
}
WINDOWS = {
    "gqa_head_dim_rope_per_layer_type": (6, None, 6),
    "mqa_bias_tied_legacy_linear_rope": (None, 5),
}


def tiny_hf_olmo3(path, variant: str):
    """A random tiny torch Olmo3ForCausalLM (norm weights and biases perturbed), saved."""
    model = random_hf_model(
        transformers.Olmo3Config,
        transformers.Olmo3ForCausalLM,
        ("norm.weight", ".bias"),
        **VARIANTS[variant],
    )
    return model, save_torch_model(model, path)


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):
    """The first variant, saved, and flaxlm's import of it."""
    path = tmp_path_factory.mktemp("olmo3") / "hf"
    torch_model, path = tiny_hf_olmo3(path, "gqa_head_dim_rope_per_layer_type")
    model, params = hf.from_pretrained(path)
    return torch_model, path, model, params


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_checkpoint_keeps_every_promise(tmp_path, variant):
    torch_model, path = tiny_hf_olmo3(tmp_path / "hf", variant)
    # The kernels and meshes once, on the first variant (each variant: its reading and math).
    light = {} if variant == "gqa_head_dim_rope_per_layer_type" else LIGHT
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, **light)

    config = hf.config_from_hf_dict(hf_files.read_hf_config(path))[1]
    assert config.layer_windows == WINDOWS[variant]
    model = config.make_module()
    params = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
    )
    assert config.num_params() == sum(p.size for p in jax.tree.leaves(params))
    exported = transformers.AutoConfig.from_pretrained(str(tmp_path / "export"))
    assert exported.layer_types == torch_model.config.layer_types
    # The same rotary per layer type (the export spells out YaRN's defaults).
    assert olmo3.rope_from_hf(exported.to_dict()) == olmo3.rope_from_hf(
        torch_model.config.to_dict()
    )


@pytest.mark.slow
def test_engine_pages_the_sliding_and_full_layers_as_hf_generates(yarn_model):
    """The serving engine's paged cache: windows and both rotaries, HF's greedy tokens."""
    torch_model, _, model, params = yarn_model
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (9, 3, 14)]
    expected = hf_greedy_batch(torch_model, prompts, 12)
    assert model.paged_refusal() is None
    assert engine_greedy(model, params, prompts, 12) == expected


@pytest.mark.slow
def test_lora_training_lowers_the_loss_and_keeps_the_base(yarn_model):
    """LoRA on every projection of an imported model on an FSDP x tensor mesh: the loss
    falls, the base params stay as imported."""
    _, path, _, _ = yarn_model
    partitioner = Partitioner(mesh_shape=(1, 4, 2))
    model, params = hf.from_pretrained(path, partitioner)
    ids, mask = padded_batch(VOCAB, (16, 16, 11, 16, 16, 7, 16, 16), seed=1)
    batch = decoder_batch(ids, mask)
    lengths = {k: v.shape[1] for k, v in batch.items()}
    rules = ((r"(q|k|v|o)_proj/kernel$", 4), (r"(gate|up|down)_proj/kernel$", 4))
    cfg = lora.LoraConfig(rules=rules, alpha=8.0)
    setup = steps.Setup(model, partitioner, adamw(3e-2), lengths, lora=cfg)
    assert len(setup.lora_kernels) == 7 * model.config.num_layers
    state = setup.init_state()
    step = setup.partition_train_step(steps.make_train_step(model, partitioner, 3e-2, lora=cfg))
    before = jax.device_get(params)
    losses = []
    for _ in range(4):
        state, metrics = step(state, batch, params)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    jax.tree.map(np.testing.assert_array_equal, before, jax.device_get(params))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_heads=4, num_kv_heads=3, hidden_size=32), "num_kv_heads"),
        (dict(num_layers=2, layer_types=("full_attention",)), "layer_types"),
        (dict(num_layers=1, layer_types=("chunked_attention",)), "layer_types"),
        (
            dict(num_layers=1, layer_types=("sliding_attention",), sliding_window=None),
            "sliding_window",
        ),
        (dict(rope_scaling_type="dynamic"), "rope_scaling_type"),
        (dict(sliding_rope_parameters={"rope_type": "longrope"}), "sliding_rope_parameters"),
        (dict(model_type="olmo2"), "model_type"),
        (dict(activation="swish"), "activation"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        olmo3.Olmo3Config(**kwargs)


@pytest.mark.parametrize(
    "hf_fields, field",
    [
        (dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0}}), "full"),
        (
            dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
            "partial",
        ),
        (dict(layer_types=["sliding_attention"] * 2, sliding_window=None), "sliding_window"),
    ],
)
def test_bad_config_json_is_refused_naming_the_setting(hf_fields, field):
    hf_config = {"model_type": "olmo3", "num_hidden_layers": 2, **hf_fields}
    with pytest.raises(ValueError, match=field):
        olmo3.config_from_hf(hf_config)


def test_config_json_as_transformers_resolves_it():
    """transformers 4 fields as transformers 5's Olmo3Config resolves them: the top-level
    rope_theta and rope_scaling go to the full layers, the sliding ones keep the default
    base; layer_types default to three sliding layers, then a full one."""
    legacy = dict(PUBLISHED_7B, rope_theta=1e4)
    read = olmo3.config_from_hf(legacy)
    resolved = olmo3.config_from_hf(transformers.Olmo3Config(**legacy).to_dict())
    period = ("sliding_attention",) * 3 + ("full_attention",)
    assert resolved.per_layer_types == read.per_layer_types == period * 8
    fields = ("rope_theta", *olmo3.ROPE_FIELDS)
    for ours, theirs in ((read, resolved), (read.sliding_rope(), resolved.sliding_rope())):
        assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
    assert (read.rope_theta, read.rope_scaling_type) == (1e4, "yarn")
    assert (read.sliding_rope().rope_theta, read.sliding_rope().rope_scaling_type) == (5e5, None)


# config.json of allenai/Olmo-3-1025-7B as published (transformers 4 fields).
PUBLISHED_7B = {
    "model_type": "olmo3",
    "attention_bias": False,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "max_position_embeddings": 65536,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "attention_factor": 1.2079441541679836,
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "yarn",
    },
    "rope_theta": 500000,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "vocab_size": 100278,
}
# Published shapes; the parameter counts (billions, embeddings included) are the model cards'.
GIN_FILES = {
    "olmo3_tiny": dict(vocab_size=384, hidden_size=256, params=None),
    "olmo3_7b": dict(hidden_size=4096, num_layers=32, num_kv_heads=32, params=7.3),
    "olmo3_32b": dict(hidden_size=5120, num_layers=64, num_kv_heads=8, params=32.2),
}


@pytest.mark.parametrize("name", sorted(GIN_FILES))
def test_gin_model_file_builds_its_config(repo_dir, name):
    config = gin_config(repo_dir, name, olmo3.Olmo3Config)
    expected = dict(GIN_FILES[name])
    billions = expected.pop("params")
    for field, value in expected.items():
        assert getattr(config, field) == value, field
    assert config.vocab_size % 128 == 0
    if billions is not None:
        assert config.num_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_published_config_json_reads_as_the_gin_file(repo_dir):
    from_gin = gin_config(repo_dir, "olmo3_7b", olmo3.Olmo3Config)
    _, read = hf.config_from_hf_dict(PUBLISHED_7B)
    # The compute options are the run's.
    ignored = {f.name for f in dataclasses.fields(options.ComputeOptions)}
    for field in dataclasses.fields(olmo3.Olmo3Config):
        if field.name not in ignored:
            assert getattr(read, field.name) == getattr(from_gin, field.name), field.name
