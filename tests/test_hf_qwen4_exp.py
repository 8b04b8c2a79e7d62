"""Qwen4-Exp text from and to HuggingFace: every promise against transformers'
`Qwen4ExpForCausalLM` that flaxlm keeps (float32 logits of padded rows with each attention
implementation and on a mesh, HF `generate`'s greedy tokens, the export transformers
reloads: Gated DeltaNet and gated attention whose keys the QSA indexer picks with budgets
shorter than the rows, hyper-connections, PLE's hashed n-grams with their Hub shards,
experts with a shared expert), the multimodal `qwen4_exp` file's text tower, the exact
64-bit hashing, the serving engine's greedy tokens, config errors and the gin file."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from flaxlm.checkpoints import hf
from flaxlm.models import qwen4_exp, qwen4_exp_ple
from flaxlm.parallel.partitioning import Partitioner
from tests.hf_helpers import (
    GREEDY_TOKENS,
    MESHES,
    decoder_batch,
    engine_tokens,
    flaxlm_greedy_batch,
    gin_config,
    hf_greedy_batch,
    max_abs_diff,
    padded_batch,
    paged_engine,
    random_hf_model,
    save_torch_model,
    torch_logits,
)

VOCAB = 250
L, X = "linear_attention", "indexed_attention"
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    hc_count=2,
    hc_lowrank=8,
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=8,
    max_position_embeddings=64,
    initializer_range=0.1,  # sharp enough attention that positions visibly matter
    pad_token_id=0,
)
PLE = dict(
    ple_embed_dim=16,
    heads_per_ngram=2,
    ngram_vocab_size_base=50,
    make_ngram_vocab_size_divisible_by=8,
)
VARIANTS = {
    # PLE on both linear layers (3 Hub shards a table), 2 of the 12 complete blocks of 2
    # tokens a query, half of each head rotated.
    "ple_qsa": dict(
        COMMON,
        **PLE,
        layer_types=[L, X, L, X],
        ple_layer_ids=[1, 3],
        split_ngram_parts=3,
        indexer_budget=4,
        indexer_compress_ratio=2,
        eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    ),
    # No PLE; the sigmoid output gate, 3 streams, indexed attention first ('full_attention',
    # as the Hub's file spells it), single-token blocks, a tied head, linearly scaled rotary
    # over whole heads with the multimodal sections.
    "sigmoid_no_ple": dict(
        COMMON,
        layer_types=["full_attention", L, L, X],
        output_gate_type="sigmoid",
        hc_count=3,
        indexer_head_dim=16,
        indexer_budget=4,
        indexer_compress_ratio=1,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "linear",
            "factor": 2.0,
            "rope_theta": 1e3,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    ),
    # 4-grams of one head each, 5 uneven shards, a dilated convolution of 2 taps, 2 blocks
    # of 4 a query, an EOS id list whose first id occurs in the rows (the n-grams restart).
    "ngrams": dict(
        COMMON,
        **{**PLE, "ple_embed_dim": 12, "heads_per_ngram": 1},
        layer_types=[L, L, X, L],
        ple_layer_ids=[4, 1],
        ngram_size=4,
        ple_conv_kernel_size=2,
        seed=7,
        split_ngram_parts=5,
        indexer_budget=8,
        indexer_compress_ratio=4,
        eos_token_id=[int(padded_batch(VOCAB)[0][0, 3]), 1],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    ),
}
# (Where blocks tie at the k-th score, all heads' relu at 0, torch's topk picks among them in
# no specified order and flaxlm the earliest: these rows' real queries have no such tie.)
# HF starts these at constants (the (1 + w) norms and PLE's convolution at 0, the gated
# norm and dt_bias at 1).
PERTURBED = ("norm.weight", "layernorm.weight", "dt_bias", "conv1d.weight")
LENGTHS = (24, 13, 24, 6)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """variant -> (torch model, its saved directory), made once."""
    out = {}
    for name, kwargs in VARIANTS.items():
        model = random_hf_model(
            transformers.Qwen4ExpTextConfig, transformers.Qwen4ExpForCausalLM, PERTURBED, **kwargs
        )
        out[name] = model, save_torch_model(model, tmp_path_factory.mktemp(name))
    return out


def check_logits_and_export(torch_model, path, out, implementations=(), meshes=()) -> float:
    """float32 logits within 1e-4 of HF's on padded rows (each implementation, each mesh);
    the export reloads in transformers with no missing or unexpected keys (PLE's buffers
    and shards included) to the same logits. Returns the largest difference."""
    ids, mask = padded_batch(VOCAB, LENGTHS)
    batch = decoder_batch(ids, mask)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    model, params = hf.from_pretrained(path)
    ours = np.asarray(jax.jit(model.compute_logits)(params, batch))
    worst = max_abs_diff(ours, theirs, mask)
    assert worst < 1e-4
    for implementation in implementations:
        config = dataclasses.replace(model.config, attention=implementation, attention_chunk_size=8)
        got = jax.jit(type(model)(config).compute_logits)(params, batch)
        assert max_abs_diff(got, theirs, mask) < 1e-4, implementation
    for mesh in meshes:
        sharded, sharded_params = hf.from_pretrained(path, Partitioner(mesh_shape=mesh))
        got = jax.jit(sharded.compute_logits)(sharded_params, batch)
        assert max_abs_diff(got, theirs, mask) < 1e-4, mesh

    hf.save_pretrained(model, params, out)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(reloaded) is type(torch_model)
    written, source = (
        load_file(str(out / "model.safetensors")),
        load_file(f"{path}/model.safetensors"),
    )
    assert sorted(written) == sorted(source)
    for name in source:
        if "ple_embedding" in name:  # the shards as HF chunks them, the buffers exactly
            np.testing.assert_array_equal(written[name], source[name], err_msg=name)
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, again, mask) <= 1e-5 * max(1.0, np.abs(again).max())
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_export_are_hfs(saved, tmp_path, variant):
    torch_model, path = saved[variant]
    # The kernels and a mesh once, on the first variant (each variant: its reading and math).
    heavy = variant == "ple_qsa"
    check_logits_and_export(
        torch_model,
        path,
        tmp_path / "export",
        implementations=("jax", "chunked") if heavy else (),
        meshes=MESHES[-1:] if heavy else (),
    )
    exported = transformers.AutoConfig.from_pretrained(str(tmp_path / "export"))
    for field in ("layer_types", "ple_layer_ids", "rope_parameters", "split_ngram_parts"):
        assert getattr(exported, field) == getattr(torch_model.config, field), field


def hf_greedy(torch_model, prompts, new_tokens: int = GREEDY_TOKENS) -> list[list[int]]:
    """`hf_greedy_batch` with no EOS in the generation config: HF's `min_new_tokens` would
    forbid PLE's EOS (the model's config keeps it)."""
    eos = torch_model.generation_config.eos_token_id
    torch_model.generation_config.eos_token_id = None
    try:
        return hf_greedy_batch(torch_model, prompts, new_tokens)
    finally:
        torch_model.generation_config.eos_token_id = eos


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ngrams", "sigmoid_no_ple"])
def test_greedy_tokens_are_hf_generates(saved, variant):
    """HF `generate`'s greedy tokens from left-padded prompts of mixed lengths, decoded over
    the contiguous cache: the indexer's keys, the PLE n-gram context and its convolution's
    inputs, the Gated DeltaNet states carried between steps. (HF's `min_new_tokens` would
    forbid PLE's EOS: its generation config has none.)"""
    torch_model, path = saved[variant]
    model, params = hf.from_pretrained(path)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (11, 4, 17)]
    assert flaxlm_greedy_batch(model, params, prompts) == hf_greedy(torch_model, prompts)


