"""The shipped post-training recipes fine-tune an HF checkpoint on what HF and TRL would feed
it, along the user's path: `python -m flaxlm.main` with the repository's Gin file (or a user's
own that binds the converter scoped), one step at learning rate 0. The rows the run reads
(recorded by `tests/record_rows.py`) are TRL 1.16's, its step's metrics are TRL's formulas on
HF's torch model over those rows, and the MODEL_DIR samples from the same start."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from flaxlm.checkpoints import run_dir
from flaxlm.data.vocabularies import HuggingFaceVocabulary
from flaxlm.inference import generation
from flaxlm.models.row_start import HF_START
from flaxlm.parallel.partitioning import Partitioner
from tests.hf_helpers import random_hf_model, save_torch_model
from tests.test_main import read_metrics, run_main
from tests.test_trl_parity import (
    CONVERSATIONS,
    PAIRS,
    save_tokenizer,
    shifted,
    trl_chat_rows,
    trl_pair_batch,
)

# A float32 log-prob summed over <= 48 tokens of a 2-layer width-32 model: ~1e-5 of round-off.
TOL = 1e-4


def hf_checkpoint(root, style: str) -> tuple[str, object, LlamaForCausalLM]:
    """A tiny random Llama with a tokenizer of `style` (llama3: adds its BOS; qwen: none)."""
    save_tokenizer(root, style)
    tok = AutoTokenizer.from_pretrained(str(root))
    model = random_hf_model(
        LlamaConfig,
        LlamaForCausalLM,
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    save_torch_model(model, root)
    return str(root), tok, model


def run_recipe(tmp_path, repo_dir, gin_file, hf_dir, *bindings) -> tuple[str, list[dict]]:
    """One step of `gin_file` from `hf_dir` at learning rate 0; (MODEL_DIR, batches read)."""
    model_dir, record = str(tmp_path / "run"), tmp_path / "rows"
    record.mkdir()
    os.environ["FLAXLM_TEST_RECORD_DIR"] = str(record)
    try:
        result = run_main(
            [
                f"--gin_file={gin_file}",
                "--tasks_module=tests.record_rows",
                f"--gin.INIT_FROM_HF='{hf_dir}'",
                f"--gin.MODEL_DIR='{model_dir}'",
                "--gin.TRAIN_STEPS=1",
                "--gin.LEARNING_RATE=0.0",
                "--gin.WARMUP_STEPS=0",
                "--gin.EVAL_PERIOD=0",
                "--gin.LOG_PERIOD=1",
                "--gin.CHECKPOINT_PERIOD=1",
                *bindings,
            ],
            cwd=repo_dir,
        )
    finally:
        del os.environ["FLAXLM_TEST_RECORD_DIR"]
    assert result.returncode == 0, result.stderr[-3000:]
    with open(record / "rows.jsonl") as f:
        return model_dir, [json.loads(line) for line in f]


def token_logps(torch_model, ids: list[int]) -> np.ndarray:
    """log p(ids[t + 1] | ids[: t + 1]) under the torch model, float64 `[len(ids) - 1]`."""
    with torch.no_grad():
        logits = torch_model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]].numpy()


def answer_logp(torch_model, inputs, targets, weights) -> float:
    """The summed log-prob of a row's weighted targets (its answer) under the torch model."""
    logps = token_logps(torch_model, [inputs[0], *targets])
    return float(logps[np.asarray(weights) > 0].sum())


def row(features: dict, i: int, r: int | None = None) -> tuple[list, list, list]:
    """Row i (pair row r) of a batch as an unpadded (inputs, targets, weights)."""
    get = (lambda k: features[k][i]) if r is None else (lambda k: features[k][i][r])
    inputs, targets = (
        np.asarray(get("decoder_input_tokens")),
        np.asarray(get("decoder_target_tokens")),
    )
    n = int(np.flatnonzero(inputs | targets).max()) + 1
    weights = np.asarray(get("decoder_loss_weights"))
    return inputs[:n].tolist(), targets[:n].tolist(), weights[:n].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dpo", "orpo"])
