"""Feature converters and batch shapes: the seqio contract between tasks and models."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import seqio
import tensorflow as tf


class MaskedLMFeatureConverter(seqio.FeatureConverter):
    """Encoder-only masked-LM features from aligned `inputs` and `targets`.

    `inputs` are the (masked) token ids the encoder reads; `targets` are the original ids,
    negated at the positions chosen for the loss (see `tasks.preprocessors.mask_tokens`;
    seqio's packing drops zeros, so "no loss" cannot be a 0). Unlike
    `seqio.EncoderFeatureConverter`, whose loss covers only positions that show the mask
    id, the loss here covers every chosen position, including those BERT-style masking left
    unchanged or replaced by a random token.
    """

    TASK_FEATURES = {
        "inputs": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "targets": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
    }
    MODEL_FEATURES = {
        "encoder_input_tokens": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "encoder_target_tokens": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "encoder_loss_weights": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
    }
    PACKING_FEATURE_DTYPES = {"encoder_segment_ids": tf.int32, "encoder_positions": tf.int32}

    def _convert_features(
        self, ds: tf.data.Dataset, task_feature_lengths: Mapping[str, int]
    ) -> tf.data.Dataset:
        def convert(features: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
            out = {
                "encoder_input_tokens": features["inputs"],
                "encoder_target_tokens": tf.abs(features["targets"]),
                "encoder_loss_weights": tf.cast(features["targets"] < 0, tf.int32),
            }
            if self.pack:
                out["encoder_segment_ids"] = features["inputs_segment_ids"]
                out["encoder_positions"] = features["inputs_positions"]
            return out

        ds = self._pack_or_pad(ds, task_feature_lengths)
        return ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)

    def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> dict:
        length = task_feature_lengths["inputs"]
        names = ["encoder_input_tokens", "encoder_target_tokens", "encoder_loss_weights"]
        if self.pack:
            names += ["encoder_segment_ids", "encoder_positions"]
        return {name: length for name in names}


def batch_shapes_from(feature_lengths: Mapping[str, int], batch_size: int) -> dict[str, Any]:
    """`{feature: (batch, length)}` for the model features a converter produces."""
    return {k: (batch_size, v) for k, v in feature_lengths.items()}


class PromptFeatureConverter(seqio.FeatureConverter):
    """Prompts and their reference answers, as they are (never packed: `pack` is ignored):
    `prompt_tokens` from `inputs` and `answer_tokens` from `targets`, right-padded (and cut
    at the end) to their lengths. What a GRPO run samples from and rewards against."""

    TASK_FEATURES = {
        "inputs": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "targets": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
    }
    MODEL_FEATURES = {
        "prompt_tokens": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "answer_tokens": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
    }
    PACKING_FEATURE_DTYPES: dict[str, Any] = {}

    def __init__(self, pack: bool = False, **kwargs: Any):
        del pack
        super().__init__(pack=False, **kwargs)

    def _convert_features(
        self, ds: tf.data.Dataset, task_feature_lengths: Mapping[str, int]
    ) -> tf.data.Dataset:
        ds = self._pack_or_pad(ds, task_feature_lengths)
        return ds.map(
            lambda f: {"prompt_tokens": f["inputs"], "answer_tokens": f["targets"]},
            num_parallel_calls=tf.data.AUTOTUNE,
        )

    def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> dict:
        return {
            "prompt_tokens": task_feature_lengths["inputs"],
            "answer_tokens": task_feature_lengths["targets"],
        }