@pytest.mark.slow
def test_greedy_through_the_engines_pages_and_state_slots_is_hf_generate(saved):
    """The serving engine (pages of 4 slots, prefill chunks of 8): rows joining and leaving,
    a follower of an identical prompt (its state slot copied), then prompts resumed from the
    prefix cache's pages (the indexer's keys among them) and state snapshots (the Gated
    DeltaNet's, PLE's n-gram context and convolution inputs): HF's greedy tokens."""
    torch_model, path = saved["ple_qsa"]
    model, params = hf.from_pretrained(path, Partitioner(devices=jax.devices()[:1]))
    assert model.paged_refusal() is None
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (7, 5, 8, 6)]
    prompts.insert(2, prompts[0])
    later = [
        prompts[0][:4] + [5, 6, 7],
        prompts[1][:4] + [8, 9],
        rng.integers(1, VOCAB, 6).tolist(),
    ]
    expected = hf_greedy(torch_model, prompts + later, 10)
    with paged_engine(model, params) as engine:
        assert engine_tokens(engine, prompts, 10) == expected[:5]
        assert engine.scheduler.cached_tokens == 0
        assert engine_tokens(engine, later, 10) == expected[5:]
        assert engine.scheduler.cached_tokens == 4 + 4
    with pytest.raises(ValueError, match="paged_attention"):
        model.paged_logits(
            params, model.paged_cache(4, 4, 1), *(np.zeros((1, 1), np.int32),) * 2,
            np.ones((1, 1), np.int32), np.zeros(1, np.int32), paged_attention="pallas",
            state_slots=np.ones(1, np.int32),
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ple_qsa", "ngrams"])
def test_packed_row_is_hfs_segments_read_apart(saved, variant):
    """Two examples packed in one row: each segment's logits are HF's of it alone (the
    indexer's blocks, PLE's n-grams and its convolution restart at the segment)."""
    torch_model, path = saved[variant]
    model, params = hf.from_pretrained(path)
    ids, _ = padded_batch(VOCAB, (24,), seed=5)
    segments = np.array([[1] * 15 + [2] * 9], np.int32)
    positions = np.concatenate([np.arange(15), np.arange(9)])[None].astype(np.int32)
    batch = dict(decoder_batch(ids, segments), decoder_positions=positions)
    ours = np.asarray(jax.jit(model.compute_logits)(params, batch))[..., :VOCAB]
    theirs = [torch_logits(torch_model, input_ids=x) for x in (ids[:, :15], ids[:, 15:])]
    assert np.abs(ours - np.concatenate(theirs, axis=1)).max() < 1e-4


@pytest.mark.slow
def test_multimodal_file_loads_its_text_tower(saved, tmp_path):
    """The Hub's `qwen4_exp` file: the text config under `text_config`, its tensors under
    `model.language_model.` beside a vision tower's and an MTP layer's: HF's logits."""
    torch_model, path = saved["ple_qsa"]
    tensors = {
        name.replace("model.", "model.language_model.", 1): array
        for name, array in load_file(f"{path}/model.safetensors").items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    tensors["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    text = torch_model.config.to_dict()
    config = {"model_type": "qwen4_exp", "text_config": text, "vision_config": {"depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, params = hf.from_pretrained(tmp_path)
    assert model.config.model_type == "qwen4_exp_text" and model.config.ple_layer_ids == (1, 3)
    ids, mask = padded_batch(VOCAB, LENGTHS)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    assert max_abs_diff(ours, theirs, mask) < 1e-4


def test_hash_is_int64_exact():
    """PLE's ids from 32-bit limbs are torch's int64 ones: products that wrap past 2**63
    (negative) and 2**64, XORs, floor remainders by each head's prime."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2**31 - 1, (2, 9)).astype(np.int64)
    tokens[0, :3] = (0, 1, 2**31 - 2)
    multipliers = (0x7FFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFF1, 0x9E3779B97F4A7C15)
    sizes = (2**28 - 57, 20_000_003, 7)

    def reference(row: list[int]) -> list[list[int]]:
        out = []
        for t in range(len(row)):
            mixed = 0
            for s, m in enumerate(multipliers):
                value = row[t - s] if t - s >= 0 else 1
                mixed ^= (value * m) & (2**64 - 1)
            signed = mixed - 2**64 if mixed >= 2**63 else mixed
            out.append([signed % p for p in sizes])
        return out

    limbs = qwen4_exp_ple._times(np.asarray(tokens[..., None], np.int32)[..., 0], multipliers[0])
    for s, m in enumerate(multipliers[1:], 1):
        shifted = np.pad(tokens, ((0, 0), (s, 0)), constant_values=1)[:, : tokens.shape[1]]
        limbs = [a ^ b for a, b in zip(limbs, qwen4_exp_ple._times(shifted, m), strict=True)]
    got = np.asarray(qwen4_exp_ple._mod(limbs, sizes))
    want = np.array([reference(row) for row in tokens.tolist()])
    np.testing.assert_array_equal(got, want)


def tiny_config(**overrides) -> qwen4_exp.Qwen4ExpConfig:
    fields = dict(
        vocab_size=128, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, hc_count=2,
        hc_lowrank=8, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=8,
        indexer_budget=4, indexer_compress_ratio=2, ple_layer_ids=(1, 3), ple_embed_dim=16,
        heads_per_ngram=2, ngram_vocab_size_base=50, eos_token_id=1,
        layer_types=(L, "full_attention", L, "full_attention"), partial_rotary_factor=0.5,
    )  # fmt: skip
    return qwen4_exp.Qwen4ExpConfig(**{**fields, **overrides})


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(model_type="qwen3_5_moe_text"), "model_type"),
        (dict(output_gate_type="gelu"), "output_gate_type"),
        (dict(hc_count=1), "hc_count"),
        (dict(hc_lowrank=0), "hc_lowrank"),
        (dict(indexer_budget=None), "indexer_budget"),
        (dict(indexer_kv_heads=2), "indexer_kv_heads"),
        (dict(indexer_budget=5), "indexer_budget"),
        (dict(indexer_head_dim=4), "indexer_head_dim"),
        (dict(indexer_compress_ratio=0), "indexer_compress_ratio"),
        (dict(ple_embed_dim=15), "ple_embed_dim"),
        (dict(ple_layer_ids=(2,)), "ple_layer_ids"),
        (dict(ple_layer_ids=(5,)), "ple_layer_ids"),
        (dict(eos_token_id=None), "eos_token_id"),
        (dict(split_ngram_parts=0), "split_ngram_parts"),
        (dict(ple_conv_kernel_size=0), "ple_conv_kernel_size"),
        (dict(ngram_vocab_size_base=2**28), "ngram_vocab_size_base"),
        (dict(num_experts=0), "num_experts"),
        (dict(mlp_only_layers=(1,)), "mlp_only_layers"),
        (dict(num_mtp_layers=1), "num_mtp_layers"),
        (dict(scan_layers=True), "scan_layers"),
        (dict(linear_num_value_heads=3), "linear_num_value_heads"),
        (dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
    ],
    ids=str,
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**kwargs)


def test_gin_file_builds_its_config_with_transformers_parameter_count(repo_dir):
    """gin/models/qwen4_exp_tiny.gin: transformers' Qwen4ExpForCausalLM of its exported
    config.json counts 1,996,664 parameters (on the meta device), the padded vocabulary's
    rows beside them."""
    config = gin_config(repo_dir, "qwen4_exp_tiny", qwen4_exp.Qwen4ExpConfig)
    assert config.per_layer_types[-1] == "full_attention" and config.ple_layers == (0, 2)
    padding = (config.vocab_size - config.real_vocab_size) * config.hidden_size
    assert config.num_params() == 1_996_664 + padding
