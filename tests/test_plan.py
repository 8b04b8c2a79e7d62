"""The parallelism planner (flaxlm.plan): candidates, rejections, the loop-corrected cost, the
roofline's ranking, the table, the overrides it prints, and its command line."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from typing import Any

import gin
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

from flaxlm import gin_utils
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.gptj import GPTJConfig
from flaxlm.parallel import platforms
from flaxlm.plan import chips, flops, hlo, planner, report, traffic
from flaxlm.plan import run as plan_run
from flaxlm.training import optimizers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = {
    "decoder_target_tokens": 32,
    "decoder_input_tokens": 32,
    "decoder_loss_weights": 32,
    "decoder_segment_ids": 32,
    "decoder_positions": 32,
}


def tiny_run(batch_size: int = 8, scan: bool = False) -> plan_run.Run:
    config = GPTJConfig(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        rotary_dim=8,
        max_position_embeddings=64,
        dtype="float32",
        param_dtype="float32",
        remat_policy="none",
        scan_layers=scan,
    )
    base = plan_run.Knobs((1, -1, 1), "params", "none", 1, scan)
    return plan_run.Run(
        model=DecoderOnlyModel(config),
        batch_size=batch_size,
        lengths=dict(LENGTHS),
        num_microbatches=1,
        optimizer=optimizers.create_optimizer(learning_rate=1e-3),
        learning_rate=1e-3,
        lora=None,
        objective=None,
        axis_names=("data", "fsdp", "tensor"),
        base=base,
        partitioner_kwargs={},
    )


def with_sgd(run: plan_run.Run) -> plan_run.Run:
    """`run` stepped by plain SGD, for the tests that compare steps' FLOPs (the layers'):
    AdamW's clipping and per-parameter update, the same in every step compared, is a
    quarter of a small step's compile."""
    return dataclasses.replace(run, optimizer=optax.sgd(1e-3))


# A made-up chip: only the ranking's arithmetic matters here.
CHIP = chips.Chip("test", {"float32": 1e10}, 1e10, 1e9, None, collective_latency_s=1e-5)


def test_mesh_shapes_are_every_ordered_factorisation():
    shapes = planner.mesh_shapes(8, 3)
    assert len(shapes) == len(set(shapes)) == 10
    assert all(a * b * c == 8 for a, b, c in shapes)
    assert (2, 2, 2) in shapes and (1, 1, 8) in shapes


def test_rejects_what_cannot_divide_before_compiling_and_names_why():
    p = planner.Planner(tiny_run(batch_size=8), jax.devices(), CHIP)
    k = p.run.base
    reason = p.reject_reason(dataclasses.replace(k, mesh_shape=(1, 1, 8)))
    assert "k_proj/kernel" in reason and "not divisible by tensor=8" in reason
    reason = p.reject_reason(dataclasses.replace(k, mesh_shape=(1, 8, 1), num_microbatches=2))
    assert "batch 8" in reason and "degree 8" in reason
    reason = p.reject_reason(
        dataclasses.replace(k, mesh_shape=(1, 8, 1), optimizer_sharding="zero1")
    )
    assert "zero1 needs a data axis" in reason
    assert p.reject_reason(dataclasses.replace(k, mesh_shape=(2, 2, 2))) is None


@pytest.mark.slow
def test_loop_corrected_cost_ranking_and_a_parallel_compile():
    """A scanned step's FLOPs equal the unscanned step's (cost_analysis alone counts the
    loop's body once); remat `full` costs more FLOPs and ranks lower. The three compile on
    two threads, as the planner does on a larger host."""
    p = planner.Planner(with_sgd(tiny_run()), jax.devices(), CHIP)
    base = dataclasses.replace(p.run.base, mesh_shape=(1, 8, 1))
    knobs = [
        base,
        dataclasses.replace(base, scan_layers=True),
        dataclasses.replace(base, remat_policy="full"),
    ]
    with ThreadPoolExecutor(2) as pool:
        plain, looped, remat = pool.map(p.evaluate, knobs)
    assert plain.status == looped.status == remat.status == "fits"
    assert looped.step.cost()["flops"] < 0.8 * plain.flops  # the body counted once
    assert looped.flops == pytest.approx(plain.flops, rel=0.05)
    assert remat.flops > 1.1 * plain.flops
    assert plain.collective_ops > 0 and plain.collective_bytes > 0
    ranked = planner.rank([remat, plain])
    assert ranked[0] is plain and plain.predicted_s < remat.predicted_s
    assert 0 < plain.mfu < 1


def test_nothing_fits_prints_the_smallest_need():
    run = tiny_run()
    results = [
        plan_run.Result(dataclasses.replace(run.base, mesh_shape=m), "does not fit", "", b)
        for m, b in (((1, 8, 1), 3 * 2**30), ((2, 4, 1), 2**30))
    ]
    out = io.StringIO()
    with redirect_stdout(out):
        report.print_table(planner.rank(results), run)
    assert "Nothing fits: the smallest candidate (mesh (2, 4, 1)" in out.getvalue()
    assert "needs 1.00 GiB/device" in out.getvalue()


