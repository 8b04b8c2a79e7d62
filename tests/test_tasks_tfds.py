"""TFDS tasks by name, read through `tfds.testing.mock_data` (no download)."""

import os

import pytest
import seqio
import tensorflow_datasets as tfds

import tasks  # noqa: F401  (registers c4_en, lm1b, wiki40b_en)
from tasks.tfds_tasks import DEFAULT_TASKS, register_tfds_task
from tests import zygote

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _targets(name, split, n=5, lengths=None):
    # try_in_mem_cache=False: mocked datasets have no split sizes for seqio to look up.
    ds = seqio.get_mixture_or_task(name).get_dataset(
        lengths, split=split, shuffle=False, try_in_mem_cache=False
    )
    return [ex["targets"] for ex in ds.take(n).as_numpy_iterator()]


def test_default_tfds_tasks_read_mocked_text():
    with tfds.testing.mock_data(num_examples=4):
        for name in DEFAULT_TASKS:
            for split in ("train", "validation"):
                rows = _targets(name, split)
                assert len(rows) == 4, (name, split)
                assert all(r[-1] == 1 and len(r) > 1 for r in rows)  # bytes then EOS


def test_registered_tfds_task_cuts_text_into_chunks_and_maps_splits():
    name = register_tfds_task(
        name="test_lm1b_chunks", tfds_name="lm1b:1.1.0", splits={"validation": "test[:2]"}
    )
    with tfds.testing.mock_data(num_examples=3):
        rows = _targets(name, "validation", n=50, lengths={"targets": 4})
    assert max(len(r) for r in rows) == 4 and len(rows) > 3
    assert list(seqio.get_mixture_or_task(name).splits) == ["validation"]


@pytest.mark.slow
def test_importing_the_tasks_touches_no_network_or_tfds_builder():
    # (forked from the tests' zygote, which has imported TensorFlow and seqio: what is checked
    # is what importing the tasks does)
    result = zygote.run([], REPO, dict(os.environ), module="tests.offline_tasks_import")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "['c4_en', 'lm1b', 'wiki40b_en']" in result.stdout
