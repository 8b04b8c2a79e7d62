"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention) from and to HuggingFace: the
indexer's choice and the logits where it matters, dense MLA where it cannot, greedy
generation over the contiguous cache and the serving engine's pages, export, refusals, and
the published sizes.

Two tiny random models whose `index_topk` of 6 is under most of the 24 positions, so each
query's choice matters: transformers' `DeepseekV32ForCausalLM` (a dense first layer, then
MoE ones, which scan as one stack; YaRN with mscale_all_dim != mscale; attention biases;
half-split rotary in the indexer) and `GlmMoeDsaForCausalLM` (interleaved rotary in the
indexer, a dense layer between MoE ones, and its middle layer 'shared': no indexer, the first
layer's choice).
Their indexers have 16 heads: with few, some keys have every head's ReLU at zero and so the
same score 0, a tie that torch's and XLA's top-k break differently (with 4 heads GLM-5's
test rows tie at the boundary); with 16, every real query's `index_topk`-th score is at least
3e-4 above the next, ~1e3 x the float32 rounding of these O(0.3) scores.
"""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from flaxlm.checkpoints import hf, peft_experts
from flaxlm.models import deepseek, deepseek_v32, stacks
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.parallel.partitioning import Partitioner
from tests.hf_helpers import (
    check_mtp_loss,
    decoder_batch,
    engine_greedy,
    flaxlm_greedy_batch,
    gin_config,
    hf_greedy_batch,
    hf_mtp_logits,
    max_abs_diff,
    mtp_depth_logits,
    padded_batch,
    random_hf_model,
    save_with_mtp_layers,
    torch_logits,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 120
TOPK = 6
LENGTHS = (24, 13, 24, 6)
GREEDY_TOKENS = 8
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    max_position_embeddings=96,
    initializer_range=0.1,
    n_shared_experts=1,
    index_topk=TOPK,
    index_n_heads=16,
    index_head_dim=16,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF's min_new_tokens would otherwise forbid one
)
CONFIGS = {
    "deepseek_v32": dict(
        COMMON,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        attention_bias=True,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=3.0,
            original_max_position_embeddings=32,
            mscale=1.0,
            mscale_all_dim=0.8,
        ),
    ),
    "glm_moe_dsa": dict(
        COMMON,
        num_hidden_layers=3,
        mlp_layer_types=["sparse", "dense", "sparse"],
        index_topk_pattern="FSF",
        routed_scaling_factor=1.5,
    ),
}
CLASSES = {
    "deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
    "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM),
}
# float32 logits of 2-3 layers whose values are O(1): rounding in other summation orders is
# ~eps (1.2e-7) x sqrt(width) x depth ~ 1e-6 (1.5e-6 seen); 1e-4 leaves a margin (and is what
# every family meets). The choice of keys is exact: the scores at its boundary are >= 3e-4
# apart (above).
LOGITS_TOL = 1e-4
ONE = Partitioner(devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """`name -> (torch model, its save_pretrained directory, flaxlm model, params)`, each
    built once for the file; the params on one device (`ONE`), as the serving engine takes
    them."""
    built = {}

    def family(name):
        if name not in built:
            config_cls, model_cls = CLASSES[name]
            perturb = ("norm.weight", "layernorm.weight", ".bias")  # HF starts them at 1, 0
            torch_model = random_hf_model(config_cls, model_cls, perturb, **CONFIGS[name])
            with torch.no_grad():  # the correction bias at the sigmoid scores' scale
                for buffer_name, buffer in torch_model.named_buffers():
                    if buffer_name.endswith("e_score_correction_bias"):
                        buffer.copy_(0.3 * torch.randn_like(buffer))
            path = str(tmp_path_factory.mktemp(name))
            torch_model.save_pretrained(path)
            built[name] = (torch_model, path, *hf.from_pretrained(path, ONE))
        return built[name]

    return family


def without_indexers(tree):
    """A params tree without its indexers' params."""
    return {
        k: without_indexers(v) if isinstance(v, dict) else v
        for k, v in tree.items()
        if k != "indexer"
    }


def chosen_keys(torch_model, model, params, ids, mask):
    """Which keys each real query attends to, by each indexer, HF's and ours: two lists of
    bool `[batch, q_len, kv_len]` (flaxlm's from its indexers' outputs, captured)."""
    captured = []
    handles = [
        layer.self_attn.indexer.register_forward_hook(lambda m, i, out: captured.append(out))
        for layer in torch_model.model.layers
        if layer.self_attn.indexer is not None
    ]
    torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    for handle in handles:
        handle.remove()
    batch = decoder_batch(ids, mask)
    _, state = model.module.apply(
        {"params": params},
        batch["decoder_input_tokens"],
        batch["decoder_positions"],
        batch["decoder_segment_ids"],
        capture_intermediates=lambda m, _: type(m).__name__ == "Indexer",
        mutable=["intermediates"],
    )
    layers = state["intermediates"]
    ours = [layers[name]["self_attn"]["indexer"]["__call__"][0] for name in sorted(layers)]
    length, real = ids.shape[1], mask.astype(bool)
    # The keys each real query sees (flaxlm's padding queries see the padding instead).
    visible = np.tril(np.ones((length, length), bool)) & real[:, None, :] & real[:, :, None]

    def as_mask(top):
        out = np.zeros(visible.shape, bool)
        np.put_along_axis(out, np.asarray(top), True, axis=-1)
        return out & visible

    return [as_mask(t.numpy()) for t in captured], [as_mask(t) for t in ours]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_are_hf_logits_with_the_indexers_choice(families, name):
    torch_model, _, model, params = families(name)
    assert type(model.config) is deepseek_v32.CONFIGS[name]
    ids, mask = padded_batch(VOCAB, LENGTHS)
    batch = decoder_batch(ids, mask)
    theirs, ours = chosen_keys(torch_model, model, params, ids, mask)
    # DeepSeek-V3.2's 3 layers each choose; GLM-5's middle layer has no indexer.
    assert len(ours) == len(theirs) == model.config.num_layers - (name == "glm_moe_dsa")
    # Each real query chose min(its keys, index_topk) of the keys it sees, as HF's did.
    chosen = np.minimum(np.arange(1, max(LENGTHS) + 1), TOPK)[None] * mask
    for hf_choice, choice in zip(theirs, ours, strict=True):
        np.testing.assert_array_equal(choice, hf_choice)
        np.testing.assert_array_equal(choice.sum(-1), chosen)

    hf_logits = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(jax.jit(model.compute_logits)(params, batch), hf_logits, mask) < LOGITS_TOL
    # The choice matters: attending to every key (the same params) is far from HF.
    dense = type(model)(dataclasses.replace(model.config, index_topk=max(LENGTHS)))
    assert max_abs_diff(jax.jit(dense.compute_logits)(params, batch), hf_logits, mask) > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sequences_no_longer_than_index_topk_are_dense_mla(families, name):
    """Up to `index_topk` keys every one is chosen: HF's logits, and DeepSeek-V3's latent
    attention on the same params (the indexers' unread; DeepSeek-V3.2's layers, all MoE,
    are DeepSeek-V3's) to float32 round-off of the same computation."""
    torch_model, _, model, params = families(name)
    ids, mask = padded_batch(VOCAB, (TOPK, 4, TOPK, 3))
    batch = decoder_batch(ids, mask)
    ours = np.asarray(jax.jit(model.compute_logits)(params, batch))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, theirs, mask) < LOGITS_TOL
    if name == "deepseek_v32":
        fields = {f.name for f in dataclasses.fields(deepseek.DeepseekV3Config)}
        config = {k: v for k, v in dataclasses.asdict(model.config).items() if k in fields}
        dense = DecoderOnlyModel(deepseek.DeepseekV3Config(**config))
        got = jax.jit(dense.compute_logits)(without_indexers(params), batch)
        np.testing.assert_allclose(ours, got, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_is_hf_generate_over_the_contiguous_cache_and_the_engines_pages(families, name):
    """The prefill and every step choose among the cached indexer keys, past `index_topk`
    (prompts of 4 to 23 tokens, 8 new): HF's greedy tokens, from the contiguous cache and
    from the serving engine's pages (which the indexer's keys take too)."""
    torch_model, _, model, params = families(name)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (11, 4, 23)]
    tokens = flaxlm_greedy_batch(model, params, prompts, GREEDY_TOKENS)
    assert tokens == hf_greedy_batch(torch_model, prompts, GREEDY_TOKENS)
    assert model.paged_refusal() is None
    assert engine_greedy(model, params, prompts, GREEDY_TOKENS) == tokens


