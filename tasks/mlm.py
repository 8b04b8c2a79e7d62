"""Masked-LM task over the standard-library corpus (RoBERTa-style pre-training on CPU).

`stdlib_py_mlm`: the `stdlib_py` byte chunks, 15% of bytes chosen BERT-style. The byte
vocabulary has no mask token, so id 259 (the first id past it; the tiny RoBERTa's vocabulary
of 384 has room) plays `<mask>`.
"""

from __future__ import annotations

import functools

import seqio
import tensorflow as tf

from tasks import stdlib
from tasks.preprocessors import mask_tokens, split_targets

TASK_NAME = "stdlib_py_mlm"
MASK_ID = 259  # ByteVocabulary's ids are 0..258

_vocab = seqio.ByteVocabulary()
seqio.TaskRegistry.add(
    TASK_NAME,
    source=seqio.FunctionDataSource(stdlib.dataset_fn, splits=("train", "validation")),
    preprocessors=[
        functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
        seqio.preprocessors.tokenize,
        split_targets,
        functools.partial(mask_tokens, mask_id=MASK_ID, random_ids=(3, _vocab.vocab_size)),
    ],
    output_features={
        "inputs": seqio.Feature(_vocab, add_eos=False, dtype=tf.int32),
        "targets": seqio.Feature(_vocab, add_eos=False, dtype=tf.int32),
    },
    metric_fns=[],
)
