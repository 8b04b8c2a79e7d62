"""Optimizer schedules and masks; metric writers and the progress line."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from flaxlm.training import metrics, optimizers


def test_warmup_then_cosine_reaches_the_end_ratio():
    schedule = optimizers.create_schedule(
        peak_learning_rate=1.0, warmup_steps=10, total_steps=110, end_learning_rate_ratio=0.1
    )
    assert float(schedule(0)) == 0.0
    assert float(schedule(10)) == pytest.approx(1.0)
    assert float(schedule(110)) == pytest.approx(0.1, abs=1e-6)
    assert float(schedule(5)) == pytest.approx(0.5)


@pytest.mark.parametrize("decay", ["linear", "rsqrt", "constant"])
def test_other_schedules_start_at_peak_after_warmup(decay):
    schedule = optimizers.create_schedule(
        peak_learning_rate=2.0, warmup_steps=4, decay=decay, total_steps=20
    )
    assert float(schedule(4)) == pytest.approx(2.0)
    assert float(schedule(19)) <= 2.0


def test_unknown_schedule_and_optimizer_are_named():
    with pytest.raises(ValueError, match="decay='exp'"):
        optimizers.create_schedule(decay="exp", total_steps=10)
    with pytest.raises(ValueError, match="name='sgd'"):
        optimizers.create_optimizer(name="sgd", learning_rate=1.0)


def test_no_weight_decay_on_biases_and_norm_scales():
    params = {"dense": {"kernel": 1, "bias": 2}, "ln": {"scale": 3, "bias": 4}}
    mask = optimizers.decay_mask(params)
    assert mask == {"dense": {"kernel": True, "bias": False}, "ln": {"scale": False, "bias": False}}
    tx = optimizers.create_optimizer(learning_rate=0.0, weight_decay=0.5, clip_norm=None)
    tree = {"kernel": jnp.ones(3), "bias": jnp.ones(3)}
    # With zero learning rate nothing moves, but the decay term is masked per name.
    updates, _ = tx.update(jax_zeros(tree), tx.init(tree), tree)
    np.testing.assert_array_equal(updates["bias"], 0)


def jax_zeros(tree):
    return {k: jnp.zeros_like(v) for k, v in tree.items()}


def test_jsonl_writer_appends_one_object_per_step(tmp_path):
    writer = metrics.JsonlWriter(str(tmp_path))
    writer.write_scalars(1, {"loss": 2.0})
    writer.flush()
    writer.write_scalars(2, {"loss": 1.5, "eval/loss": 1.7})
    writer.flush()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5, "eval/loss": 1.7}]


def test_tensorboard_event_files_read_as_tensorflows_summaries(tmp_path):
    """Written without TensorFlow, read by it: the records `tf.summary.scalar` writes."""
    import tensorflow as tf

    first = metrics.TensorBoardWriter(str(tmp_path))
    first.write_scalars(3, {"loss": 2.5, "learning_rate": 1e-3})
    first.close()
    second = metrics.TensorBoardWriter(str(tmp_path))  # a resumed run: a file of its own
    second.write_scalars(4, {"loss": 2.25})
    second.close()
    files = sorted((tmp_path / "tensorboard").iterdir())
    assert len(files) == 2 and all(f.name.startswith("events.out.tfevents.") for f in files)
    seen = []
    for f in files:
        for event in tf.compat.v1.train.summary_iterator(str(f)):
            for value in event.summary.value:
                assert value.metadata.plugin_data.plugin_name == "scalars"
                seen.append((event.step, value.tag, float(tf.make_ndarray(value.tensor))))
    assert sorted(seen) == [
        (3, "learning_rate", pytest.approx(1e-3)),
        (3, "loss", 2.5),
        (4, "loss", 2.25),
    ]


def test_progress_line_shows_step_loss_rate_throughput_and_eta():
    progress = metrics.Progress(total_steps=100, start_step=0, flops_per_token=1e6)
    scalars = {"loss": 2.5, "learning_rate": 1e-3, **progress.rates(1000, 0.5)}
    line = progress.line(10, scalars)
    for part in ("step 10/100", "loss 2.5000", "lr 1.00e-03", "2,000 tok/s", "TFLOP/s", "ETA"):
        assert part in line


def test_wandb_writer_in_offline_mode(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = metrics.WandbWriter(str(tmp_path), mode="offline", project="flaxlm-test")
    writer.write_scalars(1, {"loss": 1.0})
    writer.close()
    assert list(tmp_path.glob("wandb/offline-run-*"))


@pytest.mark.parametrize("family", ["llama", "qwen", "gemma"])
def test_flops_per_token_is_three_forwards_as_xla_counts_them_tied_head_included(family):
    """MFU's numerator: 6N + attention is three times the forward's FLOPs (backward twice
    the forward); the LM head is a matmul whether or not it reuses the embedding."""
    import jax

    from flaxlm.models import base, gemma, llama, qwen

    config_class = {
        "llama": llama.LlamaConfig,
        "qwen": qwen.QwenConfig,
        "gemma": gemma.GemmaConfig,
    }[family]
    length = 128
    shapes = {"decoder_input_tokens": (2, length)}
    for tie in (True, False):
        config = config_class(
            vocab_size=4096,
            hidden_size=256,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=704,
            tie_word_embeddings=tie,
        )
        model = base.DecoderOnlyModel(config)
        params = jax.eval_shape(lambda m=model: m.init_params(jax.random.PRNGKey(0), shapes))
        forward = jax.jit(
            lambda p, t, m=model: m.module.apply({"params": p}, t, None, None, deterministic=True)
        )
        tokens = jax.ShapeDtypeStruct((2, length), jnp.int32)
        cost = forward.lower(params, tokens).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        per_token = 3 * cost["flops"] / (2 * length)
        assert per_token == pytest.approx(config.flops_per_token(length), rel=0.02), tie


def test_write_jsonl_replaces_an_earlier_runs_file(tmp_path):
    """infer/score into an OUTPUT_DIR that already holds `<name>.jsonl` (a rerun) replaced it;
    it was a FileExistsError after all the generation work."""
    from etils import epath

    path = epath.Path(tmp_path) / "out.jsonl"
    metrics.write_jsonl(path, [{"a": 1}])
    metrics.write_jsonl(path, [{"b": 2}])
    assert path.read_text() == '{"b": 2}\n'
    assert not (epath.Path(tmp_path) / "out.jsonl.tmp").exists()
