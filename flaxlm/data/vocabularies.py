"""Vocabularies in Python: an HF checkpoint's tokenizer and seqio's bytes, without seqio.

Inference (`infer`, `score`, `serve`) only turns text into ids and back, so it reads a
checkpoint's tokenizer (`HuggingFaceVocabulary`) or flaxlm's default bytes (`ByteVocabulary`)
without importing seqio or TensorFlow: seconds of every start. A seqio task takes the same
objects: they keep `seqio.Vocabulary`'s contract (below) and its `encode_tf`/`decode_tf`,
which load TensorFlow when a pipeline first calls them; `data/pipeline.py` registers them as
`seqio.Vocabulary`s.

    vocab = HuggingFaceVocabulary("/path/to/hf_dir")
    seqio.Feature(vocabulary=vocab, add_eos=True)

Padding: seqio pads with id 0 and its feature converters treat id 0 as padding (no loss
weight, segment id 0). Most HF tokenizers give id 0 to a real token (GPT-2's "!", Llama's
<unk>, RoBERTa's <s>): it is still encoded and decoded, but a target 0 carries no loss
weight. `pad_id` is therefore seqio's 0, whatever the tokenizer's own pad token is.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import gin
import numpy as np
from etils import epath

PAD_ID = 0  # seqio's padding id, the same for every vocabulary


# `apply_chat_template`'s own arguments, which a request's or a record's template variables
# (vLLM's and TRL's `chat_template_kwargs`) may not set.
CHAT_TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """A transformers tokenizer's special tokens: its named ones (BOS, EOS, ...) and every
    added token marked special (a chat template's turn markers), what `decode(...,
    skip_special_tokens=True)` leaves out."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    marked = {i for i, token in added.items() if getattr(token, "special", False)}
    return frozenset(marked | set(getattr(tokenizer, "all_special_ids", ())))


class Vocabulary(Protocol):
    """What flaxlm reads and writes text with: seqio's vocabularies and this module's."""

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def unk_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, s: str) -> Sequence[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class PythonVocabulary(abc.ABC):
    """`seqio.Vocabulary`'s contract computed in Python: id 0 pads, `extra_ids` ids follow
    the base vocabulary, ids past the base vocabulary decode as UNK, and decoding stops at
    the first EOS. Subclasses give `_encode`, `_decode`, `eos_id`, `unk_id` and
    `_base_vocab_size`; the tf.data forms run them through `tf.numpy_function`."""

    def __init__(self, extra_ids: int = 0):
        self._extra_ids = extra_ids or 0

    @property
    def bos_id(self) -> int | None:
        return None

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    @abc.abstractmethod
    def eos_id(self) -> int | None: ...

    @property
    @abc.abstractmethod
    def unk_id(self) -> int | None: ...

    @property
    @abc.abstractmethod
    def _base_vocab_size(self) -> int:
        """Ids without `extra_ids`, padding, EOS and UNK included."""

    @property
    def extra_ids(self) -> int:
        return self._extra_ids

    @property
    def vocab_size(self) -> int:
        return self._base_vocab_size + self.extra_ids

    @abc.abstractmethod
    def _encode(self, s: str) -> Sequence[int]: ...

    @abc.abstractmethod
    def _decode(self, ids: list[int]) -> str: ...

    def encode(self, s: str) -> Sequence[int]:
        """The ids of `s`, without EOS."""
        return self._encode(s)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` up to the first EOS (ids past the vocabulary read as UNK)."""
        clean = [int(i) for i in ids]
        if self.unk_id is not None:
            size = self._base_vocab_size
            clean = [self.unk_id if i >= size else i for i in clean]
        if self.eos_id is not None and self.eos_id in clean:
            clean = clean[: clean.index(self.eos_id) + 1]
        return self._decode(clean)

    def encode_tf(self, s: Any) -> Any:
        """`encode` of one tf.string scalar, as an int32 tensor (in a tf.data map)."""
        # TensorFlow only where a pipeline runs: inference never calls this.
        import tensorflow as tf

        def encode(x: np.ndarray) -> np.ndarray:
            text = np.asarray(x)
            if text.ndim:
                raise ValueError(f"{type(self).__name__}.encode_tf takes one string at a time.")
            return np.asarray(self.encode(text.item().decode("utf-8")), np.int32)

        ids = tf.numpy_function(encode, [s], tf.int32, stateful=False)
        ids.set_shape([None])
        return ids

    def decode_tf(self, ids: Any) -> Any:
        """`decode` of each row of an int tensor `[..., length]`, as tf.string `[...]`. Such
        rows are seqio's, padded with 0 (`PAD_ID`): a row's trailing 0s are padding, even
        where 0 is a token of the vocabulary (an HF tokenizer's "!")."""
        import tensorflow as tf

        if ids.shape == (0,):
            return tf.constant(b"", dtype=tf.string)

        def unpadded(row: np.ndarray) -> np.ndarray:
            real = np.flatnonzero(row != PAD_ID)
            return row[: real[-1] + 1] if real.size else row[:0]

        def decode(x: np.ndarray) -> np.ndarray:
            x = np.asarray(x)
            if x.ndim == 1:
                return np.asarray(self.decode(unpadded(x)).encode("utf-8"), dtype=object)
            rows = [self.decode(unpadded(r)).encode("utf-8") for r in x.reshape(-1, x.shape[-1])]
            return np.asarray(rows, dtype=object).reshape(x.shape[:-1])

        out = tf.numpy_function(decode, [ids], tf.string, stateful=False)
        out.set_shape(ids.shape[:-1])
        return out


class ByteVocabulary(PythonVocabulary):
    """`seqio.ByteVocabulary`'s ids (a UTF-8 byte is its value + 3; 0 pads, 1 is EOS, 2
    UNK): what flaxlm's default runs train with, for reading their checkpoints without
    seqio. Invalid UTF-8 and the special ids decode to nothing, as in seqio."""

    NUM_SPECIAL = 3

    @property
    def eos_id(self) -> int:
        return 1

    @property
    def unk_id(self) -> int:
        return 2

    @property
    def _base_vocab_size(self) -> int:
        return 256 + self.NUM_SPECIAL

    def _encode(self, s: str) -> list[int]:
        s = s.decode() if isinstance(s, bytes) else s
        return [b + self.NUM_SPECIAL for b in s.encode("utf-8")]

    def _decode(self, ids: list[int]) -> str:
        special, size = self.NUM_SPECIAL, self._base_vocab_size
        data = bytes(i - special for i in ids if special <= i < size)
        return data.decode("utf-8", errors="ignore")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteVocabulary) and self.extra_ids == other.extra_ids

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.extra_ids))

    def __repr__(self) -> str:
        return f"ByteVocabulary(extra_ids={self.extra_ids})"


