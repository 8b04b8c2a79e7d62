"""JSON Lines files read with the file and line of every mistake: the input of `infer` and
`score` and of the JSONL and chat tasks.

Plain Python, so that inference on a JSONL file imports neither seqio nor TensorFlow.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any


def read_jsonl(path: str, required: Sequence[str] = ("in_text",)) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSONL file; a bad line fails naming the file and line."""
    return (record for _, record in read_numbered_jsonl(path, required))


def read_numbered_jsonl(
    path: str, required: Sequence[str] = ("in_text",)
) -> Iterator[tuple[int, dict[str, Any]]]:
    """`(line number, object)` of each JSON object of a JSONL file (blank lines skipped); a
    bad line fails naming the file and line. `required`: keys whose values must be strings."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{number}: not UTF-8 (byte {raw[e.start]:#x} at column "
                    f"{e.start + 1}); save the file as UTF-8."
                ) from e
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg}).") from e
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {line[:60]!r}.")
            missing = [k for k in required if not isinstance(record.get(k), str)]
            if missing:
                raise ValueError(f"{path}:{number}: missing string field(s) {missing}.")
            yield number, record
