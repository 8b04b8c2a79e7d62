"""data/input_process.py: the input pipeline in a process of its own reads the rows an
in-process iterator reads, saves and restores their position as it does, and reports a bad
configuration as the run would; what the run knows without it (`batch_shapes`) agrees with
the converters."""

import numpy as np
import pytest
import seqio

import tasks  # noqa: F401  (registers the default task)
from flaxlm.data import input_process, pipeline
from flaxlm.data.config import DatasetConfig
from flaxlm.models import batch_shapes
from flaxlm.models.base import EncoderDecoderModel
from flaxlm.models.row_start import HF_START, SEQIO_START
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs import train_data
from flaxlm.training import objective as objective_lib
from tests.helpers import tiny_gptj

CONVERTER = "flaxlm.models.features:LMFeatureConverter"


@pytest.mark.parametrize("pack", [True, False])
def test_lm_feature_lengths_known_by_name_are_what_the_decoder_converter_gives(pack):
    model = tiny_gptj()
    cfg = DatasetConfig(
        mixture_or_task_name="stdlib_py",
        task_feature_lengths={"targets": 24},
        batch_size=8,
        pack=pack,
    )
    assert batch_shapes.converter_reference(model) == CONVERTER
    converter = model.FEATURE_CONVERTER_CLS
    predicted = batch_shapes.model_feature_lengths(CONVERTER, cfg.task_feature_lengths, pack)
    assert predicted == converter(pack=pack).get_model_feature_lengths({"targets": 24})
    assert predicted == batch_shapes.model_feature_lengths(converter, {"targets": 24}, pack)
    assert pipeline.batch_dtypes(cfg, converter) == dict.fromkeys(predicted, "int32")
    # A prefix-LM task (its inputs join the row) or another converter: the converter says.
    prefix_lm = {"inputs": 8, "targets": 16}
    assert batch_shapes.model_feature_lengths(CONVERTER, prefix_lm, pack) is None
    t5 = object.__new__(EncoderDecoderModel)  # (only its class is read)
    assert batch_shapes.converter_reference(t5) == "seqio:EncDecFeatureConverter"
    assert (
        batch_shapes.model_feature_lengths("seqio:EncDecFeatureConverter", {"targets": 24}, pack)
        is None
    )


def test_a_run_that_must_read_in_its_own_process_says_why_it_cannot():
    model = tiny_gptj()
    cfg = DatasetConfig(
        mixture_or_task_name="stdlib_py",
        task_feature_lengths={"targets": 24},
        batch_size=8,
        feature_converter=seqio.DecoderFeatureConverter,
    )
    with pytest.raises(ValueError, match="train.input_process=True, but a DatasetConfig"):
        train_data.reads_in_own_process(
            True, model, (cfg,), objective_lib.NEXT_TOKEN_PREDICTION, SEQIO_START
        )
    with pytest.raises(ValueError, match="train.input_process=True, but the rows start as"):
        train_data.reads_in_own_process(
            True, model, (None,), objective_lib.NEXT_TOKEN_PREDICTION, HF_START
        )
    plain = DatasetConfig(
        mixture_or_task_name="stdlib_py", task_feature_lengths={"targets": 24}, batch_size=8
    )
    # Left to itself: not where this process has loaded TensorFlow (as the tests have).
    assert not train_data.reads_in_own_process(
        None, model, (plain,), objective_lib.NEXT_TOKEN_PREDICTION, SEQIO_START
    )


@pytest.mark.slow
def test_the_input_process_reads_and_checkpoints_what_this_process_would(tmp_path):
    partitioner = Partitioner(mesh_shape=(2, 2, 2))
    cfg = DatasetConfig(
        mixture_or_task_name="stdlib_py",
        task_feature_lengths={"targets": 32},
        batch_size=8,
        num_input_shards=2,
    )
    converter = batch_shapes.converter_reference(tiny_gptj())
    local = pipeline.DataIterator.create(cfg, partitioner, tiny_gptj().FEATURE_CONVERTER_CLS)
    process = input_process.InputProcess()
    try:
        known = batch_shapes.model_feature_lengths(converter, cfg.task_feature_lengths, True)
        remote = input_process.RemoteDataIterator(
            process, cfg, partitioner, converter, feature_lengths=known
        )
        missing = input_process.RemoteDataIterator(
            process,
            DatasetConfig(
                mixture_or_task_name="no_such_task", task_feature_lengths={}, batch_size=8
            ),
            partitioner,
            converter,
            lazy=True,
        )
        with pytest.raises(ValueError, match="No seqio task or mixture named 'no_such_task'"):
            missing.check()  # the look-up answers at once; the iterator is never built
        assert remote.input_shards == local.input_shards == [0, 1]
        assert remote.saved_shards == local.saved_shards and remote.num_shards == 2
        assert remote.description()["task_metrics"] is False
        # What the run knew without seqio is what the child's converter says.
        assert remote.description()["feature_lengths"] == known
        assert remote.description()["dtypes"] == remote.feature_shapes()[1]

        def same(a, b):
            assert a.keys() == b.keys()
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])

        for _ in range(2):
            same(remote.next_numpy(), local.next_numpy())
        remote.write_state(str(tmp_path / "remote"))
        local.write_state(str(tmp_path / "local"))
        assert sorted(p.name for p in (tmp_path / "remote").iterdir()) == sorted(
            p.name for p in (tmp_path / "local").iterdir()
        )
        after = [local.next_numpy() for _ in range(2)]
        remote.read_state(str(tmp_path / "local"))  # an in-process run's files, read there
        for batch in after:
            same(remote.next_numpy(), batch)
        local.read_state(str(tmp_path / "remote"))  # and the other way round
        same(local.next_numpy(), after[0])
        # On the mesh as an in-process iterator puts them.
        remote.reset()
        local.reset()
        got, want = next(remote), next(local)
        assert got["decoder_target_tokens"].sharding == want["decoder_target_tokens"].sharding
        same(
            {k: np.asarray(v) for k, v in got.items()}, {k: np.asarray(v) for k, v in want.items()}
        )
        assert remote.wait_seconds > 0
    finally:
        process.close()
    assert process._proc.returncode == 0
