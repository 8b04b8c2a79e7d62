"""Phi-3, Phi-3.5-mini, Phi-4 and Phi-4-mini from and to HuggingFace: every promise of the
family against transformers' PyTorch `Phi3ForCausalLM`."""

import dataclasses

import jax
import numpy as np
import pytest
import transformers

from flaxlm.checkpoints import hf
from flaxlm.models import decoding, phi3
from flaxlm.models.options import ComputeOptions
from tests.hf_helpers import (
    LIGHT,
    check_family,
    decoder_batch,
    gin_config,
    max_abs_diff,
    padded_batch,
    random_hf_model,
    save_torch_model,
    torch_logits,
)

VOCAB = 250
ORIGINAL_CONTEXT = 16  # LongRoPE switches to its long factors past this many positions


def tiny_hf_phi3(tmp_path, **overrides):
    """A random tiny torch Phi-3 (norm weights perturbed too), saved to `tmp_path/hf`."""
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        original_max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.1,  # sharp enough attention that positions visibly matter
        bos_token_id=1,
        eos_token_id=None,  # HF generate would refuse it before min_new_tokens
        pad_token_id=None,
    )
    kwargs.update(overrides)
    model = random_hf_model(transformers.Phi3Config, transformers.Phi3ForCausalLM, **kwargs)
    return model, save_torch_model(model, tmp_path / "hf")


@pytest.mark.slow
def test_phi3_mini_shaped_checkpoint_keeps_every_promise(tmp_path):
    """Phi-3-mini-4k's shape: full rotary, default rope, a sliding window (8 here, shorter
    than the prompts plus the generated tokens), untied head; GQA."""
    torch_model, path = tiny_hf_phi3(tmp_path, num_key_value_heads=2, sliding_window=8)
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path)
    model, params = hf.from_pretrained(path)
    assert model.config.sliding_window == 8 and model.config.kv_heads == 2
    assert params["layers_0"]["q_proj"]["kernel"].shape == (32, 4, 8)


@pytest.mark.slow
def test_phi4_mini_shaped_longrope_checkpoint_keeps_every_promise(tmp_path):
    """Phi-3.5-mini / Phi-4-mini's shape: LongRoPE over 3/4 of each head, tied head, GQA.
    The logits batch (24 positions) and the generation (prompts of up to 14 tokens, 30 new)
    reach past the original 16 positions: HF's long factors, HF's switch mid-generation."""
    torch_model, path = tiny_hf_phi3(
        tmp_path,
        num_key_value_heads=2,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=ORIGINAL_CONTEXT,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.75,
            # One factor per rotary frequency: head_dim 8 * 0.75 = 6 rotary features.
            "short_factor": [1.0, 1.5, 2.5],
            "long_factor": [1.5, 6.0, 24.0],
            "original_max_position_embeddings": ORIGINAL_CONTEXT,
        },
        tie_word_embeddings=True,
    )
    check_family(torch_model, path, VOCAB, prompt_lengths=(11, 4, 14), tmp_path=tmp_path, **LIGHT)

    model, params = hf.from_pretrained(path)
    assert model.config.tie_word_embeddings and model.config.rotary_dim == 6
    # Within the original context: the short factors, as HF.
    ids, mask = padded_batch(VOCAB, (ORIGINAL_CONTEXT, 9, 12))
    short = np.asarray(jax.jit(model.compute_logits)(params, decoder_batch(ids, mask)))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(short, theirs, mask) < 1e-4
    # The same tokens in a call that reaches past it are rotated with the long factors.
    wide = np.pad(ids, ((0, 0), (0, 8)))
    long = np.asarray(
        jax.jit(model.compute_logits)(params, decoder_batch(wide, np.pad(mask, ((0, 0), (0, 8)))))
    )
    assert np.abs(long[:, :ORIGINAL_CONTEXT] - short).max() > 1e-3
    # The decoding step that crosses recomputes the cache, as HF's generate does.
    row = np.random.default_rng(1).integers(1, VOCAB, (1, ORIGINAL_CONTEXT + 1), np.int32)
    config = decoding.DecodingConfig(max_new_tokens=2)
    _, state = model.prefill(params, row[:, :-1], np.array([ORIGINAL_CONTEXT]), config)
    step, _ = model.decode_step(params, row[:, -1], np.int32(0), state, config)
    theirs = torch_logits(torch_model, input_ids=row.astype(np.int64))[:, -1]
    assert np.abs(np.asarray(step)[:, :VOCAB] - theirs).max() < 1e-4


