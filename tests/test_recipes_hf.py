"""The shipped recipes fine-tune an HF checkpoint on what HF and TRL would feed it, along the
user's path: `python -m flaxlm.main` with the repository's Gin file (as its comments say to
point it at an HF checkpoint and data, or a user's own file that binds the converter scoped),
one step at learning rate 0. The rows the run reads and the prompts `infer` and GRPO's
rollouts read (recorded by `tests/record_rows.py`) are transformers' tokenizer's and TRL
1.16's, its step's metrics are TRL's formulas on HF's torch model over those rows, and the
MODEL_DIR records the HF form and samples from the same start.

One run a Gin file, the two tokenizer styles taken in turn (llama3: the tokenizer adds its
BOS; qwen: it adds nothing); "shape file" is a gin/models/ file loaded from INIT_FROM_HF. The
checkpoint is a tiny Llama but in the preference runs, which take the linear-attention hybrids
(issue 66) as their family tests build them: a Qwen3-Next (Gated DeltaNet and gated full
attention, experts and a shared one; tests/test_hf_qwen3_next.py) and a Kimi Linear (Kimi
Delta Attention and latent attention, DeepSeek-V3's experts; tests/test_hf_kimi_linear.py):

    Gin file                           tokenizer  model from                 reads
    finetune_hf.gin (JSONL flags)      qwen       convert.model_from_hf      SFT prompt-completion
    jsonl_finetune.gin                 llama3     shape file                 SFT prompt-completion
    llama_lora.gin (train, infer)      llama3     shape file                 same, LoRA; infer
    chat_sft.gin                       qwen       convert.model_from_hf      SFT conversations
    dpo.gin, a user's copy, scoped     llama3     model_from_hf, Qwen3-Next  DPO pairs
    orpo.gin (the shipped dpo.gin's)   qwen       model_from_hf, Kimi Linear ORPO pairs
    grpo.gin (its GRPO stage)          qwen       shape file (INIT_FROM)     GRPOTrainer's prompts

The GRPO loss itself is the paper's (TRL's `loss_type="grpo"`), checked in
tests/test_loss_math.py; at learning rate 0 from one policy its step here is not compared.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
import pytest
import torch
import transformers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl.data_utils import _tokenize as trl_tokenize
from trl.data_utils import common_prefix_length
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from flaxlm.checkpoints import checkpointer, run_dir
from flaxlm.data.vocabularies import HuggingFaceVocabulary
from flaxlm.inference import generation
from flaxlm.models.row_start import HF_START, SEQIO_START
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs import infer
from tests.hf_helpers import random_hf_model, save_torch_model
from tests.test_hf_kimi_linear import PERTURBED as KIMI_LINEAR_PERTURBED
from tests.test_hf_kimi_linear import VARIANTS as KIMI_LINEAR_VARIANTS
from tests.test_hf_qwen3_next import PERTURBED as QWEN3_NEXT_PERTURBED
from tests.test_hf_qwen3_next import VARIANTS as QWEN3_NEXT_VARIANTS
from tests.test_main import read_metrics, run_main
from tests.test_trl_parity import (
    CHAT_RECORDS,
    PAIRS,
    save_tokenizer,
    segments,
    shifted,
    trl_chat_rows,
    trl_pair_batch,
)

# A float32 log-prob summed over <= 48 tokens of a tiny model (2 layers of width 32, or
# llama_tiny's 4 of 256): ~1e-5 of round-off.
TOL = 1e-4

# The shape of gin/models/llama_tiny.gin, for the recipes that include a model's shape file
# and load INIT_FROM_HF into it (a vocabulary padded past the tokenizer's, as many are).
LLAMA_TINY = dict(
    vocab_size=384,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
)
# JaxSeq's {in_text, out_text} pairs (TRL's prompt and completion): "!" is id 0 of both
# tokenizers (as of Llama 3's and Qwen's), and a completion that ends with EOS gets no second.
PROMPT_COMPLETIONS = [
    {"in_text": "Q: the fox?\nA:", "out_text": " Yes."},
    {"in_text": "import", "out_text": " os<EOS>"},
    {"in_text": "Hi!", "out_text": " Hello, été."},
]
# GRPO's {prompt, answer} line (data/arithmetic's form), "!" in it.
GRPO_PROMPT = {"prompt": "Hi! 4+7=", "answer": "11"}


# The linear-attention hybrids as their family tests build them tiny: (config class, model
# class, config, the params HF starts at constants, perturbed).
HYBRIDS = {
    "qwen3_next": (*QWEN3_NEXT_VARIANTS["qwen3_next"], QWEN3_NEXT_PERTURBED),
    "kimi_linear": (
        transformers.KimiLinearConfig,
        transformers.KimiLinearForCausalLM,
        KIMI_LINEAR_VARIANTS["default_dense_first"],
        KIMI_LINEAR_PERTURBED,
    ),
}


def hf_checkpoint(root, style: str, family: str = "llama", **shape) -> tuple[str, object, object]:
    """A tiny random HF model with a tokenizer of `style` (llama3: adds its BOS; qwen: none):
    a Llama (2 layers of width 32, or `shape`) or a `HYBRIDS` family's, over the tokenizer's
    vocabulary."""
    save_tokenizer(root, style)
    tok = AutoTokenizer.from_pretrained(str(root))
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if family != "llama":
        config_cls, model_cls, config, perturbed = HYBRIDS[family]
        config = {**config, "vocab_size": len(tok), **ids}
        model = random_hf_model(config_cls, model_cls, perturbed, **config)
        save_torch_model(model, root)
        return str(root), tok, model
    shape = shape or dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = random_hf_model(LlamaConfig, LlamaForCausalLM, **shape, **ids)
    save_torch_model(model, root)
    return str(root), tok, model


def with_eos(tok, records: list[dict]) -> list[dict]:
    """`records` with "<EOS>" in their texts spelled as the tokenizer's EOS."""
    eos = tok.eos_token
    return [
        {k: v.replace("<EOS>", eos) if isinstance(v, str) else v for k, v in r.items()}
        for r in records
    ]


