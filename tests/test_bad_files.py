"""Quantized, adapter and MoE config files are checked before they are trusted: a tensor whose
dtype or shape is not what its format stores, or a config.json without a field flaxlm needs,
is a ValueError naming the file, the tensor (or field), what it holds and what was expected,
raised before any device work (an import writes nothing to MODEL_DIR).

The bad files are the other tests' tiny Hub-style files with one thing changed: gpt-oss's
MXFP4 experts (tests/test_hf_gpt_oss.py), DeepSeek-V3's block-FP8 weights
(tests/test_hf_deepseek.py), PEFT adapters over a tiny Llama and a tiny Qwen3-MoE's experts
(tests/test_peft.py, tests/test_peft_experts.py).
"""

import json
import os

import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from flaxlm.checkpoints import fp8, hf, hf_files, mxfp4, peft_config, peft_dir
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs.serve.adapters import load_adapters as serve_adapters
from tests.hf_helpers import random_hf_model
from tests.test_hf_deepseek import FP8_BLOCK, fp8_blocks, is_fp8_in_the_hub_files, tiny_hf_deepseek
from tests.test_hf_deepseek import PLAIN as DEEPSEEK
from tests.test_hf_gpt_oss import CONFIG as GPT_OSS
from tests.test_hf_gpt_oss import mxfp4_experts
from tests.test_hf_llama import tiny_hf_llama
from tests.test_hf_moe import COMMON, FAMILIES
from tests.test_main import run_main

FILE = "model.safetensors"


