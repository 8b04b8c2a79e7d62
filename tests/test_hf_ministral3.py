"""Ministral 3 from and to HuggingFace: logits, greedy generation (generate and the serving
engine), export, the query scale by position, transformers' defaults, refused settings and
the published sizes. (Its multimodal files, as the Hub ships them: test_hf_multimodal.)

Two tiny random models of transformers' `Ministral3ForCausalLM`: FULL (YaRN past an original
context of 8 with a large `llama_4_scaling_beta`, so the queries' scale steps every 8
positions; grouped-query heads wider than hidden / heads; an untied head) and OTHER (a
'linear' rope naming its original context of 6, a sliding window of 8, a tied head).
"""

import dataclasses
import json
import os

import jax
import pytest
import transformers

from flaxlm.checkpoints import hf
from flaxlm.models import ministral3
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.options import ComputeOptions
from tests.hf_helpers import (
    LIGHT,
    TINY_DENSE,
    check_family,
    decoder_batch,
    engine_generates_as_hf,
    gin_config,
    max_abs_diff,
    padded_batch,
    random_hf_model,
    torch_logits,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 120
COMMON = dict(TINY_DENSE)
FULL = dict(
    COMMON,
    head_dim=12,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=3.0,
        original_max_position_embeddings=8,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        llama_4_scaling_beta=0.5,
    ),
)
OTHER = dict(
    COMMON,
    head_dim=8,
    sliding_window=8,
    tie_word_embeddings=True,
    rope_parameters=dict(
        rope_type="linear",
        rope_theta=10000.0,
        factor=2.0,
        original_max_position_embeddings=6,
        llama_4_scaling_beta=0.3,
    ),
)
# mistralai/Ministral-3-3B's text config.json (its Ministral3ForCausalLM, transformers 5.3).
PUBLISHED_3B = dict(
    model_type="ministral3",
    architectures=["Ministral3ForCausalLM"],
    head_dim=128,
    hidden_act="silu",
    hidden_size=3072,
    intermediate_size=9216,
    max_position_embeddings=262144,
    num_attention_heads=32,
    num_hidden_layers=26,
    num_key_value_heads=8,
    rms_norm_eps=1e-05,
    rope_parameters=dict(
        beta_fast=32.0,
        beta_slow=1.0,
        factor=16.0,
        llama_4_scaling_beta=0.1,
        mscale=1.0,
        mscale_all_dim=1.0,
        original_max_position_embeddings=16384,
        rope_theta=1000000.0,
        rope_type="yarn",
        type="yarn",
    ),
    sliding_window=None,
    tie_word_embeddings=True,
    vocab_size=131072,
)


def tiny_hf_ministral3(**kwargs):
    """A random tiny `Ministral3ForCausalLM` whose norms are perturbed too (HF starts them at
    1)."""
    return random_hf_model(
        transformers.Ministral3Config, transformers.Ministral3ForCausalLM, **kwargs
    )


@pytest.mark.slow
def test_full_options_keep_every_promise(tmp_path):
    torch_model = tiny_hf_ministral3(**FULL)
    path = str(tmp_path / "hf")
    torch_model.save_pretrained(path)
    model, params = hf.from_pretrained(path)
    cfg = model.config
    assert isinstance(cfg, ministral3.Ministral3Config) and cfg.rope_scaling_type == "yarn"
    assert (cfg.llama_4_scaling_beta, cfg.rope_original_max_position_embeddings) == (0.5, 8)
    assert cfg.dim_per_head == 12 and cfg.rope_mscale == cfg.rope_mscale_all_dim == 1.0
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path)
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["rope_parameters"]["llama_4_scaling_beta"] == 0.5
    assert exported["rope_parameters"]["original_max_position_embeddings"] == 8

    # The scale counts: without it, the positions past the original context differ.
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    unscaled = DecoderOnlyModel(dataclasses.replace(cfg, llama_4_scaling_beta=0.0))
    assert (
        max_abs_diff(
            jax.jit(unscaled.compute_logits)(params, decoder_batch(ids, mask)), theirs, mask
        )
        > 1e-2
    )

    # The serving engine (paged cache, prefill in chunks) decodes as HF generates.
    assert engine_generates_as_hf(model, params, torch_model, VOCAB)


