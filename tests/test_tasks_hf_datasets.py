"""Tasks over local HuggingFace `datasets` (save_to_disk directories, json and parquet files)."""

import json

import datasets
import pytest
import seqio

import tasks  # noqa: F401  (registers the factories)
from tasks.hf_datasets import register_hf_dataset_task

OFFSET = 3  # ByteVocabulary: id = byte + 3


def _text(ids):
    return bytes(int(i) - OFFSET for i in ids if i > 1).decode()


def _read(name, split="train", shuffle=False, seed=None, lengths=None, shard=None):
    ds = seqio.get_mixture_or_task(name).get_dataset(
        lengths, split=split, shuffle=shuffle, seed=seed, shard_info=shard
    )
    return list(ds.as_numpy_iterator())


def test_save_to_disk_directory_gives_a_text_task(tmp_path):
    texts = [f"example {i}" for i in range(6)]
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": texts, "n": list(range(6))}),
            "validation": datasets.Dataset.from_dict({"text": ["held out"], "n": [0]}),
        }
    )
    splits.save_to_disk(str(tmp_path / "hf"))
    name = register_hf_dataset_task(name="hf_disk_text", path_or_files=str(tmp_path / "hf"))
    examples = _read(name)
    assert [_text(ex["targets"]) for ex in examples] == texts
    assert all(ex["targets"][-1] == 1 for ex in examples)  # EOS
    assert [_text(ex["targets"]) for ex in _read(name, "validation")] == ["held out"]
    # Long texts are cut into target-length chunks, as with text files.
    chunks = _read(name, lengths={"targets": 4})
    assert max(len(ex["targets"]) for ex in chunks) == 4 and len(chunks) > len(texts)


def test_shuffle_is_a_seeded_permutation_and_shards_split_the_examples(tmp_path):
    texts = [f"row {i:02d}" for i in range(20)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
    name = register_hf_dataset_task(name="hf_disk_shuffle", path_or_files=str(tmp_path / "hf"))

    def order(seed, shard=None):
        return [_text(ex["targets"]) for ex in _read(name, shuffle=True, seed=seed, shard=shard)]

    first, again, other = order(0), order(0), order(1)
    assert first == again and first != other
    assert sorted(first) == texts and first != texts
    halves = [order(0, seqio.ShardInfo(index=i, num_shards=2)) for i in range(2)]
    assert sorted(halves[0] + halves[1]) == texts and not set(halves[0]) & set(halves[1])


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_local_files_give_a_pairs_task(tmp_path, kind):
    records = {"question": ["1+1=", "2+2="], "answer": ["2", "4"]}
    ds = datasets.Dataset.from_dict(records)
    path = str(tmp_path / f"train.{kind}")
    if kind == "jsonl":
        with open(path, "w") as f:
            for q, a in zip(records["question"], records["answer"]):
                f.write(json.dumps({"question": q, "answer": a}) + "\n")
    else:
        ds.to_parquet(path)
    name = register_hf_dataset_task(
        name=f"hf_files_{kind}",
        path_or_files={"train": path},
        input_key="question",
        target_key="answer",
    )
    examples = _read(name)
    assert [_text(ex["inputs"]) for ex in examples] == records["question"]
    assert [_text(ex["targets"]) for ex in examples] == records["answer"]
    assert examples[0]["inputs"][-1] != 1 and examples[0]["targets"][-1] == 1


def test_missing_or_non_string_column_names_the_columns(tmp_path):
    datasets.Dataset.from_dict({"body": ["a"], "n": [1]}).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="string column 'text'.*'body'"):
        register_hf_dataset_task(name="hf_bad_column", path_or_files=str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="string column 'n'"):
        register_hf_dataset_task(
            name="hf_bad_column", path_or_files=str(tmp_path / "hf"), text_key="n"
        )
    assert "hf_bad_column" not in seqio.TaskRegistry.names()


def test_missing_path_or_files_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory written by save_to_disk"):
        register_hf_dataset_task(name="hf_missing", path_or_files=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="'train'.*nope.json"):
        register_hf_dataset_task(
            name="hf_missing", path_or_files={"train": str(tmp_path / "nope.json")}
        )
    (tmp_path / "a.csv").write_text("text\nx\n")
    with pytest.raises(ValueError, match="file_format"):
        register_hf_dataset_task(name="hf_missing", path_or_files={"train": f"{tmp_path}/a.csv"})
