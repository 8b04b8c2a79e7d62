"""SeqIO glue: tasks, this host's shard, and global batches on the mesh."""

import dataclasses
import itertools

import numpy as np
import pytest
import seqio

import tasks  # noqa: F401  (registers the default task)
from flaxlm.data import pipeline
from flaxlm.data.config import DatasetConfig
from flaxlm.parallel.partitioning import Partitioner
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
    return DatasetConfig(**base)


def test_stdlib_split_is_deterministic_and_disjoint():
    train, validation = stdlib.stdlib_files("train"), stdlib.stdlib_files("validation")
    assert len(train) > 100 and len(validation) > 5
    assert not set(train) & set(validation)
    assert list(train) == sorted(train)


def test_global_batch_is_sharded_over_the_batch_axes():
    partitioner = Partitioner(mesh_shape=(2, 2, 2))
    cfg = _cfg()
    layout = partitioner.data_layout(cfg.batch_size)
    it = pipeline.DataIterator(
        pipeline.host_input(cfg, layout, seqio.DecoderFeatureConverter), partitioner, layout
    )
    batch = next(it)
    tokens = batch["decoder_input_tokens"]
    assert tokens.shape == (8, 32)
    assert tokens.sharding.shard_shape(tokens.shape) == (2, 32)
    assert set(batch) >= {"decoder_segment_ids", "decoder_positions", "decoder_loss_weights"}


