"""DeepSeek-V3 (and Kimi K2) from and to HuggingFace: logits, the router's choices, greedy
generation from the latent KV cache, export, the Hub's block-FP8 files, the latent cache's
size, and the published sizes.

Two tiny random models of transformers' `DeepseekV3ForCausalLM`: one with every DeepSeek-V3
feature on (a query latent, interleaved rotary with YaRN's mscale, a dense first layer,
group-limited sigmoid routing with a nonzero correction bias, a shared expert, value heads
narrower than query/key heads) and one with the other branches (plain `q_proj`, attention
biases, half-split rotary, every layer sparse so the layers scan).
"""

import collections
import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import traverse_util
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from flaxlm.checkpoints import fp8, hf, hf_files
from flaxlm.models import deepseek, hf_spec, masks, mla, routing
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
    train_on_batch,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 120
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
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    max_position_embeddings=96,
    initializer_range=0.1,
    n_shared_experts=1,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF's min_new_tokens would otherwise forbid one
)
FULL = dict(
    COMMON,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    q_lora_rank=24,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    # Past the original 32 positions, with mscale_all_dim != mscale: both YaRN factors count.
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=3.0,
        original_max_position_embeddings=32,
        mscale=1.0,
        mscale_all_dim=0.8,
    ),
)
PLAIN = dict(
    COMMON,
    num_hidden_layers=2,
    first_k_dense_replace=0,
    q_lora_rank=None,
    attention_bias=True,
    rope_interleave=False,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.5,
)
# float32 logits of a 2-layer model whose values are O(1): rounding in other summation orders
# is ~eps (1.2e-7) x sqrt(width) x depth ~ 1e-6 (1.1e-6 seen); 1e-4 leaves a margin (and is
# what every family meets).
LOGITS_TOL = 1e-4
ONE = Partitioner(devices=jax.devices()[:1])


def tiny_hf_deepseek(**kwargs):
    """A random tiny `DeepseekV3ForCausalLM` whose norms, biases and correction biases are
    perturbed too (HF starts them at 1 and 0); the correction bias (a buffer) at the scale of
    the sigmoid scores, so it changes which experts are chosen."""
    model = random_hf_model(
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        ("norm.weight", "layernorm.weight", ".bias"),
        **kwargs,
    )
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    return model


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """(torch model, its save_pretrained directory, flaxlm model, params), the params
    placed by a one-device `ONE` partitioner (as the serving engine takes them; sharding
    tiny arrays over 8 CPU devices would only slow decoding)."""
    torch_model = tiny_hf_deepseek(**FULL)
    path = str(tmp_path_factory.mktemp("deepseek_full"))
    torch_model.save_pretrained(path)
    model, params = hf.from_pretrained(path, ONE)
    return torch_model, path, model, params


@pytest.mark.slow
def test_logits_are_hf_logits(full):
    torch_model, _, model, params = full
    assert isinstance(model.config, deepseek.DeepseekV3Config)
    assert model.config.sparse_layers(2) == (False, True)
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    assert max_abs_diff(ours, theirs, mask) < LOGITS_TOL


def test_other_branches_scanned_on_a_mesh_give_hf_logits(tmp_path):
    # FSDP x tensor: the latents' `embed`-named dims split, the heads split.
    torch_model = tiny_hf_deepseek(**PLAIN)
    torch_model.save_pretrained(tmp_path)
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    model, params = hf.from_pretrained(
        str(tmp_path), Partitioner((1, 2, 2), devices=jax.devices()[:4]), scan_layers=True
    )
    assert model.config.q_lora_rank is None and not model.config.rope_interleave
    assert "q_proj" in params["layers"]["block"]["self_attn"]
    got = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    assert max_abs_diff(got, theirs, mask) < LOGITS_TOL


