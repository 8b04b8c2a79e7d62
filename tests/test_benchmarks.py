"""Smoke tests of the compile-only benchmarks and of train_step.py (with PyTorch), tiny."""

import functools
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import adamw, load_benchmark

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO, "benchmarks")


def test_parse_hlo_counts_collectives_inside_loops():
    collectives = load_benchmark("collectives")
    hlo = """HloModule m

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %ag = f32[16,8]{1,0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, metadata={op_name="jit(f)/jvp(M)/while/body/dot"}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %y)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %w = (s32[], f32[4,8]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ar = (f32[4,8]{1,0}, bf16[2]{0}) all-reduce(%a, %b), channel_id=2, replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, to_apply=%add, metadata={op_name="jit(f)/transpose(jvp(M))/dot"}
  %ra = f32[24,8]{1,0} ragged-all-to-all(%a, %o, %io, %ss, %oo, %rr), channel_id=4, replica_groups={{0,1,2,3}}
  ROOT %rs = f32[1,8]{1,0} reduce-scatter(%a), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
}
"""  # noqa: E501
    out = collectives.parse_hlo(hlo, 8)
    # ragged-all-to-all (the MoE `ragged` dispatch): an all-to-all of its whole buffer
    ragged = out["by_kind"]["ragged-all-to-all"]
    assert ragged["array_bytes"] == 768 and ragged["ring_bytes"] == pytest.approx(768 * 3 / 4)
    ag, ar, rs = (out["by_kind"][k] for k in ("all-gather", "all-reduce", "reduce-scatter"))
    # all-gather: 3 trips of a 16x8 f32 result over groups of 4
    assert ag["count"] == 3 and ag["array_bytes"] == 3 * 512
    assert ag["ring_bytes"] == pytest.approx(3 * 512 * 3 / 4)
    assert out["by_kind"]["all-gather/forward"]["count"] == 3
    # all-reduce of a tuple (128 + 4 bytes) over 8 devices, in backward
    assert ar["count"] == 1 and ar["array_bytes"] == 132
    assert ar["ring_bytes"] == pytest.approx(2 * 7 / 8 * 132)
    assert out["by_kind"]["all-reduce/backward"]["count"] == 1
    # reduce-scatter: input 4x the 32-byte result, each device sends 3 results
    assert rs["array_bytes"] == 128 and rs["ring_bytes"] == 96
    assert out["unparsed"] == []


