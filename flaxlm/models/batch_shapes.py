"""The model features a batch carries, known without the input pipeline: the one source of
the lengths a model reads (`model_feature_lengths`), which the run, the input pipeline, its
process and the planner all ask.

seqio's feature converters (and `features.py`'s) shape the batches; importing seqio imports
TensorFlow, which computing never needs. So a model names its converter lazily
(`ConverterClass`) and lists the features of an unpacked batch here, which
tests/test_models.py holds to what the converters give.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

# What each converter gives unpacked (packing adds `<stack>_segment_ids`, `<stack>_positions`).
DECODER_FEATURES = ("decoder_target_tokens", "decoder_input_tokens", "decoder_loss_weights")
ENCODER_DECODER_FEATURES = ("encoder_input_tokens", *DECODER_FEATURES)
ENCODER_FEATURES = ("encoder_input_tokens", "encoder_target_tokens", "encoder_loss_weights")


def batch_shapes_from(feature_lengths: Mapping[str, int], batch_size: int) -> dict[str, Any]:
    """`{feature: (batch, length)}` for the model features a converter produces."""
    return {k: (batch_size, v) for k, v in feature_lengths.items()}


def unpacked_shapes(model: Any, length: int, batch: int) -> dict[str, tuple[int, int]]:
    """`{feature: (batch, length)}` of `model`'s unpacked batch for `length`-long task
    features: its `UNPACKED_FEATURES`, else (a model from outside flaxlm) its converter's."""
    if model.UNPACKED_FEATURES:
        return {k: (batch, length) for k in model.UNPACKED_FEATURES}
    task_lengths = {k: length for k in model.TASK_FEATURES}
    lengths = model_feature_lengths(model.FEATURE_CONVERTER_CLS, task_lengths, pack=False)
    return batch_shapes_from(lengths, batch)


class ConverterClass:
    """A class attribute naming a seqio feature converter as "module:Class", imported when
    first read."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __get__(self, obj: Any, owner: type | None = None) -> type:
        module, name = self.where.split(":")
        return getattr(importlib.import_module(module), name)


DECODER_CONVERTER = ConverterClass("flaxlm.models.features:LMFeatureConverter")
ENCODER_DECODER_CONVERTER = ConverterClass("seqio:EncDecFeatureConverter")
MASKED_LM_CONVERTER = ConverterClass("flaxlm.models.features:MaskedLMFeatureConverter")


def converter_reference(model: Any) -> str | None:
    """The "module:Class" of `model`'s feature converter (`ConverterClass`), read without
    importing it; None for a converter given as a class."""
    attribute = inspect.getattr_static(type(model), "FEATURE_CONVERTER_CLS", None)
    return attribute.where if isinstance(attribute, ConverterClass) else None


def model_feature_lengths(
    converter: str | Callable[..., Any], task_feature_lengths: Mapping[str, int], pack: bool
) -> dict[str, int] | None:
    """`{model feature: length}` of the batches `converter` makes of a task's features
    `task_feature_lengths` long, packed or not (`pack`).

    `converter`: a converter class, or what makes one (`converter(pack=...)`:
    `pipeline.ConverterFactory`), asked (its `get_model_feature_lengths`); or its
    "module:Class" (`converter_reference`), read without importing it: for the decoder-only
    converter (`DECODER_CONVERTER`) on a language-modelling task (its only feature
    `targets`), `DECODER_FEATURES`, packed with `decoder_segment_ids` and
    `decoder_positions`, all of the targets' length; None for any other (only the converter
    says). tests/test_input_process.py holds that rule to the converter."""
    lengths = dict(task_feature_lengths)
    if not isinstance(converter, str):
        return dict(converter(pack=pack).get_model_feature_lengths(lengths))
    if converter != DECODER_CONVERTER.where or set(lengths) != {"targets"}:
        return None
    names = DECODER_FEATURES + (("decoder_segment_ids", "decoder_positions") if pack else ())
    return dict.fromkeys(names, lengths["targets"])