@pytest.mark.slow
def test_moe_layers_scanned_after_the_dense_ones_give_hf_logits_tokens_and_files(tmp_path):
    """`scan_layers` with dense first layers (DeepSeek-V3's three, as MaxText scans it): the
    dense ones unrolled (`layers_0`), the MoE ones one stack (`layers`, 3 deep): HF's logits,
    its greedy tokens (decoding unrolls the stack) and files HF reloads with the same logits
    (its training: `test_tiny_gin_trains_with_an_mtp_loss`)."""
    torch_model = tiny_hf_deepseek(**dict(FULL, num_hidden_layers=4))
    torch_model.save_pretrained(tmp_path / "hf")
    model, params = hf.from_pretrained(str(tmp_path / "hf"), ONE, scan_layers=True)
    assert model.config.first_scanned_layer == 1
    assert sorted(k for k in params if k.startswith("layers")) == ["layers", "layers_0"]
    assert "experts" not in params["layers_0"]["mlp"]
    assert params["layers"]["block"]["mlp"]["experts"]["wi"].shape[0] == 3
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    batch = decoder_batch(ids, mask)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(jax.jit(model.compute_logits)(params, batch), theirs, mask) < LOGITS_TOL

    prompts = [[5, 17, 3, 99, 42], [7, 8]]
    want = hf_greedy_batch(torch_model, prompts, GREEDY_TOKENS)
    assert flaxlm_greedy_batch(model, params, prompts, GREEDY_TOKENS) == want

    hf.save_pretrained(model, params, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(again, theirs, mask) <= 1e-6 * max(1.0, np.abs(theirs).max())


def test_router_chooses_hf_experts_with_hf_weights(full):
    """`routing.route` on HF's router logits picks the experts HF's `DeepseekV3TopkRouter`
    picks (the correction bias and the expert groups moving the choice) with its weights."""
    torch_model, _, model, params = full
    captured = []
    gate = torch_model.model.layers[1].mlp.gate
    handle = gate.register_forward_hook(lambda m, i, out: captured.append(out))
    ids, mask = padded_batch(VOCAB, (12, 7, 12, 3))
    torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    handle.remove()
    logits, hf_weights, hf_ids = (t.numpy() for t in captured[0])
    cfg = model.config
    bias = params["layers_1"]["mlp"]["e_score_correction_bias"]
    np.testing.assert_array_equal(bias, gate.e_score_correction_bias.numpy())
    weights, chosen = routing.route(
        jnp.asarray(logits), cfg.num_experts_per_tok, cfg.router, cfg.norm_topk_prob,
        correction_bias=bias, n_group=cfg.n_group, topk_group=cfg.topk_group,
        scaling_factor=cfg.routed_scaling_factor,
    )  # fmt: skip
    # Without the bias (or the groups), some tokens would choose other experts.
    plain = routing.route(jnp.asarray(logits), cfg.num_experts_per_tok, cfg.router, True)[1]
    assert (np.sort(plain, -1) != np.sort(chosen, -1)).any()
    order, hf_order = np.argsort(chosen, -1), np.argsort(hf_ids, -1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(chosen), order, -1), np.take_along_axis(hf_ids, hf_order, -1)
    )
    # Sigmoid scores of O(1) renormalised and scaled by 2.5: float32 rounding ~1e-7.
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), order, -1),
        np.take_along_axis(hf_weights, hf_order, -1),
        rtol=1e-6,
    )


@pytest.mark.slow
def test_greedy_from_the_latent_cache_is_hf_generate_the_full_cache_and_the_engine(full):
    """Decoding steps attend over the cached latents with kv_b_proj absorbed; the same
    tokens as HF's generate, as a cache of full keys and values, and as the serving engine's
    paged latent cache (pages of the latent and the rotary key: the engine pages MLA)."""
    torch_model, _, model, params = full
    rng = np.random.default_rng(3)
    # The longest runs to 31 positions past the original context of 32 (YaRN's range).
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (11, 4, 23)]
    latent = flaxlm_greedy_batch(model, params, prompts, GREEDY_TOKENS)
    assert latent == hf_greedy_batch(torch_model, prompts, GREEDY_TOKENS)
    full_cache = type(model)(dataclasses.replace(model.config, mla_cache="full"))
    assert flaxlm_greedy_batch(full_cache, params, prompts, GREEDY_TOKENS) == latent

    assert model.paged_refusal() is None
    assert engine_greedy(model, params, prompts, GREEDY_TOKENS) == latent