@pytest.mark.slow
def test_scanned_layers_on_a_mesh_give_hf_logits(families):
    """FSDP x tensor, DeepSeek-V3.2's MoE layers scanned after its dense first one (as
    DeepSeek-V3's): the indexer's heads split with the attention's."""
    torch_model, path, _, _ = families("deepseek_v32")
    model, params = hf.from_pretrained(
        path, Partitioner((1, 2, 2), devices=jax.devices()[:4]), scan_layers=True
    )
    assert "indexer" in params["layers"]["block"]["self_attn"]
    assert (
        "indexer" in params["layers_0"]["self_attn"] and "experts" not in params["layers_0"]["mlp"]
    )
    ids, mask = padded_batch(VOCAB, LENGTHS)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    got = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    assert max_abs_diff(got, theirs, mask) < LOGITS_TOL


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_export_is_what_transformers_reloads(families, name, tmp_path):
    torch_model, _, model, params = families(name)
    hf.save_pretrained(model, params, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.indexer.k_norm.bias" in names
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(reloaded) is type(torch_model)
    exported = json.loads((tmp_path / "config.json").read_text())
    for key in ("index_topk", "index_n_heads", "index_head_dim", "mlp_layer_types"):
        assert exported[key] == getattr(torch_model.config, key), key
    if name == "glm_moe_dsa":
        assert exported["indexer_types"] == ["full", "shared", "full"]
        assert "model.layers.1.self_attn.indexer.wk.weight" not in names
    ids, mask = padded_batch(VOCAB, LENGTHS)
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(again, theirs, mask) <= 1e-6 * max(1.0, np.abs(theirs).max())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mtp_layer_loads_and_predicts_as_transformers_mtp_model(families, name, tmp_path):
    """The Hub's MTP layer (DeepSeek-V3's layout after the last layer, its block with an
    indexer of its own) read with `num_mtp_layers=1`: its logits are those of transformers'
    `MtpModel` built from these models (given the `num_mtp_layers` and MTP layer kinds their
    configs lack; GLM-5's block also returns its choice, which `MtpModel` does not expect,
    so its hidden states are taken); its loss counts; the export reads back to the same
    params."""
    torch_model, path, _, _ = families(name)
    config = torch_model.config
    added = dict(
        num_mtp_layers=1, mtp_layer_types=["full_attention"], mtp_mlp_layer_types=["sparse"]
    )
    for key, value in added.items():
        setattr(config, key, value)
    try:
        main, mtp_model = save_with_mtp_layers(torch_model, path, tmp_path / "mtp", 1)
    finally:
        for key in added:
            delattr(config, key)
    if name == "glm_moe_dsa":
        for layer in mtp_model.layers:
            block_forward = layer.mtp_block.forward
            layer.mtp_block.forward = lambda *a, _f=block_forward, **k: _f(*a, **k)[0]
    model, params = hf.from_pretrained(str(tmp_path / "mtp"), ONE, num_mtp_layers=1)
    assert "indexer" in params["mtp_0"]["block"]["self_attn"]
    ids = np.random.default_rng(4).integers(1, VOCAB, (2, 17))  # longer than index_topk
    (want,) = hf_mtp_logits(main, mtp_model, torch.tensor(ids), 1)
    (got,) = mtp_depth_logits(model, params, ids)
    assert np.abs(got[..., :VOCAB] - want).max() < LOGITS_TOL
    check_mtp_loss(model, params, ids, hf_mtp_logits(main, mtp_model, torch.tensor(ids[:, :-1]), 1))

    hf.save_pretrained(model, params, tmp_path / "export")
    again, again_params = hf.from_pretrained(tmp_path / "export", ONE, num_mtp_layers=1)
    assert jax.tree.all(jax.tree.map(np.array_equal, again_params, params))


@pytest.mark.parametrize(
    "keys",
    [
        dict(index_topk_freq=3, index_skip_topk_offset=2),
        dict(index_topk_freq=2, index_skip_topk_offset=0),
        dict(index_topk_pattern="FFSFSS"),
        dict(index_topk_pattern=["full", "shared", "full", "full", "shared", "full"]),
        dict(),
    ],
    ids=str,
)
def test_glm5_indexer_types_resolve_as_transformers_does(keys):
    config = {"model_type": "glm_moe_dsa", "num_hidden_layers": 6, **keys}
    want = transformers.GlmMoeDsaConfig(num_hidden_layers=6, **keys).indexer_types
    got = deepseek_v32.indexer_types_from_hf(config, 6)
    assert (got or ("full",) * 6) == tuple(want)


@pytest.mark.parametrize(
    "name, change, field",
    [
        ("deepseek_v32", dict(q_lora_rank=None), "q_lora_rank"),
        ("deepseek_v32", dict(layer_types=["full_attention"] * 2), "layer_types"),
        ("deepseek_v32", dict(mlp_layer_types=["dense"]), "mlp_layer_types"),
        ("deepseek_v32", dict(index_head_dim=4), "index_head_dim"),
        ("deepseek_v32", dict(num_key_value_heads=2), "num_key_value_heads"),
        ("glm_moe_dsa", dict(indexer_types=["shared", "full", "full"]), "indexer_types"),
        ("glm_moe_dsa", dict(indexer_types=["full", "skip", "full"]), "indexer_types"),
    ],
    ids=str,
)
def test_configs_flaxlm_cannot_read_are_refused_naming_the_field(name, change, field):
    config = {**CLASSES[name][0](**CONFIGS[name]).to_dict(), **change}
    with pytest.raises(ValueError, match=field):
        deepseek_v32.config_from_hf(config)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(scan_layers=True, indexer_types=("full", "shared", "full")), "scan_layers"),
        (dict(rope_interleave=False), "rope_interleave"),
        (dict(index_topk=0), "index_topk"),
    ],
    ids=str,
)
def test_settings_that_cannot_be_are_errors_naming_them(kwargs, field):
    base = dict(num_layers=3, num_experts=8, num_experts_per_tok=2, mlp_only_layers=())
    with pytest.raises(ValueError, match=field):
        deepseek_v32.GlmMoeDsaConfig(**{**base, **kwargs})


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_lora_on_dense_mlps_is_refused_as_a_peft_adapter(model_type):
    """PEFT reads `gate_proj` / `up_proj` / `down_proj` targets of these model types (as of
    DeepSeek-V3's) as the fused experts' parameters: a dense layer's adapter would load
    onto the experts."""
    with pytest.raises(ValueError, match="experts"):
        peft_experts.check_modules(model_type, ["model.layers.0.mlp.gate_proj"])


