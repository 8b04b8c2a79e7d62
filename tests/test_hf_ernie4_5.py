"""ERNIE 4.5 (dense and MoE) from and to HuggingFace: logits, greedy generation (generate and
the serving engine), export, the interleaved rotary, the MoE's layers and router bias,
transformers' defaults and refusals.

Tiny random models of transformers' `Ernie4_5ForCausalLM` (head_dim 12 != 32 / 4, tied, as
the 0.3B) and `Ernie4_5_MoeForCausalLM` (a dense first layer, then MoE layers of 4 experts,
2 a token, with a shared expert; the router's bias perturbed so that it moves the choice).
"""

import json
import os

import numpy as np
import pytest
import transformers

from flaxlm.checkpoints import hf
from flaxlm.models import ernie4_5
from tests.hf_helpers import (
    TINY_DENSE,
    check_family,
    engine_generates_as_hf,
    random_hf_model,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 120
DENSE = dict(TINY_DENSE, head_dim=12, rope_parameters=dict(rope_type="default", rope_theta=1e4))
MOE = dict(
    TINY_DENSE,
    num_hidden_layers=3,
    moe_num_experts=4,
    moe_k=2,
    moe_intermediate_size=16,
    moe_num_shared_experts=1,
    moe_layer_start_index=1,
    tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=1e4),
)


def tiny(kind: str, **kwargs):
    """A random tiny ERNIE 4.5 model, its norms (and the MoE's router bias) perturbed."""
    if kind == "dense":
        classes = (transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM)
        return random_hf_model(*classes, **{**DENSE, **kwargs})
    classes = (transformers.Ernie4_5_MoeConfig, transformers.Ernie4_5_MoeForCausalLM)
    perturb = ("norm.weight", "e_score_correction_bias")
    return random_hf_model(*classes, perturb, **{**MOE, **kwargs})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_checkpoint_keeps_every_promise(kind, tmp_path):
    torch_model = tiny(kind)
    path = str(tmp_path / "hf")
    torch_model.save_pretrained(path)
    model, params = hf.from_pretrained(path)
    cfg = model.config
    if kind == "dense":
        assert isinstance(cfg, ernie4_5.Ernie45Config) and cfg.tie_word_embeddings
        assert cfg.dim_per_head == 12
    else:
        assert isinstance(cfg, ernie4_5.Ernie45MoeConfig) and cfg.score_correction_bias
        assert cfg.sparse_layers(3) == (False, True, True) and cfg.n_shared_experts == 1
        bias = np.asarray(params["layers_1"]["mlp"]["e_score_correction_bias"])
        assert np.abs(bias).max() > 0  # the file's bias, read
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, scan=kind == "dense")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["model_type"] == torch_model.config.model_type
    assert engine_generates_as_hf(model, params, torch_model, VOCAB)


def test_a_config_json_reads_with_transformers_defaults_and_refusals():
    _, dense = hf.config_from_hf_dict({"model_type": "ernie4_5"})
    theirs = transformers.Ernie4_5Config()
    assert (dense.dim_per_head, dense.rope_theta) == (theirs.head_dim, 500000.0)
    assert dense.tie_word_embeddings and dense.num_layers == theirs.num_hidden_layers
    _, moe = hf.config_from_hf_dict({"model_type": "ernie4_5_moe"})
    theirs = transformers.Ernie4_5_MoeConfig()
    assert (moe.num_experts, moe.num_experts_per_tok) == (theirs.moe_num_experts, theirs.moe_k)
    assert moe.sparse_layers(moe.num_layers) == ernie4_5.moe_layers(1, -1, 1, 28)
    assert ernie4_5.layer_pattern(moe) == dict(
        moe_layer_start_index=1, moe_layer_end_index=27, moe_layer_interval=1
    )
    every_other = ernie4_5.config_from_hf({"model_type": "ernie4_5_moe", "moe_layer_interval": 2})
    assert every_other.sparse_layers(4) == (False, True, False, True)
    with pytest.raises(ValueError, match="use_bias"):
        hf.config_from_hf_dict({"model_type": "ernie4_5", "use_bias": True})


def test_gin_sizes_and_the_tiny_gin_param_count():
    """The cards' sizes: ERNIE-4.5-21B-A3B (21.8B, 3.4B active; the card rounds to 21B and
    3B) and ERNIE-4.5-0.3B (0.36B); the tiny MoE counts its params as it holds them."""
    import jax

    from flaxlm.models.base import DecoderOnlyModel
    from tests.hf_helpers import gin_config

    moe = gin_config(REPO, "ernie4_5_21b_a3b", ernie4_5.Ernie45MoeConfig)
    assert moe.num_params() / 1e9 == pytest.approx(21.83, rel=0.001)
    assert moe.active_params() / 1e9 == pytest.approx(3.35, rel=0.001)
    dense = gin_config(REPO, "ernie4_5_0_3b", ernie4_5.Ernie45Config)
    assert dense.num_params() / 1e9 == pytest.approx(0.36, rel=0.01)
    tiny_cfg = gin_config(REPO, "ernie4_5_moe_tiny", ernie4_5.Ernie45MoeConfig)
    model = DecoderOnlyModel(tiny_cfg)
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    assert sum(x.size for x in jax.tree.leaves(shapes)) == tiny_cfg.num_params()
