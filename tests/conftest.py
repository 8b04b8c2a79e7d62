"""8 simulated CPU devices for every test, set before JAX is imported anywhere."""

import atexit
import os
import shutil
import sys
import tempfile

# The tests check numbers, not speed, and their programs are tiny: most of their time is
# XLA compiling. LLVM at -O0 without its expensive passes compiles them about 1.5-2x faster
# (tests/test_train_step.py -k "dp8 or zero1": 82 s -> 42 s), and XLA:CPU's older loop
# emitters (not the MLIR fusion emitters) 2.4x faster again (the tiny GPT-J's train step on
# (2, 2, 2): 2.8 -> 1.2 CPU s, the same loss to the bit); every process a test starts gets the
# same flags (platforms.host_device_flags keeps them), so runs compared bit for bit agree. A
# flag of these the user set in XLA_FLAGS wins.
FAST_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
)
_user_flags = os.environ.get("XLA_FLAGS", "").split()
_user_names = {f.split("=")[0] for f in _user_flags}
_flags = [*_user_flags, *(f for f in FAST_COMPILE if f.split("=")[0] not in _user_names)]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The HF references run torch on one thread: a tiny model's forward takes ~3 ms so and ~0.8 s
# on two threads while the two cores are busy with JAX (OpenMP's barriers wait), which made
# HF `generate` of 30 tokens ~20 s of each family check. torch reads this at import.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No test reads the network (the package index at install aside): a name that is not a local
# directory fails at once instead of retrying the Hub. huggingface_hub reads these when first
# imported, so they are set here, before any test module imports it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from flaxlm.parallel import platforms  # noqa: E402 - no JAX; after JAX_PLATFORMS, so it keeps that

os.environ["XLA_FLAGS"] = platforms.host_device_flags(8, " ".join(_flags))

import jax  # noqa: E402
import pytest  # noqa: E402

# The end-to-end tests start `python -m flaxlm.main` over and over on the same tiny configs,
# each compiling the same programs: one compilation cache for the whole session (both test
# workers and every process they start), with its file locks on (a size limit), so that
# concurrent processes never read a half-written entry. The environment reaches the
# processes the tests start; pytest_configure points this process's JAX at it too.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="flaxlm-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
# The processes the tests start cache every program, as `flaxlm.main` does by default: the next
# start of the same config compiles nothing (~1.7 s of CPU a start of the tiny GPT-J run);
# the test processes themselves only programs over 0.2 s (thousands of tiny ones, most never
# compiled again).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
IN_PROCESS_MIN_COMPILE_SECS = 0.2
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(1 << 30))

# The environment is set: the processes the tests start fork from a Python that has imported
# TensorFlow, seqio and JAX in it (tests/zygote.py), where their environment is this one.
from tests import zygote  # noqa: E402, F401


def pytest_configure(config: pytest.Config) -> None:
    assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"
    # The in-process tests too: many build the same tiny train step again (new closures, so
    # jit's own cache misses, the same HLO): tests/test_train_step.py 74 s -> 58 s.
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", IN_PROCESS_MIN_COMPILE_SECS)
    jax.config.update(
        "jax_compilation_cache_max_size", int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"])
    )


@pytest.fixture(scope="session")
def repo_dir() -> str:
    return REPO


@pytest.fixture(scope="session")
def trained_gptj(tmp_path_factory, repo_dir) -> str:
    """A tiny GPT-J MODEL_DIR (byte vocabulary) after 8 steps of the default run; shared by
    the inference and serving tests, which only read it. Trained once per session: under
    pytest-xdist the workers share it through their common temp directory, the first to
    need it training while the others wait on the lock."""
    from filelock import FileLock

    from tests.test_main import run_main

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # every worker's basetemp sits in the session's one directory
    model_dir = os.path.join(str(root), "trained_gptj", "run")
    done = os.path.join(os.path.dirname(model_dir), "trained")
    with FileLock(os.path.join(str(root), "trained_gptj.lock")):
        if not os.path.exists(done):
            shutil.rmtree(os.path.dirname(model_dir), ignore_errors=True)
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
            open(done, "w").close()
    return model_dir


# The files that take longest, longest first (pytest --junitxml's times summed per file on
# the 2-core machine, 2026-11-27). pytest.ini runs whole files per worker (`--dist
# loadfile`) in collection order (`--no-loadscope-reorder`: xdist's default order, most
# tests first, put these few-test, many-second files last, where one worker ran them alone
# while the other idled); these go first, every other file after them as collected, so the
# short ones fill the tail.
LONGEST_FILES = (
    "test_multiprocess.py",
    "test_lora.py",
    "test_main.py",
    "test_reliability.py",
    "test_inference_runs.py",
    "test_benchmarks.py",
    "test_hf_t5.py",
    "test_context_parallel.py",
    "test_preference.py",
    "test_data.py",
    "test_decoding.py",
    "test_hf_moe.py",
    "test_hf_mistral4.py",
    "test_hf_glm4_moe_minimax_m2.py",
    "test_hf_llama4.py",
    "test_hf_gemma4.py",
    "test_hf_qwen3_next.py",
    "test_hf_kimi_linear.py",
    "test_hf_deepseek_v32.py",
    "test_recipes_hf.py",
    "test_hf_smollm3.py",
    "test_hf_olmo3.py",
    "test_hf_glm4_moe_lite_solar_open.py",
    "test_hf_mimo_v2_flash.py",
    "test_hf_olmo2_exaone4.py",
    "test_hf_cohere.py",
    "test_hf_qwen4_exp.py",
    "test_hf_exaone_moe_hunyuan.py",
    "test_stops.py",
    "test_hf_gemma23.py",
    "test_checkpoints.py",
    "test_harness.py",
    "test_plan.py",
    "test_hf_runs.py",
    "test_serve.py",
    "test_startup.py",
    "test_hf_phi3.py",
    "test_grpo.py",
    "test_grpo_lora.py",
    "test_moe.py",
    "test_training_features.py",
    "test_kimi_delta.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))