def write_jsonl(path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


class Recorded:
    """What a run read (tests/record_rows.py): its batches, and the prompt ids `infer` and
    GRPO's rollouts read (`prompts["infer" | "grpo"]`, a list of ids a prompt)."""

    stdout = ""  # the run's terminal output

    def __init__(self, directory):
        with open(directory / "rows.jsonl") as f:
            self.batches = [json.loads(line) for line in f]
        self.prompts: dict[str, list[list[int]]] = {}
        if (directory / "prompts.jsonl").exists():
            with open(directory / "prompts.jsonl") as f:
                for line in f:
                    record = json.loads(line)
                    self.prompts.setdefault(record["by"], []).extend(record["prompts"])


def run_recipe(tmp_path, repo_dir, gin_file, hf_dir, *bindings) -> tuple[str, Recorded]:
    """One step of `gin_file` from `hf_dir` at learning rate 0; (MODEL_DIR, what it read)."""
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
    recorded = Recorded(record)
    recorded.stdout = result.stdout
    return model_dir, recorded


def token_logps(torch_model, ids: list[int]) -> np.ndarray:
    """log p(ids[t + 1] | ids[: t + 1]) under the torch model, float64 `[len(ids) - 1]`."""
    with torch.no_grad():
        logits = torch_model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]].numpy()


def answer_logp(torch_model, inputs, targets, weights) -> float:
    """The summed log-prob of a row's weighted targets (its answer) under the torch model."""
    logps = token_logps(torch_model, [inputs[0], *targets])
    return float(logps[np.asarray(weights) > 0].sum())


def mean_nll(torch_model, rows) -> float:
    """TRL's SFT loss over `rows` (inputs, targets, weights): the NLL of every weighted
    target under the torch model, averaged over all of them."""
    nll = sum(-answer_logp(torch_model, *r) for r in rows)
    return nll / sum(sum(r[2]) for r in rows)


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


def packed_segments(batch: dict) -> list[tuple]:
    """Every segment of a packed batch's rows, each as an unpacked row's (inputs, targets,
    weights)."""
    n = len(batch["decoder_input_tokens"])
    return [
        seg for i in range(n) for seg in segments({k: np.asarray(v[i]) for k, v in batch.items()})
    ]


def distinct(rows) -> set[tuple]:
    """The distinct (inputs, targets, weights) rows of `rows`, hashable."""
    return {tuple(tuple(x) for x in r) for r in rows}


