"""HuggingFaceVocabulary over a tokenizer built locally (nothing downloaded)."""

import functools
import pickle

import numpy as np
import pytest
import seqio
import tensorflow as tf
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from flaxlm.data.vocabularies import HuggingFaceVocabulary
from tests.hf_helpers import save_byte_bpe_tokenizer, save_gemma_style_tokenizer

TEXTS = ["the cat sat on the mat", "a dog ate the cat food", "the mat is on the dog"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<pad>", "</s>", "<unk>"])
    tok.train_from_iterator(TEXTS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    path = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(str(path))
    return str(path)


def test_python_round_trip_and_special_ids(tokenizer_dir):
    vocab = HuggingFaceVocabulary(tokenizer_dir)
    ids = vocab.encode("the cat sat")
    assert ids and all(3 <= i < vocab.vocab_size for i in ids)
    assert vocab.eos_id == 1 and vocab.unk_id == 2 and vocab.pad_id == 0
    assert vocab.decode(ids) == "the cat sat"
    # decode stops at EOS; seqio's padding after it is dropped.
    assert vocab.decode([*ids, vocab.eos_id, 0, 0]) == "the cat sat"
    assert vocab == HuggingFaceVocabulary(tokenizer_dir)
    assert pickle.loads(pickle.dumps(vocab)).encode("the cat sat") == ids


def test_tf_round_trip(tokenizer_dir):
    vocab = HuggingFaceVocabulary(tokenizer_dir)
    ids = vocab.encode_tf(tf.constant("a dog ate the cat food"))
    assert ids.dtype == tf.int32 and ids.shape.rank == 1
    assert list(ids.numpy()) == list(vocab.encode("a dog ate the cat food"))
    first = [*ids.numpy(), vocab.eos_id, 0]
    second = [*vocab.encode("the mat"), vocab.eos_id]
    batch = tf.constant([first, second + [0] * (len(first) - len(second))])
    texts = vocab.decode_tf(batch).numpy()
    assert [t.decode() for t in texts] == ["a dog ate the cat food", "the mat"]


def test_seqio_task_with_the_vocabulary(tokenizer_dir):
    vocab = HuggingFaceVocabulary(tokenizer_dir)
    name = "test_hf_vocab_task"
    seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(
        name,
        source=seqio.FunctionDataSource(
            lambda split, shuffle_files: tf.data.Dataset.from_tensor_slices({"text": TEXTS}),
            splits=["train"],
        ),
        preprocessors=[
            functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
            seqio.preprocessors.tokenize,
            seqio.preprocessors.append_eos,
        ],
        output_features={"targets": seqio.Feature(vocabulary=vocab, add_eos=True)},
    )
    try:
        ds = seqio.get_mixture_or_task(name).get_dataset(
            {"targets": 32}, split="train", shuffle=False
        )
        rows = [ex["targets"] for ex in ds.as_numpy_iterator()]
    finally:
        seqio.TaskRegistry.remove(name)
    assert len(rows) == 3
    assert all(r[-1] == vocab.eos_id for r in rows)
    assert vocab.decode(rows[0].tolist()) == TEXTS[0]
    assert np.all(np.concatenate(rows) < vocab.vocab_size)


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        HuggingFaceVocabulary(str(tmp_path / "nowhere"))


# What the families' own tokenizers look like on disk, built here: Qwen's and Llama 3's
# byte-level BPE (no unknown token: any text round-trips), Gemma's SentencePiece-style BPE with
# byte fallback.
HUB_STYLES = {
    "qwen": (functools.partial(save_byte_bpe_tokenizer, style="qwen"), None, "<|endoftext|>"),
    "llama3": (
        functools.partial(save_byte_bpe_tokenizer, style="llama3"),
        "<|begin_of_text|>",
        "<|end_of_text|>",
    ),
    "gemma": (save_gemma_style_tokenizer, "<bos>", "<eos>"),
}


@pytest.mark.parametrize("style", sorted(HUB_STYLES))
def test_hub_style_tokenizers_round_trip_any_text(tmp_path, style):
    save, bos, eos = HUB_STYLES[style]
    save(tmp_path)
    vocab = HuggingFaceVocabulary(str(tmp_path))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "def f(x):\n    return x  # \u00e9t\u00e9 \u4e2d\u6587 \U0001f600 unseen words"
    ids = vocab.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert vocab.decode(ids) == text
    assert vocab.decode_tf(tf.constant(ids)).numpy().decode() == text
    if reference.convert_ids_to_tokens(0) == "!":  # a token of text, not padding
        assert vocab.decode([*ids, 0]) == text + "!"
        padded = tf.constant([[*ids, 0, 0], [*ids, 0, vocab.eos_id]])  # seqio's padded rows
        assert [t.decode() for t in vocab.decode_tf(padded).numpy()] == [text, text + "!"]
    assert vocab.eos_id == reference.convert_tokens_to_ids(eos)
    assert vocab.bos_id == (None if bos is None else reference.convert_tokens_to_ids(bos))
