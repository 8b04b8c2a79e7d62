"""Start-up: the persistent compilation cache, `--profile_startup`, `--help`, and what a run
imports (inference loads neither TensorFlow nor seqio; a run its Gin files' modules)."""

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import gin
import pytest

from flaxlm import gin_utils, main
from flaxlm.data import library_start, vocabularies
from flaxlm.data.config import DatasetConfig
from flaxlm.parallel import platforms
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
            user_env=True,  # a fresh process, as a user starts it (not the tests' zygote)
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    first = run("first")
    assert "Start-up profile" in first.stdout and "first step" in first.stdout
    # The run's own process never loaded TensorFlow (its input process did): the profile
    # times every first import of it there.
    assert "import jax" in first.stdout and "import tensorflow" not in first.stdout
    total, hits, compiled = programs(first)
    assert compiled == total > 0 and hits == 0
    # The train step compiled once: ahead of the first step (from the batch's shapes, while
    # the input pipeline was built), which then found it.
    listed = re.search(r"programs: (.*)", first.stdout).group(1).split(", ")
    assert listed.count("jit(train_step)") == 1, listed
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


def test_help_takes_under_a_second_and_imports_no_jax_or_tensorflow(repo_dir):
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "flaxlm.main", "--help"],
        cwd=repo_dir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--compilation_cache_dir" in result.stdout  # (absl's --help exits 1)
    # Nothing heavy is imported before the flags are parsed; 3 s leaves room for a loaded
    # test machine (it takes ~0.2 s alone).
    assert time.perf_counter() - start < 3.0
    imported = {line.rpartition("|")[2].strip() for line in result.stderr.splitlines()}
    assert "flaxlm.gin_utils" in imported  # (flaxlm.main runs as __main__)
    assert not imported & {"jax", "tensorflow", "seqio", "transformers", "torch"}