_LOAD_LOCK = threading.Lock()


@gin.configurable
class HuggingFaceVocabulary(PythonVocabulary):
    """A Vocabulary backed by `transformers.AutoTokenizer` from a local directory.

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
        self._pad_is_special: bool | None = None  # `_decode`'s, from the tokenizer once
        super().__init__(extra_ids=extra_ids)

    @property
    def tokenizer(self) -> Any:
        # tf.data calls this from several threads at once: one loads, and transformers' lazy
        # imports are not thread-safe, so the tf forms load it first in the tracing thread.
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

    def _decode(self, ids: list[int]) -> str:
        # seqio pads with 0: where 0 is one of the tokenizer's special tokens (a T5- or
        # SentencePiece-style <pad>) trailing 0s are that padding; where it is a token of
        # text (Qwen's and Llama 3's "!") it is kept. Everything else is decoded, special
        # tokens too.
        if self._pad_is_special is None:
            self._pad_is_special = self.pad_id in self.tokenizer.all_special_ids
        if self._pad_is_special:
            while ids and ids[-1] == self.pad_id:
                ids.pop()
        if self.eos_id is not None and ids and ids[-1] == self.eos_id:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ------------------------------------------------------------------ tf.data

    def encode_tf(self, s: Any) -> Any:
        self.tokenizer  # noqa: B018  (loaded here, not in a tf.data thread)
        return super().encode_tf(s)

    def decode_tf(self, ids: Any) -> Any:
        self.tokenizer  # noqa: B018  (loaded here, not in a tf.data thread)
        return super().decode_tf(ids)

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
