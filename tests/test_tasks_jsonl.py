"""JSONL tasks of in_text/out_text pairs: parsing, errors, prefix-LM and encoder-decoder batches."""

import json

import jax
import numpy as np
import pytest
import seqio

import tasks  # noqa: F401  (registers the factories)
from tasks.jsonl import register_jsonl_task
from tests.helpers import tiny_gptj

PAIRS = [
    {"in_text": "2+2=", "out_text": "4"},
    {"in_text": "abc", "out_text": "def!"},
    {"in_text": "hello ", "out_text": "world"},
]
OFFSET = 3  # ByteVocabulary: id = byte + 3 (0 pad, 1 EOS, 2 UNK)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _bytes(text):
    return [b + OFFSET for b in text.encode()]


def _task(tmp_path, name, records=PAIRS, **kw):
    path = _write(tmp_path / f"{name}.jsonl", records)
    return register_jsonl_task(name=name, split_files={"train": path}, **kw)


def test_jsonl_task_reads_pairs_in_order_with_eos_on_targets(tmp_path):
    name = _task(tmp_path, "jsonl_parse")
    ds = seqio.get_mixture_or_task(name).get_dataset(None, split="train", shuffle=False)
    examples = list(ds.as_numpy_iterator())
    assert [list(ex["inputs"]) for ex in examples] == [_bytes(r["in_text"]) for r in PAIRS]
    assert [list(ex["targets"]) for ex in examples] == [_bytes(r["out_text"]) + [1] for r in PAIRS]
    assert register_jsonl_task(name=name, split_files={"train": "ignored"}) == name


def test_jsonl_task_reads_other_keys(tmp_path):
    records = [{"prompt": "a", "completion": "b"}]
    name = _task(tmp_path, "jsonl_keys", records, input_key="prompt", target_key="completion")
    ds = seqio.get_mixture_or_task(name).get_dataset(None, split="train", shuffle=False)
    (ex,) = list(ds.as_numpy_iterator())
    assert list(ex["inputs"]) == _bytes("a") and list(ex["targets"]) == _bytes("b") + [1]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"in_text": "a", "out_text": ', "not valid JSON"),
        ('{"in_text": "a"}', r"missing string field\(s\) \['out_text'\]"),
        ('{"in_text": "a", "out_text": 7}', r"missing string field\(s\) \['out_text'\]"),
        ('["in_text", "out_text"]', "expected a JSON object"),
    ],
)
def test_malformed_line_fails_at_registration_naming_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n\n" + bad_line + "\n" + json.dumps(PAIRS[1]) + "\n")
    with pytest.raises(ValueError, match=f"{path}:3: {message}"):
        register_jsonl_task(name="jsonl_bad", split_files={"train": str(path)})
    assert "jsonl_bad" not in seqio.TaskRegistry.names()


def test_empty_file_or_no_match_is_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl.*no JSONL records"):
        register_jsonl_task(name="jsonl_empty", split_files={"train": f"{tmp_path}/empty.jsonl"})
    with pytest.raises(FileNotFoundError, match="jsonl_missing.*nothing-\\*.jsonl.*'validation'"):
        register_jsonl_task(
            name="jsonl_missing",
            split_files={
                "train": str(tmp_path / "empty.jsonl"),
                "validation": str(tmp_path / "nothing-*.jsonl"),
            },
        )


def _prefix_lm_batch(name, pack):
    ds = seqio.get_dataset(
        name,
        task_feature_lengths={"inputs": 8, "targets": 8},
        dataset_split="train",
        shuffle=False,
        num_epochs=1,
        feature_converter=seqio.DecoderFeatureConverter(pack=pack),
    )
    return next(ds.batch(3).as_numpy_iterator())


