"""Gemma from and to HuggingFace: logits against transformers' PyTorch model."""

import json

import jax
import numpy as np
import pytest
import transformers

from flaxlm.checkpoints import hf
from flaxlm.models import llama
from flaxlm.parallel.partitioning import Partitioner
from tests.hf_helpers import (
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
LENGTHS = (20, 11, 20, 5)

# head_dim 16 is not hidden_size / num_heads (8) in either variant.
VARIANTS = {
    "multi_query": dict(num_key_value_heads=1),
    "multi_head": dict(num_key_value_heads=4, rope_parameters={"rope_theta": 5e4}),
}


def tiny_hf_gemma(tmp_path, **overrides):
    """A random tiny torch model (norm weights perturbed too), saved to `tmp_path/hf`."""
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=64,
        attention_dropout=0.0,
        initializer_range=0.1,  # sharp enough attention that positions visibly matter
    )
    kwargs.update(overrides)
    model = random_hf_model(transformers.GemmaConfig, transformers.GemmaForCausalLM, **kwargs)
    return model, save_torch_model(model, tmp_path / "hf")


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_import_matches_transformers_and_export_reloads(tmp_path, variant):
    torch_model, path = tiny_hf_gemma(tmp_path, **VARIANTS[variant])
    ids, mask = padded_batch(VOCAB, LENGTHS)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)

    model, params = hf.from_pretrained(path)
    assert model.config.head_dim == 16 and model.config.tie_word_embeddings
    assert (
        max_abs_diff(jax.jit(model.compute_logits)(params, decoder_batch(ids, mask)), theirs, mask)
        < 1e-4
    )

    scan = variant == "multi_head"
    model, params = hf.from_pretrained(path, Partitioner(mesh_shape=(1, 4, 2)), scan_layers=scan)
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    assert max_abs_diff(ours, theirs, mask) < 1e-4
    assert int(np.asarray(ours).argmax(-1).max()) < VOCAB
    k_proj = (params["layers"]["block"] if scan else params["layers_0"])["k_proj"]["kernel"]
    # One shared key/value head is replicated; several are split like the query heads.
    assert k_proj.sharding.spec[-2] == (None if variant == "multi_query" else "tensor")

    out = tmp_path / "out"
    hf.save_pretrained(model, params, out)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert isinstance(reloaded, transformers.GemmaForCausalLM)
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(again, theirs, mask) < 1e-5
    exported = json.loads((out / "config.json").read_text())
    assert exported["vocab_size"] == VOCAB and exported["head_dim"] == 16


@pytest.mark.slow
def test_fsdp_training_lowers_the_loss_and_exports(tmp_path):
    _, path = tiny_hf_gemma(tmp_path, **VARIANTS["multi_query"])
    partitioner = Partitioner(mesh_shape=(1, 8, 1))
    model, params = hf.from_pretrained(path, partitioner)
    ids, mask = padded_batch(VOCAB, (16, 16, 11, 16, 16, 7, 16, 16), seed=1)
    batch = decoder_batch(ids, mask)
    state, history = train_on_batch(model, params, partitioner, batch, 8, learning_rate=1e-2)
    params, losses = state.params, [m["loss"] for m in history]
    assert losses[-1] < losses[0] - 0.5, losses
    assert params["embed_tokens"]["embedding"].sharding.spec[1] == "fsdp"

    out = tmp_path / "trained"
    hf.save_pretrained(model, params, out)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    theirs = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, theirs, mask) < 1e-4


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="num_kv_heads"):
        llama.LlamaConfig(**GEMMA, num_heads=8, num_kv_heads=3)
    with pytest.raises(ValueError, match="activation"):
        llama.LlamaConfig(**{**GEMMA, "activation": "gelu_fast"})
    with pytest.raises(ValueError, match="norm_scale_plus_one"):
        llama.LlamaConfig(**{**GEMMA, "norm_scale_plus_one": False})


# What makes a LlamaConfig a Gemma.
GEMMA = dict(
    model_type="gemma",
    scale_embedding=True,
    norm_scale_plus_one=True,
    activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
)

GIN_FILES = {
    "gemma_tiny": dict(vocab_size=384, hidden_size=256, num_kv_heads=1, head_dim=96),
    "gemma_2b": dict(hidden_size=2048, num_layers=18, num_heads=8, num_kv_heads=1),
    "gemma_7b": dict(hidden_size=3072, num_layers=28, num_heads=16, num_kv_heads=16),
}


@pytest.mark.parametrize("name", sorted(GIN_FILES))
def test_gin_model_file_builds_its_config(repo_dir, name):
    config = gin_config(repo_dir, name, llama.LlamaConfig)
    for field, value in {**GEMMA, **GIN_FILES[name]}.items():
        assert getattr(config, field) == value, field
    assert config.vocab_size % 128 == 0 and config.tie_word_embeddings
