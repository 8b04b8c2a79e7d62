"""An HF checkpoint trains on the sequences HF and TRL would feed it: no inserted token 0.

Two tiny tokenizers (trained here, no download): Llama-3-like, whose tokenizer adds its BOS,
and Qwen-like, which adds nothing. For each, the rows flaxlm's converters give (plain text,
chat, preference pairs; packed and not) equal what the tokenizer and TRL 1.16's tokenization
and collators give, shifted as the model reads them (inputs `ids[:-1]`, targets `ids[1:]`);
per-answer DPO log-probs equal TRL's formula on HF's torch model; prompts at inference start
as training rows did; and an old MODEL_DIR (seqio's start token) keeps its start.
"""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest
import seqio
import tensorflow as tf
import trl.trainer.dpo_trainer as trl_dpo  # a test dependency (setup.py test extra)
import trl.trainer.sft_trainer as trl_sft
from trl.data_utils import _tokenize as trl_tokenize
from trl.trainer.utils import selective_log_softmax

from flaxlm.checkpoints import hf, run_dir
from flaxlm.data import pipeline
from flaxlm.data.vocabularies import HuggingFaceVocabulary
from flaxlm.inference import generation
from flaxlm.models.features import (
    ChatFeatureConverter,
    LMFeatureConverter,
    PreferenceFeatureConverter,
)
from flaxlm.models.row_start import HF_START, SEQIO_START
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.posttrain import preference
from tasks import chat
from tests.hf_helpers import TRAINING_TEXT, random_hf_model, save_torch_model

STYLES = {
    # specials, BOS (added by the tokenizer, written by the template), EOS, turn start, end
    "llama3": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "",
        "<|eot_id|>",
    ),
    "qwen": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        None,
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ),
}
TEXTS = ["def main():\n    return 0", "The quick brown fox.<EOS>", "import os"]
CONVERSATIONS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
    ],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6, été"},
    ],
]
# A tool-use conversation as TRL's SFT reads one: `tools` (here a JSON string, which TRL
# parses) and the template's variables handed to apply_chat_template, an assistant turn of
# tool calls alone (trained), the tool's result (not).
TOOL_RECORD = {
    "messages": [
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"c": 1}}}],
        },
        {"role": "tool", "content": "18C"},
        {"role": "assistant", "content": "18C."},
    ],
    "tools": json.dumps([{"type": "function", "function": {"name": "w"}}]),
    "chat_template_kwargs": {"brief": True},
}
CHAT_RECORDS = [*({"messages": c} for c in CONVERSATIONS), TOOL_RECORD]
PAIRS = [
    {"prompt": "Q: the fox?", "chosen": " Yes.<EOS>", "rejected": " No"},
    {"prompt": "import", "chosen": " os", "rejected": " sys"},
    {
        "prompt": [{"role": "user", "content": "Hi"}],
        "chosen": [{"role": "assistant", "content": "Hello."}],
        "rejected": [{"role": "assistant", "content": "Go away"}],
    },
    # TRL's DPO hands a pair's tools and template variables to the template too: a call
    # chosen over a guess.
    {
        "prompt": [{"role": "user", "content": "Paris?"}],
        "chosen": [TOOL_RECORD["messages"][1]],
        "rejected": [{"role": "assistant", "content": "Sunny."}],
        "tools": TOOL_RECORD["tools"],
        "chat_template_kwargs": {"brief": True},
    },
]
LENGTH = 96


def save_tokenizer(path, style: str) -> None:
    """A byte-level BPE like the style's real tokenizer: its specials, BOS added by a
    post-processor (llama3) or none (qwen), and a chat template whose generation block is
    each assistant message's content and end-of-turn token (TRL's `assistant_only_loss`)."""
    import tokenizers
    import transformers

    specials, bos, eos, start, end = STYLES[style]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT * 4, trainer)
    tok.add_special_tokens(specials)
    if bos is not None:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos
    )
    fast.chat_template = (
        ("{{ bos_token }}" if bos else "")
        + "{% if brief %}(brief){% endif %}{% if tools %}"
        + start
        + "tools\n{% for t in tools %}{{ t['function']['name'] }}{% endfor %}"
        + end
        + "\n{% endif %}{% for m in messages %}"
        + start
        + "{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}<call>{{ c['function']['name'] }}"
        "{{ c['function']['arguments'] | tojson }}</call>{% endfor %}"
        + end
        + "{% endgeneration %}{% else %}{{ m['content'] }}"
        + end
        + "{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}" + start + "assistant\n{% endif %}"
    )
    fast.save_pretrained(str(path))


