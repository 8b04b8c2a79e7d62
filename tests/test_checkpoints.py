"""Checkpoints restore onto other meshes and bring the data iterator back."""

import jax
import numpy as np
import seqio

import tasks  # noqa: F401
from flaxlm import checkpoints, data
from flaxlm.partitioning import Partitioner
from flaxlm.trainer import Setup
from tests.helpers import adamw, feature_lengths, tiny_gptj


def _setup(mesh_shape):
    return Setup(tiny_gptj(), Partitioner(mesh_shape=mesh_shape), adamw(), feature_lengths())


def test_restore_on_other_mesh_gives_same_params(tmp_path):
    saved = _setup((1, 8, 1))
    state = saved.init_state()
    ckpt = checkpoints.Checkpointer(str(tmp_path))
    ckpt.save(3, state, None, "config")
    ckpt.close()

    for mesh in [(2, 2, 2), (8, 1, 1)]:
        target = _setup(mesh)
        step, restored = checkpoints.Checkpointer(str(tmp_path)).restore_latest(
            target.abstract_state
        )
        assert step == 3
        for a, b, s in zip(
            jax.tree.leaves(state),
            jax.tree.leaves(restored),
            jax.tree.leaves(target.state_shardings),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert b.sharding.is_equivalent_to(s, b.ndim)


def test_data_iterator_position_is_restored(tmp_path):
    partitioner = Partitioner(mesh_shape=(8, 1, 1))
    cfg = data.DatasetConfig(
        mixture_or_task_name="stdlib_py", task_feature_lengths={"targets": 32}, batch_size=8
    )
    layout = partitioner.data_layout(8)

    def iterator():
        ds = data.get_dataset(cfg, layout, seqio.DecoderFeatureConverter)
        return data.DataIterator(ds, partitioner, layout)

    setup = _setup((8, 1, 1))
    state = setup.init_state()
    it = iterator()
    for _ in range(3):
        it.next_numpy()
    ckpt = checkpoints.Checkpointer(str(tmp_path))
    ckpt.save(3, state, it.tf_iterator, "config")
    ckpt.close()
    expected = [it.next_numpy()["decoder_target_tokens"] for _ in range(2)]

    resumed = iterator()
    checkpoints.Checkpointer(str(tmp_path)).restore_latest(
        setup.abstract_state, resumed.tf_iterator
    )
    got = [resumed.next_numpy()["decoder_target_tokens"] for _ in range(2)]
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(e, g)


def test_unreadable_latest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    setup = _setup((1, 8, 1))
    state = setup.init_state()
    ckpt = checkpoints.Checkpointer(str(tmp_path))
    ckpt.save(1, state, None, "config")
    ckpt.save(2, state, None, "config")
    ckpt.close()
    for f in (tmp_path / "checkpoints" / "2" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    step, restored = checkpoints.Checkpointer(str(tmp_path)).restore_latest(setup.abstract_state)
    assert step == 1 and restored is not None
    assert "checkpoints/2 could not be read" in capsys.readouterr().out
