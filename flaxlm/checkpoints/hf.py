"""HuggingFace checkpoints in and out: config.json + safetensors <-> sharded params.

Each family file registers an `HFSpec` (models/hf_spec.py) saying how its config and params
correspond to HF's. Reading places every tensor straight onto its sharding, one tensor and
one device shard at a time (`jax.make_array_from_callback` over a memory-mapped safetensors
read), so a checkpoint larger than one device's memory loads; a shard reads (and an FP8 or
MXFP4 tensor dequantizes) only its part of the file's tensors, and of a stack of layers or
experts only its own, so each host of many reads its share. Writing gathers one param at
a time on the host and writes safetensors shards (with an index past `max_shard_size`) that
`transformers` loads as is.

    model, params = hf.from_pretrained("/path/to/hf_dir", partitioner)
    hf.save_pretrained(model, params, "/path/to/out_dir")
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import traverse_util

from flaxlm.checkpoints import compressed, fp8, hf_slices, mxfp4
from flaxlm.checkpoints.hf_files import (
    GENERATION_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    SafetensorsReader,
    copy_tokenizer,
    read_generation_config,
    read_hf_config,
)
from flaxlm.models import hf_spec, stacks
from flaxlm.models.base import BaseModel, EncoderOnlyModel
from flaxlm.models.hf_spec import HF_SPECS, HFSpec, HFTensor
from flaxlm.parallel import pytrees
from flaxlm.parallel.partitioning import Partitioner

Params = Any
VOCAB_MULTIPLE = 128
# generation_config.json fields that an export without the source's file derives from the
# special ids (what transformers' GenerationConfig.from_model_config takes).
_GENERATION_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


# ------------------------------------------------------------------------ families


def spec_for_model_type(model_type: str) -> HFSpec:
    if model_type not in HF_SPECS:
        raise ValueError(
            f"config.json has model_type {model_type!r}, which flaxlm does not know; "
            f"known: {sorted([*HF_SPECS, *hf_spec.MULTIMODAL])}."
        )
    return HF_SPECS[model_type]


def spec_for_config(config: Any) -> HFSpec:
    matches = [spec for spec in HF_SPECS.values() if isinstance(config, spec.config_cls)]
    if not matches:
        raise ValueError(f"No HuggingFace mapping for {type(config).__name__}.")
    # A family whose config extends another's (Mistral 4's DeepSeek-V3's) is its own: the
    # most derived config class wins.
    return max(matches, key=lambda spec: len(spec.config_cls.__mro__)).for_config(config)


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """`vocab_size` rounded up to a multiple of `multiple`."""
    return -(-vocab_size // multiple) * multiple


def vocab_multiple_for(partitioner: Partitioner | None) -> int:
    """What a vocabulary is padded to a multiple of: 128, and the size of `partitioner`'s
    `tensor` axis (which splits the embedding and the head)."""
    if partitioner is None:
        return VOCAB_MULTIPLE
    return math.lcm(VOCAB_MULTIPLE, dict(partitioner.mesh.shape).get("tensor", 1))


def config_from_hf_dict(
    hf_config: Mapping[str, Any],
    vocab_multiple: int = VOCAB_MULTIPLE,
    dtype: Any = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[HFSpec, Any]:
    """The family spec and its config for an HF config.json dict, vocabulary padded to a
    multiple of `vocab_multiple`; `dtype` sets the compute and param dtypes, `overrides` any
    config field after it. A multimodal file's config gives its text tower's
    (`hf_spec.text_tower`)."""
    hf_config = hf_spec.text_tower(dict(hf_config))
    spec = spec_for_model_type(hf_config.get("model_type", "<missing>"))
    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    if method is not None and method not in compressed.READ_METHODS:
        raise ValueError(
            f"config.json's quantization_config quant_method is {method!r}: flaxlm dequantizes "
            f"{list(compressed.READ_METHODS)} files on import; load an unquantized copy."
        )
    if compressed.is_compressed(hf_config):
        compressed.schemes(hf_config)  # what flaxlm cannot read, named before any tensor
    try:
        config = spec.config_from_hf(dict(hf_config))
    except KeyError as e:  # a field the family reads with [] (another KeyError is a bug)
        if not e.args or e.args[0] in hf_config:
            raise
        raise ValueError(f"config.json has no {e.args[0]!r}, which the model needs.") from e
    real = config.vocab_size
    options: dict[str, Any] = {}
    if dtype is not None:
        names = {f.name for f in dataclasses.fields(config)}
        options = {k: jnp.dtype(dtype).name for k in ("dtype", "param_dtype") if k in names}
    options.update(vocab_size=padded_vocab_size(real, vocab_multiple), real_vocab_size=real)
    options.update(overrides or {})
    return spec, dataclasses.replace(config, **options)


# ------------------------------------------------------------------------ tensors


def _check_tensors(
    spec: HFSpec,
    expanded: Mapping[str, tuple[HFTensor, list[str]]],
    shapes: Mapping[str, tuple[int, ...]],
    reader: SafetensorsReader,
    real_vocab: int,
    path: Any,
) -> None:
    """Every mapped tensor present with the shape the config implies; nothing left over."""
    used = set()
    # A fused HF tensor holds the rows of all its parts.
    fused_rows: dict[str, int] = {}
    for t, _, _ in expanded.values():
        if t.rows is not None:
            fused_rows[t.hf] = max(fused_rows.get(t.hf, 0), t.rows[1])
    for param, (t, names, stacked) in expanded.items():
        if param not in shapes:
            raise ValueError(f"{type(spec).__name__} maps {param!r}, which the model lacks.")
        layer_shape = list(shapes[param][1:] if stacked else shapes[param])
        if t.vocab_axis is not None:
            layer_shape[t.vocab_axis] = real_vocab
        want = t.hf_shape(tuple(layer_shape))
        if t.rows is not None:
            if want[0] != t.rows[1] - t.rows[0]:
                raise ValueError(f"{param}: rows {t.rows} do not fit its shape {want}.")
            want = (fused_rows[t.hf], *want[1:])
        for name in names:
            if name not in reader.file_of:
                raise ValueError(
                    f"{path}: tensor {name!r} is missing; the checkpoint does not match its "
                    "config.json."
                )
            got = reader.shape(name)
            if not t.stored_as(got, want):
                raise ValueError(
                    f"{path}: tensor {name!r} has shape {got}, but config.json implies {want}."
                )
            used.add(name)
        used.update(t.copies)
    missing = sorted(set(shapes) - set(expanded))
    if missing:
        raise ValueError(f"The HF mapping of {spec.model_types[0]} does not cover {missing}.")
    ignore = [re.compile(p) for p in spec.ignore]
    extra = sorted(
        n for n in reader.file_of if n not in used and not any(p.search(n) for p in ignore)
    )
    if extra:
        raise ValueError(
            f"{path}: tensors {extra[:5]}{' ...' if len(extra) > 5 else ''} have no place in a "
            f"{spec.model_types[0]} model with this config.json (more layers than num_layers?)."
        )


def load_params(
    model: BaseModel,
    path: str | epath.Path,
    partitioner: Partitioner | None = None,
    shardings: Any = None,
) -> Params:
    """The params of `model` read from an HF checkpoint, each placed on its sharding.

    `shardings` (a tree like the params) wins over `partitioner`; with neither, the params
    go to the first local device. The model's vocabulary may be larger than the checkpoint's
    (padding rows are zeros).
    """
    spec = spec_for_config(model.config)
    reader = SafetensorsReader(path, spec.base_model_prefix, spec.own_names)
    if getattr(model.config, "tie_word_embeddings", False) and head_differs(spec, reader):
        raise tied_head_error(spec, path)
    return _place_params(model, spec, reader, path, partitioner, shardings)


def _place_params(
    model: BaseModel,
    spec: HFSpec,
    reader: SafetensorsReader,
    path: Any,
    partitioner: Partitioner | None,
    shardings: Any,
) -> Params:
    """`load_params` once the checkpoint is open and its head checked against the model."""
    abstract = pytrees.abstract_params(model, partitioner)
    if shardings is not None:
        abstract = pytrees.with_shardings(abstract, shardings)
    flat_abstract = traverse_util.flatten_dict(abstract, sep="/")
    shapes = {k: tuple(v.shape) for k, v in flat_abstract.items()}
    tensors = spec.tensors(model.config)
    expanded = hf_spec.expand(tensors, stacks.scan_layout(model.config))
    # FP8 weights (DeepSeek-V3's, Kimi K2's), compressed-tensors' (llm-compressor's, Kimi K2
    # Thinking's INT4 experts) and MXFP4 pairs (gpt-oss's experts) read dequantized; experts
    # stored in pieces read whole.
    reader = compressed.dequantized(reader, path)
    reader = mxfp4.DequantizedReader(fp8.dequantized(reader, path))
    reader = hf_slices.PiecedReader(reader, hf_spec.pieces_of(tensors))
    real_vocab = model.config.real_vocab_size or model.config.vocab_size
    _check_tensors(spec, expanded, shapes, reader, real_vocab, path)

    flat_params = {}
    for param, (t, names, stacked) in expanded.items():
        aval = flat_abstract[param]
        callback = hf_slices.shard_reader(reader, t, names, aval, stacked, real_vocab)
        flat_params[param] = jax.make_array_from_callback(aval.shape, aval.sharding, callback)
    return traverse_util.unflatten_dict(flat_params, sep="/")


def head_differs(spec: HFSpec, reader: SafetensorsReader) -> bool:
    """Whether the checkpoint stores an LM head that is not a copy of its embedding."""
    if spec.tied_head is None:
        return False
    head, embedding = spec.tied_head
    if head not in reader.file_of or embedding not in reader.file_of:
        return False
    return not np.array_equal(reader.read(head), reader.read(embedding))


def tied_head_error(spec: HFSpec, path: Any) -> ValueError:
    return ValueError(
        f"{path}: the checkpoint's LM head {spec.tied_head[0]!r} differs from its token "
        "embedding, but the model ties them: set tie_word_embeddings=False in its config."
    )


def model_from_hf_dir(
    path: str | epath.Path,
    partitioner: Partitioner | None = None,
    dtype: Any = jnp.float32,
    config_overrides: Mapping[str, Any] | None = None,
) -> BaseModel:
    """The model a local HF directory describes, without its params: the family from
    config.json's `model_type` (an unknown one is an error listing the known), its settings,
    the vocabulary padded for `partitioner`, the special ids and generation_config.json.

    `dtype` sets both the compute and the param dtype; `config_overrides` set config fields
    after it (e.g. `scan_layers=True`, `dtype='bfloat16'` to compute in bf16 on f32 params).
    """
    config_overrides = dict(config_overrides or {})
    hf_config = hf_spec.text_tower(read_hf_config(path))
    multiple = vocab_multiple_for(partitioner)
    spec, config = config_from_hf_dict(hf_config, multiple, dtype, config_overrides)
    reader = SafetensorsReader(path, spec.base_model_prefix, spec.own_names, quiet=True)
    if getattr(config, "tie_word_embeddings", False) and head_differs(spec, reader):
        if "tie_word_embeddings" in config_overrides:  # the caller's tying: as load_params
            raise tied_head_error(spec, path)
        config = dataclasses.replace(config, tie_word_embeddings=False)
    generation = read_generation_config(path)
    return spec.model_cls(
        config,
        eos_id=hf_eos_id(hf_config, generation),
        special_ids=special_ids(hf_config),
        generation_config=generation,
    )


def from_pretrained(
    path: str | epath.Path,
    partitioner: Partitioner | None = None,
    dtype: Any = jnp.float32,
    **config_overrides: Any,
) -> tuple[BaseModel, Params]:
    """`(model, params)` from a local HF directory (config.json + *.safetensors).

    The model is `model_from_hf_dir`'s (same arguments); it keeps the special token ids and
    generation_config.json, for `save_pretrained`.
    """
    model = model_from_hf_dir(path, partitioner, dtype, config_overrides)
    spec = spec_for_config(model.config)
    reader = SafetensorsReader(path, spec.base_model_prefix, spec.own_names)
    return model, _place_params(model, spec, reader, path, partitioner, None)


def special_ids(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's special token ids (`bos_token_id`, `eos_token_id`, ...), nulls kept."""
    return {k: v for k, v in hf_config.items() if k.endswith("_token_id")}