@pytest.fixture(scope="module", params=["llama3", "qwen"])
def setup(request, tmp_path_factory):
    """(style, tokenizer dir, tokenizer, task names, an HF-form model, and its converter
    kwargs for the plain-text task)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    style = request.param
    root = tmp_path_factory.mktemp(style)
    save_tokenizer(root / "tok", style)
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    eos_text = tok.eos_token
    texts = [t.replace("<EOS>", eos_text) for t in TEXTS]
    pairs = [
        {k: v.replace("<EOS>", eos_text) if isinstance(v, str) else v for k, v in p.items()}
        for p in PAIRS
    ]
    vocab = HuggingFaceVocabulary(str(root / "tok"))
    lm_name = f"trl_lm_{style}"
    if lm_name not in seqio.TaskRegistry.names():
        seqio.TaskRegistry.add(
            lm_name,
            source=seqio.FunctionDataSource(
                lambda split, shuffle_files, seed=None: tf.data.Dataset.from_tensor_slices(
                    {"text": texts}
                ),
                splits=("train",),
            ),
            preprocessors=[
                functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
                seqio.preprocessors.tokenize,
                seqio.preprocessors.append_eos_after_trim,
            ],
            output_features={"targets": seqio.Feature(vocab, add_eos=True)},
        )
    chat_path = root / "chat.jsonl"
    chat_path.write_text("".join(json.dumps(r) + "\n" for r in CHAT_RECORDS))
    pair_path = root / "pairs.jsonl"
    pair_path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    names = {
        "lm": lm_name,
        "chat": chat.register_chat_task(
            name=f"trl_chat_{style}",
            split_files={"train": str(chat_path)},
            tokenizer_path=str(root / "tok"),
            max_length=LENGTH,
        ),
        "pairs": chat.register_preference_task(
            name=f"trl_pairs_{style}",
            split_files={"train": str(pair_path)},
            tokenizer_path=str(root / "tok"),
            max_length=LENGTH,
        ),
    }
    torch_model = random_hf_model(
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
    save_torch_model(torch_model, root / "hf")
    return style, root, tok, texts, pairs, names, torch_model


def converted(name, converter, length=LENGTH) -> list[dict]:
    lengths = {"targets": length} if "pairs" not in name else {"chosen": length, "rejected": length}
    ds = seqio.get_dataset(
        name,
        task_feature_lengths=lengths,
        dataset_split="train",
        shuffle=False,
        num_epochs=1,
        feature_converter=converter,
    )
    return list(ds.as_numpy_iterator())


def hf_model(root):
    return hf.model_from_hf_dir(str(root / "hf"))


def hf_converter(root, converter_cls, task):
    """`converter_cls` told the row start of a run from the HF checkpoint, as a run gets it."""
    row_start = run_dir.run_row_start(hf_model(root), root / "no_run_yet", str(root / "hf"))
    assert row_start == HF_START
    return pipeline.ConverterFactory.create(converter_cls, row_start, task)


def shifted(ids, mask) -> tuple[list[int], list[int], list[int]]:
    """What a causal LM reads and predicts of TRL's `input_ids` / loss mask."""
    return list(ids[:-1]), list(ids[1:]), [int(m) for m in mask[1:]]


def trl_lm_rows(tok, texts) -> list[tuple]:
    eos = tok.eos_token  # SFTTrainer appends the EOS text to a text lacking it
    examples = [trl_tokenize(tok, t if t.endswith(eos) else t + eos) for t in texts]
    batch = trl_sft.DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id)(
        [{"input_ids": e["input_ids"]} for e in examples]
    )
    out = []
    for row, e in zip(batch["labels"].numpy(), examples):
        n = len(e["input_ids"])
        out.append(shifted(e["input_ids"], (row[:n] != -100)))
    return out


def trl_chat_rows(tok) -> list[tuple]:
    out = []
    for record in CHAT_RECORDS:  # as TRL 1.16's SFTTrainer.tokenize_fn renders a record
        tools = record.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        e = trl_tokenize(
            tok,
            record["messages"],
            tools=tools,
            return_assistant_tokens_mask=True,
            **record.get("chat_template_kwargs", {}),
        )
        out.append(shifted(e["input_ids"], e["assistant_masks"]))
    return out


