"""SeqIO tasks and mixtures; importing this package registers them."""

# Vocabularies the task factories take, bindable in Gin: @HuggingFaceVocabulary()
# (vocabularies), @seqio.SentencePieceVocabulary() and @seqio.ByteVocabulary() (pipeline).
from flaxlm.data import pipeline, vocabularies  # noqa: F401
from tasks import (  # noqa: F401
    chat,
    hf_datasets,
    jsonl,
    mixtures,
    mlm,
    seq2seq,
    stdlib,
    text_files,
    tfds_tasks,
)