def test_a_state_too_large_for_the_device_is_not_compiled():
    """Off TPU the planner holds the memory limit: a candidate whose params and optimizer
    state alone exceed it does not fit at once, nothing lowered, its GiB a lower bound."""
    chip = dataclasses.replace(CHIP, memory_bytes=1e5)
    p = planner.Planner(tiny_run(), jax.devices(), chip)
    result = p.evaluate(dataclasses.replace(p.run.base, mesh_shape=(1, 8, 1)))
    assert (result.status, result.at_least) == ("does not fit", True)
    assert result.reason.startswith("the training state alone needs")
    assert result.step.lowered is None and result.device_bytes == result.step.state_bytes > 1e5
    out = io.StringIO()
    with redirect_stdout(out):
        report.print_table([result], p.run)
    assert f"| >{result.device_bytes / 2**30:.2f} |" in out.getvalue()
    assert "needs more than 0.00 GiB/device (its training state alone)" in out.getvalue()


def test_matmul_costs_count_the_dots_xla_counts():
    f = jax.jit(lambda a, b, c: jnp.einsum("bij,bjk->bik", a, b) @ c)
    compiled = f.lower(jnp.ones((3, 16, 24)), jnp.ones((3, 24, 40)), jnp.ones((40, 8))).compile()
    got = flops.matmul_costs(compiled.as_text())
    assert got["dot_flops"] == 2 * 3 * 16 * 40 * 24 + 2 * 3 * 16 * 8 * 40
    assert got["dot_flops"] == aot_cost(compiled)["flops"]
    assert got["custom_calls"] == 0


@pytest.mark.parametrize("target", ["cpu", "h100"])
def test_loops_inside_a_layer_count_every_trip_the_steps_own_loops_once(target):
    """XLA's cost analysis counts a loop's body once. The planner counts a loop inside a
    layer (a chunked scan: 'chunked' attention's blocks, the delta rules' chunks) as often as
    it runs, and the microbatches' and scanned layers' loops (their named scopes) once: it
    prices those from calibration compiles. On CPU the step's cost is XLA's plus the inner
    loop's later trips; compiled for an H100 from here (no cost analysis) it is read off the
    HLO, the products cuBLAS calls."""
    from flaxlm.models import layers
    from flaxlm.plan import aot

    chunks, rows, width = 5, 4, 32

    def f(w, x):  # 3 microbatches of `chunks` chunks
        def chunk(c, xi):
            return c + jnp.tanh(xi @ w).sum(), None

        def microbatch(c, xs):
            return c + jax.lax.scan(chunk, 0.0, xs)[0], None

        with jax.named_scope(layers.MICROBATCH_LOOP):
            return jax.lax.scan(microbatch, 0.0, x)[0]

    shapes = [(width, width), (3, chunks, rows, width)]
    if target == "cpu":
        args = [jnp.ones(s, jnp.float32) for s in shapes]
    else:
        whole = jax.sharding.NamedSharding(
            jax.sharding.Mesh(aot.gpu_devices("h100", 1), ("x",)), P()
        )
        args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=whole) for s in shapes]
    compiled = jax.jit(f).lower(*args).compile()
    text = compiled.as_text()
    one = 2 * rows * width * width  # one chunk's product
    once, inner = flops.matmul_costs(text, inner_loops=False), flops.matmul_costs(text)
    assert once["dot_flops"] + once["custom_flops"] == one
    assert inner["dot_flops"] + inner["custom_flops"] == chunks * one
    step = aot.CompiledStep.__new__(aot.CompiledStep)
    step.compiled, step._hlo_text = compiled, None
    cost = step.cost()
    if target == "cpu":
        xla = aot_cost(compiled)
        assert cost["flops"] == xla["flops"] + (chunks - 1) * one
        assert cost["bytes accessed"] > xla["bytes accessed"]
    else:
        assert cost["flops"] == chunks * one
        assert cost["bytes accessed"] == traffic.program_bytes(text)
        assert traffic.program_bytes(text) > traffic.program_bytes(text, inner_loops=False)


def aot_cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    return cost[0] if isinstance(cost, list) else cost


# An NVIDIA GPU's compiled step as XLA prints it (abridged): a cuBLAS gemm, a batched
# cuBLASLt matmul, cuDNN's causal flash attention forward and backward, and a call XLA
# knows nothing of.
GPU_HLO = """HloModule jit_step, entry_computation_layout={()->f32[]}

%fused_computation (param_0: bf16[16,64]) -> bf16[16,64] {
  %param_0 = bf16[16,64]{1,0} parameter(0)
  ROOT %negate.1 = bf16[16,64]{1,0} negate(%param_0)
}

ENTRY %main.9 (p0: bf16[16,32], p1: bf16[32,64], q: bf16[2,128,4,32], k: bf16[2,128,4,32]) -> f32[] {
  %p0 = bf16[16,32]{1,0} parameter(0)
  %p1 = bf16[32,64]{1,0} parameter(1)
  %q = bf16[2,128,4,32]{3,2,1,0} parameter(2)
  %k = bf16[2,128,4,32]{3,2,1,0} parameter(3)
  %custom-call.3 = (bf16[16,64]{1,0}, s8[4194304]{0}) custom-call(bf16[16,32]{1,0} %p0, bf16[32,64]{1,0} %p1), custom_call_target="__cublas$gemm", backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":{"alpha_real":1,"alpha_imag":0,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  %gte.1 = bf16[16,64]{1,0} get-tuple-element(%custom-call.3), index=0
  %fusion.1 = bf16[16,64]{1,0} fusion(%gte.1), kind=kLoop, calls=%fused_computation
  %custom-call.4 = (bf16[2,128,4,4]{3,2,1,0}, s8[1024]{0}) custom-call(%q, %k), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["3"],"lhs_batch_dimensions":["0","1"],"rhs_batch_dimensions":["0","1"]}}}
  %custom-call.5 = (bf16[2,128,4,32]{3,2,1,0}, f32[2,4,128]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"operation_queue_id":"0","cudnn_fmha_backend_config":{"fmha_scale":0.17,"intermediate_tensor_shape":{"element_type":"BF16","dimensions":["2","4","128","128"],"tuple_shapes":[]},"is_flash_attention":true,"mask_type":"CAUSAL"}}
  %custom-call.6 = (bf16[2,128,4,32]{3,2,1,0}, bf16[2,128,4,32]{3,2,1,0}, bf16[2,128,4,32]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %q, %q), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"dimensions":["2","4","128","128"]},"mask_type":"NO_MASK"}}
  %custom-call.7 = f32[] custom-call(%p0), custom_call_target="some_kernel"
  ROOT %custom-call.8 = f32[] custom-call(%p1), custom_call_target="another_kernel"
}
"""  # noqa: E501


