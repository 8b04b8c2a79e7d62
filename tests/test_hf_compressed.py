"""Files quantized in compressed-tensors' format, read dequantized as transformers reads them.

Each file is made as llm-compressor makes one, by compressed-tensors itself: its schemes
applied to a tiny random torch model, its `calculate_qparams` giving the scales (and zero
points) from the weights, its `ModelCompressor` compressing the modules and writing the
quantization_config. transformers (with compressed-tensors installed) loads the file and
decompresses it: flaxlm's logits must be that model's and its params the decompressed
weights, bit for bit (float32 scales: the product is exact in float32 both ways).
"""

import json
import math

import jax
import numpy as np
import pytest
import torch
import transformers

from flaxlm.checkpoints import compressed, hf
from flaxlm.parallel.partitioning import Partitioner
from tests.hf_helpers import decoder_batch, max_abs_diff, padded_batch, torch_logits

VOCAB = 120
# float32 logits of 2-layer models whose values are O(1): other summation orders round at
# ~eps x sqrt(width) x depth ~ 1e-6; 1e-4 is what every family meets.
LOGITS_TOL = 1e-4
LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,
)
# Kimi K2 Thinking's layout: a DeepSeek-V3 whose routed experts alone are INT4 (groups of
# 32), the attention, shared experts, dense layer and head left plain.
KIMI = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    max_position_embeddings=64,
    initializer_range=0.1,
    rope_interleave=True,
)
KIMI_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|down)_proj$",
]
# name: (model, weights' QuantizationArgs, input activations', format, ignore)
SCHEMES = {
    # llm-compressor's W4A16: 4-bit symmetric groups (group_size 16 here, 128 on the Hub)
    "w4a16_group": ("llama", dict(num_bits=4, strategy="group", group_size=16), None,
                    "pack-quantized", ["lm_head"]),
    # 4-bit asymmetric, a scale and a zero point (packed too) a row
    "w4_asymmetric_channel": ("llama", dict(num_bits=4, strategy="channel", symmetric=False),
                              None, "pack-quantized", ["lm_head"]),
    # 3 bits a value: values that straddle the int32 words
    "w3_group": ("llama", dict(num_bits=3, strategy="group", group_size=32), None,
                 "pack-quantized", ["lm_head"]),
    # FP8 W8A8 with a static input scale a Linear (read past: flaxlm computes in float)
    "fp8_channel_static_inputs": (
        "llama", dict(num_bits=8, type="float", strategy="channel"),
        dict(num_bits=8, type="float", strategy="tensor", dynamic=False),
        "float-quantized", ["lm_head"],
    ),
    # INT8 stored unpacked, asymmetric groups (zero points int8)
    "int8_asymmetric_group": ("llama", dict(num_bits=8, strategy="group", group_size=32,
                              symmetric=False), None, "int-quantized", ["lm_head"]),
    "kimi_k2_thinking_int4_experts": ("kimi", dict(num_bits=4, strategy="group", group_size=32),
                                      None, "pack-quantized", KIMI_IGNORE),
}  # fmt: skip


