"""`python -m flaxlm.main` end to end, as users run it (subprocesses)."""

import json
import os
import subprocess
import sys

import pytest

from flaxlm import gin_utils

SMALL = [
    # The default run's model and data, shortened for CI.
    "--gin.TASK_FEATURE_LENGTHS={'targets': 128}",
    "--gin.LOG_PERIOD=5",
    "--gin.EVAL_STEPS=2",
]


def run_main(args, cwd, devices=1, timeout=600):
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "flaxlm.main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_default_run_trains_with_falling_loss_then_resumes(tmp_path, repo_dir):
    model_dir = str(tmp_path / "run")
    args = [
        "--gin_file=gin/gptj_pretrain.gin",
        f"--gin.MODEL_DIR='{model_dir}'",
        "--gin.TRAIN_STEPS=30",
        "--gin.WARMUP_STEPS=5",
        "--gin.EVAL_PERIOD=30",
        "--gin.CHECKPOINT_PERIOD=30",
        *SMALL,
    ]
    first = run_main(args, cwd=repo_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step 30/30" in first.stdout and "tok/s" in first.stdout and "ETA" in first.stdout
    records = read_metrics(model_dir)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30]
    for key in ("step", "loss", "learning_rate", "tokens_per_second"):
        assert key in train[0]
    assert train[0]["loss"] - train[-1]["loss"] > 1.0, [r["loss"] for r in train]
    assert any("eval/loss" in r for r in records)
    assert os.path.exists(os.path.join(model_dir, "config.gin"))
    assert "GPTJConfig" in open(os.path.join(model_dir, "config.gin")).read()
    assert any(
        f.startswith("events.out") for f in os.listdir(os.path.join(model_dir, "tensorboard"))
    )
    assert os.path.isdir(os.path.join(model_dir, "checkpoints", "30"))
    assert f"Wrote to {model_dir}" in first.stdout

    # Same command with more steps: resumes from step 30, does not start over.
    second = run_main([a.replace("TRAIN_STEPS=30", "TRAIN_STEPS=40") for a in args], repo_dir)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Resumed from checkpoint step 30" in second.stdout
    steps = [r["step"] for r in read_metrics(model_dir) if "loss" in r]
    assert steps[-2:] == [35, 40] and steps.count(5) == 1
    assert os.path.isdir(os.path.join(model_dir, "checkpoints", "40"))


@pytest.mark.slow
def test_run_on_a_2x2x2_mesh_from_another_directory(tmp_path):
    model_dir = str(tmp_path / "mesh")
    result = run_main(
        [
            "--gin_file=gptj_pretrain.gin",  # found through the search path
            f"--gin.MODEL_DIR='{model_dir}'",
            "--gin.Partitioner.mesh_shape=(2,2,2)",
            "--gin.TRAIN_STEPS=5",
            "--gin.EVAL_PERIOD=5",
            "--gin.CHECKPOINT_PERIOD=5",
            "--gin.BATCH_SIZE=8",
            *SMALL,
        ],
        cwd=str(tmp_path),
        devices=8,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data=2, fsdp=2, tensor=2" in result.stdout
    assert os.path.isdir(os.path.join(model_dir, "checkpoints", "5"))


def test_gin_dot_flags_become_bindings():
    argv = ["prog", "--gin.TRAIN_STEPS=5", "--gin_file=x.gin", "--gin.A.b='c=d'"]
    assert gin_utils.rewrite_gin_args(argv) == [
        "prog",
        "--gin_bindings=TRAIN_STEPS = 5",
        "--gin_file=x.gin",
        "--gin_bindings=A.b = 'c=d'",
    ]
