"""Qwen3-Next and Qwen3.5 text from and to HuggingFace: every promise against transformers'
`Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM` and `Qwen3_5MoeForCausalLM` (Gated DeltaNet
layers between gated full-attention ones, partial rotary, (1 + w) norms, experts with a
gated shared expert), the Hub's multimodal Qwen3.5 files' text tower, the serving engine's
refusal, LoRA steps on packed rows through the gin file, config errors and the gin files."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from flaxlm.checkpoints import hf, peft_config, peft_dir
from flaxlm.models import base, hf_spec, options, qwen3_next, qwen3_next_hf, stacks
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import lora, steps
from tests.helpers import adamw
from tests.hf_helpers import (
    LIGHT,
    check_family,
    check_mtp_loss,
    check_scanned,
    decoder_batch,
    flaxlm_greedy_batch,
    gin_config,
    hf_greedy_batch,
    max_abs_diff,
    mtp_depth_logits,
    padded_batch,
    random_hf_model,
    randomise_params,
    save_torch_model,
    torch_logits,
)
from tests.linear_attention_helpers import (
    HYBRID_CONFIG_ERRORS,
    check_engine_greedy_is_hf_generate,
    packed_batch,
)
from tests.test_peft_experts import random_adapters

VOCAB = 250
L, F = qwen3_next.LINEAR, qwen3_next.FULL
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    attention_dropout=0.0,
    initializer_range=0.1,  # sharp enough attention that positions visibly matter
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF's min_new_tokens would otherwise forbid one
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
VARIANTS = {
    # Linear, full, linear (a dense MLP: mlp_only_layers), full; two value heads per key
    # head, biased attention, the top k not renormalised, a quarter of each head rotated.
    "qwen3_next": (
        transformers.Qwen3NextConfig,
        transformers.Qwen3NextForCausalLM,
        dict(
            COMMON,
            **MOE,
            num_hidden_layers=4,
            layer_types=[L, F, L, F],
            mlp_only_layers=[2],
            linear_num_value_heads=4,
            linear_value_head_dim=8,
            shared_expert_intermediate_size=16,
            norm_topk_prob=False,
            attention_bias=True,
        ),
    ),  # fmt: skip
    # Linear, linear, full (full_attention_interval 3), dense; one value head per key head
    # of another width, a tied head, half of each head rotated, linearly scaled, with the
    # multimodal sections (one position stream: plain rotary).
    "qwen3_5_text": (
        transformers.Qwen3_5TextConfig,
        transformers.Qwen3_5ForCausalLM,
        dict(
            COMMON,
            num_hidden_layers=3,
            full_attention_interval=3,
            tie_word_embeddings=True,
            linear_num_value_heads=2,
            linear_value_head_dim=16,
            rope_parameters={
                "rope_type": "linear",
                "factor": 2.0,
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        ),
    ),  # fmt: skip
    # Three linear layers, then a full one (the default), experts in every layer.
    "qwen3_5_moe_text": (
        transformers.Qwen3_5MoeTextConfig,
        transformers.Qwen3_5MoeForCausalLM,
        dict(
            COMMON,
            **MOE,
            num_hidden_layers=4,
            linear_num_value_heads=4,
            linear_value_head_dim=8,
            shared_expert_intermediate_size=16,
        ),
    ),  # fmt: skip
}
# HF starts these at constants (the (1 + w) norms at 0, the gated norm at 1, dt_bias at 1).
PERTURBED = ("norm.weight", "layernorm.weight", "dt_bias", ".bias")


def tiny_hf_model(path, variant: str):
    """A random tiny torch model of `variant` (its constant-initialised params perturbed),
    saved."""
    config_cls, model_cls, kwargs = VARIANTS[variant]
    model = random_hf_model(config_cls, model_cls, PERTURBED, **kwargs)
    return model, save_torch_model(model, path)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3_next", "qwen3_5_text"])
def test_checkpoint_keeps_every_promise(tmp_path, variant):
    torch_model, path = tiny_hf_model(tmp_path / "hf", variant)
    # The kernels and meshes once, on the first variant (each variant: its reading and math);
    # the last mesh scans its layers as one cycle (linear, full, linear with a dense MLP, full).
    light = {} if variant == "qwen3_next" else LIGHT
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, **light)
    exported = transformers.AutoConfig.from_pretrained(str(tmp_path / "export"))
    assert exported.layer_types == torch_model.config.layer_types
    assert exported.rope_parameters == torch_model.config.rope_parameters
    config = qwen3_next_hf.config_from_hf(exported.to_dict())  # the vocabulary unpadded
    assert config.model_type == variant
    assert config.num_params() == sum(p.numel() for p in torch_model.parameters())


def as_multimodal_file(torch_model, path, out) -> None:
    """The saved text model as the Hub ships Qwen3.5 (`Qwen3_5MoeForConditionalGeneration`):
    the text config under `text_config`, its tensors under `model.language_model.`, beside a
    vision tower's and the multi-token-prediction layer's."""
    out.mkdir()
    tensors = {
        name.replace("model.", "model.language_model.", 1): array
        for name, array in load_file(f"{path}/model.safetensors").items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    tensors["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    text = torch_model.config.to_dict()
    config = {
        "model_type": "qwen3_5_moe",
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {"depth": 1},
    }
    (out / "config.json").write_text(json.dumps(config))


@pytest.mark.slow
def test_multimodal_file_loads_its_text_tower_and_exports_it(tmp_path):
    """Qwen3.5-MoE's multimodal file: HF's logits and greedy tokens from the text tower; the
    export is the text model, which transformers reloads to the same logits."""
    torch_model, path = tiny_hf_model(tmp_path / "hf", "qwen3_5_moe_text")
    as_multimodal_file(torch_model, path, tmp_path / "multimodal")
    model, params = hf.from_pretrained(tmp_path / "multimodal")
    assert model.config.model_type == "qwen3_5_moe_text"
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    ours = np.asarray(jax.jit(model.compute_logits)(params, decoder_batch(ids, mask)))
    assert max_abs_diff(ours, theirs, mask) < 1e-4
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (11, 4, 17)]
    assert flaxlm_greedy_batch(model, params, prompts) == hf_greedy_batch(torch_model, prompts)

    hf.save_pretrained(model, params, tmp_path / "export")
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(reloaded) is transformers.Qwen3_5MoeForCausalLM
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, again, mask) <= 1e-5 * max(1.0, np.abs(again).max())


def with_mtp_layer(torch_model, path, out, variant: str):
    """The saved checkpoint with a multi-token-prediction layer as the Hub's files hold one
    (`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` a
    full-attention decoder layer, `mtp.norm`; config.json's `mtp_num_hidden_layers`), made of
    transformers' modules: a one-layer full-attention model of the variant (its layer and its
    final norm) and norms of its class, randomised. Returns the modules."""
    import torch

    config_cls, model_cls, kwargs = VARIANTS[variant]
    one = dict(kwargs, num_hidden_layers=1, layer_types=[F])
    if "mlp_only_layers" in one:
        one["mlp_only_layers"] = []
    block = random_hf_model(config_cls, model_cls, PERTURBED, **one)
    norm_cls, width = type(block.model.norm), COMMON["hidden_size"]
    parts = torch.nn.ModuleDict(
        {
            "block": block,
            "enorm": norm_cls(width, eps=COMMON["rms_norm_eps"]),
            "hnorm": norm_cls(width, eps=COMMON["rms_norm_eps"]),
            "fc": torch.nn.Linear(2 * width, width, bias=False),
        }
    ).eval()
    randomise_params(parts, 7, norm_center=0.0)  # other values than the trunk's; (1 + w) norms
    out.mkdir()
    tensors = load_file(f"{path}/model.safetensors")
    block.save_pretrained(str(out / "block"))
    for name, array in load_file(str(out / "block" / "model.safetensors")).items():
        if name.startswith("model.layers.0."):
            tensors[name.replace("model.layers.0.", "mtp.layers.0.")] = array
        elif name == "model.norm.weight":
            tensors["mtp.norm.weight"] = array
    names = {"fc": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden"}
    for ours, theirs in names.items():
        tensors[f"mtp.{theirs}.weight"] = parts[ours].weight.detach().numpy()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(open(f"{path}/config.json").read())
    (out / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return parts


def hf_mtp_logits(main, parts, ids: np.ndarray) -> np.ndarray:
    """The MTP layer's logits `[rows, length - 1, vocab]` from transformers' modules as vLLM's
    `Qwen3NextMultiTokenPredictor` composes them: the next tokens' embeddings and the final
    hidden states normalised, `fc` of the two (embedding first), the full-attention layer and
    its norm (the one-layer model's: its rotary at positions from 0, the same attention as
    from each token's own, rotary being relative), the model's head."""
    import torch

    ids = torch.tensor(ids)
    with torch.no_grad():
        hidden = main.model(ids).last_hidden_state[:, :-1]
        e = main.model.embed_tokens(ids[:, 1:])
        x = parts["fc"](torch.cat([parts["enorm"](e), parts["hnorm"](hidden)], dim=-1))
        return main.lm_head(parts["block"].model(inputs_embeds=x).last_hidden_state).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3_next", "qwen3_5_text"])
def test_mtp_layer_loads_predicts_trains_and_exports(tmp_path, variant):
    """The Hub's MTP layer read with `num_mtp_layers=1` (vLLM's composition of a decoder
    layer of the family: MoE on Qwen3-Next, dense on Qwen3.5): its logits are that of
    transformers' modules; its loss counts; the export writes `mtp.*` back and reads again
    to the same params. Without `num_mtp_layers` the layer is passed over, as transformers
    does."""

    torch_model, path = tiny_hf_model(tmp_path / "hf", variant)
    parts = with_mtp_layer(torch_model, path, tmp_path / "mtp", variant)
    model, params = hf.from_pretrained(tmp_path / "mtp", num_mtp_layers=1)
    own = [p for n, p in parts.named_parameters() if "embed_tokens" not in n and "lm_head" not in n]
    plain = dataclasses.replace(model.config, num_mtp_layers=0)
    assert model.config.num_params() - plain.num_params() == sum(p.numel() for p in own)
    ids = np.random.default_rng(4).integers(1, VOCAB, (2, 17))
    want = hf_mtp_logits(torch_model, parts, ids)
    (got,) = mtp_depth_logits(model, params, ids)
    assert np.abs(got[..., :VOCAB] - want).max() < 1e-4
    check_mtp_loss(model, params, ids, [hf_mtp_logits(torch_model, parts, ids[:, :-1])])

    hf.save_pretrained(model, params, tmp_path / "export")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["mtp_num_hidden_layers"] == 1
    _, again = hf.from_pretrained(tmp_path / "export", num_mtp_layers=1)
    assert jax.tree.all(jax.tree.map(np.array_equal, again, params))
    _, without = hf.from_pretrained(tmp_path / "mtp")
    assert "mtp_0" not in without


def tiny_config(**overrides) -> qwen3_next.Qwen3NextConfig:
    fields = dict(
        vocab_size=128, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
    )  # fmt: skip
    return qwen3_next.Qwen3NextConfig(**{**fields, **overrides})


@pytest.mark.slow
def test_greedy_through_the_engines_pages_and_state_slots_is_hf_generate(tmp_path):
    """Rows joining and leaving, a follower of an identical prompt (its state copied), a
    state slot reused, later prompts resumed from the prefix cache's pages and state
    snapshots: HF's greedy tokens (`generate`'s are `check_family`'s)."""
    torch_model, path = tiny_hf_model(tmp_path / "hf", "qwen3_next")
    check_engine_greedy_is_hf_generate(torch_model, path, VOCAB)


