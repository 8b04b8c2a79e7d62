"""Checkpoints restore onto other meshes and bring the data iterator back."""

import logging as std_logging
import os
import sys

import jax
import numpy as np
import pytest
import seqio

import tasks  # noqa: F401
from flaxlm.checkpoints import checkpointer, data_state
from flaxlm.data import pipeline
from flaxlm.data.config import DatasetConfig
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import steps as train_steps
from flaxlm.training.steps import Setup
from tests.helpers import adamw, feature_lengths, random_batch, tiny_gptj


def _setup(mesh_shape):
    return Setup(tiny_gptj(), Partitioner(mesh_shape=mesh_shape), adamw(), feature_lengths())


def _next_loss(setup, state):
    """The loss of one more train step (with dropout-free tiny GPT-J: a pure function)."""
    step = setup.partition_train_step(
        train_steps.make_train_step(setup.model, setup.partitioner, 1e-2, seed=0)
    )
    copy = jax.tree.map(lambda x: x.copy(), state)  # the step donates its input
    return float(step(copy, random_batch())[1]["loss"])


@pytest.mark.slow
def test_restore_on_other_mesh_gives_same_params_and_next_loss(tmp_path):
    saved = _setup((1, 8, 1))
    state = saved.init_state()
    saved_loss = _next_loss(saved, state)
    ckpt = checkpointer.Checkpointer(str(tmp_path))
    ckpt.save(3, state, None, "config")
    ckpt.close()
    host_state = jax.device_get(state)

    for mesh in [(2, 2, 2), (8, 1, 1)]:
        target = _setup(mesh)
        step, restored = checkpointer.Checkpointer(str(tmp_path)).restore_latest(
            target.abstract_state
        )
        assert step == 3
        for a, b, s in zip(
            jax.tree.leaves(host_state),
            jax.tree.leaves(restored),
            jax.tree.leaves(target.state_shardings),
            strict=True,
        ):
            np.testing.assert_array_equal(a, np.asarray(b))
            assert b.sharding.is_equivalent_to(s, b.ndim)
        # Bit-identical to the same step on this mesh from the never-saved state; another
        # mesh sums in another order, so against the saving mesh it is equal to float32.
        placed = jax.tree.unflatten(
            jax.tree.structure(restored),
            [
                jax.device_put(x, s)
                for x, s in zip(
                    jax.tree.leaves(host_state), jax.tree.leaves(target.state_shardings)
                )
            ],
        )
        assert _next_loss(target, restored) == _next_loss(target, placed)
        assert abs(_next_loss(target, restored) - saved_loss) < 1e-5


@pytest.mark.slow
def test_data_iterator_position_is_restored(tmp_path):
    partitioner = Partitioner(mesh_shape=(2, 1, 4))  # 2 logical input shards
    cfg = DatasetConfig(
        mixture_or_task_name="stdlib_py", task_feature_lengths={"targets": 32}, batch_size=8
    )
    layout = partitioner.data_layout(8)

    def iterator():
        ds = pipeline.host_input(cfg, layout, seqio.DecoderFeatureConverter)
        return pipeline.DataIterator(ds, partitioner, layout)

    setup = _setup((8, 1, 1))
    state = setup.init_state()
    it = iterator()
    for _ in range(3):
        it.next_numpy()
    ckpt = checkpointer.Checkpointer(str(tmp_path))
    ckpt.save(3, state, it, "config")
    ckpt.close()
    expected = [it.next_numpy()["decoder_target_tokens"] for _ in range(2)]

    resumed = iterator()
    checkpointer.Checkpointer(str(tmp_path)).restore_latest(setup.abstract_state, resumed)
    got = [resumed.next_numpy()["decoder_target_tokens"] for _ in range(2)]
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(e, g)
    files = sorted(os.listdir(tmp_path / "checkpoints" / "3" / "dataset"))
    assert {f.split(".")[0] for f in files if f.startswith("shard_")} == {
        "shard_0-of-2",
        "shard_1-of-2",
    }

    # Another number of logical shards (here the default for a data-parallel degree of 8)
    # cannot resume the data exactly: a clear error, not a fallback to older checkpoints.
    other = Partitioner(mesh_shape=(8, 1, 1))
    other_layout = other.data_layout(8)
    other_it = pipeline.DataIterator(
        pipeline.host_input(cfg, other_layout, seqio.DecoderFeatureConverter), other, other_layout
    )
    with pytest.raises(data_state.DataIteratorMismatchError, match="num_input_shards"):
        checkpointer.Checkpointer(str(tmp_path)).restore_latest(setup.abstract_state, other_it)


