"""Chat SFT and preference data: rendering with a real chat template, the signed-offset loss
mask, ShareGPT input, packing through ChatFeatureConverter, preference pairs through
PreferenceFeatureConverter, truncation counts and malformed lines."""

import json
import re

import numpy as np
import pytest
import seqio
import tensorflow as tf

import tasks  # noqa: F401  (registers the factories)
from flaxlm.models.features import (
    ChatFeatureConverter,
    PreferenceFeatureConverter,
    decode_signed,
)
from tasks import chat
from tests.hf_helpers import QWEN_CHAT_TEMPLATE, save_byte_bpe_tokenizer

OFFSET = 3  # ByteVocabulary: id = byte + 3 (0 pad, 1 EOS)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},  # '!' is id 0 in the tiny BPE
    {"role": "user", "content": "What is the answer?"},
    {"role": "assistant", "content": "It is four."},
]
SHORT = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "main"},
        {"role": "assistant", "content": "return 0"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("chat_tokenizer")
    save_byte_bpe_tokenizer(path, style="qwen")  # ChatML template, <|im_end|> ends a turn
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    assert tok.chat_template == QWEN_CHAT_TEMPLATE
    return tok


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _template_ids(tok, messages, **kw) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _expected(tok, messages) -> tuple[list[int], list[int]]:
    """Ids and loss mask built piece by piece, independently of prefix rendering: ChatML's
    header, the content and <|im_end|> (trained for the assistant), then a newline."""
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids, mask = [], []
    for m in messages:
        trained = int(m["role"] == "assistant")
        for piece, w in ((enc(f"<|im_start|>{m['role']}\n"), 0), (enc(m["content"]), trained)):
            ids += piece
            mask += [w] * len(piece)
        ids += [im_end] + enc("\n")
        mask += [trained] + [0] * len(enc("\n"))
    return ids, mask


def _decode(signed) -> tuple[np.ndarray, np.ndarray]:
    tokens, weights = decode_signed(tf.constant(signed, tf.int32))
    return tokens.numpy(), weights.numpy()


def test_decode_signed():
    tokens, weights = _decode([3, -1, 0, 1, -5])
    assert tokens.tolist() == [2, 0, 0, 0, 4] and weights.tolist() == [1, 0, 0, 1, 0]


def test_multi_turn_rendering_matches_the_template_and_masks_exactly_the_assistant(tokenizer):
    signed = chat.render_conversation(tokenizer, CONVERSATION)
    tokens, weights = _decode(signed)
    assert tokens.tolist() == _template_ids(tokenizer, CONVERSATION)
    ids, mask = _expected(tokenizer, CONVERSATION)
    assert tokens.tolist() == ids  # the piecewise build is the same token sequence
    assert weights.tolist() == mask
    # Both assistant contents and their <|im_end|> are trained, nothing else; id 0 survives.
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert weights.sum() == len(enc("Hello!")) + len(enc("It is four.")) + 2
    assert 0 in tokens[weights == 1] and 0 not in signed
    trained_text = tokenizer.decode(tokens[weights == 1].tolist())
    assert trained_text == "Hello!<|im_end|>It is four.<|im_end|>"


def test_sharegpt_gives_the_openai_result(tmp_path, tokenizer):
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    share = [{"from": roles[m["role"]], "value": m["content"]} for m in CONVERSATION]
    openai_file = _write(tmp_path / "openai.jsonl", [{"messages": CONVERSATION}])
    share_file = _write(tmp_path / "share.jsonl", [{"conversations": share}])
    renderer = chat.ChatRenderer(tokenizer)
    rows_a, _ = chat.render_chat_files([openai_file], renderer, 1000)
    rows_b, _ = chat.render_chat_files([share_file], renderer, 1000)
    assert rows_a == rows_b == [chat.render_conversation(tokenizer, CONVERSATION)]


def test_a_template_that_is_not_prefix_consistent_fails_naming_the_example(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path, local_files_only=True)
    tok.chat_template = "{{ messages | length }}" + QWEN_CHAT_TEMPLATE  # the turn count first
    path = _write(tmp_path / "c.jsonl", [{"messages": SHORT[0]}, {"messages": CONVERSATION}])
    with pytest.raises(ValueError, match=f"{re.escape(path)}:1: the chat template is not prefix"):
        chat.render_chat_files([path], chat.ChatRenderer(tok), 1000)


def _chat_task(tmp_path, tokenizer_dir, name, conversations, **kw) -> str:
    path = _write(tmp_path / f"{name}.jsonl", [{"messages": c} for c in conversations])
    return chat.register_chat_task(
        name=name, split_files={"train": path}, tokenizer_path=tokenizer_dir, **kw
    )


def _converted(name, converter, lengths, split="train") -> list[dict]:
    ds = seqio.get_dataset(
        name,
        task_feature_lengths=lengths,
        dataset_split=split,
        shuffle=False,
        num_epochs=1,
        feature_converter=converter,
    )
    return list(ds.as_numpy_iterator())


def test_chat_converter_packs_the_task_and_counts_truncation(
    tmp_path, tokenizer, tokenizer_dir, capsys
):
    conversations = [*SHORT, CONVERSATION, SHORT[1], CONVERSATION]
    expected = [_decode(chat.render_conversation(tokenizer, c)) for c in conversations]
    max_length = len(expected[2][0]) - 3  # CONVERSATION loses ".<|im_end|>\n"
    lost = int(expected[2][1][max_length:].sum())
    assert lost == 2
    name = _chat_task(tmp_path, tokenizer_dir, "chat_packed", conversations, max_length=max_length)
    line = f"Task 'chat_packed' (train): 2 of 5 conversations longer than {max_length} tokens"
    assert f"{line}, truncated (4 assistant tokens lost)." in capsys.readouterr().out
    expected = [(t[:max_length], w[:max_length]) for t, w in expected]

    rows = _converted(name, ChatFeatureConverter(pack=True), {"targets": 128})
    segments = []
    for row in rows:
        assert set(row) == {
            "decoder_target_tokens",
            "decoder_input_tokens",
            "decoder_loss_weights",
            "decoder_segment_ids",
            "decoder_positions",
        }
        for s in range(1, row["decoder_segment_ids"].max() + 1):
            at = row["decoder_segment_ids"] == s
            tokens = row["decoder_target_tokens"][at]
            assert row["decoder_positions"][at].tolist() == list(range(at.sum()))
            assert row["decoder_input_tokens"][at].tolist() == [0, *tokens[:-1]]
            segments.append((tokens.tolist(), row["decoder_loss_weights"][at].tolist()))
        pad = row["decoder_segment_ids"] == 0
        assert not row["decoder_loss_weights"][pad].any()
        assert not row["decoder_target_tokens"][pad].any()
    assert max(r["decoder_segment_ids"].max() for r in rows) >= 2  # packed
    assert segments == [(t.tolist(), w.tolist()) for t, w in expected]

    # Unpacked: one conversation a row; the same features as seqio's LM converter gives the
    # decoded ids, but the loss weights are the mask.
    rows = _converted(name, ChatFeatureConverter(pack=False), {"targets": 96})
    plain = tf.data.Dataset.from_generator(
        lambda: ({"targets": t} for t, _ in expected),
        output_signature={"targets": tf.TensorSpec([None], tf.int32)},
    )
    lm = list(seqio.DecoderFeatureConverter(pack=False)(plain, {"targets": 96}).as_numpy_iterator())
    for row, reference, (_, w) in zip(rows, lm, expected, strict=True):
        for key in ("decoder_target_tokens", "decoder_input_tokens"):
            np.testing.assert_array_equal(row[key], reference[key])
        assert row["decoder_loss_weights"].tolist() == w.tolist() + [0] * (96 - len(w))


def test_drop_truncated_and_register_twice(tmp_path, tokenizer, tokenizer_dir, capsys):
    conversations = [SHORT[0], CONVERSATION, SHORT[1]]  # 27, 92 and 41 tokens
    name = _chat_task(
        tmp_path, tokenizer_dir, "chat_drop", conversations, max_length=50, drop_truncated=True
    )
    assert "1 of 3 conversations longer than 50 tokens, dropped" in capsys.readouterr().out
    rows = _converted(name, ChatFeatureConverter(pack=False), {"targets": 50})
    kept = [chat.render_conversation(tokenizer, c) for c in SHORT]
    assert [r["decoder_loss_weights"].sum() for r in rows] == [
        sum(t > 0 for t in ids) for ids in kept
    ]
    again = {"split_files": {}, "tokenizer_path": "x", "max_length": 1}
    assert chat.register_chat_task(name=name, **again) == name


def test_preference_task_plain_and_conversational(tmp_path, tokenizer, tokenizer_dir):
    prompt = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    records = [
        {"prompt": "Q: 3+4=", "chosen": " 7", "rejected": " 9"},
        {"prompt": prompt, "chosen": [{"role": "assistant", "content": "Hello"}], "rejected": "No"},
    ]
    path = _write(tmp_path / "pref.jsonl", records)
    name = chat.register_preference_task(
        name="pref_mixed", split_files={"train": path}, tokenizer_path=tokenizer_dir, max_length=64
    )
    converter = PreferenceFeatureConverter(pack=True)  # never packs
    assert not converter.pack
    assert converter.get_model_feature_lengths({"chosen": 40, "rejected": 32}) == {
        "decoder_target_tokens": 40,
        "decoder_input_tokens": 40,
        "decoder_loss_weights": 40,
    }
    plain, conv = _converted(name, converter, {"chosen": 52, "rejected": 46})
    for ex in (plain, conv):
        assert {k: v.shape for k, v in ex.items()} == {
            "decoder_target_tokens": (2, 52),
            "decoder_input_tokens": (2, 52),
            "decoder_loss_weights": (2, 52),
        }
        for row in (0, 1):
            targets = ex["decoder_target_tokens"][row]
            assert ex["decoder_input_tokens"][row].tolist() == [0, *targets[:-1]]

    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = tokenizer.eos_token_id
    for row, answer in ((0, " 7"), (1, " 9")):  # plain: vocabulary.encode, EOS after answers
        n_prompt, n_answer = len(enc("Q: 3+4=")), len(enc(answer)) + 1
        tokens = plain["decoder_target_tokens"][row]
        assert tokens[: n_prompt + n_answer].tolist() == enc("Q: 3+4=") + enc(answer) + [eos]
        assert not tokens[n_prompt + n_answer :].any()
        weights = plain["decoder_loss_weights"][row].tolist()
        assert weights == [0] * n_prompt + [1] * n_answer + [0] * (52 - n_prompt - n_answer)

    n_prompt = len(_template_ids(tokenizer, prompt, add_generation_prompt=True))
    for row, answer in ((0, "Hello"), (1, "No")):  # conversational: the template's rendering
        full = _template_ids(tokenizer, [*prompt, {"role": "assistant", "content": answer}])
        tokens = conv["decoder_target_tokens"][row]
        assert tokens[: len(full)].tolist() == full and not tokens[len(full) :].any()
        trained = tokens[conv["decoder_loss_weights"][row] == 1].tolist()
        # As TRL's DPO: all that follows the prompt, the template's newline after the
        # end-of-turn token included.
        end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert trained == enc(answer) + [end_of_turn] + enc("\n")
        assert np.flatnonzero(conv["decoder_loss_weights"][row])[0] == n_prompt
    np.testing.assert_array_equal(  # the same prompt in both rows
        conv["decoder_target_tokens"][0, :n_prompt], conv["decoder_target_tokens"][1, :n_prompt]
    )


def test_preference_truncation_keeps_the_end_of_the_prompt(tmp_path, capsys):
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    records = [
        {"prompt": alphabet, "chosen": "xyz", "rejected": "uvwxyz12"},
        {"prompt": "hi", "chosen": "a", "rejected": "b"},
    ]
    path = _write(tmp_path / "long.jsonl", records)
    name = chat.register_preference_task(
        name="pref_bytes", split_files={"train": path}, max_length=16
    )
    out = capsys.readouterr().out
    assert "1 of 2 pairs longer than 16 tokens, truncated (18 prompt and 1 answer tokens" in out
    first, _ = _converted(name, PreferenceFeatureConverter(), {"chosen": 16, "rejected": 16})
    byte_ids = lambda text: [b + OFFSET for b in text.encode()]  # noqa: E731
    chosen, rejected = first["decoder_target_tokens"].tolist()
    # keep max(max_length // 2, 16 - 9) = 8 prompt tokens; the rejected answer loses its EOS
    assert chosen == byte_ids("stuvwxyz") + byte_ids("xyz") + [1] + [0] * 4
    assert rejected == byte_ids("stuvwxyz") + byte_ids("uvwxyz12")
    assert first["decoder_loss_weights"].tolist() == [
        [0] * 8 + [1] * 4 + [0] * 4,
        [0] * 8 + [1] * 8,
    ]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"messages": [{"role": "user"}]}', r"messages\[0\] has no string 'content'"),
        (
            '{"conversations": [{"from": "bot", "value": "x"}]}',
            r"conversations\[0\] has 'from' 'bot'",
        ),
        ('{"text": "hello"}', "expected a 'messages' list"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
        ('{"messages": ', "not valid JSON"),
        # A column TRL reads and these tasks do not; tools and template variables they
        # read, checked (tests/test_trl_parity.py renders them as TRL does).
        ('{"messages": [], "images": ["cat.png"]}', "'images' is a column TRL reads"),
        (
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
            '"content": "x"}], "tools": "[{not json"}',
            "'tools' is a string but not JSON",
        ),
        (
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
            '"content": "x"}], "chat_template_kwargs": {"tokenize": true}}',
            r"chat_template_kwargs \['tokenize'\] are apply_chat_template's own arguments",
        ),
        (
            '{"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}',
            r"messages\[0\] has 'tool_calls' \[\]; only an assistant message calls tools",
        ),
        (
            '{"messages": [{"role": "user", "content": null}]}',
            r"messages\[0\] has no string 'content' \(only an assistant",
        ),
    ],
)
def test_malformed_chat_line_fails_naming_file_and_line(tmp_path, tokenizer_dir, bad_line, message):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": SHORT[0]})
    path.write_text(f"{good}\n\n{bad_line}\n{good}\n")
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}:3: {message}"):
        chat.register_chat_task(
            name="chat_bad", split_files={"train": str(path)}, tokenizer_path=tokenizer_dir,
            max_length=64,
        )  # fmt: skip
    assert "chat_bad" not in seqio.TaskRegistry.names()


