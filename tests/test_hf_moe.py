"""Mixture-of-experts families from and to HuggingFace: logits, the router's choices and its
aux loss against transformers' PyTorch models, greedy generation, export, both checkpoint
spellings, and the published sizes' parameter counts.

transformers 5 holds each layer's experts fused (`mlp.experts.gate_up_proj [E, 2F, D]`,
`down_proj [E, D, F]`); its `save_pretrained` writes them per expert (the Hub's spelling:
`mlp.experts.{e}.gate_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1`). flaxlm reads
both and writes the second; each family is saved both ways here.
"""

import functools
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from flaxlm.checkpoints import hf
from flaxlm.models import mixtral, olmoe, qwen_moe, routing
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.parallel.partitioning import Partitioner
from tests.hf_helpers import (
    MESHES,
    check_scanned,
    decoder_batch,
    flaxlm_greedy_batch,
    gin_config,
    hf_greedy_batch,
    max_abs_diff,
    padded_batch,
    random_hf_model,
    torch_logits,
)

GREEDY_TOKENS = 8  # past every prompt; fewer than hf_helpers' 30, for time
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 120
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=96,
    num_experts_per_tok=2,
    initializer_range=0.1,
)
QWEN = dict(num_experts=8, moe_intermediate_size=16)
FAMILIES = {
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(QWEN, head_dim=8, norm_topk_prob=True),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(QWEN, shared_expert_intermediate_size=24, norm_topk_prob=False),
    ),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=8, intermediate_size=16),
    ),
    # clip_qkv at 1: the q and k features past one RMS (a third of them) are clipped.
    "olmoe": (
        transformers.OlmoeConfig,
        transformers.OlmoeForCausalLM,
        dict(num_experts=8, intermediate_size=16, clip_qkv=1.0),
    ),
}
CONFIGS = {
    "qwen3_moe": qwen_moe.QwenMoeConfig,
    "qwen2_moe": qwen_moe.QwenMoeConfig,
    "mixtral": mixtral.MixtralConfig,
    "olmoe": olmoe.OlmoeConfig,
}
# float32 logits of a 2-layer model whose values are O(10): rounding in other summation
# orders is ~eps (1.2e-7) x sqrt(width) x depth x scale ~ 1e-5; 1e-4 leaves a margin.
LOGITS_TOL = 1e-4
family_params = pytest.mark.parametrize("family", sorted(FAMILIES))


def save_fused(torch_model, path) -> str:
    """The model's config and its state dict as transformers 5 holds it (experts fused)."""
    os.makedirs(path, exist_ok=True)
    torch_model.config.save_pretrained(str(path))
    state = {k: v.contiguous() for k, v in torch_model.state_dict().items()}
    if torch_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(str(path), "model.safetensors"), metadata={"format": "pt"})
    return str(path)


@functools.cache
def tiny_hf_moe(family, root):
    """A random tiny HF model of `family` and its checkpoints in both spellings: fused (as
    transformers holds it) and per expert (as its save_pretrained writes it, the Hub's)."""
    config_cls, model_cls, extra = FAMILIES[family]
    model = random_hf_model(config_cls, model_cls, ("norm.weight", ".bias"), **{**COMMON, **extra})
    fused = save_fused(model, os.path.join(root, family, "fused"))
    per_expert = os.path.join(root, family, "per_expert")
    model.save_pretrained(per_expert)
    return model, fused, per_expert


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_moe"))


@pytest.mark.slow
@family_params
def test_both_spellings_give_hf_logits(family, root):
    torch_model, fused, per_expert = tiny_hf_moe(family, root)
    assert any(".experts.0." in k for k in _stored_names(per_expert))  # the Hub's spelling
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    for path in (fused, per_expert):
        model, params = hf.from_pretrained(path)
        assert isinstance(model.config, CONFIGS[family])
        ours = np.asarray(jax.jit(model.compute_logits)(params, decoder_batch(ids, mask)))
        assert max_abs_diff(ours, theirs, mask) < LOGITS_TOL, path


