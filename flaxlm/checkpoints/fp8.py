"""Block-quantized FP8 tensors of a HuggingFace checkpoint, read as the plain tensors they
stand for.

The Hub's DeepSeek-V3/R1 and Kimi K2 files say in config.json `quantization_config =
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
[128, 128]}`: each quantized Linear's `<name>.weight` is float8_e4m3fn `[out, in]` and
`<name>.weight_scale_inv` float32 `[ceil(out / 128), ceil(in / 128)]` holds one scale per
128 x 128 block (the last row and column of blocks cut short where 128 does not divide the
shape); the weight is each fp8 value times its block's scale. Norms, embeddings, the router
and `lm_head` are stored unquantized.

`dequantize` forms that product in float32, one rounding (an e4m3 value is exact in float32),
and the import casts it to the run's param dtype: what transformers' dequantize-on-load
(`Fp8Dequantize`) gives, its float32 product cast to the param's dtype, and in float32 its
`_dequantize_fp8_weight` bit for bit. `DequantizedReader` serves every weight that has a
`_scale_inv` beside it dequantized, the scales consumed, once each weight's and scale's dtype
and shape are the format's; flaxlm writes plain tensors back (`hf.save_pretrained`), never
FP8. FP8 tensors in a checkpoint whose config.json does not say so are refused (`dequantized`):
read as they are, every value would miss its block's scale.

With `activation_scheme: static` (transformers' FP8 serialization with static activation
quantization, one scale a tensor) each quantized Linear also stores an `activation_scale`, by
which an FP8 kernel quantizes that Linear's input. flaxlm computes the input in the param
dtype, as transformers does when it dequantizes on load, so those scales are read past.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath

from flaxlm.checkpoints.hf_files import Box, file_slices, read_hf_config

SCALE = "_scale_inv"
ACTIVATION_SCALE = "activation_scale"
WEIGHT_DTYPE = "float8_e4m3fn"
# The scales' dtype (transformers' FP8Linear holds float32); the half floats read exactly too.
SCALE_DTYPES = ("float32", "bfloat16", "float16")


def is_fp8(hf_config: Mapping[str, Any]) -> bool:
    """Whether config.json's `quantization_config` is block FP8's (`quant_method: fp8`)."""
    return (hf_config.get("quantization_config") or {}).get("quant_method") == "fp8"


def block_size(hf_config: Mapping[str, Any]) -> tuple[int, int] | None:
    """An FP8 config.json's `weight_block_size` as `(rows, cols)` (None: one scale a
    tensor). A setting flaxlm cannot read (an `fmt` other than e4m3, an activation scheme
    other than dynamic or static, a malformed block size) is a ValueError naming it."""
    quant = hf_config["quantization_config"]
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(
            f"config.json's quantization_config fmt is {fmt!r}: flaxlm reads FP8 weights in "
            "'e4m3' (float8_e4m3fn, the Hub's DeepSeek-V3 and Kimi K2 files) only."
        )
    static_activations(hf_config)  # a scheme flaxlm can read
    block = quant.get("weight_block_size", (128, 128))
    if block is None:
        return None
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(
            f"config.json's quantization_config weight_block_size is {block!r}: two positive "
            "integers [rows, cols], or null for one scale a tensor."
        )
    return (block[0], block[1])


def static_activations(hf_config: Mapping[str, Any]) -> bool:
    """Whether an FP8 config.json's `activation_scheme` is 'static' (an `activation_scale`
    beside each quantized weight) rather than 'dynamic'; another is a ValueError."""
    scheme = str(hf_config["quantization_config"].get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ValueError(
            f"config.json's quantization_config activation_scheme is {scheme!r}: flaxlm "
            "reads 'dynamic' and 'static' FP8 checkpoints (it dequantizes the weights and "
            "computes in the param dtype)."
        )
    return scheme == "static"


def activation_scale_name(weight: str) -> str:
    """The name of FP8 weight `weight`'s static activation scale, as transformers saves it:
    `<module>.activation_scale` beside `<module>.weight`, `<param>_activation_scale` beside
    a fused experts' `<param>`."""
    if weight.endswith(".weight"):
        return weight.removesuffix("weight") + ACTIVATION_SCALE
    return f"{weight}_{ACTIVATION_SCALE}"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...]:
    """The `_scale_inv` shape of a weight of `shape`: one scale per block of its last two
    axes (the blocks at the far edges cut short), or per leading index with no blocks."""
    if block is None:
        return tuple(shape[:-2])
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize(
    weight: np.ndarray,
    scale_inv: np.ndarray,
    block: tuple[int, int] | None,
    first_row: int = 0,
    first_col: int = 0,
) -> np.ndarray:
    """float32 `weight x scale_inv`: `weight` `[..., rows, cols]` (from row `first_row` and
    column `first_col` of the block grid `scale_inv` covers: a part of the stored tensor),
    each value times its block's scale."""
    values = np.asarray(weight).astype(np.float32)
    scale = np.asarray(scale_inv).astype(np.float32)
    if block is None:
        return values * scale.reshape(*values.shape[:-2], 1, 1)
    *_, rows, cols = values.shape
    row_scale = np.take(scale, (first_row + np.arange(rows)) // block[0], axis=-2)
    return values * np.take(row_scale, (first_col + np.arange(cols)) // block[1], axis=-1)


def scale_box(box: Box, block: tuple[int, int]) -> Box:
    """The part of a weight's `_scale_inv` that covers `box` of the weight: the blocks its
    last two axes' slices touch."""
    *lead, rows, cols = box
    return (
        *lead,
        slice(rows.start // block[0], -(-rows.stop // block[0])),
        slice(cols.start // block[1], -(-cols.stop // block[1])),
    )


def float8_tensors(reader: Any) -> list[str]:
    """The names of `reader`'s tensors stored in a float8 dtype, sorted."""
    return sorted(n for n in reader.file_of if reader.dtype(n).startswith("float8"))


def check_pair(reader: Any, name: str, block: tuple[int, int] | None) -> None:
    """A ValueError naming the file and the tensor where FP8 weight `name` and its
    `_scale_inv` in `reader` (a `hf_files.SafetensorsReader`) are not what config.json's
    quantization_config says: float8_e4m3fn values, float32 scales of the block grid's
    shape."""
    scale = name + SCALE
    for tensor, want in ((name, (WEIGHT_DTYPE,)), (scale, SCALE_DTYPES)):
        if reader.dtype(tensor) not in want:
            raise ValueError(
                f"{reader.file_path(tensor)}: tensor {tensor!r} holds {reader.dtype(tensor)}, "
                f"but config.json's quantization_config (fmt e4m3) stores {want[0]} "
                f"{'weights' if tensor == name else 'block scales'}."
            )
    if len(reader.shape(name)) < 2:
        raise ValueError(
            f"{reader.file_path(name)}: tensor {name!r} has shape {reader.shape(name)}, but "
            "FP8 weights are [..., rows, cols]."
        )
    want_shape = scale_shape(reader.shape(name), block)
    got = reader.shape(scale)
    if math.prod(got) != math.prod(want_shape) or (block is not None and got != want_shape):
        raise ValueError(
            f"{reader.file_path(scale)}: tensor {scale!r} has shape {got}, but a weight of "
            f"{reader.shape(name)} with config.json's weight_block_size "
            f"{block and list(block)} has {want_shape} scales."
        )


class DequantizedReader:
    """A checkpoint reader (`file_of`, `shape`, `dtype`, `file_path`, `read`, as
    `hf_files.SafetensorsReader`'s) that serves each FP8 weight `<name>` with a
    `<name>_scale_inv` dequantized to float32, the scales (and with `static` activations
    their `activation_scale_name`s) taken out of `file_of`; other tensors pass through. Each
    pair is checked first (`check_pair`), and an FP8 tensor with no scales is an error.

    A read of a box (a device shard's part) reads that part of the weight and the scales of
    the blocks it touches, and gives what the whole tensor's dequantization holds there, bit
    for bit. The last tensor dequantized is kept (a param read whole by every shard: a
    layout hf.py cannot cut)."""

    def __init__(self, reader: Any, block: tuple[int, int] | None, static: bool = False):
        self._reader = reader
        self._block = block
        stored = reader.file_of
        self._quantized = {
            name[: -len(SCALE)]
            for name in stored
            if name.endswith(SCALE) and name[: -len(SCALE)] in stored
        }
        for name in sorted(self._quantized):
            check_pair(reader, name, block)
        unscaled = [n for n in float8_tensors(reader) if n not in self._quantized]
        if unscaled:
            raise ValueError(
                f"{reader.file_path(unscaled[0])}: tensor {unscaled[0]!r} holds "
                f"{reader.dtype(unscaled[0])} but has no {unscaled[0] + SCALE!r} beside it "
                "(its block scales, without which its values are not the weight's)."
            )
        scales = {name + SCALE for name in self._quantized}
        if static:
            scales |= {activation_scale_name(name) for name in self._quantized}
        self.file_of = {n: f for n, f in stored.items() if n not in scales}
        self._last: tuple[Any, Any] = (None, None)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader.shape(name)

    def dtype(self, name: str) -> str:
        """The stored dtype (a dequantized weight's too: float8_e4m3fn)."""
        return self._reader.dtype(name)

    def file_path(self, name: str) -> epath.Path:
        return self._reader.file_path(name)

    def read(
        self, name: str, rows: tuple[int, int] | None = None, box: Box | None = None
    ) -> np.ndarray:
        if name not in self._quantized:
            return self._reader.read(name, rows, box)
        if self._last[0] == (name, rows, box):
            return self._last[1]
        weight = self._reader.read(name, rows, box)
        shape = self.shape(name)
        where = file_slices(rows, box) + (slice(None),) * len(shape)
        where = tuple(slice(*s.indices(n)[:2]) for s, n in zip(where, shape, strict=False))
        if self._block is None:
            scale = self._reader.read(name + SCALE).reshape(scale_shape(shape, None))
            tensor = dequantize(weight, scale[where[:-2]], None)
        else:
            scales = scale_box(where, self._block)
            scale = self._reader.read(name + SCALE, None, scales)
            first_row = where[-2].start - scales[-2].start * self._block[0]
            first_col = where[-1].start - scales[-1].start * self._block[1]
            tensor = dequantize(weight, scale, self._block, first_row, first_col)
        self._last = ((name, rows, box), tensor)
        return tensor


def dequantized(reader: Any, path: str | epath.Path) -> Any:
    """`reader`, its FP8 weights served dequantized (`DequantizedReader`) where the
    checkpoint's config.json says `quant_method: fp8`. FP8 tensors or `_scale_inv` scales in
    a checkpoint whose config.json says otherwise (or has none) are a ValueError naming one."""
    config_file = epath.Path(path) / "config.json"
    hf_config = read_hf_config(path) if config_file.exists() else {}
    if is_fp8(hf_config):
        return DequantizedReader(reader, block_size(hf_config), static_activations(hf_config))
    quantized = float8_tensors(reader) or sorted(n for n in reader.file_of if n.endswith(SCALE))
    if quantized:
        method = (hf_config.get("quantization_config") or {}).get("quant_method")
        says = f"quant_method {method!r}" if method else "no quantization_config"
        raise ValueError(
            f"{reader.file_path(quantized[0])}: tensor {quantized[0]!r} "
            f"({reader.dtype(quantized[0])}) is a block-FP8 checkpoint's, but {config_file} "
            f"says {says}: restore the checkpoint's own config.json, whose quantization_config "
            'reads {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], '
            "...}."
        )
    return reader
