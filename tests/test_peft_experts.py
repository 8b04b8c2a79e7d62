"""LoRA on MoE experts and routers to and from PEFT adapter directories: flaxlm's per-expert
pairs over `experts/wi` / `experts/wo` are PEFT's `target_parameters` over transformers' fused
`mlp.experts.gate_up_proj` / `down_proj`, and a pair over the router (`mlp/gate/kernel`) is
one over its weight (`mlp.gate.weight`), with PEFT's logits both ways."""

import copy
import dataclasses
import json

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import traverse_util
from safetensors.numpy import load_file

from flaxlm.checkpoints import hf, peft_config, peft_dir, run_dir
from flaxlm.models import gpt_oss
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import lora
from tests.hf_helpers import decoder_batch, gin_config, max_abs_diff, padded_batch, torch_logits
from tests.test_hf_deepseek import FULL, tiny_hf_deepseek
from tests.test_hf_gpt_oss import CONFIG as GPT_OSS
from tests.test_hf_moe import COMMON, FAMILIES, REPO, VOCAB, random_hf_model
from tests.test_peft import peft_logits

# The tiny MoEs' logits are O(1-10) (initializer_range 0.1, adapters of the same scale);
# float32 over widths of 16-48 and 2 layers in two frameworks (other summation orders, PEFT's
# unmerged experts against flaxlm's merged) differ by ~eps (1.2e-7) x sqrt(width) x depth x
# scale ~ 1e-5, so 1e-4 is a margin above the noise and far below an adapter's effect (> 1e-2).
TOL = 1e-4
# Experts, router and attention at different ranks: `rank_pattern` names the parameters.
RULES = (
    (r"experts/wi$", 2),
    (r"experts/wo$", 3),
    (r"(q|o)_proj/kernel$", 4),
    (r"mlp/gate/kernel$", 5),
)
# PEFT 0.21 warns that rank_pattern / alpha_pattern keys naming expert parameters "did not
# match any targeted module": it checks them against modules only, and applies them (its
# ParamWrapper's r and scaling are the pattern's; the logits below depend on it).
pytestmark = pytest.mark.filterwarnings(
    "ignore:The following (rank|alpha)_pattern keys:RuntimeWarning"
)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def family(request, tmp_path_factory):
    """A random tiny HF MoE saved as an HF directory, and flaxlm's unrolled and scanned
    models of it. Mixtral's MoE block is `block_sparse_moe` on the Hub, `mlp` in memory."""
    config_cls, model_cls, extra = FAMILIES[request.param]
    torch_model = random_hf_model(config_cls, model_cls, **{**COMMON, **extra})
    path = str(tmp_path_factory.mktemp(request.param))
    torch_model.save_pretrained(path)
    model, params = hf.from_pretrained(path)
    scanned = hf.model_from_hf_dir(path, config_overrides={"scan_layers": True})
    return torch_model, path, model, params, scanned


@pytest.fixture(scope="module")
def partitioner():
    return Partitioner(mesh_shape=(1, 4, 2))


def random_adapters(model, cfg, scale=0.1):
    """Non-zero A and B (training starts B at zero: an export of that proves nothing)."""
    kernels = lora.plan(cfg, model, model.example_batch_shapes())
    flat = traverse_util.flatten_dict(lora.init_adapters(jax.random.PRNGKey(0), kernels))
    rng = np.random.default_rng(0)
    flat = {k: scale * rng.standard_normal(v.shape).astype(np.float32) for k, v in flat.items()}
    return traverse_util.unflatten_dict(flat)


def flaxlm_logits(model, params, ids, mask):
    return np.asarray(jax.jit(model.compute_logits)(params, decoder_batch(ids, mask)))


