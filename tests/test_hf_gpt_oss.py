"""gpt-oss from and to HuggingFace: a tiny random `GptOssForCausalLM` whose experts are stored
in MXFP4 as the Hub's files store them (`*_blocks`, `*_scales`), loaded by transformers (its
own dequantization) as the reference and by flaxlm: logits, the router's choices, sharded and
scanned with the experts split, greedy generation past the sliding window, paged decoding,
export (unquantized experts) and the published sizes. Attention sinks are checked against a
textbook softmax in every attention path, the clamped SwiGLU experts against HF's module.
"""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from flaxlm.checkpoints import hf, mxfp4
from flaxlm.models import attention, experts, gpt_oss, masks, routing
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import lora
from tests.hf_helpers import (
    decoder_batch,
    flaxlm_greedy_batch,
    gin_config,
    hf_greedy_batch,
    max_abs_diff,
    padded_batch,
    random_hf_model,
    torch_logits,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 120
WINDOW = 4  # every other layer sees the 4 latest positions: the prompts below are longer
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=32,  # MXFP4 groups 32 values: one group a row
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    max_position_embeddings=64,  # YaRN's factor x its original context
    initializer_range=0.1,
    swiglu_limit=1.0,  # low enough that the clamps bite at this scale
    rope_parameters=dict(
        rope_type="yarn",
        factor=4.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=16,  # the batches run past it
        rope_theta=150000.0,
    ),
)
# float32 logits O(1) of a 2-layer model: rounding in other summation orders is ~eps (1.2e-7)
# x sqrt(width) x depth x scale ~ 1e-5; 1e-4 leaves a margin.
LOGITS_TOL = 1e-4
LENGTHS = (24, 13, 24, 6)


def mxfp4_experts(torch_model, rng) -> dict[str, torch.Tensor]:
    """Random MXFP4 blocks and scales for every layer's two expert weights (`{name}_blocks`,
    `{name}_scales`, the Hub's layout); the torch model's experts set to their values."""
    cfg = torch_model.config
    e, d, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    out = {}
    for i, layer in enumerate(torch_model.model.layers):
        for proj, rows, cols in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
            blocks = rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
            scales = rng.integers(121, 125, (e, rows, cols // 32), dtype=np.uint8)  # 2^-6..2^-3
            blocks, scales = torch.from_numpy(blocks), torch.from_numpy(scales)
            with torch.no_grad():
                values = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                getattr(layer.mlp.experts, proj).copy_(values)
            name = f"model.layers.{i}.mlp.experts.{proj}"
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(reference, MXFP4 directory, float directory): a random tiny gpt-oss whose experts are
    MXFP4 values, saved as the Hub stores it (MXFP4 experts, `quantization_config`) and as
    transformers' `save_pretrained` writes it (float32); the reference is transformers'
    model loaded from the MXFP4 directory (its own dequantization)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    model = random_hf_model(
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        ("norm.weight", ".bias", "_bias"),
        **CONFIG,
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks))
    quantized = mxfp4_experts(model, np.random.default_rng(0))
    float_dir, mx_dir = str(root / "float"), str(root / "mxfp4")
    model.save_pretrained(float_dir)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state = {k: v for k, v in state.items() if f"{k}_blocks" not in quantized} | quantized
    os.makedirs(mx_dir)
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(mx_dir, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(state, os.path.join(mx_dir, "model.safetensors"), metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(mx_dir, dtype=torch.float32)
    for ours, theirs in zip(model.model.layers, reference.model.layers, strict=True):
        for proj in ("gate_up_proj", "down_proj"):  # transformers dequantized the MXFP4 files
            assert torch.equal(getattr(ours.mlp.experts, proj), getattr(theirs.mlp.experts, proj))
    return reference.eval(), mx_dir, float_dir


@pytest.fixture(scope="module")
def imported(checkpoints):
    _, mx_dir, _ = checkpoints
    return hf.from_pretrained(mx_dir)


# ---------------------------------------------------------------- MXFP4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantization_is_transformers(dtype):
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 10, 4), dtype=np.uint8)
    want = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype
    )
    got = mxfp4.dequantize(blocks, scales)
    assert got.shape == tuple(want.shape) == (3, 128, 10)
    np.testing.assert_array_equal(got.astype(np.float32), want.float().numpy())  # exact


