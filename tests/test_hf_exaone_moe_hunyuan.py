"""K-EXAONE (`exaone_moe`) and Hunyuan V1 (`hunyuan_v1_dense`, `hunyuan_v1_moe`) from and to
HuggingFace: every promise of `check_family` on two configs of each family, greedy decoding
through the serving engine's paged cache, refused settings, the Hub's spellings and the gin
sizes.

Tiny random models of transformers' `ExaoneMoeForCausalLM`, `HunYuanDenseV1ForCausalLM` and
`HunYuanMoEV1ForCausalLM`, norms, biases and correction biases perturbed (HF starts them at
1 and 0; the perturbed q/k norm scales make their order against rotary count).
K-EXAONE: `EXAONE` sliding, sliding, global (NoPE), sliding layers (window 5, from the
pattern), a dense layer between MoE ones (`mlp_layer_types`), heads of 16 (not the width's
8), GQA, group-limited routing, two shared experts, YaRN; `EXAONE_PLAIN` the Hub's 'LLLG'
beside spelled-out `layer_types`, every layer sparse, one key/value head, a tied head,
unnormalised routing weights, transformers 4's llama3 `rope_scaling`.
Hunyuan: `DENSE` biases on q, k, v and o, the Hub's NTK-alpha 'dynamic' dict (with the
unread YaRN keys it carries), GQA, an untied head; `MOE` one key/value head, a tied head,
linear rope, `moe_topk` per layer and the keys transformers ignores at the Hub's values.
"""

import dataclasses
import os

import jax
import numpy as np
import pytest
import torch
import transformers

from flaxlm.checkpoints import hf, peft_experts
from flaxlm.models import exaone_moe, hunyuan
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.parallel.partitioning import Partitioner
from tests.hf_helpers import (
    LIGHT,
    check_family,
    engine_greedy,
    gin_config,
    hf_greedy_batch,
    random_hf_model,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 120
GREEDY_TOKENS = 8
FULL, SLIDING = "full_attention", "sliding_attention"
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=96,
    initializer_range=0.1,  # sharp enough attention that positions visibly matter
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF's min_new_tokens would otherwise forbid one
    pad_token_id=None,
)
EXAONE = dict(
    COMMON,
    num_hidden_layers=4,
    num_key_value_heads=2,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    sliding_window=5,
    sliding_window_pattern=3,
    mlp_layer_types=["sparse", "dense", "sparse", "sparse"],
    n_group=4,
    topk_group=2,
    num_shared_experts=2,
    rope_parameters=dict(
        rope_type="yarn", rope_theta=1e4, factor=2.0, original_max_position_embeddings=32
    ),
)
EXAONE_PLAIN = dict(
    COMMON,
    num_hidden_layers=3,
    num_key_value_heads=1,
    intermediate_size=40,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=3,
    sliding_window=6,
    sliding_window_pattern="LLLG",  # read only through the spelled-out layer_types
    layer_types=[SLIDING, FULL, SLIDING],
    first_k_dense_replace=0,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    tie_word_embeddings=True,
    rope_theta=5e5,
    rope_scaling=dict(
        rope_type="llama3",
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    ),
)
# The Hub's Hunyuan rope dict: 'dynamic' with an alpha (transformers' ntk_alpha), and the
# YaRN keys it does not read.
NTK_ALPHA = dict(
    type="dynamic",
    alpha=50.0,
    factor=1.0,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)
DENSE = dict(
    COMMON,
    num_hidden_layers=2,
    num_key_value_heads=2,
    intermediate_size=48,
    attention_bias=True,
    rope_theta=1e4,
    rope_scaling=NTK_ALPHA,
)
MOE = dict(
    COMMON,
    num_hidden_layers=2,
    num_key_value_heads=1,
    intermediate_size=16,
    num_experts=8,
    moe_topk=[3, 3],
    tie_word_embeddings=True,
    rope_scaling=dict(type="linear", factor=2.0),
    # Keys HF's model ignores, at the values of the model it builds (as the Hub's files).
    use_qk_norm=True,
    use_cla=False,
    use_mixed_mlp_moe=True,
    num_shared_expert=[1, 1],
    moe_intermediate_size=[16, 16],
    attention_head_dim=16,
)
CONFIGS = {"exaone": EXAONE, "exaone_plain": EXAONE_PLAIN, "dense": DENSE, "moe": MOE}
CLASSES = {
    "exaone": (transformers.ExaoneMoeConfig, transformers.ExaoneMoeForCausalLM),
    "dense": (transformers.HunYuanDenseV1Config, transformers.HunYuanDenseV1ForCausalLM),
    "moe": (transformers.HunYuanMoEV1Config, transformers.HunYuanMoEV1ForCausalLM),
}
# The first config of each family runs every kernel and mesh, the other the second mesh.
LIGHTER = {"exaone_plain": LIGHT, "moe": LIGHT}
ONE = Partitioner(devices=jax.devices()[:1])