def random_model(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**LLAMA)
        model_cls = transformers.LlamaForCausalLM
    else:
        config = transformers.DeepseekV3Config(**KIMI)
        model_cls = transformers.DeepseekV3ForCausalLM
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def qparams_of(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' scale and zero point for `weight` under `args`, from the min and
    max over what each scale covers (its minmax observer's, on the weight alone)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    rows, cols = weight.shape
    if args.strategy == "tensor":
        lo, hi = weight.min().reshape(1), weight.max().reshape(1)
    elif args.strategy == "channel":
        lo, hi = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    else:
        groups = weight.reshape(rows, math.ceil(cols / args.group_size), args.group_size)
        lo, hi = groups.amin(-1), groups.amax(-1)
    return calculate_qparams(lo, hi, args)


def scheme_of(name: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    _, weights, inputs, _, _ = SCHEMES[name]
    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**weights),
        input_activations=QuantizationArgs(**inputs) if inputs else None,
    )


def save_compressed(path, name: str) -> None:
    """The `SCHEMES[name]` file of a tiny random model, saved at `path` as llm-compressor
    saves one: a Llama compressed by compressed-tensors' `ModelCompressor`; Kimi K2
    Thinking's experts (one Linear each in the Hub's files, fused in transformers 5's model,
    which compressed-tensors' targets do not reach) compressed one by one, as its files
    store them."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file, save_file

    kind, _, _, fmt, ignore = SCHEMES[name]
    model, scheme = random_model(kind), scheme_of(name)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore, format=fmt)
    if kind == "kimi":
        model.save_pretrained(str(path))
        stored, out = load_file(str(path / "model.safetensors")), {}
        for key, weight in stored.items():
            if ".experts." not in key:
                out[key] = weight
                continue
            scale, _ = qparams_of(weight, scheme.weights)
            state = {"weight": weight, "weight_scale": scale}
            packed = BaseCompressor.get_value_from_registry(fmt).compress(state, scheme)
            out.update({f"{key.removesuffix('weight')}{p}": t for p, t in packed.items()})
        save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
        hf_config = json.loads((path / "config.json").read_text())
        config.quantization_status = "compressed"
        quant = config.model_dump(exclude=["quant_method"])
        hf_config["quantization_config"] = {"quant_method": "compressed-tensors", **quant}
        (path / "config.json").write_text(json.dumps(hf_config))
        return
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                scale, zero = qparams_of(module.weight, scheme.weights)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
                if hasattr(module, "input_scale"):
                    module.input_scale.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(path))
    compressor.update_config(str(path))


def decompressed_weights(path, name: str) -> dict[str, np.ndarray]:
    """Each quantized module's weight in the file at `path`, as compressed-tensors'
    compressor for its format decompresses it (float32)."""
    from compressed_tensors.compressors import BaseCompressor
    from safetensors.torch import load_file

    stored = load_file(str(path / "model.safetensors"))
    compressor = BaseCompressor.get_value_from_registry(SCHEMES[name][3])
    out = {}
    for key in (k for k in stored if k.endswith(".weight_scale")):
        module = key.removesuffix(".weight_scale")
        state = {
            k.removeprefix(f"{module}."): v for k, v in stored.items() if k.startswith(f"{module}.")
        }
        weight = compressor.decompress(state, scheme_of(name))["weight"]
        out[f"{module}.weight"] = weight.float().numpy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_compressed_tensors_file_reads_as_transformers_decompresses_it(name, tmp_path, capsys):
    from compressed_tensors.quantization.lifecycle.helpers import disable_quantization

    save_compressed(tmp_path, name)
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == SCHEMES[name][3]
    reference = decompressed_weights(tmp_path, name)
    if name == "w4_asymmetric_channel":
        # transformers 5.23 cannot load packed zero points (it expects them unpacked and
        # reinitialises them): the model the file stands for is the float one with
        # compressed-tensors' decompressed weights.
        theirs_model = random_model("llama")
        theirs_model.load_state_dict(
            {k: torch.from_numpy(v) for k, v in reference.items()}, strict=False
        )
    else:
        theirs_model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path), output_loading_info=True
        )
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    if SCHEMES[name][2]:  # W8A8: flaxlm computes the inputs unquantized, as weight-only does
        theirs_model.apply(disable_quantization)
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    theirs = torch_logits(theirs_model.eval(), input_ids=ids, attention_mask=mask)

    mesh = (
        Partitioner((1, 2, 2, 2), ("data", "fsdp", "expert", "tensor")) if "kimi" in name else None
    )
    model, params = hf.from_pretrained(tmp_path, mesh)
    ours = np.asarray(jax.jit(model.compute_logits)(params, decoder_batch(ids, mask)))
    assert max_abs_diff(ours, theirs, mask) < LOGITS_TOL
    # The weights are compressed-tensors' decompression, bit for bit.
    state = dict(hf.hf_state_dict(model, params))
    assert reference and ("kimi" not in name or all(".experts." in k for k in reference))
    for key, weight in reference.items():
        np.testing.assert_array_equal(state[key], weight, err_msg=key)
    noted = "quantizes input_activations too" in capsys.readouterr().out
    assert noted == bool(SCHEMES[name][2])


@pytest.mark.parametrize("bits", range(1, 9))
def test_unpacking_gives_what_compressed_tensors_packed(bits):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    rng = np.random.default_rng(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    values = rng.integers(lo, hi + 1, size=(5, 45)).astype(np.int8)  # 45: no word boundary
    packed = pack_to_int32(torch.from_numpy(values), bits).numpy()
    np.testing.assert_array_equal(compressed.unpack(packed, bits, 45), values)


GROUP = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
         "group_size": 16, "symmetric": True}}  # fmt: skip


def weights(**change) -> dict:
    """config_groups of GROUP with its weights changed."""
    return dict(config_groups={"g": {**GROUP, "weights": {**GROUP["weights"], **change}}})


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(format="nvfp4-pack-quantized"), "format"),
        (dict(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
        (dict(transform_config={"config_groups": {"u": {"type": "hadamard"}}}), "transform_config"),
        (weights(strategy="tensor_group"), "strategy"),
        (weights(dynamic=True), "dynamic"),
        (weights(group_size=None), "group_size"),
        (weights(type="float"), "weight type"),
        (weights(num_bits=16), "num_bits"),
    ],
    ids=str,
)  # fmt: skip
def test_settings_flaxlm_cannot_read_are_refused_naming_them(change, named):
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"g": GROUP}, **change}  # fmt: skip
    config = {**LLAMA, "model_type": "llama", "quantization_config": quant}
    with pytest.raises(ValueError, match=named):
        hf.config_from_hf_dict(config)
    with pytest.raises(ValueError, match="quant_method is 'gptq'"):
        hf.config_from_hf_dict({**config, "quantization_config": {"quant_method": "gptq"}})
