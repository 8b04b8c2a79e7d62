"""T5 from and to HuggingFace: logits against transformers' PyTorch model, v1.0 and v1.1."""

import glob
import json
import os

import gin
import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from flaxlm.checkpoints import hf
from flaxlm.models import base, t5
from flaxlm.parallel.partitioning import Partitioner
from tests.helpers import float32_atol
from tests.hf_helpers import (
    max_abs_diff,
    padded_batch,
    save_torch_model,
    torch_logits,
    train_on_batch,
)

VOCAB = 250
VERSIONS = {
    # T5 v1.0: ReLU MLP, head tied to `shared`, decoder output scaled by d_model**-0.5.
    "v1_0": dict(feed_forward_proj="relu"),
    # T5 v1.1 / FLAN-T5: gated-GELU MLP, own head, no scaling; a deeper decoder.
    "v1_1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, num_decoder_layers=3),
}


def tiny_hf_t5(tmp_path, version):
    kwargs = dict(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        # Few buckets, so that 12-token rows reach the logarithmic ones.
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        **VERSIONS[version],
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**kwargs)).eval()
    if version == "v1_1":
        # transformers 5 ties the head even for v1.1 configs; published v1.1 checkpoints
        # (and FLAN-T5) have their own `lm_head.weight`.
        model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32))
    return model, save_torch_model(model, tmp_path / "hf")


def our_logits(model, params, batch):
    """`model.compute_logits`, jitted (one compile beats many eager op dispatches)."""
    return np.asarray(jax.jit(model.compute_logits)(params, batch))


def seq2seq_batch(input_lengths=(10, 4, 12, 2), target_lengths=(6, 9, 3, 9), seed=0):
    """Our seqio features and HF's inputs for the same padded examples."""
    inputs, input_mask = padded_batch(VOCAB, input_lengths, seed)
    targets, target_mask = padded_batch(VOCAB, target_lengths, seed + 1)
    decoder_inputs = np.zeros_like(targets)  # targets shifted right, starting with 0
    decoder_inputs[:, 1:] = targets[:, :-1]
    decoder_inputs *= target_mask

    def positions(ids):
        return np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()

    ours = {
        "encoder_input_tokens": inputs.astype(np.int32),
        "encoder_segment_ids": input_mask.astype(np.int32),
        "encoder_positions": positions(inputs),
        "decoder_input_tokens": decoder_inputs.astype(np.int32),
        "decoder_target_tokens": targets.astype(np.int32),
        "decoder_segment_ids": target_mask.astype(np.int32),
        "decoder_positions": positions(targets),
        "decoder_loss_weights": target_mask.astype(np.int32),
    }
    theirs = dict(
        input_ids=inputs,
        attention_mask=input_mask,
        decoder_input_ids=decoder_inputs,
        decoder_attention_mask=target_mask,
    )
    return ours, theirs, target_mask


@pytest.mark.parametrize("mesh_shape", [None, (1, 4, 2)])
@pytest.mark.parametrize("version", ["v1_0", "v1_1"])
def test_import_matches_transformers(tmp_path, version, mesh_shape):
    torch_model, path = tiny_hf_t5(tmp_path, version)
    partitioner = Partitioner(mesh_shape=mesh_shape) if mesh_shape else None
    # Each version runs once scanned and once unrolled.
    scan_layers = (version == "v1_0") == (mesh_shape is not None)
    model, params = hf.from_pretrained(path, partitioner, scan_layers=scan_layers)
    assert isinstance(model, base.EncoderDecoderModel)
    assert model.config.vocab_size == 256 and model.config.real_vocab_size == VOCAB
    assert model.config.tie_word_embeddings == (version == "v1_0")
    ours_batch, theirs_batch, mask = seq2seq_batch()
    if mesh_shape:  # positions are optional: 0..length-1 by default
        ours_batch.pop("encoder_positions"), ours_batch.pop("decoder_positions")
    ours = our_logits(model, params, ours_batch)
    theirs = torch_logits(torch_model, **theirs_batch)
    assert max_abs_diff(ours, theirs, mask) < 1e-4
    assert int(ours.argmax(-1).max()) < VOCAB  # padded vocabulary rows never win
    if mesh_shape:
        wo = params["decoder"]["block"]["block"] if scan_layers else params["decoder"]["block_0"]
        assert "tensor" in wo["DenseReluDense"]["wo"]["kernel"].sharding.spec