def trl_pair_batch(tok, pairs) -> dict:
    """TRL 1.16 DPOTrainer's tokenization of each pair, then its collator."""
    eos = tok.eos_token
    examples = []
    for p in pairs:
        if isinstance(p["prompt"], str):
            chosen, rejected = (
                a if a.endswith(eos) else a + eos for a in (p["chosen"], p["rejected"])
            )
            prompt = trl_tokenize(tok, p["prompt"])["input_ids"]
            full_c = trl_tokenize(tok, p["prompt"] + chosen)["input_ids"]
            full_r = trl_tokenize(tok, p["prompt"] + rejected)["input_ids"]
        else:  # as TRL 1.16's DPOTrainer.tokenize_fn hands a record's tools and variables
            tools = json.loads(p["tools"]) if isinstance(p.get("tools"), str) else p.get("tools")
            extra = {"tools": tools, **p.get("chat_template_kwargs", {})}
            prompt = trl_tokenize(tok, p["prompt"], add_generation_prompt=True, **extra)
            prompt = prompt["input_ids"]
            full_c = trl_tokenize(tok, p["prompt"] + p["chosen"], **extra)["input_ids"]
            full_r = trl_tokenize(tok, p["prompt"] + p["rejected"], **extra)["input_ids"]
        n = min(
            next((i for i, (a, b) in enumerate(zip(prompt, f)) if a != b), len(prompt))
            for f in (full_c, full_r)
        )
        examples.append(
            {"prompt_ids": prompt[:n], "chosen_ids": full_c[n:], "rejected_ids": full_r[n:]}
        )
    return trl_dpo.DataCollatorForPreference(pad_token_id=tok.pad_token_id)(examples)


def unpadded(ex, row=None) -> tuple[list[int], list[int], list[int]]:
    get = (lambda k: ex[k]) if row is None else (lambda k: ex[k][row])
    n = int(np.flatnonzero(get("decoder_input_tokens") | get("decoder_target_tokens")).max()) + 1
    return tuple(
        [int(t) for t in get(k)[:n]]
        for k in ("decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights")
    )


def segments(ex) -> list[tuple]:
    """The packed row's segments, each as an unpacked row's (inputs, targets, weights)."""
    out = []
    for s in sorted(set(ex["decoder_segment_ids"].tolist()) - {0}):
        at = ex["decoder_segment_ids"] == s
        out.append(
            tuple(
                [int(t) for t in ex[k][at]]
                for k in ("decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights")
            )
        )
    return out


def test_plain_text_rows_are_the_tokenizers_and_trls(setup):
    style, root, tok, texts, _, names, _ = setup
    want = trl_lm_rows(tok, texts)
    # The BOS where the tokenizer adds one, no token 0 inserted; one EOS after a text that
    # already ends with it.
    assert all((row[0][0] == tok.bos_token_id) == (style == "llama3") for row in want)
    assert tok.convert_tokens_to_ids(tok.eos_token) not in want[1][1][:-1]
    for pack in (False, True):
        converter = hf_converter(root, LMFeatureConverter, names["lm"])
        rows = converted(names["lm"], converter(pack=pack))
        got = [seg for ex in rows for seg in segments(ex)] if pack else [unpadded(e) for e in rows]
        assert got == want, (style, pack)


def test_chat_rows_are_trls_assistant_only_loss(setup):
    style, root, tok, _, _, names, _ = setup
    want = trl_chat_rows(tok)
    for pack in (False, True):
        converter = hf_converter(root, ChatFeatureConverter, names["chat"])
        rows = converted(names["chat"], converter(pack=pack))
        got = [seg for ex in rows for seg in segments(ex)] if pack else [unpadded(e) for e in rows]
        assert got == want, (style, pack)


def pair_rows(root, names) -> list[dict]:
    converter = hf_converter(root, PreferenceFeatureConverter, names["pairs"])
    return converted(names["pairs"], converter(pack=False))