@pytest.mark.slow
def test_lora_steps_on_packed_rows_through_the_gin_file(repo_dir):
    """gin/models/qwen3_next_tiny.gin's model, LoRA on the linear layers' projections and
    the full ones' q and v, packed rows, an FSDP x tensor mesh: the loss falls, the base
    params stay as they were. The gin file scans the linear layers, the full one unrolled
    after them."""
    config = gin_config(repo_dir, "qwen3_next_tiny", qwen3_next.Qwen3NextConfig)
    model = base.DecoderOnlyModel(config)
    partitioner = Partitioner(mesh_shape=(1, 4, 2))
    batch = packed_batch()
    lengths = {k: v.shape[1] for k, v in batch.items()}
    rules = ((r"(in_proj_qkvz|in_proj_ba|out_proj)/kernel$", 4), (r"(q|v)_proj/kernel$", 4))
    cfg = lora.LoraConfig(rules=rules, alpha=8.0)
    setup = steps.Setup(model, partitioner, adamw(1e-2), lengths, lora=cfg)
    assert (config.first_scanned_layer, config.scan_period, config.scan_tail) == (0, 1, 1)
    assert len(setup.lora_kernels) == 3 + 2
    state, params = setup.init_state(), setup.init_base()
    before = jax.device_get(params)
    step = setup.partition_train_step(steps.make_train_step(model, partitioner, 1e-2, lora=cfg))
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch, params)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    jax.tree.map(np.testing.assert_array_equal, before, jax.device_get(params))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        *HYBRID_CONFIG_ERRORS,
        (dict(full_attention_interval=0), "full_attention_interval"),
        (dict(linear_num_value_heads=3), "linear_num_value_heads"),
        (dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
        (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
        (dict(model_type="qwen3_5_text"), "num_experts"),
        (dict(model_type="qwen3_5_moe_text", norm_topk_prob=False), "norm_topk_prob"),
        (dict(model_type="qwen3_5_moe_text", mlp_only_layers=(1,)), "mlp_only_layers"),
        (dict(mrope_section=(2, 1, 1)), "mrope_section"),
        (dict(model_type="qwen3_5"), "model_type"),
    ],
    ids=str,
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**kwargs)


