"""Blocks applied in order: unrolled (`layers_0`, `layers_1`, ...), scanned as one stack
(`nn.scan`: params gain a leading `layers` axis), or both (a model whose first layers differ
from the rest: DeepSeek-V3's dense ones unrolled before its MoE stack); each block
rematerialised by a named policy (`layers.REMAT_POLICIES`).

A stack of layers that repeat a cycle of `period` kinds (Qwen3.5's three Gated DeltaNet
layers and one full-attention layer) scans the cycle: its body applies `block_0` ..
`block_{period-1}`, each param stacked over the cycles (`block_j`'s axis 0 holds layers
first + j, first + j + period, ...). Layers after the last whole cycle (a tail shorter than
the pattern: Kimi Linear's last two) stay unrolled after the stack. A block reads which layer
it stands for from its name (`layer_of`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxlm.models.layers import LAYER_LOOP, REMAT_POLICIES

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
    period: int = 1,
    tail: int = 0,
    **block_kwargs: Any,
) -> Callable[..., Any]:
    """Applies `num_layers` blocks `(x, *args) -> x`, scanned (params gain a `layers` axis)
    or unrolled (`layers_0`, `layers_1`, ...). Returns a callable `(x, *args) -> x`.

    layer_index: call the blocks as `(x, index, *args)`, index an int32 scalar counting
    from 0 (traced when scanned, so blocks must use it arithmetically, not in Python `if`s).
    first_scanned: with `scan_layers`, the blocks before it stay unrolled (`layers_0`, ...)
    and the scan stacks the rest (`layers`, its axis 0 the layers from `first_scanned` on):
    a model whose first layers differ from the others (DeepSeek-V3's dense ones).
    period: with `scan_layers`, the scan's body applies this many blocks (`block_0`, ...),
    a cycle of layers of different kinds; it must divide the stacked layers.
    tail: with `scan_layers`, the last `tail` layers stay unrolled after the stack
    (`layers_{i}`: a pattern's incomplete last cycle).
    """
    block = remat_block(block_cls, remat_policy)
    start, stop = scanned_range(num_layers, scan_layers, first_scanned, period, tail)

    def unrolled(i: int) -> nn.Module:
        return block(**block_kwargs, name=f"{name}_{i}")

    head = [(i, unrolled(i)) for i in range(start)]
    stack = None
    if start < stop:
        stack = _scanned_blocks(block, start, stop, period, name, layer_index, block_kwargs)
    after = [(i, unrolled(i)) for i in range(stop, num_layers)]

    def apply_unrolled(x: Array, blocks: list[tuple[int, nn.Module]], args: tuple) -> Array:
        for i, b in blocks:
            # An array, as when scanned, so a block behaves the same either way.
            x = b(x, jnp.asarray(i, jnp.int32), *args) if layer_index else b(x, *args)
        return x

    def apply(x: Array, *args: Any) -> Array:
        x = apply_unrolled(x, head, args)
        if stack is not None:
            x = stack(x, *args)
        return apply_unrolled(x, after, args)

    return apply


def scanned_range(
    num_layers: int, scan_layers: bool, first_scanned: int, period: int, tail: int
) -> tuple[int, int]:
    """(start, stop) of the layers a scan stacks (start == stop: none, all unrolled); those
    before start and from stop on stay unrolled."""
    if not scan_layers:
        return num_layers, num_layers
    start = first_scanned if first_scanned < num_layers else 0
    stop = num_layers - tail
    if tail < 0 or stop < start or (stop - start) % period:
        raise ValueError(
            f"scan_layers: cycles of {period} layers do not cover layers {start} to "
            f"{stop - 1} ({num_layers} layers, the last {tail} unrolled)."
        )
    return start, stop


def _scanned_blocks(
    block: type[nn.Module],
    start: int,
    stop: int,
    period: int,
    name: str,
    layer_index: bool,
    block_kwargs: dict[str, Any],
) -> Callable[..., Any]:
    """Blocks `start`..`stop - 1` as one `nn.scan` named `name` (params `[cycles, ...]`)."""

    class _ScanBody(nn.Module):
        @nn.compact
        def __call__(self, x: Array, index: Array, args: tuple) -> tuple[Array, None]:
            for j in range(period):
                b = block(**block_kwargs, name=slot_name(j, period))
                x = b(x, index + j, *args) if layer_index else b(x, *args)
            return x, None

    # The index differs per layer, so it is scanned over; the other arguments are shared.
    scanned = nn.scan(
        _ScanBody,
        # intermediates: what layers sow (MoE router statistics), stacked per layer.
        variable_axes={"params": 0, "cache": 0, "intermediates": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(0, nn.broadcast),
        length=(stop - start) // period,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(name=name)
    indices = jnp.arange(start, stop, period, dtype=jnp.int32)

    def run(x: Array, *args: Any) -> Array:
        with jax.named_scope(LAYER_LOOP):  # the planner counts this loop's body once
            return scanned(x, indices, args)[0]

    return run


def cycle_of(kinds: Sequence[Hashable]) -> tuple[int, int]:
    """(period, tail): the cycle the layers' kinds repeat at least twice and the layers after
    its last whole repeat, chosen for the fewest distinct layers to compile (period + tail;
    the shorter cycle at a tie): (1, 0) when all are alike, (4, 0) for three linear layers and
    a full one repeated, (4, 2) when two layers of a fifth cycle end them; (all, 0) when
    nothing repeats."""
    return _cycle(tuple(kinds))


def layout_of(kinds: Sequence[Hashable]) -> tuple[int, int, int]:
    """(first, period, tail): `cycle_of` the layers from `first` on, the layers before it
    unrolled too, `first` chosen with the cycle for the fewest distinct layers to compile
    (first + period + tail; the earlier first at a tie): DeepSeek-V4-Flash's 43 layers, three
    hash-routed ones then (HCA, CSA) MoE ones, (3, 2, 0)."""
    return _layout(tuple(kinds))


@functools.lru_cache(maxsize=256)
def _layout(kinds: tuple[Hashable, ...]) -> tuple[int, int, int]:
    firsts = range(max(len(kinds), 1))
    return min(((f, *_cycle(kinds[f:])) for f in firsts), key=sum)


@functools.lru_cache(maxsize=256)
def _cycle(kinds: tuple[Hashable, ...]) -> tuple[int, int]:
    n = len(kinds)
    best = (max(n, 1), 0)
    for p in range(1, n // 2 + 1):
        covered = 0
        while covered < n and kinds[covered] == kinds[covered % p]:
            covered += 1
        cycles = covered // p
        if cycles >= 2 and p + n - cycles * p < sum(best):
            best = (p, n - cycles * p)
    return best


def slot_name(j: int, period: int) -> str:
    """The scope of the j-th block of a scanned cycle: `block` when the cycle is one layer."""
    return "block" if period == 1 else f"block_{j}"


def scan_slot(module: nn.Module) -> int | None:
    """Which block of a scanned cycle `module` is (`block` 0, `block_2` 2); None for an
    unrolled block (`layers_3`)."""
    stem, _, number = (module.name or "").rpartition("_")
    if module.name == "block":
        return 0
    return int(number) if stem == "block" and number.isdigit() else None


def unrolled_layer(module: nn.Module) -> int | None:
    """The number of an unrolled block (`layers_3` -> 3); None for a scanned one."""
    _, _, number = (module.name or "").rpartition("_")
    if scan_slot(module) is not None or not number.isdigit():
        return None
    return int(number)


def layer_of(module: nn.Module, first_scanned: int) -> int:
    """The layer a block stands for: an unrolled one's number (`layers_3` -> 3), a scanned
    one's first layer (`block_j` of a stack from `first_scanned` -> first_scanned + j; its
    other layers are the same kind, a cycle on)."""
    slot = scan_slot(module)
    if slot is not None:
        return first_scanned + slot
    number = unrolled_layer(module)
    if number is None:
        raise ValueError(f"{module.name!r} is neither an unrolled layer nor a scanned block.")
    return number


def scan_layout(config: Any) -> tuple[int, int, int] | None:
    """A model config's scanned stack: None unless it scans its layers, else
    (`first_scanned_layer`, `scan_period`, `scan_tail`) (`hf_spec.expand`'s `scanned`,
    `walk_order`'s `layout`)."""
    if not getattr(config, "scan_layers", False):
        return None
    return (
        config.first_scanned_layer,
        getattr(config, "scan_period", 1),
        getattr(config, "scan_tail", 0),
    )


def walk_order(num_layers: int, layout: tuple[int, int, int] | None) -> list[int]:
    """The layers in the order a walk of a model's params or sown values meets them, scopes
    sorted `layers_9` before `layers_10` before a scanned stack `layers`, `block_0` before
    `block_1`, a stacked value's rows by cycle: the unrolled layers by number, then each
    block of the scan's cycle over its cycles. `layout`: (first, period, tail), as
    `scan_layout` gives it; None when the layers are unrolled."""
    if layout is None:
        return list(range(num_layers))
    first, period, tail = layout
    stop = num_layers - tail
    cycles = (stop - first) // period
    stacked = [first + j + c * period for j in range(period) for c in range(cycles)]
    return [*range(first), *range(stop, num_layers), *stacked]


def unstack(
    params: dict[str, Any],
    name: str,
    num_layers: int,
    first_scanned: int,
    period: int,
    tail: int = 0,
) -> dict[str, Any]:
    """`params` with the scanned stack `name` (`block` or `block_j`, `[cycles, ...]`) as
    unrolled layers `name_{i}` (the unrolled ones before `first_scanned` and the last `tail`
    kept)."""
    stacked = params[name]
    out = {k: v for k, v in params.items() if k != name}
    for i in range(first_scanned, num_layers - tail):
        cycle, j = divmod(i - first_scanned, period)
        out[f"{name}_{i}"] = jax.tree.map(lambda x, c=cycle: x[c], stacked[slot_name(j, period)])
    return out
