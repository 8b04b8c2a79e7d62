"""SeqIO tasks and mixtures; importing this package registers them."""

from tasks import stdlib, text_files  # noqa: F401