def test_mxfp4_and_float_files_import_the_same_params(checkpoints, imported):
    _, _, float_dir = checkpoints
    _, params = imported
    _, from_float = hf.from_pretrained(float_dir)
    jax.tree.map(np.testing.assert_array_equal, params, from_float)


# ---------------------------------------------------------------- the family against HF


def test_logits_router_choices_and_aux_loss_are_hf(checkpoints, imported):
    reference, _, _ = checkpoints
    model, params = imported
    ids, mask = padded_batch(VOCAB, LENGTHS)
    with torch.no_grad():
        out = reference(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            output_router_logits=True,
        )
    batch = decoder_batch(ids, mask)
    apply = functools.partial(model.module.apply, mutable=[routing.ROUTER_COLLECTION])
    logits, sown = jax.jit(apply)(
        {"params": params},
        batch["decoder_input_tokens"],
        batch["decoder_positions"],
        batch["decoder_segment_ids"],
    )
    assert max_abs_diff(logits, out.logits.numpy(), mask) < LOGITS_TOL
    stats = routing.collect_router_stats(sown[routing.ROUTER_COLLECTION])
    k, e = model.config.num_experts_per_tok, model.config.num_experts
    real = mask.reshape(-1).astype(bool)
    for layer, router_logits in enumerate(out.router_logits):  # the router's bias included
        chosen = torch.topk(router_logits, k, -1).indices.numpy()[real]
        counts = np.bincount(chosen.reshape(-1), minlength=e)
        np.testing.assert_array_equal(stats["expert_counts"][layer], counts)
    # A sum of E products of O(1/E) means over ~60 tokens: float32 rounding ~1e-7.
    aux = routing.router_losses(stats, e, k)["aux"]
    np.testing.assert_allclose(float(aux), float(out.aux_loss), rtol=1e-5)


@pytest.mark.slow
def test_chunked_scanned_and_expert_split_give_hf_logits(checkpoints):
    """One compile for what placement adds: layers scanned (their windows looked up per
    layer), 'chunked' attention in blocks of 8 with the sinks, experts (and their biases)
    split over a 2-way 'expert' axis, heads (and their sinks) over 'tensor'; cuDNN's 'jax'
    cannot take sinks and is refused naming itself."""
    reference, mx_dir, _ = checkpoints
    ids, mask = padded_batch(VOCAB, LENGTHS)
    partitioner = Partitioner(
        mesh_shape=(1, 2, 2, 2), mesh_axis_names=("data", "fsdp", "expert", "tensor")
    )
    model, params = hf.from_pretrained(
        mx_dir, partitioner, scan_layers=True, attention="chunked", attention_chunk_size=8
    )
    got = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    theirs = torch_logits(reference, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(got, theirs, mask) < LOGITS_TOL
    with pytest.raises(ValueError, match="jax"):
        dataclasses.replace(model.config, attention="jax")


def test_greedy_generation_past_the_window_is_hf_generate(checkpoints, imported):
    reference, _, _ = checkpoints
    model, params = imported
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (11, 4, 17)]
    ours = flaxlm_greedy_batch(model, params, prompts, 8)
    assert ours == hf_greedy_batch(reference, prompts, 8)


