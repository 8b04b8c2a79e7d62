"""GPT-J from and to HuggingFace: logits against transformers' PyTorch model."""

import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers

from flaxlm.checkpoints import hf
from flaxlm.parallel.partitioning import Partitioner
from tests.hf_helpers import (
    decoder_batch,
    max_abs_diff,
    padded_batch,
    save_torch_model,
    torch_logits,
)


def tiny_hf_gptj(tmp_path, **overrides):
    kwargs = dict(
        vocab_size=250,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        rotary_dim=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = transformers.GPTJForCausalLM(transformers.GPTJConfig(**kwargs)).eval()
    return model, save_torch_model(model, tmp_path / "hf")


@pytest.mark.parametrize("mesh_shape", [None, (1, 4, 2)])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_import_matches_transformers(tmp_path, mesh_shape, scan_layers):
    torch_model, path = tiny_hf_gptj(tmp_path)
    partitioner = Partitioner(mesh_shape=mesh_shape) if mesh_shape else None
    model, params = hf.from_pretrained(path, partitioner, scan_layers=scan_layers)
    assert model.config.vocab_size == 256 and model.config.real_vocab_size == 250
    ids, mask = padded_batch(250)
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, theirs, mask) < 1e-4
    # The padded vocabulary rows never win.
    assert int(np.asarray(ours).argmax(-1).max()) < 250
    if mesh_shape:
        kernel = (
            params["h"]["block"]["fc_in"]["kernel"]
            if scan_layers
            else params["h_0"]["fc_in"]["kernel"]
        )
        assert kernel.sharding.spec[-1] == "tensor"


def test_export_reloads_in_transformers(tmp_path):
    torch_model, path = tiny_hf_gptj(tmp_path, n_layer=3)
    model, params = hf.from_pretrained(path, Partitioner(mesh_shape=(2, 2, 2)))
    out = tmp_path / "out"
    hf.save_pretrained(model, params, out)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids, mask = padded_batch(250)
    a = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    b = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(b, a, mask) < 1e-5
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 250


def test_sharded_export_writes_an_index(tmp_path):
    _, path = tiny_hf_gptj(tmp_path)
    model, params = hf.from_pretrained(path)
    out = tmp_path / "out"
    hf.save_pretrained(model, params, out, max_shard_size=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _, params2 = hf.from_pretrained(out)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mismatched_checkpoint_names_the_tensor(tmp_path):
    _, path = tiny_hf_gptj(tmp_path)
    config = json.loads(open(os.path.join(path, "config.json")).read())
    config["n_inner"] = 64  # the saved fc_in is 128 wide
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(
        ValueError, match=r"transformer\.h\.0\.mlp\.fc_in\.weight.*\(128, 32\).*\(64, 32\)"
    ):
        hf.from_pretrained(path)


def test_a_tied_head_is_refused_naming_the_setting(tmp_path):
    """transformers ties GPT-J's lm_head.weight to wte where config.json says so (its file
    then has no lm_head.weight); flaxlm's GPT-J keeps its own head, and says so."""
    _, path = tiny_hf_gptj(tmp_path, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tie_word_embeddings true"):
        hf.from_pretrained(path)
