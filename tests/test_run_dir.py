"""The MODEL_DIR contract: the model record (and its old name), restores, HF directories."""

import json

import jax
import pytest

from flaxlm.checkpoints import checkpointer, hf, run_dir
from flaxlm.models.row_start import SEQIO_START
from flaxlm.parallel import pytrees
from flaxlm.parallel.partitioning import Partitioner
from tests.helpers import tiny_gptj


def test_model_record_round_trips_and_old_directories_still_load(tmp_path):
    model = tiny_gptj(scan_layers=True)
    run_dir.write_model_record(model, tmp_path, SEQIO_START)
    record = json.loads((tmp_path / run_dir.MODEL_RECORD).read_text())
    assert record["model_type"] == "gptj" and record["flaxlm_config"]["scan_layers"] is True
    assert run_dir.read_model(tmp_path).config == model.config

    # A directory written before the record was renamed keeps its `hf_config.json`.
    (tmp_path / run_dir.MODEL_RECORD).rename(tmp_path / run_dir.LEGACY_MODEL_RECORD)
    assert run_dir.model_record_file(tmp_path).name == run_dir.LEGACY_MODEL_RECORD
    assert run_dir.read_model(tmp_path).config == model.config
    run_dir.record_if_known(model, tmp_path, SEQIO_START)  # already recorded: nothing new written
    assert not (tmp_path / run_dir.MODEL_RECORD).exists()

    with pytest.raises(ValueError, match="bind the model"):
        run_dir.read_model(tmp_path / "elsewhere")


def test_load_model_and_params_reads_a_model_dir_and_an_hf_dir(tmp_path):
    partitioner = Partitioner(mesh_shape=(1, 2, 2), devices=jax.devices()[:4])
    model = tiny_gptj()
    params = model.init_params(jax.random.PRNGKey(1), model.example_batch_shapes())
    ckpt = checkpointer.Checkpointer(str(tmp_path / "run"))
    ckpt.save_params(7, params)
    ckpt.close()
    run_dir.write_model_record(model, tmp_path / "run", SEQIO_START)

    loaded = run_dir.load_model_and_params(tmp_path / "run", partitioner)
    assert loaded.step == 7 and run_dir.checkpoint_vocabulary(tmp_path / "run") is None
    abstract = pytrees.abstract_params(model, partitioner)
    for got, want, aval in zip(
        jax.tree.leaves(loaded.params), jax.tree.leaves(params), jax.tree.leaves(abstract)
    ):
        assert got.sharding == aval.sharding
        assert (pytrees.host_array(got) == pytrees.host_array(want)).all()

    hf.save_pretrained(model, params, tmp_path / "hf")
    assert run_dir.is_hf_dir(tmp_path / "hf") and not run_dir.is_hf_dir(tmp_path / "run")
    from_hf = run_dir.load_model_and_params(tmp_path / "hf", partitioner)
    assert from_hf.step == 0 and from_hf.model.config.real_vocab_size == 128

    with pytest.raises(ValueError, match="No checkpoint in"):
        run_dir.restore_params(tmp_path / "empty", abstract)
