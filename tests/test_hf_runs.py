"""HF import/export runs and fine-tuning from HF (`INIT_FROM_HF`), through flaxlm.main."""

import json
import os

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from tests.hf_helpers import (
    QWEN_CHAT_TEMPLATE,
    save_byte_bpe_tokenizer,
    save_torch_model,
)
from tests.test_hf_fidelity import CHAT_TEMPLATE, save_tokenizer
from tests.test_main import read_metrics, run_main

# The shape of gin/models/gptj_tiny.gin, as a HuggingFace checkpoint.
TINY = dict(
    vocab_size=384,
    n_positions=2048,
    n_embd=256,
    n_layer=4,
    n_head=4,
    rotary_dim=32,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=1,
)
FINETUNE = [
    "--gin_file=models/gptj_tiny.gin",
    "--gin_file=partitioning/fsdp.gin",
    "--gin_file=runs/finetune.gin",
    "--gin.MIXTURE_OR_TASK_NAME='stdlib_py'",
    "--gin.TASK_FEATURE_LENGTHS={'targets': 64}",
    "--gin.BATCH_SIZE=8",
    "--gin.LOG_PERIOD=1",
    "--gin.EVAL_PERIOD=0",
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny GPT-J with two EOS ids, sampling defaults and a tokenizer with a chat template."""
    torch.manual_seed(0)
    model = transformers.GPTJForCausalLM(transformers.GPTJConfig(**TINY)).eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=1, eos_token_id=[1, 7], do_sample=True, temperature=0.8, top_p=0.95
    )
    path = save_torch_model(model, tmp_path_factory.mktemp("hf") / "gptj")
    save_tokenizer(path)
    return model, path


def assert_keeps_what_makes_it_usable(source, export, chat_template=CHAT_TEMPLATE):
    """An export has the source's special ids, generation_config.json and tokenizer."""

    def read(directory, name):
        with open(os.path.join(directory, name)) as f:
            return f.read()

    source_config = json.loads(read(source, "config.json"))
    export_config = json.loads(read(export, "config.json"))
    for key in ("bos_token_id", "eos_token_id"):
        assert export_config[key] == source_config[key], key
    generation = [json.loads(read(d, "generation_config.json")) for d in (source, export)]
    assert generation[0] == generation[1]
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert read(export, name) == read(source, name), name
    assert transformers.AutoTokenizer.from_pretrained(export).chat_template == chat_template


def same_tensors(dir_a, dir_b):
    a, b = (
        load_file(os.path.join(dir_a, "model.safetensors")),
        load_file(os.path.join(dir_b, "model.safetensors")),
    )
    assert sorted(a) == sorted(b)
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.slow
def test_import_then_train_then_export(tmp_path, repo_dir, hf_dir):
    _, path = hf_dir
    model_dir = str(tmp_path / "run")
    result = run_main(
        [
            "--gin_file=runs/import_hf.gin",
            f"--gin.HF_DIR='{path}'",
            f"--gin.MODEL_DIR='{model_dir}'",
        ],
        cwd=str(tmp_path),
        devices=8,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isdir(os.path.join(model_dir, "checkpoints", "0", "params"))

    # Training over the imported MODEL_DIR starts from step 0 with a fresh optimizer.
    result = run_main(
        [
            *FINETUNE,
            f"--gin.MODEL_DIR='{model_dir}'",
            "--gin.TRAIN_STEPS=4",
            "--gin.Partitioner.mesh_shape=(2, 2, 2)",
        ],
        cwd=repo_dir,
        devices=8,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resumed from checkpoint step 0" in result.stdout
    assert [r["step"] for r in read_metrics(model_dir) if "loss" in r] == [1, 2, 3, 4]
    out = str(tmp_path / "exported")
    result = run_main(
        [
            "--gin_file=runs/export_hf.gin",
            f"--gin.MODEL_DIR='{model_dir}'",
            f"--gin.HF_OUT_DIR='{out}'",
        ],
        cwd=str(tmp_path),
        devices=8,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Exported step 4" in result.stdout
    # Trained, so other tensors; the names, ids, generation config and tokenizer are the
    # source's. (That an export of the import alone is HF's model, logits and all, is
    # test_hf_fidelity's and test_hf_gptj's, in process; and this file's other test's.)
    assert 0.0 < same_tensors(path, out) < 1.0
    assert_keeps_what_makes_it_usable(path, out)
    assert json.loads(open(os.path.join(out, "config.json")).read())["model_type"] == "gptj"


def finetune_hf(source, model_dir, repo_dir, *bindings: str):
    """gin/finetune_hf.gin from HF directory `source` for 2 steps of 8 x 64 tokens in float32
    on 2 devices, logging each step, with `bindings` after."""
    return run_main(
        [
            "--gin_file=gin/finetune_hf.gin",
            f"--gin.INIT_FROM_HF='{source}'",
            f"--gin.MODEL_DIR='{model_dir}'",
            "--gin.COMPUTE_DTYPE='float32'",
            "--gin.TASK_FEATURE_LENGTHS={'targets': 64}",
            "--gin.BATCH_SIZE=8",
            "--gin.TRAIN_STEPS=2",
            "--gin.EVAL_PERIOD=0",
            "--gin.LOG_PERIOD=1",
            *bindings,
        ],
        cwd=repo_dir,
        devices=2,  # (each device of the fsdp axis is an input pipeline to build)
    )


@pytest.mark.slow
def test_finetune_hf_gin_starts_from_any_hf_directory_and_exports_it_back(tmp_path, repo_dir):
    """gin/finetune_hf.gin with nothing but INIT_FROM_HF (and a small run's sizes): the family
    from config.json, the directory's own BPE tokenizer on the stdlib corpus. With a zero
    learning rate the export gives the directory's tensors, ids, generation config and
    tokenizer back."""
    source = tmp_path / "hf"
    length = save_byte_bpe_tokenizer(source, style="qwen")
    eos = [length - 3, length - 1]  # <|endoftext|>, <|im_end|> (Qwen2.5-Instruct's pair)
    config = transformers.Qwen2Config(
        vocab_size=length,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos[0],
        attention_dropout=0.1,  # transformers' training would apply it; flaxlm says it does not
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=eos, pad_token_id=eos[0], do_sample=True, temperature=0.7, top_p=0.8
    )
    model.save_pretrained(str(source))
    model_dir = str(tmp_path / "run")
    result = finetune_hf(source, model_dir, repo_dir, "--gin.LEARNING_RATE=0.0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"from {source}" in result.stdout
    assert "config.json's dropout (attention_dropout 0.1) is not read" in result.stdout
    with open(os.path.join(model_dir, "model_record.json")) as f:
        assert json.load(f)["model_type"] == "qwen2"
    assert len(read_metrics(model_dir)) == 2
    out = str(tmp_path / "exported")
    result = run_main(
        [
            "--gin_file=runs/export_hf.gin",
            f"--gin.MODEL_DIR='{model_dir}'",
            f"--gin.HF_OUT_DIR='{out}'",
            "--gin.Partitioner.mesh_shape=(1, 4, 2)",
        ],
        cwd=str(tmp_path),
        devices=8,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert same_tensors(str(source), out) == 0.0
    assert_keeps_what_makes_it_usable(str(source), out, QWEN_CHAT_TEMPLATE)
