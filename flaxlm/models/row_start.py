"""What a decoder-only model reads before a row's first token.

One value a run decides once (`checkpoints/run_dir.row_start_of` and `run_start`: from the
model record of a MODEL_DIR, an HF or PEFT directory, or the run's INIT_FROM_HF) and hands to
every feature converter (`models/features.py`), evaluation's predict prompts, `infer`,
`score`, `serve`, the lm-eval harness and GRPO's rollouts, so that a model is sampled from
the start it was trained with. Nothing re-derives it from a model or a signature.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RowStart:
    """`decoder_start_id`: seqio's decoder start token, read before every row (the targets
    shifted right, as t5x trains from scratch; 0); None: the HF form, the sequence as the
    tokenizer gives it (its own prefix, e.g. BOS, where it adds one), as HF and TRL feed a
    causal LM (read `row[:-1]`, predict `row[1:]`; nothing inserted)."""

    decoder_start_id: int | None = 0

    @property
    def hf_form(self) -> bool:
        return self.decoder_start_id is None

    def ids(self, vocabulary: Any) -> tuple[int, ...]:
        """What the model reads before a text that `vocabulary` tokenized: seqio's start
        token, or in the HF form the tokenizer's own prefix (`HuggingFaceVocabulary.
        prefix_ids`; a seqio vocabulary adds nothing)."""
        if self.hf_form:
            return tuple(int(t) for t in getattr(vocabulary, "prefix_ids", ()))
        return (int(self.decoder_start_id),)

    def describe(self) -> str:
        if self.hf_form:
            return "the HF form (the tokenizer's own sequence, nothing inserted)"
        return f"seqio's decoder start token {self.decoder_start_id}"


SEQIO_START = RowStart(0)
HF_START = RowStart(None)
