"""Kimi Linear from and to HuggingFace: every promise against transformers'
`KimiLinearForCausalLM` (Kimi Delta Attention layers between latent attention ones without
rotary, DeepSeek-V3's experts with shared experts and dense layers anywhere), the Hub's
config.json spelling and the settings transformers would not honour, transformers'
in-memory tensor names, the serving engine's refusal, training steps on packed rows through
the gin file, config errors and the gin files' sizes."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from flaxlm.checkpoints import hf
from flaxlm.models import base, hf_spec, kimi_linear, kimi_linear_hf, options, stacks
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import steps
from tests.helpers import adamw
from tests.hf_helpers import (
    LIGHT,
    check_family,
    check_scanned,
    decoder_batch,
    gin_config,
    max_abs_diff,
    padded_batch,
    random_hf_model,
    save_torch_model,
    torch_logits,
)
from tests.linear_attention_helpers import (
    HYBRID_CONFIG_ERRORS,
    check_engine_greedy_is_hf_generate,
    packed_batch,
)

VOCAB = 120
L, F = kimi_linear.LINEAR, kimi_linear.FULL
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=12,
    v_head_dim=10,
    num_hidden_layers=3,
    initializer_range=0.1,  # sharp enough attention that positions visibly matter
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF's min_new_tokens would otherwise forbid one
)
VARIANTS = {
    # Linear, full, linear; the first MLP dense (HF's default), then 8 experts in 2 groups
    # (2 per token from the best group), queries straight from the input, biased attention.
    "default_dense_first": dict(
        COMMON,
        layer_types=[L, F, L],
        q_lora_rank=None,
        qk_rope_head_dim=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        attention_bias=True,
        linear_num_heads=2,
        linear_head_dim=8,
    ),
    # Full, linear, linear; a dense middle layer between MoE ones, a query latent, an odd
    # key part without rotary, GELU (the MLPs' and the convolution's), a 3-tap convolution,
    # heads narrower than the width, two shared experts, the top k not renormalised, and
    # tie_word_embeddings, which HF's model does not honour (its head stays its own).
    "dense_middle_tied": dict(
        COMMON,
        layer_types=[F, L, L],
        mlp_layer_types=["sparse", "dense", "sparse"],
        q_lora_rank=24,
        qk_rope_head_dim=7,
        hidden_act="gelu",
        linear_conv_kernel_dim=3,
        linear_num_heads=4,
        linear_head_dim=6,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}
# HF starts these at constants (norms at 1, biases and the correction bias at 0).
PERTURBED = ("norm.weight", "layernorm.weight", ".bias")


def tiny_hf_model(path, variant: str):
    """A random tiny torch model of `variant` (its constant-initialised params and the
    routers' correction biases perturbed: the bias at the scale of the sigmoid scores, so it
    changes which experts are chosen), saved."""
    model = random_hf_model(
        transformers.KimiLinearConfig,
        transformers.KimiLinearForCausalLM,
        PERTURBED,
        **VARIANTS[variant],
    )
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    return model, save_torch_model(model, path)


def hf_param_count(torch_model) -> int:
    """transformers' params and the routers' correction biases (buffers there, params here)."""
    biases = [b for n, b in torch_model.named_buffers() if n.endswith("e_score_correction_bias")]
    return sum(p.numel() for p in torch_model.parameters()) + sum(b.numel() for b in biases)


def as_in_memory_names(path, out) -> None:
    """The saved model under transformers' in-memory names: MLPs under `mlp.`, the experts
    fused, the forget gate's params under `forget_gate.`."""
    out.mkdir()
    stored = load_file(f"{path}/model.safetensors")
    tensors = {}
    for name, array in stored.items():
        if ".experts." in name:
            continue
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for p in ("f_a_proj", "f_b_proj", "A_log", "dt_bias"):
            name = name.replace(f".self_attn.{p}", f".self_attn.forget_gate.{p}")
        tensors[name] = array
    for prefix in sorted({n.split(".experts.")[0] for n in stored if ".experts." in n}):
        count = len([n for n in stored if n.startswith(f"{prefix}.experts.") and ".w1." in n])
        pieces = [[stored[f"{prefix}.experts.{e}.{w}.weight"] for w in ("w1", "w3", "w2")]
                  for e in range(count)]  # fmt: skip
        memory = prefix.replace(".block_sparse_moe", ".mlp")
        tensors[f"{memory}.experts.gate_up_proj"] = np.stack(
            [np.concatenate(p[:2]) for p in pieces]
        )
        tensors[f"{memory}.experts.down_proj"] = np.stack([p[2] for p in pieces])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((path / "config.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_checkpoint_keeps_every_promise(tmp_path, variant):
    torch_model, path = tiny_hf_model(tmp_path / "hf", variant)
    # The kernels and meshes once, on the first variant (each variant: its reading and math).
    light = {} if variant == "default_dense_first" else LIGHT
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, scan=False, **light)
    exported = transformers.AutoConfig.from_pretrained(str(tmp_path / "export"))
    for key in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_conv_kernel_dim"):
        assert getattr(exported, key) == getattr(torch_model.config, key), key
    config = kimi_linear_hf.config_from_hf(exported.to_dict())  # the vocabulary unpadded
    assert not config.tie_word_embeddings
    assert config.num_params() == hf_param_count(torch_model)
    if variant == "dense_middle_tied":  # the in-memory names read to the same logits
        as_in_memory_names(tmp_path / "hf", tmp_path / "memory")
        model, params = hf.from_pretrained(tmp_path / "memory")
        ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
        theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
        ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
        assert max_abs_diff(ours, theirs, mask) < 1e-4


@pytest.mark.slow
def test_layers_scan_in_cycles_between_unrolled_ones_to_hf_logits_tokens_and_files(tmp_path):
    """A dense first layer, two cycles of (linear, full) MoE layers, and a last linear one
    (the published file's shape: a cycle cut short at the end): the dense layer and the
    tail stay unrolled around the scanned cycles; HF's logits, its greedy tokens (decoding
    unstacks the cycles) and files HF reloads."""
    kinds = dict(layer_types=[L, L, F, L, F, L], mlp_layer_types=["dense"] + ["sparse"] * 5)
    kwargs = dict(VARIANTS["default_dense_first"], num_hidden_layers=6, **kinds)
    torch_model = random_hf_model(
        transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM, PERTURBED, **kwargs
    )
    path = save_torch_model(torch_model, tmp_path / "hf")
    model, params = hf.from_pretrained(path, scan_layers=True)
    cfg = model.config
    assert (cfg.first_scanned_layer, cfg.scan_period, cfg.scan_tail) == (1, 2, 1)
    assert {"layers_0", "layers", "layers_5"} <= set(params) and "layers_1" not in params
    stack = params["layers"]
    assert stack["block_0"]["self_attn"]["A_log"].shape == (2, 2)
    assert "kv_a_proj_with_mqa" in stack["block_1"]["self_attn"]
    assert "A_log" in params["layers_5"]["self_attn"] and "experts" in params["layers_5"]["mlp"]
    check_scanned(torch_model, model, params, VOCAB, tmp_path / "out")


def tiny_config(**overrides) -> kimi_linear.KimiLinearConfig:
    fields = dict(
        vocab_size=128, hidden_size=32, num_layers=4, num_heads=4, intermediate_size=48,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        linear_num_heads=2, linear_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16,
    )  # fmt: skip
    return kimi_linear.KimiLinearConfig(**{**fields, **overrides})


@pytest.mark.slow
def test_greedy_through_the_engines_pages_and_state_slots_is_hf_generate(tmp_path):
    """Rows joining and leaving, a follower of an identical prompt (its state copied), a
    state slot reused, later prompts resumed from the prefix cache's pages and state
    snapshots: HF's greedy tokens (`generate`'s are `check_family`'s)."""
    torch_model, path = tiny_hf_model(tmp_path / "hf", "default_dense_first")
    check_engine_greedy_is_hf_generate(torch_model, path, VOCAB)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        *HYBRID_CONFIG_ERRORS,
        (dict(linear_head_dim=0), "linear_head_dim"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(n_shared_experts=0), "n_shared_experts"),
        (dict(router="softmax_topk"), "router"),
        (dict(score_correction_bias=False), "score_correction_bias"),
        (dict(shared_expert_intermediate_size=16), "shared_expert_intermediate_size"),
        (dict(decoder_sparse_step=2), "decoder_sparse_step"),
        (dict(kv_lora_rank=0), "kv_lora_rank"),
        (dict(rope_scaling_type="yarn", rope_scaling_factor=4.0), "rope_scaling_type"),
    ],
    ids=str,
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**kwargs)