def test_parse_hlo_reads_tpu_async_pieces_reduce_scatter_fusions_and_loop_bounds():
    """TPU's compiled HLO: one async all-gather split into a start and a continuation fusion
    (one channel_id), a reduce-scatter as a custom fusion around an all-reduce, and a while
    loop without known_trip_count (its condition compares the counter with a constant)."""
    collectives = load_benchmark("collectives")
    hlo = """HloModule m

%fused_start (p0: bf16[2,8]) -> bf16[16,8] {
  %p0 = bf16[2,8]{1,0} parameter(0)
  ROOT %ag.1 = bf16[16,8]{1,0} all-gather(%p0), channel_id=7, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}, metadata={op_name="jit(f)/jvp(M)/while/body/dot"}
}

%async_collective_fusion.3 (p0: bf16[2,8]) -> bf16[16,8] {
  %p0 = bf16[2,8]{1,0} parameter(0)
  ROOT %ag.2 = bf16[16,8]{1,0} all-gather(%p0), channel_id=7, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}, metadata={op_name="jit(f)/jvp(M)/while/body/dot"}
}

%all-reduce-scatter.1 (input: f32[16,8]) -> f32[2,8] {
  %input = f32[16,8]{1,0} parameter(0)
  %ar = f32[16,8]{1,0} all-reduce(%input), channel_id=9, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %ds = f32[2,8]{1,0} dynamic-slice(%ar, %i, %j), dynamic_slice_sizes={2,8}
}

%body (p: (s32[], f32[2,8])) -> (s32[], f32[2,8]) {
  %p = (s32[], f32[2,8]{1,0}) parameter(0)
  %s = bf16[16,8]{1,0} fusion(%x), kind=kCustom, calls=%fused_start
  %c = bf16[16,8]{1,0} fusion(%x), kind=kLoop, calls=%async_collective_fusion.3
  %rs = f32[2,8]{1,0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.1, metadata={op_name="jit(f)/transpose(jvp(M))/while/body/dot"}
  ROOT %t = (s32[], f32[2,8]{1,0}) tuple(%i, %y)
}

%cond (p: (s32[], f32[2,8])) -> pred[] {
  %bound = s32[] constant(5)
  %p = (s32[], f32[2,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %bound), direction=LT
}

ENTRY %main (a: f32[2,8]) -> f32[2,8] {
  %zero = s32[] constant(1)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[2,8]{1,0}) tuple(%start, %a)
  ROOT %w = (s32[], f32[2,8]{1,0}) while(%init), condition=%cond, body=%body
}
"""  # noqa: E501
    out = collectives.parse_hlo(hlo, 8)
    assert out["unparsed"] == []
    ag, rs = out["by_kind"]["all-gather"], out["by_kind"]["reduce-scatter"]
    # 5 - 1 = 4 trips; the all-gather once per trip (not once per piece): 16x8 bf16
    assert ag["count"] == 4 and ag["array_bytes"] == 4 * 256
    # the reduce-scatter: a 2x8 f32 result over 8 devices, in backward; no all-reduce left
    assert rs["count"] == 4 and rs["array_bytes"] == 4 * 8 * 64
    assert rs["ring_bytes"] == pytest.approx(4 * 7 * 64)
    assert out["by_kind"]["reduce-scatter/backward"]["count"] == 4
    assert "all-reduce" not in out["by_kind"]


def test_parse_hlo_counts_each_shard_map_collective_of_channel_1():
    """Every collective a shard_map emits keeps channel_id 1 in TPU's compiled HLO: pieces
    of one op (same kind and shape) count once, distinct ops (the experts' two weights
    gathered, their two gradients reduce-scattered) each once."""
    collectives = load_benchmark("collectives")
    attrs = "channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}"
    hlo = f"""HloModule m

%piece.1 (p0: bf16[2,8]) -> bf16[16,8] {{
  ROOT %ag.1 = bf16[16,8]{{1,0}} all-gather(%p0), {attrs}
}}

%piece.2 (p0: bf16[2,8]) -> bf16[16,8] {{
  ROOT %ag.2 = bf16[16,8]{{1,0}} all-gather(%p0), {attrs}
}}

%other (p0: bf16[1,8]) -> bf16[8,8] {{
  ROOT %ag.3 = bf16[8,8]{{1,0}} all-gather(%p0), {attrs}
}}

ENTRY %main (a: bf16[2,8]) -> bf16[2,8] {{
  %s = bf16[16,8]{{1,0}} fusion(%a), kind=kCustom, calls=%piece.1
  %c = bf16[16,8]{{1,0}} fusion(%a), kind=kLoop, calls=%piece.2
  %o = bf16[8,8]{{1,0}} fusion(%a), kind=kLoop, calls=%other
  %rs.1 = bf16[2,8]{{1,0}} reduce-scatter(%s), {attrs}
  ROOT %rs.2 = bf16[1,8]{{1,0}} reduce-scatter(%o), {attrs}
}}
"""
    by_kind = collectives.parse_hlo(hlo, 8)["by_kind"]
    assert by_kind["all-gather"]["count"] == 2
    assert by_kind["all-gather"]["array_bytes"] == 16 * 8 * 2 + 8 * 8 * 2
    assert by_kind["reduce-scatter"]["count"] == 2