def module_names(path: str | epath.Path | None) -> Callable[[str], str]:
    """Text-model module name -> its name in the model HF directory `path` holds: the outer
    model's for a multimodal file (`hf_spec.Multimodal.module_name`, what PEFT names an
    adapter's modules over it), else itself (also where `path` is no local directory)."""
    if not path or not (epath.Path(path) / "config.json").exists():
        return lambda name: name
    outer = hf_spec.MULTIMODAL.get(read_hf_config(path).get("model_type", ""))
    return outer.module_name if outer else lambda name: name


def hf_eos_id(
    hf_config: Mapping[str, Any], generation: Mapping[str, Any] | None = None
) -> int | list[int] | None:
    """The EOS id(s) generation stops at: generation_config.json's, else config.json's."""
    if generation and generation.get("eos_token_id") is not None:
        return generation["eos_token_id"]
    return hf_config.get("eos_token_id")


# ------------------------------------------------------------------------ writing


def hf_state_dict(model: BaseModel, params: Params) -> Iterator[tuple[str, np.ndarray]]:
    """`(HF name, numpy tensor)` for every param, vocabulary padding removed."""
    spec = spec_for_config(model.config)
    flat = traverse_util.flatten_dict(params, sep="/")
    real_vocab = model.config.real_vocab_size or model.config.vocab_size
    tensors = spec.tensors(model.config)
    records = hf_spec.expand(tensors, stacks.scan_layout(model.config))
    pieces = hf_spec.pieces_of(tensors)
    # A fused tensor is written once all its parts are in, rows in order.
    parts_left = collections.Counter(n for t, names, _ in records.values() if t.rows for n in names)
    parts: dict[str, list[tuple[int, np.ndarray]]] = collections.defaultdict(list)
    for param, (t, names, stacked) in records.items():
        array = pytrees.host_array(flat[param])
        layers = list(array) if stacked else [array]
        for name, layer in zip(names, layers, strict=True):
            if t.vocab_axis is not None:
                layer = np.take(layer, np.arange(real_vocab), axis=t.vocab_axis)
            tensor = np.ascontiguousarray(t.to_hf_layout(layer))
            if t.rows is not None:
                parts[name].append((t.rows[0], tensor))
                parts_left[name] -= 1
                if parts_left[name]:
                    continue
                tensor = np.concatenate([p for _, p in sorted(parts.pop(name), key=_first)])
            if name in pieces:  # written as transformers' save_pretrained writes it
                for names, block in zip(pieces[name], tensor, strict=True):
                    for piece, part in zip(names, np.split(block, len(names)), strict=True):
                        yield piece, np.ascontiguousarray(part)
                continue
            yield name, tensor
            for other in t.copies:
                yield other, tensor
    if spec.buffers is not None:
        yield from spec.buffers(model.config).items()


