"""Stops and the input process's failures, through `python -m flaxlm.main` (subprocesses).

A SIGTERM or SIGINT at any moment of a run's start-up stops it: the handler records the
request and the run acts on it at its next safe point (flaxlm.main's start-up, the run's
set-up, the loop between steps), exiting 0 with nothing half-written and nothing "ignored".
An error in the input process reaches the run with its cause; an input process whose run
was killed ends quietly. A bad flag is a usage error like the others (exit 2).
"""

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from flaxlm.parallel import platforms
from tests import zygote

TRAIN_STEPS = 20  # (more than any trial reaches before its signal: each one stops early)
CONFIG = [
    "--gin_file=gin/gptj_pretrain.gin",
    f"--gin.TRAIN_STEPS={TRAIN_STEPS}",
    "--gin.WARMUP_STEPS=2",
    "--gin.TASK_FEATURE_LENGTHS={'targets': 32}",
    "--gin.BATCH_SIZE=8",
    "--gin.LOG_PERIOD=1",
    "--gin.CHECKPOINT_PERIOD=100",
    "--gin.EVAL_PERIOD=0",
]
# How long a stop may take from the signal to the exit: the longest start-up step it waits
# for (importing JAX, parsing Gin, an initial compile) on a loaded machine, then the exit.
STOP_WITHIN = 30.0
# The lines a stop ends with, by where it came: start-up, the run's set-up, the loop.
STOPPED = ("during start-up: exiting; nothing to save.", "before the first step", "Preempted by")


