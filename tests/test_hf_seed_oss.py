"""Seed-OSS from and to HuggingFace: logits, greedy generation (generate and the serving
engine), export, the biases' placement, transformers' defaults and the published size.

Two tiny random models of transformers' `SeedOssForCausalLM`: QKV (its published settings:
q/k/v biases only, grouped-query heads wider than width / heads, rope theta 1e7, untied) and
OUT (biases on o and the MLP, none on q/k/v; a llama3 rope; tied).
"""

import dataclasses
import json
import os

import jax
import pytest
import transformers

from flaxlm.checkpoints import hf
from flaxlm.models import seed_oss
from flaxlm.models.base import DecoderOnlyModel
from tests.hf_helpers import (
    LIGHT,
    TINY_DENSE,
    check_family,
    engine_generates_as_hf,
    gin_config,
    random_hf_model,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 120
COMMON = dict(TINY_DENSE, attention_dropout=0.0, residual_dropout=0.0)
QKV = dict(COMMON, head_dim=12, rope_parameters=dict(rope_type="default", rope_theta=1e7))
OUT = dict(
    COMMON,
    head_dim=8,
    attention_bias=False,
    attention_out_bias=True,
    mlp_bias=True,
    tie_word_embeddings=True,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    ),
)
# ByteDance-Seed/Seed-OSS-36B's config.json (transformers 4.57's spelling).
PUBLISHED = dict(
    model_type="seed_oss",
    architectures=["SeedOssForCausalLM"],
    attention_bias=True,
    attention_dropout=0.0,
    attention_out_bias=False,
    head_dim=128,
    hidden_act="silu",
    hidden_size=5120,
    intermediate_size=27648,
    max_position_embeddings=524288,
    mlp_bias=False,
    num_attention_heads=80,
    num_hidden_layers=64,
    num_key_value_heads=8,
    residual_dropout=0.0,
    rms_norm_eps=1e-06,
    rope_scaling={"rope_type": "default"},
    rope_theta=10000000.0,
    tie_word_embeddings=False,
    vocab_size=155136,
)


def tiny_hf_seed_oss(**kwargs):
    """A random tiny `SeedOssForCausalLM` whose norms and biases are perturbed too (HF
    starts them at 1 and 0)."""
    return random_hf_model(
        transformers.SeedOssConfig,
        transformers.SeedOssForCausalLM,
        ("norm.weight", ".bias"),
        **kwargs,
    )


@pytest.mark.slow
def test_published_settings_keep_every_promise(tmp_path):
    torch_model = tiny_hf_seed_oss(**QKV)
    path = str(tmp_path / "hf")
    torch_model.save_pretrained(path)
    model, params = hf.from_pretrained(path)
    cfg = model.config
    assert isinstance(cfg, seed_oss.SeedOssConfig) and cfg.rope_theta == 1e7
    assert cfg.attention_bias and not cfg.attention_out_bias and cfg.dim_per_head == 12
    layer = params["layers_0"]
    assert "bias" in layer["q_proj"] and "bias" not in layer["o_proj"]
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path)
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["residual_dropout"] == 0.0 and not exported["attention_out_bias"]

    # The serving engine (paged cache, prefill in chunks) decodes as HF generates.
    assert engine_generates_as_hf(model, params, torch_model, VOCAB)


@pytest.mark.slow
def test_output_and_mlp_biases_keep_every_promise(tmp_path):
    torch_model = tiny_hf_seed_oss(**OUT)
    path = str(tmp_path / "hf")
    torch_model.save_pretrained(path)
    model, params = hf.from_pretrained(path)
    assert model.config.attention_out_bias and not model.config.attention_bias
    layer = params["layers_0"]
    assert "bias" not in layer["q_proj"] and "bias" in layer["o_proj"]
    assert "bias" in layer["down_proj"] and model.config.tie_word_embeddings
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, **LIGHT)


def test_a_config_json_reads_with_transformers_defaults():
    """What a config.json leaves out is transformers' SeedOssConfig default (q/k/v biases,
    head_dim 128)."""
    theirs = transformers.SeedOssConfig(hidden_size=256, num_attention_heads=16)
    _, ours = hf.config_from_hf_dict(
        {"model_type": "seed_oss", "hidden_size": 256, "num_attention_heads": 16}
    )
    assert ours.dim_per_head == theirs.head_dim == 128
    assert (ours.attention_bias, ours.attention_out_bias) == (True, False)
    assert (ours.num_layers, ours.kv_heads, ours.real_vocab_size) == (64, 8, 155136)


def test_tiny_gin_model_counts_its_params_and_the_published_size_reads_as_the_gin_file():
    cfg = gin_config(REPO, "seed_oss_tiny", seed_oss.SeedOssConfig)
    for config in (cfg, dataclasses.replace(cfg, attention_bias=False, attention_out_bias=True)):
        model = DecoderOnlyModel(config)
        shapes = jax.eval_shape(
            lambda m=model: m.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
        )
        assert sum(x.size for x in jax.tree.leaves(shapes)) == config.num_params()
    from_gin = gin_config(REPO, "seed_oss_36b", seed_oss.SeedOssConfig)
    assert from_gin.num_params() / 1e9 == pytest.approx(36.15, rel=0.001)  # "36B"
    _, read = hf.config_from_hf_dict(PUBLISHED)
    compute = {"dtype", "param_dtype", "remat_policy", "scan_layers", "real_vocab_size"}
    for field in dataclasses.fields(seed_oss.SeedOssConfig):
        if field.name not in compute:
            assert getattr(read, field.name) == getattr(from_gin, field.name), field.name
