"""MiMo-V2-Flash from and to HuggingFace: every promise of `check_family` against
transformers' `MiMoV2FlashForCausalLM` (sliding layers with twice the key/value heads and
attention sinks, values of their own width and scale, a partial rotary per layer type,
DeepSeek-V3's router without shared experts, dense layers anywhere), the serving engine's
paged cache, the Hub's spellings (`sliding_window_size`, a null `routed_scaling_factor`,
`attention_sink_bias`, per-expert weights, MTP layers), refused settings and the gin files.

Two tiny random models, their norms, biases, sinks and correction biases perturbed (HF starts
them at constants): `hybrid` full, sliding, sliding, full layers with one key/value head on
the full ones, values half the keys' width scaled by 0.5, q/k/v biases, each layer type its
own rotary base and fraction, dense layers 0 and 2, groups of experts, scaled weights;
`hub` transformers' default layer and MLP kinds and rope (a third of 16 features: 5, an odd
count) with values wider than the keys, no value scale, unnormalised weights, GELU and a tied
head, saved as the Hub's files are.
"""

import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from flaxlm.checkpoints import hf
from flaxlm.models import masks, mimo_v2_flash, paged_attention
from tests.hf_helpers import (
    LIGHT,
    check_family,
    engine_greedy,
    gin_config,
    hf_greedy_batch,
    random_hf_model,
    save_torch_model,
)

VOCAB = 120
S, F = mimo_v2_flash.SLIDING, mimo_v2_flash.FULL
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=4,
    head_dim=16,
    num_experts_per_tok=2,
    max_position_embeddings=96,
    initializer_range=0.1,  # sharp enough attention that positions visibly matter
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF's min_new_tokens would otherwise forbid one
    pad_token_id=None,
)
# Prompts of up to 17 tokens + 30 generated outrun the windows (5 and 7 positions).
CONFIGS = {
    "hybrid": dict(
        num_hidden_layers=4,
        layer_types=[F, S, S, F],
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        num_key_value_heads=1,
        v_head_dim=8,
        attention_value_scale=0.5,
        attention_bias=True,
        sliding_window=5,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.0,
        rope_parameters={
            F: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            S: {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.75},
        },
    ),
    "hub": dict(
        num_hidden_layers=3,
        num_key_value_heads=2,
        v_head_dim=24,
        attention_value_scale=None,
        sliding_window=7,
        n_routed_experts=4,
        norm_topk_prob=False,
        hidden_act="gelu",
        tie_word_embeddings=True,
    ),
}
PERTURB = ("norm.weight", ".bias", "sinks")


