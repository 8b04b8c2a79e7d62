"""flaxlm: Gin-configured, t5x-style training of language models in JAX."""

from flaxlm.parallel import platforms

# Before any flaxlm module imports JAX: on a host without a TPU, keep JAX off libtpu.
platforms.exclude_absent_tpu()

__version__ = "0.1.0"
