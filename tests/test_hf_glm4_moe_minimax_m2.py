"""GLM-4.5 / 4.6 (`glm4_moe`) and MiniMax-M2 (`minimax_m2`) from and to HuggingFace: every
promise of `check_family`, greedy decoding through the serving engine's paged cache, full and
LoRA training, the multi-token-prediction layer skipped, refused settings, the gin sizes.

Tiny random models of transformers' `Glm4MoeForCausalLM` and `MiniMaxM2ForCausalLM` with
their norms, biases and correction biases perturbed (HF starts them at 1 and 0). GLM-4.5 in
two configs: `GLM` every layer sparse (so the layers scan) with per-head q/k norms, q/k/v
biases, group-limited routing and YaRN over half of each head; `GLM_DENSE_FIRST` a dense
first layer, no q/k norms or biases, unnormalised routing weights, two shared experts, one
key/value head and rotary over three quarters of each head. MiniMax-M2 with rotary over 8 of
12 features (its files' `rotary_dim`) and whole-projection q/k norms.
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
from safetensors.torch import save_file

from flaxlm.checkpoints import hf
from flaxlm.models import glm4_moe, minimax_m2
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import lora, steps
from tests.helpers import adamw
from tests.hf_helpers import (
    check_family,
    decoder_batch,
    engine_greedy,
    gin_config,
    hf_greedy_batch,
    hf_mtp_logits,
    max_abs_diff,
    padded_batch,
    random_hf_model,
    save_with_mtp_layers,
    torch_logits,
    train_on_batch,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 120
GREEDY_TOKENS = 8
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_hidden_layers=2,
    num_experts_per_tok=2,
    max_position_embeddings=96,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF's min_new_tokens would otherwise forbid one
)
GLM = dict(
    COMMON,
    num_key_value_heads=2,
    head_dim=12,
    intermediate_size=48,
    moe_intermediate_size=16,
    n_routed_experts=8,
    first_k_dense_replace=0,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
    use_qk_norm=True,
    attention_bias=True,
    # Past the original 32 positions: YaRN's frequencies over the 6 rotated features only.
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=2.0,
        original_max_position_embeddings=32,
        partial_rotary_factor=0.5,
    ),
)
GLM_DENSE_FIRST = dict(
    COMMON,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=48,
    moe_intermediate_size=16,
    n_routed_experts=8,
    first_k_dense_replace=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.5,
    n_shared_experts=2,
    use_qk_norm=False,
    attention_bias=False,
    partial_rotary_factor=0.75,
)
MINIMAX = dict(
    COMMON,
    num_key_value_heads=2,
    head_dim=12,
    intermediate_size=16,
    num_local_experts=8,
    rotary_dim=8,
)
# float32 logits of a 2-layer model whose values are O(1): rounding in other summation orders
# is ~eps (1.2e-7) x sqrt(width) x depth ~ 1e-6; 1e-4 leaves a margin (what every family meets).
LOGITS_TOL = 1e-4
ONE = Partitioner(devices=jax.devices()[:1])


def tiny_hf(family: str, **kwargs):
    """A random tiny HF model of `family` whose norms, biases and correction biases are
    perturbed; the correction bias at the scale of the sigmoid scores, so it moves choices."""
    config_cls, model_cls = {
        "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
        "minimax_m2": (transformers.MiniMaxM2Config, transformers.MiniMaxM2ForCausalLM),
    }[family]
    model = random_hf_model(config_cls, model_cls, ("norm.weight", ".bias"), **kwargs)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    return model


@pytest.fixture(scope="module", params=["glm4_moe", "minimax_m2"])
def saved(request, tmp_path_factory):
    """(family, torch model, its save_pretrained directory): GLM_DENSE_FIRST and MINIMAX."""
    config = GLM_DENSE_FIRST if request.param == "glm4_moe" else MINIMAX
    torch_model = tiny_hf(request.param, **config)
    path = str(tmp_path_factory.mktemp(request.param))
    torch_model.save_pretrained(path)
    return request.param, torch_model, path


@pytest.mark.slow
def test_glm4_moe_keeps_every_promise(tmp_path):
    torch_model = tiny_hf("glm4_moe", **GLM)
    torch_model.save_pretrained(tmp_path / "hf")
    model, _ = hf.from_pretrained(str(tmp_path / "hf"), ONE)
    assert model.config.rotary_dim == 6 and model.config.rope_scaling_type == "yarn"
    check_family(torch_model, tmp_path / "hf", VOCAB, tmp_path=tmp_path)


@pytest.mark.slow
def test_minimax_m2_keeps_every_promise(tmp_path):
    torch_model = tiny_hf("minimax_m2", **MINIMAX)
    torch_model.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as f:
        assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in f.keys()  # the Hub's
    check_family(torch_model, tmp_path / "hf", VOCAB, tmp_path=tmp_path)
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "np") as f:
        assert "model.layers.1.block_sparse_moe.e_score_correction_bias" in f.keys()
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["rotary_dim"] == 8


@pytest.mark.slow
def test_greedy_through_the_engines_paged_cache_is_hf_generate(saved):
    """The dense first layer beside the sparse ones (GLM; its MoE layers scanned apart from
    it), the whole q/k norms (MiniMax): HF's logits with the experts split over an `expert`
    mesh axis, and HF's tokens from the serving engine's paged KV cache (`generate`'s are
    `check_family`'s)."""
    family, torch_model, path = saved
    expert_mesh = Partitioner(
        mesh_shape=(1, 2, 2, 2), mesh_axis_names=("data", "fsdp", "expert", "tensor")
    )
    glm = family == "glm4_moe"
    model, params = hf.from_pretrained(path, expert_mesh, scan_layers=glm)
    if glm:
        assert model.config.sparse_layers(2) == (False, True) and model.config.rotary_dim == 12
        assert "experts" not in params["layers_0"]["mlp"]
        wi = params["layers"]["block"]["mlp"]["experts"]["wi"]
        assert wi.shape[0] == 1 and wi.sharding.spec[1] == "expert"
    else:
        assert params["layers_1"]["mlp"]["experts"]["wi"].sharding.spec[0] == "expert"
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    assert max_abs_diff(ours, theirs, mask) < LOGITS_TOL

    model, params = hf.from_pretrained(path, ONE)  # the engine's placement

    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (11, 4, 17)]
    expected = hf_greedy_batch(torch_model, prompts, GREEDY_TOKENS)
    assert model.paged_refusal() is None
    assert engine_greedy(model, params, prompts, GREEDY_TOKENS) == expected


