"""Small models and batches shared by the tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.gptj import GPTJConfig
from flaxlm.training import optimizers

SEQ_LEN = 16
FLOAT32_EPS = float(np.finfo(np.float32).eps)


def float32_atol(values: np.ndarray, depth: int) -> float:
    """The absolute tolerance between two float32 computations of `values` that differ only
    in the order of their sums (packing, a mesh, another CPU's kernels: XLA's CPU backend
    tiles its reductions differently on AMD and Intel builds). Each of the `depth` rounding
    stages a value goes through (a matmul, a norm, a softmax, ...) may move it by about
    float32 epsilon relative to the values' scale, and the errors add up: eps x depth x
    max|values|. A fixed atol holds only on the CPU it was tuned on."""
    return FLOAT32_EPS * depth * float(np.max(np.abs(values)))


def jaxpr_equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of `jaxpr` and of the jaxprs nested in it (pjit, cond, scan, while,
    custom_vjp, remat)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from jaxpr_equations(sub)


def tiny_gptj(**overrides) -> DecoderOnlyModel:
    """A 2-layer GPT-J whose widths divide 8 (so every mesh in the tests can split them)."""
    kwargs = dict(
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        rotary_dim=4,
        max_position_embeddings=64,
    )
    kwargs.update(overrides)
    return DecoderOnlyModel(GPTJConfig(**kwargs))


def feature_lengths(length: int = SEQ_LEN) -> dict[str, int]:
    return {
        name: length
        for name in (
            "decoder_input_tokens",
            "decoder_target_tokens",
            "decoder_loss_weights",
            "decoder_segment_ids",
            "decoder_positions",
        )
    }


def random_batch(batch_size: int = 8, length: int = SEQ_LEN, seed: int = 0) -> dict:
    """A packed batch: two segments per row, positions restarting in each, some padding."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(3, 128, size=(batch_size, length), dtype=np.int32)
    inputs = np.concatenate([np.zeros((batch_size, 1), np.int32), targets[:, :-1]], axis=1)
    split = length // 2
    segments = (
        np.where(np.arange(length) < split, 1, 2).astype(np.int32)[None].repeat(batch_size, 0)
    )
    positions = np.where(np.arange(length) < split, np.arange(length), np.arange(length) - split)
    positions = positions.astype(np.int32)[None].repeat(batch_size, 0)
    weights = np.ones((batch_size, length), np.int32)
    weights[:, -2:] = 0  # padding at the end of each row
    segments[:, -2:] = 0
    targets[:, -2:] = 0
    return {
        "decoder_input_tokens": inputs,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": weights,
        "decoder_segment_ids": segments,
        "decoder_positions": positions,
    }


def adamw(learning_rate: float = 1e-2):
    return optimizers.create_optimizer(learning_rate=learning_rate)


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the scripts import their siblings by name)."""
    import importlib.util
    import os
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    benchmarks = os.path.join(repo, "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", f"{benchmarks}/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def partitioner_from_gin(name: str):
    """The `Partitioner` that gin/partitioning/<name>.gin binds (Gin cleared before and
    after)."""
    import os

    import gin

    from flaxlm.parallel.partitioning import Partitioner

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    gin.clear_config()
    try:
        gin.parse_config_file(os.path.join(repo, "gin", "partitioning", f"{name}.gin"))
        return Partitioner()
    finally:
        gin.clear_config()
