"""SeqIO glue: tasks, this host's shard, and global batches on the mesh."""

import numpy as np
import pytest
import seqio

import tasks  # noqa: F401  (registers the default task)
from flaxlm import data
from flaxlm.partitioning import Partitioner
from tasks import stdlib
from tasks.text_files import register_text_files_task


def _cfg(**kw):
    base = dict(
        mixture_or_task_name="stdlib_py",
        task_feature_lengths={"targets": 32},
        batch_size=8,
        seed=0,
    )
    base.update(kw)
    return data.DatasetConfig(**base)


def test_stdlib_split_is_deterministic_and_disjoint():
    train, validation = stdlib.stdlib_files("train"), stdlib.stdlib_files("validation")
    assert len(train) > 100 and len(validation) > 5
    assert not set(train) & set(validation)
    assert list(train) == sorted(train)


def test_global_batch_is_sharded_over_the_batch_axes():
    partitioner = Partitioner(mesh_shape=(2, 2, 2))
    cfg = _cfg()
    layout = partitioner.data_layout(cfg.batch_size)
    it = data.DataIterator(
        data.get_dataset(cfg, layout, seqio.DecoderFeatureConverter), partitioner, layout
    )
    batch = next(it)
    tokens = batch["decoder_input_tokens"]
    assert tokens.shape == (8, 32)
    assert tokens.sharding.shard_shape(tokens.shape) == (2, 32)
    assert set(batch) >= {"decoder_segment_ids", "decoder_positions", "decoder_loss_weights"}


def test_same_seed_gives_the_same_batches():
    partitioner = Partitioner(mesh_shape=(8, 1, 1))
    layout = partitioner.data_layout(8)

    def first_batches(seed):
        ds = data.get_dataset(_cfg(seed=seed), layout, seqio.DecoderFeatureConverter)
        it = data.DataIterator(ds, partitioner, layout)
        return [it.next_numpy()["decoder_target_tokens"] for _ in range(3)]

    a, b, c = first_batches(0), first_batches(0), first_batches(1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_long_documents_are_cut_into_target_length_chunks():
    ds = seqio.get_mixture_or_task("stdlib_py").get_dataset(
        {"targets": 64}, split="validation", shuffle=False
    )
    lengths = [len(ex["targets"]) for ex in ds.take(50).as_numpy_iterator()]
    assert max(lengths) == 64 and len(lengths) == 50


def test_unregistered_task_is_named_with_suggestions():
    with pytest.raises(ValueError, match="stdlib_pyy.*Did you mean.*stdlib_py"):
        data.get_dataset(
            _cfg(mixture_or_task_name="stdlib_pyy"),
            Partitioner(mesh_shape=(8, 1, 1)).data_layout(8),
            seqio.DecoderFeatureConverter,
        )


def test_text_files_task_reads_local_lines(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"line number {i}\n" for i in range(40)))
    name = register_text_files_task(name="test_local_lines", split_files={"train": str(path)})
    ds = seqio.get_mixture_or_task(name).get_dataset({"targets": 32}, split="train", shuffle=False)
    first = next(ds.as_numpy_iterator())["targets"]
    assert bytes(int(t) - 3 for t in first[:-1]) == b"line number 0"
    assert first[-1] == 1  # EOS


def test_text_files_task_with_no_matching_files_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no files match"):
        register_text_files_task(
            name="test_missing_files", split_files={"train": str(tmp_path / "nope*.txt")}
        )