def test_library_calls_of_a_gpu_step_are_counted_where_xla_left_them_out():
    got = flops.matmul_costs(GPU_HLO)
    gemm = 2 * 16 * 64 * 32
    batched = 2 * (2 * 128 * 4 * 4) * 32
    scores = 2 * 4 * 128 * 128
    attention = 4 * scores * 32 / 2 + 10 * scores * 32  # causal forward, full backward
    assert got["custom_flops"] == gemm + batched + attention
    assert got["custom_calls"] == 6 and got["dot_flops"] == 0
    q = 2 * 128 * 4 * 32 * 2  # bytes of one bf16 [2, 128, 4, 32]
    gemm_bytes = (16 * 32 + 32 * 64 + 16 * 64) * 2  # not the s8 workspace
    fmha_bytes = (3 + 1) * q + 2 * 4 * 128 * 4 + (4 + 3) * q  # in + out, f32 statistics
    assert got["custom_bytes"] == gemm_bytes + (2 * q + 2 * 128 * 4 * 4 * 2) + fmha_bytes
    # XLA's generic analysis: each custom call -1 FLOPs and -1 bytes, the negate counted.
    xla = {"flops": 16 * 64 - 6, "bytes accessed": 4096.0 - 6}
    fixed = flops.with_library_calls(xla, got)
    assert fixed["flops"] == 16 * 64 + got["custom_flops"]
    assert fixed["bytes accessed"] == 4096 + got["custom_bytes"]
    # An analysis that counted the calls itself is left as it is.
    counted = {"flops": 16 * 64 + got["custom_flops"], "bytes accessed": 1e6}
    assert flops.with_library_calls(counted, got) == counted


def test_loop_traffic_charges_slices_and_in_place_updates_and_lists_branches_apart():
    """`traffic.loop_kernels` on a compiled loop (XLA:CPU's; `decode_hlo.py` reads XLA:GPU's
    alike): a gather of 4 rows of a 4 MiB table and a one-row update in place of a 4 MiB
    loop-carried buffer are charged their rows, not the arrays; a conditional's branches
    are listed apart, and `iteration_bytes` picks one of them."""
    whole = 4096 * 256 * 4

    def loop(table, buf, acc):
        def body(i, carry):
            buf, acc = carry
            rows = jnp.take(table, (jnp.arange(4) * 7 + i) % 4096, axis=0)
            buf = jax.lax.dynamic_update_slice(buf, rows[:1] * 2.0, (i, 0))
            heavy = lambda: acc + jnp.sin(buf).sum()  # noqa: E731 - reads the whole buffer
            acc = jax.lax.cond(i % 2 == 0, heavy, lambda: acc + rows.sum())
            return buf, acc

        return jax.lax.fori_loop(0, 8, body, (buf, acc))

    big = jnp.zeros((4096, 256))
    compiled = jax.jit(loop, donate_argnums=(1,)).lower(big, big, jnp.float32(0)).compile()
    kernels = traffic.loop_kernels(compiled.as_text())
    unconditional = [k for k in kernels if k.branch is None]
    assert sum(k.nbytes for k in unconditional) < 8 * 4 * 256 * 4  # rows, not tables
    assert {k.branch.rsplit(":", 1)[1] for k in kernels if k.branch} == {"0", "1"}
    assert traffic.iteration_bytes(kernels) < 8 * 4 * 256 * 4
    assert traffic.iteration_bytes(kernels, max) >= 2 * whole  # sin: the buffer in and out