def hub_files(torch_model, path: str) -> None:
    """`torch_model` saved as the Hub's files are: config.json without the keys transformers
    derives (layer and MLP kinds, rope) and with SGLang's `sliding_window_size`, a null
    `routed_scaling_factor` and keys transformers does not read; the sinks as
    `attention_sink_bias`, the experts one by one, an MTP layer beside."""
    config = torch_model.config.to_dict()
    window = config.pop("sliding_window")
    for key in ("layer_types", "mlp_layer_types", "rope_parameters"):
        config.pop(key)
    config.update(sliding_window_size=window - 1, routed_scaling_factor=None, rope_theta=5e6)
    config.update(hybrid_layer_pattern=[0, 1, 1], moe_layer_freq=[0, 1, 1], swa_rope_theta=1e4)
    tensors = {}
    for name, value in torch_model.state_dict().items():
        value = value.contiguous()
        if name.endswith("self_attn.sinks"):
            tensors[name.replace("sinks", "attention_sink_bias")] = value
        elif name.endswith("experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                tensors[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e].clone()
                tensors[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(value.shape[0]):
                tensors[name.replace("down_proj", f"{e}.down_proj.weight")] = value[e].clone()
        elif name != "lm_head.weight":  # tied
            tensors[name] = value
    tensors["model.mtp.layers.0.input_layernorm.weight"] = torch.ones(32)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (torch model, its files): built once a module, on first use."""
    root, made = tmp_path_factory.mktemp("mimo_v2_flash"), {}

    def get(name: str):
        if name not in made:
            model = random_hf_model(
                transformers.MiMoV2FlashConfig,
                transformers.MiMoV2FlashForCausalLM,
                PERTURB,
                **BASE,
                **CONFIGS[name],
            )
            with torch.no_grad():
                for layer in model.model.layers:
                    if hasattr(layer.mlp, "gate"):
                        bias = layer.mlp.gate.e_score_correction_bias
                        bias.copy_(0.3 * torch.randn_like(bias))
            path = str(root / name)
            if name == "hub":
                hub_files(model, path)
            else:
                save_torch_model(model, path)
            made[name] = model, path
        return made[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_keeps_every_promise(checkpoints, name, tmp_path):
    torch_model, path = checkpoints(name)
    # The kernels and meshes once, on `hybrid` (each config: its reading and math); cuDNN's
    # 'jax' cannot add the sliding layers' sinks.
    light = dict(implementations=("chunked",), refused=("jax",)) if name == "hybrid" else LIGHT
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, **light)
    model, params = hf.from_pretrained(path)
    config = model.config
    assert config.num_params() == sum(p.size for p in jax.tree.leaves(params))
    if name == "hub":
        assert (config.sliding_window, config.routed_scaling_factor) == (7, 1.0)
        assert config.per_layer_types == (F, S, S) and config.mlp_only_layers == (0,)
        assert config.rotary_dim(F) == config.rotary_dim(S) == 5
    else:
        assert [config.layer_kv_heads(i) for i in range(4)] == [1, 2, 2, 1]
        assert "sinks" in params["layers_1"] and "sinks" not in params["layers_0"]
        assert params["layers_0"]["v_proj"]["kernel"].shape == (32, 1, 8)
        exported = json.loads((tmp_path / "export" / "config.json").read_text())
        for key in ("layer_types", "mlp_layer_types", "rope_parameters"):
            assert exported[key] == getattr(torch_model.config, key), key


@pytest.mark.slow
def test_engine_greedy_over_the_paged_cache_is_hf_generate(checkpoints):
    """The serving engine's pages: the sliding layers' windows, sinks and doubled key/value
    heads, values narrower than the keys; HF's greedy tokens past the window."""
    torch_model, path = checkpoints("hybrid")
    model, params = hf.from_pretrained(path)
    assert model.paged_refusal() is None
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (9, 3, 14)]
    expected = hf_greedy_batch(torch_model, prompts, 12)
    assert engine_greedy(model, params, prompts, 12) == expected


def test_the_pallas_kernel_declines_values_narrower_than_keys(capsys):
    one = np.zeros((1, 1), np.int32)
    where = masks.Decoding(0, one[0], 8, one, one, 2, 8, "pallas")
    query = np.zeros((1, 1, 4, 16), np.float32)
    assert paged_attention.use_kernel(where, query)
    assert not paged_attention.use_kernel(where, query, value_dim=8)
    assert "values 8 wide" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_layers=2, layer_types=(F,)), "layer_types"),
        (dict(num_layers=2, layer_types=(F, "chunked_attention")), "layer_types"),
        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
        (dict(num_heads=6, num_kv_heads=2), "num_kv_heads"),  # the sliding layers' 4
        (dict(head_dim=15), "head_dim"),
        (dict(v_head_dim=0), "v_head_dim"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
        (dict(sliding_partial_rotary_factor=-0.1), "sliding_partial_rotary_factor"),
        (dict(sliding_rope_theta=0.0), "sliding_rope_theta"),
        (dict(num_experts=8, num_experts_per_tok=2, n_group=8, topk_group=4), "n_group 8"),
        (dict(n_shared_experts=1), "n_shared_experts"),
        (dict(router="softmax_topk"), "router"),
        (dict(num_layers=2, mlp_only_layers=(2,)), "mlp_only_layers"),
        (dict(attention="jax"), "jax"),
    ],
    ids=str,
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        mimo_v2_flash.MiMoV2FlashConfig(**kwargs)