def write_dir(path, config, tensors, config_name="config.json", file=FILE):
    """A directory of `config` as JSON and `tensors` (torch) as one safetensors file."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, config_name), "w") as f:
        json.dump(config, f)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
    return str(path)


# ---------------------------------------------------------------- MXFP4 (gpt-oss)


@pytest.fixture(scope="module")
def gpt_oss_hub():
    """(config.json, tensors) of a tiny gpt-oss as the Hub stores it: MXFP4 experts."""
    model = random_hf_model(transformers.GptOssConfig, transformers.GptOssForCausalLM, **GPT_OSS)
    quantized = mxfp4_experts(model, np.random.default_rng(0))
    state = {k: v for k, v in model.state_dict().items() if f"{k}_blocks" not in quantized}
    config = {**model.config.to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    return config, {**state, **quantized}


# The pair checked first (sorted names); [expert 8, rows 32, groups 1, 16 bytes].
PAIR = "model.layers.0.mlp.experts.down_proj"


@pytest.mark.slow
def test_mxfp4_scales_stored_as_floats_refuse_the_import_writing_nothing(
    gpt_oss_hub, tmp_path, repo_dir
):
    """The user's file: its scales the powers of two themselves, as float32. A cast to bytes
    read every one as 2^-127 (expert weights ~1e-38), and the import succeeded."""
    config, tensors = gpt_oss_hub
    bad = {k: 2.0 ** (v.float() - 127) if k.endswith("_scales") else v for k, v in tensors.items()}
    hf_dir = write_dir(tmp_path / "hf", config, bad)
    model_dir = tmp_path / "run"

    result = run_main(
        [
            "--gin_file=gin/runs/import_hf.gin",
            f"--gin.HF_DIR='{hf_dir}'",
            f"--gin.MODEL_DIR='{model_dir}'",
        ],
        cwd=repo_dir,
        devices=8,
    )

    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {hf_dir}/{FILE}: tensor '{PAIR}_scales' holds float32, but MXFP4 scales are "
        "uint8 (E8M0 exponents): the file was not written as the Hub's gpt-oss files are; "
        "store the expert weights unquantized instead."
    ], result.stderr[-3000:]
    assert not model_dir.exists()


MXFP4_CHANGES = {
    "blocks_of_signed_bytes": (
        f"{PAIR}_blocks",
        lambda t: t.view(torch.int8),
        f"tensor '{PAIR}_blocks' holds int8, but MXFP4 blocks are uint8",
    ),
    "blocks_not_16_bytes_a_group": (
        f"{PAIR}_blocks",
        lambda t: t[..., :8],
        f"tensor '{PAIR}_blocks' has shape (8, 32, 1, 8), but MXFP4 blocks are [..., rows, "
        "groups, 16]",
    ),
    "scales_of_fewer_experts": (
        f"{PAIR}_scales",
        lambda t: t[:7],
        f"tensor '{PAIR}_scales' has shape (7, 32, 1), but the scales of blocks "
        "(8, 32, 1, 16) are (8, 32, 1)",
    ),
}


@pytest.mark.parametrize("change", list(MXFP4_CHANGES))
def test_mxfp4_pairs_not_in_the_format_are_refused_naming_the_tensor(gpt_oss_hub, tmp_path, change):
    config, tensors = gpt_oss_hub
    name, edit, message = MXFP4_CHANGES[change]
    path = write_dir(tmp_path, config, {**tensors, name: edit(tensors[name])})
    with pytest.raises(ValueError) as e:
        mxfp4.DequantizedReader(hf_files.SafetensorsReader(path))
    assert str(e.value).startswith(f"{path}/{FILE}: {message}"), str(e.value)


def test_mxfp4_dequantize_refuses_scales_that_are_not_bytes():
    blocks = np.zeros((2, 1, 16), np.uint8)
    with pytest.raises(ValueError, match="uint8, not uint8 and float32"):
        mxfp4.dequantize(blocks, np.full((2, 1), 2.0**-5, np.float32))


# ---------------------------------------------------------------- FP8 (DeepSeek-V3)


@pytest.fixture(scope="module")
def deepseek_hub(tmp_path_factory):
    """(config.json with its quantization_config, tensors) of a tiny DeepSeek-V3 as the Hub
    stores it: block-FP8 Linear weights, each with its float32 `weight_scale_inv`."""
    path = tmp_path_factory.mktemp("deepseek")
    tiny_hf_deepseek(**DEEPSEEK).save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    stored = {}
    for name, tensor in load_file(str(path / FILE)).items():
        if is_fp8_in_the_hub_files(name, tensor):
            stored[name], stored[name + fp8.SCALE] = fp8_blocks(tensor)
        else:
            stored[name] = tensor
    quantization = dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=FP8_BLOCK
    )
    return {**config, "quantization_config": quantization}, stored


def test_fp8_file_whose_config_lacks_quantization_config_is_refused_saying_so(
    deepseek_hub, tmp_path
):
    """It was refused as tensors with "no place in the model (more layers than
    num_layers?)"."""
    config, tensors = deepseek_hub
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    path = write_dir(tmp_path, config, tensors)
    first = sorted(n for n in tensors if tensors[n].dtype == torch.float8_e4m3fn)[0]
    with pytest.raises(ValueError) as e:
        hf.from_pretrained(path)
    assert str(e.value).startswith(
        f"{path}/{FILE}: tensor {first!r} (float8_e4m3fn) is a block-FP8 checkpoint's, but "
        f"{path}/config.json says no quantization_config: restore the checkpoint's own "
        "config.json"
    ), str(e.value)


def _first_quantized(tensors):
    return sorted(n for n in tensors if n + fp8.SCALE in tensors)[0]


FP8_CHANGES = {
    "weights_in_bfloat16": (
        "",
        lambda t: t.to(torch.bfloat16),
        "tensor '{w}' holds bfloat16, but config.json's quantization_config (fmt e4m3) stores "
        "float8_e4m3fn weights.",
    ),
    "scales_as_exponent_bytes": (
        fp8.SCALE,
        lambda t: t.to(torch.uint8),
        "tensor '{w}_scale_inv' holds uint8, but config.json's quantization_config (fmt e4m3) "
        "stores float32 block scales.",
    ),
    "scales_of_another_block_grid": (
        fp8.SCALE,
        lambda t: t[:, :1],
        "tensor '{w}_scale_inv' has shape ({rows}, 1), but a weight of {shape} with "
        "config.json's weight_block_size [16, 12] has ({rows}, {cols}) scales.",
    ),
    "weight_without_scales": (
        fp8.SCALE,
        None,
        "tensor '{w}' holds float8_e4m3fn but has no '{w}_scale_inv' beside it",
    ),
}


