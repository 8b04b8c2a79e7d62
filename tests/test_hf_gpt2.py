"""GPT-2 from and to HuggingFace: logits against transformers' PyTorch model, then training."""

import json
import os

import gin
import jax
import numpy as np
import pytest
import torch
import transformers

from flaxlm.checkpoints import hf
from flaxlm.models import base, gpt2
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
    # GPT-2 as published: 4x MLP, gelu-new, scores scaled by 1/sqrt(head_dim).
    "standard": dict(n_head=4),
    # Narrower heads, an explicit n_inner, exact gelu and unscaled scores.
    "narrow_heads": dict(
        n_head=8, n_inner=48, activation_function="gelu", scale_attn_weights=False
    ),
    # Layer i's scores also divided by i + 1, computed by HF's upcast-and-reorder path.
    "layer_scaled": dict(
        n_head=4, scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True
    ),
}
GIN_SIZES = {  # gin file -> (hidden_size, num_layers, approximate parameter count)
    "gpt2_tiny": (256, 4, None),
    "gpt2_small": (768, 12, 124e6),
    "gpt2_medium": (1024, 24, 355e6),
    "gpt2_large": (1280, 36, 774e6),
    "gpt2_xl": (1600, 48, 1558e6),
}


def tiny_hf_gpt2(tmp_path, variant, **overrides):
    """A random 2-layer GPT-2 whose biases and norms are random too (HF inits them to 0/1)."""
    kwargs = dict(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        **VARIANTS[variant],
    )
    kwargs.update(overrides)
    if kwargs.get("reorder_and_upcast_attn"):
        kwargs["attn_implementation"] = "eager"  # HF reorders and upcasts only when eager
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model, save_torch_model(model, tmp_path / "hf")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(
    "mesh_shape,scan_layers", [(None, False), ((1, 4, 2), True)], ids=["one_device", "mesh_scan"]
)
def test_import_matches_transformers(tmp_path, variant, mesh_shape, scan_layers):
    torch_model, path = tiny_hf_gpt2(tmp_path, variant)
    partitioner = Partitioner(mesh_shape=mesh_shape) if mesh_shape else None
    model, params = hf.from_pretrained(path, partitioner, scan_layers=scan_layers)
    assert model.config.vocab_size == 256 and model.config.real_vocab_size == VOCAB
    ids, mask = padded_batch(VOCAB)
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, theirs, mask) < 1e-4
    assert int(np.asarray(ours).argmax(-1).max()) < VOCAB
    if mesh_shape:
        c_attn = params["h"]["block"]["attn"]["c_attn"]["kernel"]
        # [layers, embed, 3, heads, head_dim]: embed over fsdp, heads over tensor.
        assert c_attn.shape[:3] == (2, 32, 3)
        assert tuple(c_attn.sharding.spec)[1:4] == ("fsdp", None, "tensor")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_export_reloads_in_transformers(tmp_path, variant):
    torch_model, path = tiny_hf_gpt2(tmp_path, variant)
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


def test_untied_head_round_trips(tmp_path):
    torch_model, path = tiny_hf_gpt2(tmp_path, "standard", tie_word_embeddings=False)
    model, params = hf.from_pretrained(path)
    assert "lm_head" in params
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
    # Hub files saved from GPT2Model name tensors without the 'transformer.' prefix.
    torch_model, _ = tiny_hf_gpt2(tmp_path, "standard")
    prefixes = ("h.", "wte.", "wpe.", "ln_f.")
    ids, mask = padded_batch(VOCAB)
    bare = tmp_path / "bare"
    assert (
        bare_base_model_logits(torch_model, torch_model.transformer, bare, prefixes, ids, mask)
        < 1e-4
    )


@pytest.mark.slow
def test_training_from_import_under_fsdp_lowers_loss_and_exports(tmp_path):
    _, path = tiny_hf_gpt2(tmp_path, "narrow_heads")
    partitioner = Partitioner(mesh_shape=(1, 8, 1))
    model, params = hf.from_pretrained(path, partitioner)
    ids, mask = padded_batch(VOCAB, lengths=(12, 7, 12, 3, 9, 12, 5, 10))
    batch = decoder_batch(ids, mask)
    state, history = train_on_batch(model, params, partitioner, batch, steps=6)
    losses = [m["loss"] for m in history]
    assert losses[-1] < losses[0] - 0.1, losses
    assert state.params["wte"]["embedding"].sharding.spec[1] == "fsdp"

    hf.save_pretrained(model, state.params, tmp_path / "trained")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"))
    theirs = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    ours = jax.jit(model.compute_logits)(state.params, batch)
    assert max_abs_diff(ours, theirs, mask) < 1e-4


def test_unsupported_hf_options_are_refused(tmp_path):
    _, path = tiny_hf_gpt2(tmp_path, "standard")
    config = json.loads(open(os.path.join(path, "config.json")).read())
    config["add_cross_attention"] = True
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="add_cross_attention"):
        hf.from_pretrained(path)


@pytest.mark.parametrize("name", sorted(GIN_SIZES))
def test_gin_model_file_builds_its_config(repo_dir, name):
    hidden, num_layers, approx_params = GIN_SIZES[name]
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(
            [os.path.join(repo_dir, "gin", "models", f"{name}.gin")], [], finalize_config=False
        )
        config = gpt2.GPT2Config()
        model = base.DecoderOnlyModel()
    finally:
        gin.clear_config()
    assert (config.hidden_size, config.num_layers) == (hidden, num_layers)
    assert model.config == config
    assert config.vocab_size % 128 == 0 and config.mlp_dim == 4 * config.hidden_size
    if approx_params:
        assert abs(config.num_params() / approx_params - 1) < 0.02, config.num_params()