ROPE = {"rope_type": "default", "rope_theta": 1e4}


@pytest.mark.parametrize(
    "hf_fields, field",
    [
        (dict(mlp_layer_types=["dense", "moe"]), "mlp_layer_types"),
        (dict(mlp_layer_types=["dense"]), "mlp_layer_types"),
        (dict(layer_types=[F, "chunked_attention"]), "layer_types"),
        (dict(rope_parameters=ROPE), "rope_parameters"),  # flat: HF reads one per type
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_parameters"),
        (dict(rope_parameters={F: ROPE}), "rope_parameters"),  # no sliding layers' rope
        (dict(rope_parameters={F: {"rope_type": "default"}, S: ROPE}), "rope_parameters"),
        (dict(rope_parameters={F: {**ROPE, "rope_type": "yarn"}, S: ROPE}), "rope_type"),
        (dict(rope_parameters={F: {**ROPE, "partial_rotary_factor": None}, S: ROPE}), "partial"),
    ],
    ids=str,
)
def test_config_json_flaxlm_cannot_run_is_refused_naming_the_setting(hf_fields, field):
    hf_config = {"model_type": "mimo_v2_flash", "num_hidden_layers": 2, **hf_fields}
    with pytest.raises(ValueError, match=field):
        mimo_v2_flash.config_from_hf(hf_config)


def test_config_json_reads_as_transformers_resolves_it():
    """The Hub's spellings as transformers reads them: `sliding_window_size` + 1, a null
    `routed_scaling_factor` 1, `num_local_experts` for `n_routed_experts`, the default layer
    and MLP kinds and per-type rope whatever the keys it does not read say."""
    published = dict(
        num_hidden_layers=12,
        sliding_window=128,
        sliding_window_size=128,
        routed_scaling_factor=None,
        num_local_experts=64,
        rope_theta=1.0,  # not read
        hybrid_layer_pattern=[0] * 12,  # not read
    )
    read = mimo_v2_flash.config_from_hf({"model_type": "mimo_v2_flash", **published})
    theirs = transformers.MiMoV2FlashConfig(**published)
    assert list(read.per_layer_types) == theirs.layer_types
    assert list(read.mlp_layer_types) == theirs.mlp_layer_types
    assert read.sliding_window == theirs.sliding_window == 129
    assert read.routed_scaling_factor == theirs.routed_scaling_factor == 1.0
    assert read.num_experts == theirs.n_routed_experts == 64
    exported = mimo_v2_flash.config_to_hf(read)
    assert exported["rope_parameters"] == theirs.rope_parameters


# The published shapes' parameters: transformers' MiMoV2FlashForCausalLM of the gin file's
# exported config.json, counted once on the meta device (its parameters, plus the 47 MoE
# layers' 256 correction biases, buffers there and params here); active per token 15.4B.
PUBLISHED_PARAMS = 308_778_768_832 + 47 * 256


def test_gin_model_files_build_their_configs(repo_dir):
    config = gin_config(repo_dir, "mimo_v2_flash", mimo_v2_flash.MiMoV2FlashConfig)
    assert config == mimo_v2_flash.MiMoV2FlashConfig(
        dtype="bfloat16", remat_policy="dots_with_no_batch_dims_saveable", scan_layers=True
    )
    assert config.num_params() == PUBLISHED_PARAMS
    assert round(config.active_params() / 1e9, 1) == 15.4
    assert (config.first_scanned_layer, config.scan_period, config.scan_tail) == (1, 6, 5)
    tiny = gin_config(repo_dir, "mimo_v2_flash_tiny", mimo_v2_flash.MiMoV2FlashConfig)
    assert tiny.per_layer_types == (F, S, S, S, S, F) and tiny.vocab_size % 128 == 0
    module = tiny.make_module()
    params = jax.eval_shape(
        lambda: module.init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
    )
    assert tiny.num_params() == sum(p.size for p in jax.tree.leaves(params))