def trl_prompt_completion_rows(tok, pairs: list[dict]) -> list[tuple]:
    """TRL 1.16 SFTTrainer's rows of prompt-completion pairs (completion-only loss, EOS
    appended to a completion lacking it), through its collator, as the model reads them."""
    eos = tok.eos_token
    examples = []
    for p in pairs:
        prompt, completion = p["in_text"], p["out_text"]
        completion = completion if completion.endswith(eos) else completion + eos
        prompt_ids = trl_tokenize(tok, prompt)["input_ids"]
        ids = trl_tokenize(tok, prompt + completion)["input_ids"]
        n = common_prefix_length(prompt_ids, ids)
        examples.append({"input_ids": ids, "labels": [-100] * n + ids[n:]})
    batch = DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id)(examples)
    return [
        shifted(e["input_ids"], labels[: len(e["input_ids"])].numpy() != -100)
        for e, labels in zip(examples, batch["labels"])
    ]


def check_sft_step(model_dir, recorded: Recorded, tok, torch_model) -> list[tuple]:
    """The run's first batch is TRL's prompt-completion rows of PROMPT_COMPLETIONS, packed,
    its step's loss TRL's on them, and its MODEL_DIR records the HF form; TRL's rows."""
    want = trl_prompt_completion_rows(tok, with_eos(tok, PROMPT_COMPLETIONS))
    prefix = [tok.bos_token_id] if tok.bos_token_id is not None else []
    assert all(w[0][: len(prefix)] == prefix and w[0][0] != 0 for w in want)  # never token 0
    assert tok.eos_token_id not in want[1][1][:-1]  # one EOS
    assert 0 in want[2][0]  # "!"
    read = packed_segments(recorded.batches[0])
    assert distinct(read) == distinct(want), read  # every example, as TRL's row
    (step,) = read_metrics(model_dir)
    # (a model file's z-loss, 1e-4 x log Z^2, is logged apart; TRL has none)
    assert step["loss"] - step.get("z_loss", 0.0) == pytest.approx(
        mean_nll(torch_model, read), abs=TOL
    )
    record = json.loads((pathlib.Path(model_dir) / run_dir.MODEL_RECORD).read_text())
    assert record[run_dir.RECORD_ROW_START] is None
    return want


