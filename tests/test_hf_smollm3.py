"""SmolLM3 from and to HuggingFace: every promise against transformers'
`SmolLM3ForCausalLM` (NoPE layers among rotary ones, windows on the layers HF slides,
biases, tied and untied heads), the serving engine's paged cache, LoRA, config errors and
the gin files."""

import dataclasses

import jax
import numpy as np
import pytest
import transformers

from flaxlm.checkpoints import hf, hf_files
from flaxlm.models import options, smollm3
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
# Prompts of up to 17 tokens + 30 generated outrun the window (6 positions) and YaRN's
# original context (16).
VARIANTS = {
    # Rotary, NoPE, rotary (interval 2); the NoPE layer slides; GQA, head_dim unlike the
    # width's, YaRN, an untied head.
    "interval_window_gqa_yarn_untied": dict(
        COMMON,
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=16,
        no_rope_layer_interval=2,
        use_sliding_window=True,
        sliding_window=6,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # NoPE, rotary, rotary from the list; MQA, biases on attention and MLP, a tied head,
    # transformers 4's top-level rope_theta + rope_scaling.
    "list_bias_mqa_linear_tied": dict(
        COMMON,
        num_hidden_layers=3,
        num_key_value_heads=1,
        no_rope_layers=[0, 1, 1],
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rope_theta=2e4,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
}
LAYERS = {  # (rotary per layer, window per layer)
    "interval_window_gqa_yarn_untied": ((True, False, True), (None, 6, None)),
    "list_bias_mqa_linear_tied": ((False, True, True), (None, None, None)),
}


def tiny_hf_smollm3(path, variant: str):
    """A random tiny torch SmolLM3ForCausalLM (norm weights and biases perturbed), saved."""
    model = random_hf_model(
        transformers.SmolLM3Config,
        transformers.SmolLM3ForCausalLM,
        ("norm.weight", ".bias"),
        **VARIANTS[variant],
    )
    return model, save_torch_model(model, path)


@pytest.fixture(scope="module")
def nope_model(tmp_path_factory):
    """The first variant, saved, and flaxlm's import of it."""
    path = tmp_path_factory.mktemp("smollm3") / "hf"
    torch_model, path = tiny_hf_smollm3(path, "interval_window_gqa_yarn_untied")
    model, params = hf.from_pretrained(path)
    return torch_model, path, model, params


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_checkpoint_keeps_every_promise(tmp_path, variant):
    torch_model, path = tiny_hf_smollm3(tmp_path / "hf", variant)
    # The kernels and meshes once, on the first variant (each variant: its reading and math).
    light = {} if variant == "list_bias_mqa_linear_tied" else LIGHT
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, **light)

    config = hf.config_from_hf_dict(hf_files.read_hf_config(path))[1]
    assert (config.rope_layers, config.layer_windows) == LAYERS[variant]
    model = config.make_module()
    params = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
    )
    assert config.num_params() == sum(p.size for p in jax.tree.leaves(params))
    exported = transformers.AutoConfig.from_pretrained(str(tmp_path / "export"))
    for field in ("no_rope_layers", "layer_types", "sliding_window", "use_sliding_window"):
        assert getattr(exported, field) == getattr(torch_model.config, field), field


@pytest.mark.slow
def test_engine_pages_the_nope_and_windowed_layers_as_hf_generates(nope_model):
    """The serving engine's paged cache: a NoPE layer with a window among rotary ones, HF's
    greedy tokens."""
    torch_model, _, model, params = nope_model
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (9, 3, 14)]
    expected = hf_greedy_batch(torch_model, prompts, 12)
    assert model.paged_refusal() is None
    assert engine_greedy(model, params, prompts, 12) == expected


