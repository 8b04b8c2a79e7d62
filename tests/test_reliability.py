"""Preemption, kill -9 and non-finite values, through `python -m flaxlm.main` (subprocesses).

Every run here has the same config (10 steps of the tiny GPT-J with dropout, a checkpoint
every 2 steps, an evaluation every 3), so each interrupted run can be compared step by step
with one uninterrupted reference run.
"""

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

from flaxlm.parallel import platforms
from tests import zygote
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
    env["XLA_FLAGS"] = platforms.host_device_flags(1)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([cwd, env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    return zygote.start(args, cwd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc, timeout=300, within=10.0):
    """(stdout, stderr) of `proc` once it exits; asserts that it exits within `within`
    seconds of printing its last line (a finished or preempted run must not hang at exit)."""
    import threading

    outputs, last_line = {}, [time.monotonic()]

    def read(name, stream):
        lines = []
        for line in stream:
            lines.append(line)
            if name == "out":
                last_line[0] = time.monotonic()
        outputs[name] = "".join(lines)

    readers = [
        threading.Thread(target=read, args=(name, stream))
        for name, stream in (("out", proc.stdout), ("err", proc.stderr))
    ]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout=timeout)
    finally:
        proc.kill()
    exited = time.monotonic()
    for reader in readers:
        reader.join()
    assert exited - last_line[0] < within, (
        f"exited {exited - last_line[0]:.1f}s after its last line",
        outputs["out"][-2000:],
    )
    return outputs["out"], outputs["err"]


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


def assert_same_losses(model_dir, reference, steps=None, rel=0.0):
    """Every run that reached a step logged the reference loss: bit for bit (the same
    program), or within `rel` for a run whose step is another program (an injected
    non-finite loss: XLA may order a float32 reduction differently, ~1e-7 relative)."""
    got = losses(model_dir)
    assert sorted(got) == sorted(steps or reference)
    for step, values in got.items():
        want = [pytest.approx(reference[step], rel=rel, abs=0)] * len(values)
        assert values == want, (step, values, reference[step])


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

    # 4. Finishes, and exits at once (a rerun after a kill -9 used to hang at exit).
    last = start_main(args_for(model_dir), repo_dir)
    out, err = finish(last)
    assert last.returncode == 0, err[-3000:]
    assert f"Resumed from checkpoint step {resume_from}" in out
    assert_same_losses(model_dir, reference)
    assert checkpoint_steps(model_dir)[-1] == TRAIN_STEPS


@pytest.mark.slow
def test_sigterm_saves_at_the_current_step_exits_0_at_once_and_resumes_exactly(
    tmp_path, repo_dir, reference
):
    model_dir = str(tmp_path / "run")
    kill = "--tasks_module=tests.kill_switch"
    # 1. SIGTERM in the middle of the evaluation at step 3: step 3 is saved, no step 4 runs.
    term = {"FLAXLM_TEST_SIGNAL": "TERM"}
    proc = start_main(args_for(model_dir, kill), repo_dir, {"FLAXLM_TEST_KILL": "eval:3", **term})
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert f"Preempted by SIGTERM at step 3: saved checkpoint {model_dir}/checkpoints/3." in out
    assert max(losses(model_dir)) == 3 and checkpoint_steps(model_dir)[-1] == 3

    # 2. Resumed, then SIGTERM from outside, mid-step.
    at = random.randint(4, 7)
    proc = start_main(args_for(model_dir), repo_dir)
    wait_for_step(model_dir, at, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "Resumed from checkpoint step 3" in out
    stopped = max(losses(model_dir))
    assert at <= stopped < TRAIN_STEPS
    line = f"Preempted by SIGTERM at step {stopped}: saved checkpoint {model_dir}/checkpoints/"
    assert f"{line}{stopped}." in out, out
    assert checkpoint_steps(model_dir)[-1] == stopped

    # 3. With that checkpoint's largest array file cut short: set aside, the one before
    # restored; finishes exactly as the uninterrupted run.
    from tests.test_checkpoints import _truncate_an_array_file

    _truncate_an_array_file(pathlib.Path(model_dir, "checkpoints", str(stopped)))
    previous = checkpoint_steps(model_dir)[-2]
    proc = start_main(args_for(model_dir), repo_dir)
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    aside = f"{model_dir}/checkpoints/{stopped}.unreadable"
    assert "could not be read" in out and f"moved it to {aside}" in out, out
    # The warning line says it all: the failed restore's other array reads used to print
    # 100-250 TensorStore tracebacks (~8,000 lines), most of them after "Done in".
    assert err == "", err[-3000:]
    assert f"Resumed from checkpoint step {previous}" in out
    assert_same_losses(model_dir, reference)
    assert os.path.isdir(aside) and checkpoint_steps(model_dir)[-1] == TRAIN_STEPS

    # 4. Run again: nothing left to do.
    proc = start_main(args_for(model_dir), repo_dir)
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert f"Already trained to step {TRAIN_STEPS}" in out


@pytest.mark.slow
@pytest.mark.parametrize("where", ["import", "restore"])
def test_sigterm_during_start_up_exits_0_saying_so(tmp_path, repo_dir, where):
    """Before Gin is parsed (main's own handler), and in the run's set-up (train's)."""
    model_dir = str(tmp_path / "run")
    env = {"FLAXLM_TEST_KILL": where, "FLAXLM_TEST_SIGNAL": "TERM"}
    proc = start_main(args_for(model_dir, "--tasks_module=tests.kill_switch"), repo_dir, env)
    out, err = finish(proc, within=60)
    assert proc.returncode == 0, err[-3000:]
    if where == "import":
        assert "Received SIGTERM during start-up: exiting; nothing to save." in err, err[-3000:]
    else:
        line = "Stopped by SIGTERM before the first step: nothing new to save (no checkpoint yet)."
        assert line in out, out
        assert "(none yet)" in out and "step 0" not in out, out
    assert checkpoint_steps(model_dir) == []
    assert "Traceback" not in err


def test_second_signal_exits_at_once_without_saving(repo_dir):
    script = (
        "import os, signal, sys\n"
        "from flaxlm.training.preemption import PreemptionHandler\n"
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
    assert_same_losses(model_dir, reference, steps=[1, 2, 3, 4], rel=1e-6)


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
    # (another program than the reference's: float32 round-off, as assert_same_losses says)
    assert [train[s]["loss"] for s in (1, 2, 3, 4)] == [
        pytest.approx(reference[s], rel=1e-6, abs=0) for s in (1, 2, 3, 4)
    ]
    assert checkpoint_steps(model_dir)[-1] == TRAIN_STEPS