@pytest.mark.slow
def test_collectives_fsdp_reduce_scatters_on_tpu(tmp_path):
    """FSDP's collectives as the TPU compiler emits them (libtpu compiles for a v5e 2x4
    slice ahead of time; no TPU needed): params all-gathered, gradients reduce-scattered,
    within 1.1x of theory. XLA:CPU has no reduce-scatter (it all-reduces and slices)."""
    path = tmp_path / "coll.json"
    argv = ["--tpu-topology", "v5e:2x4", "--matmul-precision", "highest"]
    argv += ["--partitionings", "fsdp", "--layers", "2", "--hidden", "128", "--vocab", "256"]
    argv += ["--seq-len", "16", "--json", str(path)]
    env = dict(os.environ, PYTHONPATH=REPO)
    run = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "collectives.py"), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(path.read_text())
    assert "compiled ahead of time for 8x TPU" in results["machine"]
    (fsdp,) = results["rows"]
    assert fsdp["pass"] and fsdp["ratio"] <= 1.1, fsdp["ratio"]
    by_kind, parts = fsdp["measured"]["by_kind"], fsdp["theory"]["parts"]
    # Every sharded gradient is reduce-scattered: the gradient collectives (reduce-scatter
    # and backward all-reduce) move what the theory's reduce-scatter and small all-reduce
    # do. A [3, embed, heads, head_dim] q/k/v gradient stayed an all-reduce of the whole
    # gradient (1.22x at this shape) until layers.contract flattened its output dims.
    grads = by_kind["reduce-scatter"]["ring_bytes"] + by_kind["all-reduce/backward"]["ring_bytes"]
    theory_grads = sum(
        parts[k]["ring_bytes"]
        for k in ("reduce-scatter gradients", "all-reduce gradients of whole params")
    )
    assert grads <= 1.1 * theory_grads, grads / theory_grads


LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"