def test_preference_from_a_users_gin_file_reads_trls_pairs_and_logs_trls_log_probs(
    tmp_path, repo_dir, loss
):
    """A user's Gin file: gin/dpo.gin with the model from the HF directory and the converter
    bound scoped (`train/data.DatasetConfig.feature_converter`), a BOS-adding tokenizer; DPO
    (gin/dpo.gin's loss) and ORPO (gin/orpo.gin's)."""
    hf_dir, tok, torch_model = hf_checkpoint(tmp_path / "hf", "llama3")
    eos = tok.eos_token
    pairs = [
        {k: v.replace("<EOS>", eos) if isinstance(v, str) else v for k, v in p.items()}
        for p in PAIRS
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    dpo = open(os.path.join(repo_dir, "gin", "dpo.gin")).read()
    scoped = dpo.replace(
        "data.DatasetConfig.feature_converter", "train/data.DatasetConfig.feature_converter"
    )
    assert scoped != dpo
    user_gin = tmp_path / "my_dpo.gin"
    user_gin.write_text(
        scoped.replace("include 'models/llama_tiny.gin'\n", "")
        + "\nfrom flaxlm.runs import convert\n"
        "MODEL = @convert.model_from_hf()\n"
        "convert.model_from_hf.path = %INIT_FROM_HF\n"
    )
    model_dir, batches = run_recipe(
        tmp_path,
        repo_dir,
        str(user_gin),
        hf_dir,
        f"--gin.PREFERENCE_TRAIN='{data}'",
        f"--gin.PREFERENCE_VALIDATION='{data}'",
        f"--gin.PREFERENCE_TOKENIZER='{hf_dir}'",
        "--gin.BATCH_SIZE=4",
        f"--gin.LOSS='{loss}'",
    )

    # TRL's rows of each pair (its tokenization and collator), as the model reads them.
    trl = trl_pair_batch(tok, pairs)
    ids, mask = trl["input_ids"].numpy(), trl["completion_mask"].numpy()
    n = len(pairs)
    want = {}
    for p in range(n):
        rows = []
        for r in (0, 1):
            length = int(trl["attention_mask"][p + r * n].sum())
            rows.append(shifted(ids[p + r * n, :length].tolist(), mask[p + r * n, :length]))
        want[p] = rows
    assert all(w[0][0][0] == tok.bos_token_id for w in want.values())  # BOS, never token 0
    first = batches[0]
    read = [[row(first, i, r) for r in (0, 1)] for i in range(len(first["decoder_input_tokens"]))]
    which = []
    for got in read:
        matches = [p for p, w in want.items() if [tuple(x) for x in w] == [tuple(x) for x in got]]
        assert matches, got
        which.append(matches[0])

    # TRL's metrics: each answer's summed log-prob (DPOTrainer), or its mean per answer token
    # (ORPOTrainer), averaged over the batch's pairs.
    sums = {p: [answer_logp(torch_model, *w[r]) for r in (0, 1)] for p, w in want.items()}
    if loss == "orpo":
        sums = {p: [v / sum(w[r][2]) for r, v in enumerate(sums[p])] for p, w in want.items()}
    (step,) = read_metrics(model_dir)
    assert step["logps/chosen"] == pytest.approx(np.mean([sums[p][0] for p in which]), abs=TOL)
    assert step["logps/rejected"] == pytest.approx(np.mean([sums[p][1] for p in which]), abs=TOL)
    if loss == "dpo":
        assert step["loss"] == pytest.approx(np.log(2.0), abs=TOL)  # the policy is its reference

    # The MODEL_DIR records the HF form, and its prompts start as its rows did.
    loaded = run_dir.load_model_and_params(
        model_dir, Partitioner(mesh_shape=(1, 1, 1), devices=jax.devices()[:1])
    )
    assert loaded.row_start == HF_START
    vocab = HuggingFaceVocabulary(hf_dir)
    prompt = generation.prompt_ids(loaded.model, vocab, "Q: the fox?", loaded.row_start)
    assert prompt == want[0][0][0][: len(prompt)]


@pytest.mark.slow
def test_chat_sft_gin_reads_trls_conversations_and_its_loss(tmp_path, repo_dir):
    """gin/chat_sft.gin as shipped, the model from the HF directory, a tokenizer that adds
    nothing (Qwen-like): packed segments are TRL's assistant-only rows, the loss TRL's."""
    hf_dir, tok, torch_model = hf_checkpoint(tmp_path / "hf", "qwen")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    user_gin = tmp_path / "my_chat.gin"  # the shipped file, the model from the HF directory
    user_gin.write_text(
        "include 'chat_sft.gin'\n"
        "from flaxlm.runs import convert\n"
        "MODEL = @convert.model_from_hf()\n"
        "convert.model_from_hf.path = %INIT_FROM_HF\n"
    )
    model_dir, batches = run_recipe(
        tmp_path,
        repo_dir,
        str(user_gin),
        hf_dir,
        f"--gin.CHAT_TRAIN='{data}'",
        f"--gin.CHAT_VALIDATION='{data}'",
        f"--gin.CHAT_TOKENIZER='{hf_dir}'",
        "--gin.MAX_LENGTH=96",
        "--gin.BATCH_SIZE=2",
    )
    want = [tuple(tuple(x) for x in r) for r in trl_chat_rows(tok)]
    first = batches[0]
    segments, nll, count = [], 0.0, 0
    for i in range(len(first["decoder_input_tokens"])):
        seg_ids = np.asarray(first["decoder_segment_ids"][i])
        for s in sorted(set(seg_ids.tolist()) - {0}):
            at = seg_ids == s
            seg = tuple(
                tuple(int(t) for t in np.asarray(first[k][i])[at])
                for k in ("decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights")
            )
            assert seg in want, seg
            segments.append(seg)
            inputs, targets, weights = seg
            logps = token_logps(torch_model, [*inputs, targets[-1]])
            nll -= float(logps[np.asarray(weights) > 0].sum())
            count += int(np.sum(weights))
    assert segments and all(seg[0][0] != 0 for seg in segments)  # nothing inserted
    (step,) = read_metrics(model_dir)
    # (the tiny model file's z-loss, 1e-4 x log Z^2, is logged apart; TRL has none)
    assert step["loss"] - step["z_loss"] == pytest.approx(nll / count, abs=TOL)
    record = json.loads((tmp_path / "run" / run_dir.MODEL_RECORD).read_text())
    assert record[run_dir.RECORD_ROW_START] is None
