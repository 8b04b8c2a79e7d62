"""The records a family fills in to map its params to HuggingFace tensor names.

Each family file describes how its params correspond to a HuggingFace checkpoint's tensors
with these plain records and registers them (`register_hf`); `flaxlm/hf.py` does the
reading, placing and writing.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from flaxlm.models import stacks
from flaxlm.models.base import BaseModel


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One param <-> one HF tensor.

    `param` is the param's path joined by '/', `hf` the HF tensor name; a `{i}` in both is
    repeated for i in range(layers), or for the layers in `only` (those of one kind: a
    hybrid's linear ones, DeepSeek-V3's MoE ones after its dense ones); hf.py stacks them when
    the model scans its layers.
    The HF tensor is the param reshaped to 2-D after its first `split` axes (to 1-D when
    `split` is None), transposed when `transpose` (torch `Linear` stores [out, in]).
    `vocab_axis` is the param axis that hf.py pads to the model's `vocab_size`.
    `to_flax` / `to_hf` (numpy -> numpy) replace the reshape rule where it is not enough.
    """

    param: str
    hf: str
    split: int | None = None
    transpose: bool = False
    layers: int = 0
    only: tuple[int, ...] | None = None  # the layers of a `{i}` record, where not all
    vocab_axis: int | None = None
    to_flax: Callable[[np.ndarray, tuple[int, ...]], np.ndarray] | None = None
    to_hf: Callable[[np.ndarray], np.ndarray] | None = None
    # Other HF names that hold the same values (a tensor outside the layers): written on
    # export (HF reports them missing otherwise), accepted and not read on import.
    copies: tuple[str, ...] = ()
    # The param is rows [start, stop) (HF layout, axis 0) of a fused HF tensor that other
    # records fill too (Phi-3's qkv_proj, gate_up_proj): split on import, joined on export.
    rows: tuple[int, int] | None = None
    # The HF tensor `[experts, rows, ...]` as checkpoints on the Hub store it (and
    # transformers' save_pretrained writes it): `experts` x len(pieces) tensors, named by
    # `pieces` with `{i}` (layer) and `{e}` (expert); expert e's pieces joined on their axis 0
    # are its row block. Read in either spelling, written as pieces.
    pieces: tuple[str, ...] = ()
    experts: int = 0
    # Two axes a file may store swapped (Qwen3-VL-MoE's Hub files, their fused experts
    # `[experts, embed, 2 * mlp]`): read as transformers' `Transpose(check_dims=True)` reads
    # them, as they are where the shape is the expected one, else swapped back; written
    # unswapped (as its save_pretrained writes them).
    also_swapped: tuple[int, int] | None = None

    def __post_init__(self):
        if self.copies and self.layers:
            raise ValueError(f"{self.param}: copies of a per-layer tensor are not supported.")
        if self.rows is not None and (self.copies or self.vocab_axis is not None):
            raise ValueError(f"{self.param}: a fused tensor's rows have no copies or vocab.")
        if self.pieces and (self.rows is not None or self.copies or not self.experts):
            raise ValueError(f"{self.param}: pieces need `experts`, and no rows or copies.")

    def layer_numbers(self) -> Sequence[int]:
        """The layers a `{i}` record covers, in order (none for a tensor outside them)."""
        return self.only if self.only is not None else range(self.layers)

    def to_hf_layout(self, array: np.ndarray) -> np.ndarray:
        """A param (one layer, vocabulary unpadded) in HF's layout."""
        if self.to_hf is not None:
            return self.to_hf(array)
        shape = array.shape
        if self.split is None:
            out = array.reshape(-1)
        else:
            out = array.reshape(math.prod(shape[: self.split]), math.prod(shape[self.split :]))
        return out.T if self.transpose else out

    def to_flax_layout(self, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """An HF tensor in the param's layout (one layer, vocabulary unpadded)."""
        if self.also_swapped is not None and array.shape != self.hf_shape(shape):
            array = np.swapaxes(array, *self.also_swapped)
        if self.to_flax is not None:
            return self.to_flax(array, shape)
        return (array.T if self.transpose else array).reshape(shape)

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF tensor's shape for a param (one layer) of `shape`."""
        return self.to_hf_layout(np.broadcast_to(np.zeros((), np.float32), shape)).shape

    def stored_as(self, stored: tuple[int, ...], want: tuple[int, ...]) -> bool:
        """Whether a stored tensor of shape `stored` holds a param whose HF shape is `want`
        (or, with `also_swapped`, `want` with those axes swapped)."""
        if stored == want or self.also_swapped is None:
            return stored == want
        swapped = list(want)
        a, b = self.also_swapped
        swapped[a], swapped[b] = want[b], want[a]
        return stored == tuple(swapped)


class Expanded(NamedTuple):
    """One param's record and HF names: one a layer, in order, for a stacked param."""

    tensor: HFTensor
    names: list[str]
    stacked: bool  # the param has the layers on its axis 0 (a scanned stack's)


def expand(
    tensors: Sequence[HFTensor], scanned: tuple[int, int, int] | None
) -> dict[str, Expanded]:
    """Param path -> its record and HF names. `scanned`: None for unrolled layers, else
    (first, period, tail) of the model's scanned stack (`stacks.scan_layout`): a `{i}` record's
    layers before `first` and its last `tail` unrolled, those between stacked, one param a
    block of the scan's cycle of `period` layers (`name/block/rest`, or `name/block_j/rest`
    for the layers first + j, first + j + period, ...)."""
    out: dict[str, Expanded] = {}
    for t in tensors:
        if t.layers == 0 and t.only is None:
            out[t.param] = Expanded(t, [t.hf], False)
            continue
        first, period, tail = (t.layers, 1, 0) if scanned is None else scanned
        stop = t.layers - tail
        for i in (i for i in t.layer_numbers() if not first <= i < stop):
            out[t.param.format(i=i)] = Expanded(t, [t.hf.format(i=i)], False)
        cycles = (stop - first) // period
        slots: dict[int, list[int]] = {}
        for i in (i for i in t.layer_numbers() if first <= i < stop):
            slots.setdefault((i - first) % period, []).append(i)
        for j, numbers in slots.items():
            if numbers != list(range(first + j, stop, period)) or len(numbers) != cycles:
                raise ValueError(
                    f"{t.param}: layers {numbers} are not every layer of block {j} of a scan "
                    f"of {period}-layer cycles from layer {first} (its records cover it all)."
                )
            # `name_{i}/rest` unrolled is `name/block/rest` (`name/block_j/rest`) scanned.
            param = re.sub(r"_\{i\}", f"/{stacks.slot_name(j, period)}", t.param, count=1)
            out[param] = Expanded(t, [t.hf.format(i=i) for i in numbers], True)
    return out


def per_kind(kinds: Sequence[Any], records: Callable[[Any], list[HFTensor]]) -> list[HFTensor]:
    """`records(kind)` (`{i}` records) for each kind among the layers' `kinds`, each record
    naming the layers of its kind (`only`): a table whose layers differ, which a scan of
    their cycle reads."""
    out: list[HFTensor] = []
    for kind in sorted(set(kinds)):
        only = tuple(i for i, k in enumerate(kinds) if k == kind)
        out += [dataclasses.replace(t, only=only) for t in records(kind)]
    return out


def pieces_of(tensors: Sequence[HFTensor]) -> dict[str, list[list[str]]]:
    """HF name (layer formatted) -> the names of its pieces, a list per expert, for every
    record stored in pieces (`HFTensor.pieces`); scanned or not, the names are the same."""
    out: dict[str, list[list[str]]] = {}
    for t in tensors:
        for i in (t.layer_numbers() if t.layers or t.only else [0]) if t.pieces else ():
            experts = range(t.experts)
            out[t.hf.format(i=i)] = [[p.format(i=i, e=e) for p in t.pieces] for e in experts]
    return out


def linear(param: str, hf: str, split: int = 1, **kw: Any) -> HFTensor:
    """A torch `nn.Linear` weight ([out, in]) for a kernel whose first `split` axes are in."""
    return HFTensor(param, hf, split=split, transpose=True, **kw)


@dataclasses.dataclass(frozen=True)
class HFSpec:
    """How one family reads and writes HuggingFace checkpoints.

    config_from_hf: HF config.json dict (+ keyword overrides) -> the family's config, with
      the real vocabulary size (hf.py pads it).
    config_to_hf: the family's config -> HF config.json dict (with `model_type` and
      `architectures`), for the real vocabulary size.
    tensors: config -> the HFTensor records covering every param exactly once.
    ignore: regular expressions of HF tensor names that have no param (buffers, tied copies).
    """

    model_types: tuple[str, ...]
    config_cls: type
    model_cls: Callable[[Any], BaseModel]
    config_from_hf: Callable[..., Any]
    config_to_hf: Callable[[Any], dict[str, Any]]
    tensors: Callable[[Any], list[HFTensor]]
    ignore: tuple[str, ...] = ()
    auto_class: str = "AutoModelForCausalLM"  # the transformers class that loads an export
    # HF's `base_model_prefix` ('transformer', 'model'): files saved from the bare base
    # model name their tensors without it, and hf.py reads those too.
    base_model_prefix: str = ""
    # (LM head, token embedding) HF names of a family whose config says
    # `tie_word_embeddings`. Like transformers, a file whose head differs from the embedding
    # is loaded untied whatever the config says (T5 as transformers 5 saves it).
    tied_head: tuple[str, str] | None = None
    # Checkpoints of a larger model that holds this one (Gemma 3's multimodal files keep the
    # text tower under `model.language_model.`, a vision tower beside it): (pattern,
    # replacement) regular expressions renaming a stored tensor to our HF name (the first
    # that matches applies), and patterns of stored tensors skipped (with one note on load).
    renames: tuple[tuple[str, str], ...] = ()
    skip: tuple[str, ...] = ()
    # config -> the fields above whose value depends on the config (DeepSeek-V3's `skip` and
    # `ignore`: its MTP layer is skipped unless the config holds it); `for_config` applies it.
    config_fields: Callable[[Any], dict[str, Any]] | None = None
    # The multimodal files whose text tower this family reads (`text_tower`), as `Multimodal`
    # records; their tensors' names come through `renames` and `skip` above.
    multimodal: tuple[Multimodal, ...] = ()
    # config -> HF's persistent buffers derived from it (name -> array: Qwen4-Exp's PLE hash
    # constants), written on export; `ignore` passes over them on import.
    buffers: Callable[[Any], dict[str, np.ndarray]] | None = None

    def for_config(self, config: Any) -> HFSpec:
        """This spec for a model of `config` (`config_fields` applied)."""
        if self.config_fields is None:
            return self
        return dataclasses.replace(self, **self.config_fields(config))

    def own_names(self, stored: Iterable[str]) -> tuple[dict[str, str], list[str]]:
        """Our HF name -> the stored name of each tensor of a checkpoint (after `renames`),
        and the stored names that `skip` leaves out."""
        names: dict[str, str] = {}
        skipped: list[str] = []
        for name in stored:
            if any(re.search(p, name) for p in self.skip):
                skipped.append(name)
                continue
            ours = next(
                (re.sub(p, r, name, count=1) for p, r in self.renames if re.search(p, name)), name
            )
            names[ours] = name
        return names, skipped


class Multimodal(NamedTuple):
    """A multimodal config.json whose text tower is a family's (Llama 4's `llama4`, whose
    `text_config` is a `llama4_text`): the text tower loads as that family's model, and
    exports as it (the other towers are skipped with a note)."""

    model_type: str  # the file's model_type
    text_type: str  # its text_config's model_type where that names none (transformers')
    # The file's `tie_word_embeddings` default where its LM head is its own (transformers
    # ties it by the outer config's setting); None where the head is the text tower's
    # (its text_config's setting decides).
    tied: bool | None
    # What the outer model, as transformers holds it, names the text tower's `model.`: the
    # prefix of its modules in a PEFT adapter over the file.
    text_modules: str = "model.language_model."
    # A config.json without a text_config holds the text fields at its top level (the Hub's
    # Qwen2-VL and Qwen2.5-VL files, as transformers reads them).
    flat: bool = False
    # Tied where the text config says so though the outer one does not (transformers'
    # Qwen2-VL / Qwen2.5-VL reading of pre-v5 saves, which kept the setting there).
    text_ties: bool = False
    # text_config settings the outer model does not apply, read as None (Gemma 3's
    # `final_logit_softcapping`: Gemma3ForConditionalGeneration does not cap its logits).
    unapplied: tuple[str, ...] = ()

    def module_name(self, name: str) -> str:
        """The outer model's name of text-model module `name` (`model.layers.0...`)."""
        return self.text_modules + name.removeprefix("model.")


# The text tower of a transformers vision-language model saved by its own modules (Qwen3-VL's,
# GLM-4.1V's, Gemma 4's, Qwen3.5's): under `model.language_model.` where the text model has
# `model.`.
LANGUAGE_MODEL_RENAMES = ((r"^model\.language_model\.", "model."),)
# The text tower of a file in transformers' llava layout (LLaVA's, Gemma 3's, Mistral 3's,
# InternVL's: the conversion mapping's 'llava' and 'llava_next'), as `renames` and `skip`:
# under `language_model.` as the Hub's files and `save_pretrained` name it (its LM head
# `language_model.lm_head.`), or `model.language_model.` as the modules do; the vision tower,
# projector and LLaVA-NeXT's `image_newline` skipped.
LLAVA_RENAMES = ((r"^language_model\.", ""), *LANGUAGE_MODEL_RENAMES)
LLAVA_SKIP = (r"^(model\.)?(vision_tower\.|multi_modal_projector\.|image_newline$)",)

HF_SPECS: dict[str, HFSpec] = {}
MULTIMODAL: dict[str, Multimodal] = {}
# What a multimodal file's outer config.json says for its text tower, where the text_config
# itself says nothing: how its weights are quantized and its special token ids.
_OUTER_FIELDS = ("quantization_config", "bos_token_id", "eos_token_id", "pad_token_id")


def register_hf(spec: HFSpec) -> HFSpec:
    """Makes `spec` the reader and writer of its model types (in `HF_SPECS`) and of the text
    towers of its multimodal files (`MULTIMODAL`); returns it."""
    for model_type in spec.model_types:
        HF_SPECS[model_type] = spec
    for outer in spec.multimodal:
        MULTIMODAL[outer.model_type] = outer
    return spec


def text_tower(hf: dict[str, Any]) -> dict[str, Any]:
    """The config.json dict of a multimodal file's text tower (`MULTIMODAL`): its
    `text_config` with its model_type, the outer config's `tie_word_embeddings` where the
    outer model holds the LM head (as transformers ties it), and the outer quantization
    config and special token ids where the text config has none. Any other dict: itself."""
    outer = MULTIMODAL.get(hf.get("model_type", ""))
    if outer is None:
        return hf
    text = dict(hf.get("text_config") or {})
    if not text and outer.flat:
        outer_only = ("model_type", "architectures", "text_config", "vision_config")
        text = {k: v for k, v in hf.items() if k not in outer_only}
    text.setdefault("model_type", outer.text_type)
    if text["model_type"] not in HF_SPECS:
        raise ValueError(
            f"config.json is a {outer.model_type!r} file whose text_config has model_type "
            f"{text['model_type']!r}, a text model flaxlm does not know; known: "
            f"{sorted(HF_SPECS)}."
        )
    for name in _OUTER_FIELDS:
        if text.get(name) is None and hf.get(name) is not None:
            text[name] = hf[name]
    text.update(dict.fromkeys(outer.unapplied))
    if outer.tied is not None:
        tied = hf.get("tie_word_embeddings", outer.tied)
        text_tied = outer.text_ties and bool(text.get("tie_word_embeddings"))
        text["tie_word_embeddings"] = bool(tied) or text_tied
    return text