@pytest.mark.slow
def test_other_options_keep_every_promise(tmp_path):
    torch_model = tiny_hf_ministral3(**OTHER)
    path = str(tmp_path / "hf")
    torch_model.save_pretrained(path)
    model, _ = hf.from_pretrained(path)
    cfg = model.config
    assert (cfg.rope_scaling_type, cfg.rope_original_max_position_embeddings) == ("linear", 6)
    assert cfg.sliding_window == 8 and cfg.tie_word_embeddings
    # Prompts of one length: HF's window counts a left-padded row's padding (test_hf_llama).
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, prompt_lengths=(11, 11), **LIGHT)


def test_a_config_json_reads_with_transformers_defaults():
    """What a config.json leaves out is transformers' Ministral3Config default: head_dim 128
    (not hidden / heads), the YaRN rope with its query scale."""
    theirs = transformers.Ministral3Config(hidden_size=256, num_attention_heads=16)
    _, ours = hf.config_from_hf_dict(
        {"model_type": "ministral3", "hidden_size": 256, "num_attention_heads": 16}
    )
    assert ours.dim_per_head == theirs.head_dim == 128
    params = theirs.rope_parameters
    assert ours.rope_scaling_type == params["type"] == "yarn"
    assert ours.rope_scaling_factor == params["factor"]
    assert ours.rope_original_max_position_embeddings == params["original_max_position_embeddings"]
    assert ours.llama_4_scaling_beta == params["llama_4_scaling_beta"]
    assert ours.rope_theta == params["rope_theta"]
    assert (ours.num_layers, ours.kv_heads) == (
        theirs.num_hidden_layers,
        theirs.num_key_value_heads,
    )
    # A 'default' rope that names its original context reads (no YaRN left from the defaults).
    rope = {"rope_type": "default", "rope_theta": 1e4, "original_max_position_embeddings": 6}
    _, ours = hf.config_from_hf_dict(
        {"model_type": "ministral3", "rope_parameters": {**rope, "llama_4_scaling_beta": 0.2}}
    )
    assert ours.rope_scaling_type is None and ours.rope_mscale is None
    assert ours.rope_original_max_position_embeddings == 6


@pytest.mark.parametrize(
    "change, field",
    [
        (
            dict(rope_parameters=dict(FULL["rope_parameters"], llama_4_scaling_beta=None)),
            "llama_4_scaling_beta",
        ),
        (
            dict(rope_parameters=dict(rope_type="linear", factor=2.0, llama_4_scaling_beta=0.1)),
            "original_max_position_embeddings",
        ),
        (
            dict(rope_parameters=dict(FULL["rope_parameters"], partial_rotary_factor=0.5)),
            "partial_rotary_factor",
        ),
        (dict(attention_bias=True), "attention_bias"),
    ],
    ids=str,
)
def test_configs_flaxlm_cannot_read_are_refused_naming_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        ministral3.config_from_hf({**COMMON, "model_type": "ministral3", **change})


@pytest.mark.parametrize("name, billions", [("ministral3_3b", 3.43), ("ministral3_8b", 8.49)])
def test_gin_sizes_match_the_model_cards(name, billions):
    """The cards' language models: 3.4B and 8.4B (8.5 with the untied head counted)."""
    cfg = gin_config(REPO, name, ministral3.Ministral3Config)
    assert cfg.num_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_published_config_json_reads_as_the_gin_file():
    from_gin = gin_config(REPO, "ministral3_3b", ministral3.Ministral3Config)
    _, read = hf.config_from_hf_dict(PUBLISHED_3B)
    compute = {"dtype", "param_dtype", "remat_policy", "scan_layers", "real_vocab_size"}
    for field in dataclasses.fields(ministral3.Ministral3Config):
        if field.name not in compute:
            assert getattr(read, field.name) == getattr(from_gin, field.name), field.name


def test_tiny_gin_model_counts_its_params_and_configs_round_trip():
    cfg = gin_config(REPO, "ministral3_tiny", ministral3.Ministral3Config)
    model = DecoderOnlyModel(cfg)
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    assert sum(x.size for x in jax.tree.leaves(shapes)) == cfg.num_params()
    # What a run directory records and reads back (config.json, the run's compute options
    # beside it) is the same config.
    for config in (cfg, ministral3.config_from_hf({**OTHER, "model_type": "ministral3"})):
        compute = {f.name: getattr(config, f.name) for f in dataclasses.fields(ComputeOptions)}
        assert ministral3.config_from_hf(ministral3.config_to_hf(config), **compute) == config