@pytest.mark.slow
def test_same_seed_gives_the_same_batches():
    partitioner = Partitioner(mesh_shape=(2, 1, 4))
    layout = partitioner.data_layout(8)

    def first_batches(seed):
        ds = pipeline.host_input(_cfg(seed=seed), layout, seqio.DecoderFeatureConverter)
        it = pipeline.DataIterator(ds, partitioner, layout)
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
        pipeline.host_batches(
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


def _tiny_lines_task(tmp_path, name, files=4, lines=6):
    for f in range(files):
        text = "".join(f"file {f} line {i}\n" for i in range(lines))
        (tmp_path / f"part{f}.txt").write_text(text)
    return register_text_files_task(name=name, split_files={"train": str(tmp_path / "part*.txt")})


def _batches(cfg, layout, n):
    batches = pipeline.host_batches(cfg, layout, seqio.DecoderFeatureConverter)
    return [b["decoder_target_tokens"] for b in itertools.islice(batches, n)]


@pytest.mark.parametrize(
    "mesh", [pytest.param((8, 1, 1), marks=pytest.mark.slow), (2, 1, 4), (1, 2, 4)]
)
def test_global_batches_do_not_depend_on_the_number_of_hosts(tmp_path, mesh):
    from tests.test_mesh_platforms import gpu_hosts

    name = _tiny_lines_task(tmp_path, f"test_hosts_{'_'.join(map(str, mesh))}")
    cfg = _cfg(mixture_or_task_name=name, task_feature_lengths={"targets": 16}, batch_size=8)
    reference = None
    # (8, 1, 1): every host count reads 8 logical shards, 24 pipelines for (1, 2, 4) hosts;
    # 1 and 4 make the point there. The other meshes' replicas span hosts at 2.
    for hosts in (1, 4) if mesh == (8, 1, 1) else (1, 2, 4):
        partitioner = Partitioner(mesh_shape=mesh, devices=gpu_hosts(hosts, 8 // hosts))
        layouts = [partitioner.data_layout(8, process_index=p) for p in range(hosts)]
        read = {}
        for layout in layouts:
            got = _batches(cfg, layout, 3)
            span = (layout.row_start, layout.row_stop)
            # Hosts holding the same rows (a replica spanning hosts) read the same examples.
            if span in read:
                assert all(np.array_equal(a, b) for a, b in zip(read[span], got))
            read[span] = got
        spans = sorted(read)
        assert spans[0][0] == 0 and spans[-1][1] == 8
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert all(stop - start < 8 for start, stop in spans) or hosts == 1 or mesh == (1, 2, 4)
        glued = [np.concatenate([read[s][i] for s in spans]) for i in range(3)]
        if reference is None:
            reference = glued
            assert all(x.shape == (8, 16) for x in reference)
        else:
            assert all(np.array_equal(a, b) for a, b in zip(reference, glued)), hosts


def test_fewer_input_shards_than_row_blocks_slices_this_hosts_rows(tmp_path):
    name = _tiny_lines_task(tmp_path, "test_one_input_shard")
    cfg = _cfg(
        mixture_or_task_name=name,
        task_feature_lengths={"targets": 16},
        batch_size=8,
        num_input_shards=1,
    )
    whole = _batches(cfg, Partitioner(mesh_shape=(8, 1, 1)).data_layout(8), 2)
    half = dataclasses.replace(
        Partitioner(mesh_shape=(8, 1, 1)).data_layout(8), per_host_batch_size=4, row_start=4
    )
    for w, h in zip(whole, _batches(cfg, half, 2)):
        np.testing.assert_array_equal(w[4:], h)
    with pytest.raises(ValueError, match="num_input_shards=3 must .* divide the batch size 8"):
        pipeline.host_batches(
            dataclasses.replace(cfg, num_input_shards=3), half, seqio.DecoderFeatureConverter
        )


def test_resume_across_an_epoch_boundary_continues_with_the_same_batches(tmp_path):
    import tensorflow as tf

    # 2 input shards of 12 lines each, 2 rows per shard per batch: an epoch is 6 batches.
    name = _tiny_lines_task(tmp_path, "test_resume_epochs", files=4, lines=6)
    cfg = _cfg(
        mixture_or_task_name=name,
        task_feature_lengths={"targets": 16},
        batch_size=4,
        pack=False,
        num_epochs=None,
    )
    partitioner = Partitioner(mesh_shape=(2, 1, 4))
    layout = partitioner.data_layout(4)

    def iterator():
        ds = pipeline.host_input(cfg, layout, seqio.DecoderFeatureConverter)
        return pipeline.DataIterator(ds, partitioner, layout)

    straight_it = iterator()
    straight = [straight_it.next_numpy()["decoder_target_tokens"] for _ in range(10)]
    # 40 rows from 24 lines: the last 5 batches hold second-epoch lines (seqio repeats, then
    # shuffles, so the epochs blend in the shuffle buffer), some of them already seen.
    rows = [bytes(r) for b in straight for r in b]
    assert len(set(rows)) <= 24 and set(rows[:20]) & set(rows[20:])

    stopped = iterator()
    head = [stopped.next_numpy()["decoder_target_tokens"] for _ in range(5)]
    assert sorted(stopped.shard_iterators) == [0, 1]  # one iterator per logical shard
    paths = {
        r: tf.train.Checkpoint(iterator=it).write(str(tmp_path / f"it{r}"))
        for r, it in stopped.shard_iterators.items()
    }
    resumed = iterator()
    for r, it in resumed.shard_iterators.items():
        tf.train.Checkpoint(iterator=it).read(paths[r]).assert_consumed()
    tail = [resumed.next_numpy()["decoder_target_tokens"] for _ in range(5)]
    for a, b in zip(straight, head + tail):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_functions_mapped_without_autograph_give_the_batches_autograph_gives(monkeypatch):
    """tf.data maps seqio's preprocessors, feature converters and vocabularies and the tasks'
    functions as written (`pipeline.NOT_AUTOGRAPHED`, ~1 s less a start): the default task
    packed for a decoder and the MLM task for an encoder-decoder give, to the token, the
    batches of the same pipelines with AutoGraph converting every function, as before."""
    from tensorflow.python.autograph.core import config as autograph_config

    partitioner = Partitioner(mesh_shape=(1, 2, 4))
    layout = partitioner.data_layout(4)
    cases = [
        ("stdlib_py", {"targets": 32}, seqio.DecoderFeatureConverter),
        ("stdlib_py_mlm", {"inputs": 32, "targets": 32}, seqio.EncDecFeatureConverter),
    ]

    def first_batches():
        out = []
        for name, lengths, converter in cases:
            cfg = _cfg(mixture_or_task_name=name, task_feature_lengths=lengths, batch_size=4)
            batches = pipeline.host_batches(cfg, layout, converter)
            out += [dict(b) for b in itertools.islice(batches, 2)]
        return out

    skipped = first_batches()
    assert any(str(r).endswith("seqio.preprocessors") for r in autograph_config.CONVERSION_RULES)
    monkeypatch.setattr(
        autograph_config,
        "CONVERSION_RULES",
        tuple(
            r
            for r in autograph_config.CONVERSION_RULES
            if str(r).rsplit(" ", 1)[-1] not in pipeline.NOT_AUTOGRAPHED
        ),
    )
    converted = first_batches()
    for a, b in zip(skipped, converted, strict=True):
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


def test_length_checks_decided_once_per_host_keep_seqios_outcomes(monkeypatch):
    """`length_checks.check_lengths` (what seqio's converters call in flaxlm's pipelines)
    checks a length the dataset's spec fixes when the pipeline is built, and the others per
    example with seqio's assertion; the batches are seqio's own checks' batches."""
    import tensorflow as tf

    from flaxlm.data import length_checks

    pipeline.configure_tensorflow()
    assert seqio.feature_converters._check_lengths is length_checks.check_lengths
    fixed = tf.data.Dataset.from_tensors({"a": tf.zeros([4], tf.int32)})
    axes = {"a": 0}
    assert length_checks.check_lengths(fixed, {"a": 4}, axes, True, "output") is fixed
    with pytest.raises(ValueError, match="'a' has length not equal to the expected length of 3"):
        length_checks.check_lengths(fixed, {"a": 3}, axes, True, "output")
    with pytest.raises(ValueError, match="not less than or equal to the expected length of 3"):
        length_checks.check_lengths(fixed, {"a": 3}, axes, False, "input")

    # Lengths that vary from example to example: asserted per example, through a converter.
    rows = [[3, 4, 5], [3, 4, 5, 6, 7, 8]]
    varying = tf.data.Dataset.from_generator(
        lambda: ({"targets": np.array(r, np.int32)} for r in rows),
        output_signature={"targets": tf.TensorSpec([None], tf.int32)},
    )
    converter = seqio.DecoderFeatureConverter(pack=False)
    out = converter(varying, {"targets": 4}).as_numpy_iterator()
    np.testing.assert_array_equal(next(out)["decoder_target_tokens"], [3, 4, 5, 0])
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match="length not less than or equal to the expected length of 4",
    ):
        next(out)

    def batches():
        cfg = _cfg(batch_size=2, num_input_shards=2, task_feature_lengths={"targets": 16})
        layout = Partitioner(mesh_shape=(2, 1, 4)).data_layout(2)
        return list(
            itertools.islice(pipeline.host_batches(cfg, layout, seqio.DecoderFeatureConverter), 2)
        )

    ours = batches()
    monkeypatch.setattr(
        seqio.feature_converters, "_check_lengths", length_checks._SEQIO_CHECK_LENGTHS
    )
    for a, b in zip(ours, batches(), strict=True):
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
