"""On PYTHONPATH, makes `import tensorflow` and `import seqio` fail in every Python process
started (an accelerator host with JAX and torch but no TensorFlow; see test_benchmarks.py)."""

import sys

sys.modules.update(tensorflow=None, seqio=None)