def libtpu_lockfile_held() -> bool:
    """Whether a process holds libtpu's lockfile (libtpu takes a POSIX lock on it)."""
    import fcntl

    try:
        fd = os.open(LIBTPU_LOCKFILE, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the lock if this probe got it
    return False


@pytest.mark.slow
def test_tpu_compile_beside_a_process_holding_libtpu():
    """The ahead-of-time TPU compile passes while another JAX process on this host holds
    libtpu's lockfile (here one that starts JAX's backends the default way, not through
    flaxlm), and without libtpu's TPU start-up errors."""
    from flaxlm.parallel import platforms

    if platforms.tpu_attached():
        pytest.skip("this host has a TPU: its runtime owns the lockfile")
    holder_env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    holder = subprocess.Popen(
        [sys.executable, "-c", "import jax; jax.devices(); print('ready', flush=True); input()"],
        env=holder_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "ready\n", "the other JAX process failed to start"
        assert libtpu_lockfile_held(), "the other process should hold libtpu's lockfile"
        compile_tpu = (
            "import bench_common; bench_common.force_host_devices(8)\n"
            "import jax, jax.numpy as jnp, numpy as np\n"
            "devices = bench_common.topology_devices('v5e:2x4')\n"
            "mesh = jax.sharding.Mesh(np.array(devices), ('x',))\n"
            "x = jax.ShapeDtypeStruct((64,), jnp.float32,\n"
            "    sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x')))\n"
            "jax.jit(lambda x: (2 * x).sum()).lower(x).compile()\n"
            "print(len(devices), devices[0].device_kind)\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", compile_tpu],
            cwd=BENCHMARKS,
            env=dict(os.environ, PYTHONPATH=REPO),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert run.stdout == "8 TPU v5 lite\n", run.stdout
        assert "E0000" not in run.stderr and "TPU_" not in run.stderr, run.stderr
        assert holder.poll() is None and libtpu_lockfile_held()  # held all along
    finally:
        holder.stdin.close()  # ends its input(): a normal exit, where libtpu removes its file
        try:
            holder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()


@pytest.mark.slow
def test_memory_fsdp_and_zero1_targets(tmp_path):
    memory = load_benchmark("memory")
    path = tmp_path / "memory.json"
    argv = ["--models", "gptj", "--layers", "1", "--hidden", "128", "--seq-len", "16"]
    argv += ["--partitionings", "fsdp", "zero1", "--remat-policies", "--json", str(path)]
    results = memory.main(argv)
    assert json.loads(path.read_text())["rows"] == json.loads(json.dumps(results["rows"]))
    # Any gin/models/ file's shape, as written but for the layer count and remat.
    args = memory.parse_args(["--models", "gemma2_9b", "--layers", "2"])
    gemma = memory.build_model("gemma2_9b", args, "full").config
    assert (gemma.hidden_size, gemma.num_layers, gemma.remat_policy) == (3584, 2, "full")
    rows = {r["partitioning"]: r for r in results["rows"]}
    assert set(rows) == {"fsdp", "zero1"}
    fsdp, zero1 = rows["fsdp"], rows["zero1"]
    total = fsdp["params_total_bytes"] + fsdp["opt_total_bytes"]
    assert fsdp["pass"] and total / 8 <= fsdp["params_bytes"] + fsdp["opt_bytes"] <= total / 7
    assert zero1["pass"] and zero1["params_bytes"] == zero1["params_total_bytes"]
    assert zero1["opt_bytes"] < zero1["opt_total_bytes"] / 7
    assert fsdp["temp_bytes"] > 0 and fsdp["remat_policy"] == memory.MODEL_REMAT

    # DPO's step: the reference a frozen copy of the params' shards; with LoRA, the base is
    # the reference and nothing else is frozen (no second copy).
    argv = ["--models", "llama", "--layers", "1", "--hidden", "128", "--seq-len", "16"]
    argv += ["--partitionings", "fsdp", "--remat-policies", "--preference", "dpo"]
    (full,) = memory.main(argv)["rows"]
    (adapted,) = memory.main(argv + ["--lora-rank", "4"])["rows"]
    assert full["frozen_bytes"] == full["params_bytes"] and full["temp_bytes"] > 0
    assert adapted["frozen_bytes"] == full["params_bytes"]
    assert adapted["params_bytes"] + adapted["opt_bytes"] < full["params_bytes"] / 4


@pytest.mark.slow
def test_collectives_dp_and_tp_match_theory():
    collectives = load_benchmark("collectives")
    argv = ["--partitionings", "dp", "tp", "--layers", "1", "--hidden", "64", "--vocab", "128"]
    results = collectives.main(argv + ["--seq-len", "16"])
    dp, tp = results["rows"]
    # DP: exactly one all-reduce of the gradients (plus scalar metric reductions)
    assert dp["ratio"] == pytest.approx(1.0, abs=0.01) and dp["pass"]
    assert dp["measured"]["by_kind"]["all-reduce"]["array_bytes"] >= dp["theory"]["array_bytes"]
    assert "all-gather" not in dp["measured"]["by_kind"]
    # TP: Megatron's count, which needs q/k/v's input gradient all-reduced once
    # (layers.parallel_dense); separate projections measured 1.45x.
    assert tp["ratio"] <= 1.1 and tp["pass"], tp["ratio"]


@pytest.mark.slow
def test_a_sequence_axis_in_collectives_and_memory():
    """`--sequence`: the ring's collective-permutes within 1.1x of theory (K and V in forward,
    K, V and their gradients in backward), and memory.py compiles a sequence-split row with
    the chunked loss and counts its collectives."""
    collectives = load_benchmark("collectives")
    argv = ["--partitionings", "fsdp", "--sequence", "4", "--layers", "1", "--hidden", "64"]
    (fsdp,) = collectives.main(argv + ["--vocab", "128", "--seq-len", "16"])["rows"]
    assert fsdp["mesh"] == {"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1}
    assert fsdp["ring_pass"] and 1.0 <= fsdp["ring_ratio"] <= 1.1, fsdp["ring_ratio"]
    memory = load_benchmark("memory")
    argv = ["--models", "llama", "--layers", "1", "--hidden", "128", "--seq-len", "32"]
    argv += ["--batch-size", "1", "--sequence", "8", "--attention-chunk-size", "4"]
    argv += ["--loss-chunk-size", "2", "--collectives"]
    (row,) = memory.main(argv + ["--partitionings", "--remat-policies", "none"])["rows"]
    assert row["mesh"] == {"data": 1, "fsdp": 1, "sequence": 8, "tensor": 1}
    assert row["temp_bytes"] > 0 and row["pass"] and row["attention_chunk_size"] == 4
    assert row["loss_chunk_size"] == 2 and row["collective_bytes"]["all-gather"] > 0


@pytest.mark.slow
def test_compile_time_scan(tmp_path):
    compile_time = load_benchmark("compile_time")
    argv = ["--layers", "1", "3", "--modes", "scan", "--hidden", "64", "--seq-len", "16"]
    results = compile_time.main(argv + ["--json", str(tmp_path / "ct.json")])
    assert [(r["mode"], r["layers"]) for r in results["rows"]] == [("scan", 1), ("scan", 3)]
    assert all(r["compile_seconds"] > 0 and r["lower_seconds"] > 0 for r in results["rows"])
    assert results["scan_ratio"] > 0 and isinstance(results["pass"], bool)
    assert json.loads((tmp_path / "ct.json").read_text())["scan_ratio"] == results["scan_ratio"]


def test_train_step_shapes_and_flags():
    train_step = load_benchmark("train_step")
    args = train_step.parse_args([])
    assert args.shapes == ["baby", "gptj"]
    baby = train_step.shape_of("baby", args)
    assert [baby[k] for k in train_step.SIZES] == [4, 4, 128, 64, 12]  # nanoGPT's baby GPT
    assert train_step.shape_of("gptj", args)["hidden_size"] == 256
    # A size flag alone selects the custom shape: gptj's sizes, that one changed.
    args = train_step.parse_args(["--hidden-size", "64", "--steps", "3"])
    custom = train_step.shape_of("custom", args)
    assert args.shapes == ["custom"] and custom["hidden_size"] == 64
    assert custom["seq_len"] == 256 and custom["steps"] == 3
    with pytest.raises(SystemExit):
        train_step.parse_args(["--shapes", "baby", "--hidden-size", "64"])
    train_step.jax.devices()  # started: XLA_FLAGS was read then, too late to add to it
    with pytest.raises(RuntimeError, match="started"):
        train_step.apply_xla_flags("--xla_cpu_enable_fast_math=false")


@pytest.mark.slow
def test_train_step_vs_pytorch_tiny(tmp_path, monkeypatch):
    """flaxlm, the plain jax.jit step and HF's PyTorch GPT-J alternate on a tiny custom
    shape, with the input-wait loop; the JSON holds the conditions and each side's numbers."""
    train_step = load_benchmark("train_step")
    # The conditions' matmul probe, before and after, in one burst of 10 ms of a 128 x 128
    # matmul, not 5 of 200 ms of 512 x 512 (2 s of this test).
    probe = functools.partial(
        train_step.bench_common.matmul_probe, size=128, bursts=1, burst_seconds=0.01
    )
    monkeypatch.setattr(train_step.bench_common, "matmul_probe", probe)
    argv = ["--hidden-size", "64", "--num-layers", "1", "--num-heads", "2", "--batch-size", "2"]
    argv += ["--seq-len", "16", "--steps", "2", "--repeats", "2", "--warmup", "1"]
    argv += ["--input-steps", "1", "--input-warmup", "1", "--json", str(tmp_path / "ts.json")]
    results = train_step.main(argv)
    assert json.loads((tmp_path / "ts.json").read_text())["shapes"].keys() == {"custom"}
    custom = results["shapes"]["custom"]
    for side in ("flaxlm", "plain", "torch"):
        numbers = custom["sides"][side]
        assert numbers["tokens_per_second"] > 0 and len(numbers["step_seconds_per_round"]) == 2
        # all start near ln(vocab) = ln(384) on random tokens, and all train
        assert 5.0 < custom["first_loss"][side] < 7.0
        assert custom["last_loss"][side] < custom["first_loss"][side]
    # flaxlm and the plain step: same init, batch and optimizer, so the same trajectory
    assert custom["first_loss"]["flaxlm"] == pytest.approx(custom["first_loss"]["plain"])
    assert custom["last_loss"]["flaxlm"] == pytest.approx(custom["last_loss"]["plain"], rel=1e-4)
    assert set(custom["ratios"]) == {"torch/flaxlm", "plain/flaxlm"}
    assert custom["torch"]["decayed_params"] > custom["torch"]["undecayed_params"] > 0
    assert custom["input"]["loop_steps"] == 1
    for when in ("before", "after"):
        assert results[when]["matmul_gflops"] > 0 and len(results[when]["loadavg"]) == 3
    assert len(results["markdown_rows"]) == 1


@pytest.mark.slow
def test_accelerator_benchmark_tiny_on_cpu(tmp_path, monkeypatch):
    """flaxlm (as the planner compiled it) and HF torch train from the same weights (equal
    first losses), then decode greedily to the same tokens; the report has both MFU
    conventions' columns and the planner's prediction; flaxlm's loss in two chunks of 16
    positions (`--loss-chunk-size`, as the 3B row on a GPU) is torch's whole loss (with
    gradient checkpointing, `--torch-checkpointing`). Both sides' processes run with
    TensorFlow and seqio unimportable, as on the lent GPU machines: the compute core
    (models, train step, aot, planner, inference, HF files) needs neither."""
    no_tensorflow = os.path.join(REPO, "tests", "no_tensorflow")
    assert os.path.exists(os.path.join(no_tensorflow, "sitecustomize.py"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([no_tensorflow, REPO]))
    accelerator = load_benchmark("accelerator")
    # llama_tiny cut to one layer of its 4 (`--layers`): each side's work is its layers'.
    argv = ["--model", "llama_tiny", "--layers", "1", "--lengths", "32", "--tokens", "64"]
    argv += ["--dtype", "float32", "--steps", "1", "--repeats", "1", "--warmup", "1"]
    argv += ["--no-torch-compile"]
    argv += ["--decode-batch", "2", "--decode-prompt", "4", "--decode-new", "4"]
    hlo_dir = tmp_path / "hlo"
    results = accelerator.main(
        [*argv, "--time-limit=900", "--json", str(tmp_path / "acc.json"), "--hlo", str(hlo_dir)]
        + ["--loss-chunk-size", "16", "--torch-checkpointing"]
    )
    assert results["flaxlm"]["models"]["llama_tiny"]["loss_chunk_size"] == 16
    torch_row = results["torch"]["models"]["llama_tiny"]["train"]["32"]
    assert torch_row["description"]["gradient_checkpointing"] is True
    assert json.loads((tmp_path / "acc.json").read_text())["train"] == results["train"]
    assert [p.name for p in hlo_dir.iterdir()] == ["LlamaConfig_1M_L32.hlo.txt.gz"]
    planned = results["flaxlm"]["models"]["llama_tiny"]["train"]["32"]["planner"]
    assert planned["flops"] > 0 and planned["bytes_accessed"] > 0
    assert results["unfinished"] == {}
    [row] = results["train"]
    assert (row["model"], row["length"], row["batch"]) == ("llama_tiny", 32, 2)
    for side in ("flaxlm", "torch"):
        assert row[side]["tokens_per_second"] > 0
        assert row[side]["mfu_whole"] is None  # CPU: no peak to divide by
    assert row["first_losses_agree"] and row["planner_ms"] > 0 and row["planner_gib"] > 0
    whole, causal = results["flaxlm"]["models"]["llama_tiny"]["flops_per_token"]["32"]
    assert whole > causal > whole / 2
    [decode] = results["decode"]
    assert decode["first_tokens_equal"] == 1.0 and decode["tokens_equal"] >= 0.75
    with pytest.raises(SystemExit):
        accelerator.parse_args(["--model", "llama_huge"])

    # A side stopped at the time limit keeps the lengths it finished: asked for 16 and 32,
    # finished 32 alone, the report has the row of 32 (with torch's beside it).
    args = accelerator.parse_args([*argv[:2], "--lengths", "16", "32"])
    [row] = accelerator.summarize(args, results["flaxlm"], results["torch"])
    assert row["length"] == 32 and row["torch_over_flaxlm"] > 0

    # Stopped before its first numbers (the limit ran out while it started), or failed
    # (an attention flaxlm does not have): a report that says so, no torch side.
    stopped = accelerator.main([*argv, "--time-limit=0.2"])
    assert stopped["unfinished"]["flaxlm"].startswith("stopped at the time limit")
    assert stopped["train"] == [] and stopped["torch"] is None
    failed = accelerator.main([*argv, "--attention", "nonsense"])
    assert failed["unfinished"]["flaxlm"].startswith("failed (exit code 1")
    assert failed["train"] == [] and failed["torch"] is None


@pytest.mark.slow
def test_accelerator_largest_turns_down_a_model_too_large_without_compiling_it(monkeypatch):
    """`--largest`: the 1B's float32 state alone exceeds a 1 GiB device, so the planner
    turns it down without a compile; the tiny model fits, and its compiled step is the one
    its first length measures (not planned again)."""
    import jax

    from flaxlm.plan import chips

    accelerator = load_benchmark("accelerator")
    args = accelerator.parse_args(
        ["--model", "llama_tiny", "--largest", "llama3_2_1b", "llama_tiny", "--lengths", "32"]
        + ["--tokens", "64", "--dtype", "float32", "--steps", "1", "--repeats", "1"]
    )
    chip = chips.Chip("test", {"float32": 1e10}, 1e10, 1e9, memory_bytes=2**30)
    devices = jax.devices()[:1]
    summary, planned = accelerator.choose_largest(args, devices, chip)
    too_large, tiny = summary["verdicts"]
    assert (too_large["status"], tiny["status"], summary["model"]) == (
        "does not fit",
        "fits",
        "llama_tiny",
    )
    assert too_large["reason"].startswith("the training state alone needs")
    assert too_large["gib"] > 1 and planned.step.compiled is not None

    def no_second_plan(*a, **k):
        raise AssertionError("planned again")

    monkeypatch.setattr(accelerator, "plan_one", no_second_plan)
    model = accelerator.flaxlm_model("llama_tiny", args, remat="full")
    vocab = model.config.vocab_size
    row = accelerator.flaxlm_length(model, args, devices, chip, 32, vocab, planned)
    assert row["planner"]["status"] == "fits" and row["step_seconds"] > 0


def test_attention_cpu_times_every_implementation_and_torch():
    attention_cpu = load_benchmark("attention_cpu")
    rows = attention_cpu.main(
        ["--batch", "2", "--length", "16", "--chunk-size", "8", "--calls", "1"]
    )
    assert [r["side"].split(" (")[0] for r in rows] == [
        "flaxlm 'xla'",
        "flaxlm 'jax'",
        "flaxlm 'chunked'",
        "torch einsum",
    ]
    assert all(r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 for r in rows)


@pytest.mark.parametrize("name", ["gpt_oss_120b", "deepseek_v3", "llama4_maverick"])
def test_published_moe_shapes_split_their_state_evenly_over_expert_and_fsdp(name):
    """The memory rows' first column without compiling (benchmarks/moe.py `memory`): the gin
    files' full-size shapes cut to 2 layers (DeepSeek-V3 and Llama 4 Maverick: a dense layer
    unrolled, then a MoE one scanned), their params + AdamW
    state per device = total / 8 under fsdp + expert 8 (1, 1, 8, 1), as under fsdp (1, 8, 1).
    Only shapes are traced (`Setup.abstract_state`), nothing allocated."""
    from flaxlm.training import steps

    bench_common = load_benchmark("bench_common")
    model = bench_common.reduce_layers(bench_common.gin_model(name), 2)
    c = model.config
    assert c.sparse_layers(2) == ((True, True) if name == "gpt_oss_120b" else (False, True))
    assert c.scan_layers and c.first_scanned_layer == (name != "gpt_oss_120b")
    lengths = bench_common.feature_lengths(model, 128)
    for expert in (1, 8):
        partitioner = bench_common.make_partitioner("fsdp", expert=expert)
        state = steps.Setup(model, partitioner, adamw(), lengths).abstract_state
        total = bench_common.total_bytes(state.params) + bench_common.total_bytes(state.opt_state)
        per_device = bench_common.per_device_bytes(state.params)
        per_device += bench_common.per_device_bytes(state.opt_state)
        # Every large array splits 8 ways; only scalars and small vectors (norm scales, the
        # router's biases, AdamW's count) are whole on each device, well under 1%.
        assert total / 8 <= per_device <= 1.01 * total / 8, (expert, per_device / (total / 8))


@pytest.mark.slow
def test_ragged_dispatch_compiled_for_a_v5p_slice_holds_less_per_device_with_more_experts():
    """A small MoE (qwen3_moe_tiny.gin's layers at 32 experts of width 256) with the ragged
    dispatch, compiled ahead of time for v5p:2x2x2 (libtpu, no TPU) on the fsdp mesh with
    its `expert` axis at 2 and at 8: the real `ragged-all-to-all` in the program, and the
    temporaries per device fall as the experts spread (each device gathers only its own
    experts' weights, and the buffers follow the tokens it sends, not the group's). The GiB a
    device the planner gives a TPU program is libtpu's own peak, at most the sum of its
    arguments and temporaries (which are not all live at once)."""
    script = (
        "import bench_common; bench_common.force_host_devices(8)\n"
        "devices = bench_common.topology_devices('v5p:2x2x2')\n"
        "model = bench_common.gin_model('qwen3_moe_tiny', num_layers=1, num_experts=32,\n"
        "    moe_intermediate_size=256, moe_dispatch='ragged')\n"
        "for expert in (2, 8):\n"
        "    partitioner = bench_common.make_partitioner('fsdp', devices, expert=expert)\n"
        "    step = bench_common.CompiledStep(model, partitioner, 16, 64)\n"
        "    temp = step.compiled.memory_analysis().temp_size_in_bytes\n"
        "    ragged = step.hlo_text().count(' ragged-all-to-all(')\n"
        "    print('expert', expert, temp, ragged)\n"
        "    mem = step.compiled.memory_analysis()\n"
        "    total = mem.argument_size_in_bytes + mem.output_size_in_bytes\n"
        "    total += mem.temp_size_in_bytes - mem.alias_size_in_bytes\n"
        "    peak = mem.peak_memory_in_bytes\n"
        "    print('bytes', step.device_bytes(), peak, total)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=BENCHMARKS,
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith("expert ")]
    (two, temp2, ragged2), (eight, temp8, ragged8) = ((int(x) for x in r[1:]) for r in rows)
    assert (two, eight) == (2, 8) and ragged2 > 0 and ragged8 > 0, rows
    assert int(temp8) < int(temp2), rows
    sizes = [
        [int(x) for x in r.split()[1:]] for r in run.stdout.splitlines() if r.startswith("bytes ")
    ]
    assert len(sizes) == 2 and all(0 < shown == peak <= total for shown, peak, total in sizes), (
        sizes
    )
