"""Llama and Mistral from and to HuggingFace: logits against transformers' PyTorch models."""

import dataclasses
import json

import gin
import jax
import numpy as np
import pytest
import transformers

from flaxlm import gin_utils
from flaxlm.checkpoints import hf
from flaxlm.models import llama, rope
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.parallel.partitioning import Partitioner
from tests.helpers import float32_atol
from tests.hf_helpers import (
    check_family,
    decoder_batch,
    gin_config,
    max_abs_diff,
    padded_batch,
    random_hf_model,
    save_torch_model,
    torch_logits,
    train_on_batch,
)

VOCAB = 250
LENGTHS = (40, 23, 40, 9)  # long enough for the rope scalings and the window to matter

VARIANTS = {
    "gqa_theta": dict(num_key_value_heads=2, rope_parameters={"rope_theta": 5e4}),
    "linear_rope": dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
        attention_bias=True,
        mlp_bias=True,
    ),
    "llama3_rope": dict(
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 1e4,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,  # wavelengths fall in all three bands
        },
    ),
    "tied": dict(tie_word_embeddings=True, head_dim=16),
    "mistral_window": dict(model_type="mistral", num_key_value_heads=2, sliding_window=8),
}


def tiny_hf_llama(tmp_path, model_type="llama", **overrides):
    """A random tiny torch model (norm weights perturbed too), saved to `tmp_path/hf`."""
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        attention_dropout=0.0,
        initializer_range=0.1,  # sharp enough attention that positions visibly matter
    )
    kwargs.update(overrides)
    config_cls = transformers.MistralConfig if model_type == "mistral" else transformers.LlamaConfig
    model_cls = (
        transformers.MistralForCausalLM
        if model_type == "mistral"
        else transformers.LlamaForCausalLM
    )
    model = random_hf_model(config_cls, model_cls, ("norm.weight", ".bias"), **kwargs)
    return model, save_torch_model(model, tmp_path / "hf")


def logits_of(model, params, ids, mask):
    return jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))


# llama3_rope and tied: test_llama3_2_shaped_checkpoint_keeps_every_promise.
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gqa_theta", "linear_rope", "mistral_window"])
def test_import_matches_transformers_and_export_reloads(tmp_path, variant):
    torch_model, path = tiny_hf_llama(tmp_path, **VARIANTS[variant])
    ids, mask = padded_batch(VOCAB, LENGTHS)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)

    model, params = hf.from_pretrained(path)
    assert max_abs_diff(logits_of(model, params, ids, mask), theirs, mask) < 1e-4

    partitioner = Partitioner(mesh_shape=(1, 4, 2))
    model, params = hf.from_pretrained(path, partitioner, scan_layers=variant == "tied")
    ours = logits_of(model, params, ids, mask)
    assert max_abs_diff(ours, theirs, mask) < 1e-4
    assert int(np.asarray(ours).argmax(-1).max()) < VOCAB
    layer = params["layers"]["block"] if variant == "tied" else params["layers_0"]
    assert layer["gate_proj"]["kernel"].sharding.spec[-1] == "tensor"

    out = tmp_path / "out"
    hf.save_pretrained(model, params, out)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert type(reloaded) is type(torch_model)
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(again, theirs, mask) < 1e-5
    exported = json.loads((out / "config.json").read_text())
    assert exported["vocab_size"] == VOCAB
    assert exported["rope_parameters"] == torch_model.config.rope_parameters


@pytest.mark.slow
def test_llama3_2_shaped_checkpoint_keeps_every_promise(tmp_path):
    """Llama 3.2 1B/3B's shape: tied head, llama3 rope scaling, GQA, and the EOS list
    (`<|end_of_text|>`, `<|eot_id|>`) in generation_config.json."""
    torch_model, _ = tiny_hf_llama(tmp_path, tie_word_embeddings=True, **VARIANTS["llama3_rope"])
    torch_model.config.bos_token_id, torch_model.config.eos_token_id = 240, 241
    torch_model.generation_config = transformers.GenerationConfig(
        bos_token_id=240, eos_token_id=[241, 249], do_sample=True, temperature=0.6, top_p=0.9
    )
    path = save_torch_model(torch_model, tmp_path / "llama3_2")
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path)
    model, _ = hf.from_pretrained(path)
    assert model.eos_ids == (241, 249) and model.config.tie_word_embeddings


# A Mistral config.json as written by hand or by older tools (not every key present).
TINY_MISTRAL_JSON = {
    "model_type": "mistral",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
}


@pytest.mark.parametrize("window", [{}, {"sliding_window": None}, {"sliding_window": 8}])
def test_mistral_window_is_transformers_reading_of_config_json(window):
    """No `sliding_window` key: MistralConfig's default, 4096 (a null: no window)."""
    config_json = {**TINY_MISTRAL_JSON, **window}
    _, config = hf.config_from_hf_dict(config_json)
    assert config.sliding_window == transformers.MistralConfig(**config_json).sliding_window