@pytest.mark.slow
def test_full_and_lora_training_lower_the_loss(saved):
    """Full fine-tuning, then LoRA on the attention, the router and the experts (the base
    untouched): both losses fall. On one device (the meshes are `check_family`'s; compiling
    for 8 simulated devices would only slow this)."""
    family, _, path = saved
    partitioner = ONE
    model, params = hf.from_pretrained(path, partitioner)
    ids, mask = padded_batch(VOCAB, (16, 16, 11, 16, 16, 7, 16, 16), seed=1)
    batch = decoder_batch(ids, mask)
    _, history = train_on_batch(model, params, partitioner, batch, steps=3)
    assert history[-1]["loss"] < history[0]["loss"], history

    rules = ((r"(q|v|o)_proj/kernel$", 4), (r"mlp/gate/kernel$", 2), (r"experts/wi$", 2))
    cfg = lora.LoraConfig(rules=rules, alpha=8.0)
    lengths = {k: v.shape[1] for k, v in batch.items()}
    setup = steps.Setup(model, partitioner, adamw(3e-2), lengths, lora=cfg)
    sparse = sum(model.config.sparse_layers(model.config.num_layers))
    assert len(setup.lora_kernels) == 3 * model.config.num_layers + 2 * sparse
    state = setup.init_state()
    step = setup.partition_train_step(steps.make_train_step(model, partitioner, 3e-2, lora=cfg))
    before = jax.device_get(params)
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch, params)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    jax.tree.map(np.testing.assert_array_equal, before, jax.device_get(params))


