"""8 simulated CPU devices for every test, set before JAX is imported anywhere."""

import os
import sys

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
