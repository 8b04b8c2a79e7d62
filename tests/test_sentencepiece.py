"""A SentencePiece model trained locally, used as a seqio vocabulary in a text-files task."""

import gin
import pytest
import sentencepiece
import seqio

import tasks  # noqa: F401  (registers the factories and the Gin vocabularies)
from tasks.text_files import register_text_files_task

LINES = [
    "the cat sat on the mat",
    "a dog ate the cat food",
    "the mat is on the dog",
    "cats and dogs eat food",
]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("spm")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(LINES * 4) + "\n")
    # seqio's convention (T5's): pad 0, EOS 1, UNK 2, no BOS.
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(root / "spm"),
        vocab_size=40,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return str(root / "spm.model")


@pytest.fixture()
def text_file(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("\n".join(LINES) + "\n")
    return str(path)


def _rows(name):
    ds = seqio.get_mixture_or_task(name).get_dataset({"targets": 64}, split="train", shuffle=False)
    return [ex["targets"] for ex in ds.as_numpy_iterator()]


def test_text_files_task_with_a_local_sentencepiece_model(spm_model, text_file):
    vocab = seqio.SentencePieceVocabulary(spm_model)
    name = register_text_files_task(
        name="spm_lines", split_files={"train": text_file}, vocabulary=vocab
    )
    rows = _rows(name)
    assert [vocab.decode(r[:-1].tolist()) for r in rows] == LINES
    assert all(r[-1] == 1 for r in rows)
    # Subwords, not bytes: far fewer ids than characters.
    assert sum(len(r) for r in rows) < 0.75 * sum(len(line) for line in LINES)
    assert max(max(r) for r in rows) < vocab.vocab_size


def test_sentencepiece_vocabulary_binds_in_gin(spm_model, text_file):
    gin.clear_config()
    try:
        gin.parse_config(
            [
                "register_text_files_task.name = 'spm_gin'",
                f"register_text_files_task.split_files = {{'train': '{text_file}'}}",
                "register_text_files_task.vocabulary = @seqio.SentencePieceVocabulary()",
                f"seqio.SentencePieceVocabulary.sentencepiece_model_file = '{spm_model}'",
            ]
        )
        name = register_text_files_task()
    finally:
        gin.clear_config()
    vocab = seqio.get_mixture_or_task(name).output_features["targets"].vocabulary
    assert isinstance(vocab, seqio.SentencePieceVocabulary)
    assert vocab.decode(_rows(name)[0][:-1].tolist()) == LINES[0]
