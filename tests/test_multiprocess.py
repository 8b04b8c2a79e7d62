"""Several processes on one machine joined by jax.distributed (gloo collectives)."""

import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest

from flaxlm.parallel import platforms
from tests import zygote
from tests.helpers import float32_atol
from tests.test_main import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(args, cwd, env, stdout, stderr):
    """`python *args` (`-m module ...` or `script.py ...`), forked from the tests' zygote
    where it can be (see tests/zygote.py)."""
    module, rest = (args[1], args[2:]) if args[0] == "-m" else (args[0], args[1:])
    return zygote.start(rest, cwd, env, module=module, stdout=stdout, stderr=stderr)


def launch(args_for, num_processes, devices_per_process, cwd, timeout=300, grace=120):
    """Runs the processes to completion; once one fails, the rest get `grace` seconds."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = platforms.host_device_flags(devices_per_process)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    address = f"127.0.0.1:{free_port()}"
    logs = [tempfile.TemporaryFile("w+") for _ in range(2 * num_processes)]
    procs = [
        start_process(args_for(address, i), cwd, env, logs[2 * i], logs[2 * i + 1])
        for i in range(num_processes)
    ]
    start = time.monotonic()
    deadline = start + timeout
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            break
        time.sleep(0.5)
    results = []
    for i, p in enumerate(procs):
        p.wait()
        out, err = logs[2 * i], logs[2 * i + 1]
        out.seek(0)
        err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return results


def joined(args: list[str], processes: int = 2) -> Callable[[str, int], list[str]]:
    """`launch`'s `args_for`: `args` on each of `processes` processes joined by
    jax.distributed (the coordinator's address, the count and the process's index added;
    nothing for one process)."""

    def args_for(address: str, index: int) -> list[str]:
        if processes == 1:
            return list(args)
        return [
            *args,
            f"--coordinator_address={address}",
            f"--process_count={processes}",
            f"--process_index={index}",
        ]

    return args_for


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """tests/multiprocess_worker.py on two processes of 4 devices: each one's `RESULT` line,
    the directory where process 0 saved its results on meshes spanning both, and the same
    computations on this process's 8 devices, run while the worker runs (which spends much
    of its time importing and waiting on its collectives)."""
    from tests import multiprocess_cases
    from tests.test_moe import fsdp_ep_loss_and_grads

    cwd = tmp_path_factory.mktemp("worker")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            launch,
            lambda addr, i: [os.path.join(HERE, "multiprocess_worker.py"), addr, "2", str(i)],
            num_processes=2,
            devices_per_process=4,
            cwd=str(cwd),
        )
        one_process = {
            "moe": fsdp_ep_loss_and_grads(),
            "grpo": multiprocess_cases.grpo_lora_steps(),
            "balance": multiprocess_cases.aux_free_balance_steps(),
        }
        results = running.result()
    out = []
    for code, stdout, stderr in results:
        assert code == 0, stderr[-3000:]
        line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
        out.append(json.loads(line[len("RESULT ") :]))
    return out, cwd, one_process


@pytest.mark.slow
def test_hosts_holding_the_same_batch_rows_read_the_same_shard(worker):
    layouts = [result["layouts"] for result in worker[0]]
    # (1, 1, 8, 1): ('data', 'fsdp', 'expert', 'tensor'), the batch split over `expert`.
    for shape in ["(2, 4, 1)", "(1, 8, 1)", "(1, 4, 2)", "(1, 1, 8, 1)"]:
        # The batch is split across the hosts: each reads half, a shard of its own.
        assert [lay[shape]["shard"] for lay in layouts] == [0, 1]
        assert all(lay[shape]["num_shards"] == 2 and lay[shape]["per_host"] == 8 for lay in layouts)
        assert layouts[0][shape]["sum"] == 8 * 4 * 1  # rows of shard 1 are ones
    # Pure tensor parallelism across both hosts: one replica, both hosts read the same shard.
    assert all(
        lay["(1, 1, 8)"] == {"per_host": 16, "shard": 0, "num_shards": 1, "sum": 0}
        for lay in layouts
    )


@pytest.mark.slow
def test_experts_split_across_two_processes_give_the_one_process_loss_and_gradients(worker):
    """gin/partitioning/fsdp_ep.gin on two processes of 4 devices: the `expert` axis (one of
    the 8 experts a device) spans both, so tokens reach the other process's experts and come
    back through the cross-process collectives (gloo), each host feeding its half of the
    rows. The loss, router statistics and gradients of the same mesh in one process.

    The same program on the same mesh; only the collectives' sums may add in another order:
    a sum of 8 float32 terms rounds within ~8 eps (1e-6) of its size, and a gradient entry
    near zero within that of the largest terms it sums (atol at 1e-6 of the largest)."""
    saved = np.load(worker[1] / "moe.npz")
    (loss, sums), grads = worker[2]["moe"]
    np.testing.assert_allclose(saved["loss"], loss, rtol=1e-6)
    for name, value in sums.items():
        np.testing.assert_allclose(saved[f"sums/{name}"], value, rtol=1e-6, err_msg=name)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert len(leaves) == len([k for k in saved.files if k.startswith("grad")])
    for path, g in leaves:
        got = saved[f"grad{jax.tree_util.keystr(path)}"]
        atol = 1e-6 * np.abs(g).max()
        np.testing.assert_allclose(got, g, rtol=1e-6, atol=atol, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_grpo_with_lora_on_two_processes_gives_the_one_process_rollouts_and_losses(worker):
    """Issue 48: GRPO with LoRA, its rollouts through the paged engine, on fsdp 8 spanning
    two processes (the base, the adapters and the engine's cache split over both, what the
    host reads back replicated on each): two steps of two passes each give one process's
    8 devices' sampled tokens exactly, and its rewards, log-probs, losses and KL.

    The same programs on the same mesh: only the cross-process sums (the gradients'
    reductions) may add in another order, so the first pass agreed exactly here (not
    asserted: another build may order the forward's sums otherwise too) and the rest
    within float32 rounding of the values summed, eps x depth (one layer's rounding
    stages: embed, norm, attention, MLP, head, log-softmax: ~10) times their size: the
    log-probs' (~7); for the loss and KL the per-token terms' (an advantage, |a| <=
    sqrt(GROUP - 1), times a ratio near 1; a k3 KL of a few nats: ~3), not the means'
    (~0.05, the advantages cancelling); the gradient norm's own."""
    from tests.multiprocess_cases import GRPO_GROUP

    saved = np.load(worker[1] / "grpo.npz")
    want = worker[2]["grpo"]
    assert (want["kl"][-1] > 0).all()  # step 2 sampled with adapters that moved the policy
    np.testing.assert_array_equal(saved["tokens"], want["tokens"])
    np.testing.assert_array_equal(saved["reward"], want["reward"])  # of the same texts
    depth = 10
    atol = float32_atol(want["sampled_logps"], depth)
    np.testing.assert_allclose(saved["sampled_logps"], want["sampled_logps"], rtol=0, atol=atol)
    terms = np.sqrt(GRPO_GROUP - 1) * 1.5  # ~3: an advantage times a ratio, or a k3 KL
    for name in ("loss", "kl"):
        atol = float32_atol(np.float32(terms), depth)
        np.testing.assert_allclose(saved[name], want[name], rtol=0, atol=atol, err_msg=name)
    atol = float32_atol(want["grad_norm"], depth)
    np.testing.assert_allclose(saved["grad_norm"], want["grad_norm"], rtol=0, atol=atol)


@pytest.mark.slow
def test_aux_free_balance_on_two_processes_gives_the_one_process_biases(worker):
    """Issue 46: DeepSeek-V3's correction biases after two train steps on (1, 2, 4, 1) (the
    batch over both processes, the `expert` axis within each), moved by the expert loads
    of the global batch: exactly one process's, as the bias moves by a sign of integer
    counts, which any order of summing gives alike. The loss (~4) within float32 rounding
    of its size: eps x depth (~10 rounding stages of a layer, its router and the loss)."""
    saved = np.load(worker[1] / "balance.npz")
    want = worker[2]["balance"]
    assert (want["biases"] != 0).any()  # the loads were uneven: something moved
    np.testing.assert_array_equal(saved["biases"], want["biases"])
    atol = float32_atol(want["loss"], 10)
    np.testing.assert_allclose(saved["loss"], want["loss"], rtol=0, atol=atol)


@pytest.mark.slow
def test_two_process_dpo_run_gives_the_one_process_losses(tmp_path, repo_dir):
    """gin/dpo.gin (pairs, a frozen reference sharded like the policy) on two processes
    joined by jax.distributed: the per-step losses (1e-6) of one process whose reference
    log-probs were precomputed in a pass before training (no reference params held), and a
    checkpoint with each logical input shard's iterator saved once, whichever process reads
    it."""
    args = [
        "-m",
        "flaxlm.main",
        "--gin_file=gin/dpo.gin",
        "--gin.TRAIN_STEPS=4",
        "--gin.LOG_PERIOD=1",
        "--gin.EVAL_PERIOD=4",
        "--gin.EVAL_STEPS=1",
        "--gin.CHECKPOINT_PERIOD=4",
        "--gin.BATCH_SIZE=8",
        "--gin.MAX_LENGTH=32",
        "--gin.Partitioner.mesh_shape=(2, -1, 1)",
    ]
    # Both runs at once: the two-process run waits on its collectives, the other fills in.
    with ThreadPoolExecutor(2) as pool:
        two_processes = pool.submit(
            launch,
            joined([*args, f"--gin.MODEL_DIR='{tmp_path / 'two'}'"]),
            num_processes=2,
            devices_per_process=4,
            cwd=repo_dir,
        )
        one_process = pool.submit(
            launch,
            lambda addr, i: [
                *args,
                f"--gin.MODEL_DIR='{tmp_path / 'one'}'",
                "--gin.PreferenceConfig.precompute_reference=True",
            ],
            num_processes=1,
            devices_per_process=8,
            cwd=repo_dir,
        )
        results = two_processes.result()
        ((code, out, err),) = one_process.result()
    assert code == 0, err[-3000:]
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    assert "data=2, fsdp=4" in results[0][1] and "data=2, fsdp=4" in out
    assert "Reference log-probs of 4 training and 1 evaluation batches precomputed" in out
    two, one = read_metrics(str(tmp_path / "two")), read_metrics(str(tmp_path / "one"))
    names = ("loss", "rewards/margins", "logps/chosen", "eval/rewards/accuracies")
    for name in names:
        a = [r[name] for r in two if name in r]
        b = [r[name] for r in one if name in r]
        assert len(a) == len(b) == (1 if name.startswith("eval/") else 4), name
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=name)
    files = os.listdir(os.path.join(tmp_path / "two", "checkpoints", "4", "dataset"))
    assert {f.split(".")[0] for f in files if f.startswith("shard_")} == {
        f"shard_{r}-of-8"
        for r in range(8)  # the data-parallel degree: data 2 x fsdp 4
    }


