"""Blocks applied in order: unrolled (`layers_0`, `layers_1`, ...), scanned as one stack
(`nn.scan`: params gain a leading `layers` axis), or both (a model whose first layers differ
from the rest: DeepSeek-V3's dense ones unrolled before its MoE stack); each block
rematerialised by a named policy (`layers.REMAT_POLICIES`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models.layers import REMAT_POLICIES

Array = jax.Array


def remat_block(block_cls: type[nn.Module], policy: str, static_argnums: tuple[int, ...] = ()):
    """`block_cls` wrapped in `nn.remat` with the named policy ('none' returns it as is)."""
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={policy!r}: expected one of {sorted(REMAT_POLICIES)}.")
    if policy == "none":
        return block_cls
    return nn.remat(
        block_cls,
        policy=REMAT_POLICIES[policy],
        prevent_cse=True,
        static_argnums=static_argnums,
    )


def stack_blocks(
    block_cls: type[nn.Module],
    num_layers: int,
    *,
    scan_layers: bool,
    remat_policy: str,
    name: str = "layers",
    layer_index: bool = False,
    first_scanned: int = 0,
    **block_kwargs: Any,
) -> Callable[..., Any]:
    """Applies `num_layers` blocks `(x, *args) -> x`, scanned (params gain a `layers` axis)
    or unrolled (`layers_0`, `layers_1`, ...). Returns a callable `(x, *args) -> x`.

    layer_index: call the blocks as `(x, index, *args)`, index an int32 scalar counting
    from 0 (traced when scanned, so blocks must use it arithmetically, not in Python `if`s).
    first_scanned: with `scan_layers`, the blocks before it stay unrolled (`layers_0`, ...)
    and the scan stacks the rest (`layers`, its axis 0 the layers from `first_scanned` on):
    a model whose first layers differ from the others (DeepSeek-V3's dense ones).
    """
    block = remat_block(block_cls, remat_policy)
    if not scan_layers:
        unrolled = num_layers
    else:
        unrolled = first_scanned if first_scanned < num_layers else 0
    blocks = [block(**block_kwargs, name=f"{name}_{i}") for i in range(unrolled)]
    stack = None
    if unrolled < num_layers:
        stack = _scanned_blocks(block, unrolled, num_layers, name, layer_index, block_kwargs)

    def apply(x: Array, *args: Any) -> Array:
        for i, b in enumerate(blocks):
            # An array, as when scanned, so a block behaves the same either way.
            x = b(x, jnp.asarray(i, jnp.int32), *args) if layer_index else b(x, *args)
        return x if stack is None else stack(x, *args)

    return apply


def _scanned_blocks(
    block: type[nn.Module],
    start: int,
    stop: int,
    name: str,
    layer_index: bool,
    block_kwargs: dict[str, Any],
) -> Callable[..., Any]:
    """Blocks `start`..`stop - 1` as one `nn.scan` named `name` (params `[layers, ...]`)."""

    class _ScanBody(nn.Module):
        @nn.compact
        def __call__(self, x: Array, index: Array, args: tuple) -> tuple[Array, None]:
            b = block(**block_kwargs, name="block")
            return (b(x, index, *args) if layer_index else b(x, *args)), None

    # The index differs per layer, so it is scanned over; the other arguments are shared.
    scanned = nn.scan(
        _ScanBody,
        # intermediates: what layers sow (MoE router statistics), stacked per layer.
        variable_axes={"params": 0, "cache": 0, "intermediates": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(0, nn.broadcast),
        length=stop - start,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(name=name)
    indices = jnp.arange(start, stop, dtype=jnp.int32)
    return lambda x, *args: scanned(x, indices, args)[0]