def infer_prompt(model_dir: str, hf_dir: str, text: str) -> list[int]:
    """The ids `infer` reads `text` as from MODEL_DIR, with the HF directory's tokenizer."""
    row_start = run_dir.recorded_row_start(model_dir) or SEQIO_START
    model = run_dir.read_model(model_dir)
    vocab = HuggingFaceVocabulary(hf_dir)
    (example,), _, _ = infer.read_examples_from_texts([text], model, row_start, vocab)
    return example.input_ids


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loss", "style", "family"),
    [("dpo", "llama3", "qwen3_next"), ("orpo", "qwen", "kimi_linear")],
)
def test_preference_gin_reads_trls_pairs_and_logs_trls_log_probs(
    tmp_path, repo_dir, loss, style, family
):
    """DPO: a user's Gin file, gin/dpo.gin with the model from the HF directory and the
    converter bound scoped (`train/data.DatasetConfig.feature_converter`), a BOS-adding
    tokenizer, a Qwen3-Next. ORPO: gin/orpo.gin as shipped (gin/dpo.gin's binding), a
    tokenizer that adds nothing, a Kimi Linear. Both hybrids' linear layers run the chunked
    rule over each pair's rows, and HF's torch model gives the log-probs."""
    hf_dir, tok, torch_model = hf_checkpoint(tmp_path / "hf", style, family)
    pairs = with_eos(tok, PAIRS)
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    user_gin = tmp_path / f"my_{loss}.gin"
    from_hf = (
        "from flaxlm.runs import convert\n"
        "MODEL = @convert.model_from_hf()\n"
        "convert.model_from_hf.path = %INIT_FROM_HF\n"
    )
    if loss == "dpo":
        dpo = open(os.path.join(repo_dir, "gin", "dpo.gin")).read()
        scoped = dpo.replace(
            "data.DatasetConfig.feature_converter", "train/data.DatasetConfig.feature_converter"
        )
        assert scoped != dpo
        user_gin.write_text(scoped.replace("include 'models/llama_tiny.gin'\n", "") + from_hf)
    else:
        user_gin.write_text("include 'orpo.gin'\n" + from_hf)
    model_dir, recorded = run_recipe(
        tmp_path,
        repo_dir,
        str(user_gin),
        hf_dir,
        f"--gin.PREFERENCE_TRAIN='{data}'",
        f"--gin.PREFERENCE_VALIDATION='{data}'",
        f"--gin.PREFERENCE_TOKENIZER='{hf_dir}'",
        "--gin.BATCH_SIZE=4",
        f"--gin.LOSS='{loss}'",
        "--gin.MAX_LENGTH=64",  # the tool-use pair's 60-62 tokens whole, as TRL reads it
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
    first_ids = [w[0][0][0] for w in want.values()]
    assert 0 not in first_ids  # never token 0 first
    assert (set(first_ids) == {tok.bos_token_id}) == (style == "llama3")
    first = recorded.batches[0]
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
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT_RECORDS)
    user_gin = tmp_path / "my_chat.gin"  # the shipped file, the model from the HF directory
    user_gin.write_text(
        "include 'chat_sft.gin'\n"
        "from flaxlm.runs import convert\n"
        "MODEL = @convert.model_from_hf()\n"
        "convert.model_from_hf.path = %INIT_FROM_HF\n"
    )
    model_dir, recorded = run_recipe(
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
    want = trl_chat_rows(tok)
    read = packed_segments(recorded.batches[0])
    assert read and all(seg in want for seg in read), read
    assert all(seg[0][0] != 0 for seg in read)  # nothing inserted
    (step,) = read_metrics(model_dir)
    # (the tiny model file's z-loss, 1e-4 x log Z^2, is logged apart; TRL has none)
    assert step["loss"] - step["z_loss"] == pytest.approx(mean_nll(torch_model, read), abs=TOL)
    record = json.loads((tmp_path / "run" / run_dir.MODEL_RECORD).read_text())
    assert record[run_dir.RECORD_ROW_START] is None


@pytest.mark.slow
def test_finetune_hf_gin_on_jsonl_pairs_reads_trls_prompt_completion_rows(tmp_path, repo_dir):
    """gin/finetune_hf.gin as shipped with the flags its comment gives for one's own JSONL
    pairs, a tokenizer that adds nothing (Qwen-like), computing in float32: packed segments
    are TRL SFTTrainer's prompt-completion rows (completion-only loss), the loss TRL's, and
    `infer` prompts the MODEL_DIR as the rows start."""
    hf_dir, tok, torch_model = hf_checkpoint(tmp_path / "hf", "qwen")
    data = write_jsonl(tmp_path / "train.jsonl", with_eos(tok, PROMPT_COMPLETIONS))
    model_dir, recorded = run_recipe(
        tmp_path,
        repo_dir,
        "gin/finetune_hf.gin",
        hf_dir,
        "--gin.MIXTURE_OR_TASK_NAME=@register_jsonl_task()",
        "--gin.register_jsonl_task.name='my_sft'",
        f"--gin.register_jsonl_task.split_files={{'train': '{data}', 'validation': '{data}'}}",
        "--gin.register_jsonl_task.vocabulary=@HuggingFaceVocabulary()",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 16}",
        "--gin.COMPUTE_DTYPE='float32'",
        "--gin.BATCH_SIZE=2",
    )
    want = check_sft_step(model_dir, recorded, tok, torch_model)
    prompt = infer_prompt(model_dir, hf_dir, PROMPT_COMPLETIONS[0]["in_text"])
    assert prompt == trl_tokenize(tok, PROMPT_COMPLETIONS[0]["in_text"])["input_ids"]
    assert prompt == want[0][0][: len(prompt)]


