"""A `--tasks_module` for tests (test-only): registers the usual tasks and appends every batch
this process reads (all its features, as the steps get them) to
`$FLAXLM_TEST_RECORD_DIR/rows.jsonl`: the rows a run's model really reads."""

import json
import os

import tasks  # noqa: F401
from flaxlm.data import pipeline

RECORD_DIR = os.environ["FLAXLM_TEST_RECORD_DIR"]
_next_numpy = pipeline.DataIterator.next_numpy


def _recording_next_numpy(self):
    batch = _next_numpy(self)
    with open(os.path.join(RECORD_DIR, "rows.jsonl"), "a") as f:
        f.write(json.dumps({k: v.tolist() for k, v in batch.items()}) + "\n")
    return batch


pipeline.DataIterator.next_numpy = _recording_next_numpy
