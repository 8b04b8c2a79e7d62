"""Gemma 4 (text) from and to HuggingFace: logits against transformers' Gemma4ForCausalLM,
greedy tokens through `generate` and the serving engine, LoRA and full training, the gin
files' parameter counts against transformers' own."""

import dataclasses
import json
import os

import jax
import numpy as np
import optax
import pytest
import transformers
from safetensors.numpy import save_file

from flaxlm.checkpoints import hf
from flaxlm.models import gemma4, gemma4_hf, stacks
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import lora
from tests.hf_helpers import (
    GREEDY_TOKENS,
    LIGHT,
    check_family,
    check_scanned,
    decoder_batch,
    engine_greedy,
    gin_config,
    hf_greedy_batch,
    max_abs_diff,
    padded_batch,
    random_hf_model,
    save_torch_model,
    torch_logits,
    train_on_batch,
)

VOCAB = 256
S, G = "sliding_attention", "full_attention"
BASE = dict(
    vocab_size=VOCAB,
    vocab_size_per_layer_input=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=128,
    sliding_window=8,  # well inside prompt + 30 generated tokens
    attention_dropout=0.0,
    initializer_range=0.1,  # sharp enough attention that positions visibly matter
    # No EOS: HF's generate(min_new_tokens=...) would mask the logit flaxlm may pick.
    eos_token_id=None,
)
CONFIGS = {
    # E2B-like: per-layer inputs, the last 2 layers reusing layers 0 and 1's keys and values
    # with MLPs twice as wide, global heads twice as wide (a quarter of their pairs rotate),
    # final soft cap, tied head.
    "shared": dict(
        num_hidden_layers=4,
        layer_types=[S, G, S, G],
        num_key_value_heads=1,
        global_head_dim=32,
        hidden_size_per_layer_input=8,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        final_logit_softcapping=3.0,
    ),
    # 26B-A4B-like: global layers whose values are their keys (1 key head), 4 experts (2 a
    # token) beside every MLP, biases, scaled proportional rope on half the pairs, no
    # per-layer inputs, untied head.
    "k_eq_v_moe": dict(
        num_hidden_layers=3,
        layer_types=[S, S, G],
        num_key_value_heads=2,
        global_head_dim=24,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        attention_bias=True,
        hidden_size_per_layer_input=0,
        use_bidirectional_attention="vision",
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=16,
        tie_word_embeddings=False,
        rope_parameters={
            G: {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "factor": 2.0,
                "rope_theta": 1e4,
            },
            S: {"rope_type": "default", "rope_theta": 1e3},
        },  # fmt: skip
    ),
}
# HF starts norms, layer scalars, router scales and biases at constants: make them count.
PERTURB = ("norm.weight", "layer_scalar", "router.scale", "per_expert_scale", ".bias")
ONE = Partitioner(devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_gemma4"))


def tiny_hf_gemma4(name: str, root: str):
    torch_model = random_hf_model(
        transformers.Gemma4TextConfig,
        transformers.Gemma4ForCausalLM,
        PERTURB,
        **BASE,
        **CONFIGS[name],
    )
    path = os.path.join(root, name)
    if not os.path.exists(path):
        save_torch_model(torch_model, path)
    return torch_model, path


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gemma4_keeps_every_promise_of_an_hf_family(name, root, tmp_path):
    torch_model, path = tiny_hf_gemma4(name, root)
    # The kernels and meshes once, on the MoE config (each config: its reading and math); the
    # layers scanned on the last mesh (k_eq_v_moe: one cycle of 3, the types repeat nothing;
    # shared: the two KV-shared layers, one cycle, after the two they reuse).
    light = {} if name == "k_eq_v_moe" else LIGHT
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, **light)
    config = hf.from_pretrained(path)[0].config
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["rope_parameters"] == torch_model.config.rope_parameters
    if name == "shared":
        assert config.kv_sources == (0, 1, 0, 1)
        assert [config.mlp_width(i) for i in range(4)] == [64, 64, 128, 128]
    else:
        assert config.layer_shape(2) == (1, 24) and config.layer_shape(0) == (2, 16)
        assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
        # The experts split over an `expert` mesh axis, one a device.
        axes = ("data", "fsdp", "expert", "tensor")
        sharded, params = hf.from_pretrained(path, Partitioner((1, 2, 4, 1), axes))
        ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
        theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
        got = jax.jit(sharded.compute_logits)(params, decoder_batch(ids, mask))
        assert max_abs_diff(got, theirs, mask) < 1e-4