def test_replica_groups_in_each_of_xlas_spellings():
    """`hlo.replica_groups`: explicit groups, the iota spelling, and the mesh-axes spelling
    XLA:GPU prints (with the device order as an iota tile assignment), and a permute's
    source-target pairs; `spans_hosts` says which cross a host boundary."""
    groups = hlo.replica_groups
    assert groups("replica_groups={{0,1},{2,3}}, dimensions={0}", 4) == [[0, 1], [2, 3]]
    assert groups("replica_groups={}, to_apply=%add", 4) == [[0, 1, 2, 3]]
    assert groups("replica_groups=[2,4]<=[8]", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # 16 devices, 2 hosts of 8 (an fsdp axis of 8 inside each host): the all-gather over fsdp
    # as XLA:GPU prints it, and the gradient's all-reduce over every device.
    gather = (
        "replica_groups=mesh['axis_0'=8,'axis_1'=1,'axis_2'=2], device_ids=([2,8]T(1,0)) "
        "{'axis_0'}, dimensions={0}"
    )
    assert groups(gather, 16) == [list(range(8)), list(range(8, 16))]
    assert groups("replica_groups=mesh['axis_0'=16,'axis_1'=1] {'axis_0'}", 16) == [list(range(16))]
    assert groups("replica_groups=mesh['a'=2,'b'=4] {'a'}", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups("source_target_pairs={{0,1},{1,2}}", 4) == [[0, 1], [1, 2]]
    assert groups("dimensions={0}", 4) is None
    assert hlo.group_size(gather, 16) == 8
    hosts = [0] * 8 + [1] * 8
    assert not hlo.spans_hosts(groups(gather, 16), hosts)
    assert hlo.spans_hosts([[0, 8], [1, 9]], hosts)
    assert not hlo.spans_hosts([[0, 8]], None) and not hlo.spans_hosts([[0, 8]], [0] * 16)


# XLA:GPU's async collectives (abridged from a step compiled for 2 hosts of 8 H100s,
# `aot.gpu_devices("h100", 8, 2)`): all-to-all, all-gather and a ragged all-to-all (printed
# with no metadata) inside each host, the psum over the hosts; each `-start` typed as XLA:GPU
# types it (the all-reduce's is its result; the others' hold operands then results), each
# `-done` waiting on it.
GPU_CLUSTER_HLO = """HloModule jit_body, entry_computation_layout={()->bf16[64,256]{1,0}}

%fused_negate (p0: bf16[64,256]) -> bf16[64,256] {
  %p0 = bf16[64,256]{1,0} parameter(0)
  ROOT %negate = bf16[64,256]{1,0} negate(%p0)
}

%region_0.0 (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %add = bf16[] add(%a, %b)
}

ENTRY %main (param.2: bf16[64,256], param.3: bf16[32,256], o: s64[8]) -> bf16[64,256] {
  %param.2 = bf16[64,256]{1,0} parameter(0)
  %param.3 = bf16[32,256]{1,0} parameter(1)
  %o = s64[8]{0} parameter(2)
  %all-gather-start = (bf16[32,256]{1,0}, bf16[256,256]{1,0}) all-gather-start(%param.3), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14,15}}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(body)/shard_map/all_gather"}
  %all-gather-done = bf16[256,256]{1,0} all-gather-done(%all-gather-start)
  %all-to-all-start = ((bf16[64,256]{1,0}), bf16[64,256]{1,0}) all-to-all-start(%param.2), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14,15}}, dimensions={0}, metadata={op_name="jit(body)/shard_map/all_to_all"}
  %all-to-all-done = bf16[64,256]{1,0} all-to-all-done(%all-to-all-start)
  %fusion = bf16[64,256]{1,0} fusion(%all-to-all-done), kind=kLoop, calls=%fused_negate
  %ragged-all-to-all-start = ((bf16[64,256]{1,0}, bf16[64,256]{1,0}, s64[8]{0}, s64[8]{0}, s64[8]{0}, /*index=5*/s64[8]{0}), bf16[64,256]{1,0}) ragged-all-to-all-start(%fusion, %param.2, %o, %o, %o, /*index=5*/%o), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14,15}}
  %ragged-all-to-all-done = bf16[64,256]{1,0} ragged-all-to-all-done(%ragged-all-to-all-start)
  %all-reduce-start = bf16[64,256]{1,0} all-reduce-start(%fusion), channel_id=1, replica_groups={{0,8},{1,9},{2,10},{3,11},{4,12},{5,13},{6,14},{7,15}}, use_global_device_ids=true, to_apply=%region_0.0, metadata={op_name="jit(body)/shard_map/psum_invariant"}
  ROOT %all-reduce-done = bf16[64,256]{1,0} all-reduce-done(%all-reduce-start)
}
"""  # noqa: E501


def test_a_gpu_clusters_async_collectives_are_counted_and_those_between_hosts_apart():
    out = hlo.parse_hlo(GPU_CLUSTER_HLO, 16, [0] * 8 + [1] * 8)
    assert out["unparsed"] == []
    by_kind = out["by_kind"]
    gathered, moved, reduced = 256 * 256 * 2, 64 * 256 * 2, 64 * 256 * 2
    assert by_kind["all-gather"]["ring_bytes"] == pytest.approx(gathered * 7 / 8)
    assert by_kind["all-to-all"]["ring_bytes"] == pytest.approx(moved * 7 / 8)
    assert by_kind["all-reduce"]["ring_bytes"] == pytest.approx(reduced)  # 2 (n - 1) / n, n = 2
    assert out["host_ring_bytes"] == pytest.approx(reduced)  # only the psum leaves a host
    assert by_kind["ragged-all-to-all"]["ring_bytes"] == pytest.approx(moved * 7 / 8)
    assert by_kind["all-to-all"]["host_ring_bytes"] == 0
    # The MoE layers' own (in a shard_map): the ragged one though XLA:GPU names no op.
    moe = hlo.shard_map_collectives(GPU_CLUSTER_HLO, 16)
    assert set(moe) >= {"all-gather", "all-to-all", "ragged-all-to-all"}
    assert "all-reduce" in moe  # (the psum is the shard_map's too)
    # One host: nothing crosses. The kernels' bytes (a done moves nothing of its own).
    assert hlo.parse_hlo(GPU_CLUSTER_HLO, 16)["host_ring_bytes"] == 0
    starts = 32 * 256 * 2 + gathered + 2 * moved + 2 * reduced  # operands in, results out
    ragged = 3 * moved + 4 * 8 * 8  # input, output buffer and offsets in, the output out
    assert traffic.program_bytes(GPU_CLUSTER_HLO) == starts + ragged + 2 * moved  # + fusion


def test_gpu_targets_describe_the_chip_and_an_unknown_one_is_named():
    """`aot.GPU_TARGETS`: the target description XLA:GPU compiles from (benchmarks/
    decode_hlo.py compiles with it, given JAX's CUDA plugin) carries the chip's roofline."""
    from flaxlm.plan import aot

    text = aot.GPU_TARGETS["h200"].config_text()
    assert f"memory_bandwidth: {int(chips.CHIPS['h200'].memory_bytes_per_s)}" in text
    assert "core_count: 132" in text and 'device_description_str: "NVIDIA H200"' in text
    with pytest.raises(ValueError, match="expected one of \\['h100', 'h200'\\]"):
        aot.gpu_devices("h300")


def test_spearman():
    assert report.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert report.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert report.spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)


def test_chip_for_known_and_unknown_devices():
    class Device:
        def __init__(self, kind):
            self.device_kind = kind

    assert planner.chips.chip_for(Device("TPU v5 lite")).name == "v5e"
    assert planner.chips.chip_for(Device("NVIDIA H100 80GB HBM3")).name == "h100"
    assert planner.chips.chip_for(Device("cpu")) is None


def test_a_gpu_compiled_for_holds_what_jax_will_let_the_run_hold(monkeypatch):
    """A GPU with no runtime to ask (compiled for, not attached): its limit is
    XLA_CLIENT_MEM_FRACTION of its HBM, JAX's 0.75 unless set; a TPU's is the chip's."""

    class Device:
        device_kind = "NVIDIA H100 80GB HBM3"

    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert chips.chip_for(Device()).memory_bytes == pytest.approx(0.75 * 80e9)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # JAX's deprecated name
    assert chips.chip_for(Device()).memory_bytes == pytest.approx(0.95 * 80e9)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    with pytest.raises(ValueError, match="both set"):
        chips.chip_for(Device())
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert chips.chip_for(Device()).memory_bytes == pytest.approx(0.9 * 80e9)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "1.5")
    with pytest.raises(ValueError, match="XLA_CLIENT_MEM_FRACTION='1.5'"):
        chips.chip_for(Device())
    Device.device_kind = "TPU v5"
    assert chips.chip_for(Device()).memory_bytes == chips.CHIPS["v5p"].memory_bytes


