"""Weights quantized in compressed-tensors' format (`quant_method: compressed-tensors`:
llm-compressor's W4A16 / W8A16 / W8A8 / FP8 files, Kimi K2 Thinking's INT4 experts), read as
the plain tensors they stand for.

config.json's `quantization_config` holds `config_groups`, each a scheme for the modules its
`targets` name (`Linear`, or `re:<pattern>` matched against module names) with its `format`
(or the top level's). A quantized Linear `<m>` stores, by format:

- `pack-quantized`: `<m>.weight_packed` int32 `[rows, ceil(cols * bits / 32)]`, the weight's
  integers (1 to 8 bits, offset by 2 ** (bits - 1) to be unsigned) packed densely along each
  row, element i at bits [i * bits, (i + 1) * bits) of the row's little-endian stream;
  `<m>.weight_shape` the unpacked shape; an asymmetric group or channel scheme's
  `<m>.weight_zero_point` packed so along the columns;
- `int-quantized` / `naive-quantized`: `<m>.weight` int8 (the zero point int8 unpacked);
- `float-quantized`: `<m>.weight` float8_e4m3fn;

and `<m>.weight_scale`: one scale (`tensor`), one a row (`channel`), one a row's
`group_size` columns (`group`) or one a block of `block_structure` (`block`). The weight is
`(q - zero_point) * scale`, formed here in float32 (one rounding at most: a small integer or
an e4m3 value times the scale, exact for float32 and bfloat16 scales) and cast by the import
to the param dtype: compressed-tensors' `decompress` in float32 bit for bit, and in bfloat16
the same numbers as its bfloat16 product.

A scheme that also quantizes the Linears' inputs or outputs (W8A8: `input_activations`,
static scales `input_scale` stored, or dynamic ones) or the KV cache (`kv_cache_scheme`,
`k_scale` / `v_scale`) is read with a note: flaxlm computes those in the run's dtype
unquantized, as a weight-only kernel does (transformers' compressed-tensors model simulates
the quantization, so its logits differ by that quantization's error); the static scales are
read past.

Refused (a ValueError naming the setting): other formats (`nvfp4-pack-quantized`,
`mxfp4-pack-quantized`, `marlin-24`, sparse formats), sparsity or transform configs (weights
that are not the model's until transformed), `tensor_group` and other strategies, dynamic
weight scales, float weights of other than 8 bits, a quantized tensor whose dtype or shape is
not its format's, a module that two config groups target, columns in activation order (an
older GPTQ export's `weight_g_idx`, which compressed-tensors no longer writes).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from etils import epath

from flaxlm.checkpoints.hf_files import Box, file_slices, read_hf_config

METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
# The quantization methods whose files flaxlm dequantizes on import: block FP8 (`fp8.py`),
# gpt-oss's MXFP4 experts (`mxfp4.py`) and compressed-tensors' (here).
READ_METHODS = ("fp8", "mxfp4", METHOD)
STRATEGIES = ("tensor", "channel", "group", "block")
# The params a quantized Linear stores beside (or in place of) its weight.
WEIGHT_PARAMS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
# Static scales for kernels flaxlm does not use: read past.
READ_PAST = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")
KV_SCALES = ("k_scale", "v_scale")


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One config group's weight quantization."""

    format: str
    num_bits: int
    type: str  # 'int' or 'float'
    symmetric: bool
    strategy: str
    group_size: int | None = None
    block: tuple[int, int] | None = None


def is_compressed(hf_config: Mapping[str, Any]) -> bool:
    """Whether config.json's `quantization_config` is compressed-tensors'."""
    return (hf_config.get("quantization_config") or {}).get("quant_method") == METHOD


def _setting(name: str, value: Any, reads: str) -> ValueError:
    return ValueError(
        f"config.json's compressed-tensors quantization_config has {name} {value!r}: flaxlm "
        f"reads {reads}; load a dequantized copy."
    )


