"""`python -m flaxlm.main` end to end, as users run it (subprocesses)."""

import glob
import importlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import warnings

import gin
import pytest

from flaxlm import gin_utils
from flaxlm.data import library_start
from flaxlm.parallel import platforms
from tests import zygote

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMALL = [
    # The default run's model and data, shortened for CI (8 x 128 tokens a step: the loss
    # falls as far in 20 steps as at 16 x 128, ~1.15, for two thirds of the time).
    "--gin.TASK_FEATURE_LENGTHS={'targets': 128}",
    "--gin.BATCH_SIZE=8",
    "--gin.LOG_PERIOD=5",
    "--gin.EVAL_STEPS=2",
]

# Every line a training run prints (train.train and metrics.Progress.line): flaxlm's lines.
# The terminal of a default run holds these alone; anything else came from a library.
TRAIN_LINES = [
    re.compile(shape)
    for shape in (
        r"Initialised \w+ on Partitioner\(.*\)\.",
        r"Resumed from checkpoint step \d+ in \S+ on Partitioner\(.*\)\.",
        r"Reading the training data as \d+ logical input shards, .*",
        r"step \d+/\d+ \| loss [\d.]+ \| .* \| ETA [\d:]+",
        r"step \d+ \| eval loss [\d.]+ \| eval accuracy [\d.]+ \| eval perplexity .*",
        r"Done in [\d:]+\. Wrote to \S+:",
        r"  (checkpoints|config|metrics|tensorboard) +\S+.*",
    )
]


def not_flaxlm_lines(result):
    """What a run wrote that flaxlm did not: all of stderr (flaxlm writes there only to
    fail), and the stdout lines that are none of TRAIN_LINES."""
    stdout = result.stdout.splitlines()
    return result.stderr.splitlines() + [
        line for line in stdout if not any(shape.fullmatch(line) for shape in TRAIN_LINES)
    ]


def run_main(args, cwd, devices=1, timeout=600, user_env=False, extra_env=None):
    """`python -m flaxlm.main` with `devices` simulated CPU devices. `user_env`: with the
    environment a user has, not the tests' (no JAX_PLATFORMS=cpu, no TF_CPP_MIN_LOG_LEVEL), so
    that flaxlm's own defaults choose the platforms and the log levels."""
    env = {**os.environ, **(extra_env or {})}
    env["XLA_FLAGS"] = platforms.host_device_flags(devices)
    env["JAX_PLATFORMS"] = "cpu"
    if user_env:
        del env["JAX_PLATFORMS"]
        env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    # Forked from the tests' zygote (TensorFlow, seqio and JAX imported once) where the
    # environment allows; as a user runs it (`user_env`), a fresh process.
    return zygote.run(args, cwd, env, timeout=timeout)