# Published sizes (model cards), in billions: (config, all params, active params, how many
# vocabulary tables the active count leaves out). DeepSeek-V3.2's 671B and 37B count the
# head, not the embedding (as DeepSeek-V3's; the indexers add 0.9B to each); GLM-5's 744B and
# 40B leave out both tables (39.9B; 41.8B with them).
PUBLISHED = {
    "deepseek_v32": (deepseek_v32.DeepseekV32Config, 671.0, 37.0, 1),
    "glm5": (deepseek_v32.GlmMoeDsaConfig, 744.0, 40.0, 2),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_gin_sizes_match_the_model_cards(name):
    config_cls, total, active, tables = PUBLISHED[name]
    cfg = gin_config(REPO, name, config_cls)
    assert abs(cfg.num_params() / 1e9 - total) / total < 0.01, cfg.num_params()
    counted = cfg.active_params() - tables * cfg.vocab_size * cfg.hidden_size
    # The cards round the active count to two digits.
    assert abs(counted / 1e9 - active) / active < 0.035, counted
    # The dense first layers unrolled, the MoE ones one scanned stack (as DeepSeek-V3's file).
    assert stacks.scan_layout(cfg) == (3, 1, 0)


@pytest.mark.parametrize(
    "name, config_cls",
    [
        ("deepseek_v32_tiny", deepseek_v32.DeepseekV32Config),
        ("glm5_tiny", deepseek_v32.GlmMoeDsaConfig),
    ],
)
def test_tiny_gin_models_count_their_params(name, config_cls):
    model = DecoderOnlyModel(gin_config(REPO, name, config_cls))
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    assert sum(x.size for x in jax.tree.leaves(shapes)) == model.config.num_params()
    assert "indexer" in shapes["layers_0"]["self_attn"]