def test_latent_cache_holds_576_values_per_token_against_40960(full):
    """DeepSeek-V3's decoding cache per token and layer from the cache's shapes (one layer
    of the 671B gin's attention): 512 + 64 latent values against 128 heads x (192 + 128) for
    full keys and values, 71x fewer bytes; and the tiny model's cache has the latent's
    shapes."""
    cfg = gin_config(REPO, "deepseek_v3", deepseek.DeepseekV3Config)
    cfg = dataclasses.replace(cfg, num_layers=1, mlp_only_layers=(0,))
    batch, slots = 2, 16

    def cache_shapes(config):
        where = masks.Decoding(jnp.int32(0), jnp.zeros((batch,), jnp.int32), slots)
        tokens = jnp.zeros((batch, slots), jnp.int32)
        init = lambda: config.make_module().init(  # noqa: E731
            jax.random.PRNGKey(0), tokens, None, None, decoding=where
        )["cache"]
        return jax.tree.leaves(jax.eval_shape(init))

    per_token = {}
    for kind in mla.MLA_CACHES:
        leaves = cache_shapes(dataclasses.replace(cfg, mla_cache=kind))
        values = sum(int(np.prod(leaf.shape)) for leaf in leaves) // (batch * slots)
        per_token[kind] = (values, sum(leaf.size * leaf.dtype.itemsize for leaf in leaves))
        assert values == mla.cache_values_per_token(dataclasses.replace(cfg, mla_cache=kind))
    assert per_token["latent"][0] == 576 and per_token["full"][0] == 40960
    assert per_token["full"][1] / per_token["latent"][1] == pytest.approx(40960 / 576)

    _, _, model, _ = full
    leaves = cache_shapes(model.config)
    tiny = model.config
    assert sorted(leaf.shape for leaf in leaves) == sorted(
        [(batch, 1, slots, tiny.kv_lora_rank), (batch, 1, slots, tiny.qk_rope_head_dim)] * 2
    )


