"""seqio's length checks of a feature converter's input and output, decided when the pipeline
is built wherever the lengths are fixed.

A seqio `FeatureConverter` checks its input (each feature's length <= the task's) and its
output (each model feature's length == the model's) with `_check_lengths`: a `map` whose
function asserts every feature's length, traced again for every dataset. A host's logical
input shards are a dataset each, so a run on 8 data-parallel rows traced these assertions 16
times, 40% of building its pipelines (benchmarks/HISTORY.md, "Thirty-sixth session").
`check_lengths` decides the same checks differently, with the same outcome:

- a feature whose length the dataset's spec fixes (a converter's padded or packed output)
  is checked when the pipeline is built: a ValueError then, where seqio's assertion would
  fail at the first example;
- the others (the task's features, of any length) get seqio's assertions per example.
  (Those stay in the dataset's own function: a `tf.function` of assertions called from it
  would be a stateful call, which tf.data refuses to checkpoint.)

`use_static_length_checks()` has seqio's converters call it; flaxlm's input pipelines do so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import seqio
import tensorflow as tf

_SEQIO_CHECK_LENGTHS = seqio.feature_converters._check_lengths  # noqa: SLF001


def _message(feat: str, expected: int, strict: bool, error_label: str) -> str:
    """seqio's message for a feature whose length fails its check."""
    if strict:
        return (
            f"Feature '{feat}' has length not equal to the expected length of {expected} "
            f"during {error_label} validation"
        )
    return (
        f"Feature '{feat}' has length not less than or equal to the expected length of "
        f"{expected} during {error_label} validation"
    )


def static_length(spec: Any, axis: int) -> int | None:
    """The length along `axis` that a feature's spec fixes; None where examples may differ
    (an unknown dimension, a ragged feature)."""
    if not isinstance(spec, tf.TensorSpec) or spec.shape.rank is None:
        return None
    if not -spec.shape.rank <= axis < spec.shape.rank:
        return None
    return spec.shape[axis]


def check_lengths(
    ds: tf.data.Dataset,
    expected_lengths: Mapping[str, int],
    sequence_axis_mapping: Mapping[str, int],
    strict: bool,
    error_label: str,
) -> tf.data.Dataset:
    """`seqio.feature_converters._check_lengths(...)`'s checks (its signature): each feature
    of `ds` that `expected_lengths` names has length == (`strict`) or <= its expected length
    along its sequence axis; fixed lengths are checked now, the others per example."""
    spec = ds.element_spec
    dynamic = {}
    for feat, expected in expected_lengths.items():
        if feat not in spec:
            continue  # seqio checks only the features the examples have
        axis = sequence_axis_mapping[feat]
        length = static_length(spec[feat], axis)
        if length is None:
            dynamic[feat] = expected
        elif (length != expected) if strict else (length > expected):
            raise ValueError(f"{_message(feat, expected, strict, error_label)}: got {length}.")
    if not dynamic:
        return ds
    return _SEQIO_CHECK_LENGTHS(ds, dynamic, sequence_axis_mapping, strict, error_label)


def use_static_length_checks() -> None:
    """Makes seqio's feature converters check lengths with `check_lengths` (they look
    `_check_lengths` up in their module when they validate a dataset)."""
    seqio.feature_converters._check_lengths = check_lengths  # noqa: SLF001