@pytest.mark.slow
def test_expert_and_router_adapters_export_to_peft_with_our_logits_and_import_back(
    family, tmp_path
):
    torch_model, base, model, params, scanned = family
    cfg = lora.LoraConfig(rules=RULES, alpha=8.0)
    adapters = random_adapters(model, cfg)
    out = tmp_path / "peft"
    peft_dir.save_adapters(model, adapters, cfg, out, base_model_name_or_path=base)

    config = json.loads((out / peft_config.ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["o_proj", "q_proj"]
    assert config["target_parameters"] == [
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
        "mlp.gate.weight",  # Mixtral's too: transformers 5's name in memory
    ]
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["rank_pattern"] == {"down_proj": 3, "gate_up_proj": 2, "gate.weight": 5}
    # PEFT nests the two wrappers of a layer's experts: down_proj's outside gate_up_proj's.
    stored = load_file(str(out / peft_config.ADAPTER_WEIGHTS))
    experts = "base_model.model.model.layers.1.mlp.experts"
    assert stored[f"{experts}.lora_A.weight"].shape == (3 * 8, 16)  # [r * experts, mlp]
    assert stored[f"{experts}.base_layer.lora_B.weight"].shape == (2 * 16, 2 * 8)
    router = "base_model.model.model.layers.1.mlp.gate"  # a Linear's pair: [r, embed], [expert, r]
    assert stored[f"{router}.lora_A.weight"].shape == (5, 32)
    assert stored[f"{router}.lora_B.weight"].shape == (8, 5)

    ids, mask = padded_batch(VOCAB, (12, 7, 12, 3))
    theirs, all_keys = peft_logits(torch_model, str(out), ids, mask)
    assert all_keys
    ours = flaxlm_logits(model, lora.merge(params, adapters, cfg), ids, mask)
    assert max_abs_diff(ours, theirs, mask) < TOL
    # The experts' adapters alone move the logits, and so do the router's: their mappings
    # are what the match checks.
    flat = traverse_util.flatten_dict(adapters, sep="/")
    for part in ("/experts/", "/gate/"):
        without = {k: v * (part not in k) for k, v in flat.items()}
        without = lora.merge(params, traverse_util.unflatten_dict(without, sep="/"), cfg)
        assert max_abs_diff(flaxlm_logits(model, without, ids, mask), theirs, mask) > 1e-2

    imported_cfg, imported = peft_dir.load_adapters(model, out)
    assert imported_cfg.rules == (
        ("(^|/)(experts/wi)$", 2),
        ("(^|/)(experts/wo)$", 3),
        ("(^|/)(o_proj|q_proj)/kernel$", 4),
        ("(^|/)(gate)/kernel$", 5),
    )
    back = traverse_util.flatten_dict(imported, sep="/")
    assert sorted(back) == sorted(flat)
    for key, value in flat.items():  # transposes and reshapes only: exact
        np.testing.assert_array_equal(back[key], value, err_msg=key)

    # Scanned: the same adapters stacked over layers, exported to the same file.
    _, stacked = peft_dir.load_adapters(scanned, out)
    again = tmp_path / "scanned"
    peft_dir.save_adapters(scanned, stacked, cfg, again, base_model_name_or_path=base)
    assert json.loads((again / peft_config.ADAPTER_CONFIG).read_text()) == config
    for key, value in load_file(str(again / peft_config.ADAPTER_WEIGHTS)).items():
        np.testing.assert_array_equal(value, stored[key], err_msg=key)


@pytest.mark.slow
def test_peft_expert_adapter_imports_with_peft_logits(family, partitioner, tmp_path):
    """PEFT's own adapter (random A and B): down_proj on every layer, gate_up_proj on layer
    1 only (its wrapper nested inside), an alpha_pattern folded into A, the router at its
    own rank; unrolled and scanned (layer 0's gate_up pair zeros)."""
    torch_model, base, _, _, scanned = family
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules=["v_proj"],
        target_parameters=[
            "mlp.experts.down_proj",
            "model.layers.1.mlp.experts.gate_up_proj",
            "mlp.gate.weight",
        ],
        alpha_pattern={"gate_up_proj": 6},
        rank_pattern={"gate.weight": 3},
        init_lora_weights=False,
    )
    path = tmp_path / "theirs"
    peft.get_peft_model(copy.deepcopy(torch_model), config).save_pretrained(str(path))
    config_file = path / peft_config.ADAPTER_CONFIG
    record = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**record, "base_model_name_or_path": base}))

    ids, mask = padded_batch(VOCAB, (12, 7, 12, 3))
    theirs, _ = peft_logits(torch_model, str(path), ids, mask)
    base_logits = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(base_logits, theirs, mask) > 1e-2
    model, merged, *_ = run_dir.load_model_and_params(str(path), partitioner)
    assert max_abs_diff(flaxlm_logits(model, merged, ids, mask), theirs, mask) < TOL
    _, merged, *_ = run_dir.load_model_and_params(str(path), partitioner, model=scanned)
    assert max_abs_diff(flaxlm_logits(scanned, merged, ids, mask), theirs, mask) < TOL
    _, adapters = peft_dir.load_adapters(scanned, path)
    gate_up = adapters["layers"]["block"]["mlp"]["experts"]["wi_lora_a"]
    assert not gate_up[0].any() and gate_up[1].any()
    assert adapters["layers"]["block"]["mlp"]["gate"]["lora_a"].shape == (2, 32, 3)


