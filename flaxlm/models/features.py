"""Feature converters and batch shapes: the seqio contract between tasks and models."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import seqio
import tensorflow as tf

from flaxlm.models.row_start import RowStart


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


def decode_signed(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """`(tokens, weights)` of signed-offset ids `x` (the chat and preference tasks' encoding:
    a token `id` that carries loss is stored as `id + 1`, one that does not as `-(id + 1)`,
    and 0 is padding): `tokens = |x| - 1` (0 at padding), `weights = int32(x > 0)`."""
    x = tf.convert_to_tensor(x)
    tokens = tf.where(x != 0, tf.abs(x) - 1, tf.zeros_like(x))
    return tokens, tf.cast(x > 0, tf.int32)


class ReadsRowStart:
    """A decoder-only converter that reads its rows from the run's row start
    (`row_start.RowStart`), which the run hands it through `reading` (the data pipeline's
    `ConverterFactory`), never through a constructor argument a Gin binding could drop.

    seqio's form (`decoder_start_id` an int): the start token first, the targets shifted
    right (seqio's `bos_id`). The HF form: `hf_prefix` (what the tokenizer adds in front,
    e.g. its BOS; empty where it adds nothing, or where the task rendered the whole
    sequence itself: `RENDERED_ROWS`) then the row, of which the model reads all but the
    last token and predicts all but the first. No token is inserted, so the first token of
    a row without a BOS has no prediction, as in HF. Packed, each segment starts as an
    unpacked row would.
    """

    # The task renders each row whole (a chat template's BOS included): no prefix is added.
    RENDERED_ROWS = False
    hf_prefix: tuple[int, ...] | None = None  # None: seqio's form
    eos_id: int | None = None  # the HF form: the task vocabulary's EOS (not doubled)

    def reading(self, row_start: RowStart, vocabulary: Any) -> Any:
        """A copy of this converter that reads its rows from `row_start`; `vocabulary` (the
        task's) gives the HF form's prefix and EOS."""
        out = copy.copy(self)
        if row_start.hf_form:
            out.hf_prefix = () if self.RENDERED_ROWS else row_start.ids(vocabulary)
            out.eos_id = getattr(vocabulary, "eos_id", None)
        else:
            out.hf_prefix = None
            out._bos_id = row_start.decoder_start_id  # seqio's start token  # noqa: SLF001
        return out


def shifted_rows(
    converter: seqio.FeatureConverter, ds: tf.data.Dataset, length: int
) -> tf.data.Dataset:
    """HF-form decoder features of `ds`'s signed-offset `targets` rows (see `decode_signed`;
    each row already holds the whole sequence the model reads, BOS included): inputs
    `row[:-1]`, targets and loss weights `row[1:]`, packed or padded to `length` as
    `converter.pack` says (segments and positions from the packing)."""

    def split(features: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        row = features["targets"][: length + 1]
        return {"targets": row[1:], "inputs": row[:-1]}

    ds = ds.filter(lambda f: tf.size(f["targets"]) > 1).map(split)
    ds = converter._pack_or_pad(ds, {"targets": length, "inputs": length})  # noqa: SLF001

    def convert(features: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        tokens, weights = decode_signed(features["targets"])
        out = {
            "decoder_target_tokens": tokens,
            "decoder_input_tokens": decode_signed(features["inputs"])[0],
            "decoder_loss_weights": weights,
        }
        if converter.pack:
            out["decoder_segment_ids"] = features["targets_segment_ids"]
            out["decoder_positions"] = features["targets_positions"]
        return out

    return ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)


class LMFeatureConverter(ReadsRowStart, seqio.DecoderFeatureConverter):
    """seqio's decoder-only converter (LM and prefix-LM tasks), or in the HF form the rows
    as HF feeds them (`ReadsRowStart`). A prefix-LM task's `inputs` join the sequence as
    context without loss (attended causally, as in HF), its `targets` carry the loss. In the
    HF form a row whose text already ended with EOS does not get a second one (seqio appends
    EOS to every `targets`; TRL appends it once).
    """

    def __call__(
        self, ds: tf.data.Dataset, task_feature_lengths: Mapping[str, int]
    ) -> tf.data.Dataset:
        if self.hf_prefix is None:
            return super().__call__(ds, task_feature_lengths)
        if "suffixes" in task_feature_lengths:
            raise ValueError(
                "Prefix-suffix LM tasks are read with seqio's start token only: this run reads "
                "its rows in the HF form (it starts from an HF checkpoint)."
            )
        length = self.get_model_feature_lengths(task_feature_lengths)["decoder_target_tokens"]
        prefix = tf.constant(self.hf_prefix, tf.int32, shape=[len(self.hf_prefix)])
        eos = self.eos_id

        def signed(features: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
            targets = tf.cast(features["targets"], tf.int32)
            if eos is not None:  # "...<eos>" + appended EOS: one EOS, as TRL appends it
                doubled = tf.logical_and(
                    tf.size(targets) >= 2, tf.reduce_all(tf.equal(targets[-2:], eos))
                )
                targets = tf.cond(doubled, lambda: targets[:-1], lambda: targets)
            context = prefix
            if "inputs" in features:
                context = tf.concat([prefix, tf.cast(features["inputs"], tf.int32)], 0)
            return {"targets": tf.concat([-(context + 1), targets + 1], 0)}

        ds = ds.map(signed, num_parallel_calls=tf.data.AUTOTUNE)
        return shifted_rows(self, ds, length)

    def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> dict:
        lengths = dict(super().get_model_feature_lengths(task_feature_lengths))
        if self.hf_prefix is not None:  # the HF form attends causally over the whole row
            lengths.pop("decoder_causal_attention", None)
        return lengths


class ChatFeatureConverter(ReadsRowStart, seqio.FeatureConverter):
    """Decoder-only LM features from signed-offset `targets` (see `decode_signed`), packed
    or padded as seqio's LM converter does them.

    The features are those `seqio.DecoderFeatureConverter` gives a plain `targets` task
    (`decoder_input_tokens` the targets shifted right, restarting at every packed segment)
    except that `decoder_loss_weights` is the loss mask the task encoded in the signs: one on
    the tokens the model must learn to produce (a chat's assistant turns), zero on the rest
    and on padding. Packing sees only nonzero values, so a token id 0 (stored as +-1) is
    packed like any other.
    """

    TASK_FEATURES = {"targets": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32)}
    MODEL_FEATURES = {
        "decoder_target_tokens": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "decoder_input_tokens": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "decoder_loss_weights": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
    }
    PACKING_FEATURE_DTYPES = {"decoder_segment_ids": tf.int32, "decoder_positions": tf.int32}
    RENDERED_ROWS = True  # the chat template renders each row whole, its BOS included

    def _convert_example(self, features: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        tokens, weights = decode_signed(features["targets"])
        segment_ids = features.get("targets_segment_ids")
        out = {
            "decoder_target_tokens": tokens,
            "decoder_input_tokens": seqio.utils.make_autoregressive_inputs(
                tokens, sequence_id=segment_ids, bos_id=self.bos_id
            ),
            "decoder_loss_weights": weights,
        }
        if self.pack:
            out["decoder_segment_ids"] = segment_ids
            out["decoder_positions"] = features["targets_positions"]
        return out

    def _convert_features(
        self, ds: tf.data.Dataset, task_feature_lengths: Mapping[str, int]
    ) -> tf.data.Dataset:
        if self.hf_prefix is not None:
            prefix = tf.constant([-(t + 1) for t in self.hf_prefix], tf.int32)
            ds = ds.map(lambda f: {**f, "targets": tf.concat([prefix, f["targets"]], 0)})
            return shifted_rows(self, ds, task_feature_lengths["targets"])
        ds = self._pack_or_pad(ds, task_feature_lengths)
        return ds.map(self._convert_example, num_parallel_calls=tf.data.AUTOTUNE)

    def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> dict:
        length = task_feature_lengths["targets"]
        names = list(self.MODEL_FEATURES)
        if self.pack:
            names += list(self.PACKING_FEATURE_DTYPES)
        return {name: length for name in names}


_PAIR_SPEC = seqio.FeatureConverter.FeatureSpec(dtype=tf.int32, rank=2, sequence_dim=1)


class PreferenceFeatureConverter(ReadsRowStart, seqio.FeatureConverter):
    """Preference pairs: signed-offset `chosen` and `rejected` (see `decode_signed`) as
    decoder-only features of shape `[2, L]` per example, row 0 the chosen sequence and row 1
    the rejected one: `decoder_target_tokens` (decoded ids, 0 at padding),
    `decoder_input_tokens` (each row shifted right, `bos_id` first) and
    `decoder_loss_weights` (one on the answer tokens, which the task encoded as positive).

    Both rows are trimmed or padded to `L`, the larger of the two task feature lengths. A
    pair is never packed, whatever `pack` says (an example is one pair, so the rows of a
    batch stay aligned pair by pair): `pack=True`, the default of every converter that
    flaxlm builds, is accepted and ignored, and `self.pack` is False.
    """

    TASK_FEATURES = {
        "chosen": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        "rejected": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
    }
    MODEL_FEATURES = {
        "decoder_target_tokens": _PAIR_SPEC,
        "decoder_input_tokens": _PAIR_SPEC,
        "decoder_loss_weights": _PAIR_SPEC,
    }
    PACKING_FEATURE_DTYPES: Mapping[str, tf.dtypes.DType] = {}
    RENDERED_ROWS = True  # as ChatFeatureConverter's

    def __init__(self, pack: bool = False, **kwargs: Any):
        del pack  # never packed (see the class docstring)
        super().__init__(pack=False, **kwargs)

    def _convert_example(self, features: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        tokens, weights = decode_signed(tf.stack([features["chosen"], features["rejected"]]))
        if self.hf_prefix is not None:  # the HF form: read row[:-1], predict row[1:]
            inputs = tf.stack([features["chosen_inputs"], features["rejected_inputs"]])
            return {
                "decoder_target_tokens": tokens,
                "decoder_input_tokens": decode_signed(inputs)[0],
                "decoder_loss_weights": weights,
            }
        shift = seqio.utils.make_autoregressive_inputs
        inputs = tf.stack([shift(tokens[row], bos_id=self.bos_id) for row in (0, 1)])
        return {
            "decoder_target_tokens": tokens,
            "decoder_input_tokens": inputs,
            "decoder_loss_weights": weights,
        }

    def _convert_features(
        self, ds: tf.data.Dataset, task_feature_lengths: Mapping[str, int]
    ) -> tf.data.Dataset:
        length = self._pair_length(task_feature_lengths)
        names: tuple[str, ...] = ("chosen", "rejected")
        if self.hf_prefix is not None:  # each row split before padding: nothing read past it
            prefix = tf.constant([-(t + 1) for t in self.hf_prefix], tf.int32)

            def split(features: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
                out = {}
                for name in ("chosen", "rejected"):
                    row = tf.concat([prefix, features[name]], 0)[: length + 1]
                    out[name], out[name + "_inputs"] = row[1:], row[:-1]
                return out

            ds = ds.map(split)
            names += ("chosen_inputs", "rejected_inputs")
        ds = seqio.utils.trim_and_pad_dataset(ds, {name: length for name in names})
        return ds.map(self._convert_example, num_parallel_calls=tf.data.AUTOTUNE)

    @staticmethod
    def _pair_length(task_feature_lengths: Mapping[str, int]) -> int:
        return max(task_feature_lengths["chosen"], task_feature_lengths["rejected"])

    def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> dict:
        length = self._pair_length(task_feature_lengths)
        return {name: length for name in self.MODEL_FEATURES}


class PromptFeatureConverter(seqio.FeatureConverter):
    """Prompts and their reference answers, as they are (never packed: `pack` is ignored):
    `prompt_tokens` from `inputs` and `answer_tokens` from `targets`, each id stored as
    `id + 1` (as `decode_signed` reads it), right-padded with 0 (and cut at the end) to their
    lengths: an id 0 is a real token of many HF tokenizers (Llama 3's, Qwen's and GPT-2's
    "!"), not padding. `unpadded_ids` gives a row's ids back. What a GRPO run samples from
    and rewards against."""

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
        ds = ds.map(
            lambda f: {"prompt_tokens": f["inputs"] + 1, "answer_tokens": f["targets"] + 1},
            num_parallel_calls=tf.data.AUTOTUNE,
        )
        lengths = self.get_model_feature_lengths(task_feature_lengths)
        return self._pack_or_pad(ds, lengths)

    def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> dict:
        return {
            "prompt_tokens": task_feature_lengths["inputs"],
            "answer_tokens": task_feature_lengths["targets"],
        }


def unpadded_ids(row: Sequence[int]) -> list[int]:
    """The ids of one row of `PromptFeatureConverter`'s features, padding dropped."""
    return [int(t) - 1 for t in row if t]