def run_plan(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "XLA_FLAGS": platforms.host_device_flags(None),
    }  # the planner sets the device count
    # a GPU's limit is read from these (benchmarks/accelerator.py, imported by another test
    # in this process, sets one): the planner's default here
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "flaxlm.plan", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_command_line_plans_measures_and_prints_overrides_that_parse(tmp_path):
    """`python -m flaxlm.plan` on cpu:8 for gin/gptj_pretrain.gin (made smaller): progress,
    the ranked table, measured times beside the prediction, the JSON, and `--gin.` overrides
    that bind the planned configuration when given to the same Gin files."""
    out = tmp_path / "plan.json"
    small = [
        "--gin.TASK_FEATURE_LENGTHS={'targets': 32}",
        "--gin.BATCH_SIZE=8",
        "--gin.GPTJConfig.hidden_size=64",
        "--gin.GPTJConfig.num_layers=1",
        "--gin.GPTJConfig.rotary_dim=8",
    ]
    proc = run_plan(
        "--gin_file=gin/gptj_pretrain.gin",
        "--topology=cpu:8",
        "--max_candidates=2",
        "--measure=2",
        f"--json={out}",
        *small,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "| # | mesh | optimizer |" in text and "predicted ms/step" in text
    assert "Spearman rank correlation" in text
    assert "compiling mesh" in proc.stderr and "done" in proc.stderr
    assert "Traceback" not in proc.stderr and "cudart_stub" not in proc.stderr
    saved = json.loads(out.read_text())
    fits = [c for c in saved["candidates"] if c["status"] == "fits"]
    assert len(fits) >= 2 and all(c["predicted_s"] > 0 for c in fits)
    assert sum(c["measured_s"] is not None for c in fits) == 2
    overrides = fits[0]["overrides"]
    assert overrides == [line.strip(" \\") for line in text.split("Best:")[1].splitlines()[1:6]]
    gin.clear_config()
    try:
        shell = shlex.split(" ".join(overrides))  # as a shell passes them
        bindings = gin_utils.rewrite_gin_args(["x", *small, *shell])[1:]
        gin_utils.parse_gin(
            [os.path.join(REPO, "gin/gptj_pretrain.gin")],
            [b.split("=", 1)[1] for b in bindings],
            [],
        )
        mesh = gin.query_parameter("partitioning.Partitioner.mesh_shape")
        assert list(mesh) == fits[0]["mesh_shape"]
        assert gin.query_parameter("train.train.num_microbatches") == 1
    finally:
        gin.clear_config()


@pytest.mark.parametrize("topology", ["v5z", "h100:0x8"])
def test_command_line_bad_topology_is_a_clear_error(topology):
    proc = run_plan("--gin_file=gin/gptj_pretrain.gin", f"--topology={topology}")
    assert proc.returncode == 2
    assert f"error: --topology='{topology}'" in proc.stderr and "Traceback" not in proc.stderr
    assert "h100:16x8" in proc.stderr  # the spellings it takes


@pytest.mark.slow
def test_command_line_plans_for_a_cluster_of_gpu_hosts(tmp_path):
    """`--topology=h100:2x8` (XLA:GPU, no GPU): qwen3_moe_tiny (one layer) over 2 hosts of
    8, data across the hosts and the experts inside each. XLA:GPU's cost analysis of such a
    program is empty, so FLOPs and bytes are read off the HLO; the collectives between hosts
    are priced at the network's rate: the gradients' reduction over `data` crosses it, the
    experts' all-to-alls stay on NVLink. In bfloat16 at widths of 64s its dropless experts
    compile to the Mosaic GPU kernels an H100 runs."""
    out = tmp_path / "plan.json"
    proc = run_plan(
        "--gin_file=gin/runs/pretrain.gin",
        "--gin_file=gin/models/qwen3_moe_tiny.gin",
        "--gin_file=gin/partitioning/fsdp.gin",
        "--gin.MODEL_DIR='/tmp/unused'",
        "--gin.MIXTURE_OR_TASK_NAME='stdlib_py'",
        "--gin.TRAIN_STEPS=1",
        "--gin.BATCH_SIZE=16",
        "--gin.TASK_FEATURE_LENGTHS={'targets': 64}",
        "--gin.QwenMoeConfig.moe_dispatch='all_to_all'",
        "--gin.QwenMoeConfig.dtype='bfloat16'",
        "--gin.QwenMoeConfig.moe_intermediate_size=128",
        "--gin.QwenMoeConfig.num_layers=1",  # its 4: a compile of 25 s, not 10
        "--gin.planner.plan.meshes=[(2, 1, 8, 1)]",
        "--topology=h100:2x8",
        "--max_candidates=1",
        f"--json={out}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "16 x NVIDIA H100 80GB HBM3" in proc.stdout
    assert "(2 hosts: 50 GB/s between them)" in proc.stdout
    assert "55.88 GiB (XLA_CLIENT_MEM_FRACTION of its HBM)" in proc.stdout
    assert "'chunked' attention's blocks stand in for it" in proc.stdout  # no cuDNN here
    assert "Traceback" not in proc.stderr
    (row,) = [c for c in json.loads(out.read_text())["candidates"] if c["status"] == "fits"]
    assert row["moe_dispatch"] == "all_to_all" and row["flops"] > 0 and row["bytes_accessed"] > 0
    assert 0 < row["host_collective_bytes"] < row["collective_bytes"]
    moe = row["moe_collectives"]["all-to-all"]
    assert moe["ring_bytes"] > 0 and moe["host_ring_bytes"] == 0
    network = row["host_collective_bytes"] / chips.CHIPS["h100"].host_link_bytes_per_s
    assert row["predicted_s"] >= network


@pytest.mark.slow
def test_command_line_on_a_tpu_topology_says_what_the_compiler_could_not_fit():
    """`--topology=v5e:2x4` (libtpu, no TPU): a batch no v5e chip holds gets the TPU
    compiler's own RESOURCE_EXHAUSTED line per candidate and a "Nothing fits" summary; each
    row's GiB/device is the compiler's figure, which holds the arguments (the training state)
    already (it was counted twice: the state added to it)."""
    proc = run_plan(
        "--gin_file=gin/gptj_pretrain.gin",
        "--topology=v5e:2x4",
        "--max_candidates=2",
        "--gin.BATCH_SIZE=4096",
        "--gin.TASK_FEATURE_LENGTHS={'targets': 2048}",
        "--gin.GPTJConfig.num_layers=1",
        "--gin.GPTJConfig.intermediate_size=131072",  # a state of 0.1 GiB a chip
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on v5e:2x4: 8 x TPU v5 lite" in proc.stdout
    assert proc.stdout.count("does not fit: RESOURCE_EXHAUSTED") == 2
    assert "exceeds available HBM" in proc.stdout
    assert "Nothing fits: the smallest candidate" in proc.stdout
    needs = re.findall(r"HLO temporaries \(([\d.]+)G\)", proc.stdout)
    assert len(needs) == 2 and all(f"| no | {need} |" in proc.stdout for need in needs)
    assert f"needs {min(needs, key=float)} GiB/device." in proc.stdout


def tiny_moe_run() -> plan_run.Run:
    """A two-layer Qwen3-MoE of 4 experts (2 per token) planned over (data, fsdp, tensor),
    which the planner extends with an `expert` axis."""
    from flaxlm.models.qwen_moe import QwenMoeConfig

    config = QwenMoeConfig(
        model_type="qwen3_moe",
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        max_position_embeddings=64,
        dtype="float32",
        param_dtype="float32",
        remat_policy="none",
        scan_layers=False,
    )
    axes, mesh = plan_run.with_expert_axis(("data", "fsdp", "tensor"), (1, -1, 1))
    run = tiny_run()
    return dataclasses.replace(
        run,
        model=DecoderOnlyModel(config),
        axis_names=axes,
        base=dataclasses.replace(run.base, mesh_shape=mesh),
    )


@pytest.mark.slow
def test_an_moe_model_is_planned_over_an_expert_axis():
    """For a model with experts the planner enumerates an `expert` axis (before tensor);
    an expert split the experts do not divide is rejected naming it, one they divide
    compiles (its dispatch's collectives counted), and the overrides name the axes."""
    assert plan_run.with_expert_axis(("data", "fsdp", "tensor"), (1, -1, 1)) == (
        ("data", "fsdp", "expert", "tensor"),
        (1, -1, 1, 1),
    )
    assert plan_run.with_expert_axis(("fsdp", "expert"), (2, 4)) == (("fsdp", "expert"), (2, 4))
    p = planner.Planner(tiny_moe_run(), jax.devices(), CHIP)
    shapes = {k.mesh_shape for k in p.first_stage()}
    assert (1, 2, 4, 1) in shapes and (1, 1, 8, 1) in shapes
    reason = p.reject_reason(dataclasses.replace(p.run.base, mesh_shape=(1, 1, 8, 1)))
    assert "experts" in reason and "not divisible by expert=8" in reason
    ep = p.evaluate(dataclasses.replace(p.run.base, mesh_shape=(1, 2, 4, 1)))
    assert ep.status == "fits" and ep.predicted_s > 0 and ep.collective_bytes > 0
    assert ep.knobs.moe_dispatch == "all_gather" and ep.state_bytes > 0
    assert ep.moe_collectives["all-gather"]["ring_bytes"] > 0  # the dispatch's, apart
    assert report.overrides(p.run, ep.knobs)[0] == (
        "--gin.Partitioner.mesh_axis_names=\"('data', 'fsdp', 'expert', 'tensor')\""
    )


def one_device_planner(run: plan_run.Run) -> planner.Planner:
    """A planner of `run` (stepped by SGD) on one device, for the tests of how loops over
    layers are priced, which no mesh changes: the step compiles without SPMD partitioning
    (with SGD, 2/3 the time of AdamW's step on 8 devices)."""
    return planner.Planner(with_sgd(run), jax.devices()[:1], CHIP)


@pytest.mark.slow
def test_steps_of_unlike_layers_microbatched_or_scanned_are_priced_as_their_one_batch_twin():
    """A model whose first layers are dense and wide (DeepSeek-V3's kind), whose 1- and
    2-layer cuts would hold those alone: unscanned microbatches count as the step they split
    (FLOPs of 2 microbatches equal one batch's), and its MoE layers scanned apart from the
    dense ones (`first_scanned_layer`) are priced from cuts of the dense layers + 1 and + 2
    MoE layers: the unrolled step's FLOPs."""
    run = tiny_moe_run()
    config = dataclasses.replace(
        run.model.config, num_layers=4, mlp_only_layers=(0, 1), intermediate_size=1024
    )
    p = one_device_planner(dataclasses.replace(run, model=DecoderOnlyModel(config), batch_size=16))
    one = p.evaluate(p.run.base)
    two = p.evaluate(dataclasses.replace(p.run.base, num_microbatches=2))
    scanned = p.evaluate(dataclasses.replace(p.run.base, scan_layers=True))
    assert one.status == two.status == scanned.status == "fits", (two.reason, scanned.reason)
    assert two.flops == pytest.approx(one.flops, rel=0.05)
    assert two.step.cost()["flops"] < 0.7 * one.flops  # the loop's body counted once
    assert p.first_scanned == 2 and scanned.flops == pytest.approx(one.flops, rel=0.05)


@pytest.mark.slow
def test_a_hybrid_scanned_in_cycles_is_priced_as_its_unrolled_twin():
    """(linear, full) three times and a linear layer, scanned as a cycle of two blocks
    (`scan_period`; Qwen3.5's is four) and the last layer unrolled (`scan_tail`): priced from
    cuts of one and two cycles with the tail, the unrolled step's FLOPs (cuts of one and two
    layers priced every layer as a full one, with a linear one less outside; cuts without the
    tail, a linear layer of seven less)."""
    from flaxlm.models.qwen3_next import Qwen3NextConfig

    config = Qwen3NextConfig(
        model_type="qwen3_5_text", vocab_size=128, hidden_size=64, num_layers=7, num_heads=4,
        num_kv_heads=2, head_dim=64, intermediate_size=128, num_experts=0,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, max_position_embeddings=64, dtype="float32",
        param_dtype="float32", remat_policy="none", scan_layers=False,
        layer_types=("linear_attention", "full_attention") * 3 + ("linear_attention",),
    )  # fmt: skip
    p = one_device_planner(dataclasses.replace(tiny_run(), model=DecoderOnlyModel(config)))
    one = p.evaluate(p.run.base)
    scanned = p.evaluate(dataclasses.replace(p.run.base, scan_layers=True))
    assert one.status == scanned.status == "fits", scanned.reason
    assert (p.period, p.tail) == (2, 1)
    assert scanned.flops == pytest.approx(one.flops, rel=0.05)


def test_calibration_cuts_of_gemma4_keep_the_layers_kv_shared_ones_reuse():
    """Gemma 4 E2B's shape in miniature (7 layers, the last 4 reusing the keys and values of
    the 3 before): a scan stacks the 4, so the calibration cuts of s + p and s + 2p layers
    keep the 3 and share the rest (a cut left at 4 shared layers of 5 would be refused)."""
    from flaxlm.models.gemma4 import Gemma4Config

    s, g = "sliding_attention", "full_attention"
    config = Gemma4Config(
        vocab_size=128, hidden_size=32, num_layers=7, num_heads=2, num_kv_heads=1, head_dim=8,
        global_head_dim=16, intermediate_size=32, hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=128, layer_types=(s, s, g, s, g, s, g),
        num_kv_shared_layers=4, scan_layers=True,
    )  # fmt: skip
    p = planner.Planner(
        dataclasses.replace(tiny_run(), model=DecoderOnlyModel(config)), jax.devices(), CHIP
    )
    assert (p.first_scanned, p.period, p.tail) == (3, 2, 0)
    for n in (5, 7):
        cut = p.model(p.run.base, num_layers=n).config
        assert cut.kv_sources[:3] == (0, 1, 2) and cut.num_kv_shared_layers == n - 3
        assert cut.per_layer_types == config.per_layer_types[:n]


def moe_gin_run(bindings: Sequence[str] = ()) -> tuple[Any, Any]:
    """run_from_gin of qwen3_moe_tiny under fsdp.gin with `bindings` (a user's `--gin.`
    values): (the Run, the bound Partitioner mesh_shape)."""
    gin.clear_config()
    try:
        files = (
            "gin/models/qwen3_moe_tiny.gin",
            "gin/partitioning/fsdp.gin",
            "gin/runs/pretrain.gin",
        )
        macros = [
            "MODEL_DIR='/tmp/unused'",
            "MIXTURE_OR_TASK_NAME='stdlib_py'",
            "TASK_FEATURE_LENGTHS={'targets': 32}",
            "BATCH_SIZE=8",
            "TRAIN_STEPS=1",
            *bindings,
        ]
        gin_utils.parse_gin([os.path.join(REPO, f) for f in files], macros, [])
        return plan_run.run_from_gin(), gin.query_parameter("partitioning.Partitioner.mesh_shape")
    finally:
        gin.clear_config()


def test_a_gin_run_of_an_moe_model_gets_an_expert_axis():
    """run_from_gin: qwen3_moe_tiny under fsdp.gin is planned over (data, fsdp, expert,
    tensor), the bound mesh with expert = 1."""
    run, _ = moe_gin_run()
    assert run.axis_names == ("data", "fsdp", "expert", "tensor")
    assert run.base.mesh_shape == (1, -1, 1, 1)


def test_the_moe_dispatch_is_enumerated_where_the_expert_axis_is_split():
    """For a model with experts the first stage crosses each mesh whose `expert` axis is split
    with every dispatch (the bound one first), and where fsdp is split too with the experts
    over (expert, fsdp) or not, a mesh with `expert` = 1 with the bound one alone; a dense
    model's candidates carry none; `meshes` limits the first stage; the overrides name the
    dispatch and the experts' split and bind them when given to the run's Gin files."""
    p = planner.Planner(tiny_moe_run(), jax.devices(), CHIP)
    assert p.run.base.moe_dispatch == "all_gather"
    first = p.first_stage()
    by_mesh = {}
    for k in first:
        if k.optimizer_sharding == "params":
            by_mesh.setdefault(k.mesh_shape, []).append((k.moe_dispatch, k.experts_over_fsdp))
    dispatches = ("all_gather", "all_to_all", "ragged")
    assert by_mesh[(1, 2, 4, 1)] == [(d, s) for d in dispatches for s in (False, True)]
    assert by_mesh[(1, 1, 8, 1)] == [(d, False) for d in dispatches]
    assert by_mesh[(1, 8, 1, 1)] == [("all_gather", False)]
    dense = planner.Planner(tiny_run(), jax.devices(), CHIP)
    assert {k.moe_dispatch for k in dense.first_stage()} == {None}
    assert "dispatch" not in report.header(dense.run)
    only = planner.Planner(tiny_moe_run(), jax.devices(), CHIP, meshes=[(2, 1, 4, 1)])
    assert [(k.optimizer_sharding, k.moe_dispatch) for k in only.first_stage()] == [
        (s, d) for s in ("params", "zero1") for d in ("all_gather", "all_to_all", "ragged")
    ]
    with pytest.raises(ValueError, match="not a shape"):
        planner.Planner(tiny_moe_run(), jax.devices(), CHIP, meshes=[(2, 2)]).first_stage()
    chosen = dataclasses.replace(
        p.run.base, mesh_shape=(1, 2, 4, 1), moe_dispatch="ragged", experts_over_fsdp=True
    )
    assert p.model(chosen).config.moe_dispatch == "ragged"
    assert p.partitioner(chosen).mesh_axes(("expert",)) == P(("expert", "fsdp"))
    assert "dispatch=ragged experts_over_fsdp" in report.knobs_text(chosen)
    assert report.header(p.run)[3] == "dispatch"
    flags = report.overrides(p.run, chosen)
    assert "--gin.QwenMoeConfig.moe_dispatch=\"'ragged'\"" in flags
    assert "--gin.Partitioner.experts_over_fsdp=True" in flags
    bindings = gin_utils.rewrite_gin_args(["x", *shlex.split(" ".join(flags))])[1:]
    run, mesh_shape = moe_gin_run([b.split("=", 1)[1] for b in bindings])
    assert mesh_shape == (1, 2, 4, 1)
    assert run.axis_names == ("data", "fsdp", "expert", "tensor")
    assert run.base.moe_dispatch == "ragged" and run.base.mesh_shape == (1, 2, 4, 1)
    assert run.base.experts_over_fsdp