def test_exports_peft_cannot_read_are_errors_naming_them(family, tmp_path):
    """Refused before any array is read: gpt-oss's experts (`[expert, in, out]`, gate and up
    interleaved, with biases) have no PEFT mapping; a Qwen3-MoE dense layer's `down_proj`
    (`mlp_only_layers`) PEFT would load onto the experts (it reads target_modules named
    down_proj of a qwen3_moe as the fused experts' parameters)."""
    zeros = np.zeros((1,), np.float32)
    oss = DecoderOnlyModel(gin_config(REPO, "gpt_oss_tiny", gpt_oss.GptOssConfig))
    adapters = {"layers_0": {"mlp": {"experts": {"wi_lora_a": zeros, "wi_lora_b": zeros}}}}
    cfg = lora.LoraConfig(rules=((r"experts/wi$", 2),))
    with pytest.raises(ValueError, match=r"layers_0/mlp/experts/wi.*GptOssConfig"):
        peft_dir.save_adapters(oss, adapters, cfg, tmp_path / "oss")
    model = family[2]
    if model.config.model_type != "qwen3_moe":
        return
    dense = DecoderOnlyModel(dataclasses.replace(model.config, mlp_only_layers=(0,)))
    adapters = {"layers_0": {"mlp": {"down_proj": {"lora_a": zeros, "lora_b": zeros}}}}
    cfg = lora.LoraConfig(rules=((r"down_proj/kernel$", 2),))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.*onto the experts"):
        peft_dir.save_adapters(dense, adapters, cfg, tmp_path / "dense")
    assert not (tmp_path / "oss").exists() and not (tmp_path / "dense").exists()


def test_peft_target_parameter_flaxlm_does_not_map_is_an_error(family, tmp_path):
    _, base, model, _, _ = family
    out = tmp_path / "bias"
    out.mkdir()
    record = {"peft_type": "LORA", "r": 2, "target_modules": [], "base_model_name_or_path": base}
    record["target_parameters"] = ["mlp.experts.gate_up_proj_bias"]
    (out / peft_config.ADAPTER_CONFIG).write_text(json.dumps(record))
    (out / peft_config.ADAPTER_WEIGHTS).write_bytes(b"")
    with pytest.raises(ValueError, match="target_parameters entry 'mlp.experts.gate_up_proj_bias'"):
        peft_dir.load_adapters(model, out)