def test_scan_stacks_the_cycle_the_layer_kinds_repeat():
    """The scan's body is the shortest cycle of (token mixer, MLP) kinds that divides the
    layers; each of its blocks stacks the HF layers a cycle apart."""
    cycles = tiny_config(num_layers=8, scan_layers=True)  # (L, L, L, F) twice
    assert (cycles.first_scanned_layer, cycles.scan_period) == (0, 4)
    table = hf_spec.expand(qwen3_next_hf.hf_tensors(cycles), stacks.scan_layout(cycles))
    assert table["layers/block_3/q_proj/kernel"].names == [
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.7.self_attn.q_proj.weight",
    ]
    assert "layers/block_0/q_proj/kernel" not in table
    assert table["layers/block_1/linear_attn/A_log"].names[1] == "model.layers.5.linear_attn.A_log"
    assert tiny_config(layer_types=(L,) * 4).scan_period == 1
    assert tiny_config(layer_types=(L, F, F, L)).scan_period == 4  # no shorter cycle
    # Dense first MLPs stay unrolled before the cycles.
    dense_first = tiny_config(num_layers=5, layer_types=(F, *(L, F) * 2), mlp_only_layers=(0,))
    assert (dense_first.first_scanned_layer, dense_first.scan_period) == (1, 2)


