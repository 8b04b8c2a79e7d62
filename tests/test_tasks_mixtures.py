"""Mixtures of registered tasks, sampled at their rates."""

import json

import gin
import pytest
import seqio

import tasks  # noqa: F401
from tasks.jsonl import register_jsonl_task
from tasks.mixtures import register_mixture
from tasks.text_files import register_text_files_task

OFFSET = 3


def _text(ids):
    return bytes(int(i) - OFFSET for i in ids if i > 1).decode()


def _sources(tmp_path):
    (tmp_path / "a.txt").write_text("".join(f"apple {i}\n" for i in range(20)))
    (tmp_path / "b.txt").write_text("".join(f"berry {i}\n" for i in range(20)))
    a = register_text_files_task(name="mix_a", split_files={"train": str(tmp_path / "a.txt")})
    b = register_text_files_task(name="mix_b", split_files={"train": str(tmp_path / "b.txt")})
    return a, b


def test_mixture_draws_from_every_task_at_its_rate(tmp_path):
    a, b = _sources(tmp_path)
    name = register_mixture(name="mix_ab", tasks_and_rates={a: 3.0, b: 1.0})
    ds = seqio.get_dataset(
        name,
        task_feature_lengths={"targets": 16},
        dataset_split="train",
        shuffle=True,
        seed=0,
        num_epochs=None,
        feature_converter=seqio.DecoderFeatureConverter(pack=False),
    )
    texts = [_text(ex["decoder_target_tokens"]) for ex in ds.take(200).as_numpy_iterator()]
    apples = sum(t.startswith("apple") for t in texts)
    berries = sum(t.startswith("berry") for t in texts)
    assert apples + berries == 200
    assert 0.65 < apples / 200 < 0.85, (apples, berries)  # rate 3:1, i.e. 0.75
    assert register_mixture(name="mix_ab", tasks_and_rates=[(a, 1.0)]) == name


def test_mixture_of_an_unknown_task_or_bad_rate_is_an_error(tmp_path):
    a, _ = _sources(tmp_path)
    with pytest.raises(ValueError, match="no task or mixture named 'mix_aa'.*Did you mean"):
        register_mixture(name="mix_bad", tasks_and_rates=[("mix_aa", 1.0)])
    with pytest.raises(ValueError, match="rate 0 of 'mix_a' must be positive"):
        register_mixture(name="mix_bad", tasks_and_rates={a: 0})
    # seqio's own check: a mixture's tasks must have the same features.
    (tmp_path / "c.jsonl").write_text(json.dumps({"in_text": "x", "out_text": "y"}) + "\n")
    pairs = register_jsonl_task(name="mix_c", split_files={"train": str(tmp_path / "c.jsonl")})
    with pytest.raises(ValueError, match="different output features"):
        register_mixture(name="mix_bad", tasks_and_rates={a: 1.0, pairs: 1.0})
    assert "mix_bad" not in seqio.MixtureRegistry.names()


def test_mixture_binds_in_gin_with_scoped_task_factories(tmp_path):
    (tmp_path / "c.txt").write_text("cherry\n")
    (tmp_path / "d.txt").write_text("date\n")
    gin.clear_config()
    try:
        gin.parse_config(
            f"""
            register_mixture.name = 'mix_gin'
            register_mixture.tasks_and_rates = [
                (@c/register_text_files_task(), 1.0), (@d/register_text_files_task(), 2.0)]
            c/register_text_files_task.name = 'mix_gin_c'
            c/register_text_files_task.split_files = {{'train': '{tmp_path}/c.txt'}}
            d/register_text_files_task.name = 'mix_gin_d'
            d/register_text_files_task.split_files = {{'train': '{tmp_path}/d.txt'}}
            """
        )
        name = register_mixture()
    finally:
        gin.clear_config()
    mixture = seqio.get_mixture_or_task(name)
    assert sorted(t.name for t in mixture.tasks) == ["mix_gin_c", "mix_gin_d"]
    assert mixture.get_rate(seqio.get_mixture_or_task("mix_gin_d")) == 2.0