@pytest.mark.slow
def test_glm_mtp_layer_is_skipped_and_other_extra_layers_refused(tmp_path):
    """GLM-4.5-Air's files carry its multi-token-prediction layer as `model.layers.46`
    (GLM-4.5's as `.92`): skipped, as transformers skips it; a layer past `num_layers`
    that is no such thing is refused."""
    tiny_hf("glm4_moe", **GLM_DENSE_FIRST).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for extra, refused in (("model.layers.46.eh_proj.weight", False), ("model.layers.2.x", True)):
        save_file({**tensors, extra: torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
        if refused:
            with pytest.raises(ValueError, match=extra):
                hf.from_pretrained(str(tmp_path), ONE)
        else:
            model, _ = hf.from_pretrained(str(tmp_path), ONE)
            assert isinstance(model.config, glm4_moe.Glm4MoeConfig)


@pytest.mark.slow
def test_glm_mtp_layer_loads_predicts_trains_and_exports_as_transformers(tmp_path):
    """GLM-4.5's MTP layer read where the config asks for it (`num_mtp_layers`): its logits
    are transformers' `MtpModel`'s, its loss counts with `mtp_loss_weight`, and the export
    writes it back as it was read."""
    torch_model = tiny_hf("glm4_moe", **GLM_DENSE_FIRST)
    torch_model.save_pretrained(tmp_path / "hf")
    main, mtp_model = save_with_mtp_layers(torch_model, tmp_path / "hf", tmp_path / "mtp", 1)
    model, params = hf.from_pretrained(tmp_path / "mtp", ONE, num_mtp_layers=1)
    ids = np.random.default_rng(4).integers(1, VOCAB, (2, 13))
    (want,) = hf_mtp_logits(main, mtp_model, torch.tensor(ids), 1)

    # Jitted: run eagerly, each op of these programs would compile on its own (~5 s more).
    @jax.jit
    def mtp_logits(params, ids):
        _, sown = model.module.apply({"params": params}, ids, mutable=["mtp", "intermediates"])
        return model.module.head_logits(params, sown["mtp"]["hidden"][0])

    got = np.asarray(mtp_logits(params, ids))
    assert np.abs(got[:, :-1, :VOCAB] - want).max() < LOGITS_TOL
    batch = {
        "decoder_input_tokens": ids[:, :-1],
        "decoder_target_tokens": ids[:, 1:],
        "decoder_loss_weights": np.ones(ids[:, 1:].shape, np.float32),
    }
    plain, sums = jax.jit(model.loss_fn)(params, batch, None)
    weighted = DecoderOnlyModel(dataclasses.replace(model.config, mtp_loss_weight=0.5))
    loss, _ = jax.jit(weighted.loss_fn)(params, batch, None)
    mean = float(sums["mtp_loss_sum"]) / ids[:, 1:].size
    assert float(loss) - float(plain) == pytest.approx(0.5 * mean, rel=1e-5)
    hf.save_pretrained(model, params, tmp_path / "export")
    again = hf.from_pretrained(tmp_path / "export", ONE, num_mtp_layers=1)[1]
    assert jax.tree.all(jax.tree.map(np.array_equal, again, params))


# Published sizes (model cards): (all, active) params in billions. The totals agree to 1%;
# the active counts (here without the embedding lookup, which no token multiplies by) are
# the cards' rounded figures: GLM-4.5-Air's 12B is 12.8B counted, so 7%.
PUBLISHED = {
    "glm4_5": (glm4_moe.Glm4MoeConfig, 355.0, 32.0),
    "glm4_6": (glm4_moe.Glm4MoeConfig, 355.0, 32.0),
    "glm4_5_air": (glm4_moe.Glm4MoeConfig, 106.0, 12.0),
    "minimax_m2": (minimax_m2.MiniMaxM2Config, 230.0, 10.0),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_gin_sizes_match_the_model_cards(name):
    config_cls, total, active = PUBLISHED[name]
    cfg = gin_config(REPO, name, config_cls)
    assert abs(cfg.num_params() / 1e9 - total) / total < 0.01, cfg.num_params()
    matmul = cfg.active_params() - cfg.vocab_size * cfg.hidden_size
    assert abs(matmul / 1e9 - active) / active < 0.07, matmul
    assert cfg.flops_per_token(4096) > 6 * matmul


@pytest.mark.parametrize(
    "name, config_cls",
    [("glm4_moe_tiny", glm4_moe.Glm4MoeConfig), ("minimax_m2_tiny", minimax_m2.MiniMaxM2Config)],
)
def test_tiny_gin_model_counts_its_params(name, config_cls):
    model = DecoderOnlyModel(gin_config(REPO, name, config_cls))
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    assert sum(x.size for x in jax.tree.leaves(shapes)) == model.config.num_params()


GLM_BASE = dict(num_layers=4, num_experts=8, num_experts_per_tok=2, mlp_only_layers=(0,))


@pytest.mark.parametrize(
    "config_cls, kwargs, field",
    [
        (glm4_moe.Glm4MoeConfig, dict(GLM_BASE, n_group=3), "n_group"),
        (glm4_moe.Glm4MoeConfig, dict(GLM_BASE, n_group=8, topk_group=4), "n_group"),
        (glm4_moe.Glm4MoeConfig, dict(GLM_BASE, n_group=4, topk_group=5), "topk_group"),
        (glm4_moe.Glm4MoeConfig, dict(GLM_BASE, mlp_only_layers=(1,)), "mlp_only_layers"),
        (glm4_moe.Glm4MoeConfig, dict(GLM_BASE, router="softmax_topk"), "router"),
        (glm4_moe.Glm4MoeConfig, dict(GLM_BASE, n_shared_experts=0), "n_shared_experts"),
        (glm4_moe.Glm4MoeConfig, dict(GLM_BASE, partial_rotary_factor=0.0), "partial_rotary"),
        (glm4_moe.Glm4MoeConfig, dict(GLM_BASE, partial_rotary_factor=0.01), "partial_rotary"),
        (minimax_m2.MiniMaxM2Config, dict(routed_scaling_factor=2.0), "routed_scaling_factor"),
        (minimax_m2.MiniMaxM2Config, dict(norm_topk_prob=False), "norm_topk_prob"),
        (minimax_m2.MiniMaxM2Config, dict(mlp_only_layers=(0,)), "mlp_only_layers"),
        (minimax_m2.MiniMaxM2Config, dict(num_kv_heads=5), "num_kv_heads"),
    ],
    ids=str,
)
def test_settings_that_cannot_be_are_errors_naming_them(config_cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        config_cls(**kwargs)


@pytest.mark.parametrize(
    "family, change, field",
    [
        ("glm4_moe", dict(quantization_config={"quant_method": "gptq"}), "quant_method"),
        ("glm4_moe", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
        ("glm4_moe", dict(partial_rotary_factor=0.1, rope_parameters=None), "partial_rotary"),
        ("minimax_m2", dict(router_jitter_noise=0.1), "router_jitter_noise"),
        ("minimax_m2", dict(output_router_logits=True), "output_router_logits"),
        ("minimax_m2", dict(quantization_config={"quant_method": "awq"}), "quant_method"),
    ],
    ids=str,
)
def test_configs_flaxlm_cannot_read_are_refused_naming_the_field(family, change, field):
    config_cls, read = {
        "glm4_moe": (transformers.Glm4MoeConfig, glm4_moe.config_from_hf),
        "minimax_m2": (transformers.MiniMaxM2Config, minimax_m2.config_from_hf),
    }[family]
    config = {**config_cls(**(GLM if family == "glm4_moe" else MINIMAX)).to_dict(), **change}
    with pytest.raises(ValueError, match=field):
        read(config)


def test_released_config_json_fields_read_as_transformers_reads_them():
    """MiniMax-M2's files: `rotary_dim` and a top-level `rope_theta`, no `rope_parameters`;
    GLM-4.5's: `partial_rotary_factor` at the top level. Both as transformers reads them."""
    released = dict(MINIMAX, rope_theta=5e6, use_qk_norm=True)  # (a field HF ignores)
    cfg = minimax_m2.config_from_hf(released)
    theirs = transformers.MiniMaxM2Config(**released)
    assert cfg.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"]
    assert cfg.rotary_dim == 8 and cfg.rope_theta == 5e6
    bare = {k: v for k, v in MINIMAX.items() if k != "rotary_dim"}
    assert minimax_m2.config_from_hf(bare).rotary_dim == 12  # transformers' default: all
    assert minimax_m2.config_from_hf(bare).rope_theta == transformers.MiniMaxM2Config.default_theta
    glm = {k: v for k, v in GLM.items() if k != "rope_parameters"}
    assert glm4_moe.config_from_hf(dict(glm, partial_rotary_factor=1.0)).rotary_dim == 12
    assert glm4_moe.config_from_hf(glm).rotary_dim == 6  # transformers' default: half