def _first(pair: tuple[int, Any]) -> int:
    return pair[0]


def model_special_ids(model: BaseModel) -> dict[str, Any]:
    """The special ids an export writes: the imported checkpoint's, else the model's EOS."""
    ids = dict(model.special_ids)
    if "eos_token_id" not in ids and model.eos_ids:
        eos = list(model.eos_ids)
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return ids


def hf_config_dict(model: BaseModel, dtype: Any = None) -> dict[str, Any]:
    spec = spec_for_config(model.config)
    out = spec.config_to_hf(model.config)
    out.update(model_special_ids(model))
    out["vocab_size"] = model.config.real_vocab_size or model.config.vocab_size
    out["torch_dtype"] = jnp.dtype(dtype or jnp.float32).name
    return out


def generation_config_dict(model: BaseModel) -> dict[str, Any] | None:
    """generation_config.json of an export: the imported one as it was, else the special
    ids' (none for an encoder-only model, which does not generate)."""
    if model.generation_config is not None:
        return dict(model.generation_config)
    if isinstance(model, EncoderOnlyModel):
        return None
    config = hf_config_dict(model)
    ids = {k: config[k] for k in _GENERATION_IDS if config.get(k) is not None}
    return {**ids, "_from_model_config": True}


def save_pretrained(
    model: BaseModel,
    params: Params,
    out_dir: str | epath.Path,
    *,
    max_shard_size: int = 5 * 2**30,
    dtype: Any = None,
    tokenizer_dir: str | epath.Path | None = None,
) -> None:
    """Writes `config.json` (special token ids included), `generation_config.json` and
    safetensors (sharded with an index past `max_shard_size`).

    `dtype` casts every tensor (default: as stored). `tokenizer_dir`: an HF directory whose
    tokenizer files (and chat template) are copied beside the weights. All processes must
    call this (params spread over hosts are gathered); process 0 writes.
    """
    from safetensors.numpy import save_file

    out = epath.Path(out_dir)
    write = jax.process_index() == 0
    if write:
        out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    for name, tensor in hf_state_dict(model, params):
        if dtype is not None and not np.issubdtype(tensor.dtype, np.integer):  # ids stay ints
            tensor = tensor.astype(jnp.dtype(dtype))
        if sizes[-1] and sizes[-1] + tensor.nbytes > max_shard_size:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor
        sizes[-1] += tensor.nbytes
    if not write:
        return
    metadata = {"format": "pt"}

    def write_shard(tensors: dict[str, np.ndarray], name: str) -> None:
        save_file(tensors, str(out / name), metadata=metadata)
        # safetensors creates its files 0600; exports are shared like any file (the umask's).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(str(out / name), 0o666 & ~umask)

    if len(shards) == 1:
        write_shard(shards[0], SINGLE_FILE)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_shard(shard, fname)
            weight_map.update({name: fname for name in shard})
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    config = hf_config_dict(model, dtype or next(iter(shards[0].values())).dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = generation_config_dict(model)
    if generation is not None:
        # As transformers writes it (GenerationConfig.to_json_string).
        (out / GENERATION_FILE).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