@pytest.mark.slow
def test_jsonl_finetune_gin_from_an_hf_checkpoint_reads_trls_prompt_completion_rows(
    tmp_path, repo_dir
):
    """gin/jsonl_finetune.gin as its comment says to start it from an HF checkpoint: its
    shape's file for models/gptj_tiny.gin, INIT_FROM_HF and the checkpoint's tokenizer (here
    BOS-adding) bound by flags. TRL SFTTrainer's prompt-completion rows and loss; `infer`'s
    prompt starts with the BOS its rows start with."""
    hf_dir, tok, torch_model = hf_checkpoint(tmp_path / "hf", "llama3", **LLAMA_TINY)
    data = write_jsonl(tmp_path / "train.jsonl", with_eos(tok, PROMPT_COMPLETIONS))
    shipped = open(os.path.join(repo_dir, "gin", "jsonl_finetune.gin")).read()
    user_gin = tmp_path / "my_jsonl_finetune.gin"
    user_gin.write_text(
        shipped.replace("include 'models/gptj_tiny.gin'", "include 'models/llama_tiny.gin'")
    )
    model_dir, recorded = run_recipe(
        tmp_path,
        repo_dir,
        str(user_gin),
        hf_dir,
        f"--gin.JSONL_TRAIN='{data}'",
        "--gin.register_jsonl_task.vocabulary=@HuggingFaceVocabulary()",
        f"--gin.HuggingFaceVocabulary.path='{hf_dir}'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 16}",
        "--gin.BATCH_SIZE=2",
    )
    want = check_sft_step(model_dir, recorded, tok, torch_model)
    prompt = infer_prompt(model_dir, hf_dir, PROMPT_COMPLETIONS[2]["in_text"])
    assert prompt == trl_tokenize(tok, PROMPT_COMPLETIONS[2]["in_text"])["input_ids"]
    assert prompt == want[2][0][: len(prompt)] and prompt[0] == tok.bos_token_id


@pytest.mark.slow
def test_llama_lora_gin_from_an_hf_checkpoint_trains_on_trls_rows_then_infers_from_them(
    tmp_path, repo_dir
):
    """gin/llama_lora.gin as its comment says to start it from an HF checkpoint (its shape's
    file, INIT_FROM_HF, the tokenizer bound for the task and for infer; here BOS-adding):
    LoRA (adapters at zero: the base's loss) trains on TRL SFTTrainer's prompt-completion rows
    with TRL's loss, then its own `infer` stage reads each validation prompt as
    `tokenizer(prompt)`, the start of that example's training row."""
    hf_dir, tok, torch_model = hf_checkpoint(tmp_path / "hf", "llama3", **LLAMA_TINY)
    data = write_jsonl(tmp_path / "train.jsonl", with_eos(tok, PROMPT_COMPLETIONS))
    user_gin = tmp_path / "my_lora.gin"
    user_gin.write_text(
        "include 'llama_lora.gin'\n"
        "from flaxlm.data import vocabularies\n"
        "jsonl.register_jsonl_task.vocabulary = @vocabularies.HuggingFaceVocabulary()\n"
        "infer.infer.vocabulary = @vocabularies.HuggingFaceVocabulary()\n"
        f"vocabularies.HuggingFaceVocabulary.path = '{hf_dir}'\n"
    )
    model_dir, recorded = run_recipe(
        tmp_path,
        repo_dir,
        str(user_gin),
        hf_dir,
        f"--gin.TRAIN_FILE='{data}'",
        f"--gin.VALIDATION_FILE='{data}'",
        f"--gin.OUTPUT_DIR='{tmp_path / 'generations'}'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 16}",
        "--gin.BATCH_SIZE=2",
        "--gin.MAX_NEW_TOKENS=2",
        # (one step of warmup, then a decay over max(TRAIN_STEPS - 1, 1) steps: at 1 and at 2
        # steps the same schedule, so the resumed run below reads this run's train step from
        # the compilation cache instead of compiling its own)
        "--gin.WARMUP_STEPS=1",
    )
    want = check_sft_step(model_dir, recorded, tok, torch_model)
    prompts = recorded.prompts["infer"]
    assert prompts == [trl_tokenize(tok, p["in_text"])["input_ids"] for p in PROMPT_COMPLETIONS]
    assert all(p == w[0][: len(p)] for p, w in zip(prompts, want))
    outputs = (tmp_path / "generations" / "train.jsonl").read_text().splitlines()
    assert len(outputs) == len(PROMPT_COMPLETIONS)
    # Only the adapters train and are checkpointed, as the file's rules say, and the run
    # records them with their base.
    assert "LoRA on 28 kernels" in recorded.stdout  # 7 projections x 4 layers
    record = json.loads((pathlib.Path(model_dir) / "lora.json").read_text())
    assert record["base"] == {"hf": os.path.abspath(hf_dir)}
    assert record["config"]["rules"][0] == ["(q|k|v|o)_proj/kernel$", 8]
    assert record["config"]["dropout"] == 0.05
    ckpt = checkpointer.Checkpointer(model_dir)
    saved = ckpt.saved_param_shapes(1)
    ckpt.close()
    assert len(saved) == 56 and all(n.endswith(("/lora_a", "/lora_b")) for n in saved)

    # The same command with more steps, training alone, resumes the adapters.
    result = run_main(
        [
            f"--gin_file={user_gin}",
            f"--gin.INIT_FROM_HF='{hf_dir}'",
            f"--gin.MODEL_DIR='{model_dir}'",
            f"--gin.TRAIN_FILE='{data}'",
            f"--gin.VALIDATION_FILE='{data}'",
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 16}",
            "--gin.BATCH_SIZE=2",
            "--gin.TRAIN_STEPS=2",
            "--gin.LEARNING_RATE=0.0",
            "--gin.WARMUP_STEPS=1",
            "--gin.EVAL_PERIOD=0",
            "--gin.LOG_PERIOD=1",
            "--gin.run_in_order.fns=[@train.train]",
        ],
        cwd=repo_dir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resumed from checkpoint step 1" in result.stdout
    assert [m["step"] for m in read_metrics(model_dir)] == [1, 2]


