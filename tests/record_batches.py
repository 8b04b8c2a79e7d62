"""A `--tasks_module` for test_multiprocess (test-only): registers the usual tasks and a tiny
repeating text task over `$FLAXLM_TEST_RECORD_DIR/part*.txt`, and appends each batch of rows
this process feeds (`decoder_target_tokens`) to `$FLAXLM_TEST_RECORD_DIR/process_<i>.jsonl`."""

import json
import os

import jax

import tasks  # noqa: F401
from flaxlm.data import pipeline
from tasks.text_files import register_text_files_task

RECORD_DIR = os.environ["FLAXLM_TEST_RECORD_DIR"]
register_text_files_task(
    name="test_tiny_lines", split_files={"train": os.path.join(RECORD_DIR, "part*.txt")}
)
_next_numpy = pipeline.DataIterator.next_numpy


def _recording_next_numpy(self):
    batch = _next_numpy(self)
    with open(os.path.join(RECORD_DIR, f"process_{jax.process_index()}.jsonl"), "a") as f:
        f.write(json.dumps(batch["decoder_target_tokens"].tolist()) + "\n")
    return batch


pipeline.DataIterator.next_numpy = _recording_next_numpy
