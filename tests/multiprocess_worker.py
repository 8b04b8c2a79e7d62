"""Run by test_multiprocess.py as one of several processes joined by jax.distributed: which
rows of a batch each host feeds on several meshes, and on meshes spanning the processes the
mixture of experts with its `expert` axis, GRPO with LoRA through the paged engine, and the
aux-loss-free bias update (their results saved by process 0 to moe.npz, grpo.npz and
balance.npz)."""

import json
import os
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=sys.argv[1], num_processes=int(sys.argv[2]), process_id=int(sys.argv[3])
)

import numpy as np  # noqa: E402

from flaxlm.parallel.partitioning import Partitioner  # noqa: E402
from tests import multiprocess_cases  # noqa: E402
from tests.test_moe import fsdp_ep_loss_and_grads  # noqa: E402

EXPERT_AXES = ("data", "fsdp", "expert", "tensor")

out = {"process_index": jax.process_index(), "layouts": {}}
for shape in [(2, 4, 1), (1, 8, 1), (1, 4, 2), (1, 1, 8), (1, 1, 8, 1)]:
    names = EXPERT_AXES if len(shape) == 4 else ("data", "fsdp", "tensor")
    partitioner = Partitioner(mesh_shape=shape, mesh_axis_names=names)
    layout = partitioner.data_layout(16)
    # Each host feeds rows that identify its shard; the global array must hold them in order.
    local = np.full((layout.per_host_batch_size, 4), layout.shard_index, np.int32)
    sharding = partitioner.batch_sharding(2)
    global_batch = jax.make_array_from_process_local_data(sharding, local, (16, 4))
    total = int(jax.jit(lambda x: x.sum(), out_shardings=None)(global_batch))
    out["layouts"][str(shape)] = {
        "per_host": layout.per_host_batch_size,
        "shard": layout.shard_index,
        "num_shards": layout.num_shards,
        "sum": total,
    }

(loss, sums), grads = fsdp_ep_loss_and_grads()
if jax.process_index() == 0:
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    arrays = {f"grad{jax.tree_util.keystr(path)}": g for path, g in leaves}
    np.savez("moe.npz", loss=loss, **{f"sums/{k}": v for k, v in sums.items()}, **arrays)
for name, case in [
    ("grpo", multiprocess_cases.grpo_lora_steps),
    ("balance", multiprocess_cases.aux_free_balance_steps),
]:
    result = case()  # on every process: its collectives need them all
    if jax.process_index() == 0:
        np.savez(f"{name}.npz", **result)
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
