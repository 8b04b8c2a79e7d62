"""GLM-4 and GLM (dense) from and to HuggingFace: logits, greedy generation (generate and the
serving engine), export, the interleaved partial rotary, GLM-4's output norms, the fused
gate/up projection and transformers' defaults.

Tiny random models of transformers' `Glm4ForCausalLM` (its published settings: q/k/v biases,
half of each 12-wide head rotated, the output norms, untied) and `GlmForCausalLM` (no biases,
three quarters of each 16-wide head rotated, a llama3 rope, tied).
"""

import json
import os

import pytest
import transformers

from flaxlm.checkpoints import hf
from flaxlm.models import glm4
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
GLM4 = dict(
    TINY_DENSE,
    head_dim=12,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
)
GLM = dict(
    TINY_DENSE,
    head_dim=16,
    attention_bias=False,
    tie_word_embeddings=True,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
        partial_rotary_factor=0.75,
    ),
)
CLASSES = {
    "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM, GLM4),
    "glm": (transformers.GlmConfig, transformers.GlmForCausalLM, GLM),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_checkpoint_keeps_every_promise(kind, tmp_path):
    config_cls, model_cls, settings = CLASSES[kind]
    torch_model = random_hf_model(config_cls, model_cls, ("norm.weight", ".bias"), **settings)
    path = str(tmp_path / "hf")
    torch_model.save_pretrained(path)
    model, params = hf.from_pretrained(path)
    cfg = model.config
    assert isinstance(cfg, glm4.Glm4Config) and cfg.post_norms == (kind == "glm4")
    assert cfg.rotary_dim == (6 if kind == "glm4" else 12)
    assert ("post_mlp_layernorm" in params["layers_0"]) == (kind == "glm4")
    assert ("bias" in params["layers_0"]["q_proj"]) == (kind == "glm4")
    full = {} if kind == "glm4" else LIGHT
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, **full)
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["rope_parameters"]["partial_rotary_factor"] == cfg.partial_rotary_factor
    if kind == "glm4":
        assert engine_generates_as_hf(model, params, torch_model, VOCAB)


def test_defaults_and_the_published_size():
    """What a config.json leaves out is transformers' default (half of each 128-wide head
    rotated, q/k/v biases); GLM-4-9B-0414's gin file holds 9.4B params."""
    _, read = hf.config_from_hf_dict({"model_type": "glm4"})
    theirs = transformers.Glm4Config()
    assert (read.dim_per_head, read.rotary_dim, read.attention_bias) == (128, 64, True)
    assert (read.num_layers, read.kv_heads) == (theirs.num_hidden_layers, 2)
    assert read.rms_norm_eps == theirs.rms_norm_eps
    cfg = gin_config(REPO, "glm4_9b", glm4.Glm4Config)
    assert cfg.num_params() / 1e9 == pytest.approx(9.40, rel=0.01)