def test_sharded_scanned_model_gives_hf_logits(root):
    # One family (the shared expert's) on one mesh, layers scanned: what the placement adds.
    torch_model, fused, _ = tiny_hf_moe("qwen2_moe", root)
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    partitioner = Partitioner(mesh_shape=MESHES[-1])
    model, params = hf.from_pretrained(fused, partitioner, scan_layers=True)
    got = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    assert max_abs_diff(got, theirs, mask) < LOGITS_TOL


@pytest.mark.slow
def test_dense_layers_among_moe_ones_scan_their_cycle_to_hf_logits_tokens_and_files(tmp_path):
    """Qwen2-MoE with dense MLPs among its MoE ones (`mlp_only_layers` 1 and 3 of 5): the
    scan stacks (MoE, dense) twice and leaves the last MoE layer unrolled; HF's logits, its
    greedy tokens (decoding unstacks the cycles) and files HF reloads."""
    config_cls, model_cls, extra = FAMILIES["qwen2_moe"]
    kwargs = {**COMMON, **extra, "num_hidden_layers": 5, "mlp_only_layers": [1, 3]}
    torch_model = random_hf_model(config_cls, model_cls, ("norm.weight", ".bias"), **kwargs)
    path = save_fused(torch_model, tmp_path / "hf")
    model, params = hf.from_pretrained(path, scan_layers=True)
    cfg = model.config
    assert (cfg.first_scanned_layer, cfg.scan_period, cfg.scan_tail) == (0, 2, 1)
    stack = params["layers"]
    assert "experts" in stack["block_0"]["mlp"] and "gate_proj" in stack["block_1"]["mlp"]
    assert "experts" in params["layers_4"]["mlp"] and "layers_0" not in params
    check_scanned(torch_model, model, params, VOCAB, tmp_path / "out")


@pytest.mark.slow
@family_params
def test_router_chooses_hf_experts_and_aux_loss(family, root):
    """The same top-k experts as HF's router at every real token and layer, and the same
    aux loss as HF's `output_router_logits=True` (added to the loss with its coefficient)."""
    torch_model, fused, _ = tiny_hf_moe(family, root)
    ids, mask = padded_batch(VOCAB, (12, 7, 12, 3))
    with torch.no_grad():
        out = torch_model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            output_router_logits=True,
        )
    model, params = hf.from_pretrained(fused)
    batch = decoder_batch(ids, mask)
    _, sown = model.module.apply(
        {"params": params},
        batch["decoder_input_tokens"],
        batch["decoder_positions"],
        batch["decoder_segment_ids"],
        mutable=[routing.ROUTER_COLLECTION],
    )
    stats = routing.collect_router_stats(sown[routing.ROUTER_COLLECTION])
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
    aux = routing.router_losses(stats, experts, k)["aux"]
    # A sum of E products of O(1/E) means over ~40 tokens: float32 rounding ~1e-7.
    np.testing.assert_allclose(float(aux), float(out.aux_loss), rtol=1e-5)

    # Each layer's top-k experts at the real tokens: the counts HF's router logits give.
    real = mask.reshape(-1).astype(bool)
    for layer, logits in enumerate(out.router_logits):
        chosen = torch.topk(torch.softmax(logits.float(), -1), k, -1).indices.numpy()[real]
        counts = np.bincount(chosen.reshape(-1), minlength=experts)
        np.testing.assert_array_equal(stats["expert_counts"][layer], counts)

    # The loss adds router_aux_loss_coef x aux, as HF's does.
    loss, sums = model.loss_fn(params, batch, None)
    assert "moe_expert_counts" in sums
    np.testing.assert_allclose(
        float(sums["moe_aux_loss_sum"] / sums["weight_sum"]), float(out.aux_loss), rtol=1e-5
    )