def schemes(hf_config: Mapping[str, Any]) -> list[tuple[tuple[str, ...], Scheme]]:
    """Each config group's `(targets, Scheme)` of a compressed-tensors config.json (groups
    that quantize no weight left out), or a ValueError naming what flaxlm cannot read."""
    quant = hf_config["quantization_config"]
    for key in ("sparsity_config", "transform_config"):
        if quant.get(key):
            raise _setting(key, quant[key], "quantized weights only (no sparsity or transforms)")
    out = []
    for name, group in (quant.get("config_groups") or {}).items():
        weights = group.get("weights")
        if not weights:
            continue  # activations only: the weights are stored plain
        fmt = group.get("format") or quant.get("format")
        if fmt not in FORMATS:
            raise _setting(f"config group {name!r}'s format", fmt, f"the formats {FORMATS}")
        kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 8))
        strategy = weights.get("strategy")
        if strategy not in STRATEGIES:
            raise _setting(f"{name!r}'s weight strategy", strategy, f"{STRATEGIES}")
        if weights.get("dynamic"):
            raise _setting(f"{name!r}'s weights dynamic", True, "static weight scales")
        if (kind == "float") != (fmt == "float-quantized"):
            raise _setting(f"{name!r}'s weight type for format {fmt!r}", kind, "int or float")
        if not (1 <= bits <= 8 if fmt == "pack-quantized" else bits == 8):
            raise _setting(f"{name!r}'s num_bits for format {fmt!r}", bits, "1 to 8 packed, else 8")
        group_size = weights.get("group_size")
        if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
            raise _setting(f"{name!r}'s group_size", group_size, "a positive group size")
        block = weights.get("block_structure")
        if strategy == "block" and not (isinstance(block, list) and len(block) == 2):
            raise _setting(f"{name!r}'s block_structure", block, "[rows, cols] blocks")
        scheme = Scheme(
            fmt, bits, kind, bool(weights.get("symmetric", True)), strategy,
            group_size if strategy == "group" else None,
            tuple(int(b) for b in block) if strategy == "block" else None,
        )  # fmt: skip
        out.append((tuple(group.get("targets") or ()), scheme))
    return out


def scheme_of(module: str, stored: str, groups: list[tuple[tuple[str, ...], Scheme]]) -> Scheme:
    """The scheme of quantized module `module` (`stored`: its name in the file): the group a
    `re:` target of which matches either name, else the one targeting `Linear`."""
    by_name = [
        s
        for targets, s in groups
        if any(
            t.startswith("re:") and re.match(t[3:], n) for t in targets for n in (module, stored)
        )
    ]
    found = by_name or [s for targets, s in groups if "Linear" in targets]
    if len(set(found)) != 1:
        raise ValueError(
            f"compressed-tensors module {stored!r} is quantized, and config.json's config "
            f"groups target it {len(set(found))} ways: flaxlm reads one scheme a module."
        )
    return found[0]


def unpack(packed: np.ndarray, num_bits: int, cols: int) -> np.ndarray:
    """int32 `[rows, words]` packed as `pack-quantized` -> int32 `[rows, cols]` (signed)."""
    rows = packed.shape[0]
    data = np.ascontiguousarray(packed.astype("<i4")).view(np.uint8).reshape(rows, -1)
    if num_bits == 8:
        values = data[:, :cols].astype(np.int32)
    elif num_bits == 4:
        values = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(rows, -1)[:, :cols]
        values = values.astype(np.int32)
    else:
        bits = np.unpackbits(data, axis=1, bitorder="little")[:, : cols * num_bits]
        weights = (1 << np.arange(num_bits, dtype=np.int32))[None, None]
        values = (bits.reshape(rows, cols, num_bits).astype(np.int32) * weights).sum(-1)
    return values - (1 << (num_bits - 1))


def dequantize(
    q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, scheme: Scheme
) -> np.ndarray:
    """float32 `(q - zero) * scale` of a `[rows, cols]` weight, the scales (and zero points)
    broadcast over what `scheme.strategy` gives each."""
    rows, cols = q.shape

    def spread(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32)
        if scheme.strategy == "tensor":
            return x.reshape(())
        if scheme.strategy == "channel":
            return x.reshape(rows, 1)
        if scheme.strategy == "group":
            return np.repeat(x, scheme.group_size, axis=1)[:, :cols]
        bh, bw = scheme.block
        return np.repeat(np.repeat(x, bh, axis=0), bw, axis=1)[:rows, :cols]

    values = q.astype(np.float32)
    if zero is not None:
        values = values - spread(zero)
    return values * spread(scale)


