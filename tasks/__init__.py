"""SeqIO tasks and mixtures; importing this package registers them."""

from tasks import (  # noqa: F401
    hf_datasets,
    jsonl,
    mixtures,
    mlm,
    seq2seq,
    stdlib,
    text_files,
    tfds_tasks,
)