# (layer types, KV-shared layers, (first_scanned_layer, scan_period, scan_tail)).
SCANNED = {
    # Two (sliding, global) cycles, heads of different widths (the global ones' values their
    # keys), then a last global layer unrolled.
    "cycles_and_tail": ([S, G, S, G, G], 0, (0, 2, 1)),
    # The last four layers reuse layers 0 and 1's keys and values: those two stay unrolled
    # and the scan of the four carries their keys and values.
    "kv_shared": ([S, G, S, G, S, G], 4, (2, 2, 0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCANNED))
def test_layers_scan_in_cycles_of_their_types_to_hf_logits_tokens_and_files(name, tmp_path):
    """Each block of the scan's cycle one type and head width, the per-layer inputs sliced
    by the traced layer number: HF's logits, its greedy tokens (decoding unstacks the
    cycles) and files HF reloads."""
    types, shared, layout = SCANNED[name]
    kwargs = dict(CONFIGS["shared"], num_hidden_layers=len(types), layer_types=types)
    kwargs.update(num_kv_shared_layers=shared, attention_k_eq_v=True, num_global_key_value_heads=1)
    torch_model = random_hf_model(
        transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM, PERTURB, **BASE, **kwargs
    )
    path = save_torch_model(torch_model, tmp_path / "hf")
    model, params = hf.from_pretrained(path, Partitioner((1, 4, 2)), scan_layers=True)
    cfg = model.config
    assert (cfg.first_scanned_layer, cfg.scan_period, cfg.scan_tail) == layout
    first, _, tail = layout
    unrolled = [*range(first), *range(len(types) - tail, len(types))]
    assert {f"layers_{i}" for i in unrolled} | {"layers"} == {k for k in params if "layers" in k}
    blocks = [params["layers"][f"block_{j}"] for j in (0, 1)]
    assert blocks[0]["q_proj"]["kernel"].shape == (2, 32, 4, 16)
    assert blocks[1]["q_proj"]["kernel"].shape == (2, 32, 4, 32)
    assert ("k_proj" in blocks[0]) == (not shared) and "v_proj" not in blocks[1]
    check_scanned(torch_model, model, params, VOCAB, tmp_path / "out", alone=True)


@pytest.mark.slow
def test_engine_greedy_over_the_paged_cache_is_hf_generate(root):
    """The serving engine's paged cache gives HF's greedy tokens; KV-shared layers read the
    pages of the layer they reuse."""
    torch_model, path = tiny_hf_gemma4("shared", root)
    model, params = hf.from_pretrained(path)
    assert model.paged_refusal() is None
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (11, 4, 17)]
    expected = hf_greedy_batch(torch_model, prompts, GREEDY_TOKENS)
    assert engine_greedy(model, params, prompts) == expected


@pytest.mark.slow
def test_lora_and_full_training_lower_the_loss(root):
    """LoRA on attention and the per-layer input gate, then every param, a few steps each."""
    _, path = tiny_hf_gemma4("shared", root)
    model, params = hf.from_pretrained(path)
    batch = decoder_batch(*padded_batch(VOCAB, (16, 9, 16, 5)))
    cfg = lora.LoraConfig(rules=((r"(q|k|v|o)_proj/kernel$", 4), (r"per_layer_input_gate", 2)))
    shapes = {k: v.shape for k, v in batch.items()}
    kernels = lora.plan(cfg, model, shapes)
    assert any("per_layer_input_gate" in k for k in kernels)
    adapters = lora.init_adapters(jax.random.PRNGKey(0), kernels)
    loss_model = lora.LoraModel(model, cfg, params)
    tx = optax.adam(1e-2)

    @jax.jit
    def step(adapters, opt_state):
        def loss(a):
            value, sums = loss_model.loss_fn(a, batch, None)
            return value / sums["weight_sum"]

        value, grads = jax.value_and_grad(loss)(adapters)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value

    opt_state, losses = tx.init(adapters), []
    for _ in range(5):
        adapters, opt_state, value = step(adapters, opt_state)
        losses.append(float(value))
    assert losses[-1] < 0.9 * losses[0], losses

    partitioner = Partitioner(mesh_shape=(1, 4, 2))
    model, params = hf.from_pretrained(path, partitioner)
    state, history = train_on_batch(model, params, partitioner, batch, steps=3)
    assert history[-1]["loss"] < history[0]["loss"], history
    # HF's layer_scalar is a buffer: not trained here either.
    assert float(state.params["layers_0"]["layer_scalar"]["scale"][0]) == float(
        params["layers_0"]["layer_scalar"]["scale"][0]
    )


# The parameters transformers' Gemma4ForCausalLM of each gin file's exported config.json
# has, counted once on the meta device (`sum(p.numel() for p in model.parameters())`).
GIN_FILES = {
    "gemma4_tiny": dict(vocab_size=384, attention_k_eq_v=True, params=7_897_696),
    "gemma4_e2b": dict(hidden_size=1536, num_layers=35, params=4_628_569_344),
    "gemma4_e4b": dict(hidden_size=2560, num_layers=42, params=7_463_013_376),
    "gemma4_31b": dict(hidden_size=5376, num_global_kv_heads=4, params=30_697_345_280),
    "gemma4_26b_a4b": dict(num_experts=128, num_experts_per_tok=8, params=25_233_141_760),
}


