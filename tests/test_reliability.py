"""Preemption, kill -9 and non-finite values, through `python -m flaxlm.main` (subprocesses).

Every run here has the same config (10 steps of the tiny GPT-J with dropout, a checkpoint
every 2 steps, an evaluation every 3), so each interrupted run can be compared step by step
with one uninterrupted reference run.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.test_main import read_metrics, run_main

TRAIN_STEPS = 10
CONFIG = [
    "--gin_file=gin/gptj_pretrain.gin",
    f"--gin.TRAIN_STEPS={TRAIN_STEPS}",
    "--gin.WARMUP_STEPS=2",
    "--gin.TASK_FEATURE_LENGTHS={'targets': 64}",
    "--gin.BATCH_SIZE=8",
    "--gin.LOG_PERIOD=1",
    "--gin.CHECKPOINT_PERIOD=2",
    "--gin.EVAL_PERIOD=3",
    "--gin.EVAL_STEPS=1",
    # Dropout on, so that exact resume also covers the per-step dropout RNG.
    "--gin.GPTJConfig.dropout_rate=0.1",
]


def args_for(model_dir, *extra):
    return [*CONFIG, f"--gin.MODEL_DIR='{model_dir}'", *extra]


def losses(model_dir):
    """{step: [loss of every run that logged that step]}."""
    out = {}
    for record in read_metrics(model_dir):
        if "loss" in record:
            out.setdefault(record["step"], []).append(record["loss"])
    return out


def checkpoint_steps(model_dir):
    root = os.path.join(model_dir, "checkpoints")
    return sorted(int(d) for d in os.listdir(root) if d.isdigit()) if os.path.isdir(root) else []


def start_main(args, cwd, env_extra=None):
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([cwd, env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    return subprocess.Popen(
        [sys.executable, "-m", "flaxlm.main", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step(model_dir, step, proc, timeout=300):
    """Blocks until metrics.jsonl has logged `step` (or the process ended)."""
    path = os.path.join(model_dir, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(path):
            with open(path) as f:
                steps = [json.loads(line)["step"] for line in f if line.strip()]
            if steps and max(steps) >= step:
                return
        time.sleep(0.05)
    raise AssertionError(f"step {step} never logged (process returned {proc.poll()})")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, repo_dir):
    """Per-step losses of the uninterrupted run."""
    model_dir = str(tmp_path_factory.mktemp("reference"))
    result = run_main(args_for(model_dir), cwd=repo_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    got = losses(model_dir)
    assert sorted(got) == list(range(1, TRAIN_STEPS + 1))
    return {step: values[0] for step, values in got.items()}


def assert_same_losses(model_dir, reference, steps=None):
    got = losses(model_dir)
    assert sorted(got) == sorted(steps or reference)
    for step, values in got.items():
        # Every run that reached this step logged exactly the reference loss (bit for bit).
        assert values == [reference[step]] * len(values), (step, values, reference[step])


@pytest.mark.slow
def test_kill_9_mid_save_mid_eval_and_mid_step_then_restart_gives_identical_losses(
    tmp_path, repo_dir, reference
):
    model_dir = str(tmp_path / "run")
    tasks = "--tasks_module=tests.kill_switch"

    # 1. Killed while step 4's checkpoint is being written: only step 2 counts.
    first = start_main(args_for(model_dir, tasks), repo_dir, {"FLAXLM_TEST_KILL": "save:4"})
    first.communicate(timeout=300)
    assert first.returncode == -signal.SIGKILL
    assert checkpoint_steps(model_dir) == [2]
    assert any(".orbax-checkpoint-tmp" in d for d in os.listdir(f"{model_dir}/checkpoints"))

    # 2. Restarts from step 2, killed in the middle of the evaluation at step 6.
    second = start_main(args_for(model_dir, tasks), repo_dir, {"FLAXLM_TEST_KILL": "eval:6"})
    out, _ = second.communicate(timeout=300)
    assert second.returncode == -signal.SIGKILL
    assert "Resumed from checkpoint step 2" in out
    # Step 4's async save has committed unless the machine is slow enough to reach step 6's
    # evaluation first.
    after_second = checkpoint_steps(model_dir)[-1]
    assert after_second in (2, 4)

    # 3. Restarts, killed from outside once step 7 is logged (wherever it is then).
    third = start_main(args_for(model_dir), repo_dir)
    wait_for_step(model_dir, 7, third)
    third.kill()
    out, _ = third.communicate(timeout=60)
    assert f"Resumed from checkpoint step {after_second}" in out
    # The latest *committed* save, whatever the kill interrupted.
    resume_from = checkpoint_steps(model_dir)[-1]
    assert resume_from in (4, 6, 8, 10)

    # 4. Finishes.
    last = run_main(args_for(model_dir), cwd=repo_dir)
    assert last.returncode == 0, last.stderr[-3000:]
    assert f"Resumed from checkpoint step {resume_from}" in last.stdout
    assert_same_losses(model_dir, reference)
    assert checkpoint_steps(model_dir)[-1] == TRAIN_STEPS


@pytest.mark.slow
def test_sigterm_saves_at_the_current_step_exits_0_and_resumes_exactly(
    tmp_path, repo_dir, reference
):
    model_dir = str(tmp_path / "run")
    at = random.randint(2, 6)
    proc = start_main(args_for(model_dir), repo_dir)
    wait_for_step(model_dir, at, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    stopped = max(losses(model_dir))
    assert at <= stopped < TRAIN_STEPS
    line = f"Preempted by SIGTERM at step {stopped}: saved checkpoint {model_dir}/checkpoints/"
    assert f"{line}{stopped}." in out, out
    assert checkpoint_steps(model_dir)[-1] == stopped

    resumed = run_main(args_for(model_dir), cwd=repo_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from checkpoint step {stopped}" in resumed.stdout
    assert_same_losses(model_dir, reference)


def test_second_signal_exits_at_once_without_saving(repo_dir):
    script = (
        "import os, signal, sys\n"
        "from flaxlm.preemption import PreemptionHandler\n"
        "with PreemptionHandler() as h:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    assert h.received == signal.SIGTERM and h.should_stop()\n"
        "    print('first signal: still running', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    print('not reached', flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=repo_dir, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert "first signal: still running" in result.stdout
    assert "not reached" not in result.stdout
    assert result.returncode == 128 + signal.SIGINT
    assert "Received SIGINT again: exiting now without saving" in result.stderr


@pytest.mark.slow
def test_injected_inf_loss_stops_at_that_step_naming_the_last_good_checkpoint(
    tmp_path, repo_dir, reference
):
    model_dir = str(tmp_path / "run")
    result = run_main(
        args_for(model_dir, "--gin.train.inject_nonfinite_loss_at_step=5"), cwd=repo_dir
    )
    assert result.returncode == 1
    assert "Non-finite values at step 5 (loss inf" in result.stderr
    assert f"Last good checkpoint: step 4 in {model_dir}/checkpoints" in result.stderr
    assert "Traceback" not in result.stderr
    assert checkpoint_steps(model_dir) == [2, 4]
    # Stopped before logging step 5; what came before is the normal run.
    assert_same_losses(model_dir, reference, steps=[1, 2, 3, 4])


@pytest.mark.slow
def test_skip_nonfinite_updates_skips_and_counts(tmp_path, repo_dir, reference):
    model_dir = str(tmp_path / "run")
    result = run_main(
        args_for(
            model_dir,
            "--gin.train.inject_nonfinite_loss_at_step=5",
            "--gin.train.skip_nonfinite_updates=True",
        ),
        cwd=repo_dir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    train = {r["step"]: r for r in read_metrics(model_dir) if "loss" in r}
    assert [train[s]["nonfinite"] for s in range(1, 11)] == [0] * 4 + [1] + [0] * 5
    assert [train[s]["nonfinite_updates_skipped"] for s in (4, 5, 10)] == [0, 1, 1]
    assert train[5]["loss"] == float("inf")
    for step in range(6, TRAIN_STEPS + 1):
        assert 0 < train[step]["loss"] < 10
    assert [train[s]["loss"] for s in (1, 2, 3, 4)] == [reference[s] for s in (1, 2, 3, 4)]
    assert checkpoint_steps(model_dir)[-1] == TRAIN_STEPS
