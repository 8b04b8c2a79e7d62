"""OPT from and to HuggingFace: logits against transformers' PyTorch model, then training."""

import json
import os

import gin
import jax
import numpy as np
import pytest
import torch
import transformers

from flaxlm.checkpoints import hf
from flaxlm.models import base, opt
from flaxlm.parallel.partitioning import Partitioner
from tests.hf_helpers import (
    bare_base_model_logits,
    decoder_batch,
    max_abs_diff,
    padded_batch,
    save_torch_model,
    torch_logits,
    train_on_batch,
)

VOCAB = 250
VARIANTS = {
    # OPT-125m..66b: layer norm before each sublayer, a final norm, no projection.
    "pre_ln": dict(do_layer_norm_before=True),
    # OPT-350m: post-LN blocks, no final norm, 16-wide embeddings projected to 32.
    "post_ln_proj": dict(do_layer_norm_before=False, word_embed_proj_dim=16),
    # LayerNorms without scale or bias (no tensors in the file).
    "no_affine": dict(do_layer_norm_before=True, layer_norm_elementwise_affine=False),
}
GIN_SIZES = {  # gin file -> (hidden_size, num_layers, approximate parameter count)
    "opt_tiny": (256, 4, None),
    "opt_125m": (768, 12, 125e6),
    "opt_350m": (1024, 24, 331e6),
    "opt_1.3b": (2048, 24, 1.3e9),
    "opt_6.7b": (4096, 32, 6.7e9),
    "opt_13b": (5120, 40, 13e9),
    "opt_30b": (7168, 48, 30e9),
    "opt_66b": (9216, 64, 66e9),
}


def tiny_hf_opt(tmp_path, variant, **overrides):
    """A random 2-layer OPT whose biases and norms are random too (HF inits them to 0/1)."""
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        **VARIANTS[variant],
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model, save_torch_model(model, tmp_path / "hf")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(
    "mesh_shape,scan_layers", [(None, False), ((1, 4, 2), True)], ids=["one_device", "mesh_scan"]
)
def test_import_matches_transformers(tmp_path, variant, mesh_shape, scan_layers):
    torch_model, path = tiny_hf_opt(tmp_path, variant)
    partitioner = Partitioner(mesh_shape=mesh_shape) if mesh_shape else None
    model, params = hf.from_pretrained(path, partitioner, scan_layers=scan_layers)
    assert model.config.vocab_size == 256 and model.config.real_vocab_size == VOCAB
    assert model.config.final_layer_norm == (variant != "post_ln_proj")
    ids, mask = padded_batch(VOCAB)
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, theirs, mask) < 1e-4
    assert int(np.asarray(ours).argmax(-1).max()) < VOCAB
    block = params["layers"]["block"] if scan_layers else params["layers_0"]
    assert ("self_attn_layer_norm" in block) == (variant != "no_affine")
    if mesh_shape:
        fc1 = params["layers"]["block"]["fc1"]["kernel"]
        assert fc1.shape[0] == 2 and fc1.sharding.spec[-1] == "tensor"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_export_reloads_in_transformers(tmp_path, variant):
    torch_model, path = tiny_hf_opt(tmp_path, variant)
    model, params = hf.from_pretrained(path, Partitioner(mesh_shape=(1, 4, 2)))
    out = tmp_path / "out"
    hf.save_pretrained(model, params, out)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids, mask = padded_batch(VOCAB)
    a = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    b = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(b, a, mask) < 1e-5
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["tie_word_embeddings"]
    assert {k: config[k] for k in VARIANTS[variant]} == VARIANTS[variant]


def test_untied_head_without_biases_round_trips(tmp_path):
    torch_model, path = tiny_hf_opt(
        tmp_path, "pre_ln", tie_word_embeddings=False, enable_bias=False
    )
    model, params = hf.from_pretrained(path)
    assert "lm_head" in params and "bias" not in params["layers_0"]["fc1"]
    ids, mask = padded_batch(VOCAB)
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, theirs, mask) < 1e-4
    hf.save_pretrained(model, params, tmp_path / "out")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_checkpoint_of_the_bare_base_model_loads(tmp_path):
    # Hub files saved from OPTModel name tensors without the 'model.' prefix.
    torch_model, _ = tiny_hf_opt(tmp_path, "pre_ln")
    ids, mask = padded_batch(VOCAB)
    bare = tmp_path / "bare"
    assert (
        bare_base_model_logits(torch_model, torch_model.model, bare, "decoder.", ids, mask) < 1e-4
    )


@pytest.mark.slow
def test_training_from_import_under_fsdp_lowers_loss_and_exports(tmp_path):
    _, path = tiny_hf_opt(tmp_path, "post_ln_proj")
    partitioner = Partitioner(mesh_shape=(1, 8, 1))
    model, params = hf.from_pretrained(path, partitioner)
    ids, mask = padded_batch(VOCAB, lengths=(12, 7, 12, 3, 9, 12, 5, 10))
    batch = decoder_batch(ids, mask)
    state, history = train_on_batch(model, params, partitioner, batch, steps=6)
    losses = [m["loss"] for m in history]
    assert losses[-1] < losses[0] - 0.1, losses
    embedding = state.params["embed_tokens"]["embedding"]
    assert embedding.sharding.spec[1] == "fsdp"  # FSDP: params split over the 8 devices

    hf.save_pretrained(model, state.params, tmp_path / "trained")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"))
    theirs = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    ours = jax.jit(model.compute_logits)(state.params, batch)
    assert max_abs_diff(ours, theirs, mask) < 1e-4


@pytest.mark.parametrize("key,value", [("activation_function", "tanh")])
def test_unsupported_hf_options_are_refused(tmp_path, key, value):
    _, path = tiny_hf_opt(tmp_path, "pre_ln")
    config = json.loads(open(os.path.join(path, "config.json")).read())
    config[key] = value
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=key.replace("_function", "")):
        hf.from_pretrained(path)


def test_old_checkpoint_without_final_norm_loads(tmp_path):
    torch_model, path = tiny_hf_opt(tmp_path, "pre_ln", _remove_final_layer_norm=True)
    model, params = hf.from_pretrained(path)
    assert "final_layer_norm" not in params
    ids, mask = padded_batch(VOCAB)
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, theirs, mask) < 1e-4


@pytest.mark.parametrize("name", sorted(GIN_SIZES))
def test_gin_model_file_builds_its_config(repo_dir, name):
    hidden, num_layers, approx_params = GIN_SIZES[name]
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(
            [os.path.join(repo_dir, "gin", "models", f"{name}.gin")], [], finalize_config=False
        )
        config = opt.OPTConfig()
        model = base.DecoderOnlyModel()
    finally:
        gin.clear_config()
    assert (config.hidden_size, config.num_layers) == (hidden, num_layers)
    assert model.config == config
    assert config.vocab_size % 128 == 0 and config.ffn_dim == 4 * config.hidden_size
    if approx_params:
        assert abs(config.num_params() / approx_params - 1) < 0.06, config.num_params()