def tiny_hf(name: str):
    """A random tiny HF model of config `name`, its norms, biases and correction biases
    perturbed; the correction bias at the scale of the sigmoid scores, so it moves choices."""
    config_cls, model_cls = CLASSES[name.split("_")[0]]
    perturb = ("norm.weight", "layernorm.weight", ".bias")
    model = random_hf_model(config_cls, model_cls, perturb, **CONFIGS[name])
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`name -> (torch model, its save_pretrained directory)`, each built once."""
    built = {}

    def get(name):
        if name not in built:
            torch_model = tiny_hf(name)
            path = tmp_path_factory.mktemp(name)
            torch_model.save_pretrained(str(path))
            built[name] = (torch_model, path)
        return built[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_keeps_every_promise(saved, name, tmp_path):
    """HF's logits (each attention implementation and mesh on the first config of each
    family, the second mesh alone on the other), greedy tokens and reloaded export; the
    settings read as HF reads them; the params counted."""
    torch_model, path = saved(name)
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, **LIGHTER.get(name, {}))
    config = hf.config_from_hf_dict(torch_model.config.to_dict())[1]
    theirs = torch_model.config
    if name.startswith("exaone"):
        assert list(config.per_layer_types) == theirs.layer_types
        assert list(config.mlp_layer_types) == theirs.mlp_layer_types
        attn = [layer.self_attn for layer in torch_model.model.layers]
        assert config.rope_layers == tuple(a.is_sliding for a in attn)
    else:
        rotary = torch_model.model.rotary_emb
        ours = hunyuan.ntk_alpha_inv_freq(config) if config.rope_alpha else None
        assert (rotary.rope_type == "ntk_alpha") == (ours is not None)
        if ours is not None:
            np.testing.assert_allclose(ours, rotary.inv_freq.numpy(), rtol=1e-6)
    model = DecoderOnlyModel(config)
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    assert sum(x.size for x in jax.tree.leaves(shapes)) == config.num_params()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["exaone", "moe"])
def test_greedy_through_the_engines_paged_cache_is_hf_generate(saved, name):
    """The serving engine's pages (K-EXAONE's windows and NoPE layers, Hunyuan's keys cached
    after their norm): HF `generate`'s tokens, prompts past the windows."""
    torch_model, path = saved(name)
    model, params = hf.from_pretrained(str(path), ONE)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (11, 4, 17)]
    assert model.paged_refusal() is None
    expected = hf_greedy_batch(torch_model, prompts, GREEDY_TOKENS)
    assert engine_greedy(model, params, prompts, GREEDY_TOKENS) == expected


def test_the_hubs_correction_bias_and_mtp_spellings_read():
    """K-EXAONE's files: the correction bias under the MLP (transformers renames it into the
    router), the multi-token-prediction layers (`mtp.*`) skipped as transformers skips them."""
    spec = exaone_moe.HF_SPEC
    stored = [
        "model.layers.3.mlp.e_score_correction_bias",
        "mtp.layers.0.mlp.gate.weight",
        "model.mtp.norm.weight",
        "model.layers.3.mlp.gate.weight",
    ]
    names, skipped = spec.own_names(stored)
    assert names == {
        "model.layers.3.mlp.gate.e_score_correction_bias": stored[0],
        "model.layers.3.mlp.gate.weight": stored[3],
    }
    assert skipped == stored[1:3]


BASE = dict(num_layers=4, num_experts=8, num_experts_per_tok=2)


