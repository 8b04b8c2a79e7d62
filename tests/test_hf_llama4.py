"""Llama 4 (text) from and to HuggingFace: every promise of `check_family` on two tiny random
`Llama4ForCausalLM`s, greedy decoding through the serving engine's paged cache, LoRA
training, the settings refused, and the published sizes.

MIXED: every layer sparse (two experts a token, so the router's weight on each expert's
input counts twice), queries and keys L2-normalised, NoPE every other layer with attention
temperature tuning from the 4th position on, chunks of 8 positions, Scout's llama3 rope
scaling (equal low and high factors). INTERLEAVED: dense and sparse layers alternating, one
expert a token, a NoPE layer that is chunked and a rotary one that is not (`layer_types`),
chunks of 5, attention biases, one key/value head, a tied head, no q/k norm or temperature.
"""

import functools
import os

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
import transformers

from flaxlm.checkpoints import hf
from flaxlm.models import llama4, moe
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import lora
from tests.hf_helpers import (
    LIGHT,
    check_family,
    decoder_batch,
    engine_greedy,
    gin_config,
    hf_greedy_batch,
    padded_batch,
    random_hf_model,
    save_torch_model,
)

ONE = Partitioner(devices=jax.devices()[:1])
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 120
GREEDY_TOKENS = 8
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=16,
    intermediate_size_mlp=48,
    num_attention_heads=4,
    num_local_experts=4,
    max_position_embeddings=96,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF's min_new_tokens would otherwise forbid one
)
CONFIGS = {
    "mixed": dict(
        COMMON,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=8,
        num_experts_per_tok=2,
        no_rope_layer_interval=2,
        attention_chunk_size=8,
        floor_scale=4,
        attn_scale=0.5,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=1.0,
            original_max_position_embeddings=16,
        ),
    ),
    "interleaved": dict(
        COMMON,
        num_hidden_layers=4,
        num_key_value_heads=1,
        head_dim=16,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        no_rope_layers=[0, 1, 1, 0],
        layer_types=["chunked_attention", "full_attention", "full_attention", "chunked_attention"],
        attention_chunk_size=5,
        use_qk_norm=False,
        attn_temperature_tuning=False,
        attention_bias=True,
        tie_word_embeddings=True,
    ),
}


@functools.cache
def tiny_hf_llama4(name: str, root: str):
    """A random tiny HF Llama 4 of `CONFIGS[name]` and its saved directory."""
    torch_model = random_hf_model(
        transformers.Llama4TextConfig,
        transformers.Llama4ForCausalLM,
        ("norm.weight", ".bias"),
        **CONFIGS[name],
    )
    return torch_model, save_torch_model(torch_model, os.path.join(root, name))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_llama4"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_llama4_keeps_every_promise_of_an_hf_family(name, root, tmp_path):
    torch_model, path = tiny_hf_llama4(name, root)
    model, _ = hf.from_pretrained(path)
    assert isinstance(model.config, llama4.Llama4Config)
    # The kernels and meshes once, on "mixed" (each config: its reading and math). The last
    # mesh scans: "interleaved" (Maverick's dense, MoE) as two cycles of two blocks, each
    # layer's rotary and chunking its own.
    light = {} if name == "mixed" else LIGHT
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, **light)


@pytest.mark.slow
def test_engine_greedy_over_the_paged_cache_is_hf_generate(root):
    """The serving engine's paged cache (chunks and temperature by position) gives HF's
    greedy tokens of each prompt alone."""
    torch_model, path = tiny_hf_llama4("mixed", root)
    model, params = hf.from_pretrained(path)
    assert model.paged_refusal() is None
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (11, 4, 17)]
    expected = [hf_greedy_batch(torch_model, [p], GREEDY_TOKENS)[0] for p in prompts]
    assert engine_greedy(model, params, prompts, GREEDY_TOKENS) == expected


