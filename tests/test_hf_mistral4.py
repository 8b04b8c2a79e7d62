"""Mistral 4 from and to HuggingFace: logits, greedy generation (generate and the serving
engine's paged latent cache), export, full and LoRA training on an expert mesh, the query
scale by position, refused settings, and the published size.

Two tiny random models of transformers' `Mistral4ForCausalLM`, differing in Mistral 4's own
settings and DeepSeek-V3's branches: FULL (a query latent, interleaved rotary, YaRN past an
original context of 8 with mscale_all_dim != mscale, a large llama_4_scaling_beta so the
query scale steps every 8 positions, a dense first layer, group-limited softmax routing
renormalised and scaled, rms_norm_eps != the latent norms' 1e-6) and OTHER (plain `q_proj`,
attention biases, half-split rotary, llama3 rope over HF's rotary width of
int(44 * 30 / 44) = 29 with mscale_all_dim on the softmax, unrenormalised routing, two shared
experts' width, every layer sparse so the layers scan, a tied head).
"""

import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from transformers.models.mistral4.modeling_mistral4 import get_llama_4_attn_scale

from flaxlm.checkpoints import hf
from flaxlm.models import mistral4
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.rope import llama4_query_scale
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import lora, steps
from tests.helpers import adamw, load_benchmark
from tests.hf_helpers import (
    LIGHT,
    check_family,
    decoder_batch,
    engine_greedy,
    gin_config,
    hf_greedy_batch,
    max_abs_diff,
    padded_batch,
    random_hf_model,
    torch_logits,
    train_on_batch,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 120
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    max_position_embeddings=96,
    initializer_range=0.1,
    num_hidden_layers=2,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF's min_new_tokens would otherwise forbid one
    pad_token_id=None,
)
FULL = dict(
    COMMON,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    first_k_dense_replace=1,
    q_lora_rank=24,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-5,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=3.0,
        original_max_position_embeddings=8,
        mscale=1.0,
        mscale_all_dim=0.8,
        llama_4_scaling_beta=0.5,
    ),
)
OTHER = dict(
    COMMON,
    qk_rope_head_dim=30,
    qk_nope_head_dim=14,
    v_head_dim=10,
    first_k_dense_replace=0,
    q_lora_rank=None,
    attention_bias=True,
    rope_interleave=False,
    norm_topk_prob=False,
    n_shared_experts=2,
    tie_word_embeddings=True,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=2.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
        mscale_all_dim=0.7,
        llama_4_scaling_beta=0.3,
    ),
)
# float32 logits of a 2-layer model whose values are O(1): rounding in other summation orders
# is ~eps (1.2e-7) x sqrt(width) x depth ~ 1e-6; 1e-4 is what every family meets.
LOGITS_TOL = 1e-4
ONE = Partitioner(devices=jax.devices()[:1])
# transformers 5.23's AutoModelForCausalLM has no mistral4 entry (its pretraining and
# image-text-to-text auto maps do): exports reload through the class itself.
RELOAD = transformers.Mistral4ForCausalLM


def tiny_hf_mistral4(**kwargs):
    """A random tiny `Mistral4ForCausalLM` whose norms and biases are perturbed too (HF
    starts them at 1 and 0)."""
    return random_hf_model(
        transformers.Mistral4Config,
        transformers.Mistral4ForCausalLM,
        ("norm.weight", "layernorm.weight", ".bias"),
        **kwargs,
    )


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """(torch model, its save_pretrained directory, flaxlm model, params on one device)."""
    torch_model = tiny_hf_mistral4(**FULL)
    path = str(tmp_path_factory.mktemp("mistral4_full"))
    torch_model.save_pretrained(path)
    model, params = hf.from_pretrained(path, ONE)
    return torch_model, path, model, params


@pytest.mark.slow
def test_full_options_keep_every_promise(full, tmp_path):
    torch_model, path, model, _ = full
    cfg = model.config
    assert isinstance(cfg, mistral4.Mistral4Config)
    assert cfg.sparse_layers(2) == (False, True) and cfg.q_lora_rank == 24
    assert (cfg.llama_4_scaling_beta, cfg.rope_original_max_position_embeddings) == (0.5, 8)
    # The dense first layer keeps the layers unrolled on the second mesh too.
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, scan=False, reload_cls=RELOAD)
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["rope_parameters"]["llama_4_scaling_beta"] == 0.5
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "np") as f:
        # transformers keeps Mistral 4's experts fused (no per-expert conversion).
        assert "model.layers.1.mlp.experts.gate_up_proj" in set(f.keys())