@pytest.mark.slow
def test_two_processes_reading_through_input_processes_give_the_one_process_losses(
    tmp_path, repo_dir
):
    """The default pre-training run on two processes joined by jax.distributed, each reading
    its rows through an input process of its own (data/input_process.py; forced on, as the
    zygote's processes have TensorFlow loaded): the per-step losses of one 8-device process
    reading in-process, and each logical shard's position saved once between the two
    children. (A resume through an input process reads what an in-process run wrote, and the
    other way round: tests/test_input_process.py; resumes onto other process counts:
    test_two_processes_read_their_rows_of_the_one_process_batches.)"""
    args = [
        "-m",
        "flaxlm.main",
        "--gin_file=gin/gptj_pretrain.gin",
        "--gin.BATCH_SIZE=8",
        "--gin.TASK_FEATURE_LENGTHS={'targets': 64}",
        "--gin.LOG_PERIOD=1",
        "--gin.EVAL_PERIOD=0",
        "--gin.CHECKPOINT_PERIOD=4",
        "--gin.TRAIN_STEPS=4",
        "--gin.Partitioner.mesh_shape=(2, -1, 1)",
    ]
    # Both runs at once: the two-process run waits on its collectives, the other fills in.
    with ThreadPoolExecutor(1) as pool:
        one_process = pool.submit(
            launch,
            lambda addr, i: [*args, f"--gin.MODEL_DIR='{tmp_path / 'one'}'"],
            num_processes=1,
            devices_per_process=8,
            cwd=repo_dir,
        )
        two = launch(
            joined(
                [*args, f"--gin.MODEL_DIR='{tmp_path / 'two'}'", "--gin.train.input_process=True"]
            ),
            num_processes=2,
            devices_per_process=4,
            cwd=repo_dir,
        )
        ((code, _, err),) = one_process.result()
    assert code == 0, err[-3000:]
    for code, _, stderr in two:
        assert code == 0, stderr[-3000:]
    files = os.listdir(os.path.join(tmp_path / "two", "checkpoints", "4", "dataset"))
    assert {f.split(".")[0] for f in files if f.startswith("shard_")} == {
        f"shard_{r}-of-8" for r in range(8)
    }
    losses = {
        name: [r["loss"] for r in read_metrics(str(tmp_path / name)) if "loss" in r]
        for name in ("two", "one")
    }
    assert len(losses["two"]) == len(losses["one"]) == 4
    # The same batches on the same mesh shape; the cross-process sums (gloo) may add in
    # another order: float32's eps (1.2e-7) times the ~50 rounding stages between the data
    # and the fourth step's loss (forward, backward, three Adam updates of a 2-layer model).
    np.testing.assert_allclose(losses["two"], losses["one"], rtol=50 * 1.2e-7)