def env_for(devices=1):
    env = dict(os.environ)
    env["XLA_FLAGS"] = platforms.host_device_flags(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([zygote.REPO, env.get("PYTHONPATH", "")])
    return env


def running(pids=None, parent=None):
    """The processes among `pids` (else all), children of `parent` if given, that are
    running (Linux's /proc; a zombie has finished)."""
    found = []
    for entry in os.listdir("/proc") if pids is None else map(str, pids):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rpartition(")")[2].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z" and parent in (None, int(ppid)):
            found.append(int(entry))
    return found


def wait_until_gone(pids, seconds=20.0):
    """Those of `pids` still running after `seconds`."""
    deadline = time.monotonic() + seconds
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running(pids)


def checkpoint_entries(model_dir):
    """The steps and the unfinished saves (orbax's `*.orbax-checkpoint-tmp-*`) under
    MODEL_DIR/checkpoints."""
    root = os.path.join(model_dir, "checkpoints")
    entries = os.listdir(root) if os.path.isdir(root) else []
    return sorted(e for e in entries if e.isdigit() or "tmp" in e)


def stop_after(delay, sig, model_dir, repo_dir, fresh=False):
    """Starts a run, sends it `sig` after `delay` seconds; returns (return code, stdout,
    stderr, seconds from the signal to the exit, the run's child processes at the signal).
    The run is forked from the tests' zygote, or `fresh`: a new process in a process group
    of its own, signalled as a group (as a terminal's Ctrl-C is) `delay` seconds after its
    input process has started (then flaxlm.main has taken the signals, and imports JAX)."""
    args = [*CONFIG, f"--gin.MODEL_DIR='{model_dir}'"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    if fresh:
        command = [sys.executable, "-m", "flaxlm.main", *args]
        proc = subprocess.Popen(
            command, cwd=repo_dir, env=env_for(), text=True, start_new_session=True, **pipes
        )
        deadline = time.monotonic() + 60
        while not running(parent=proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
    else:
        proc = zygote.start(args, repo_dir, env_for(), **pipes)
    time.sleep(delay)
    children = running(parent=proc.pid)
    if fresh:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    signalled = time.monotonic()
    try:
        out, err = proc.communicate(timeout=STOP_WITHIN + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err, time.monotonic() - signalled, children


def stop_problem(result, delay, sig, model_dir):
    """What is wrong with how a run took a stop (None: nothing), with its output."""
    code, out, err, took, _ = result
    problem = None
    entries = checkpoint_entries(model_dir)
    saved = []
    if "Preempted by" in out:  # (a run that reached its loop saves the step it is at)
        saved = [out.split("Preempted by")[1].split("at step ")[1].split(":")[0]]
    if code != 0:
        problem = f"exit code {code}"
    elif took > STOP_WITHIN:
        problem = f"{took:.1f} s from the signal to the exit"
    elif "Exception ignored" in err or "Traceback" in err:
        problem = "a traceback"
    elif not any(line in out + err for line in STOPPED) or sig.name not in out + err:
        problem = "no line saying it stopped"
    elif entries != saved:  # nothing half-written: no checkpoint but one it says it saved
        problem = f"checkpoints {entries}, not {saved}"
    if problem is None:
        return None
    return f"{sig.name} after {delay:.1f} s: {problem}\n{out[-2000:]}\n{err[-3000:]}"


@pytest.mark.slow
def test_a_stop_at_any_moment_of_start_up_exits_0_with_nothing_half_written(tmp_path, repo_dir):
    """Every 0.2 s over the first 3 s (from when flaxlm.main has taken the signals: before,
    the interpreter's defaults end the process at once), SIGTERM and SIGINT in turn, two
    runs at a time."""
    trials = [
        (0.4 + 0.2 * i, (signal.SIGTERM, signal.SIGINT)[i % 2], str(tmp_path / f"run{i}"))
        for i in range(15)
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda t: stop_after(*t, repo_dir), trials))
    problems = [stop_problem(r, *t) for t, r in zip(trials, results, strict=True)]
    assert not any(problems), "\n\n".join(p for p in problems if p)


def test_a_stop_asked_during_jax_plugin_discovery_ends_the_start_up_at_the_next_import():
    """JAX calls each installed plugin's `initialize()` under a bare `except:` that logs what
    it catches (the CUDA plugin imports NVIDIA's packages there, GPU or not): a stop raised
    at those imports would be printed as a plugin error and lost (a CI failure of the test
    above). It is raised at the next import outside instead."""
    pytest.importorskip("jax_plugins.xla_cuda12")  # the `test` extra installs it
    script = textwrap.dedent(
        """
        import jax
        import jax_plugins.xla_cuda12  # imported: its initialize() is what runs under the except

        from flaxlm import startup

        class Stop(BaseException):
            pass

        def check():
            raise Stop

        startup.BeforeEachImport(check).install()
        jax.devices()
        try:
            import xml.dom.minidom
        except Stop:
            print("stopped at the next import")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env_for(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "plugin configuration error" not in done.stderr, done.stderr
    assert done.stdout.strip() == "stopped at the next import", done.stdout


@pytest.mark.slow
def test_a_stop_between_start_up_and_the_runs_handler_stops_before_the_first_step(
    tmp_path, repo_dir
):
    """A Ctrl-C in the run's own checks, after flaxlm.main's start-up and before `train`
    takes the signals over: `train`'s handler takes the request over with them."""
    model_dir = str(tmp_path / "run")
    env = {**env_for(), "FLAXLM_TEST_KILL": "checks", "FLAXLM_TEST_SIGNAL": "INT"}
    args = [*CONFIG, f"--gin.MODEL_DIR='{model_dir}'", "--tasks_module=tests.kill_switch"]
    result = zygote.run(args, repo_dir, env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    line = "Stopped by SIGINT before the first step: nothing new to save (no checkpoint yet)."
    assert line in result.stdout, result.stdout[-3000:]
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr
    assert checkpoint_entries(model_dir) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "delay, sig", [(0.2, signal.SIGTERM), (1.0, signal.SIGINT)], ids=["SIGTERM", "SIGINT"]
)
def test_a_stop_in_a_fresh_process_start_up_exits_0_and_leaves_no_process(
    tmp_path, repo_dir, delay, sig
):
    """As a user starts it: its input process starts beside JAX's import (in a process
    group of its own, which a Ctrl-C to the run's does not reach), and goes with the run."""
    model_dir = str(tmp_path / "run")
    result = stop_after(delay, sig, model_dir, repo_dir, fresh=True)
    problem = stop_problem(result, delay, sig, model_dir)
    assert problem is None, problem
    assert result[-1], "no input process was running"
    left = wait_until_gone(result[-1], seconds=10)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "the run's input process outlived it"


INPUT_PROCESS_PARENT = textwrap.dedent(
    """
    import sys, time
    from flaxlm.data import input_process
    process = input_process.InputProcess(quiet=True)
    process.request("reset", 1)  # (answered once the child has loaded the pipeline)
    print(process.pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow
def test_an_input_process_whose_run_was_killed_exits_quietly(tmp_path, repo_dir):
    log = tmp_path / "run.log"
    with open(log, "w") as stderr:
        parent = subprocess.Popen(
            [sys.executable, "-c", INPUT_PROCESS_PARENT],
            cwd=repo_dir,
            env=env_for(),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    child = int(parent.stdout.readline())
    parent.kill()  # kill -9: the child's requests are left unanswered
    parent.wait()
    if wait_until_gone([child], seconds=20):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the orphaned input process is still running 20 s after its run's kill -9")
    assert log.read_text() == ""


@pytest.mark.slow
def test_an_input_process_error_reaches_the_run_with_its_cause(monkeypatch):
    """An input process that cannot load its pipeline (here: no TensorFlow) answers every
    request with that error; the run's error names its type and message on its first line (a
    checkpoint's "could not be read (...)" warning shows that line: a truncated dataset
    position file reads "The input process failed: IndexError: Read less bytes than
    requested"), the child's traceback below it."""
    from flaxlm.data import input_process

    # The child's Python path is this process's: tests/no_tensorflow's sitecustomize runs
    # there first, making `import tensorflow` and `import seqio` fail.
    monkeypatch.syspath_prepend(os.path.join(zygote.REPO, "tests", "no_tensorflow"))
    process = input_process.InputProcess(quiet=True)
    try:
        with pytest.raises(RuntimeError) as raised:
            process.call("reset", 1)
    finally:
        process.close()
    first, _, rest = str(raised.value).partition("\n")
    cause = "ModuleNotFoundError: import of seqio halted; None in sys.modules"
    assert first == f"The input process failed: {cause}", first
    assert "Traceback" in rest, str(raised.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, named",
    [
        ("--profile_startup=maybe", "flag --profile_startup=maybe: "),
        ("--process_count=two", "flag --process_count=two: "),
        ("--no_such_flag", "Unknown command line flag 'no_such_flag'"),
    ],
)
def test_a_bad_flag_exits_2_with_one_error_line(repo_dir, flag, named):
    result = zygote.run(["--gin_file=gin/gptj_pretrain.gin", flag], repo_dir, env_for())
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: {named}"), result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == "", result.stderr
