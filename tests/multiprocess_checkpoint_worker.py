"""Run by test_multiprocess.py: two processes train the tiny GPT-J one step on a (1, 8, 1)
mesh spanning both, save a checkpoint, and record its params and the next step's loss."""

import json
import os
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=sys.argv[1], num_processes=int(sys.argv[2]), process_id=int(sys.argv[3])
)
model_dir = sys.argv[4]

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from flaxlm.checkpoints import checkpointer  # noqa: E402
from flaxlm.parallel.partitioning import Partitioner  # noqa: E402
from flaxlm.training import steps  # noqa: E402
from tests.helpers import adamw, feature_lengths, random_batch, tiny_gptj  # noqa: E402

setup = steps.Setup(tiny_gptj(), Partitioner(mesh_shape=(1, 8, 1)), adamw(), feature_lengths())


def global_batch(seed):
    """The same numpy batch on every process, as one global array over the mesh."""
    return {
        name: jax.make_array_from_callback(
            x.shape, setup.partitioner.batch_sharding(x.ndim), lambda index, x=x: x[index]
        )
        for name, x in random_batch(seed=seed).items()
    }


step = setup.partition_train_step(
    steps.make_train_step(setup.model, setup.partitioner, 1e-2, seed=0)
)
state, _ = step(setup.init_state(), global_batch(0))
ckpt = checkpointer.Checkpointer(model_dir)
ckpt.save(1, state, None, "config")
ckpt.close()
params = multihost_utils.process_allgather(state.params, tiled=True)
_, metrics = step(state, global_batch(1))
if jax.process_index() == 0:
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree.leaves_with_path(params)}
    np.savez(os.path.join(model_dir, "params.npz"), **flat)
print("RESULT " + json.dumps({"next_loss": float(metrics["loss"])}), flush=True)
os._exit(0)
