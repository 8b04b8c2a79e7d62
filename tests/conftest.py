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
