"""tests/zygote.py: a forked `flaxlm.main` behaves as a fresh process, and the tests use it."""

import os
import re
import signal
import subprocess
import sys

import pytest

from flaxlm.parallel import platforms
from tests import zygote

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _env(devices=8):
    """The environment tests/test_main.run_main gives `flaxlm.main`."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = platforms.host_device_flags(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    return env


def test_the_tests_environment_is_served_after_torch_and_flaxlm_are_imported():
    """The end-to-end tests' processes fork from the zygote (a variable some import sets in
    this process must not silently send them all back to fresh processes)."""
    import torch  # noqa: F401 - sets KMP_* and TORCHINDUCTOR_* here
    import transformers  # noqa: F401

    import flaxlm.runs.train  # noqa: F401 - TensorFlow and its variables

    proc = zygote.start(["--helpfull"], REPO, _env(), stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=120)
    assert isinstance(proc, zygote.Forked), zygote._get().refusals
    assert "--gin_file" in out
    # ... with TensorFlow loaded as flaxlm.main loads it.
    from flaxlm.data import library_start

    assert zygote.HIDDEN_WHILE_TENSORFLOW_LOADS == library_start.HIDDEN_WHILE_TENSORFLOW_LOADS


@pytest.mark.slow
def test_a_forked_run_prints_and_exits_as_a_fresh_one(tmp_path):
    """A run stopped before its first step by a mesh its devices do not fit (flaxlm's error
    line, exit 2): the same streams and status, forked or fresh; the child's own arguments
    and devices (8 here, though the zygote has none)."""
    args = [
        "--gin_file=gin/gptj_pretrain.gin",
        f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
        "--gin.Partitioner.mesh_shape=(3, -1, 1)",
    ]
    forked = zygote.run(args, REPO, _env(), timeout=300)
    fresh = subprocess.run(
        [sys.executable, "-m", "flaxlm.main", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert forked.returncode == fresh.returncode == 2, (forked.stderr, fresh.stderr)
    # (Gin's messages name functions with their addresses, which differ.)
    assert ADDRESS.sub("", forked.stderr) == ADDRESS.sub("", fresh.stderr)
    assert forked.stdout == fresh.stdout
    assert "(3, -1, 1)" in forked.stderr and "8" in forked.stderr


def test_signals_reach_the_child_and_its_status_comes_back():
    proc = zygote.start(
        ["--gin_file=gin/gptj_pretrain.gin", "--gin.TRAIN_STEPS=100000"],
        REPO,
        _env(1),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert isinstance(proc, zygote.Forked) and proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:  # a failed check must not leave a 100,000-step run behind
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


def test_an_environment_that_changes_what_imports_see_gets_a_fresh_process():
    """A PYTHONPATH with its own `tensorflow` (tests/no_tensorflow: the bad-input rows
    refused before TensorFlow loads), or another JAX setting read at import."""
    env = _env()
    env["PYTHONPATH"] = os.path.join(HERE, "no_tensorflow")
    proc = zygote.start(["--helpshort"], REPO, env, stdout=subprocess.DEVNULL)
    assert isinstance(proc, subprocess.Popen)
    proc.wait(timeout=120)
    env = _env()
    env["JAX_ENABLE_X64"] = "1"
    proc = zygote.start(["--helpshort"], REPO, env, stdout=subprocess.DEVNULL)
    assert isinstance(proc, subprocess.Popen)
    proc.wait(timeout=120)


def test_a_script_runs_as_python_script_py(tmp_path):
    """`python script.py args` (test_multiprocess's workers): the script's directory first on
    the path, its name as argv[0], its signal dispositions, its exit status; forked and
    fresh alike."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import os, sys\n"
        "print(sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)), os.getcwd())\n"
        "print(__name__, 'jax' in sys.modules)\n"
        "import signal\n"  # the dispositions a fresh interpreter starts with (SIGPIPE ignored)
        "print([signal.getsignal(s) for s in (signal.SIGPIPE, signal.SIGTERM, signal.SIGCHLD)])\n"
        "sys.exit(3)\n"
    )
    forked = zygote.run(["a", "b"], REPO, _env(), module=str(script), timeout=120)
    fresh = subprocess.run(
        [sys.executable, str(script), "a", "b"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert forked.returncode == fresh.returncode == 3, (forked.stderr, fresh.stderr)
    assert forked.stdout.splitlines()[0] == fresh.stdout.splitlines()[0]
    assert f"['{script}', 'a', 'b'] True {REPO}" == fresh.stdout.splitlines()[0]
    assert forked.stdout.splitlines()[1] == "__main__ True"  # forked: JAX was imported before
    assert forked.stdout.splitlines()[2] == fresh.stdout.splitlines()[2]
