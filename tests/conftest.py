"""8 simulated CPU devices for every test, set before JAX is imported anywhere."""

import atexit
import os
import shutil
import sys
import tempfile

os.environ["XLA_FLAGS"] = (
    " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    + " --xla_force_host_platform_device_count=8"
)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import pytest  # noqa: E402

# The end-to-end tests start `python -m flaxlm.main` over and over on the same tiny configs,
# each compiling the same programs. Set after JAX is imported here (which has read its
# config), this reaches only those processes: one compilation cache per test worker, with
# its file locks on (a size limit), so that concurrent processes never read a half-written
# entry. This process, and so the in-process tests, compile without it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="flaxlm-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(1 << 30))


def pytest_configure(config: pytest.Config) -> None:
    assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"


@pytest.fixture(scope="session")
def repo_dir() -> str:
    return REPO


@pytest.fixture(scope="session")
def trained_gptj(tmp_path_factory, repo_dir) -> str:
    """A tiny GPT-J MODEL_DIR (byte vocabulary) after 8 steps of the default run; shared by
    the inference and serving tests."""
    from tests.test_main import run_main

    model_dir = str(tmp_path_factory.mktemp("trained_gptj") / "run")
    result = run_main(
        [
            "--gin_file=gin/gptj_pretrain.gin",
            f"--gin.MODEL_DIR='{model_dir}'",
            "--gin.TRAIN_STEPS=8",
            "--gin.EVAL_PERIOD=0",
            "--gin.CHECKPOINT_PERIOD=8",
            "--gin.BATCH_SIZE=8",
            "--gin.TASK_FEATURE_LENGTHS={'targets': 64}",
        ],
        repo_dir,
        devices=8,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.exists(os.path.join(model_dir, "model_record.json"))
    return model_dir