def test_export_is_what_transformers_reloads(full, tmp_path):
    torch_model, path, model, params = full
    hf.save_pretrained(model, params, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names  # the Hub's spelling
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(reloaded) is type(torch_model)
    ids, mask = padded_batch(VOCAB, (12, 7, 12, 3))
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(again, theirs, mask) <= 1e-6 * max(1.0, np.abs(theirs).max())
    exported = json.loads((tmp_path / "config.json").read_text())
    for key in ("n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace"):
        assert exported[key] == getattr(torch_model.config, key), key


def test_kimi_k2_and_mtp_layers_load_as_deepseek_v3(full, tmp_path):
    """Kimi K2's config.json names `kimi_k2`; DeepSeek-V3's files carry a multi-token-
    prediction layer `model.layers.61` that is skipped. Both only change the reading."""
    _, path, model, params = full
    config = json.loads(open(os.path.join(path, "config.json")).read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.61.eh_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    kimi, kimi_params = hf.from_pretrained(str(tmp_path))
    assert kimi.config == model.config
    assert jax.tree.all(jax.tree.map(np.array_equal, kimi_params, params))


# Smaller than the tiny shapes and not square; 16 does not divide q_a_proj's 24 rows nor
# kv_b_proj's 88, 12 not o_proj's 40 columns: the far blocks are cut short both ways.
FP8_BLOCK = (16, 12)
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value


def fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` as the Hub's DeepSeek-V3 files store it: float8_e4m3fn values and a float32
    `weight_scale_inv` per FP8_BLOCK block, each block's largest |value| mapped to 448."""
    (rows, cols), (br, bc) = weight.shape, FP8_BLOCK
    scales = torch.empty(math.ceil(rows / br), math.ceil(cols / bc))
    values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = weight[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            scales[i, j] = part.abs().max() / E4M3_MAX
            values[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = part / scales[i, j]
    return values, scales


def is_fp8_in_the_hub_files(name: str, tensor: torch.Tensor) -> bool:
    """Every Linear's weight but the head's and the router's (`mlp.gate`)."""
    keep = ("model.embed_tokens.", "lm_head.")
    return tensor.ndim == 2 and not name.startswith(keep) and not name.endswith("mlp.gate.weight")


@pytest.fixture(scope="module")
def hub_fp8(full, tmp_path_factory):
    """The `full` model's weights block-quantized to FP8 and saved as the Hub stores them
    (weight + weight_scale_inv, quantization_config in config.json): (that directory, the
    transformers model whose weights are their `_dequantize_fp8_weight`, those tensors)."""
    _, path, _, _ = full
    config = json.loads(open(os.path.join(path, "config.json")).read())
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    stored, dequantized = dict(tensors), {}
    for name, tensor in tensors.items():
        if is_fp8_in_the_hub_files(name, tensor):
            values, scales = fp8_blocks(tensor)
            stored[name], stored[name + "_scale_inv"] = values, scales
            dequantized[name] = _dequantize_fp8_weight(values, scales, FP8_BLOCK, torch.float32)
    quantization = dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=FP8_BLOCK
    )
    fp8_dir, plain_dir = (tmp_path_factory.mktemp(n) for n in ("deepseek_fp8", "dequantized"))
    for out, config_json, weights in (
        (fp8_dir, {**config, "quantization_config": quantization}, stored),
        (plain_dir, config, {**tensors, **dequantized}),
    ):
        (out / "config.json").write_text(json.dumps(config_json))
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(plain_dir), attn_implementation="eager"
    ).eval()
    return fp8_dir, reference, dequantized


def test_fp8_weights_import_as_transformers_dequantizes_them(hub_fp8):
    """float32 params are `_dequantize_fp8_weight`'s float32 tensors bit for bit (the same
    product of an exact e4m3 value and a float32 scale, rounded once). bfloat16 params are
    that product rounded to bfloat16, as transformers' dequantize-on-load casts it, which is
    within one bfloat16 rounding of `_dequantize_fp8_weight` in bfloat16 (that rounds the
    scale to bfloat16 before the product)."""
    path, _, dequantized = hub_fp8
    ragged = [t.shape for t in dequantized.values() if t.shape[0] % 16 and t.shape[1] % 12]
    # 2 x 5 attention projections, the dense MLP's 3, 8 experts' 3 and the shared expert's 3.
    assert ragged and len(dequantized) == 40
    model, params = hf.from_pretrained(str(path), ONE)
    ours = dict(hf.hf_state_dict(model, params))
    for name, theirs in dequantized.items():
        np.testing.assert_array_equal(ours[name], theirs.numpy(), err_msg=name)

    model, params = hf.from_pretrained(str(path), ONE, dtype=jnp.bfloat16)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name, got in hf.hf_state_dict(model, params):
            if name not in dequantized:
                continue
            want = dequantized[name].to(torch.bfloat16).float().numpy()
            np.testing.assert_array_equal(got.astype(np.float32), want, err_msg=name)
            weight, scale = (f.get_tensor(name + s) for s in ("", "_scale_inv"))
            in_bf16 = _dequantize_fp8_weight(weight, scale, FP8_BLOCK, torch.bfloat16)
            ulp = np.spacing(np.abs(want).astype(jnp.bfloat16)).astype(np.float32)
            assert (np.abs(in_bf16.float().numpy() - want) <= ulp).all(), name


def test_fp8_import_gives_the_logits_of_its_dequantized_weights(full, hub_fp8):
    path, reference, _ = hub_fp8
    model, params = hf.from_pretrained(str(path), ONE)
    assert model.config == full[2].config  # the quantization changes the reading only
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    theirs = torch_logits(reference, input_ids=ids, attention_mask=mask)
    ours = full[2].compute_logits(params, decoder_batch(ids, mask))  # its compiled logits
    assert max_abs_diff(ours, theirs, mask) < LOGITS_TOL


def test_fp8_rows_of_a_fused_tensor_are_those_of_the_whole(hub_fp8):
    """A part of a fused tensor (rows 5 to 21, across a block edge) reads dequantized with
    its blocks' scales, as the whole tensor's rows."""
    path, _, dequantized = hub_fp8
    reader = fp8.dequantized(hf_files.SafetensorsReader(path), path)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    assert name + "_scale_inv" not in reader.file_of
    np.testing.assert_array_equal(reader.read(name), dequantized[name].numpy())
    np.testing.assert_array_equal(reader.read(name, (5, 21)), dequantized[name][5:21].numpy())


def test_fp8_import_on_a_mesh_reads_each_shard_s_slice_only(hub_fp8, monkeypatch):
    """On 8 devices splitting the experts, the embed and the MLP dims (at rows and columns
    that are no multiple of the 16 x 12 blocks), each device shard reads only its part of an
    FP8 weight (and of its experts' pieces only theirs), and the params are the whole
    tensors' dequantization bit for bit (the one-device import's)."""
    path, _, dequantized = hub_fp8
    _, whole = hf.from_pretrained(str(path), ONE)
    read_elements = collections.Counter()
    plain_read = hf_files.SafetensorsReader.read

    def counted(self, name, rows=None, box=None):
        array = plain_read(self, name, rows, box)
        read_elements[name] += array.size
        return array

    monkeypatch.setattr(hf_files.SafetensorsReader, "read", counted)
    mesh = Partitioner((1, 2, 2, 2), ("data", "fsdp", "expert", "tensor"))
    model, params = hf.from_pretrained(str(path), mesh)
    assert jax.tree.all(jax.tree.map(np.array_equal, params, whole))
    flat = traverse_util.flatten_dict(params, sep="/")
    kernel, experts = flat["layers_0/mlp/gate_proj/kernel"], flat["layers_1/mlp/experts/wi"]
    assert all(a < b for a, b in zip(kernel.sharding.shard_shape(kernel.shape), kernel.shape))
    assert experts.sharding.shard_shape(experts.shape)[0] < experts.shape[0]

    # What the 8 shards hold, replicas counted: no FP8 weight is read more than that.
    names = hf_spec.expand(hf.spec_for_config(model.config).tensors(model.config), None)
    for param, (record, (name,), _) in names.items():
        if name in dequantized and not record.pieces:
            shards = 8 * math.prod(flat[param].sharding.shard_shape(flat[param].shape))
            assert 0 < read_elements[name] <= shards < 8 * dequantized[name].numel(), name
    # Each expert is on 4 of the 8 devices (expert axis 2): its pieces are read by those 4
    # only (each whole: an expert's own layout is not cut within it).
    for name in (n for n in dequantized if ".experts." in n):
        assert read_elements[name] == 4 * dequantized[name].numel(), name


@pytest.mark.parametrize(
    "change", [dict(fmt="e5m2"), dict(activation_scheme="tensorwise")], ids=lambda c: next(iter(c))
)
def test_fp8_settings_flaxlm_cannot_read_are_refused_naming_them(hub_fp8, tmp_path, change):
    path, _, _ = hub_fp8
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    os.symlink(path / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=f"{next(iter(change))} is {next(iter(change.values()))!r}"
    ):
        hf.from_pretrained(str(tmp_path), ONE)


def test_fp8_with_static_activation_scales_reads_its_dequantized_weights(full, tmp_path):
    """transformers' FP8 serialization with static activation quantization and one scale a
    tensor (`activation_scheme: static`, `weight_block_size: null`): each quantized weight's
    `activation_scale` is read past, the params are each value times its tensor's scale."""
    _, path, _, _ = full
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    stored, dequantized = dict(tensors), {}
    for name, tensor in tensors.items():
        if is_fp8_in_the_hub_files(name, tensor):
            scale = tensor.abs().max() / E4M3_MAX
            values = (tensor / scale).to(torch.float8_e4m3fn)
            stored[name], stored[name + "_scale_inv"] = values, scale.reshape(())
            stored[fp8.activation_scale_name(name)] = torch.tensor(0.5)
            dequantized[name] = values.float() * scale
    assert "model.layers.1.mlp.experts.0.up_proj.activation_scale" in stored
    config = json.loads(open(os.path.join(path, "config.json")).read())
    config["quantization_config"] = dict(
        quant_method="fp8", activation_scheme="static", weight_block_size=None
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model, params = hf.from_pretrained(str(tmp_path), ONE)
    ours = dict(hf.hf_state_dict(model, params))
    for name, theirs in dequantized.items():
        np.testing.assert_array_equal(ours[name], theirs.numpy(), err_msg=name)


# Published sizes (model cards): (all, active) params in billions and the tolerances their
# rounding allows: DeepSeek-V3's 671B and 37B; Kimi K2's "1T" and "32B" (1.03T and 32.9B).
PUBLISHED = {"deepseek_v3": (671.0, 37.0, 0.01), "kimi_k2": (1000.0, 32.0, 0.03)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_gin_sizes_match_the_model_cards(name):
    total, active, tol = PUBLISHED[name]
    cfg = gin_config(REPO, name, deepseek.DeepseekV3Config)
    assert abs(cfg.num_params() / 1e9 - total) / total < tol, cfg.num_params()
    # The cards round the active count to two digits.
    assert abs(cfg.active_params() / 1e9 - active) / active < 0.035, cfg.active_params()
    assert cfg.flops_per_token(4096) > 6 * (cfg.active_params() - cfg.vocab_size * cfg.hidden_size)


def test_tiny_gin_model_counts_its_params():
    model = DecoderOnlyModel(gin_config(REPO, "deepseek_v3_tiny", deepseek.DeepseekV3Config))
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    assert sum(x.size for x in jax.tree.leaves(shapes)) == model.config.num_params()
    moe = shapes["layers_1"]["mlp"]
    assert moe["experts"]["wi"].shape[0] == 8 and moe["e_score_correction_bias"].dtype == "float32"
    assert "experts" not in shapes["layers_0"]["mlp"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_group=3), "n_group"),
        (dict(topk_group=5), "topk_group"),
        (dict(n_group=8, topk_group=1, num_experts_per_tok=2), "topk_group"),
        (dict(mlp_only_layers=(1,)), "mlp_only_layers"),
        (dict(mla_cache="compressed"), "mla_cache"),
        (dict(router="topk_softmax"), "router"),
    ],
    ids=str,
)
def test_settings_that_cannot_be_are_errors_naming_them(kwargs, field):
    base = dict(num_layers=4, num_experts=8, num_experts_per_tok=2, mlp_only_layers=(0,))
    base.update(n_group=4, topk_group=2)
    with pytest.raises(ValueError, match=field):
        deepseek.DeepseekV3Config(**{**base, **kwargs})


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(quantization_config={"quant_method": "gptq"}), "quant_method is 'gptq'"),
    ],
    ids=str,
)
def test_configs_flaxlm_cannot_read_are_refused_naming_the_field(change, field):
    config = {**transformers.DeepseekV3Config(**FULL).to_dict(), **change}
    with pytest.raises(ValueError, match=field):
        deepseek.config_from_hf(config)


# ------------------------------------------------------------ multi-token prediction

MTP_DEPTHS = 2


@pytest.fixture(scope="module")
def with_mtp(full, tmp_path_factory):
    """The `full` checkpoint with two MTP layers as the Hub lays them out
    (`hf_helpers.save_with_mtp_layers`): (main torch model, MtpModel, directory)."""
    torch_model, path, _, _ = full
    out = tmp_path_factory.mktemp("deepseek_mtp")
    return (*save_with_mtp_layers(torch_model, path, out, MTP_DEPTHS), str(out))


@pytest.mark.slow
def test_mtp_layers_load_and_predict_as_transformers_mtp_model(with_mtp, tmp_path):
    """The Hub's MTP layers read (`num_mtp_layers`): each depth's logits are transformers'
    `MtpModel`'s; the MTP loss is the depths' mean cross-entropy on the targets k + 1 tokens
    on, times `mtp_loss_weight`; the export writes the layers back as it read them."""
    main, mtp_model, path = with_mtp
    model, params = hf.from_pretrained(path, ONE, num_mtp_layers=MTP_DEPTHS)
    assert sorted(k for k in params if k.startswith("mtp_")) == ["mtp_0", "mtp_1"]
    # Each MTP layer's params: transformers' (its correction bias, a buffer there, too).
    plain = dataclasses.replace(model.config, num_mtp_layers=0).num_params()
    own = [(n, t) for n, t in mtp_model.state_dict().items() if n.startswith("layers.")]
    assert model.config.num_params() - plain == sum(t.numel() for _, t in own)
    ids = np.random.default_rng(4).integers(1, VOCAB, (2, 17))
    want = hf_mtp_logits(main, mtp_model, torch.tensor(ids), MTP_DEPTHS)
    got = mtp_depth_logits(model, params, ids)
    assert len(got) == MTP_DEPTHS
    for k in range(MTP_DEPTHS):
        assert np.abs(got[k][..., :VOCAB] - want[k]).max() < LOGITS_TOL, k
    # Plain logits do not run the MTP layers (nothing is sown), and equal the main model's.
    logits = jax.jit(model.compute_logits)(params, decoder_batch(ids, np.ones_like(ids)))
    assert max_abs_diff(logits, torch_logits(main, input_ids=ids), np.ones_like(ids)) < LOGITS_TOL

    # The loss on rows ids[:, :-1] -> ids[:, 1:]: depth k predicts ids[i + k + 1].
    check_mtp_loss(model, params, ids, hf_mtp_logits(main, mtp_model, torch.tensor(ids[:, :-1]), 2))

    hf.save_pretrained(model, params, tmp_path / "export")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["num_nextn_predict_layers"] == MTP_DEPTHS
    again, again_params = hf.from_pretrained(tmp_path / "export", ONE, num_mtp_layers=MTP_DEPTHS)
    assert jax.tree.all(jax.tree.map(np.array_equal, again_params, params))


@pytest.mark.slow
def test_tiny_gin_trains_with_an_mtp_loss(tmp_path):
    """gin/models/deepseek_v3_tiny.gin with `num_mtp_layers` and `mtp_loss_weight` bound
    as a user's flags bind them, its MoE layers scanned after the dense first one:
    partitioned train steps lower both losses and report `mtp_loss`; the aux-loss-free
    balance moves the scanned layers' correction biases and the MTP layer's."""
    import gin

    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(
            [f"{REPO}/gin/models/deepseek_v3_tiny.gin"],
            ["deepseek.DeepseekV3Config.num_mtp_layers = 1",
             "deepseek.DeepseekV3Config.mtp_loss_weight = 0.3"],
        )  # fmt: skip
        config = deepseek.DeepseekV3Config()
    finally:
        gin.clear_config()
    config = dataclasses.replace(config, num_layers=3, vocab_size=128, scan_layers=True)
    model = DecoderOnlyModel(config)
    ids, mask = padded_batch(128, (16, 9, 16, 5))
    batch = decoder_batch(ids, mask)
    params = model.init_params(jax.random.PRNGKey(0), {k: v.shape for k, v in batch.items()})
    assert "mtp_0" in params and "layers_0" in params and "layers" in params
    partitioner = Partitioner(mesh_shape=(1, 4, 2))
    state, history = train_on_batch(model, params, partitioner, batch, steps=4, learning_rate=1e-2)
    assert history[-1]["loss"] < history[0]["loss"], history
    assert history[-1]["mtp_loss"] < history[0]["mtp_loss"], history
    assert config.correction_bias_update_rate > 0
    for scope in ("mtp_0", "layers"):  # each layer's bias moved (the stack's 2 rows each)
        bias = np.asarray(params[scope]["block"]["mlp"]["e_score_correction_bias"])
        moved = np.asarray(state.params[scope]["block"]["mlp"]["e_score_correction_bias"])
        changed = (moved != bias).reshape(-1, bias.shape[-1]).any(-1)
        assert bias.shape == moved.shape and changed.all(), scope


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(mtp_loss_weight=0.3), "num_mtp_layers"),
        (dict(num_mtp_layers=-1), "num_mtp_layers"),
    ],
)
def test_mtp_settings_that_cannot_be_are_errors_naming_them(kwargs, field):
    with pytest.raises(ValueError, match=field):
        deepseek.DeepseekV3Config(**kwargs)


def test_mtp_layers_asked_of_a_file_without_them_or_of_another_family_are_errors(full):
    _, path, _, _ = full
    with pytest.raises(ValueError, match=r"model\.layers\.2\.enorm\.weight.* is missing"):
        hf.from_pretrained(path, ONE, num_mtp_layers=1)
    from flaxlm.models import mistral4

    with pytest.raises(ValueError, match="num_mtp_layers"):
        mistral4.Mistral4Config(num_mtp_layers=1)
