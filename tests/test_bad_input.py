"""Each bad input of a run fails with a message naming the thing to fix (subprocesses).

Every row runs `python -m flaxlm.main` and checks: exit code 2, the culprit named in stderr,
no Python traceback, and no checkpoint written (or, for a MODEL_DIR that has one, none
changed). A malformed JSONL line belongs to the data tests (tasks/ and pipeline.py).
"""

import hashlib
import os
import subprocess
import sys

import pytest

from tests.test_main import run_main

PRETRAIN = [
    "--gin_file=gin/gptj_pretrain.gin",
    "--gin.TRAIN_STEPS=1",
    "--gin.TASK_FEATURE_LENGTHS={'targets': 64}",
    "--gin.BATCH_SIZE=8",
    "--gin.EVAL_PERIOD=0",
]
FINETUNE = [
    "--gin_file=models/gptj_tiny.gin",
    "--gin_file=partitioning/fsdp.gin",
    "--gin_file=runs/finetune.gin",
    "--gin.MIXTURE_OR_TASK_NAME='stdlib_py'",
    "--gin.TASK_FEATURE_LENGTHS={'targets': 64}",
    "--gin.BATCH_SIZE=8",
    "--gin.TRAIN_STEPS=1",
    "--gin.EVAL_PERIOD=0",
]
TEXT_FILES = [
    "--gin.MIXTURE_OR_TASK_NAME=@register_text_files_task()",
    "--gin.register_text_files_task.name='my_text'",
]

STRING_REWARDS = ["--gin.rl.GrpoConfig.reward_fns=['exact_match']"]
# Rows whose MODEL_DIR (and GRPO's SFT_DIR) must stay unwritten: no config.gin, no model
# record, no checkpoint.
NOTHING_WRITTEN = {"length_the_sequence_axis_does_not_divide", "reward_fns_that_are_strings"}