def test_malformed_preference_line_fails_naming_file_and_line(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with open(path, "a") as f:
        f.write(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
        f.write(json.dumps({"prompt": [{"role": "user", "content": "a"}], "chosen": "b"}) + "\n")
    with pytest.raises(ValueError, match=f"{re.escape(path)}:2: missing 'rejected'"):
        chat.register_preference_task(name="pref_bad", split_files={"train": path}, max_length=8)
    images = {"prompt": "a", "chosen": "b", "rejected": "c", "images": ["cat.png"]}
    path = _write(tmp_path / "images.jsonl", [images])
    with pytest.raises(ValueError, match=f"{re.escape(path)}:1: 'images' is a column TRL"):
        chat.register_preference_task(name="pref_img", split_files={"train": path}, max_length=8)
    # Tools go to the chat template: on a plain-text pair (TRL ignores them there), refused.
    tools = {"prompt": "a", "chosen": "b", "rejected": "c", "tools": [{"type": "function"}]}
    path = _write(tmp_path / "tools.jsonl", [tools])
    with pytest.raises(ValueError, match=f"{re.escape(path)}:1: 'tools' goes to the chat"):
        chat.register_preference_task(name="pref_tools", split_files={"train": path}, max_length=8)


def test_examples_that_cannot_teach_are_refused_or_dropped_and_counted(
    tmp_path, tokenizer_dir, capsys
):
    """A pair whose chosen is its rejected (its loss is log 2 under any policy) and a chat
    whose assistant turn is empty: an error naming file and line, or with
    on_untrainable='drop' left out and counted in the split's line."""
    pairs = [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "q", "chosen": " x"}]
    pairs[1]["rejected"] = " x"
    pair_path = _write(tmp_path / "pairs.jsonl", pairs)
    empty = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]
    chat_path = _write(tmp_path / "chat.jsonl", [{"messages": SHORT[0]}, {"messages": empty}])
    files = {"pref_same": {"train": pair_path}, "chat_empty": {"train": chat_path}}
    register = {
        "pref_same": lambda **kw: chat.register_preference_task(max_length=16, **kw),
        "chat_empty": lambda **kw: chat.register_chat_task(
            tokenizer_path=tokenizer_dir, max_length=64, **kw
        ),
    }
    why = {"pref_same": "chosen and rejected answers are the same", "chat_empty": "message 1"}
    for name, fn in register.items():
        with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path))}.*:2: .*{why[name]}"):
            fn(name=name, split_files=files[name])
        assert name not in seqio.TaskRegistry.names()
        fn(name=name, split_files=files[name], on_untrainable="drop")
        assert "1 that cannot teach dropped." in capsys.readouterr().out
    with pytest.raises(ValueError, match="on_untrainable='skip'"):
        register["pref_same"](name="pref_bad_setting", split_files={}, on_untrainable="skip")


def test_conversational_pairs_need_a_tokenizer_and_shuffling_is_deterministic(tmp_path):
    conv = {"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"}
    path = _write(tmp_path / "conv.jsonl", [conv])
    with pytest.raises(ValueError, match="'pref_no_template': a conversational record needs"):
        chat.register_preference_task(
            name="pref_no_template", split_files={"train": path}, max_length=8
        )
    records = [{"prompt": f"p{i}", "chosen": "y", "rejected": "n"} for i in range(20)]
    path = _write(tmp_path / "many.jsonl", records)
    name = chat.register_preference_task(
        name="pref_shuffle", split_files={"train": path}, max_length=8
    )

    def order(seed):
        ds = seqio.get_mixture_or_task(name).get_dataset(None, "train", shuffle=True, seed=seed)
        prompts = [_decode(ex["chosen"])[0][:-2] - OFFSET for ex in ds.as_numpy_iterator()]
        return [bytes(p.tolist()).decode() for p in prompts]

    assert order(1) == order(1) != order(2)
    assert sorted(order(1)) == sorted(r["prompt"] for r in records)
