"""A `--tasks_module` for test_multiprocess: registers the usual tasks, then makes process 0
(only) fail at its first metrics write, the way a missing TensorBoard once did in CI."""

import jax

import tasks  # noqa: F401
from flaxlm.training import metrics

if jax.process_index() == 0:

    def _fail(self, step, scalars):
        raise RuntimeError("injected failure on process 0")

    metrics.JsonlWriter.write_scalars = _fail
