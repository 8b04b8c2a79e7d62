"""A `--tasks_module` for tests (test-only): registers the usual tasks and records, under
`$FLAXLM_TEST_RECORD_DIR`, what the process's model really reads: every batch its data
iterators give (all features, as the steps get them) in `rows.jsonl`, and the prompt ids
`infer` reads its examples as and GRPO's rollouts sample from in `prompts.jsonl`
(`{"by": "infer" | "grpo", "prompts": [[id, ...], ...]}` a line)."""

import json
import os

import tasks  # noqa: F401
from flaxlm.data import pipeline
from flaxlm.runs import grpo, infer

RECORD_DIR = os.environ["FLAXLM_TEST_RECORD_DIR"]
_next_numpy = pipeline.DataIterator.next_numpy
_read_examples = infer.read_examples
_sample = grpo.Rollouts.sample


def _append(name: str, record: dict) -> None:
    with open(os.path.join(RECORD_DIR, name), "a") as f:
        f.write(json.dumps(record) + "\n")


def _recording_next_numpy(self):
    batch = _next_numpy(self)
    _append("rows.jsonl", {k: v.tolist() for k, v in batch.items()})
    return batch


def _recording_read_examples(*args, **kwargs):
    examples, vocabulary, name = _read_examples(*args, **kwargs)
    _append("prompts.jsonl", {"by": "infer", "prompts": [e.input_ids for e in examples]})
    return examples, vocabulary, name


def _recording_sample(self, state, prompts, step):
    _append("prompts.jsonl", {"by": "grpo", "prompts": [list(map(int, p)) for p in prompts]})
    return _sample(self, state, prompts, step)


pipeline.DataIterator.next_numpy = _recording_next_numpy
infer.read_examples = _recording_read_examples
grpo.Rollouts.sample = _recording_sample