@pytest.mark.slow
def test_other_options_keep_every_promise(tmp_path):
    torch_model = tiny_hf_mistral4(**OTHER)
    torch_model.save_pretrained(tmp_path / "hf")
    path = str(tmp_path / "hf")
    cfg = hf.config_from_hf_dict(json.loads((tmp_path / "hf" / "config.json").read_text()))[1]
    assert cfg.rotary_dim == 29 and cfg.rope_scaling_type == "llama3"
    assert cfg.q_lora_rank is None and cfg.tie_word_embeddings and not cfg.rope_interleave
    # The kernels and meshes are the full options' (here: the reading and math of these).
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, reload_cls=RELOAD, **LIGHT)


def test_query_scale_is_hfs_at_every_position():
    positions = np.arange(0, 70, dtype=np.int64)[None]
    cfg = mistral4.Mistral4Config(
        llama_4_scaling_beta=0.5, rope_original_max_position_embeddings=8, num_layers=1
    )
    theirs = get_llama_4_attn_scale(torch.from_numpy(positions), 0.5, 8)[:, 0, :, 0].numpy()
    ours = np.asarray(llama4_query_scale(positions.astype(np.int32), cfg))
    # The same float32 operations; XLA's and torch's log may round 1 ulp apart.
    np.testing.assert_allclose(ours, theirs, rtol=2e-7)
    assert ours[0, 7] == 1.0 and ours[0, 8] > 1.0  # one step per original context


@pytest.mark.slow
def test_engine_pages_the_latent_cache_as_hf_generates(full):
    """The serving engine's paged latent cache, positions past several steps of the query
    scale: HF's greedy tokens."""
    torch_model, _, model, params = full
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (9, 3, 14)]
    expected = hf_greedy_batch(torch_model, prompts, 12)
    assert model.paged_refusal() is None
    assert engine_greedy(model, params, prompts, 12) == expected


@pytest.mark.slow
def test_full_and_lora_training_lower_the_loss_on_an_expert_mesh(full):
    """On (data, fsdp, expert, tensor) = (1, 2, 4, 1), the experts split 4 ways: HF's logits,
    then full training and LoRA (attention, MLPs and every expert adapted) each lower the
    loss, LoRA leaving the base as imported."""
    torch_model, path, _, _ = full
    partitioner = Partitioner(
        mesh_shape=(1, 2, 4, 1), mesh_axis_names=("data", "fsdp", "expert", "tensor")
    )
    model, params = hf.from_pretrained(path, partitioner)
    ids, mask = padded_batch(VOCAB, (16, 16, 11, 16, 16, 7, 16, 16), seed=1)
    batch = decoder_batch(ids, mask)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(jax.jit(model.compute_logits)(params, batch), theirs, mask) < LOGITS_TOL

    _, history = train_on_batch(model, params, partitioner, batch, steps=3)
    assert history[-1]["loss"] < history[0]["loss"], history

    rules = (
        (r"(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)/kernel$", 4),
        (r"experts/(wi|wo)$", 2),
        (r"(gate|up|down)_proj/kernel$", 4),
    )
    cfg = lora.LoraConfig(rules=rules, alpha=8.0)
    lengths = {k: v.shape[1] for k, v in batch.items()}
    setup = steps.Setup(model, partitioner, adamw(3e-2), lengths, lora=cfg)
    # 5 attention kernels a layer, the dense MLP's 3, the MoE's experts (2) and shared (3).
    assert len(setup.lora_kernels) == 5 * 2 + 3 + 2 + 3
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
def test_no_shared_experts_reads_past_the_empty_linears_transformers_saves(tmp_path):
    """n_shared_experts = 0: transformers still saves 0-wide shared-expert Linears."""
    torch_model = tiny_hf_mistral4(**{**FULL, "n_shared_experts": 0, "first_k_dense_replace": 0})
    torch_model.save_pretrained(tmp_path)
    name = "model.layers.1.mlp.shared_experts.up_proj.weight"
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        assert f.get_slice(name).get_shape() == [0, 32]
    # They add nothing to HF's output: the import has no shared experts (every tensor with
    # a param is checked present and of its shape, the empty ones are left unread).
    _, params = hf.from_pretrained(str(tmp_path), ONE)
    assert "shared_experts" not in params["layers_1"]["mlp"]
    assert "experts" in params["layers_1"]["mlp"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(router="sigmoid_topk"), "router"),
        (dict(score_correction_bias=True), "score_correction_bias"),
        (dict(n_group=8, topk_group=4), "n_group"),
        (dict(rope_scaling_type=None), "rope_scaling_type"),
        (dict(partial_rotary_factor=1.0), "partial_rotary_factor"),
        (dict(qk_nope_head_dim=14, qk_rope_head_dim=30), "partial_rotary_factor"),
        (dict(mlp_only_layers=(1,)), "mlp_only_layers"),
        (dict(mla_cache="compressed"), "mla_cache"),
        (dict(topk_group=3, n_group=2), "topk_group"),
    ],
    ids=str,
)
def test_settings_that_cannot_be_are_errors_naming_them(kwargs, field):
    base = dict(num_layers=4, num_experts=8, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=field):
        mistral4.Mistral4Config(**{**base, **kwargs})


