"""SeqIO tasks and mixtures; importing this package registers them."""

from tasks import (  # noqa: F401
    seq2seq,  # noqa: F401
    stdlib,
    text_files,
)
