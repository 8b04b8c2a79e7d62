"""The files of a HuggingFace checkpoint directory: config.json, generation_config.json, the
tokenizer's files, and memory-mapped reads of its (possibly sharded) safetensors.

`hf.py` maps their contents onto a model; nothing here knows one.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np
from etils import epath

# A part of a tensor: one `slice(start, stop)` (step 1, bounds given) for each leading axis.
Box = tuple[slice, ...]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
GENERATION_FILE = "generation_config.json"
# What `tokenizer.save_pretrained` writes (any tokenizer class), chat templates included.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
# Stored dtypes that safetensors' numpy reader cannot name (it looks for numpy.float8_*):
# read from the file's bytes (the Hub's FP8 DeepSeek-V3 and Kimi K2 weights).
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
# safetensors' dtype codes by the names numpy, ml_dtypes and torch give them (for messages).
DTYPE_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}


def read_hf_config(path: str | epath.Path) -> dict[str, Any]:
    file = epath.Path(path) / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: a HuggingFace checkpoint directory needs one.")
    return json.loads(file.read_text())


# config.json's dropout probabilities inside the language model, transformers' names across the
# families flaxlm reads. flaxlm trains with its config's `dropout_rate` instead (T5's, whose
# config.json names it so, is read; the rest are not).
DROPOUT_KEYS = (
    "attention_dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
    "dropout",
    "residual_dropout",
    "hidden_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "activation_dropout",
    "layerdrop",
)


def file_dropouts(hf_config: dict[str, Any]) -> dict[str, float]:
    """The non-zero `DROPOUT_KEYS` of a config.json dict."""
    return {
        key: float(value)
        for key in DROPOUT_KEYS
        if isinstance(value := hf_config.get(key), int | float) and value > 0
    }


# What an inference run may compute an HF checkpoint in ('auto': the checkpoint's own).
INFERENCE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_inference_dtype(dtype: str) -> None:
    """A ValueError naming the choices when `dtype` is not one of `INFERENCE_DTYPES`."""
    if dtype not in INFERENCE_DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {INFERENCE_DTYPES}.")


def inference_dtype(dtype: str, path: str | epath.Path) -> str:
    """The dtype an inference run holds and computes HF directory `path`'s model in: `dtype`,
    or for 'auto' the checkpoint's own (config.json's `dtype`, `torch_dtype` before
    transformers 5; float32 where it names none of the three), as transformers'
    `from_pretrained` does by default since version 5 (`dtype="auto"`)."""
    check_inference_dtype(dtype)
    if dtype != "auto":
        return dtype
    config = read_hf_config(path)
    stored = config.get("dtype") or config.get("torch_dtype")
    return stored if stored in INFERENCE_DTYPES[1:] else "float32"


def read_generation_config(path: str | epath.Path) -> dict[str, Any] | None:
    file = epath.Path(path) / GENERATION_FILE
    return json.loads(file.read_text()) if file.exists() else None


def copy_tokenizer(src: str | epath.Path, dst: str | epath.Path) -> list[str]:
    """Copies the tokenizer files (chat templates included) of HF directory `src` into
    `dst`; returns their names (none: `dst` is not created)."""
    src, dst = epath.Path(src), epath.Path(dst)
    names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if names and jax.process_index() == 0:
        dst.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copyfile(str(src / name), str(dst / name))
    return names


class SafetensorsReader:
    """Memory-mapped access to the tensors of a (possibly sharded) safetensors checkpoint."""

    def __init__(
        self,
        path: str | epath.Path,
        base_model_prefix: str = "",
        own_names: Callable | None = None,
        quiet: bool = False,
    ):
        """`own_names`: an `HFSpec.own_names`, for a checkpoint that holds the model in a larger
        one (its other tensors skipped, with a note unless `quiet`)."""
        from safetensors import safe_open

        root = epath.Path(path)
        index = root / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in root.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"No *.safetensors in {root}; flaxlm reads HF checkpoints in safetensors "
                    "(save with `save_pretrained(..., safe_serialization=True)`)."
                )
        self._handles = {f: _open_safetensors(root / f, safe_open) for f in files}
        stored = {name: f for f, handle in self._handles.items() for name in handle.keys()}
        names, skipped = own_names(stored) if own_names else ({n: n for n in stored}, [])
        if skipped and not quiet and jax.process_index() == 0:
            print(
                f"{root}: skipped {len(skipped)} tensors the model does not use: {skipped[0]}, ..."
            )
        # Our name -> the file's. A checkpoint saved from the bare base model (GPT2Model,
        # OPTModel: most hub GPT-2 and OPT files) names its tensors without the prefix.
        self._stored = names
        prefix = f"{base_model_prefix}." if base_model_prefix else ""
        if prefix and not any(name.startswith(prefix) for name in names):
            self._stored = {prefix + ours: name for ours, name in names.items()}
        self.file_of: dict[str, str] = {n: stored[s] for n, s in self._stored.items()}

        self._root = root
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        handle = self._handles[self.file_of[name]]
        return tuple(handle.get_slice(self._stored[name]).get_shape())

    def dtype(self, name: str) -> str:
        """The tensor's stored dtype as numpy and torch name it (`float32`, `uint8`,
        `float8_e4m3fn`), from the file's header (nothing read)."""
        code = self._handles[self.file_of[name]].get_slice(self._stored[name]).get_dtype()
        return DTYPE_NAMES.get(code, code)

    def file_path(self, name: str) -> epath.Path:
        """The safetensors file that holds the tensor (for messages that name it)."""
        return self._root / self.file_of[name]

    def stored_name(self, name: str) -> str:
        """The tensor's name in its file (ours after `own_names`' renames and the prefix)."""
        return self._stored[name]

    def read(
        self, name: str, rows: tuple[int, int] | None = None, box: Box | None = None
    ) -> np.ndarray:
        """The tensor, or only its rows [start, stop) (a part of a fused tensor), or only
        `box` of those (one slice an axis, counted from the rows' first): a box reads no
        more of the file than it covers."""
        handle = self._handles[self.file_of[name]]
        try:
            raw = RAW_DTYPES.get(handle.get_slice(self._stored[name]).get_dtype())
            if rows is None and box is None:
                return (
                    np.array(self._raw(name, raw)) if raw else handle.get_tensor(self._stored[name])
                )
            where = file_slices(rows, box)
            if raw is not None:
                return np.array(self._raw(name, raw)[where])
            return handle.get_slice(self._stored[name])[where]
        except Exception as e:  # noqa: BLE001 - safetensors' errors have no common base
            raise ValueError(
                f"{self._root / self.file_of[name]}: tensor {self._stored[name]!r} cannot be "
                f"read ({e}); the file may be truncated: copy or download it again."
            ) from e

    def _raw(self, name: str, dtype: Any) -> np.ndarray:
        """The tensor memory-mapped from its file's header offsets (safetensors' layout: an
        8-byte little-endian header size, the JSON header, then the data)."""
        file = self.file_of[name]
        if file not in self._headers:
            with open(str(self._root / file), "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._headers[file] = (8 + size, json.loads(f.read(size)))
        start, header = self._headers[file]
        entry = header[self._stored[name]]
        first, last = entry["data_offsets"]
        data = np.memmap(str(self._root / file), np.uint8, "r", start + first, (last - first,))
        return data.view(dtype).reshape(entry["shape"])


def file_slices(rows: tuple[int, int] | None, box: Box | None) -> tuple[slice, ...]:
    """The stored tensor's slices for rows [start, stop) of it (None: all) and `box` within
    those (None: all)."""
    start, stop = rows if rows is not None else (0, None)
    if box is None:
        return (slice(start, stop),)
    first = box[0]
    return (slice(start + first.start, start + first.stop), *box[1:])


def _open_safetensors(path: epath.Path, safe_open: Any) -> Any:
    """A safetensors handle, or a ValueError naming the file (missing, truncated, not
    safetensors) instead of the library's bare message."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing (the checkpoint's index names it).")
    try:
        return safe_open(str(path), framework="numpy")
    except Exception as e:  # noqa: BLE001 - SafetensorError has no importable base
        raise ValueError(
            f"{path} is not a readable safetensors file ({e}); it may be truncated or not "
            "safetensors: copy or download it again."
        ) from e