@pytest.mark.slow
def test_layers_scanned_in_cycles_give_hf_logits_tokens_and_files(tmp_path):
    """Qwen3.5-MoE's (linear, linear, linear, full) twice, scanned as two cycles of four
    blocks: HF's logits, its greedy tokens (decoding unstacks the cycles), files HF reloads,
    and PEFT adapters read into the cycles written back as the same file."""
    config_cls, model_cls, kwargs = VARIANTS["qwen3_5_moe_text"]
    torch_model = random_hf_model(
        config_cls, model_cls, PERTURBED, **{**kwargs, "num_hidden_layers": 8}
    )
    path = save_torch_model(torch_model, tmp_path / "hf")
    model, params = hf.from_pretrained(path, scan_layers=True)
    stack = params["layers"]
    assert sorted(stack) == ["block_0", "block_1", "block_2", "block_3"] and len(params) == 4
    assert "q_proj" in stack["block_3"] and "linear_attn" in stack["block_0"]
    assert stack["block_3"]["mlp"]["experts"]["wi"].shape[0] == 2
    check_scanned(torch_model, model, params, VOCAB, tmp_path / "out")

    rules = ((r"(q_proj|out_proj)/kernel$", 4), (r"in_proj_z/kernel$", 2), (r"experts/wi$", 2))
    cfg = lora.LoraConfig(rules=rules, alpha=8.0)
    unrolled = hf.model_from_hf_dir(path)
    written = tmp_path / "peft"
    peft_dir.save_adapters(unrolled, random_adapters(unrolled, cfg), cfg, written)
    _, stacked = peft_dir.load_adapters(model, written)
    assert stacked["layers"]["block_3"]["q_proj"]["lora_a"].shape[0] == 2
    peft_dir.save_adapters(model, stacked, cfg, tmp_path / "again")
    first, second = (
        load_file(str(d / peft_config.ADAPTER_WEIGHTS)) for d in (written, tmp_path / "again")
    )
    assert sorted(first) == sorted(second)
    for key, value in first.items():
        np.testing.assert_array_equal(second[key], value, err_msg=key)