def _scale_shape(scheme: Scheme, rows: int, cols: int) -> tuple[int, ...]:
    if scheme.strategy == "tensor":
        return (1,)
    if scheme.strategy == "channel":
        return (rows, 1)
    if scheme.strategy == "group":
        return (rows, math.ceil(cols / scheme.group_size))
    bh, bw = scheme.block
    return (math.ceil(rows / bh), math.ceil(cols / bw))


class CompressedReader:
    """A checkpoint reader (`file_of`, `shape`, `dtype`, `file_path`, `read`, as
    `hf_files.SafetensorsReader`'s) that serves each quantized Linear's `<m>.weight`
    dequantized to float32, its quantization params and static activation scales consumed,
    once each module's tensors are its scheme's (dtypes and shapes); other tensors pass
    through. A read of a part dequantizes the whole weight (kept for the next part)."""

    def __init__(self, reader: Any, hf_config: Mapping[str, Any]):
        self._reader = reader
        groups = schemes(hf_config)
        stored = reader.file_of
        modules = sorted(n[: -len(".weight_scale")] for n in stored if n.endswith(".weight_scale"))
        self._schemes: dict[str, Scheme] = {}
        # A packed weight's unpacked shape (its `weight_shape`), read once.
        self._shapes: dict[str, tuple[int, ...]] = {}
        for m in modules:
            file_name = reader.stored_name(f"{m}.weight_scale").removesuffix(".weight_scale")
            scheme = scheme_of(m, file_name, groups)
            self._schemes[m] = scheme
            if scheme.format == "pack-quantized" and f"{m}.weight_shape" in stored:
                self._shapes[m] = tuple(int(n) for n in reader.read(f"{m}.weight_shape"))
            self._check(m, scheme)
        taken = {f"{m}.{p}" for m in modules for p in (*WEIGHT_PARAMS, *READ_PAST)}
        kv = hf_config["quantization_config"].get("kv_cache_scheme")
        self.file_of = {
            n: f
            for n, f in stored.items()
            if n not in taken and not (kv and n.rpartition(".")[2] in KV_SCALES)
        }
        for m in modules:
            self.file_of[f"{m}.weight"] = stored[f"{m}.weight_scale"]
        self._last: tuple[str | None, Any] = (None, None)

    def _packed(self, m: str) -> bool:
        return self._schemes[m].format == "pack-quantized"

    def _check(self, m: str, scheme: Scheme) -> None:
        """A ValueError naming the file and tensor where module `m`'s tensors are not its
        scheme's."""
        r = self._reader
        weight = f"{m}.weight_packed" if scheme.format == "pack-quantized" else f"{m}.weight"
        want = {"pack-quantized": "int32", "float-quantized": "float8_e4m3fn"}
        want_dtype = want.get(scheme.format, "int8")
        if f"{m}.weight_g_idx" in r.file_of:
            raise ValueError(
                f"{r.file_path(f'{m}.weight_g_idx')}: module {m!r} stores its columns' groups "
                "in activation order (weight_g_idx, an older GPTQ export's), which flaxlm does "
                "not read; load a dequantized copy."
            )
        if weight not in r.file_of:
            raise ValueError(
                f"{r.file_path(f'{m}.weight_scale')}: module {m!r} has a weight_scale but no "
                f"{weight!r} ({scheme.format}, as config.json's quantization_config says)."
            )
        if scheme.format == "pack-quantized" and m not in self._shapes:
            raise ValueError(
                f"{r.file_path(weight)}: module {m!r} has no {m + '.weight_shape'!r}, the "
                "unpacked shape pack-quantized weights store beside them."
            )
        if r.dtype(weight) != want_dtype or len(r.shape(weight)) != 2:
            raise ValueError(
                f"{r.file_path(weight)}: tensor {weight!r} holds {r.dtype(weight)} "
                f"{r.shape(weight)}, but {scheme.format} weights are {want_dtype} [rows, cols]: "
                "the file is not the format config.json's quantization_config says."
            )
        rows, cols = self.shape(f"{m}.weight") if scheme.format == "pack-quantized" else (
            r.shape(weight)
        )  # fmt: skip
        if scheme.format == "pack-quantized":
            words = math.ceil(cols * scheme.num_bits / 32)
            if r.shape(weight) != (rows, words):
                raise ValueError(
                    f"{r.file_path(weight)}: tensor {weight!r} has shape {r.shape(weight)}, but "
                    f"{rows} x {cols} {scheme.num_bits}-bit values pack into {(rows, words)}."
                )
        scale = f"{m}.weight_scale"
        got, shape = r.shape(scale), _scale_shape(scheme, rows, cols)
        if math.prod(got) != math.prod(shape):
            raise ValueError(
                f"{r.file_path(scale)}: tensor {scale!r} has shape {got}, but a {rows} x {cols} "
                f"weight quantized by {scheme.strategy} has {shape} scales."
            )

    def shape(self, name: str) -> tuple[int, ...]:
        m = name.removesuffix(".weight")
        if not name.endswith(".weight") or m not in self._schemes:
            return self._reader.shape(name)
        if self._packed(m):
            return self._shapes[m]
        return self._reader.shape(name)

    def dtype(self, name: str) -> str:
        """The served dtype: float32 for a dequantized weight."""
        if name.endswith(".weight") and name.removesuffix(".weight") in self._schemes:
            return "float32"
        return self._reader.dtype(name)

    def file_path(self, name: str) -> epath.Path:
        m = name.removesuffix(".weight")
        quantized = name.endswith(".weight") and m in self._schemes
        return self._reader.file_path(f"{m}.weight_scale" if quantized else name)

    def read(
        self, name: str, rows: tuple[int, int] | None = None, box: Box | None = None
    ) -> np.ndarray:
        m = name.removesuffix(".weight")
        if not name.endswith(".weight") or m not in self._schemes:
            return self._reader.read(name, rows, box)
        if self._last[0] != name:
            self._last = (name, self._dequantized(m))
        return self._last[1][file_slices(rows, box)]

    def _dequantized(self, m: str) -> np.ndarray:
        r, scheme = self._reader, self._schemes[m]
        names = r.file_of
        rows, cols = self.shape(f"{m}.weight")
        if self._packed(m):
            q = unpack(r.read(f"{m}.weight_packed"), scheme.num_bits, cols)
        else:
            q = r.read(f"{m}.weight")
        zero = r.read(f"{m}.weight_zero_point") if f"{m}.weight_zero_point" in names else None
        if zero is not None and self._packed(m) and scheme.strategy in ("group", "channel"):
            groups = _scale_shape(scheme, rows, cols)[1]
            zero = unpack(np.ascontiguousarray(zero.T), scheme.num_bits, rows).T[:, :groups]
        scale = r.read(f"{m}.weight_scale").reshape(_scale_shape(scheme, rows, cols))
        return dequantize(q, scale, zero, scheme)