@pytest.mark.slow
def test_a_failure_on_one_process_stops_all_of_them(tmp_path, repo_dir):
    """Process 0 fails at its first metrics write; nobody may hang waiting for it."""
    start = time.monotonic()
    results = launch(
        joined(
            [
                "-m",
                "flaxlm.main",
                "--gin_file=gin/gptj_pretrain.gin",
                f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
                "--gin.TRAIN_STEPS=6",
                "--gin.LOG_PERIOD=2",
                "--gin.BATCH_SIZE=8",
                "--gin.TASK_FEATURE_LENGTHS={'targets': 64}",
                "--gin.Partitioner.mesh_shape=(2, -1, 1)",
                "--tasks_module=tests.crash_on_process_0",
            ]
        ),
        num_processes=2,
        devices_per_process=4,
        cwd=repo_dir,
        grace=150,
    )
    elapsed = time.monotonic() - start
    (code0, _, err0), (code1, _, err1) = results
    assert code0 == 1, err0[-3000:]
    assert "process 0 failed" in err0 and "injected failure on process 0" in err0
    # Killed by the harness would be -9; the peer must notice and exit on its own.
    assert code1 not in (0, -9), (code1, err1[-3000:])
    assert elapsed < 250, elapsed


@pytest.mark.slow
def test_checkpoint_saved_by_two_processes_restores_in_one_on_other_meshes(tmp_path):
    import jax
    import numpy as np

    from flaxlm.checkpoints import checkpointer
    from flaxlm.parallel.partitioning import Partitioner
    from flaxlm.training import steps as train_steps
    from tests.helpers import adamw, feature_lengths, random_batch, tiny_gptj

    model_dir = str(tmp_path / "run")
    results = launch(
        lambda addr, i: [
            os.path.join(HERE, "multiprocess_checkpoint_worker.py"),
            addr,
            "2",
            str(i),
            model_dir,
        ],
        num_processes=2,
        devices_per_process=4,
        cwd=os.path.dirname(HERE),
    )
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    line = next(x for x in results[0][1].splitlines() if x.startswith("RESULT "))
    saved_loss = json.loads(line[len("RESULT ") :])["next_loss"]
    saved = np.load(os.path.join(model_dir, "params.npz"))

    for mesh in [(2, 2, 2), (8, 1, 1)]:
        setup = train_steps.Setup(tiny_gptj(), Partitioner(mesh), adamw(), feature_lengths())
        step, state = checkpointer.Checkpointer(model_dir).restore_latest(setup.abstract_state)
        assert step == 1
        for path, leaf in jax.tree.leaves_with_path(state.params):
            np.testing.assert_array_equal(np.asarray(leaf), saved[jax.tree_util.keystr(path)])
        train_step = setup.partition_train_step(
            train_steps.make_train_step(setup.model, setup.partitioner, 1e-2, seed=0)
        )
        _, metrics = train_step(state, random_batch(seed=1))
        # Other devices and mesh: the same math in another summation order.
        assert abs(float(metrics["loss"]) - saved_loss) < 1e-5