@pytest.mark.parametrize("change", list(FP8_CHANGES))
def test_fp8_tensors_not_in_the_format_are_refused_naming_the_tensor(
    deepseek_hub, tmp_path, change
):
    config, tensors = deepseek_hub
    suffix, edit, message = FP8_CHANGES[change]
    weight = _first_quantized(tensors)
    changed = dict(tensors)
    if edit is None:
        del changed[weight + suffix]
    else:
        changed[weight + suffix] = edit(tensors[weight + suffix])
    path = write_dir(tmp_path, config, changed)
    rows, cols = tensors[weight + fp8.SCALE].shape
    message = message.format(w=weight, shape=tuple(tensors[weight].shape), rows=rows, cols=cols)
    with pytest.raises(ValueError) as e:
        fp8.dequantized(hf_files.SafetensorsReader(path), path)
    assert str(e.value).startswith(f"{path}/{FILE}: {message}"), str(e.value)


# ---------------------------------------------------------------- MoE config.json


def _moe_configs():
    """config.json dicts of tiny MoEs of each family transformers writes them for."""
    out = {n: cls(**{**COMMON, **extra}).to_dict() for n, (cls, _, extra) in FAMILIES.items()}
    out["gpt_oss"] = transformers.GptOssConfig(**GPT_OSS).to_dict()
    out["deepseek_v3"] = transformers.DeepseekV3Config(**DEEPSEEK).to_dict()
    return out


MOE_CONFIGS = _moe_configs()
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
# (family, the field taken out): every family refuses a config.json without its number of
# experts or of experts a token, but DeepSeek-V3, whose reader takes transformers' defaults
# for them; every family a field it reads with [].
MOE_ROWS = [
    *(
        (family, key)
        for family in sorted(MOE_CONFIGS)
        if family != "deepseek_v3"
        for key in (
            next(k for k in EXPERTS if k in MOE_CONFIGS[family]),
            "num_experts_per_tok",
        )
    ),
    *((family, "hidden_size") for family in sorted(MOE_CONFIGS)),
    ("deepseek_v3", "num_attention_heads"),
    ("mixtral", "intermediate_size"),
]


@pytest.mark.parametrize("family,field", MOE_ROWS, ids=[f"{f}-{k}" for f, k in MOE_ROWS])
def test_moe_config_without_a_field_flaxlm_needs_is_refused_naming_it(family, field):
    config = {k: v for k, v in MOE_CONFIGS[family].items() if k != field}
    hf.config_from_hf_dict(MOE_CONFIGS[family])  # (the whole config.json is read)
    with pytest.raises(ValueError) as e:
        hf.config_from_hf_dict(config)
    first = str(e.value).splitlines()[0]  # (Gin adds the configurable's name below)
    if field in EXPERTS:
        assert first.startswith("num_experts is not set: an MoE model needs it") and field in first
    else:
        assert first == f"config.json has no {field!r}, which the model needs."


# ---------------------------------------------------------------- PEFT adapters

A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_KEY = A_KEY.replace("lora_A", "lora_B")


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory):
    """(flaxlm model of a tiny Llama, adapter_config.json, tensors) of a rank-4 PEFT adapter
    made by `peft` over its q_proj and v_proj (width 32)."""
    torch_model, base = tiny_hf_llama(tmp_path_factory.mktemp("llama"))
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    path = tmp_path_factory.mktemp("adapter")
    peft.get_peft_model(torch_model, config).save_pretrained(str(path))
    record = json.loads((path / peft_config.ADAPTER_CONFIG).read_text())
    tensors = load_file(str(path / peft_config.ADAPTER_WEIGHTS))
    return hf.model_from_hf_dir(base), {**record, "base_model_name_or_path": base}, tensors


def write_adapter(path, config, tensors):
    return write_dir(path, config, tensors, peft_config.ADAPTER_CONFIG, peft_config.ADAPTER_WEIGHTS)


def _wider(tensors):
    """The adapter of a model twice as wide: every pair's in and out dims doubled."""
    out = {}
    for key, t in tensors.items():
        out[key] = torch.randn(4, 64) if ".lora_A." in key else torch.randn(2 * t.shape[0], 4)
    return out


