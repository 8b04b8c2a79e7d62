"""BERT-style masking, the masked-LM task and feature converter, and the RoBERTa gin files."""

import os

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf

from flaxlm.data import pipeline
from flaxlm.data.config import DatasetConfig
from flaxlm.models.base import EncoderOnlyModel
from flaxlm.models.features import MaskedLMFeatureConverter
from flaxlm.models.roberta import RobertaConfig
from flaxlm.parallel.partitioning import DataLayout
from tasks.mlm import MASK_ID
from tasks.preprocessors import mask_tokens


def masked(tokens, seed):
    ds = tf.data.Dataset.from_tensors({"targets": tf.constant(tokens, tf.int32)})
    with seqio.utils.map_seed_manager(seed):
        out = mask_tokens(ds, mask_id=MASK_ID, random_ids=(3, 259))
    return next(out.as_numpy_iterator())


def test_masking_statistics_and_determinism():
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 259, 20000).astype(np.int32)
    tokens[::50] = 1  # EOS is never chosen
    ex = masked(tokens, seed=7)
    chosen = ex["targets"] < 0
    assert abs(chosen.mean() - 0.15) < 0.01
    assert not chosen[::50].any()
    np.testing.assert_array_equal(np.abs(ex["targets"]), tokens)
    np.testing.assert_array_equal(ex["inputs"][~chosen], tokens[~chosen])
    to_mask = ex["inputs"][chosen] == MASK_ID
    unchanged = ex["inputs"][chosen] == tokens[chosen]
    assert abs(to_mask.mean() - 0.8) < 0.03
    # 10% random (some of which happen to equal the original) + 10% unchanged.
    assert abs(unchanged.mean() - 0.1) < 0.03
    again = masked(tokens, seed=7)
    np.testing.assert_array_equal(ex["inputs"], again["inputs"])
    assert (masked(tokens, seed=8)["inputs"] != ex["inputs"]).any()


def test_bad_masking_arguments_are_named():
    ds = tf.data.Dataset.from_tensors({"targets": tf.constant([5, 6], tf.int32)})
    with pytest.raises(ValueError, match="mask_rate"):
        mask_tokens(ds, mask_id=MASK_ID, random_ids=(3, 259), mask_rate=1.5)


def test_stdlib_mlm_task_through_the_converter():
    cfg = DatasetConfig(
        mixture_or_task_name="stdlib_py_mlm",
        task_feature_lengths={"inputs": 64, "targets": 64},
        split="validation",
        batch_size=4,
        shuffle=False,
        pack=True,
    )
    layout = DataLayout(global_batch_size=4, per_host_batch_size=4, shard_index=0, num_shards=1)
    batch = next(pipeline.host_batches(cfg, layout, MaskedLMFeatureConverter))
    assert set(batch) == set(
        MaskedLMFeatureConverter(pack=True).get_model_feature_lengths({"inputs": 64})
    )
    weights = batch["encoder_loss_weights"]
    real = batch["encoder_segment_ids"] > 0
    # Targets are the original ids: where not masked, the inputs show them as they are.
    unmasked = real & (weights == 0)
    np.testing.assert_array_equal(
        batch["encoder_input_tokens"][unmasked], batch["encoder_target_tokens"][unmasked]
    )
    assert (batch["encoder_target_tokens"] >= 0).all() and not weights[~real].any()
    assert 0.08 < weights[real].mean() < 0.25
    assert (batch["encoder_input_tokens"] == MASK_ID).sum() > 0


@pytest.mark.parametrize("name", ["roberta_tiny", "roberta_base", "roberta_large"])
def test_roberta_gin_files_build(repo_dir, name):
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(
            [os.path.join(repo_dir, "gin", "models", f"{name}.gin")], [], finalize_config=False
        )
        model = EncoderOnlyModel()
    finally:
        gin.clear_config()
    assert isinstance(model.config, RobertaConfig)
    if name != "roberta_tiny":
        assert model.config.real_vocab_size == 50265 and model.config.max_length == 512
        assert model.config.vocab_size % 128 == 0
        assert (
            abs(
                model.config.num_params() / {"roberta_base": 125e6, "roberta_large": 355e6}[name]
                - 1
            )
            < 0.05
        )


@pytest.mark.slow
def test_masked_lm_pretraining_run(tmp_path, repo_dir):
    from tests.test_main import read_metrics, run_main

    model_dir = str(tmp_path / "run")
    result = run_main(
        [
            "--gin_file=models/roberta_tiny.gin",
            "--gin_file=partitioning/fsdp.gin",
            "--gin_file=runs/pretrain.gin",
            f"--gin.MODEL_DIR='{model_dir}'",
            "--gin.MIXTURE_OR_TASK_NAME='stdlib_py_mlm'",
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 64}",
            "--gin.BATCH_SIZE=8",
            "--gin.TRAIN_STEPS=4",
            "--gin.LOG_PERIOD=2",
            "--gin.EVAL_PERIOD=4",
            "--gin.EVAL_STEPS=1",
        ],
        cwd=repo_dir,
        devices=2,  # (each device of the fsdp axis is an input pipeline to build, twice)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(model_dir)
    assert [r["step"] for r in rows if "loss" in r] == [2, 4]
    assert any("eval/loss" in r for r in rows)