def unquantized_activations(hf_config: Mapping[str, Any]) -> list[str]:
    """What a compressed-tensors scheme quantizes beside the weights (`input_activations`,
    `output_activations`, `kv_cache_scheme`), which flaxlm computes unquantized."""
    quant = hf_config["quantization_config"]
    kinds = {
        kind
        for group in (quant.get("config_groups") or {}).values()
        for kind in ("input_activations", "output_activations")
        if group.get(kind)
    }
    return sorted(kinds | ({"kv_cache_scheme"} if quant.get("kv_cache_scheme") else set()))


def dequantized(reader: Any, path: str | epath.Path) -> Any:
    """`reader`, its compressed-tensors weights served dequantized (`CompressedReader`)
    where the checkpoint's config.json says `quant_method: compressed-tensors` (with a note
    where its scheme quantizes activations too)."""
    config_file = epath.Path(path) / "config.json"
    hf_config = read_hf_config(path) if config_file.exists() else {}
    if not is_compressed(hf_config):
        return reader
    kinds = unquantized_activations(hf_config)
    if kinds and jax.process_index() == 0:
        print(
            f"{path}: its compressed-tensors scheme quantizes {', '.join(kinds)} too; flaxlm "
            "reads the weights dequantized and computes those unquantized (transformers' "
            "compressed-tensors model simulates that quantization: its logits differ by "
            "the quantization's error)."
        )
    return CompressedReader(reader, hf_config)