@pytest.mark.slow
def test_lora_on_attention_experts_and_router_lowers_the_loss(root):
    _, path = tiny_hf_llama4("interleaved", root)
    model, params = hf.from_pretrained(path)
    batch = decoder_batch(*padded_batch(VOCAB, (16, 9, 16, 5)))
    cfg = lora.LoraConfig(
        rules=((r"(q|v)_proj/kernel$", 4), (r"experts/wi$", 2), (r"mlp/gate/kernel$", 2))
    )
    shapes = {k: v.shape for k, v in batch.items()}
    adapters = lora.init_adapters(jax.random.PRNGKey(0), lora.plan(cfg, model, shapes))
    loss_model = lora.LoraModel(model, cfg, params)
    tx = optax.adam(1e-2)

    @jax.jit
    def step(adapters, opt_state):
        loss = lambda a: loss_model.loss_fn(a, batch, None)[0]  # noqa: E731 (per token)
        value, grads = jax.value_and_grad(loss)(adapters)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value

    opt_state, losses = tx.init(adapters), []
    for _ in range(6):
        adapters, opt_state, value = step(adapters, opt_state)
        losses.append(float(value))
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(router="softmax_topk"), "router"),
        (dict(n_shared_experts=2), "n_shared_experts"),
        (dict(norm_topk_prob=True), "norm_topk_prob"),
        (dict(layer_types=("chunked_attention",) * 3), "layer_types"),
        (dict(layer_types=("sliding_attention",) * 2), "layer_types"),
        (dict(no_rope_layers=(1,)), "no_rope_layers"),
        (dict(local_chunk_size=None), "attention_chunk_size"),
        (dict(local_chunk_size=0), "attention_chunk_size"),
        (dict(floor_scale=0), "floor_scale"),
    ],
    ids=str,
)
def test_settings_llama4_cannot_run_are_errors_naming_them(kwargs, field):
    with pytest.raises(ValueError, match=field):
        llama4.Llama4Config(num_layers=2, **kwargs)


def test_config_json_settings_flaxlm_cannot_honour_are_refused():
    hf_config = transformers.Llama4TextConfig(**CONFIGS["mixed"]).to_dict()
    with pytest.raises(ValueError, match="dynamic"):
        llama4.config_from_hf(
            {**hf_config, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}
        )
    with pytest.raises(ValueError, match="interleave_moe_layer_step"):
        llama4.config_from_hf({**hf_config, "moe_layers": None, "interleave_moe_layer_step": 0})


@pytest.mark.slow
def test_router_weights_the_experts_input_not_their_output():
    """One expert a token: expert(w x), which a SwiGLU makes differ from w expert(x)."""
    cfg = llama4.Llama4Config(
        vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
        num_experts=2, moe_intermediate_size=4, max_position_embeddings=32,
    )  # fmt: skip
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 3, 8))
    layer = moe.MoE(cfg)
    params = nn.unbox(layer.init(jax.random.PRNGKey(0), x)["params"])
    got, _ = layer.apply({"params": params}, x, mutable=["intermediates"])
    wi, wo = params["experts"]["wi"], params["experts"]["wo"]
    logits = x @ params["gate"]["kernel"]
    w, e = jax.nn.sigmoid(logits.max(-1, keepdims=True)), logits.argmax(-1)

    def expert(xs, i):
        h = np.einsum("btd,btdgf->btgf", xs, wi[i])
        return np.einsum("btf,btfd->btd", jax.nn.silu(h[..., 0, :]) * h[..., 1, :], wo[i])

    shared = params["shared_experts"]
    s = x @ shared["gate_proj"]["kernel"]
    s = (jax.nn.silu(s) * (x @ shared["up_proj"]["kernel"])) @ shared["down_proj"]["kernel"]
    np.testing.assert_allclose(got, expert(x * w, e) + s, atol=1e-5)
    assert not np.allclose(expert(x, e) * w, expert(x * w, e), rtol=0.1, atol=0)


# Published sizes (Meta's model cards: 17B active; the text model's totals, the vision
# encoder's ~1B left out of the cards' 109B and 400B).
PUBLISHED = {
    "llama4_scout": (107.8, 17.2),
    "llama4_maverick": (400.7, 17.2),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_gin_sizes_match_the_model_cards(name):
    total, active = PUBLISHED[name]
    cfg = gin_config(REPO, name, llama4.Llama4Config)
    assert abs(cfg.num_params() / 1e9 - total) / total < 0.01, cfg.num_params()
    assert abs(cfg.active_params() / 1e9 - active) / active < 0.02, cfg.active_params()


def test_tiny_gin_model_builds_its_cycles():
    """Dense and MoE layers alternating, scanned as cycles of two blocks."""
    model = DecoderOnlyModel(gin_config(REPO, "llama4_tiny", llama4.Llama4Config))
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    cycles = model.config.num_layers // 2
    assert model.config.scan_period == 2 and sorted(shapes["layers"]) == ["block_0", "block_1"]
    assert shapes["layers"]["block_1"]["mlp"]["experts"]["wi"].shape[:2] == (
        cycles,
        model.config.num_experts,
    )
    assert "experts" not in shapes["layers"]["block_0"]["mlp"]