@pytest.mark.slow
def test_preference_rows_are_trls_and_dpo_log_probs_match_it(setup):
    from transformers import LlamaForCausalLM

    style, root, tok, _, pairs, names, torch_policy = setup
    rows = pair_rows(root, names)
    batch = trl_pair_batch(tok, pairs)
    ids, mask = batch["input_ids"].numpy(), batch["completion_mask"].numpy()
    n = len(pairs)
    for i, ex in enumerate(rows):
        for r in (0, 1):
            trl_row = i + r * n
            length = int(batch["attention_mask"][trl_row].sum())
            want = shifted(ids[trl_row, :length], mask[trl_row, :length])
            assert unpadded(ex, r) == want, (style, i, r)

    # Per-answer log-probs: the policy and a reference that differs from it.
    torch_reference = LlamaForCausalLM(torch_policy.config).eval()
    save_torch_model(torch_reference, root / "reference")
    features = {k: np.stack([ex[k] for ex in rows]) for k in rows[0]}
    for torch_model, path in ((torch_policy, root / "hf"), (torch_reference, root / "reference")):
        import torch

        with torch.no_grad():
            logits = torch_model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
        token_logps = selective_log_softmax(logits[:, :-1], batch["input_ids"][:, 1:])
        trl = (token_logps * batch["completion_mask"][:, 1:]).sum(-1).numpy()
        model, params = hf.from_pretrained(str(path))
        ours, _ = preference.sequence_logps(model, params, features, None)
        np.testing.assert_allclose(np.asarray(ours), np.stack([trl[:n], trl[n:]], 1), atol=1e-4)


def test_inference_prompts_start_as_training_rows_do(setup):
    style, root, tok, texts, _, names, _ = setup
    loaded = run_dir.load_model_and_params(
        root / "hf", Partitioner(mesh_shape=(1, 1, 1), devices=jax.devices()[:1])
    )
    vocab = HuggingFaceVocabulary(str(root / "tok"))
    converter = hf_converter(root, LMFeatureConverter, names["lm"])
    row = unpadded(converted(names["lm"], converter(pack=False))[0])[0]
    prompt = generation.prompt_ids(loaded.model, vocab, texts[0], loaded.row_start)
    assert prompt == row[: len(prompt)]
    assert 0 not in prompt[:1] or style != "llama3"


def test_a_run_keeps_the_start_of_its_model_record(setup, tmp_path):
    _, root, _, _, _, names, _ = setup
    model = hf_model(root)
    # A fine-tune from HF records HF-form rows; its resumption and inference read them.
    run_dir.write_model_record(model, tmp_path / "new", HF_START, str(root / "hf"))
    assert run_dir.recorded_row_start(tmp_path / "new") == HF_START
    assert run_dir.run_row_start(model, tmp_path / "new", None) == HF_START
    # An older MODEL_DIR's record has no field: its run read seqio's start token 0, and it
    # resumes and samples so, even when its gin still names INIT_FROM_HF.
    record = json.loads((tmp_path / "new" / run_dir.MODEL_RECORD).read_text())
    del record[run_dir.RECORD_ROW_START]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / run_dir.MODEL_RECORD).write_text(json.dumps(record))
    assert run_dir.recorded_row_start(tmp_path / "old") == SEQIO_START
    assert run_dir.run_row_start(model, tmp_path / "old", str(root / "hf")) == SEQIO_START
    vocab = HuggingFaceVocabulary(str(root / "tok"))
    assert generation.prompt_ids(model, vocab, "import os", SEQIO_START)[0] == 0
    # A model trained from scratch (no record, no INIT_FROM_HF) reads seqio's start.
    assert run_dir.run_row_start(model, tmp_path / "nothing", None) == SEQIO_START
    # A converter that cannot read the HF form is refused naming it, not run with token 0.
    with pytest.raises(ValueError, match="DecoderFeatureConverter starts each row with token 0"):
        pipeline.ConverterFactory.create(seqio.DecoderFeatureConverter, HF_START, names["lm"])


def test_a_role_the_template_does_not_know_is_refused_naming_file_and_line(setup, tmp_path):
    _, root, _, _, _, _, _ = setup
    path = tmp_path / "bad.jsonl"
    good = {"messages": CONVERSATIONS[0]}
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "asistant", "content": "x"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: message 1 has role 'asistant'"):
        chat.register_chat_task(
            name=f"trl_bad_roles_{root.name}",
            split_files={"train": str(path)},
            tokenizer_path=str(root / "tok"),
            max_length=LENGTH,
        )