@pytest.mark.slow
def test_sigterm_to_one_process_stops_all_at_the_same_step_with_a_checkpoint(tmp_path, repo_dir):
    import signal

    from tests.test_reliability import wait_for_step

    model_dir = str(tmp_path / "run")
    env = dict(os.environ)
    env["XLA_FLAGS"] = platforms.host_device_flags(4)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([repo_dir, env.get("PYTHONPATH", "")])
    address = f"127.0.0.1:{free_port()}"
    procs = [
        start_process(
            [
                "-m",
                "flaxlm.main",
                "--gin_file=gin/gptj_pretrain.gin",
                f"--gin.MODEL_DIR='{model_dir}'",
                "--gin.TRAIN_STEPS=200",
                "--gin.LOG_PERIOD=1",
                "--gin.EVAL_PERIOD=0",
                "--gin.CHECKPOINT_PERIOD=100",
                "--gin.BATCH_SIZE=8",
                "--gin.TASK_FEATURE_LENGTHS={'targets': 64}",
                "--gin.Partitioner.mesh_shape=(2, -1, 1)",
                f"--coordinator_address={address}",
                "--process_count=2",
                f"--process_index={i}",
            ],
            repo_dir,
            env,
            subprocess.PIPE,
            subprocess.PIPE,
        )
        for i in range(2)
    ]
    try:
        wait_for_step(model_dir, 3, procs[0])
        procs[1].send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    stopped = max(r["step"] for r in read_metrics(model_dir) if "loss" in r)
    assert 3 <= stopped < 200
    assert f"Preempted by a signal to another process at step {stopped}" in outputs[0][0]
    files = os.listdir(os.path.join(model_dir, "checkpoints", str(stopped), "dataset"))
    assert {f.split(".")[0] for f in files if f.startswith("shard_")} == {
        f"shard_{r}-of-8" for r in range(8)
    }