# id: (arguments, what stderr must contain). `{name}` is filled in from `paths` below.
ROWS = {
    "gin_file_that_does_not_exist": (
        ["--gin_file=gin/gptj_pretrian.gin"],
        ["gptj_pretrian.gin", "not found", "Did you mean ['gin/gptj_pretrain.gin'"],
    ),
    "required_macro_left_unset": (
        ["--gin_file=gin/models/llama_tiny.gin", "--gin_file=gin/runs/pretrain.gin"],
        ["MIXTURE_OR_TASK_NAME is required and not set: add --gin.MIXTURE_OR_TASK_NAME="],
    ),
    "misspelled_configurable": (
        [*PRETRAIN, "--gin.GPTJConfg.hidden_size=8"],
        ["No configurable matching 'GPTJConfg'", "Did you mean 'GPTJConfig'"],
    ),
    "misspelled_parameter": (
        [*PRETRAIN, "--gin.GPTJConfig.hiden_size=8"],
        ["parameter named 'hiden_size'", "Did you mean 'hidden_size'"],
    ),
    "mesh_that_does_not_divide_the_devices": (
        [*PRETRAIN, "--gin.Partitioner.mesh_shape=(3,-1,1)"],
        ["(3, -1, 1)", "8"],
    ),
    "batch_not_divisible_by_data_degree_times_microbatches": (
        [*PRETRAIN, "--gin.NUM_MICROBATCHES=3"],
        ["BATCH_SIZE=8", "data-parallel degree 8", "num_microbatches=3", "(= 24)"],
    ),
    "unregistered_task": (
        [*PRETRAIN, "--gin.MIXTURE_OR_TASK_NAME='stdlib_pyy'"],
        ["'stdlib_pyy'", "Did you mean ['stdlib_py'"],
    ),
    "missing_data_file": (
        [
            *PRETRAIN,
            *TEXT_FILES,
            "--gin.register_text_files_task.split_files={'train': '{missing}'}",
        ],
        ["'my_text'", "no files match", "{missing}"],
    ),
    "empty_data_file": (
        [*PRETRAIN, *TEXT_FILES, "--gin.register_text_files_task.split_files={'train': '{empty}'}"],
        ["'my_text'", "{empty}", "are empty"],
    ),
    "sequence_longer_than_the_model_positions": (
        [*PRETRAIN, "--gin.TASK_FEATURE_LENGTHS={'targets': 4096}"],
        ["targets=4096", "max_position_embeddings=2048"],
    ),
    "hf_directory_missing_files": (
        [*FINETUNE, "--gin.INIT_FROM_HF='{empty_hf}'"],
        ["INIT_FROM_HF='{empty_hf}'", "no config.json and no *.safetensors"],
    ),
    "hf_directory_that_does_not_exist": (
        [*FINETUNE, "--gin.INIT_FROM_HF='{missing}'"],
        ["INIT_FROM_HF='{missing}'", "no such directory"],
    ),
    "resumed_with_other_task_feature_lengths": (  # was a tf.data InvalidArgumentError
        [*PRETRAIN, "--gin.MODEL_DIR='{trained}'", "--gin.TASK_FEATURE_LENGTHS={'targets': 128}"],
        [
            "TASK_FEATURE_LENGTHS={'targets': 128}",
            "{trained}/checkpoints/8 was trained with {'targets': 64}",
        ],
    ),
    "length_the_sequence_axis_does_not_divide": (  # refused before config.gin is written
        [
            *PRETRAIN,
            "--gin_file=partitioning/fsdp_cp.gin",
            "--gin.Partitioner.mesh_shape=(1, -1, 4, 1)",
            "--gin.TASK_FEATURE_LENGTHS={'targets': 60}",
        ],
        ["TASK_FEATURE_LENGTHS", "length 60", "2 x sequence=4 = 8", "56 or 64"],
    ),
    "reward_fns_that_are_strings": (  # refused before the SFT stage trains
        ["--gin_file=gin/grpo.gin", "--gin.SFT_DIR='{sft}'", *STRING_REWARDS],
        ["GrpoConfig.reward_fns=['exact_match']", "write [@rewards.exact_match]"],
    ),
    "hf_directory_with_mismatched_tensors": (
        [*FINETUNE, "--gin.INIT_FROM_HF='{small_hf}'"],
        ["{small_hf}", "'transformer.wte.weight' has shape (384, 128)", "(384, 256)"],
    ),
    "model_dir_that_cannot_be_written": (
        [*PRETRAIN, "--gin.MODEL_DIR='{under_a_file}'"],
        ["MODEL_DIR '{under_a_file}' cannot be written"],
    ),
    "coordinator_address_without_a_port": (
        [*PRETRAIN, "--coordinator_address=127.0.0.1", "--process_count=2", "--process_index=0"],
        ["--coordinator_address='127.0.0.1'", "HOST:PORT"],
    ),
    "coordinator_port_not_a_number": (  # used to crash JAX with a segmentation fault
        [
            *PRETRAIN,
            "--coordinator_address=127.0.0.1:abc",
            "--process_count=2",
            "--process_index=0",
        ],
        ["'abc'", "a number from 1 to 65535"],
    ),
    "process_index_beyond_the_process_count": (
        [
            *PRETRAIN,
            "--coordinator_address=127.0.0.1:1234",
            "--process_count=2",
            "--process_index=5",
        ],
        ["--process_index=5", "between 0 and --process_count - 1 = 1"],
    ),
    "tasks_module_that_does_not_exist": (
        [*PRETRAIN, "--tasks_module=my_tasks"],
        ["--tasks_module='my_tasks'", "no such module"],
    ),
    "checkpoint_of_a_different_model": (
        [*PRETRAIN, "--gin.MODEL_DIR='{trained}'", "--gin.GPTJConfig.hidden_size=128"],
        [
            "{trained}/checkpoints/8 was written for a different model",
            "(256,) in the checkpoint, (128,) in this model",
        ],
    ),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory, repo_dir):
    root = tmp_path_factory.mktemp("bad_input")
    (root / "empty.txt").write_text("")
    (root / "a_file").write_text("not a directory")
    (root / "empty_hf").mkdir()
    import torch
    import transformers

    torch.manual_seed(0)
    small = transformers.GPTJConfig(
        vocab_size=384, n_positions=2048, n_embd=128, n_layer=4, n_head=4, rotary_dim=16
    )
    transformers.GPTJForCausalLM(small).save_pretrained(str(root / "small_hf"))
    return {
        "root": str(root),
        "missing": str(root / "no_such_file.txt"),
        "sft": str(root / "sft"),
        "empty": str(root / "empty.txt"),
        "under_a_file": str(root / "a_file" / "run"),
        "empty_hf": str(root / "empty_hf"),
        "small_hf": str(root / "small_hf"),
    }


