"""YaRN rope (`rope_type: yarn`) from and to HuggingFace: Llama, Qwen2 and Qwen3 read past
their original context against transformers' PyTorch models, and the frequencies and
attention factor against transformers' own `_compute_yarn_parameters`."""

import json

import jax
import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from flaxlm.checkpoints import hf, hf_files
from flaxlm.models import gemma, llama, qwen, rope
from tests.hf_helpers import (
    decoder_batch,
    flaxlm_greedy_batch,
    hf_greedy_batch,
    max_abs_diff,
    padded_batch,
    random_hf_model,
    save_torch_model,
    torch_logits,
)

VOCAB = 128
ORIGINAL = 32  # the "pretraining" context; the batches and generations below run to 96
LENGTHS = (96, 57, 96, 20)
YARN = {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": ORIGINAL}

# One per family, each with other YaRN options: HF's defaults (beta 32/1, truncated ramp,
# attention factor 0.1 ln(factor) + 1); Qwen2.5's long-context shape with its own betas and
# an untruncated ramp; DeepSeek's mscale / mscale_all_dim attention factor.
CASES = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(num_key_value_heads=2, rope_parameters={**YARN, "rope_theta": 1e4}),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(
            num_key_value_heads=4,
            rope_parameters={
                **YARN,
                "rope_theta": 1e6,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "truncate": False,
                "attention_factor": 1.2,
            },
        ),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(
            head_dim=16,
            num_key_value_heads=2,
            rope_parameters={**YARN, "rope_theta": 1e4, "mscale": 1.0, "mscale_all_dim": 0.5},
        ),
    ),
}


def tiny_hf_model(tmp_path, name):
    config_cls, model_cls, overrides = CASES[name]
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=ORIGINAL * 3,  # factor x original, as HF's check expects
        attention_dropout=0.0,
        initializer_range=0.1,  # sharp enough attention that positions visibly matter
        **overrides,
    )
    model = random_hf_model(config_cls, model_cls, ("norm.weight", ".bias"), **kwargs)
    return model, save_torch_model(model, tmp_path / "hf")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_yarn_checkpoint_matches_transformers_past_the_original_context(tmp_path, name):
    torch_model, path = tiny_hf_model(tmp_path, name)
    ids, mask = padded_batch(VOCAB, LENGTHS)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)

    model, params = hf.from_pretrained(path)
    assert model.config.rope_scaling_type == "yarn"
    ours = np.asarray(jax.jit(model.compute_logits)(params, decoder_batch(ids, mask)))
    # Two float32 computations of the same logits part by about eps (1.2e-7) x the rounding
    # stages (~10 a layer: 2 layers and the head, ~25) x the logits' scale (|logit| < 10
    # here): ~3e-5; 1e-4, the family checks' bound, covers it.
    assert max_abs_diff(ours, theirs, mask) < 1e-4

    # Prompts and 40 greedy tokens run to position 80, well past the original 32.
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (40, 9, 23)]
    assert flaxlm_greedy_batch(model, params, prompts, 40) == hf_greedy_batch(
        torch_model, prompts, 40
    )

    out = tmp_path / "export"
    hf.save_pretrained(model, params, out)
    exported = json.loads((out / "config.json").read_text())
    source = hf_files.read_hf_config(path)
    assert rope.from_hf(exported) == rope.from_hf(source)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(reloaded) is type(torch_model)
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, again, mask) <= 1e-5 * max(1.0, np.abs(again).max())


@pytest.mark.parametrize(
    "params",
    [
        dict(factor=4.0),
        dict(factor=3.0, beta_fast=8.0, beta_slow=2.0, truncate=False),
        dict(factor=40.0, mscale=1.0, mscale_all_dim=0.707),  # DeepSeek-V3's
        dict(factor=2.0, attention_factor=1.3),
        dict(factor=None),  # DeepSeek-style: max_position_embeddings / original
        dict(factor=8.0, beta_fast=0, beta_slow=None),  # HF reads 0 and None as 32 and 1
    ],
)
def test_yarn_frequencies_and_attention_factor_equal_transformers(params):
    config = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        max_position_embeddings=4 * ORIGINAL,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 5e4,
            **params,
            "original_max_position_embeddings": ORIGINAL,
        },
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = llama.config_from_hf(config.to_dict())
    np.testing.assert_allclose(rope.inv_freq(ours), inv_freq.numpy(), rtol=1e-6)
    assert rope.attention_factor(ours) == pytest.approx(factor, rel=1e-12)


def test_legacy_rope_scaling_yarn_reads_as_qwen_documents_it():
    """Qwen2.5's model cards enable YaRN with the older `rope_scaling` field."""
    legacy = {
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    assert rope.from_hf(legacy) == {
        "rope_theta": 1e6,
        "rope_scaling_type": "yarn",
        "rope_scaling_factor": 4.0,
        "rope_original_max_position_embeddings": 32768,
        "rope_beta_fast": 32.0,
        "rope_beta_slow": 1.0,
        "rope_truncate": True,
    }


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(rope_beta_fast=1.0, rope_beta_slow=2.0), "rope_beta_fast"),
        (dict(rope_attention_factor=0.0), "rope_attention_factor"),
        (dict(rope_original_max_position_embeddings=0), "rope_original_max_position_embeddings"),
    ],
)
def test_bad_yarn_config_names_the_field(kwargs, field):
    for config_cls in (llama.LlamaConfig, qwen.QwenConfig):
        with pytest.raises(ValueError, match=field):
            config_cls(rope_scaling_type="yarn", rope_scaling_factor=4.0, **kwargs)


def test_gemma_still_refuses_yarn():
    hf_config = {
        "model_type": "gemma2",
        "rope_parameters": {**YARN, "rope_theta": 1e4},
    }
    with pytest.raises(ValueError, match="'yarn'"):
        gemma.rope_from_hf(hf_config)