def test_hidden_modules_fail_to_import_inside_the_block_and_import_after_it(tmp_path, monkeypatch):
    (tmp_path / "flaxlm_probe_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with library_start.modules_hidden(("flaxlm_probe_module",)):
        with pytest.raises(ImportError):
            import flaxlm_probe_module  # noqa: F401
    import flaxlm_probe_module

    assert flaxlm_probe_module.VALUE == 1
    monkeypatch.delitem(sys.modules, "flaxlm_probe_module")


def test_iterators_check_their_task_at_once_and_are_built_at_first_use_or_on_a_thread(
    monkeypatch,
):
    """The eval data is built at its first use (`DeferredDataIterator`), the training data on
    a thread from the start (`BackgroundDataIterator`: its first use waits, and raises what
    building raised); a misnamed task fails both at once."""
    import threading

    from flaxlm.data import deferred, pipeline

    def config(name):
        return DatasetConfig(
            mixture_or_task_name=name, task_feature_lengths={"targets": 8}, batch_size=1
        )

    for cls in (deferred.DeferredDataIterator, deferred.BackgroundDataIterator):
        with pytest.raises(ValueError, match="No seqio task or mixture named 'no_such_task'"):
            cls(config("no_such_task"), partitioner=None)
    built = []
    go = threading.Event()

    def create(*args):
        built.append(threading.current_thread().name)
        go.wait(60)
        if len(built) > 2:
            raise RuntimeError("the third build fails")
        return argparse.Namespace(num_shards=len(built))

    monkeypatch.setattr(pipeline.DataIterator, "create", create)
    import tasks  # noqa: F401  (registers stdlib_py)

    later = deferred.DeferredDataIterator(config("stdlib_py"), partitioner=None)
    assert not built
    go.set()
    assert later.iterator is later.iterator and built == [threading.current_thread().name]
    go.clear()
    beside = deferred.BackgroundDataIterator(config("stdlib_py"), partitioner=None)
    deadline = time.monotonic() + 60
    while len(built) < 2 and time.monotonic() < deadline:  # building on another thread
        time.sleep(0.01)
    assert built[1] != threading.current_thread().name
    go.set()
    assert beside.num_shards == 2 and beside.iterator is beside.iterator
    failing = deferred.BackgroundDataIterator(config("stdlib_py"), partitioner=None)
    failing.wait()  # (waits without raising)
    with pytest.raises(RuntimeError, match="the third build fails"):
        next(failing)


# ------------------------------------------------------------------ what a run imports

# Runs `flaxlm.main` with the arguments given, after importing serve's modules too, and
# prints at exit which of the input pipeline's libraries the process loaded.
LOADED_AT_EXIT = textwrap.dedent(
    """
    import os, sys
    PIPELINE = ("tensorflow", "seqio", "sklearn")
    leave = os._exit  # how a finished run exits (no atexit handlers run)
    def report_then_leave(code):
        print("loaded:", [m for m in PIPELINE if m in sys.modules], flush=True)
        leave(code)
    os._exit = report_then_leave
    import flaxlm.runs.serve
    from flaxlm import main
    main.console_main()
    """
)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny HF directory (Qwen2, 2 x 32) with its own byte-level BPE tokenizer, written by
    flaxlm from random params (no torch)."""
    import jax
    import numpy as np

    from flaxlm.checkpoints import hf
    from tests.hf_helpers import save_byte_bpe_tokenizer

    path = tmp_path_factory.mktemp("hf_qwen")
    length = save_byte_bpe_tokenizer(path, style="qwen")
    spec, config = hf.config_from_hf_dict(
        {
            "model_type": "qwen2",
            "vocab_size": length,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "bos_token_id": None,
            "eos_token_id": length - 3,
            "tie_word_embeddings": True,
        }
    )
    model = spec.model_cls(config, eos_id=length - 3)
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), model.example_batch_shapes())
    )
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (0.05 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)
    hf.save_pretrained(model, params, path)
    return str(path)


@pytest.mark.slow
def test_infer_and_score_of_an_hf_checkpoint_import_neither_tensorflow_nor_seqio(
    hf_checkpoint, tmp_path, repo_dir
):
    """The promise of the start-up work: inference reads text and writes text with the
    checkpoint's tokenizer, and nothing of the training input pipeline loads (serve's
    modules imported beside, so they are held to it too)."""
    (tmp_path / "prompts.txt").write_text("def main(\n")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"in_text": "def", "out_text": " main"}) + "\n")
    out = tmp_path / "out"
    env = dict(os.environ)
    env["XLA_FLAGS"] = platforms.host_device_flags(1)
    env["PYTHONPATH"] = os.pathsep.join([repo_dir, env.get("PYTHONPATH", "")])
    args = [
        "--gin_file=runs/infer.gin",
        "--gin_file=runs/score.gin",  # one process runs both (run_in_order)
        "--gin.gin_utils.run.fn=@gin_utils.run_in_order",
        "--gin.run_in_order.fns=[@infer.infer, @infer.score]",
        f"--gin.CHECKPOINT='{hf_checkpoint}'",
        f"--gin.INFER_SOURCE='{tmp_path / 'prompts.txt'}'",
        f"--gin.SCORE_SOURCE='{pairs}'",
        f"--gin.OUTPUT_DIR='{out}'",
        "--gin.MAX_NEW_TOKENS=4",
    ]
    result = subprocess.run(
        [sys.executable, "-c", LOADED_AT_EXIT, *gin_utils.rewrite_gin_args(["", *args])[1:]],
        cwd=repo_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded: []" in result.stdout, result.stdout[-2000:]
    (generated,) = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    (scored,) = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert generated["input"] == "def main(" and isinstance(generated["output"], str)
    assert scored["num_tokens"] > 0 and scored["score"] < 0.0


def test_byte_vocabulary_reads_and_writes_as_seqios():
    """Inference's default vocabulary (a checkpoint without a tokenizer) gives seqio's
    ByteVocabulary's ids and texts without seqio: multi-byte UTF-8, invalid bytes, EOS, ids
    past the vocabulary and extra ids included."""
    import seqio

    ours, theirs = vocabularies.ByteVocabulary(), seqio.ByteVocabulary()
    for text in ["def main():\n", "caf\u00e9 \u2603 \U0001f600", ""]:
        assert list(ours.encode(text)) == list(theirs.encode(text))
    rows = [
        [103, 104, 1, 105],  # EOS ends the text
        [0, 2, 3, 258, 259, 400],  # padding, UNK, bytes 0 and 255, past the vocabulary
        [0xC3 + 3, 3 + 0x28, 3 + 0x41],  # an invalid UTF-8 sequence is dropped
        list(theirs.encode("\u2603"))[:2],  # a cut multi-byte character too
    ]
    for ids in rows:
        assert ours.decode(ids) == theirs.decode(ids), ids
    assert (ours.pad_id, ours.eos_id, ours.unk_id) == (theirs.pad_id, theirs.eos_id, 2)
    assert ours.vocab_size == theirs.vocab_size == 259
    extra = vocabularies.ByteVocabulary(extra_ids=5)
    assert extra.vocab_size == seqio.ByteVocabulary(extra_ids=5).vocab_size
    assert isinstance(ours, seqio.Vocabulary)  # (registered by flaxlm.data.pipeline)


def test_tensorflow_loads_without_the_modules_hidden_while_it_loads(tmp_path, monkeypatch):
    """main hides scikit-learn, pandas and scipy while TensorFlow loads (keras imports them
    for nothing flaxlm uses), whoever imports TensorFlow, and only then."""
    (tmp_path / "flaxlm_probe_hidden.py").write_text("")
    (tmp_path / "flaxlm_probe_loading.py").write_text(
        "try:\n    import flaxlm_probe_hidden\n    SAW = True\nexcept ImportError:\n"
        "    SAW = False\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    hook = library_start.HiddenWhileLoading("flaxlm_probe_loading", ("flaxlm_probe_hidden",))
    hook.install()
    try:
        loading = importlib.import_module("flaxlm_probe_loading")
        importlib.import_module("flaxlm_probe_hidden")  # (importable once that import is over)
    finally:
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)
        for name in ("flaxlm_probe_loading", "flaxlm_probe_hidden"):
            sys.modules.pop(name, None)
    assert loading.SAW is False and hook not in sys.meta_path


def test_an_unregistered_name_imports_the_registering_modules_and_parses_again(
    tmp_path, monkeypatch
):
    """A Gin file without imports names a configurable of a module nothing imported yet:
    `parse_gin` imports the registering modules and parses it; a name no module registers
    is still Gin's error."""
    (tmp_path / "flaxlm_probe_configurable.py").write_text(
        "import gin\n\n\n@gin.configurable\ndef probe_run(size=1):\n    return size\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "old_style.gin"
    config.write_text("probe_run.size = 3\n")
    gin.clear_config()
    try:
        gin_utils.parse_gin([str(config)], finalize=False, registering_modules=["math"])
    except ValueError as e:
        assert "No configurable matching 'probe_run'" in str(e)
    else:
        raise AssertionError("an unknown configurable parsed")
    try:
        gin.clear_config()
        gin_utils.parse_gin(
            [str(config)], finalize=False, registering_modules=["flaxlm_probe_configurable"]
        )
        assert gin.query_parameter("probe_run.size") == 3
    finally:
        gin.clear_config()
        sys.modules.pop("flaxlm_probe_configurable", None)


def test_a_task_name_not_yet_registered_imports_the_built_in_tasks(tmp_path, monkeypatch):
    """The built-in tasks register when a run first looks a task up, not at start-up."""
    from flaxlm.data import pipeline

    (tmp_path / "flaxlm_probe_tasks.py").write_text(
        "import seqio\n\nseqio.MixtureRegistry.add('flaxlm_probe_mixture', [('stdlib_py', 1.0)])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import tasks  # noqa: F401  (stdlib_py, which the probe's mixture reads)

    monkeypatch.setattr(pipeline, "BUILTIN_TASKS_MODULE", "flaxlm_probe_tasks")
    try:
        pipeline.check_registered("flaxlm_probe_mixture")
        with pytest.raises(ValueError, match="No seqio task or mixture named 'no_such_task'"):
            pipeline.check_registered("no_such_task")
    finally:
        import seqio

        seqio.MixtureRegistry.remove("flaxlm_probe_mixture")
        sys.modules.pop("flaxlm_probe_tasks", None)