def test_prefix_lm_loss_weights_cover_only_the_output_tokens(tmp_path):
    name = _task(tmp_path, "jsonl_prefix_lm")
    batch = _prefix_lm_batch(name, pack=False)
    for row, pair in enumerate(PAIRS):
        n_in, n_out = len(_bytes(pair["in_text"])), len(_bytes(pair["out_text"])) + 1  # EOS
        targets = batch["decoder_target_tokens"][row]
        assert list(targets[: n_in + n_out]) == _bytes(pair["in_text"] + pair["out_text"]) + [1]
        expected = [0] * n_in + [1] * n_out + [0] * (16 - n_in - n_out)
        assert list(batch["decoder_loss_weights"][row]) == expected
    # The model takes exactly these weights: its loss is over the out_text tokens alone.
    model = tiny_gptj(vocab_size=384)
    params = jax.jit(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (3, 16)})
    )()
    _, metrics = jax.jit(lambda p, b: model.loss_fn(p, b, None))(params, batch)
    assert float(metrics["weight_sum"]) == sum(len(p["out_text"]) + 1 for p in PAIRS)


def test_packed_prefix_lm_batch_keeps_the_output_only_loss(tmp_path):
    name = _task(tmp_path, "jsonl_prefix_lm_packed")
    batch = _prefix_lm_batch(name, pack=True)
    row = 0
    segments = batch["decoder_segment_ids"][row]
    assert segments.max() >= 2  # several pairs share the row
    for seg in range(1, segments.max() + 1):
        where = segments == seg
        assert list(batch["decoder_positions"][row][where]) == list(range(where.sum()))
        pair = PAIRS[seg - 1]
        n_in = len(_bytes(pair["in_text"]))
        weights = batch["decoder_loss_weights"][row][where]
        assert list(weights) == [0] * n_in + [1] * (len(weights) - n_in)


def test_encoder_decoder_batch_reads_inputs_and_targets(tmp_path):
    name = _task(tmp_path, "jsonl_encdec", inputs_add_eos=True)
    ds = seqio.get_dataset(
        name,
        task_feature_lengths={"inputs": 8, "targets": 8},
        dataset_split="train",
        shuffle=False,
        num_epochs=1,
        feature_converter=seqio.EncDecFeatureConverter(pack=False),
    )
    batch = next(ds.batch(3).as_numpy_iterator())
    for row, pair in enumerate(PAIRS):
        enc = _bytes(pair["in_text"]) + [1]
        dec = _bytes(pair["out_text"]) + [1]
        assert list(batch["encoder_input_tokens"][row][: len(enc)]) == enc
        assert list(batch["decoder_target_tokens"][row][: len(dec)]) == dec
        assert list(batch["decoder_input_tokens"][row][: len(dec)]) == [0] + dec[:-1]
        assert list(batch["decoder_loss_weights"][row]) == [1] * len(dec) + [0] * (8 - len(dec))


def _reverse_pairs(n=64):
    rng = np.random.default_rng(0)
    words = ["cat", "dog", "sun", "moon", "tree", "fish"]
    pairs = []
    for _ in range(n):
        w = [str(x) for x in rng.choice(words, 3)]
        pairs.append({"in_text": f"reverse: {' '.join(w)} =>", "out_text": " " + " ".join(w[::-1])})
    return pairs


@pytest.mark.slow
def test_jsonl_finetune_gin_trains_with_falling_loss(tmp_path, repo_dir):
    from tests.test_main import read_metrics, run_main

    train = _write(tmp_path / "train.jsonl", _reverse_pairs())
    model_dir = str(tmp_path / "run")
    result = run_main(
        [
            "--gin_file=gin/jsonl_finetune.gin",
            f"--gin.JSONL_TRAIN='{train}'",
            f"--gin.MODEL_DIR='{model_dir}'",
            "--gin.TRAIN_STEPS=20",
            "--gin.WARMUP_STEPS=4",
            "--gin.LOG_PERIOD=5",
            "--gin.EVAL_PERIOD=20",
            "--gin.CHECKPOINT_PERIOD=20",
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 32}",
        ],
        cwd=repo_dir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(model_dir)
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], losses
    assert any("eval/loss" in r for r in records), records


@pytest.mark.slow
def test_jsonl_finetune_with_a_malformed_line_fails_before_training(tmp_path, repo_dir):
    from tests.test_main import run_main

    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n" + '{"in_text": "a"}\n')
    model_dir = tmp_path / "run"
    result = run_main(
        [
            "--gin_file=gin/jsonl_finetune.gin",
            f"--gin.JSONL_TRAIN='{path}'",
            f"--gin.MODEL_DIR='{model_dir}'",
        ],
        cwd=repo_dir,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{path}:2: missing string field(s) ['out_text']" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (model_dir / "checkpoints").exists()
