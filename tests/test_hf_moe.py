"""Mixture-of-experts families from and to HuggingFace: logits, the router's choices and its
aux loss against transformers' PyTorch models, and the published sizes' parameter counts.

transformers 5 holds each layer's experts fused (`mlp.experts.gate_up_proj [E, 2F, D]`,
`down_proj [E, D, F]`); its `save_pretrained` writes them back per expert (the Hub's
spelling). flaxlm reads and writes the fused spelling; these tests save the checkpoint as
transformers holds it (`save_fused`).
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
from flaxlm.models import moe, qwen_moe
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.parallel.partitioning import Partitioner, standard_logical_axis_rules
from tests.hf_helpers import (
    MESHES,
    decoder_batch,
    flaxlm_greedy_batch,
    gin_config,
    hf_greedy_batch,
    max_abs_diff,
    padded_batch,
    random_hf_model,
    torch_logits,
)

GREEDY_TOKENS = 12  # past every prompt; fewer than hf_helpers' 30, for time
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
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    initializer_range=0.1,
)
FAMILIES = {
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(head_dim=8, norm_topk_prob=True),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(shared_expert_intermediate_size=24, norm_topk_prob=False),
    ),
}


def save_fused(torch_model, path) -> str:
    """The model's config and its state dict as transformers 5 holds it (experts fused)."""
    os.makedirs(path, exist_ok=True)
    torch_model.config.save_pretrained(str(path))
    state = {k: v.contiguous() for k, v in torch_model.state_dict().items()}
    if torch_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(str(path), "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def tiny_hf_moe(tmp_path, family):
    config_cls, model_cls, extra = FAMILIES[family]
    model = random_hf_model(config_cls, model_cls, ("norm.weight", ".bias"), **COMMON, **extra)
    return model, save_fused(model, tmp_path / "hf")


def check_moe_family(torch_model, path, tmp_path) -> None:
    """`hf_helpers.check_family`'s promises for a mixture of experts: float32 logits within
    1e-4 unsharded and on its meshes (the second scanned), greedy generation token-identical
    to HF `generate`, export -> transformers reload with no missing or unexpected keys.

    Local because the Partitioner's standard rules do not yet name the logical axis `expert`
    (the experts' weights): here it is added, replicated."""
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    batch = decoder_batch(ids, mask)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    model, params = hf.from_pretrained(path)
    ours = np.asarray(model.compute_logits(params, batch))
    assert max_abs_diff(ours, theirs, mask) < 1e-4
    # One mesh, scanned layers (check_family's second): the unscanned one adds compile time
    # and nothing MoE-specific.
    rules = (*standard_logical_axis_rules(), ("expert", None))
    partitioner = Partitioner(mesh_shape=MESHES[-1], logical_axis_rules=rules)
    sharded, sharded_params = hf.from_pretrained(path, partitioner, scan_layers=True)
    got = sharded.compute_logits(sharded_params, batch)
    assert max_abs_diff(got, theirs, mask) < 1e-4

    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (11, 4, 17)]
    ours_greedy = flaxlm_greedy_batch(model, params, prompts, GREEDY_TOKENS)
    assert ours_greedy == hf_greedy_batch(torch_model, prompts, GREEDY_TOKENS)

    out = tmp_path / "export"
    hf.save_pretrained(model, params, out)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(reloaded) is type(torch_model)
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, again, mask) <= 1e-5 * max(1.0, np.abs(again).max())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpoint_keeps_every_promise(tmp_path, family):
    torch_model, path = tiny_hf_moe(tmp_path, family)
    check_moe_family(torch_model, path, tmp_path)
    check_router(torch_model, path)
    with open(tmp_path / "export" / "config.json") as f:
        exported = json.load(f)
    for key in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
        assert exported[key] == getattr(torch_model.config, key), key


def check_router(torch_model, path) -> None:
    """The same top-k experts as HF's router at every real token and layer, and the same
    aux loss as HF's `output_router_logits=True` (added to the loss with its coefficient)."""
    ids, mask = padded_batch(VOCAB, (12, 7, 12, 3))
    with torch.no_grad():
        out = torch_model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            output_router_logits=True,
        )
    model, params = hf.from_pretrained(path)
    batch = decoder_batch(ids, mask)
    _, sown = model.module.apply(
        {"params": params},
        batch["decoder_input_tokens"],
        batch["decoder_positions"],
        batch["decoder_segment_ids"],
        mutable=[moe.ROUTER_COLLECTION],
    )
    stats = moe.collect_router_stats(sown[moe.ROUTER_COLLECTION])
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
    aux = moe.router_losses(stats, experts, k)["aux"]
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


# Published sizes (model cards): (all, active) params in billions.
PUBLISHED = {
    "qwen3_moe_30b_a3b": (30.5, 3.3),
    "qwen3_moe_235b_a22b": (235.0, 22.0),
    "qwen2_moe_a2_7b": (14.3, 2.7),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_gin_sizes_match_the_model_cards(name):
    cfg = gin_config(REPO, name, qwen_moe.QwenMoeConfig)
    total, active = PUBLISHED[name]
    assert abs(cfg.num_params() / 1e9 - total) / total < 0.01, cfg.num_params()
    assert abs(cfg.active_params() / 1e9 - active) / active < 0.035, cfg.active_params()
    assert (
        cfg.flops_per_token(2048) > 6 * cfg.active_params() - 6 * cfg.vocab_size * cfg.hidden_size
    )


def test_tiny_gin_models_build():
    for name in ("qwen3_moe_tiny", "qwen2_moe_tiny"):
        model = DecoderOnlyModel(gin_config(REPO, name, qwen_moe.QwenMoeConfig))
        shapes = jax.eval_shape(
            lambda m=model: m.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
        )
        assert shapes["layers_0"]["mlp"]["experts"]["wi"].shape[0] == model.config.num_experts
