"""Packed batches straight from seqio: segment ids, per-segment positions, and per-token
losses equal to the unpacked run's (decoder-only prefix-LM and encoder-decoder).

test_models.py and test_hf_t5.py prove the same for hand-built packed rows; these take the
rows seqio's feature converters pack from a real task."""

import json

import jax
import numpy as np
import pytest
import seqio
import tensorflow as tf

import tasks  # noqa: F401
from flaxlm.data import packing, pipeline
from flaxlm.models.base import EncoderDecoderModel
from flaxlm.models.t5 import T5Config
from tasks.jsonl import register_jsonl_task
from tests.helpers import float32_atol, tiny_gptj

PAIRS = [
    {"in_text": "ab", "out_text": "cde"},
    {"in_text": "fghi", "out_text": "jk"},
    {"in_text": "l", "out_text": "mnopq"},
    {"in_text": "rst", "out_text": "uv"},
]
LENGTHS = {"inputs": 8, "targets": 8}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    path = tmp_path_factory.mktemp("packing") / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return register_jsonl_task(name="packing_pairs", split_files={"train": str(path)})


def _batch(task, converter, pack, rows):
    ds = seqio.get_dataset(
        task,
        task_feature_lengths=LENGTHS,
        dataset_split="train",
        shuffle=False,
        num_epochs=1,
        feature_converter=converter(pack=pack),
    )
    return next(ds.batch(rows).as_numpy_iterator())


def _token_losses(model, params, batch):
    """Per-token cross-entropy times the loss weight, `[batch, length]`."""
    logits = jax.jit(model.compute_logits)(params, batch)
    logp = jax.nn.log_softmax(logits, axis=-1)
    targets = batch["decoder_target_tokens"]
    nll = -np.take_along_axis(np.asarray(logp), targets[..., None], axis=-1)[..., 0]
    return nll * batch["decoder_loss_weights"]


def _check_segments(packed, prefix):
    """Segments 1, 2, ... each with positions 0, 1, ...; padding is segment 0."""
    segments, positions = packed[f"{prefix}_segment_ids"], packed[f"{prefix}_positions"]
    for seg_row, pos_row in zip(segments, positions):
        for seg in range(1, seg_row.max() + 1):
            where = seg_row == seg
            assert list(pos_row[where]) == list(range(where.sum()))
        assert (pos_row[seg_row == 0] == 0).all()
    assert segments.max() >= 2  # rows really hold several examples


def _compare(model, params, packed, unpacked):
    """Each packed segment's per-token losses equal its own unpacked row's."""
    packed_losses = _token_losses(model, params, packed)
    unpacked_losses = _token_losses(model, params, unpacked)
    seen = 0
    for row in range(len(packed["decoder_segment_ids"])):
        seg_row = packed["decoder_segment_ids"][row]
        for seg in range(1, seg_row.max() + 1):
            where = seg_row == seg
            targets = packed["decoder_target_tokens"][row][where]
            (match,) = [
                i
                for i, t in enumerate(unpacked["decoder_target_tokens"])
                if list(t[: where.sum()]) == list(targets) and not t[where.sum() :].any()
            ]
            # Losses ~log(vocab) through at most a 2 + 2-layer T5 (~10 and ~16 rounding stages
            # a layer) and the log-softmax, summed in other orders packed and unpacked.
            want = unpacked_losses[match][: where.sum()]
            atol = float32_atol(want, depth=2 * 10 + 2 * 16 + 3)
            np.testing.assert_allclose(packed_losses[row][where], want, atol=atol)
            seen += 1
    assert seen == len(PAIRS)


def test_packed_prefix_lm_rows_give_the_unpacked_per_token_losses(task):
    model = tiny_gptj(vocab_size=384)
    converter = seqio.DecoderFeatureConverter
    packed = _batch(task, converter, pack=True, rows=len(PAIRS))
    unpacked = _batch(task, converter, pack=False, rows=len(PAIRS))
    _check_segments(packed, "decoder")
    params = model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 16)})
    _compare(model, params, packed, unpacked)


@pytest.mark.slow
def test_packed_encoder_decoder_rows_give_the_unpacked_per_token_losses(task):
    config = T5Config(
        vocab_size=384,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
    )
    model = EncoderDecoderModel(config)
    converter = seqio.EncDecFeatureConverter
    packed = _batch(task, converter, pack=True, rows=len(PAIRS))
    unpacked = _batch(task, converter, pack=False, rows=len(PAIRS))
    _check_segments(packed, "encoder")
    _check_segments(packed, "decoder")
    shapes = {k: (1, 8) for k in ("encoder_input_tokens", "decoder_input_tokens")}
    params = model.init_params(jax.random.PRNGKey(0), shapes)
    _compare(model, params, packed, unpacked)


@pytest.mark.parametrize("packer", ["pack_batches", "pack_linear"])
@pytest.mark.parametrize(
    "lengths,examples", [({"targets": 16}, 100), ({"inputs": 12, "targets": 10}, 57)]
)
def test_flaxlm_packers_make_seqios_rows_token_for_token(packer, lengths, examples):
    """flaxlm's packers against seqio's (a batch of L examples padded to the longest, packed
    in a loop AutoGraph rewrites), across seqio's flush every L examples, empty examples,
    zeros inside examples and a last partial batch: `pack_batches` (seqio's batches, explicit
    ops) and `pack_linear` (one row in memory), both as the pipelines run them (without
    AutoGraph: `pipeline.NOT_AUTOGRAPHED`)."""
    pipeline.configure_tensorflow()
    rng = np.random.default_rng(0)
    rows = [{k: rng.integers(0, 5, rng.integers(0, 30)) for k in lengths} for _ in range(examples)]
    spec = {k: tf.TensorSpec([None], tf.int64) for k in lengths}
    ds = tf.data.Dataset.from_generator(lambda: iter(rows), output_signature=spec)
    want = list(packing._SEQIO_TRIM_AND_PACK(ds, lengths).as_numpy_iterator())
    got_ds = getattr(packing, packer)(ds, lengths)
    assert got_ds.element_spec == packing._SEQIO_TRIM_AND_PACK(ds, lengths).element_spec
    got = list(got_ds.as_numpy_iterator())
    assert len(got) == len(want) > examples // 2
    for w, g in zip(want, got, strict=True):
        assert sorted(w) == sorted(g)
        for k in w:
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)


def test_a_data_position_saved_under_seqios_packer_restores_into_flaxlms(tmp_path):
    """A run checkpointed before flaxlm packed short rows itself (seqio's packer) resumes
    with the next batches it would have read: the iterator's structure is seqio's."""
    pipeline.configure_tensorflow()
    lengths = {"targets": 16}
    rng = np.random.default_rng(0)
    rows = tf.ragged.constant([rng.integers(1, 5, rng.integers(0, 30)) for _ in range(400)])

    def source():
        return tf.data.Dataset.from_tensor_slices(rows).map(lambda r: {"targets": r})

    saved = iter(packing._SEQIO_TRIM_AND_PACK(source(), lengths).batch(4))
    for _ in range(7):
        next(saved)
    path = tf.train.Checkpoint(iterator=saved).write(str(tmp_path / "position"))
    want = [next(saved) for _ in range(5)]
    restored = iter(packing.pack_batches(source(), lengths).batch(4))
    tf.train.Checkpoint(iterator=restored).read(path).assert_consumed()
    for w in want:
        got = next(restored)
        for k in w:
            np.testing.assert_array_equal(got[k].numpy(), w[k].numpy(), err_msg=k)