PEFT_CHANGES = {
    "a_and_b_of_two_ranks": (
        {},
        lambda t: {**t, B_KEY: torch.randn(32, 8)},
        f"tensor {A_KEY!r} (4, 32) has rank 4 but {B_KEY!r} (32, 8) rank 8: lora_A is [r, in] "
        "and lora_B [out, r] of one rank.",
    ),
    "adapter_of_a_wider_model": (
        {},
        _wider,
        f"tensors {A_KEY!r} (4, 64) and {B_KEY!r} (64, 4) do not fit the base model's ",
    ),
    "config_rank_not_the_tensors": (
        {"r": 16},
        lambda t: t,
        f"tensor {A_KEY!r} (4, 32) has rank 4, but {{path}}/adapter_config.json says r=16 for "
        "model.layers.0.self_attn.q_proj",
    ),
}


@pytest.mark.parametrize("change", list(PEFT_CHANGES))
def test_peft_adapter_that_does_not_fit_its_base_is_refused_naming_the_tensor(
    llama_adapter, tmp_path, change
):
    model, config, tensors = llama_adapter
    update, edit, message = PEFT_CHANGES[change]
    path = write_adapter(tmp_path / "adapter", {**config, **update}, edit(dict(tensors)))
    message = f"{path}/{peft_config.ADAPTER_WEIGHTS}: {message.format(path=path)}"
    with pytest.raises(ValueError) as e:
        peft_dir.load_adapters(model, path)
    assert str(e.value).startswith(message), str(e.value)
    if change == "adapter_of_a_wider_model":
        assert "expected (4, 32) and (32, 4) (rank 4); is it an adapter of another model?" in str(
            e.value
        )
    # serve's LORA_ADAPTERS reads it the same way (before any device work: no params needed).
    with pytest.raises(ValueError) as e:
        serve_adapters({"bad": path}, model, None, Partitioner(), "base")
    assert str(e.value).startswith(f"LORA_ADAPTERS['bad'] ({path}): {message}"), str(e.value)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """The flaxlm model of a tiny Qwen3-MoE (8 experts, width 32, experts 16 wide)."""
    config_cls, model_cls, extra = FAMILIES["qwen3_moe"]
    path = tmp_path_factory.mktemp("qwen3_moe")
    random_hf_model(config_cls, model_cls, **{**COMMON, **extra}).save_pretrained(str(path))
    return hf.model_from_hf_dir(str(path))


EXPERT_A = "base_model.model.model.layers.{i}.mlp.experts.lora_A.weight"


@pytest.mark.parametrize(
    "b_shape,message",
    [
        ((32, 3 * 8), "has rank 2 but {b!r} (32, 24) rank 3: lora_A is [r * 8 experts, in]"),
        ((48, 2 * 8), "do not fit the base model's"),
    ],
    ids=["a_and_b_of_two_ranks", "adapter_of_a_wider_model"],
)
def test_peft_expert_adapter_that_does_not_fit_is_refused_naming_the_tensor(
    qwen3_moe, tmp_path, b_shape, message
):
    """PEFT's pair over `mlp.experts.down_proj` `[expert, embed 32, mlp 16]`: lora_A
    `[r * 8, 16]`, lora_B `[32, r * 8]`."""
    config = dict(
        peft_type="LORA", r=2, lora_alpha=4, target_modules=[], target_parameters=["down_proj"]
    )
    tensors = {}
    for i in range(2):
        tensors[EXPERT_A.format(i=i)] = torch.randn(2 * 8, 16)
        tensors[EXPERT_A.format(i=i).replace("lora_A", "lora_B")] = torch.randn(*b_shape)
    path = write_adapter(tmp_path, config, tensors)
    a, b = EXPERT_A.format(i=0), EXPERT_A.format(i=0).replace("lora_A", "lora_B")
    with pytest.raises(ValueError) as e:
        peft_dir.load_adapters(qwen3_moe, path)
    assert str(e.value).startswith(f"{path}/{peft_config.ADAPTER_WEIGHTS}: tensor"), str(e.value)
    assert a in str(e.value) and message.format(b=b) in str(e.value), str(e.value)
