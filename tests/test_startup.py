"""Start-up: the persistent compilation cache, `--profile_startup`, `--help`."""

import os
import re
import subprocess
import sys
import time

import pytest

from flaxlm import main
from tests.test_main import SMALL, run_main

PROGRAMS = re.compile(
    r"XLA programs: (\d+) \((\d+) read from the persistent compilation cache, (\d+) compiled\)\."
)


def programs(result):
    """(programs, read from the cache, compiled) of a `--profile_startup` run."""
    match = PROGRAMS.search(result.stdout)
    assert match, result.stdout[-2000:] + result.stderr[-2000:]
    return tuple(int(n) for n in match.groups())


@pytest.mark.slow
def test_second_run_compiles_nothing_with_the_compilation_cache(tmp_path, repo_dir, monkeypatch):
    # Every program cached, however quick to compile (the tests' own setting caches only the
    # slow ones): flaxlm's default.
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    cache = tmp_path / "cache"

    def run(name):
        result = run_main(
            [
                "--gin_file=gin/gptj_pretrain.gin",
                f"--gin.MODEL_DIR='{tmp_path / name}'",
                "--gin.TRAIN_STEPS=1",
                "--gin.EVAL_PERIOD=1",
                *SMALL,
                f"--compilation_cache_dir={cache}",
                "--profile_startup",
            ],
            repo_dir,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    first = run("first")
    assert "Start-up profile" in first.stdout and "first step" in first.stdout
    total, hits, compiled = programs(first)
    assert compiled == total > 0 and hits == 0
    assert programs(run("second")) == (total, total, 0)


def test_compilation_cache_dir_follows_flag_then_environment_then_user_cache():
    assert main.compilation_cache_dir("/x", {"JAX_COMPILATION_CACHE_DIR": "/y"}) == "/x"
    assert main.compilation_cache_dir("", {"JAX_COMPILATION_CACHE_DIR": "/y"}) is None
    assert main.compilation_cache_dir(None, {"JAX_COMPILATION_CACHE_DIR": "/y"}) == "/y"
    assert main.compilation_cache_dir(None, {"JAX_COMPILATION_CACHE_DIR": ""}) is None
    default = main.compilation_cache_dir(None, {"XDG_CACHE_HOME": "/c"})
    assert default == os.path.join("/c", "flaxlm", "jax", main.host_kind())


def test_unwritable_compilation_cache_dir_leaves_the_cache_off(tmp_path):
    import jax

    blocker = tmp_path / "file"
    blocker.write_text("")
    before = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    try:
        main.enable_compilation_cache(str(blocker / "cache"))
        assert not jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_enable_compilation_cache", before[0])
        jax.config.update("jax_compilation_cache_dir", before[1])


def test_help_takes_under_a_second(repo_dir):
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "flaxlm.main", "--help"],
        cwd=repo_dir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--compilation_cache_dir" in result.stdout  # (absl's --help exits 1)
    # Nothing heavy (JAX, TensorFlow) is imported before the flags are parsed; 3 s leaves
    # room for a loaded test machine (it takes ~0.15 s alone).
    assert time.perf_counter() - start < 3.0


def test_hidden_modules_fail_to_import_inside_the_block_and_import_after_it(tmp_path, monkeypatch):
    (tmp_path / "flaxlm_probe_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with main.modules_hidden(("flaxlm_probe_module",)):
        with pytest.raises(ImportError):
            import flaxlm_probe_module  # noqa: F401
    import flaxlm_probe_module

    assert flaxlm_probe_module.VALUE == 1
    monkeypatch.delitem(sys.modules, "flaxlm_probe_module")


def test_eval_dataset_checks_its_task_at_once_and_is_built_at_its_first_use(monkeypatch):
    from flaxlm.data import pipeline

    def config(name):
        return pipeline.DatasetConfig(
            mixture_or_task_name=name, task_feature_lengths={"targets": 8}, batch_size=1
        )

    with pytest.raises(ValueError, match="No seqio task or mixture named 'no_such_task'"):
        pipeline.DeferredDataIterator(config("no_such_task"), partitioner=None)
    built = []
    monkeypatch.setattr(pipeline.DataIterator, "create", lambda *args: built.append(args) or args)
    import tasks  # noqa: F401  (registers stdlib_py)

    deferred = pipeline.DeferredDataIterator(config("stdlib_py"), partitioner=None)
    assert not built
    assert deferred.iterator is deferred.iterator and len(built) == 1