def test_odd_key_part_and_scanned_layouts_are_accepted():
    """No rotary: any qk_rope_head_dim. Scanned, every layer linear and sparse is one block
    a layer; the published layout (full layers 4, 8, .., 24 and 27 counted from 1, a dense
    first) a dense first layer, six cycles of four and two layers unrolled, the HF table
    stacking each block's layers."""
    assert tiny_config(qk_rope_head_dim=7).qk_rope_head_dim == 7
    alike = tiny_config(layer_types=(L,) * 4, mlp_only_layers=(), scan_layers=True)
    assert (alike.first_scanned_layer, alike.scan_period, alike.scan_tail) == (0, 1, 0)
    full = (4, 8, 12, 16, 20, 24, 27)
    types = tuple(F if i + 1 in full else L for i in range(27))
    config = tiny_config(num_layers=27, layer_types=types, scan_layers=True)
    assert (config.first_scanned_layer, config.scan_period, config.scan_tail) == (1, 4, 2)
    table = hf_spec.expand(kimi_linear_hf.hf_tensors(config), stacks.scan_layout(config))
    a_log = table["layers/block_0/self_attn/A_log"]
    assert a_log.stacked and a_log.names[:2] == [
        "model.layers.1.self_attn.A_log",
        "model.layers.5.self_attn.A_log",
    ]
    assert table["layers/block_2/self_attn/kv_b_proj/kernel"].names[-1] == (
        "model.layers.23.self_attn.kv_b_proj.weight"
    )
    assert not table["layers_26/self_attn/o_proj/kernel"].stacked
    assert "layers_25/self_attn/A_log" in table and "layers_0/mlp/gate_proj/kernel" in table


