"""MXFP4 tensors of a HuggingFace checkpoint, read as the plain tensors they stand for.

The Hub's gpt-oss files store each layer's expert weights in MXFP4 (OCP microscaling, 4-bit
floats): `<name>_blocks` uint8 `[..., rows, groups, 16]` packs 32 e2m1 values per group, two a
byte (the low nibble first), and `<name>_scales` uint8 `[..., rows, groups]` holds each
group's e8m0 exponent (biased by 127). The tensor `<name>` is their product `[..., groups *
32, rows]` (the last two axes swapped, as transformers' `convert_moe_packed_tensors` lays it
out for `GptOssExperts`). Every such value is exact in bfloat16 (a 2-bit significand times a
power of two), which `dequantize` returns and the import casts to the run's dtype: the same
numbers as transformers' dequantization in any dtype.

`DequantizedReader` serves a checkpoint's pairs under their plain names, so a family's tensor
table names `mlp.experts.gate_up_proj` whichever way the file stores it, once each pair's
dtypes and shapes are the format's (`check_pair`): a scale of another dtype cast to a byte
would be another number, silently. flaxlm writes plain tensors back (`hf.save_pretrained`),
never MXFP4.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from flaxlm.checkpoints.hf_files import Box

BLOCKS, SCALES = "_blocks", "_scales"
# The 16 e2m1 codes: sign bit, 2 exponent bits, 1 mantissa bit.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
# Each byte's two values (low nibble, high nibble): one gather per byte.
_PAIRS = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]], -1)
# 2 ** (e - 127) for each exponent byte, as float32 (255 overflows to inf, as torch's does).
with np.errstate(over="ignore"):
    _POWERS = np.ldexp(np.ones(256, np.float32), np.arange(256) - 127).astype(np.float32)


def check_pair(reader: Any, name: str) -> None:
    """A ValueError naming the file and the tensor where `name`'s MXFP4 pair in `reader` (a
    `hf_files.SafetensorsReader`) is not the format's: blocks uint8 `[..., rows, groups, 16]`,
    scales uint8 `[..., rows, groups]`."""
    blocks, scales = name + BLOCKS, name + SCALES
    for tensor, holds in ((blocks, "two e2m1 values a byte"), (scales, "E8M0 exponents")):
        dtype = reader.dtype(tensor)
        if dtype != "uint8":
            raise ValueError(
                f"{reader.file_path(tensor)}: tensor {tensor!r} holds {dtype}, but MXFP4 "
                f"{tensor.rpartition('_')[2]} are uint8 ({holds}): the file was not written "
                "as the Hub's gpt-oss files are; store the expert weights unquantized instead."
            )
    shape = reader.shape(blocks)
    if len(shape) < 3 or shape[-1] != 16:
        raise ValueError(
            f"{reader.file_path(blocks)}: tensor {blocks!r} has shape {shape}, but MXFP4 "
            "blocks are [..., rows, groups, 16] (32 values a group, two a byte)."
        )
    if reader.shape(scales) != shape[:-1]:
        raise ValueError(
            f"{reader.file_path(scales)}: tensor {scales!r} has shape {reader.shape(scales)}, "
            f"but the scales of blocks {shape} are {shape[:-1]} (one a group)."
        )


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """bfloat16 `[..., groups * 32, rows]` from MXFP4 `blocks` uint8 `[..., rows, groups, 16]`
    and `scales` uint8 `[..., rows, groups]`, one leading index at a time (the temporaries
    stay one expert's size)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}: a cast "
            "would read other numbers as the packed values and exponents."
        )
    *lead, rows, groups, width = blocks.shape
    if tuple(scales.shape) != (*lead, rows, groups):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
            "the scales must be the blocks' shape without the last axis."
        )
    flat_blocks = blocks.reshape(-1, rows, groups, width)
    flat_scales = scales.reshape(-1, rows, groups)
    out = np.empty((flat_blocks.shape[0], rows, groups * width * 2), jnp.bfloat16)
    for i, (b, s) in enumerate(zip(flat_blocks, flat_scales, strict=True)):
        values = _PAIRS[b] * _POWERS[s][..., None, None]  # [rows, groups, width, 2]
        out[i] = values.reshape(rows, -1).astype(jnp.bfloat16)
    return np.swapaxes(out.reshape(*lead, rows, -1), -1, -2)


class DequantizedReader:
    """A checkpoint reader (`file_of`, `shape`, `read`, as `hf_files.SafetensorsReader`'s)
    that serves each MXFP4 pair `<name>_blocks` + `<name>_scales` as `<name>`, dequantized,
    in place of the pair, each pair checked first (`check_pair`); other tensors pass
    through.

    A read of a box (a device shard's part) reads the blocks and scales of the groups it
    touches and gives what the whole tensor's dequantization holds there, bit for bit. The
    last tensor dequantized is kept (a param read whole by every shard: a layout hf.py cannot
    cut; dequantizing one of gpt-oss-120b's layers takes seconds)."""

    def __init__(self, reader: Any):
        self._reader = reader
        stored = reader.file_of
        self._pairs = {
            name[: -len(BLOCKS)]
            for name in stored
            if name.endswith(BLOCKS) and name[: -len(BLOCKS)] + SCALES in stored
        }
        for name in sorted(self._pairs):
            check_pair(reader, name)
        taken = {p + suffix for p in self._pairs for suffix in (BLOCKS, SCALES)}
        self.file_of = {n: f for n, f in stored.items() if n not in taken}
        self.file_of.update({p: stored[p + BLOCKS] for p in self._pairs})
        self._last: tuple[str | None, Any] = (None, None)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._pairs:
            return self._reader.shape(name)
        *lead, rows, groups, width = self._reader.shape(name + BLOCKS)
        return (*lead, groups * width * 2, rows)

    def read(
        self, name: str, rows: tuple[int, int] | None = None, box: Box | None = None
    ) -> np.ndarray:
        if name not in self._pairs:
            return self._reader.read(name, rows, box)
        if rows is None and box is not None:
            return self._read_box(name, box)
        if self._last[0] != name:
            blocks, scales = (self._reader.read(name + s) for s in (BLOCKS, SCALES))
            self._last = (name, dequantize(blocks, scales))
        tensor = self._last[1]
        tensor = tensor if rows is None else tensor[rows[0] : rows[1]]
        return tensor if box is None else tensor[box]

    def _read_box(self, name: str, box: Box) -> np.ndarray:
        """`box` of `[..., groups * 32, rows]` from the groups' blocks and scales it touches."""
        shape = self.shape(name)
        full = tuple(box) + (slice(None),) * (len(shape) - len(box))
        *lead, cols, rows = (slice(*s.indices(n)[:2]) for s, n in zip(full, shape, strict=True))
        width = 2 * self._reader.shape(name + BLOCKS)[-1]
        groups = slice(cols.start // width, -(-cols.stop // width))
        blocks = self._reader.read(name + BLOCKS, None, (*lead, rows, groups, slice(None)))
        scales = self._reader.read(name + SCALES, None, (*lead, rows, groups))
        first = cols.start - groups.start * width
        return dequantize(blocks, scales)[..., first : first + cols.stop - cols.start, :]