def _truncate_an_array_file(step_dir):
    """What a copy cut short leaves: the largest file of array data, 100 bytes long."""
    files = [f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    largest = max(files, key=lambda f: f.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:100])


def _delete_the_metadata(step_dir):
    (step_dir / "state" / "_METADATA").unlink()


@pytest.mark.parametrize("corrupt", [_truncate_an_array_file, _delete_the_metadata])
def test_unreadable_latest_checkpoint_is_set_aside_and_its_step_saved_again(
    tmp_path, capsys, monkeypatch, corrupt
):
    setup = _setup((1, 8, 1))
    state = setup.init_state()
    ckpt = checkpointer.Checkpointer(str(tmp_path))
    ckpt.save(1, state, None, "config")
    ckpt.save(2, state, None, "config")
    ckpt.close()
    root = tmp_path / "checkpoints"
    corrupt(root / "2")

    resumed = checkpointer.Checkpointer(str(tmp_path))
    # The failed restore's other reads print from TensorStore's threads (a closed event
    # loop; futures nobody retrieved) as soon as it fails, before restore_latest hears of it:
    # they are quiet from before the first read.
    restore, quiet_at_reads = resumed.restore, []

    def watched_restore(step, *args, **kwargs):
        quiet_at_reads.append(getattr(sys.unraisablehook, "flaxlm_quiet", False))
        return restore(step, *args, **kwargs)

    monkeypatch.setattr(resumed, "restore", watched_restore)
    step, restored = resumed.restore_latest(setup.abstract_state)
    assert step == 1 and all(quiet_at_reads)
    asyncio_log = std_logging.getLogger("asyncio")
    for where, dropped in [(root / "2", True), (tmp_path / "elsewhere", False)]:
        error = ValueError(
            f'OUT_OF_RANGE: Error reading "params.x/0" in OCDBT database at '
            f'local file "{where}/state/": Requested byte range [0, 9) is not valid'
        )
        record = asyncio_log.makeRecord(
            "asyncio",
            std_logging.ERROR,
            __file__,
            0,
            "Future exception was never retrieved",
            (),
            (ValueError, error, None),
        )
        assert asyncio_log.filter(record) is not dropped
    # One line naming the checkpoint, where it went and why (not TensorStore's spec).
    out = capsys.readouterr().out
    assert out.startswith(f"WARNING: checkpoint {root}/2 could not be read (")
    assert out.endswith(f"moved it to {root}/2.unreadable and fell back to step 1.\n")
    assert out.count("\n") == 1 and len(out) < 300 + 2 * len(str(root))
    assert (root / "2.unreadable" / "state").is_dir() and not (root / "2").exists()
    assert resumed.all_steps() == [1]

    # The resumed run saves step 2 again, and the next run resumes from that one.
    retrained = restored.replace(step=restored.step + 1)
    resumed.save(2, retrained, None, "config")
    resumed.close()
    step, again = checkpointer.Checkpointer(str(tmp_path)).restore_latest(setup.abstract_state)
    assert step == 2 and int(again.step) == int(retrained.step)
    assert capsys.readouterr().out == ""
    assert (root / "2.unreadable").is_dir()  # kept for inspection


