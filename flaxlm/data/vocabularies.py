"""seqio Vocabularies over HuggingFace tokenizers loaded from a local directory.

seqio ships `ByteVocabulary` and `SentencePieceVocabulary`; this adds the tokenizer that
comes with an HF checkpoint, so a task can feed a model its own ids:

    vocab = HuggingFaceVocabulary("/path/to/hf_dir")
    seqio.Feature(vocabulary=vocab, add_eos=True)

Padding: seqio pads with id 0 and its feature converters treat id 0 as padding (no loss
weight, segment id 0). Most HF tokenizers give id 0 to a real token (GPT-2's "!", Llama's
<unk>, RoBERTa's <s>): it is still encoded and decoded, but a target 0 carries no loss
weight. `pad_id` is therefore seqio's 0, whatever the tokenizer's own pad token is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import gin
import numpy as np
import seqio
import tensorflow as tf
from etils import epath

# seqio's own vocabularies, bindable in Gin files as `@seqio.SentencePieceVocabulary()`
# (`seqio.SentencePieceVocabulary.sentencepiece_model_file = '/path/spm.model'`) and
# `@seqio.ByteVocabulary()`.
gin.external_configurable(seqio.SentencePieceVocabulary, module="seqio")
gin.external_configurable(seqio.ByteVocabulary, module="seqio")


_LOAD_LOCK = threading.Lock()


@gin.configurable
class HuggingFaceVocabulary(seqio.Vocabulary):
    """A seqio Vocabulary backed by `transformers.AutoTokenizer` from a local directory.

    Encoding adds no special tokens (seqio appends EOS itself when a feature asks for it).
    The tokenizer is loaded on first use, so the object pickles cheaply (seqio caching).
    """

    def __init__(self, path: str, extra_ids: int = 0):
        if not epath.Path(path).exists():
            raise FileNotFoundError(
                f"Tokenizer directory {path!r} not found; point HuggingFaceVocabulary at a "
                "local directory saved with `tokenizer.save_pretrained`."
            )
        self._path = str(path)
        self._tokenizer: Any = None
        self._prefix: tuple[int, ...] | None = None
        super().__init__(extra_ids=extra_ids)

    @property
    def tokenizer(self) -> Any:
        # tf.data calls this from several threads at once: one loads, and transformers' lazy
        # imports are not thread-safe, so the tf ops load it first in the tracing thread.
        with _LOAD_LOCK:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self._path, local_files_only=True)
        return self._tokenizer

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tokenizer"] = None
        return state

    # ------------------------------------------------------------------ ids

    @property
    def bos_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @property
    def prefix_ids(self) -> tuple[int, ...]:
        """The tokens the tokenizer adds before a text with its special tokens (Llama's and
        Gemma's BOS; nothing for Qwen or GPT-2): what an HF model reads first."""
        if self._prefix is None:
            probe = "a"
            plain = list(self.tokenizer(probe, add_special_tokens=False)["input_ids"])
            full = list(self.tokenizer(probe)["input_ids"])
            start = next(
                (i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain),
                0,
            )
            self._prefix = tuple(int(t) for t in full[:start])
        return self._prefix

    def encode_text(self, text: str) -> list[int]:
        """Ids of `text` with the tokenizer's special tokens, as `tokenizer(text)` gives them
        (what TRL feeds a model for plain text)."""
        return [int(i) for i in self.tokenizer(text)["input_ids"]]

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def unk_id(self) -> int | None:
        return self.tokenizer.unk_token_id

    @property
    def _base_vocab_size(self) -> int:
        return len(self.tokenizer)

    # ------------------------------------------------------------------ python

    def _encode(self, s: str) -> Sequence[int]:
        return self.tokenizer.encode(s, add_special_tokens=False)

    def _decode(self, ids: Iterable[int]) -> str:
        # seqio pads with 0; drop that padding, keep everything else (special tokens too).
        ids = [int(i) for i in ids]
        while ids and ids[-1] == self.pad_id:
            ids.pop()
        if self.eos_id is not None and ids and ids[-1] == self.eos_id:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ------------------------------------------------------------------ tf.data

    def _encode_tf(self, s: tf.Tensor) -> tf.Tensor:
        self.tokenizer  # noqa: B018  (loaded here, not in a tf.data thread)

        def encode(x: np.ndarray) -> np.ndarray:
            texts = np.asarray(x)
            if texts.ndim:
                raise ValueError("HuggingFaceVocabulary.encode_tf takes one string at a time.")
            return np.asarray(self._encode(texts.item().decode("utf-8")), np.int32)

        ids = tf.numpy_function(encode, [s], tf.int32, stateful=False)
        ids.set_shape([None])
        return ids

    def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
        self.tokenizer  # noqa: B018  (loaded here, not in a tf.data thread)

        def decode(x: np.ndarray) -> np.ndarray:
            x = np.asarray(x)
            if x.ndim == 1:
                return np.asarray(self._decode(x).encode("utf-8"), dtype=object)
            rows = [self._decode(r).encode("utf-8") for r in x.reshape(-1, x.shape[-1])]
            return np.asarray(rows, dtype=object).reshape(x.shape[:-1])

        out = tf.numpy_function(decode, [ids], tf.string, stateful=False)
        out.set_shape(ids.shape[:-1])
        return out

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, HuggingFaceVocabulary)
            and self._path == other._path
            and self.extra_ids == other.extra_ids
        )

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._path, self.extra_ids))

    def __repr__(self) -> str:
        return f"HuggingFaceVocabulary({self._path!r})"


def hf_prefix(vocabulary: seqio.Vocabulary) -> tuple[int, ...]:
    """What a model reading HF-form rows (`decoder_start_id=None`) reads before a text:
    an HF tokenizer's own prefix (`HuggingFaceVocabulary.prefix_ids`), nothing for a seqio
    vocabulary (which adds no special tokens)."""
    return tuple(getattr(vocabulary, "prefix_ids", ()))