@pytest.mark.slow
def test_lora_training_lowers_the_loss_and_keeps_the_base(nope_model):
    """LoRA on every projection of an imported model, layers scanned, on an FSDP x tensor
    mesh: the loss falls, the base params stay as imported."""
    _, path, _, _ = nope_model
    partitioner = Partitioner(mesh_shape=(1, 4, 2))
    model, params = hf.from_pretrained(path, partitioner, scan_layers=True)
    ids, mask = padded_batch(VOCAB, (16, 16, 11, 16, 16, 7, 16, 16), seed=1)
    batch = decoder_batch(ids, mask)
    lengths = {k: v.shape[1] for k, v in batch.items()}
    rules = ((r"(q|k|v|o)_proj/kernel$", 4), (r"(gate|up|down)_proj/kernel$", 4))
    cfg = lora.LoraConfig(rules=rules, alpha=8.0)
    setup = steps.Setup(model, partitioner, adamw(3e-2), lengths, lora=cfg)
    assert len(setup.lora_kernels) == 7  # each a stack of the scanned layers'
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
        (dict(num_layers=4, no_rope_layers=(1, 1, 0)), "no_rope_layers"),
        (dict(no_rope_layer_interval=0), "no_rope_layer_interval"),
        (dict(num_layers=2, layer_types=("full_attention",)), "layer_types"),
        (dict(num_layers=1, layer_types=("chunked_attention",)), "layer_types"),
        (dict(num_layers=1, layer_types=("sliding_attention",), sliding_window=8), "use_sliding"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(rope_scaling_type="dynamic"), "rope_scaling_type"),
        (dict(model_type="smollm2"), "model_type"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        smollm3.SmolLM3Config(**kwargs)


@pytest.mark.parametrize(
    "hf_fields, field",
    [
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "longrope"),
        (dict(rope_scaling={"rope_type": "yarn", "partial_rotary_factor": 0.5}), "partial"),
        (dict(rope_theta=1e4, partial_rotary_factor=0.5), "partial"),
    ],
)
def test_bad_config_json_is_refused_naming_the_setting(hf_fields, field):
    with pytest.raises(ValueError, match=field):
        smollm3.config_from_hf({"model_type": "smollm3", **hf_fields})


def test_layers_as_transformers_derives_them():
    """no_rope_layers and layer_types as SmolLM3Config derives them from the interval and
    the window."""
    windowed = dict(use_sliding_window=True, sliding_window=4)
    for kwargs in (
        dict(num_hidden_layers=6, no_rope_layer_interval=3),
        dict(num_hidden_layers=5, no_rope_layer_interval=2, **windowed),
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=None),
        dict(num_hidden_layers=4, no_rope_layers=[0, 1, 0, 1, 1], **windowed),
    ):
        theirs = transformers.SmolLM3Config(**kwargs)
        read = smollm3.config_from_hf({"model_type": "smollm3", **kwargs})
        n = kwargs["num_hidden_layers"]  # (a longer list's first n count)
        assert [int(r) for r in read.rope_layers] == theirs.no_rope_layers[:n]
        assert list(read.per_layer_types) == theirs.layer_types


# config.json of HuggingFaceTB/SmolLM3-3B as published (transformers 4 fields).
PUBLISHED_3B = {
    "model_type": "smollm3",
    "attention_bias": False,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "max_position_embeddings": 65536,
    "mlp_bias": False,
    "no_rope_layer_interval": 4,
    "no_rope_layers": [1, 1, 1, 0] * 9,
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 5000000.0,
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "vocab_size": 128256,
}
# Published shapes; the parameter counts (billions, embeddings included) are the model cards'.
GIN_FILES = {
    "smollm3_tiny": dict(vocab_size=384, hidden_size=256, params=None),
    "smollm3_3b": dict(hidden_size=2048, num_layers=36, tie_word_embeddings=True, params=3.08),
}


@pytest.mark.parametrize("name", sorted(GIN_FILES))
def test_gin_model_file_builds_its_config(repo_dir, name):
    config = gin_config(repo_dir, name, smollm3.SmolLM3Config)
    expected = dict(GIN_FILES[name])
    billions = expected.pop("params")
    for field, value in expected.items():
        assert getattr(config, field) == value, field
    assert config.vocab_size % 128 == 0
    if billions is not None:
        assert config.num_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_published_config_json_reads_as_the_gin_file(repo_dir):
    from_gin = gin_config(repo_dir, "smollm3_3b", smollm3.SmolLM3Config)
    _, read = hf.config_from_hf_dict(PUBLISHED_3B)
    assert read.rope_layers == from_gin.rope_layers
    assert read.layer_windows == from_gin.layer_windows == (None,) * 36
    # The compute options are the run's; the NoPE list says what the interval does.
    ignored = {f.name for f in dataclasses.fields(options.ComputeOptions)} | {"no_rope_layers"}
    for field in dataclasses.fields(smollm3.SmolLM3Config):
        if field.name not in ignored:
            assert getattr(read, field.name) == getattr(from_gin, field.name), field.name