def test_unreadable_checkpoints_only_is_an_error_not_a_fresh_start(tmp_path):
    setup = _setup((1, 8, 1))
    ckpt = checkpointer.Checkpointer(str(tmp_path))
    ckpt.save(1, setup.init_state(), None, "config")
    ckpt.close()
    for f in (tmp_path / "checkpoints" / "1" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(checkpointer.NoReadableCheckpointError, match="refusing to train"):
        checkpointer.Checkpointer(str(tmp_path)).restore_latest(setup.abstract_state)
    assert checkpointer.Checkpointer(str(tmp_path)).all_steps() == [1]  # nothing moved


def test_checkpoint_of_another_model_names_the_mismatched_params(tmp_path):
    ckpt = checkpointer.Checkpointer(str(tmp_path))
    ckpt.save(2, _setup((1, 8, 1)).init_state(), None, "config")
    ckpt.close()
    wider = Setup(tiny_gptj(hidden_size=64), Partitioner((1, 8, 1)), adamw(), feature_lengths())
    with pytest.raises(checkpointer.CheckpointMismatchError) as e:
        checkpointer.Checkpointer(str(tmp_path)).restore_latest(wider.abstract_state)
    assert "different model" in str(e.value)
    assert "h_0/fc_in/kernel: (32, 128) in the checkpoint, (64, 256) in this model" in str(e.value)
    assert "scan_layers" not in str(e.value)
    # The same model scanned: the hint names the setting (the params' names differ alike).
    scanned = Setup(tiny_gptj(scan_layers=True), Partitioner((1, 8, 1)), adamw(), feature_lengths())
    with pytest.raises(checkpointer.CheckpointMismatchError, match="set scan_layers=False"):
        checkpointer.Checkpointer(str(tmp_path)).restore_latest(scanned.abstract_state)


@pytest.mark.slow
def test_keep_the_newest_k_plus_every_mth_permanently(tmp_path):
    state = _setup((1, 8, 1)).init_state()
    ckpt = checkpointer.Checkpointer(str(tmp_path), keep=2, keep_period=4)
    for step in range(1, 11):
        ckpt.save(step, state, None, "config")
    ckpt.close()
    assert checkpointer.Checkpointer(str(tmp_path)).all_steps() == [4, 8, 9, 10]


def test_a_save_killed_before_its_commit_is_never_restored(tmp_path):
    setup = _setup((1, 8, 1))
    ckpt = checkpointer.Checkpointer(str(tmp_path))
    ckpt.save(1, setup.init_state(), None, "config")
    ckpt.close()
    # What a kill -9 mid-save leaves: step 2 in orbax's temporary directory, never renamed.
    partial = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1234"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "half_written").write_bytes(b"\0" * 10)
    reopened = checkpointer.Checkpointer(str(tmp_path))
    assert reopened.all_steps() == [1]
    step, state = reopened.restore_latest(setup.abstract_state)
    assert step == 1
    # The resumed run saves step 2 again; the leftover is cleaned up, not mistaken for it.
    reopened.save(2, state, None, "config")
    reopened.close()
    assert not partial.exists()
    assert checkpointer.Checkpointer(str(tmp_path)).all_steps() == [1, 2]


def test_one_process_saves_replicated_arrays_without_compiling(tmp_path):
    """Arrays replicated over 8 devices (data parallelism) saved by one process: orbax's
    replica-parallel save would cut each replica's slice on its device, a program compiled
    per shape and replica (8 here for each array), for bytes the same host writes anyway;
    off in one process (`checkpointer.REPLICA_PARALLEL_MIN_SLICE_BYTES`). They restore."""
    from jax import monitoring
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Partitioner(mesh_shape=(8, 1, 1)).mesh
    replicated = NamedSharding(mesh, P())
    state = {
        f"w{i}": jax.device_put(np.arange(8 * n, dtype=np.float32).reshape(8, n), replicated)
        for i, n in enumerate((3, 5, 7))
    }
    compiles = []

    def on_duration(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    monitoring.register_event_duration_secs_listener(on_duration)
    try:
        ckpt = checkpointer.Checkpointer(str(tmp_path))
        ckpt.save(1, state, None, "config")
        ckpt.wait()
    finally:
        monitoring.unregister_event_duration_listener(on_duration)
    assert compiles == []
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state
    )
    restored = ckpt.restore(1, abstract)
    ckpt.close()
    for name, value in state.items():
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(value))