def _tiny_run(
    tmp_path, name, mesh, steps, processes, repo_dir, extra_args=(), devices=8, input_shards=8
):
    """`python -m flaxlm.main` on a tiny repeating task (an epoch is about 4 steps) with
    `devices` over all processes and `input_shards` logical input shards (None: the default,
    the mesh's data-parallel degree or a resumed checkpoint's); returns (per-step losses, the
    rows each process fed per step)."""
    import numpy as np

    run_dir = tmp_path / name
    run_dir.mkdir(exist_ok=True)
    for f in range(4):
        lines = "".join(f"file {f} line {i} {'x' * (i % 5)}\n" for i in range(16))
        (run_dir / f"part{f}.txt").write_text(lines)
    os.environ["FLAXLM_TEST_RECORD_DIR"] = str(run_dir)
    args = [
        "-m",
        "flaxlm.main",
        "--gin_file=gin/gptj_pretrain.gin",
        f"--gin.MODEL_DIR='{run_dir / 'model'}'",
        "--gin.MIXTURE_OR_TASK_NAME='test_tiny_lines'",
        "--gin.TASK_FEATURE_LENGTHS={'targets': 32}",
        "--gin.BATCH_SIZE=8",
        f"--gin.TRAIN_STEPS={steps}",
        "--gin.LOG_PERIOD=1",
        "--gin.EVAL_PERIOD=0",
        "--gin.CHECKPOINT_PERIOD=3",
        f"--gin.Partitioner.mesh_shape={mesh}",
        "--tasks_module=tests.record_batches",
        *extra_args,
    ]
    if input_shards is not None:
        # The same input shards for every mesh, so that all runs read the same global batches.
        args.append(f"--gin.train/DatasetConfig.num_input_shards={input_shards}")
    try:
        results = launch(
            joined(args, processes),
            num_processes=processes,
            devices_per_process=devices // processes,
            cwd=repo_dir,
        )
    finally:
        del os.environ["FLAXLM_TEST_RECORD_DIR"]
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    losses = {r["step"]: r["loss"] for r in read_metrics(str(run_dir / "model")) if "loss" in r}
    rows = []
    for i in range(processes):
        with open(run_dir / f"process_{i}.jsonl") as f:
            rows.append([np.asarray(json.loads(line)) for line in f])
    return losses, rows