def test_packed_examples_match_separate_ones(tmp_path):
    _, path = tiny_hf_t5(tmp_path, "v1_1")
    model, params = hf.from_pretrained(path)
    ours, _, _ = seq2seq_batch(input_lengths=(5, 7), target_lengths=(4, 6))

    def pack(name, lengths):
        parts = [ours[name][row, :n] for row, n in enumerate(lengths)]
        return np.concatenate(parts)[None]

    n_in, n_out = (5, 7), (4, 6)
    packed = {
        "encoder_input_tokens": pack("encoder_input_tokens", n_in),
        "encoder_segment_ids": np.repeat([1, 2], n_in)[None],
        "encoder_positions": np.concatenate([np.arange(n) for n in n_in])[None],
        "decoder_input_tokens": pack("decoder_input_tokens", n_out),
        "decoder_segment_ids": np.repeat([1, 2], n_out)[None],
        "decoder_positions": np.concatenate([np.arange(n) for n in n_out])[None],
    }
    packed_logits = our_logits(model, params, packed)[0, :, :VOCAB]  # (padded rows: -max)
    separate = our_logits(model, params, ours)[:, :, :VOCAB]
    # Logits of magnitude ~6 through 2 encoder layers (~10 rounding stages each: norm, q/k/v,
    # scores, softmax, sum, out, norm, gated MLP), 3 decoder layers (~16: cross-attention
    # too) and the head: a packed and a separate batch sum in other orders, and 1e-5 missed
    # by 1.3e-5 on an Intel Xeon.
    atol = float32_atol(separate, depth=2 * 10 + 3 * 16 + 2)
    np.testing.assert_allclose(packed_logits[:4], separate[0, :4], atol=atol)
    np.testing.assert_allclose(packed_logits[4:10], separate[1, :6], atol=atol)


@pytest.mark.parametrize("version", ["v1_0", "v1_1"])
def test_export_reloads_in_transformers(tmp_path, version):
    torch_model, path = tiny_hf_t5(tmp_path, version)
    model, params = hf.from_pretrained(path, Partitioner(mesh_shape=(2, 2, 2)))
    out = tmp_path / "out"
    hf.save_pretrained(model, params, out)
    reloaded, info = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert t5.HF_SPEC.auto_class == "AutoModelForSeq2SeqLM"
    _, theirs_batch, mask = seq2seq_batch()
    a = torch_logits(torch_model, **theirs_batch)
    b = torch_logits(reloaded.eval(), **theirs_batch)
    assert max_abs_diff(b, a, mask) < 1e-5
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == VOCAB
    with safe_open(str(out / "model.safetensors"), "np") as f:
        assert ("lm_head.weight" in f.keys()) == (version == "v1_1")


@pytest.mark.slow
def test_fsdp_training_lowers_loss_then_reloads_in_transformers(tmp_path):
    _, path = tiny_hf_t5(tmp_path, "v1_1")
    partitioner = Partitioner(mesh_shape=(1, 8, 1))
    model, params = hf.from_pretrained(path, partitioner, scan_layers=True, remat_policy="minimal")
    batch, _, _ = seq2seq_batch(input_lengths=(10, 4, 12, 2) * 2, target_lengths=(6, 9, 3, 9) * 2)
    state, history = train_on_batch(model, params, partitioner, batch, 5, learning_rate=1e-2)
    assert state.params["shared"]["embedding"].sharding.spec[1] == "fsdp"
    losses = [m["loss"] for m in history]
    assert losses[-1] < losses[0] - 0.5, losses

    out = tmp_path / "trained"
    hf.save_pretrained(model, state.params, out)
    reloaded, info = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ours_batch, theirs_batch, mask = seq2seq_batch()
    ours = our_logits(model, state.params, ours_batch)
    assert max_abs_diff(ours, torch_logits(reloaded.eval(), **theirs_batch), mask) < 1e-4


def test_relative_position_buckets_match_transformers():
    relative = torch.arange(-300, 301)[None, :]
    for bidirectional in (True, False):
        theirs = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
            relative, bidirectional=bidirectional, num_buckets=32, max_distance=128
        )
        ours = t5.relative_position_buckets(
            np.zeros((1, 1), np.int32),
            relative.numpy().astype(np.int32),
            bidirectional=bidirectional,
            num_buckets=32,
            max_distance=128,
        )
        np.testing.assert_array_equal(np.asarray(ours)[0], theirs.numpy())