# The other families' routers: those PEFT refuses as `target_modules` (Qwen2-MoE's `mlp.gate`,
# a model type PEFT does not upgrade from transformers 4; gpt-oss's biased `mlp.router`),
# OLMoE's, and DeepSeek-V3's (float32 logits; layer 0 dense, without one). PEFT's logits are
# compared with those of flaxlm's merged export in torch, which test_hf_moe, test_hf_deepseek
# and test_hf_gpt_oss prove equal to flaxlm's own (no flaxlm compile here, for time).
OTHERS = ("deepseek_v3", "gpt_oss", "olmoe", "qwen2_moe")


def tiny_torch_moe(name):
    if name == "deepseek_v3":
        return tiny_hf_deepseek(**FULL)
    if name == "gpt_oss":
        return random_hf_model(transformers.GptOssConfig, transformers.GptOssForCausalLM, **GPT_OSS)
    config_cls, model_cls, extra = FAMILIES[name]
    return random_hf_model(config_cls, model_cls, **{**COMMON, **extra})


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHERS)
def test_router_adapters_export_as_peft_target_parameters_with_our_logits(name, tmp_path):
    torch_model = tiny_torch_moe(name)
    base = str(tmp_path / "base")
    torch_model.save_pretrained(base)
    model, params = hf.from_pretrained(base)
    cfg = lora.LoraConfig(rules=((r"mlp/gate/kernel$", 2),), alpha=8.0)
    adapters = random_adapters(model, cfg)
    out = tmp_path / "peft"
    peft_dir.save_adapters(model, adapters, cfg, out, base_model_name_or_path=base)
    config = json.loads((out / peft_config.ADAPTER_CONFIG).read_text())
    weight = "mlp.router.weight" if name == "gpt_oss" else "mlp.gate.weight"
    assert (config["target_modules"], config["target_parameters"]) == ([], [weight])

    merged = tmp_path / "merged"
    hf.save_pretrained(model, lora.merge(params, adapters, cfg), merged)
    merged_model = type(torch_model).from_pretrained(str(merged), dtype=torch.float32).eval()
    vocab = torch_model.config.vocab_size
    ids, mask = padded_batch(vocab, (12, 7, 12, 3))
    theirs, all_keys = peft_logits(torch_model, str(out), ids, mask)
    assert all_keys
    ours = torch_logits(merged_model, input_ids=ids, attention_mask=mask)
    base_logits = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, base_logits, mask) > 1e-2  # the router's adapter matters
    # torch both sides: PEFT's W + alpha / r * B @ A against flaxlm's merged W differ by
    # rounding alone (~eps x |W|), well inside TOL.
    assert max_abs_diff(ours, theirs, mask) < TOL

    # Scanned (DeepSeek-V3's MoE layers one stack after its dense first layer): the
    # adapters read stacked and write the same file.
    scanned = hf.model_from_hf_dir(base, config_overrides={"scan_layers": True})
    _, stacked = peft_dir.load_adapters(scanned, out)
    peft_dir.save_adapters(
        scanned, stacked, cfg, tmp_path / "scanned", base_model_name_or_path=base
    )
    stored = load_file(str(out / peft_config.ADAPTER_WEIGHTS))
    again = load_file(str(tmp_path / "scanned" / peft_config.ADAPTER_WEIGHTS))
    assert sorted(again) == sorted(stored)
    for key, value in again.items():
        np.testing.assert_array_equal(value, stored[key], err_msg=key)

    # Read back exactly; and so in transformers 4's spelling (the router a Linear among
    # `target_modules`, which PEFT refuses for Qwen2-MoE and gpt-oss): the same tensors.
    legacy = {**config, "target_modules": [weight.split(".")[1]], "target_parameters": None}
    flat = traverse_util.flatten_dict(adapters)
    for record in (config, legacy):
        (out / peft_config.ADAPTER_CONFIG).write_text(json.dumps(record))
        back = traverse_util.flatten_dict(peft_dir.load_adapters(model, out)[1])
        assert sorted(back) == sorted(flat)
        for key, value in flat.items():
            np.testing.assert_array_equal(back[key], value, err_msg=str(key))