# config.json of Qwen/Qwen3.5-27B as published (the multimodal file; its text tower's).
PUBLISHED_27B = {
    "model_type": "qwen3_5",
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "mtp_num_hidden_layers": 1,
        "num_attention_heads": 24,
        "num_hidden_layers": 64,
        "num_key_value_heads": 4,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "vocab_size": 248320,
    },
}
# The parameters of transformers' causal LM of each gin file's exported config.json, counted
# once on the meta device (`sum(p.numel() for p in model.parameters())`; the published
# Qwen3.5 sizes count the vision tower too).
GIN_FILES = {
    "qwen3_next_tiny": dict(model_type="qwen3_next", params=1_650_488),
    "qwen3_5_tiny": dict(model_type="qwen3_5_text", params=908_600),
    "qwen3_5_moe_tiny": dict(model_type="qwen3_5_moe_text", params=1_650_488),
    "qwen3_next_80b_a3b": dict(num_experts=512, params=79_674_391_296),
    "qwen3_5_27b": dict(hidden_size=5120, linear_num_value_heads=48, params=26_895_998_464),
    "qwen3_5_35b_a3b": dict(num_experts=256, num_layers=40, params=34_660_610_688),
}


@pytest.mark.parametrize("name", sorted(GIN_FILES))
def test_gin_model_file_builds_its_config_with_transformers_parameter_count(repo_dir, name):
    config = gin_config(repo_dir, name, qwen3_next.Qwen3NextConfig)
    expected = dict(GIN_FILES[name])
    params = expected.pop("params")
    for field, value in expected.items():
        assert getattr(config, field) == value, field
    assert config.vocab_size % 128 == 0 and config.per_layer_types[-1] == F
    assert config.num_params() == params


def test_config_json_as_transformers_resolves_it():
    """transformers 4's spelling (top-level rope_theta and partial_rotary_factor, no
    layer_types: every full_attention_interval-th layer full) reads as transformers 5's
    Qwen3NextConfig resolves it."""
    legacy = dict(
        model_type="qwen3_next", num_hidden_layers=8, full_attention_interval=4,
        rope_theta=1e7, partial_rotary_factor=0.25, rope_scaling=None,
    )  # fmt: skip
    read = qwen3_next_hf.config_from_hf(legacy)
    resolved = qwen3_next_hf.config_from_hf(transformers.Qwen3NextConfig(**legacy).to_dict())
    assert read.per_layer_types == resolved.per_layer_types == (L, L, L, F) * 2
    fields = ("rope_theta", "partial_rotary_factor", "rope_scaling_type", "num_experts")
    assert [getattr(read, f) for f in fields] == [getattr(resolved, f) for f in fields]
    assert (read.rope_theta, read.rotary_dim, read.num_experts) == (1e7, 64, 512)


def test_published_config_json_reads_as_the_gin_file(repo_dir):
    from_gin = gin_config(repo_dir, "qwen3_5_27b", qwen3_next.Qwen3NextConfig)
    _, read = hf.config_from_hf_dict(PUBLISHED_27B)
    ignored = {f.name for f in dataclasses.fields(options.ComputeOptions)}
    ignored |= {"real_vocab_size", "linear_attention_chunk_size"}
    for field in dataclasses.fields(qwen3_next.Qwen3NextConfig):
        if field.name not in ignored:
            assert getattr(read, field.name) == getattr(from_gin, field.name), field.name