@pytest.mark.parametrize(
    "config_cls, kwargs, field",
    [
        (exaone_moe.ExaoneMoeConfig, dict(BASE, sliding_window=None), "sliding_window"),
        (exaone_moe.ExaoneMoeConfig, dict(BASE, sliding_window=0), "sliding_window"),
        (exaone_moe.ExaoneMoeConfig, dict(BASE, sliding_window_pattern="LLLG"), "pattern"),
        (exaone_moe.ExaoneMoeConfig, dict(BASE, sliding_window_pattern=0), "pattern"),
        (exaone_moe.ExaoneMoeConfig, dict(BASE, layer_types=(FULL,)), "layer_types"),
        (exaone_moe.ExaoneMoeConfig, dict(BASE, mlp_only_layers=(4,)), "mlp_only_layers"),
        (exaone_moe.ExaoneMoeConfig, dict(BASE, n_shared_experts=0), "n_shared_experts"),
        (exaone_moe.ExaoneMoeConfig, dict(BASE, n_group=8), "n_group"),
        (exaone_moe.ExaoneMoeConfig, dict(BASE, router="softmax_topk"), "router"),
        (exaone_moe.ExaoneMoeConfig, dict(BASE, decoder_sparse_step=2), "decoder_sparse_step"),
        (exaone_moe.ExaoneMoeConfig, dict(BASE, num_kv_heads=3), "num_kv_heads"),
        (hunyuan.HunyuanDenseConfig, dict(rope_alpha=0.0), "rope_alpha"),
        (hunyuan.HunyuanDenseConfig, dict(rope_scaling_type="linear"), "rope_alpha"),
        (hunyuan.HunyuanDenseConfig, dict(rope_scaling_type="dynamic"), "rope_scaling_type"),
        (hunyuan.HunyuanMoeConfig, dict(moe_intermediate_size=64), "moe_intermediate_size"),
        (hunyuan.HunyuanMoeConfig, dict(n_shared_experts=2), "n_shared_experts"),
        (hunyuan.HunyuanMoeConfig, dict(router="sigmoid_topk"), "router"),
        (hunyuan.HunyuanMoeConfig, dict(norm_topk_prob=False), "norm_topk_prob"),
        (hunyuan.HunyuanMoeConfig, dict(num_experts_per_tok=65), "num_experts_per_tok"),
    ],
    ids=str,
)
def test_settings_that_cannot_be_are_errors_naming_them(config_cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        config_cls(**kwargs)


@pytest.mark.parametrize(
    "name, change, field",
    [
        # transformers' config or model fails on each.
        ("exaone", dict(sliding_window=None), "sliding_window"),
        ("exaone", dict(head_dim=None), "head_dim"),
        ("exaone", dict(layer_types=None, sliding_window_pattern="LLLG"), "pattern"),
        ("exaone", dict(layer_types=[SLIDING, "chunked_attention", FULL, FULL]), "layer_types"),
        ("exaone", dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types"),
        ("exaone", dict(is_moe_layer=[True] * 4), "is_moe_layer"),
        ("exaone", dict(num_shared_experts=0), "n_shared_experts"),
        ("exaone", dict(n_group=3), "n_group"),
        ("exaone", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)), "dynamic"),
        ("exaone", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        ("dense", dict(head_dim=None), "head_dim"),
        ("dense", dict(rope_scaling=dict(type="dynamic", alpha=50.0)), "factor"),
        ("dense", dict(rope_scaling=dict(type="dynamic", factor=2.0)), "dynamic"),
        (
            "dense",
            dict(rope_scaling=dict(type="linear", factor=2.0), partial_rotary_factor=0.5),
            "partial",
        ),
        ("dense", dict(use_qk_norm=False), "use_qk_norm"),
        ("dense", dict(use_cla=True), "use_cla"),
        ("moe", dict(num_experts=[8, 8]), "num_experts"),
        ("moe", dict(moe_topk=[3, 2]), "moe_topk"),
        ("moe", dict(moe_topk=[3]), "moe_topk"),
        ("moe", dict(num_shared_expert=[2, 2]), "num_shared_expert"),
        ("moe", dict(moe_intermediate_size=[8, 8]), "moe_intermediate_size"),
        ("moe", dict(moe_layer_num_skipped=1), "moe_layer_num_skipped"),
    ],
    ids=str,
)
def test_configs_flaxlm_cannot_read_are_refused_naming_the_field(name, change, field):
    model_type = CLASSES[name][0].model_type
    config = {**CONFIGS[name], **change, "model_type": model_type}
    with pytest.raises(ValueError, match=field):
        hf.config_from_hf_dict(config)


def test_config_json_defaults_and_aliases_read_as_transformers_reads_them():
    """Keys a config.json omits take transformers' defaults (K-EXAONE's dense first layer,
    pattern 4 and window 4096; Hunyuan's kv heads; a partial rotary factor the default rope
    ignores); the names its attribute_map reads
    (`num_experts_per_tok`, `num_local_experts`) count; the legacy 'attention' type is full."""
    read = exaone_moe.config_from_hf({"model_type": "exaone_moe", "num_hidden_layers": 6})
    theirs = transformers.ExaoneMoeConfig(num_hidden_layers=6)
    assert list(read.per_layer_types) == theirs.layer_types
    assert list(read.mlp_layer_types) == theirs.mlp_layer_types
    assert read.sliding_window == theirs.sliding_window
    assert read.dim_per_head == theirs.hidden_size // theirs.num_attention_heads
    legacy = ["attention", SLIDING] * 3
    fields = {"num_hidden_layers": 6, "layer_types": legacy}
    read = exaone_moe.config_from_hf({"model_type": "exaone_moe", **fields})
    assert list(read.per_layer_types) == transformers.ExaoneMoeConfig(**fields).layer_types
    # HF's default rope ignores a partial_rotary_factor (its tables span whole heads).
    partial = exaone_moe.config_from_hf({"model_type": "exaone_moe", "partial_rotary_factor": 0.5})
    assert partial.rope_scaling_type is None
    fields = {"model_type": "hunyuan_v1_moe", "head_dim": 128, "num_experts_per_tok": 3}
    read = hunyuan.config_from_hf({**fields, "num_local_experts": 4})
    theirs = transformers.HunYuanMoEV1Config(num_experts_per_tok=3, num_local_experts=4)
    assert (read.num_experts, read.num_experts_per_tok) == (theirs.num_experts, theirs.moe_topk)
    assert read.kv_heads == theirs.num_key_value_heads


def test_lora_on_dense_or_shared_mlps_is_refused_as_a_peft_adapter():
    """PEFT reads `gate_proj` / `up_proj` / `down_proj` targets of these model types
    (transformers converts them as Qwen2-MoE's) as the fused experts' parameters."""
    for model_type, module in (
        ("exaone_moe", "model.layers.0.mlp.up_proj"),
        ("hunyuan_v1_moe", "model.layers.0.mlp.shared_mlp.gate_proj"),
    ):
        with pytest.raises(ValueError, match="experts"):
            peft_experts.check_modules(model_type, [module])


# Published sizes (model cards), in billions: (config class, all params, active params, how
# many vocabulary tables the active count leaves out). K-EXAONE-236B-A23B's card: 236B, 23B
# active (23.7B counted with both tables); Hunyuan-A13B's: 80B, 13B active (12.7B with its
# tied table); Hunyuan-7B: 7.5B.
PUBLISHED = {
    "k_exaone_236b_a23b": (exaone_moe.ExaoneMoeConfig, 236.0, 23.0, 0),
    "hunyuan_a13b": (hunyuan.HunyuanMoeConfig, 80.0, 13.0, 0),
    "hunyuan_7b": (hunyuan.HunyuanDenseConfig, 7.5, 7.5, 0),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_gin_sizes_are_transformers_and_the_model_cards(name):
    """The published gin file's params, counted: transformers' model of its config
    (`config_to_hf`, built on the meta device; the correction biases are its buffers; the
    real vocabulary, which the gin file pads) and the model card's rounded figures."""
    config_cls, total, active, tables = PUBLISHED[name]
    cfg = gin_config(REPO, name, config_cls)
    spec = hf.spec_for_config(cfg)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**spec.config_to_hf(cfg))
        )
    counted = sum(p.numel() for p in theirs.parameters())
    counted += sum(b.numel() for k, b in theirs.named_buffers() if "e_score_correction" in k)
    real = dataclasses.replace(cfg, vocab_size=cfg.real_vocab_size or cfg.vocab_size)
    assert real.num_params() == counted
    assert abs(cfg.num_params() / 1e9 - total) / total < 0.01, cfg.num_params()
    active_params = getattr(cfg, "active_params", cfg.num_params)()  # dense: all
    matmul = active_params - tables * cfg.vocab_size * cfg.hidden_size
    assert abs(matmul / 1e9 - active) / active < 0.05, matmul
    lookup = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    assert cfg.flops_per_token(4096) > 6 * (active_params - lookup)


@pytest.mark.parametrize(
    "name, config_cls",
    [
        ("exaone_moe_tiny", exaone_moe.ExaoneMoeConfig),
        ("hunyuan_tiny", hunyuan.HunyuanDenseConfig),
        ("hunyuan_moe_tiny", hunyuan.HunyuanMoeConfig),
    ],
)
def test_tiny_gin_models_count_their_params(name, config_cls):
    model = DecoderOnlyModel(gin_config(REPO, name, config_cls))
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    assert sum(x.size for x in jax.tree.leaves(shapes)) == model.config.num_params()
