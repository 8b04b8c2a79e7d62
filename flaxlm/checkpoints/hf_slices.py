"""Which part of an HF checkpoint's tensors a device shard of a param reads: the
`make_array_from_callback` callback of one param (`shard_reader`) reads only the layers of a
stack its index covers, and of each only the part it needs (a box in the file's layout;
FP8 and MXFP4 tensors dequantize only that part), and `PiecedReader` serves a tensor the
Hub stores one piece per expert as one, opening only the pieces of the experts asked for."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flaxlm.checkpoints.hf_files import Box, SafetensorsReader
from flaxlm.models.hf_spec import HFTensor


def shard_reader(
    reader: SafetensorsReader,
    t: HFTensor,
    names: Sequence[str],
    aval: Any,
    stacked: bool,
    real_vocab: int,
) -> Any:
    """The `make_array_from_callback` callback of one param: index -> that shard's values,
    read from the layers (axis 0 of a stacked param) the index covers, and of each only the
    part `_layer_part` says it needs."""
    layer_shape = tuple(aval.shape[1:] if stacked else aval.shape)
    unpadded = list(layer_shape)
    if t.vocab_axis is not None:
        unpadded[t.vocab_axis] = real_vocab
    by_expert = _cuts_experts(t, tuple(unpadded))

    def whole_layer(i: int) -> np.ndarray:
        array = t.to_flax_layout(reader.read(names[i], t.rows), tuple(unpadded))
        if t.vocab_axis is not None and layer_shape[t.vocab_axis] > real_vocab:
            pad = [(0, 0)] * array.ndim
            pad[t.vocab_axis] = (0, layer_shape[t.vocab_axis] - real_vocab)
            array = np.pad(array, pad)
        return array

    def layer(i: int, index: tuple[slice, ...]) -> np.ndarray:
        # A layout of its own (`to_flax`, or `to_hf` alone: e.g. Kimi's `A_log` `[heads]`,
        # `[1, 1, heads, 1]` in the file) is read whole unless it keeps experts apart; the
        # box of `_layer_part` is the default layout's (the param reshaped to 2-D).
        custom = t.to_flax is not None or t.to_hf is not None
        if t.vocab_axis is not None or (custom and not by_expert):
            return whole_layer(i)[index]
        box, take = _layer_part(t, layer_shape, index, by_expert)
        return take(reader.read(names[i], t.rows, box))

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        if not stacked:
            return np.asarray(layer(0, index), aval.dtype)
        return np.stack(
            [np.asarray(layer(i, index[1:]), aval.dtype) for i in range(len(names))[index[0]]]
        )

    return callback


def _cuts_experts(t: HFTensor, shape: tuple[int, ...]) -> bool:
    """Whether a record with its own layout (`to_flax`) keeps experts apart: the HF tensor
    and the param lead with the same axis, and the layout of a slice of it is the slice of
    the layout (probed on two entries). Stored in pieces, it is one set of pieces an expert."""
    if t.to_flax is None or len(shape) < 2 or shape[0] < 2:
        return False
    if t.pieces:
        return shape[0] == t.experts
    hf_shape = t.hf_shape(shape)
    if hf_shape[0] != shape[0]:
        return False
    size = 2 * math.prod(hf_shape[1:])
    probe = np.arange(size, dtype=np.int32 if size < 2**31 else np.int64)
    probe = probe.reshape(2, *hf_shape[1:])
    both = t.to_flax_layout(probe, (2, *shape[1:]))
    return all(
        np.array_equal(both[e : e + 1], t.to_flax_layout(probe[e : e + 1], (1, *shape[1:])))
        for e in range(2)
    )


def _layer_part(
    t: HFTensor, shape: tuple[int, ...], index: tuple[slice, ...], by_expert: bool
) -> tuple[Box, Any]:
    """`(box, take)`: the part of a layer's HF tensor that the param's `index` needs (in the
    file's layout), and the function from that part to the param's values at `index`.

    A record with its own layout that keeps experts apart (`_cuts_experts`) reads the
    experts `index` covers; the default layout (`HFTensor.to_flax_layout`: the param
    reshaped to 2-D after its first `split` axes, maybe transposed) reads, on each of the
    two axes, the range from the index's first element to its last."""
    ranges = [range(*s.indices(n)) for s, n in zip(index, shape, strict=False)]
    ranges += [range(n) for n in shape[len(ranges) :]]
    if by_expert:
        experts = slice(ranges[0].start, ranges[0].stop)
        part_shape = (len(ranges[0]), *shape[1:])
        rest = (slice(None), *index[1:])
        return (experts,), lambda block: t.to_flax_layout(block, part_shape)[rest]
    groups = [(0, len(shape))] if t.split is None else [(0, t.split), (t.split, len(shape))]
    box, offsets = [], []
    for lo, hi in groups:
        # The flat positions, in the group's axes, of the index's elements.
        flat = np.zeros((1,) * (hi - lo), np.int64)
        for axis in range(lo, hi):
            stride = math.prod(shape[axis + 1 : hi])
            coords = np.asarray(ranges[axis], np.int64) * stride
            flat = flat + coords.reshape([-1 if a == axis else 1 for a in range(lo, hi)])
        flat = flat.reshape(-1)
        box.append(slice(int(flat.min()), int(flat.max()) + 1))
        offsets.append(flat - flat.min())
    shard_shape = tuple(len(r) for r in ranges)

    def take(block: np.ndarray) -> np.ndarray:
        block = block.T if t.transpose else block
        return block[np.ix_(*offsets)].reshape(shard_shape)

    return tuple(reversed(box)) if t.transpose else tuple(box), take


class PiecedReader:
    """A `SafetensorsReader` that also serves each tensor the checkpoint stores in pieces
    (`HFTensor.pieces`: one set per expert, the Hub's spelling) whole, as if stored so:
    `file_of` names it in place of its pieces."""

    def __init__(self, reader: SafetensorsReader, pieces: Mapping[str, list[list[str]]]):
        self._reader = reader
        self._pieces = {
            name: experts
            for name, experts in pieces.items()
            if name not in reader.file_of
            and all(p in reader.file_of for names in experts for p in names)
        }
        taken = {p for experts in self._pieces.values() for names in experts for p in names}
        self.file_of = {n: f for n, f in reader.file_of.items() if n not in taken}
        self.file_of.update({n: reader.file_of[e[0][0]] for n, e in self._pieces.items()})

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._pieces:
            return self._reader.shape(name)
        experts = self._pieces[name]
        shapes = [self._reader.shape(p) for p in experts[0]]
        return (len(experts), sum(s[0] for s in shapes), *shapes[0][1:])

    def read(
        self, name: str, rows: tuple[int, int] | None = None, box: Box | None = None
    ) -> np.ndarray:
        """As `SafetensorsReader.read`; a box of a tensor stored in pieces opens only the
        pieces of its experts (axis 0) and, within them, its rows (axis 1)."""
        if name not in self._pieces:
            return self._reader.read(name, rows, box)
        if rows is not None:
            raise ValueError(f"{name}: a tensor stored in pieces has no fused rows.")
        box = box or (slice(None),)
        _, total, *_ = self.shape(name)
        start, stop = box[1].indices(total)[:2] if len(box) > 1 else (0, total)
        experts = []
        for names in self._pieces[name][box[0]]:
            parts, offset = [], 0
            for piece in names:
                size = self._reader.shape(piece)[0]
                lo, hi = max(start, offset), min(stop, offset + size)
                if lo < hi:
                    part = (slice(lo - offset, hi - offset), *box[2:])
                    parts.append(self._reader.read(piece, None, part))
                offset += size
            experts.append(np.concatenate(parts))
        return np.stack(experts)