# Published parameter counts (HF's count: a tied head once).
GIN_MODELS = {
    "t5_small": 60_506_624,
    "t5_base": 222_903_552,
    "t5_large": 737_668_096,
    "t5_3b": 2_851_598_336,
    "t5_11b": 11_307_321_344,
    "t5_1_1_small": 76_961_152,
    "t5_1_1_base": 247_577_856,
    "t5_1_1_large": 783_150_080,
    "t5_1_1_xl": 2_849_757_184,
    "t5_1_1_xxl": 11_135_332_352,
    "t5_tiny": None,
}


def test_gin_model_files_build_their_configs(repo_dir):
    files = sorted(os.path.basename(f)[:-4] for f in glob.glob(f"{repo_dir}/gin/models/t5*.gin"))
    assert files == sorted(GIN_MODELS)
    for name, num_params in GIN_MODELS.items():
        gin.clear_config()
        try:
            gin.parse_config_files_and_bindings(
                [os.path.join(repo_dir, "gin", "models", f"{name}.gin")], [], finalize_config=False
            )
            model = base.EncoderDecoderModel()
        finally:
            gin.clear_config()
        assert isinstance(model, base.EncoderDecoderModel), name
        if num_params is not None:
            assert model.config.num_params() == num_params, name
        else:
            assert model.config.vocab_size >= 259 and model.config.vocab_size % 128 == 0


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(feed_forward_proj="gated-swish"), "feed_forward_proj"),
        (dict(feed_forward_proj="fancy-gelu"), "feed_forward_proj"),
        (dict(relative_attention_num_buckets=7), "relative_attention_num_buckets"),
        (dict(relative_attention_max_distance=8), "relative_attention_max_distance"),
        (dict(num_decoder_layers=0), "num_decoder_layers"),
        (dict(remat_policy="most"), "remat_policy"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        t5.T5Config(**overrides)


def test_continuation_task_pairs_consecutive_chunks():
    import tensorflow as tf

    from tasks import seq2seq

    doc = tf.data.Dataset.from_tensors({"targets": tf.range(3, 22, dtype=tf.int32)})
    pairs = list(seq2seq.continuation_pairs(doc, {"inputs": 5, "targets": 5}).as_numpy_iterator())
    # Chunks of 4 + 4 tokens (one place each for EOS); the last 3 tokens are cut 1 + 2.
    assert [(p["inputs"].tolist(), p["targets"].tolist()) for p in pairs] == [
        ([3, 4, 5, 6], [7, 8, 9, 10]),
        ([11, 12, 13, 14], [15, 16, 17, 18]),
        ([19], [20, 21]),
    ]


@pytest.mark.slow
def test_t5_finetune_gin_trains_from_hf_then_exports(tmp_path, repo_dir):
    from tests.test_main import read_metrics, run_main

    # A HuggingFace T5 of gin/models/t5_tiny.gin's shape, with its own head (v1.1).
    config = transformers.T5Config(
        vocab_size=384,
        d_model=256,
        num_layers=3,
        num_heads=4,
        d_kv=64,
        d_ff=512,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        dropout_rate=0.0,
    )
    torch.manual_seed(0)
    torch_model = transformers.T5ForConditionalGeneration(config).eval()
    torch_model.lm_head.weight = torch.nn.Parameter(torch.randn(384, 256) * 256**-0.5)
    hf_dir = save_torch_model(torch_model, tmp_path / "hf")
    model_dir, out_dir = str(tmp_path / "run"), str(tmp_path / "out")
    run = run_main(
        [
            "--gin_file=gin/t5_finetune.gin",
            f"--gin.MODEL_DIR='{model_dir}'",
            f"--gin.INIT_FROM_HF='{hf_dir}'",
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 32}",
            "--gin.BATCH_SIZE=8",
            "--gin.TRAIN_STEPS=6",
            "--gin.WARMUP_STEPS=1",
            "--gin.LOG_PERIOD=2",
            "--gin.EVAL_PERIOD=6",
            "--gin.EVAL_STEPS=1",
        ],
        cwd=repo_dir,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"Initialised EncoderDecoderModel from {hf_dir}" in run.stdout
    losses = [r["loss"] for r in read_metrics(model_dir) if "loss" in r]
    assert len(losses) == 3 and np.all(np.isfinite(losses)), losses

    export = run_main(
        [
            "--gin_file=runs/export_hf.gin",
            f"--gin.MODEL_DIR='{model_dir}'",
            f"--gin.HF_OUT_DIR='{out_dir}'",
        ],
        cwd=repo_dir,
    )
    assert export.returncode == 0, export.stderr[-3000:]
    _, info = transformers.AutoModelForSeq2SeqLM.from_pretrained(out_dir, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