@pytest.mark.slow
def test_grpo_gin_from_an_hf_checkpoint_samples_from_trls_prompts(tmp_path, repo_dir):
    """gin/grpo.gin as its comment says to start it from an HF checkpoint (its shape's file
    for models/gptj_tiny.gin, no SFT stage, INIT_FROM, the checkpoint's tokenizer for the
    task; here one that adds nothing, Qwen-like): the rollouts sample from the ids TRL's
    GRPOTrainer tokenizes each prompt to ("!", id 0, kept), the MODEL_DIR records the HF form
    and `infer` prompts it the same way."""
    hf_dir, tok, _ = hf_checkpoint(tmp_path / "hf", "qwen", **LLAMA_TINY)
    data = write_jsonl(tmp_path / "prompts.jsonl", [GRPO_PROMPT])
    shipped = open(os.path.join(repo_dir, "gin", "grpo.gin")).read()
    user_gin = tmp_path / "my_grpo.gin"
    user_gin.write_text(
        shipped.replace("include 'models/gptj_tiny.gin'", "include 'models/llama_tiny.gin'")
        + "from flaxlm.data import vocabularies\n"
        "gin_utils.run.fn = @grpo.grpo\n"
        "INIT_FROM = %INIT_FROM_HF\n"
        "jsonl.register_jsonl_task.vocabulary = @vocabularies.HuggingFaceVocabulary()\n"
        "vocabularies.HuggingFaceVocabulary.path = %INIT_FROM_HF\n"
        f"jsonl.register_jsonl_task.split_files = {{'train': '{data}'}}\n"
        # one step at learning rate 0, 2 prompts x 2 completions
        "grpo.grpo.total_steps = 1\n"
        "grpo.grpo.log_period = 1\n"
        "grpo.grpo.checkpoint_period = 1\n"
        "grpo/data.DatasetConfig.batch_size = 2\n"
        "rl.GrpoConfig.num_generations = 2\n"
    )
    model_dir, recorded = run_recipe(
        tmp_path,
        repo_dir,
        str(user_gin),
        hf_dir,
        "--gin.GRPO_LEARNING_RATE=0.0",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 12, 'targets': 4}",
    )
    (trl,) = tok(text=[GRPO_PROMPT["prompt"]])["input_ids"]  # GRPOTrainer's
    assert 0 in trl  # "!"
    assert recorded.prompts["grpo"] == [trl] * 4  # 2 prompts x 2 completions
    (step,) = read_metrics(model_dir)
    assert step["kl"] == pytest.approx(0.0, abs=TOL)  # the policy is its reference
    record = json.loads((pathlib.Path(model_dir) / run_dir.MODEL_RECORD).read_text())
    assert record[run_dir.RECORD_ROW_START] is None
    assert infer_prompt(model_dir, hf_dir, GRPO_PROMPT["prompt"]) == trl
