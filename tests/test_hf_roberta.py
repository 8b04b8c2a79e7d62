"""RoBERTa (masked LM) from and to HuggingFace, and masked-LM training."""

import jax
import numpy as np
import pytest
import torch
import transformers

from flaxlm.checkpoints import hf
from flaxlm.parallel.partitioning import Partitioner
from tests.hf_helpers import (
    max_abs_diff,
    padded_batch,
    save_torch_model,
    torch_logits,
    train_on_batch,
)

VOCAB = 250
VARIANTS = {
    "small": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "wide_ffn": dict(
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=160,
        layer_norm_eps=1e-5,
    ),
}


def tiny_hf_roberta(tmp_path, variant):
    kwargs = dict(
        vocab_size=VOCAB,
        max_position_embeddings=40,
        type_vocab_size=1,
        pad_token_id=1,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **VARIANTS[variant],
    )
    torch.manual_seed(0)
    model = transformers.RobertaForMaskedLM(transformers.RobertaConfig(**kwargs)).eval()
    with torch.no_grad():  # HF starts biases and norms at 0/1: make every tensor count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model, save_torch_model(model, tmp_path / "hf")


def encoder_batch(ids, mask):
    """Our features for HF's right-padded ids (HF's pad id is 1; ours is segment 0)."""
    length = ids.shape[1]
    return {
        "encoder_input_tokens": ids.astype(np.int32),
        "encoder_target_tokens": ids.astype(np.int32),
        "encoder_loss_weights": mask.astype(np.int32),
        "encoder_segment_ids": mask.astype(np.int32),
        "encoder_positions": np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape).copy(),
    }


def hf_inputs(ids, mask):
    ids = np.where(mask == 1, ids, 1)  # HF finds padding by its pad token id
    return dict(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("mesh_shape", [None, (1, 4, 2)])
def test_import_matches_transformers_and_export_reloads(tmp_path, variant, mesh_shape):
    torch_model, path = tiny_hf_roberta(tmp_path, variant)
    partitioner = Partitioner(mesh_shape=mesh_shape) if mesh_shape else None
    model, params = hf.from_pretrained(path, partitioner, scan_layers=mesh_shape is not None)
    ids, mask = padded_batch(VOCAB, lengths=(12, 7, 12, 3))
    ids = np.where(ids == 1, 5, ids)  # keep HF's pad id out of the real tokens
    theirs = torch_logits(torch_model, **hf_inputs(ids, mask))
    ours = jax.jit(model.compute_logits)(params, encoder_batch(ids, mask))
    assert max_abs_diff(ours, theirs, mask) < 1e-4
    assert int(np.asarray(ours).argmax(-1).max()) < VOCAB

    out = tmp_path / "out"
    hf.save_pretrained(model, params, out)
    reloaded, info = transformers.AutoModelForMaskedLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    again = torch_logits(reloaded.eval(), **hf_inputs(ids, mask))
    assert max_abs_diff(again, theirs, mask) < 1e-5


def test_bare_encoder_checkpoint_is_refused_without_the_head(tmp_path):
    torch_model, _ = tiny_hf_roberta(tmp_path, "small")
    bare = save_torch_model(torch_model.roberta, tmp_path / "bare")
    with pytest.raises(ValueError, match=r"lm_head\.dense\.weight.*missing"):
        hf.from_pretrained(bare)


@pytest.mark.slow
def test_masked_lm_training_under_fsdp_then_export(tmp_path):
    _, path = tiny_hf_roberta(tmp_path, "small")
    partitioner = Partitioner(mesh_shape=(1, 8, 1))
    model, params = hf.from_pretrained(path, partitioner)
    ids, mask = padded_batch(VOCAB, lengths=(12, 7, 12, 3, 9, 12, 5, 10))
    ids = np.where(ids <= 2, 5, ids)
    rng = np.random.default_rng(0)
    chosen = (rng.random(ids.shape) < 0.3) & (mask == 1)
    batch = encoder_batch(np.where(chosen, 4, ids), mask)  # id 4 plays <mask>
    batch["encoder_target_tokens"] = np.where(chosen, ids, 0).astype(np.int32)
    batch["encoder_loss_weights"] = chosen.astype(np.int32)
    state, history = train_on_batch(model, params, partitioner, batch, steps=6)
    losses = [m["loss"] for m in history]
    # The loss counts the masked ids only.
    assert all(m["num_tokens"] == chosen.sum() for m in history)
    assert losses[-1] < losses[0] - 0.1, losses
    hf.save_pretrained(model, state.params, tmp_path / "trained")
    reloaded = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "trained"))
    ours = jax.jit(model.compute_logits)(state.params, encoder_batch(ids, mask))
    theirs = torch_logits(reloaded.eval(), **hf_inputs(ids, mask))
    assert max_abs_diff(ours, theirs, mask) < 1e-4