@family_params
def test_greedy_generation_is_hf_generate(family, root):
    torch_model, fused, _ = tiny_hf_moe(family, root)
    model, params = hf.from_pretrained(fused)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (11, 4, 17)]
    ours = flaxlm_greedy_batch(model, params, prompts, GREEDY_TOKENS)
    assert ours == hf_greedy_batch(torch_model, prompts, GREEDY_TOKENS)


@family_params
def test_export_is_what_transformers_saves_and_reloads(family, root, tmp_path):
    torch_model, fused, per_expert = tiny_hf_moe(family, root)
    model, params = hf.from_pretrained(fused)
    out = tmp_path / "export"
    hf.save_pretrained(model, params, out)
    # The tensors transformers' save_pretrained writes, by name and shape.
    assert _stored_shapes(str(out)) == _stored_shapes(per_expert)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(reloaded) is type(torch_model)
    ids, mask = padded_batch(VOCAB, (12, 7, 12, 3))
    ours = np.asarray(jax.jit(model.compute_logits)(params, decoder_batch(ids, mask)))
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, again, mask) < LOGITS_TOL
    exported = json.loads((out / "config.json").read_text())
    for key in ("num_experts_per_tok", "router_aux_loss_coef", "intermediate_size"):
        assert exported[key] == getattr(torch_model.config, key), key


@pytest.mark.parametrize(
    "config_cls, kwargs, field",
    [
        (mixtral.MixtralConfig, dict(norm_topk_prob=False), "norm_topk_prob"),
        (mixtral.MixtralConfig, dict(mlp_only_layers=(0,)), "mlp_only_layers"),
        (olmoe.OlmoeConfig, dict(clip_qkv=0.0), "clip_qkv"),
        (olmoe.OlmoeConfig, dict(shared_expert_intermediate_size=8), "shared_expert"),
        (olmoe.OlmoeConfig, dict(head_dim=64), "head_dim"),
    ],
    ids=str,
)
def test_settings_the_family_lacks_are_errors_naming_them(config_cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        config_cls(num_layers=2, **kwargs)


def _stored_names(path: str) -> list[str]:
    return list(_stored_shapes(path))


def _stored_shapes(path: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


# Published sizes (model cards): (all, active) params in billions, and the config class.
PUBLISHED = {
    "qwen3_moe_30b_a3b": (30.5, 3.3, qwen_moe.QwenMoeConfig),
    "qwen3_moe_235b_a22b": (235.0, 22.0, qwen_moe.QwenMoeConfig),
    "qwen2_moe_a2_7b": (14.3, 2.7, qwen_moe.QwenMoeConfig),
    "mixtral_8x7b": (46.7, 12.9, mixtral.MixtralConfig),
    "mixtral_8x22b": (141.0, 39.0, mixtral.MixtralConfig),
    "olmoe_1b_7b": (6.9, 1.3, olmoe.OlmoeConfig),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_gin_sizes_match_the_model_cards(name):
    total, active, config_cls = PUBLISHED[name]
    cfg = gin_config(REPO, name, config_cls)
    assert abs(cfg.num_params() / 1e9 - total) / total < 0.01, cfg.num_params()
    # The cards round the active count to two digits (1.3B is 1.25-1.35B: 4%).
    assert abs(cfg.active_params() / 1e9 - active) / active < 0.035, cfg.active_params()
    assert (
        cfg.flops_per_token(2048) > 6 * cfg.active_params() - 6 * cfg.vocab_size * cfg.hidden_size
    )


@pytest.mark.parametrize(
    "name, config_cls",
    [
        ("qwen3_moe_tiny", qwen_moe.QwenMoeConfig),
        ("qwen2_moe_tiny", qwen_moe.QwenMoeConfig),
        ("mixtral_tiny", mixtral.MixtralConfig),
        ("olmoe_tiny", olmoe.OlmoeConfig),
    ],
)
def test_tiny_gin_models_build(name, config_cls):
    model = DecoderOnlyModel(gin_config(REPO, name, config_cls))
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    assert shapes["layers_0"]["mlp"]["experts"]["wi"].shape[0] == model.config.num_experts