@pytest.mark.slow
def test_phi4_shaped_checkpoint_keeps_every_promise(tmp_path):
    """Phi-4's shape (multi-head here): default rope with a large theta, untied head."""
    torch_model, path = tiny_hf_phi3(
        tmp_path,
        num_key_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 2.5e5},
    )
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path)
    model, _ = hf.from_pretrained(path)
    assert not model.config.tie_word_embeddings and model.config.rope_theta == 2.5e5


def test_legacy_rope_names_read_as_longrope():
    factors = dict(short_factor=[1.0, 2.0], long_factor=[3.0, 4.0])
    for name in ("su", "yarn", "longrope"):
        # As Phi-3.5-mini's and Phi-4-mini's config.json: rope fields at the top level.
        legacy = {"rope_theta": 5e4, "partial_rotary_factor": 0.75}
        rope = phi3.rope_from_hf({**legacy, "rope_scaling": {"type": name, **factors}})
        assert rope["rope_scaling_type"] == "longrope" and rope["rope_theta"] == 5e4
        assert rope["partial_rotary_factor"] == 0.75
        assert rope["rope_long_factor"] == (3.0, 4.0)
    with pytest.raises(ValueError, match="'dynamic'"):
        phi3.rope_from_hf({"rope_scaling": {"type": "dynamic", "factor": 2.0}})


GIN_FILES = {
    "phi3_tiny": dict(vocab_size=384, hidden_size=256, partial_rotary_factor=0.75),
    "phi3_mini": dict(vocab_size=32128, real_vocab_size=32064, rope_scaling_type="longrope"),
    "phi4_mini": dict(vocab_size=200064, num_kv_heads=8, tie_word_embeddings=True),
    "phi4": dict(vocab_size=100352, hidden_size=5120, num_kv_heads=10, rope_theta=2.5e5),
}


@pytest.mark.parametrize("name", sorted(GIN_FILES))
def test_gin_model_file_builds_its_config(repo_dir, name):
    config = gin_config(repo_dir, name, phi3.Phi3Config)
    for field, value in GIN_FILES[name].items():
        assert getattr(config, field) == value, field
    assert config.vocab_size % 128 == 0
    # What an export writes reads back as the same config.
    kept = {f.name: getattr(config, f.name) for f in dataclasses.fields(ComputeOptions)}
    kept.update(vocab_size=config.vocab_size, real_vocab_size=config.real_vocab_size)
    assert phi3.config_from_hf(phi3.config_to_hf(config), **kept) == config


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_heads=4, num_kv_heads=3, hidden_size=32), "num_kv_heads"),
        (dict(hidden_size=30, num_heads=4), "hidden_size"),
        (dict(hidden_size=48, num_heads=4, partial_rotary_factor=0.75), "partial_rotary_factor"),
        (dict(rope_scaling_type="yarn"), "rope_scaling_type"),
        (dict(rope_short_factor=(1.0,) * 48), "rope_short_factor"),
        (dict(rope_scaling_type="longrope", rope_short_factor=(1.0,) * 48), "rope_long_factor"),
        (
            dict(
                rope_scaling_type="longrope",
                rope_short_factor=(1.0,) * 47,
                rope_long_factor=(1.0,) * 48,
            ),
            "rope_short_factor",
        ),
        (dict(sliding_window=0), "sliding_window"),
        (dict(original_max_position_embeddings=0), "original_max_position_embeddings"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        phi3.Phi3Config(**kwargs)