def test_sliding_window_changes_the_logits(tmp_path):
    _, path = tiny_hf_llama(tmp_path, **VARIANTS["mistral_window"])
    model, params = hf.from_pretrained(path)
    assert model.config.sliding_window == 8 and model.config.model_type == "mistral"
    unwindowed = DecoderOnlyModel(dataclasses.replace(model.config, sliding_window=None))
    batch = decoder_batch(*padded_batch(VOCAB, LENGTHS))
    windowed = np.asarray(jax.jit(model.compute_logits)(params, batch))[
        ..., :VOCAB
    ]  # (padding: -max)
    full = np.asarray(jax.jit(unwindowed.compute_logits)(params, batch))[..., :VOCAB]
    # Identical while the window covers the whole prefix, different after; "identical" to
    # float32 rounding over the layers' ~10 stages each (another mask may change the order
    # of the attention's sums).
    atol = float32_atol(full, depth=10 * model.config.num_layers + 2)
    np.testing.assert_allclose(windowed[:, :8], full[:, :8], atol=atol)
    assert np.abs(windowed[0, 8:] - full[0, 8:]).max() > 1e-3


def test_rope_scaling_from_legacy_config_fields():
    legacy = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert rope.from_hf(legacy) == {
        "rope_theta": 5e5,
        "rope_scaling_type": "linear",
        "rope_scaling_factor": 2.0,
    }
    assert rope.from_hf({}) == {"rope_theta": 1e4}


def test_dynamic_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="'dynamic'"):
        rope.from_hf({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_heads=4, num_kv_heads=3, hidden_size=32), "num_kv_heads"),
        (dict(rope_scaling_type="dynamic"), "rope_scaling_type"),
        (dict(sliding_window=16), "sliding_window"),
        (dict(model_type="mistral", mlp_bias=True), "mlp_bias"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        llama.LlamaConfig(**kwargs)


@pytest.mark.slow
def test_fsdp_training_lowers_the_loss_and_exports(tmp_path):
    torch_model, path = tiny_hf_llama(tmp_path, **VARIANTS["gqa_theta"])
    partitioner = Partitioner(mesh_shape=(1, 8, 1))
    model, params = hf.from_pretrained(path, partitioner)
    ids, mask = padded_batch(VOCAB, (24, 24, 17, 24, 24, 9, 24, 24), seed=1)
    batch = decoder_batch(ids, mask)
    state, history = train_on_batch(model, params, partitioner, batch, 8, learning_rate=1e-2)
    params, losses = state.params, [m["loss"] for m in history]
    assert losses[-1] < losses[0] - 0.5, losses
    assert params["layers_0"]["q_proj"]["kernel"].sharding.spec[0] == "fsdp"

    out = tmp_path / "trained"
    hf.save_pretrained(model, params, out)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    theirs = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, theirs, mask) < 1e-4


GIN_FILES = {
    "llama_tiny": dict(hidden_size=256, num_kv_heads=2, vocab_size=384),
    "llama2_7b": dict(hidden_size=4096, num_layers=32, intermediate_size=11008),
    "llama2_13b": dict(hidden_size=5120, num_layers=40, intermediate_size=13824),
    "llama2_70b": dict(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8),
    "llama3_8b": dict(vocab_size=128256, rope_theta=5e5, rope_scaling_type="llama3"),
    "mistral_7b": dict(sliding_window=4096, model_type="mistral", max_position_embeddings=32768),
    "llama3_1_8b": dict(hidden_size=4096, num_kv_heads=8, max_position_embeddings=131072),
    "llama3_1_70b": dict(hidden_size=8192, num_layers=80, intermediate_size=28672),
    "llama3_2_1b": dict(hidden_size=2048, num_layers=16, tie_word_embeddings=True),
    "llama3_2_3b": dict(hidden_size=3072, num_heads=24, rope_scaling_factor=32.0),
}
# Parameter counts of the published checkpoints (billions, to 1%).
PUBLISHED_PARAMS = {
    "llama3_1_8b": 8.03,
    "llama3_1_70b": 70.55,
    "llama3_2_1b": 1.24,
    "llama3_2_3b": 3.21,
}


@pytest.mark.parametrize("name", sorted(GIN_FILES))
def test_gin_model_file_builds_its_config(repo_dir, name):
    config = gin_config(repo_dir, name, llama.LlamaConfig)
    for field, value in GIN_FILES[name].items():
        assert getattr(config, field) == value, field
    assert config.vocab_size % 128 == 0
    if name in PUBLISHED_PARAMS:
        assert config.num_params() / 1e9 == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)


def test_finetune_gin_parses_with_the_tiny_llama(repo_dir):
    gin.clear_config()
    try:
        gin_utils.parse_gin(["llama_finetune.gin"], search_paths=[f"{repo_dir}/gin"])
        assert gin.query_parameter("%INIT_FROM_HF") is None
        assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == "stdlib_py"
        assert llama.LlamaConfig().hidden_size == 256
    finally:
        gin.clear_config()
