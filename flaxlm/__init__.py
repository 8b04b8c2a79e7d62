"""flaxlm: Gin-configured, t5x-style training of language models in JAX."""

__version__ = "0.1.0"
