"""PEFT adapter directories in and out: a flaxlm LoRA run's adapters load in
`peft.PeftModel` with the adapted logits, and PEFT's adapters serve and train in flaxlm."""

import copy
import json
import os
import shutil

import jax
import numpy as np
import peft
import pytest
from flax import traverse_util
from safetensors.numpy import load_file

from flaxlm.checkpoints import checkpointer, hf, peft_config, peft_dir, run_dir
from flaxlm.data.config import DatasetConfig
from flaxlm.models.row_start import HF_START
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs import convert, train
from flaxlm.training import lora
from tests.hf_helpers import decoder_batch, max_abs_diff, padded_batch, torch_logits
from tests.test_hf_llama import tiny_hf_llama

# Logits of the tiny Llama are O(1) (|logit| < ~5); float32 matmuls over widths of 32-64 in
# two frameworks (different summation orders, merged vs unmerged adapters) differ by ~1e-6
# relative, so 1e-4 absolute is two orders above the noise and far below an adapter's effect.
TOL = 1e-4
RULES = ((r"(q|v)_proj/kernel$", 4), (r"o_proj/kernel$", 2), (r"down_proj/kernel$", 4))


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """A tiny random torch Llama saved as an HF directory (vocabulary of the stdlib_py task)."""
    torch_model, path = tiny_hf_llama(tmp_path_factory.mktemp("base"), vocab_size=384)
    return torch_model, path


@pytest.fixture(scope="module")
def partitioner():
    return Partitioner(mesh_shape=(1, 4, 2))


@pytest.fixture(scope="module")
def peft_adapters(hf_base, tmp_path_factory):
    """Two adapters made by `peft` itself (random A and B): ranks differing by module; the
    second on layer 1 only, with rsLoRA and an alpha_pattern (scales flaxlm folds into A)."""
    import torch

    configs = {
        "qvd": peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"down_proj": 2},
            init_lora_weights=False,
        ),
        "og_layer1": peft.LoraConfig(
            r=2,
            lora_alpha=4,
            target_modules=["o_proj", "gate_proj"],
            layers_to_transform=[1],
            use_rslora=True,
            alpha_pattern={"gate_proj": 6},
            init_lora_weights=False,
        ),
    }
    torch_model, base = hf_base
    out = {}
    for i, (name, config) in enumerate(configs.items()):
        torch.manual_seed(i)
        model = peft.get_peft_model(copy.deepcopy(torch_model), config)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(str(path))
        config_file = path / peft_config.ADAPTER_CONFIG
        record = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**record, "base_model_name_or_path": base}))
        out[name] = str(path)
    return out


def peft_logits(torch_model, adapter_dir, ids, mask):
    """PEFT's logits of `adapter_dir` over the torch base, and whether its keys all loaded."""
    model = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), adapter_dir).eval()
    saved = set(peft.utils.load_peft_weights(adapter_dir))
    expected = {k.replace(".default", "") for k in peft.get_peft_model_state_dict(model).keys()}
    return torch_logits(model, input_ids=ids, attention_mask=mask), saved == expected


@pytest.mark.slow
def test_peft_adapters_serve_in_flaxlm_with_peft_logits(hf_base, peft_adapters, partitioner):
    torch_model, base = hf_base
    ids, mask = padded_batch(384, (12, 7, 12, 3))
    base_logits = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    for name, path in peft_adapters.items():
        theirs, _ = peft_logits(torch_model, path, ids, mask)
        assert max_abs_diff(base_logits, theirs, mask) > 1e-2  # the adapter matters
        model, params, step, _ = run_dir.load_model_and_params(path, partitioner)
        assert step == 0
        ours = np.asarray(jax.jit(model.compute_logits)(params, decoder_batch(ids, mask)))
        assert max_abs_diff(ours, theirs, mask) < TOL, name
    # Scanned layers: layer 0 of og_layer1's stack holds zero adapters.
    scanned = hf.model_from_hf_dir(base, partitioner, config_overrides={"scan_layers": True})
    _, params, *_ = run_dir.load_model_and_params(
        peft_adapters["og_layer1"], partitioner, model=scanned
    )
    ours = np.asarray(jax.jit(scanned.compute_logits)(params, decoder_batch(ids, mask)))
    theirs, _ = peft_logits(torch_model, peft_adapters["og_layer1"], ids, mask)
    assert max_abs_diff(ours, theirs, mask) < TOL


def test_imported_config_adapts_exactly_peft_modules(hf_base, peft_adapters):
    model = hf.model_from_hf_dir(hf_base[1])
    cfg, adapters = peft_dir.load_adapters(model, peft_adapters["og_layer1"])
    flat = traverse_util.flatten_dict(adapters, sep="/")
    assert sorted(k.rsplit("/", 1)[0] for k in flat if k.endswith("lora_a")) == [
        "layers_1/gate_proj",
        "layers_1/o_proj",
    ]
    assert cfg.alpha == 4.0 and {r for _, r in cfg.rules} == {2}
    cfg, _ = peft_dir.load_adapters(model, peft_adapters["qvd"])
    assert cfg.rules == (("(^|/)(down_proj)/kernel$", 2), ("(^|/)(q_proj|v_proj)/kernel$", 4))
    with pytest.raises(ValueError, match="other kernels or ranks"):
        peft_dir.load_adapters(model, peft_adapters["qvd"], lora.LoraConfig(rules=RULES))