def rope(**change):
    return {"rope_parameters": {**FULL["rope_parameters"], **change}}


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(quantization_config={"quant_method": "gptq"}), "quant_method is 'gptq'"),
        (dict(n_group=None), "n_group"),
        (dict(v_head_dim=None), "v_head_dim"),
        (rope(rope_type="default"), "rope_type 'default'"),
        (rope(rope_type="dynamic"), "dynamic"),
        (rope(llama_4_scaling_beta=None), "llama_4_scaling_beta"),
        (
            {"rope_parameters": dict(rope_type="linear", factor=2.0, llama_4_scaling_beta=0.1)},
            "original_max_position_embeddings",
        ),
        (dict(qk_nope_head_dim=14, qk_rope_head_dim=30), "partial_rotary_factor"),
    ],
    ids=str,
)
def test_configs_flaxlm_cannot_read_are_refused_naming_the_field(change, field):
    config = {**transformers.Mistral4Config(**FULL).to_dict(), **change}
    if "qk_rope_head_dim" in change:  # HF's default factor, as its config would set it
        config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": 30 / 44}
    with pytest.raises(ValueError, match=field):
        mistral4.config_from_hf(config)


def test_gin_size_matches_the_model_card():
    """Mistral Small 4: 119B params, 6.5B active (the card's rounding)."""
    cfg = gin_config(REPO, "mistral_small_4_119b", mistral4.Mistral4Config)
    assert abs(cfg.num_params() / 1e9 - 119.0) / 119.0 < 0.01, cfg.num_params()
    assert abs(cfg.active_params() / 1e9 - 6.5) / 6.5 < 0.03, cfg.active_params()


def test_tiny_gin_model_counts_its_params():
    model = DecoderOnlyModel(gin_config(REPO, "mistral4_tiny", mistral4.Mistral4Config))
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    assert sum(x.size for x in jax.tree.leaves(shapes)) == model.config.num_params()
    moe = shapes["layers"]["block"]["mlp"]  # scanned: every layer a mixture of experts
    assert moe["experts"]["wi"].shape[:2] == (4, 8) and "e_score_correction_bias" not in moe


@pytest.mark.slow
def test_published_shape_splits_its_state_evenly_over_expert_and_fsdp():
    """benchmarks/moe.py `memory`'s first column, as tests/test_benchmarks.py checks it for
    the other MoE files: Mistral Small 4 cut to 2 (scanned) layers, params + AdamW state per
    device = total / 8 under fsdp + expert 8 as under fsdp 8, shapes only."""
    bench_common = load_benchmark("bench_common")
    model = bench_common.reduce_layers(bench_common.gin_model("mistral_small_4_119b"), 2)
    assert model.config.sparse_layers(2) == (True, True) and model.config.scan_layers
    lengths = bench_common.feature_lengths(model, 128)
    for expert in (1, 8):
        partitioner = bench_common.make_partitioner("fsdp", expert=expert)
        state = steps.Setup(model, partitioner, adamw(), lengths).abstract_state
        total = bench_common.total_bytes(state.params) + bench_common.total_bytes(state.opt_state)
        per_device = bench_common.per_device_bytes(state.params)
        per_device += bench_common.per_device_bytes(state.opt_state)
        assert total / 8 <= per_device <= 1.01 * total / 8, (expert, per_device / (total / 8))