def test_paged_decoding_gives_hf_logits(checkpoints, imported):
    """The serving engine's path: a prompt fed in two chunks of 4 over pages of 4 slots
    (the second chunk's windowed layer reading the first's page), sinks and all."""
    reference, _, _ = checkpoints
    model, params = imported
    assert model.paged_refusal() is None  # the engine pages gpt-oss
    ids, mask = padded_batch(VOCAB, (8,))
    theirs = torch_logits(reference, input_ids=ids, attention_mask=mask)[0]
    cache = model.paged_cache(num_pages=6, page_size=4)
    table = jnp.asarray([[1, 2, 3, 4]], jnp.int32)  # page 0 is the padding's
    step = jax.jit(model.paged_logits)
    for chunk in range(2):
        slots = jnp.arange(4 * chunk, 4 * chunk + 4, dtype=jnp.int32)[None]
        tokens = jnp.asarray(ids[:, 4 * chunk : 4 * chunk + 4], jnp.int32)
        logits, cache = step(params, cache, tokens, slots, table, jnp.asarray([3]))
        got = np.asarray(logits[0, :VOCAB])
        np.testing.assert_allclose(got, theirs[4 * chunk + 3], atol=LOGITS_TOL)


def test_export_writes_unquantized_experts_that_transformers_reloads(
    checkpoints, imported, tmp_path
):
    reference, _, float_dir = checkpoints
    model, params = imported
    out = tmp_path / "export"
    hf.save_pretrained(model, params, out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    # The tensors transformers' save_pretrained writes, by name and shape: no MXFP4 pairs.
    assert _stored_shapes(str(out)) == _stored_shapes(float_dir)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(reloaded) is type(reference)
    ids, mask = padded_batch(VOCAB, LENGTHS)
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    theirs = torch_logits(reference, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(again, theirs, mask) == 0.0  # the same float32 values
    hf.save_pretrained(model, params, tmp_path / "bf16", dtype="bfloat16")
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj").dtype == torch.bfloat16


def _stored_shapes(path: str) -> dict[str, tuple[int, ...]]:
    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


# ---------------------------------------------------------------- the pieces


def textbook_attention(q, k, v, keep, sinks):
    """Softmax over the scores and each head's sink, the sink's column dropped (HF's eager
    gpt-oss attention)."""
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
    sink = jnp.broadcast_to(sinks[None, :, None, None], (*scores.shape[:-1], 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], -1), -1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def test_sinks_in_every_attention_path_give_textbook_values_and_gradients():
    """'xla' (its hand-written backward), 'chunked' under a `Mask` (context parallelism's
    kernel) and under a dense mask (decoding's), packed rows in a sliding window; gradients
    of queries, keys, values and sinks equal autodiff's of the textbook."""
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(keys[0], (2, 12, 4, 8))
    k, v = (jax.random.normal(key, (2, 12, 2, 8)) for key in keys[1:3])
    sinks = 2.0 * jax.random.normal(keys[3], (4,))
    segments = jnp.asarray([[1] * 7 + [2] * 5, [1] * 9 + [0] * 3])
    mask = masks.attention_mask(segments, 2, 12, sliding_window=3)
    d_out = jax.random.normal(keys[4], q.shape)

    def grads(attend):
        loss = lambda *a: jnp.sum(attend(*a) * d_out)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(q, k, v, sinks)

    want = grads(lambda q, k, v, s: textbook_attention(q, k, v, mask.dense(), s))
    for how, m in [("xla", mask), ("chunked", mask), ("chunked", mask.dense())]:
        got = grads(
            lambda q, k, v, s, how=how, m=m: attention.dot_product_attention(
                q, k, v, m, sinks=s, implementation=how, chunk_size=5
            )
        )
        # O(1) values summed over ~800 terms: float32 rounding ~1e-6.
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="sinks"):
        attention.dot_product_attention(q, k, v, mask, sinks=sinks, implementation="jax")


def test_experts_are_hf_experts_with_biases_and_clamps():
    """HF's `GptOssExperts` (interleaved gate and up, biases, the clamped SwiGLU) equal the
    dense, dropless and capacity experts on the converted weights, inputs large enough that
    a third of the gates and ups are clamped."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**{**CONFIG, "swiglu_limit": 0.5})
    config._experts_implementation = "eager"  # the module alone, outside a model
    module = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    x = torch.randn(20, 32)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(20)])
    weights = torch.softmax(torch.randn(20, 2), -1)
    with torch.no_grad():
        want = module(x, ids, weights).numpy()
        gate_up = x @ module.gate_up_proj[0] + module.gate_up_proj_bias[0]
    assert (gate_up.abs() > 0.5).float().mean() > 0.3
    e, d, f = 8, 32, 32
    as_np = {n: p.detach().numpy() for n, p in module.named_parameters()}
    wi = gpt_oss.wi_from_hf(as_np["gate_up_proj"], (e, d, 2, f))
    bi = gpt_oss.bi_from_hf(as_np["gate_up_proj_bias"], (e, 2, f))
    bias = (jnp.asarray(bi), jnp.asarray(as_np["down_proj_bias"]))
    wo = as_np["down_proj"]
    glu = functools.partial(experts.clamped_swiglu, limit=0.5, alpha=config.swiglu_alpha)
    args = (jnp.asarray(x.numpy()), wi, wo, jnp.asarray(weights.numpy()), jnp.asarray(ids.numpy()))
    ys = {
        "dense": jax.jit(lambda *a: experts.dense_experts(*a, glu, bias))(*args),
        "dropless": jax.jit(lambda *a: experts.grouped_experts(*a, glu, bias=bias))(*args),
        "capacity": jax.jit(lambda *a: experts.capacity_experts(*a, glu, 40, bias)[0])(*args),
    }
    for name, y in ys.items():  # O(1) sums of 32 products: float32 rounding ~1e-6
        np.testing.assert_allclose(y, want, atol=1e-5, err_msg=name)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(router="softmax_topk"), "router"),
        (dict(swiglu_limit=None), "swiglu_limit"),
        (dict(expert_bias=False), "expert_bias"),
        (dict(attention="jax"), "jax"),
        (dict(n_shared_experts=1), "n_shared_experts"),
    ],
    ids=str,
)
def test_settings_gpt_oss_lacks_are_errors_naming_them(kwargs, field):
    with pytest.raises(ValueError, match=field):
        gpt_oss.GptOssConfig(num_layers=2, **kwargs)


# Published sizes (OpenAI's model card, table 1): all and active params in billions. The card
# counts the unembedding as active but not the embedding (a lookup): active_params() counts
# both, so the embedding comes off before comparing.
PUBLISHED = {"gpt_oss_20b": (20.91, 3.61), "gpt_oss_120b": (116.83, 5.13)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_gin_sizes_match_the_model_card(name):
    total, active = PUBLISHED[name]
    cfg = gin_config(REPO, name, gpt_oss.GptOssConfig)
    assert abs(cfg.num_params() / 1e9 - total) / total < 0.01, cfg.num_params()
    embedding = cfg.vocab_size * cfg.hidden_size
    assert abs((cfg.active_params() - embedding) / 1e9 - active) / active < 0.01
    assert cfg.layer_windows[:2] == (128, None)  # sliding, then full


def test_tiny_gin_model_builds_and_lora_adapts_attention_and_experts():
    """LoRA finds the attention's and the experts' weights, not the sinks or the biases (a
    LoRA run on them trains as any family's: the same dense kernels and stacked experts)."""
    model = DecoderOnlyModel(gin_config(REPO, "gpt_oss_tiny", gpt_oss.GptOssConfig))
    batch_shapes = {"decoder_input_tokens": (1, 8)}
    shapes = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0), batch_shapes))
    block = shapes["layers_0"]
    assert block["sinks"]["logits"].shape == (model.config.num_heads,)
    assert block["mlp"]["experts"]["bi"].shape == (model.config.num_experts, 2, 192)
    rules = ((r"(q|k|v|o)_proj/kernel$", 4), (r"experts/", 2))
    kernels = lora.plan(lora.LoraConfig(rules=rules), model, batch_shapes)
    adapted = {name.split("/", 1)[1] for name in kernels}
    want = {f"{p}_proj/kernel" for p in "qkvo"} | {"mlp/experts/wi", "mlp/experts/wo"}
    assert adapted == want