# adapter_config.json settings whose adapted model is not `W + s B A` over the base as it is
# (PiSSA, OLoRA, CorDA and LoftQ rewrite the base's weights when PEFT loads the adapter;
# activated LoRA, KaSA, Arrow, block-diagonal, DoRA, biases, saved modules compute otherwise).
NOT_PLAIN_LORA = [
    ("init_lora_weights", "pissa"),
    ("init_lora_weights", "pissa_niter_4"),
    ("init_lora_weights", "olora"),
    ("init_lora_weights", "corda"),
    ("init_lora_weights", "loftq"),
    ("alora_invocation_tokens", [5, 6]),
    ("kasa_config", {"rank": 2}),
    ("arrow_config", {"top_k": 2}),
    ("use_bdlora", {"nblocks": 2}),
    ("use_dora", True),
    ("modules_to_save", ["lm_head"]),
    ("bias", "all"),
]


@pytest.mark.parametrize("key, value", NOT_PLAIN_LORA, ids=[f"{k}={v}" for k, v in NOT_PLAIN_LORA])
def test_adapters_other_than_plain_lora_are_refused_naming_the_setting(
    hf_base, peft_adapters, tmp_path, key, value
):
    path = tmp_path / "adapter"
    shutil.copytree(peft_adapters["qvd"], path)
    config_file = path / peft_config.ADAPTER_CONFIG
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), key: value}))
    with pytest.raises(ValueError, match=f"{key}="):
        peft_dir.load_adapters(hf.model_from_hf_dir(hf_base[1]), str(path))


def test_lora_run_exports_peft_adapters_that_peft_loads_with_our_logits(
    hf_base, partitioner, tmp_path
):
    """A LoRA MODEL_DIR (scanned, ranks 4 and 2) -> export_hf(peft=True) -> PeftModel on the
    original HF base: every key loads, the logits are flaxlm's."""
    torch_model, base = hf_base
    model = hf.model_from_hf_dir(base, partitioner, config_overrides={"scan_layers": True})
    cfg = lora.LoraConfig(rules=RULES, alpha=8.0)
    kernels = lora.plan(cfg, model, model.example_batch_shapes())
    flat = traverse_util.flatten_dict(lora.init_adapters(jax.random.PRNGKey(0), kernels))
    rng = np.random.default_rng(0)
    flat = {k: 0.1 * rng.standard_normal(v.shape).astype(np.float32) for k, v in flat.items()}
    model_dir = tmp_path / "run"
    ckpt = checkpointer.Checkpointer(str(model_dir))
    ckpt.save_params(7, traverse_util.unflatten_dict(flat))
    ckpt.close()
    run_dir.write_model_record(model, model_dir, HF_START, base)
    run_dir.write_lora_record(model_dir, cfg, {"hf": base})

    out = tmp_path / "peft"
    convert.export_hf(model_dir=str(model_dir), out_dir=str(out), peft=True)
    config = json.loads((out / peft_config.ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["down_proj", "o_proj", "q_proj", "v_proj"]
    assert (config["r"], config["rank_pattern"], config["lora_alpha"]) == (4, {"o_proj": 2}, 8.0)
    assert config["base_model_name_or_path"] == base
    assert os.path.exists(out / "tokenizer_config.json") or not os.path.exists(
        os.path.join(base, "tokenizer_config.json")
    )

    ids, mask = padded_batch(384, (12, 7, 12, 3))
    theirs, all_keys = peft_logits(torch_model, str(out), ids, mask)
    assert all_keys
    _, merged, step, _ = run_dir.load_model_and_params(str(model_dir), partitioner)
    assert step == 7
    ours = np.asarray(jax.jit(model.compute_logits)(merged, decoder_batch(ids, mask)))
    assert max_abs_diff(ours, theirs, mask) < TOL
    base_logits = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(base_logits, theirs, mask) > 1e-2


@pytest.mark.slow
def test_peft_import_trains_one_step_at_lr_0_to_the_same_adapters(
    hf_base, peft_adapters, partitioner, tmp_path
):
    """train(lora_init_from_peft=...) at learning rate 0: the checkpointed adapters are the
    imported ones, and their PEFT export is PEFT's own file."""
    import tasks  # noqa: F401 - registers stdlib_py

    _, base = hf_base
    path = peft_adapters["qvd"]
    model = hf.model_from_hf_dir(base, partitioner)
    model_dir = str(tmp_path / "run")
    dataset = DatasetConfig(
        mixture_or_task_name="stdlib_py", task_feature_lengths={"targets": 16}, batch_size=8
    )
    train.train(
        model=model,
        partitioner=partitioner,
        train_dataset_cfg=dataset,
        learning_rate=0.0,
        model_dir=model_dir,
        total_steps=1,
        checkpoint_period=1,
        log_period=1,
        lora_init_from_peft=path,
    )
    record = run_dir.read_lora_record(model_dir)
    assert record[1] == {"hf": os.path.abspath(base)}
    cfg, _, trained, step = run_dir.restore_adapters(model_dir, model, partitioner)
    assert step == 1
    _, imported = peft_dir.load_adapters(model, path)
    flat_trained = traverse_util.flatten_dict(jax.device_get(trained))
    for key, value in traverse_util.flatten_dict(imported).items():
        np.testing.assert_array_equal(np.asarray(flat_trained[key]), value)

    out = tmp_path / "peft"
    convert.export_hf(model_dir=model_dir, out_dir=str(out), peft=True)
    theirs = load_file(os.path.join(path, peft_config.ADAPTER_WEIGHTS))
    ours = load_file(str(out / peft_config.ADAPTER_WEIGHTS))
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-6, atol=1e-7)
    config = json.loads((out / peft_config.ADAPTER_CONFIG).read_text())
    assert (cfg.alpha, cfg.dropout) == (8.0, 0.0)
    assert config["rank_pattern"] == {"down_proj": 2}