@pytest.fixture(scope="module")
def one_process_resumed(tmp_path_factory, repo_dir):
    """One process with 8 devices on (8, 1, 1), as a user runs it (so 8 logical input
    shards, the data-parallel degree): 6 steps straight (an epoch is about 4 steps), and its
    directory as it was at the step-3 checkpoint, from which the tests resume other meshes
    and process counts: what they read after step 3 must be this run's. Losses and global
    batches."""
    import shutil

    tmp = tmp_path_factory.mktemp("reference")
    losses, (batches,) = _tiny_run(tmp, "ref", (8, 1, 1), 6, 1, repo_dir, input_shards=None)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and len(batches) == 6
    at_step_3 = tmp / "ref_model_at_step_3"
    shutil.copytree(tmp / "ref" / "model", at_step_3)
    shutil.rmtree(at_step_3 / "checkpoints" / "6")
    metrics = (at_step_3 / "metrics.jsonl").read_text().splitlines(keepends=True)
    (at_step_3 / "metrics.jsonl").write_text(
        "".join(line for line in metrics if json.loads(line).get("step", 0) <= 3)
    )
    return losses, batches, at_step_3


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(8, 1, 1), (1, 1, 8, 1)])
def test_two_processes_read_their_rows_of_the_one_process_batches(
    tmp_path, repo_dir, one_process_resumed, mesh
):
    """Same global batches and losses whatever the process count, and a resumed run sees
    exactly the batches of a straight one; each process read only its own rows.

    With (8, 1, 1) the two processes resume from the one-process run's step-3 checkpoint
    (train state and data-iterator position restored onto another process count). With
    (1, 1, 8, 1) each sequence is split over a `sequence` axis spanning both processes
    (context parallelism: the ring passes keys between them)."""
    import shutil

    import numpy as np

    ref_losses, ref_batches, ref_at_step_3 = one_process_resumed
    first = 0
    if mesh == (8, 1, 1):
        shutil.copytree(ref_at_step_3, tmp_path / "run" / "model")
        first = 3
    # (1, 1, 8, 1): the one model replica spans both processes (its `sequence` axis), so
    # each process holds, and reads, every row.
    replica_spans_hosts = mesh[0] * mesh[1] == 1
    extra = []
    if len(mesh) == 4:
        extra = ["--gin.Partitioner.mesh_axis_names=('data', 'fsdp', 'sequence', 'tensor')"]
    losses, rows = _tiny_run(tmp_path, "run", mesh, 6, 2, repo_dir, extra)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    for step in losses:
        tol = 1e-5 if len(mesh) == 4 else 1e-6  # the ring adds in another order
        assert abs(losses[step] - ref_losses[step]) < tol, (step, losses, ref_losses)
    # Each process fed exactly its half of every global batch (data split over the hosts),
    # or, where the replica spans both processes, both read the same whole batch.
    for process, fed in enumerate(rows):
        assert len(fed) == 6 - first
        for got, want in zip(fed, ref_batches[first:], strict=True):
            if replica_spans_hosts:
                np.testing.assert_array_equal(got, want)
            else:
                np.testing.assert_array_equal(got, want[4 * process : 4 * (process + 1)])


@pytest.mark.slow
def test_resume_on_another_mesh_continues_the_same_batches(tmp_path, repo_dir, one_process_resumed):
    """Saved on (8, 1, 1) at step 3 with the default input shards, resumed on half the
    devices as (2, 2, 1), data-parallel degree 4 (data x fsdp, the params split over fsdp):
    exactly the global batches (and, up to reduction order, the losses) of the run that
    stayed on (8, 1, 1)."""
    import shutil

    import numpy as np

    mesh, devices = (2, 2, 1), 4

    ref_losses, ref_batches, ref_at_step_3 = one_process_resumed
    shutil.copytree(ref_at_step_3, tmp_path / "run" / "model")
    losses, (fed,) = _tiny_run(
        tmp_path, "run", mesh, 6, 1, repo_dir, devices=devices, input_shards=None
    )
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]  # 1-3 logged before the copy
    for step in losses:
        assert abs(losses[step] - ref_losses[step]) < 1e-5, (step, losses, ref_losses)
    assert len(fed) == 3
    for got, want in zip(fed, ref_batches[3:], strict=True):
        np.testing.assert_array_equal(got, want)