def tree_digest(directory):
    digest = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(directory)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, directory).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


# Rows refused before TensorFlow (and the data and run modules) load: these run with
# TensorFlow unimportable, which would be a traceback had main reached it first.
BEFORE_TENSORFLOW = {
    "gin_file_that_does_not_exist",
    "coordinator_address_without_a_port",
    "coordinator_port_not_a_number",
    "process_index_beyond_the_process_count",
}
NO_TENSORFLOW = os.path.join(os.path.dirname(os.path.abspath(__file__)), "no_tensorflow")


@pytest.mark.slow
@pytest.mark.parametrize("row", list(ROWS))
def test_bad_input_fails_naming_the_culprit_without_writing_a_checkpoint(
    row, tmp_path, repo_dir, paths, request, monkeypatch
):
    assert BEFORE_TENSORFLOW <= set(ROWS)
    if row in BEFORE_TENSORFLOW:
        monkeypatch.setenv("PYTHONPATH", NO_TENSORFLOW)
    fill = dict(paths)
    if "{trained}" in " ".join(ROWS[row][0]):
        # The session's tiny GPT-J run (8 steps of PRETRAIN's model and lengths), read only:
        # the digest below proves these rows leave it as it was.
        fill["trained"] = request.getfixturevalue("trained_gptj")
    args = [_fill(a, fill) for a in ROWS[row][0]]
    expected = [_fill(e, fill) for e in ROWS[row][1]]
    model_dir = fill.get("trained") or str(tmp_path / "run")
    if not any(a.startswith("--gin.MODEL_DIR=") for a in args):
        args.append(f"--gin.MODEL_DIR='{model_dir}'")
    before = tree_digest(model_dir) if os.path.isdir(model_dir) else None

    result = run_main(args, cwd=repo_dir, devices=8)

    assert result.returncode == 2, result.stderr[-3000:]
    for text in expected:
        assert text in result.stderr, (text, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    if row in NOTHING_WRITTEN:
        assert not os.path.exists(model_dir) or os.listdir(model_dir) == []
        assert not os.path.exists(paths["sft"])
    if before is not None:
        assert tree_digest(model_dir) == before
    else:
        checkpoints = os.path.join(model_dir, "checkpoints")
        assert not os.path.isdir(checkpoints) or os.listdir(checkpoints) == []


def test_plan_for_no_cpu_devices_is_refused_before_jax(repo_dir, monkeypatch):
    """`--topology=cpu:0` was an XLA traceback; now an error line, before TensorFlow or JAX
    load (TensorFlow is unimportable here)."""
    monkeypatch.setenv("PYTHONPATH", NO_TENSORFLOW)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flaxlm.plan",
            "--gin_file=gin/gptj_pretrain.gin",
            "--topology=cpu:0",
        ],
        cwd=repo_dir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("error: --topology='cpu:0'"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def _fill(text, values):
    for key, value in values.items():
        text = text.replace(f"{{{key}}}", value)
    return text


# Numbers a user types on the command line, each refused by train() before any device work
# (in-process: what main turns into `error: ...`, exit 2, for every run).
BAD_NUMBERS = {
    "TRAIN_STEPS": dict(total_steps=-5),
    "TRAIN_STEPS=2.5": dict(total_steps=2.5),
    "BATCH_SIZE": dict(batch_size="sixteen"),
    "BATCH_SIZE=0": dict(batch_size=0),
    "CHECKPOINT_PERIOD": dict(checkpoint_period=0),
    "LOG_PERIOD": dict(log_period=0),
    "LEARNING_RATE": dict(learning_rate="1e-3"),
}


def test_bad_files_are_named_with_the_line_or_the_fix(tmp_path):
    """A JSONL file that is not UTF-8, a truncated safetensors file, a task module that is
    not there: each a ValueError naming the file (and line) or the setting."""
    import shutil

    import numpy as np
    from safetensors.numpy import save_file

    from flaxlm.checkpoints import hf_files
    from flaxlm.data import pipeline
    from flaxlm.data.jsonl_reader import read_jsonl

    jsonl = tmp_path / "data.jsonl"
    jsonl.write_bytes(b'{"in_text": "ok"}\n{"in_text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"{jsonl}:2: not UTF-8 \(byte 0xe9 at column 17\)"):
        list(read_jsonl(str(jsonl)))

    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    save_file({"w": np.ones((64, 64), np.float32)}, str(good / "model.safetensors"))
    shutil.copytree(good, bad)
    blob = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    assert hf_files.SafetensorsReader(str(good)).read("w").shape == (64, 64)
    with pytest.raises(ValueError, match=rf"{bad}/model.safetensors is not a readable"):
        hf_files.SafetensorsReader(str(bad))

    with pytest.raises(ValueError, match=r"MIXTURE_OR_TASK_MODULE='no_such_tasks': no such"):
        pipeline.import_task_module("no_such_tasks")


@pytest.mark.parametrize("name", sorted(BAD_NUMBERS))
def test_bad_numbers_are_named_before_any_work(name):
    from types import SimpleNamespace

    from flaxlm.runs import train
    from flaxlm.training import optimizers

    kwargs = dict(total_steps=10, batch_size=8, learning_rate=1e-3)
    kwargs.update(BAD_NUMBERS[name])
    dataset = SimpleNamespace(batch_size=kwargs.pop("batch_size"))
    macro = name.split("=")[0]
    with pytest.raises(ValueError, match=rf"^{macro}="):
        # Nothing is built before the numbers are checked: no model, mesh or data needed.
        train.train(model=None, partitioner=None, train_dataset_cfg=dataset, model_dir="", **kwargs)
    if macro == "LEARNING_RATE":  # as gin/runs/pretrain.gin binds it, through the schedule
        with pytest.raises(ValueError, match="LEARNING_RATE"):
            optimizers.create_schedule(peak_learning_rate="1e-3", total_steps=10)


def test_a_misspelled_macro_is_named_with_the_macro_meant(repo_dir):
    """`--gin.TRAIN_STEP=2` used to be accepted and ignored (the file's TRAIN_STEPS ran)."""
    import gin

    import flaxlm.runs.train  # noqa: F401  (the configurables the file binds)
    from flaxlm import gin_utils

    # Used by the file; used by another run's file (harmless); used by no file at all.
    bindings = ["TRAIN_STEPS = 2", "JSONL_VALIDATION = 'x.jsonl'", "SEQ_LENGHT = 8"]
    try:
        gin_utils.parse_gin(["gin/gptj_pretrain.gin"], bindings, [repo_dir], finalize=False)
        gin_utils.check_macros(bindings[:2])
        with pytest.raises(ValueError, match=r"--gin.SEQ_LENGHT sets a macro that nothing"):
            gin_utils.check_macros(bindings)
        gin.parse_config("TRAIN_STEP = 2")
        with pytest.raises(ValueError, match=r"TRAIN_STEP sets .* Did you mean 'TRAIN_STEPS'"):
            gin_utils.check_macros(["TRAIN_STEP = 2"])
    finally:
        gin.clear_config()