# config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct as published (the Hub's spelling:
# transformers' stored names, the linear layers' settings in linear_attn_config, keys of the
# Hub's own modeling code).
PUBLISHED = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "first_k_dense_replace": 1,
    "head_dim": 72,
    "hidden_act": "silu",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "kv_lora_rank": 512,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
    "mla_use_nope": True,
    "model_max_length": 1048576,
    "moe_intermediate_size": 1024,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 32,
    "num_expert_group": 1,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_hidden_layers": 27,
    "num_key_value_heads": 32,
    "num_nextn_predict_layers": 0,
    "num_shared_experts": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "v_head_dim": 128,
    "vocab_size": 163840,
}


def test_published_config_json_reads_as_transformers_resolves_it_and_as_the_gin_file(repo_dir):
    _, read = hf.config_from_hf_dict(PUBLISHED)
    settings = {k: v for k, v in PUBLISHED.items() if k not in ("architectures", "model_type")}
    _, resolved = hf.config_from_hf_dict(transformers.KimiLinearConfig(**settings).to_dict())
    from_gin = gin_config(repo_dir, "kimi_linear_48b_a3b", kimi_linear.KimiLinearConfig)
    ignored = {f.name for f in dataclasses.fields(options.ComputeOptions)}
    ignored |= {"real_vocab_size", "linear_attention_chunk_size", "correction_bias_update_rate"}
    for field in dataclasses.fields(kimi_linear.KimiLinearConfig):
        if field.name not in ignored:
            want = getattr(from_gin, field.name)
            assert getattr(read, field.name) == getattr(resolved, field.name) == want, field.name
    assert read.per_layer_types != kimi_linear.default_layer_types(27)  # not HF's default


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(mla_use_nope=False), "mla_use_nope"),
        (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
        (dict(moe_layer_freq=2), "moe_layer_freq"),
        (dict(num_key_value_heads=1), "num_key_value_heads"),
        (dict(quantization_config={"quant_method": "gptq"}), "quant_method"),
        (
            dict(linear_attn_config={**PUBLISHED["linear_attn_config"], "gate_lower_bound": -5}),
            "gate_lower_bound",
        ),  # fmt: skip
        (
            dict(linear_attn_config={**PUBLISHED["linear_attn_config"], "kda_layers": [0]}),
            "kda_layers",
        ),  # fmt: skip
        (dict(linear_attn_config={"full_attn_layers": [4], "kda_layers": [1, 2]}), "layer_types"),
        (dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_settings_transformers_would_not_honour_are_refused_naming_them(change, named):
    with pytest.raises(ValueError, match=named):
        kimi_linear_hf.config_from_hf({**PUBLISHED, **change})


# The parameters (and routers' correction biases) of transformers' causal LM of each gin
# file's exported config.json, counted once on the meta device (`hf_param_count`).
GIN_FILES = {
    "kimi_linear_tiny": dict(layer_count=(3, 1), params=1_565_380),
    "kimi_linear_48b_a3b": dict(layer_count=(20, 7), params=49_122_681_728),
}


@pytest.mark.parametrize("name", sorted(GIN_FILES))
def test_gin_model_file_builds_its_config_with_transformers_parameter_count(repo_dir, name):
    config = gin_config(repo_dir, name, kimi_linear.KimiLinearConfig)
    types = config.per_layer_types
    assert (types.count(L), types.count(F)) == GIN_FILES[name]["layer_count"]
    assert config.vocab_size % 128 == 0 and types[-1] == F
    assert config.num_params() == GIN_FILES[name]["params"]
    lookup = config.vocab_size * config.hidden_size
    assert config.flops_per_token(4096) > 6 * (config.active_params() - lookup)


@pytest.mark.slow
def test_train_steps_on_packed_rows_through_the_gin_file(repo_dir):
    """gin/models/kimi_linear_tiny.gin's model on packed rows and an FSDP x tensor mesh: the
    loss falls, and the routers' correction biases move (aux-loss-free balance), those of
    the scanned layers and of the last one, unrolled after them."""
    config = gin_config(repo_dir, "kimi_linear_tiny", kimi_linear.KimiLinearConfig)
    assert (config.first_scanned_layer, config.scan_period, config.scan_tail) == (1, 1, 1)
    model = base.DecoderOnlyModel(config)
    partitioner = Partitioner(mesh_shape=(1, 4, 2))
    batch = packed_batch()
    setup = steps.Setup(model, partitioner, adamw(1e-2), {k: v.shape[1] for k, v in batch.items()})
    state = setup.init_state()

    def bias(state):
        layers = state.params["layers"]["block"], state.params["layers_3"]
        return [jax.device_get(p["mlp"]["e_score_correction_bias"]) for p in layers]

    before = bias(state)
    assert [b.shape for b in before] == [(2, 8), (8,)]
    step = setup.partition_train_step(steps.make_train_step(model, partitioner, 1e-2))
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    for moved, was in zip(bias(state), before, strict=True):
        assert not np.array_equal(moved, was)


def test_exported_config_json_loads_in_transformers_as_the_config(tmp_path):
    """config_to_hf's dict (stored names, linear_attn_config beside layer_types) resolves in
    transformers to the same layers, and reads back to the same config."""
    config = tiny_config(layer_types=(L, F, L, L), mlp_only_layers=(0, 2))
    out = kimi_linear_hf.config_to_hf(config)
    (tmp_path / "config.json").write_text(json.dumps(out))
    theirs = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert theirs.layer_types == list(config.per_layer_types)
    assert theirs.mlp_layer_types == ["dense", "sparse", "dense", "sparse"]
    assert (theirs.n_shared_experts, theirs.num_local_experts) == (1, 4)
    assert kimi_linear_hf.config_from_hf(theirs.to_dict()) == config
    assert kimi_linear_hf.config_from_hf(out) == config