@pytest.mark.parametrize("name", sorted(GIN_FILES))
def test_gin_model_file_builds_its_config_with_transformers_parameter_count(repo_dir, name):
    config = gin_config(repo_dir, name, gemma4.Gemma4Config)
    expected = dict(GIN_FILES[name])
    params = expected.pop("params")
    for field, value in expected.items():
        assert getattr(config, field) == value, field
    assert config.vocab_size % 128 == 0 and config.per_layer_types[-1] == G
    assert config.num_params() == params
    # 31B and 26B-A4B scan their cycles (5 sliding, 1 global); E2B and E4B would scan their
    # KV-shared layers only, after the layers they reuse, and do not (HISTORY.md: E2B scanned
    # took 27.84 GiB a GPU against 26.35 unrolled).
    want = (0, 6, 0) if name in ("gemma4_31b", "gemma4_26b_a4b") else None
    assert stacks.scan_layout(config) == want
    scanned = gin_config(repo_dir, name, gemma4.Gemma4Config, ["Gemma4Config.scan_layers=True"])
    sources = {"gemma4_e2b": (15, 5, 0), "gemma4_e4b": (24, 6, 0), "gemma4_tiny": (4, 2, 0)}
    assert stacks.scan_layout(scanned) == sources.get(name, (0, 6, 0))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(enable_moe_block=True, norm_topk_prob=False), "norm_topk_prob"),
        (dict(enable_moe_block=True, num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
        (dict(layer_types=(S,) * 3, num_layers=4), "layer_types"),
        (dict(layer_types=(G, S), num_layers=2), "layer_types"),
        (dict(rope_type="yarn"), "rope_type"),
        (dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
        (dict(num_kv_shared_layers=30), "num_kv_shared_layers"),
        (dict(layer_types=(S, S, G), num_layers=3, num_kv_shared_layers=1), "num_kv_shared_layers"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(final_logit_softcapping=0.0), "final_logit_softcapping"),
    ],
    ids=str,
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        gemma4.Gemma4Config(**kwargs)


@pytest.mark.parametrize(
    "hf_fields, field",
    [
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
        (dict(rope_parameters={G: {"rope_type": "yarn", "rope_theta": 1e4}}), "rope_parameters"),
        (dict(per_layer_config={"0": {"head_dim": 32}}), "per_layer_config"),
        (dict(per_layer_config={"5": {"intermediate_size": 8}}), "per_layer_config"),
    ],
    ids=str,
)
def test_config_json_flaxlm_cannot_run_is_refused_naming_the_setting(hf_fields, field):
    with pytest.raises(ValueError, match=field):
        gemma4_hf.config_from_hf({"model_type": "gemma4_text", "num_hidden_layers": 6, **hf_fields})


def test_config_json_defaults_are_transformers(tmp_path):
    """A config.json that leaves everything out reads as transformers reads it: 5 sliding
    layers to 1 global (the last global), 512-wide global heads, proportional rope."""
    config = gemma4_hf.config_from_hf({"model_type": "gemma4_text", "num_hidden_layers": 8})
    theirs = transformers.Gemma4TextConfig(num_hidden_layers=8)
    assert list(config.per_layer_types) == theirs.layer_types
    assert config.layer_shape(7) == (4, 512) and config.hidden_size_per_layer_input == 256
    ours = gemma4_hf.config_to_hf(dataclasses.replace(config, vocab_size=262144))
    assert ours["rope_parameters"] == theirs.rope_parameters


def test_per_layer_config_of_ten_layers_or_more_reads_as_transformers_writes_it():
    """transformers writes `per_layer_config`'s layer keys zero-padded from 10 layers on
    ("05": a 12-layer file's first global layer) and reads them back as integers."""
    written = transformers.Gemma4TextConfig(num_hidden_layers=12).to_dict()
    assert sorted(written["per_layer_config"]) == ["05", "11"]
    config = gemma4_hf.config_from_hf(written)
    assert config.per_layer_types[5] == G and config.layer_shape(5) == (4, 512)


@pytest.mark.slow
def test_multimodal_checkpoint_loads_its_text_tower(root, tmp_path, capsys):
    """A Gemma4ForConditionalGeneration's files (the text tower under
    `model.language_model.`, a tied head, the other towers beside it): the text tower's
    logits, the other towers skipped with a note."""
    torch_model, _ = tiny_hf_gemma4("shared", root)
    tensors = {
        f"model.language_model.{name.removeprefix('model.')}": value.numpy()
        for name, value in torch_model.state_dict().items()
        if name != "lm_head.weight"
    }
    tensors["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = np.zeros((2, 2))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"]}
    config["text_config"] = torch_model.config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, params = hf.from_pretrained(tmp_path)
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert (
        max_abs_diff(jax.jit(model.compute_logits)(params, decoder_batch(ids, mask)), theirs, mask)
        < 1e-4
    )
    assert "tensors the model does not use" in capsys.readouterr().out
