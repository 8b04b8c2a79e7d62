"""What every family's config shares: `ComputeOptions` (how a module computes) and the
`ModuleConfig` protocol the model reads (its module, FLOP count and vocabulary sizes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import flax.linen as nn
import numpy as np

from flaxlm.models import attention, context_parallel, layers


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComputeOptions:
    """How a module computes, whatever its family: every family config inherits these
    (keyword-only) fields, so Gin binds them by the family's name (`LlamaConfig.dtype`).

    A family config that overrides `__post_init__` calls `super().__post_init__()`: a bad
    value then fails before any device work.
    """

    dtype: str = "float32"  # compute dtype; norms, softmax, rotary and logits stay float32
    param_dtype: str = "float32"
    dropout_rate: float = 0.0
    remat_policy: str = "none"  # see layers.REMAT_POLICIES
    scan_layers: bool = False  # stack blocks with nn.scan (params gain a 'layers' axis)
    attention: str = "auto"  # 'auto', 'xla', 'jax', 'chunked' (attention.dot_product_attention)
    attention_chunk_size: int = 512  # queries and keys per block of 'chunked' attention
    # A sequence split over the mesh's 'sequence' axis: how attention reaches the other
    # shards' keys ('ring' or 'all_gather', see models.context_parallel), and whether a
    # decoder's training batch is put in the load-balanced order (causal work even).
    context_parallel: str = "ring"
    context_parallel_balance: bool = True

    @property
    def first_scanned_layer(self) -> int:
        """The first layer of the stack `scan_layers` scans; the layers before it stay
        unrolled (DeepSeek-V3's dense first layers before its alike MoE ones). 0 here."""
        return 0

    @property
    def scan_period(self) -> int:
        """How many layers of different kinds the scan's body applies, a cycle (Qwen3.5's
        3 linear + 1 full attention: 4); the stacked layers repeat it. 1 here."""
        return 1

    @property
    def scan_tail(self) -> int:
        """How many last layers stay unrolled after the scanned stack (a pattern's incomplete
        last cycle: Kimi Linear's last two). 0 here."""
        return 0

    def __post_init__(self) -> None:
        choices = attention.ATTENTION_IMPLEMENTATIONS
        if self.attention not in choices:
            raise ValueError(f"attention {self.attention!r}: expected one of {choices}.")
        context_parallel.check_strategy(self.context_parallel)
        if self.attention_chunk_size < 1:
            raise ValueError(
                f"attention_chunk_size must be positive, got {self.attention_chunk_size}."
            )
        if self.remat_policy not in layers.REMAT_POLICIES:
            raise ValueError(
                f"remat_policy {self.remat_policy!r}: expected one of "
                f"{sorted(layers.REMAT_POLICIES)}."
            )
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}.")
        # A family's activation: a field, or a property derived from one (T5).
        activation = getattr(self, "activation", None)
        if activation is not None and activation not in layers.ACTIVATIONS:
            raise ValueError(
                f"activation {activation!r}: expected one of {sorted(layers.ACTIVATIONS)}."
            )


class ModuleConfig(Protocol):
    """What a family's config offers the model: its module and its FLOP count."""

    max_position_embeddings: int
    vocab_size: int  # the logits' width (may be padded past the real vocabulary)
    real_vocab_size: int | None  # ids at or above this are padding and never predicted

    def make_module(self) -> nn.Module: ...

    def flops_per_token(self, seq_len: int) -> float: ...


class ParamCounts:
    """`num_params` and `active_params` of a config that counts both in one pass
    (`param_counts`: all params, and those one token goes through: a mixture of experts')."""

    def param_counts(self) -> tuple[int, int]:
        raise NotImplementedError

    def num_params(self) -> int:
        """All parameters (every expert)."""
        return self.param_counts()[0]

    def active_params(self) -> int:
        """The parameters one token goes through (its k experts)."""
        return self.param_counts()[1]


class HeadShapes:
    """`kv_heads` and `dim_per_head` of a config with `num_kv_heads` and `head_dim` fields
    (None: the query heads; width / heads), as most families read HF's keys."""

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


MODEL_EOS = -1  # inference.generate(eos_id=MODEL_EOS): the model's own EOS ids


def eos_tuple(eos_id: int | Sequence[int] | None) -> tuple[int, ...]:
    if eos_id is None:
        return ()
    if isinstance(eos_id, (int, np.integer)):
        return (int(eos_id),)
    return tuple(int(e) for e in eos_id)