def read_metrics(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_default_run_trains_with_falling_loss_then_resumes(tmp_path, repo_dir):
    model_dir = str(tmp_path / "run")
    args = [
        "--gin_file=gin/gptj_pretrain.gin",
        f"--gin.MODEL_DIR='{model_dir}'",
        "--gin.TRAIN_STEPS=20",
        "--gin.WARMUP_STEPS=5",
        "--gin.EVAL_PERIOD=20",
        "--gin.CHECKPOINT_PERIOD=20",
        *SMALL,
    ]
    # As a user runs it: the terminal shows flaxlm's lines only (no TensorFlow, CUDA, libtpu or
    # seqio start-up lines), on the platforms flaxlm chooses; and it leaves nothing in the
    # temporary directory (TensorFlow's autograph writes the functions it converts there).
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    first = run_main(args, cwd=repo_dir, user_env=True, extra_env={"TMPDIR": str(tmpdir)})
    assert first.returncode == 0, first.stderr[-3000:]
    assert not_flaxlm_lines(first) == [], first.stdout + first.stderr
    assert os.listdir(tmpdir) == []
    assert "step 20/20" in first.stdout and "tok/s" in first.stdout and "ETA" in first.stdout
    records = read_metrics(model_dir)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    for key in ("step", "loss", "learning_rate", "tokens_per_second"):
        assert key in train[0]
    assert train[0]["loss"] - train[-1]["loss"] > 1.0, [r["loss"] for r in train]
    assert any("eval/loss" in r for r in records)
    assert os.path.exists(os.path.join(model_dir, "config.gin"))
    assert "GPTJConfig" in open(os.path.join(model_dir, "config.gin")).read()
    assert any(
        f.startswith("events.out") for f in os.listdir(os.path.join(model_dir, "tensorboard"))
    )
    assert os.path.isdir(os.path.join(model_dir, "checkpoints", "20"))
    assert f"Wrote to {model_dir}" in first.stdout

    # The same run with more steps, started from another directory (the gin file found
    # through the search path) on 8 devices, as a four-axis mesh set by flags (data, sequence
    # = context parallelism and tensor parallelism at once): resumes from step 20 with the
    # data order it had, does not start over.
    # (No evaluation: it would compile an eval step and read eval data on the new mesh.)
    more = [a.replace("TRAIN_STEPS=20", "TRAIN_STEPS=25") for a in args[1:]]
    more = [a.replace("EVAL_PERIOD=20", "EVAL_PERIOD=0") for a in more]
    mesh = [
        "--gin.Partitioner.mesh_axis_names=('data','fsdp','sequence','tensor')",
        "--gin.Partitioner.mesh_shape=(2,1,2,2)",
    ]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    second = run_main(
        ["--gin_file=gptj_pretrain.gin", *more, *mesh], str(elsewhere), devices=8, user_env=True
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert not_flaxlm_lines(second) == [], second.stdout + second.stderr
    assert "Resumed from checkpoint step 20" in second.stdout
    assert "data=2, fsdp=1, sequence=2, tensor=2" in second.stdout
    steps = [r["step"] for r in read_metrics(model_dir) if "loss" in r]
    assert steps[-2:] == [20, 25] and steps.count(5) == 1
    assert os.path.isdir(os.path.join(model_dir, "checkpoints", "25"))


@pytest.mark.slow
def test_moe_pretrains_with_expert_parallelism_keeps_its_experts_loaded_and_logs_them(
    tmp_path, repo_dir
):
    # The command on 4 devices, all on the `expert` axis (2 of the 8 experts each),
    # 8 x 128 bytes for 40 steps (warm-up 5, so that most of it runs at the full learning
    # rate): it trains, its loss falls, every log period writes the router's telemetry, and
    # the tiny file's per-layer load-balancing loss keeps every layer's experts loaded. With
    # HF's pooled loss (0.001) every logged step has a layer at 3.6-4 (E/k = 4: all its
    # tokens on 2 experts) and an expert no token reaches; with the per-layer loss the
    # routers catch up by step ~30, the worst layer's busiest expert at 1.4-1.95x its fair
    # share over steps 31-40 and every expert at >= 0.2x (docs/configuring.md).
    model_dir = str(tmp_path / "moe")
    result = run_main(
        [
            "--gin_file=gin/models/qwen3_moe_tiny.gin",
            "--gin_file=gin/runs/pretrain.gin",
            "--gin_file=gin/partitioning/fsdp_ep.gin",
            f"--gin.MODEL_DIR='{model_dir}'",
            "--gin.MIXTURE_OR_TASK_NAME='stdlib_py'",
            "--gin.TRAIN_STEPS=40",
            "--gin.WARMUP_STEPS=5",
            "--gin.EVAL_PERIOD=40",
            "--gin.CHECKPOINT_PERIOD=40",
            *SMALL,
        ],
        cwd=repo_dir,
        devices=4,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data=1, fsdp=1, expert=4, tensor=1" in result.stdout
    records = read_metrics(model_dir)
    train = {r["step"]: r for r in records if "loss" in r}
    assert list(train) == list(range(5, 41, 5))
    assert train[5]["loss"] - train[40]["loss"] > 1.0, [r["loss"] for r in train.values()]
    layers, experts, k = 4, 8, 2  # qwen3_moe_tiny.gin: every layer a mixture of experts
    for r in train.values():
        loads = [r[f"moe_max_load_{i}"] for i in range(layers)]
        assert all(1.0 <= x <= experts / k for x in loads), loads  # balanced .. E/k
        assert r["moe_max_load"] == max(loads) and 0.0 <= r["moe_min_load"] <= 1.0
        assert r["moe_aux_loss"] > 0.0
        assert r["moe_dropped_fraction"] == 0.0  # dropless
    # After the routers' catch-up, every layer's busiest expert well below the collapsed E/k
    # (pooled: 3.6-4 from step 20 on; per-layer: 1.4-2.05 at steps 31-40 on 1 or 4 devices,
    # whose numbers differ in the last bits and so take other paths) and no expert idle.
    balance = {s: (train[s]["moe_max_load"], train[s]["moe_min_load"]) for s in (35, 40)}
    for step, (busiest, idlest) in balance.items():
        assert busiest <= 0.625 * experts / k and idlest > 0.0, (step, balance)
    assert any("eval/moe_aux_loss" in r for r in records)


@pytest.mark.parametrize(
    "name", sorted(os.path.basename(f) for f in glob.glob(os.path.join(REPO, "gin", "*.gin")))
)
def test_every_ready_to_run_file_parses(name):
    """Each top-level gin file parses whole (includes, imports, macros); running is the
    end-to-end tests' business."""
    gin.clear_config()
    try:
        gin_utils.parse_gin([name], finalize=False)
        assert gin.query_parameter("gin_utils.run.fn") is not None
    finally:
        gin.clear_config()


def test_a_gin_file_importing_a_moved_module_is_told_its_new_path(tmp_path):
    """A user's own gin file from before the house in folders fails naming the new import,
    not with a bare ImportError; the run names users type still resolve."""
    old = tmp_path / "old.gin"
    old.write_text(
        "from __gin__ import dynamic_registration\nfrom flaxlm import partitioning\n"
        "partitioning.Partitioner.mesh_shape = (1, -1, 1)\n"
    )
    gin.clear_config()
    try:
        with pytest.raises(ImportError, match=r"flaxlm\.partitioning moved to flaxlm\.parallel"):
            gin_utils.parse_gin([str(old)], finalize=False)
        gin.clear_config()
        importlib.import_module("flaxlm.runs.infer")  # registers infer.infer, infer.score
        bindings = ["evaluation.evaluate.output_dir = 'x'", "infer.score.output_dir = 'y'"]
        gin_utils.parse_gin(["runs/eval.gin"], bindings, finalize=False)
    finally:
        gin.clear_config()


def test_gin_dot_flags_become_bindings():
    argv = ["prog", "--gin.TRAIN_STEPS=5", "--gin_file=x.gin", "--gin.A.b='c=d'"]
    assert gin_utils.rewrite_gin_args(argv) == [
        "prog",
        "--gin_bindings=TRAIN_STEPS = 5",
        "--gin_file=x.gin",
        "--gin_bindings=A.b = 'c=d'",
    ]


def test_quiet_logs_hide_native_start_up_lines_not_flaxlm_errors(capfd):
    with library_start.native_stderr_hidden():
        os.write(2, b"I0000 00:00:1.0 port.cc:153] a library's start-up line\n")
        print("error: flaxlm's own line", file=sys.stderr)
    assert capfd.readouterr().err == "error: flaxlm's own line\n"
    # A start-up that fails shows what was hidden: it may say why.
    with pytest.raises(RuntimeError), library_start.native_stderr_hidden():
        os.write(2, b"F0000 why it failed\n")
        raise RuntimeError("start-up failed")
    assert "F0000 why it failed" in capfd.readouterr().err
    with library_start.native_stderr_hidden(enabled=False):  # --verbosity: nothing hidden
        os.write(2, b"I0000 shown\n")
    assert capfd.readouterr().err == "I0000 shown\n"


def test_verbosity_flag_keeps_library_logs_that_quiet_hides(monkeypatch, caplog):
    from absl import logging as absl_logging

    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    verbosity = absl_logging.get_verbosity()
    try:
        absl_logging.set_verbosity(absl_logging.INFO)
        library_start.configure(quiet=False)  # main with --verbosity=0: absl's level stands
        assert absl_logging.get_verbosity() == absl_logging.INFO
        assert "TF_CPP_MIN_LOG_LEVEL" not in os.environ
        library_start.configure(quiet=True)  # main without --verbosity
        assert absl_logging.get_verbosity() == absl_logging.ERROR
        assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"
        # A library's `warnings.warn` becomes a WARNING record, below the level shown.
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a library's warning", UserWarning, stacklevel=1)
        (record,) = [r for r in caplog.records if r.name == "py.warnings"]
        assert record.levelno == logging.WARNING and "a library's warning" in record.message
    finally:
        absl_logging.set_verbosity(verbosity)
        logging.captureWarnings(False)


@pytest.mark.skipif(platforms.tpu_attached(), reason="this host has a TPU")
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_library_use_without_a_tpu_does_not_start_libtpu(repo_dir):
    """Importing flaxlm picks the platforms: without a TPU attached, JAX never loads libtpu
    (which would log TPU start-up errors and hold /tmp/libtpu_lockfile)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = (
        "import os, flaxlm.parallel.partitioning, jax; "
        "print(os.environ['JAX_PLATFORMS'], jax.devices()[0].platform)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=repo_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    platforms_set, platform = result.stdout.split()
    assert platforms_set.split(",")[-1] == "cpu" and "tpu" not in platforms_set
    assert platform != "tpu" and "TPU" not in result.stderr, result.stderr
    # A JAX_PLATFORMS the user set wins, even '' (JAX's own choice).
    env["JAX_PLATFORMS"] = ""
    code = "import os, flaxlm; print(repr(os.environ['JAX_PLATFORMS']))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=repo_dir, env=env, capture_output=True, text=True
    )
    assert result.stdout.strip() == "''", result.stderr
