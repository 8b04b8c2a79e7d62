"""The MODEL_DIR contract: what a run directory holds and how a model comes back out of it.

    MODEL_DIR/
      checkpoints/<step>/   orbax checkpoints (train state, data iterators, config)
      config.gin            the operative Gin config of the last run
      model_record.json     the model: its family's HF config fields plus flaxlm's own config
                            (`flaxlm_config`), EOS ids and generation config; written by every
                            training run and import (older directories: `hf_config.json`)
      lora.json             a LoRA run: the adapter config and where the frozen base lives
      base/checkpoints/0/   a LoRA run's random base params (when it starts from no checkpoint)
      tokenizer/            the tokenizer of the HF checkpoint the run started from
      metrics.jsonl, tensorboard/

`load_model_and_params` is the one way in for every run that reads a checkpoint: a flaxlm
MODEL_DIR (its latest or a given step; a LoRA run's adapters merged into its base), a
HuggingFace directory or a PEFT adapter directory over one (`peft_dir.py`), placed on a
Partitioner's shardings.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
from etils import epath

from flaxlm.checkpoints import checkpointer, hf, hf_files, peft_config, peft_dir
from flaxlm.data import vocabularies
from flaxlm.models import hf_spec
from flaxlm.models.base import BaseModel, DecoderOnlyModel
from flaxlm.models.options import eos_tuple
from flaxlm.models.row_start import HF_START, SEQIO_START, RowStart
from flaxlm.parallel import pytrees
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import lora, steps

Params = Any
MODEL_RECORD = "model_record.json"
LEGACY_MODEL_RECORD = "hf_config.json"  # the model record's name before it said what it is
LORA_RECORD = "lora.json"
LORA_BASE_DIR = "base"  # a LoRA run's random base params, saved once
TOKENIZER_DIR = "tokenizer"
CONFIG_FILE = "config.gin"
RECORD_ROW_START = "flaxlm_decoder_start_id"  # null: the HF form (`row_start.RowStart`)


def is_hf_dir(path: str | epath.Path) -> bool:
    """An HF checkpoint directory (config.json, no flaxlm checkpoints)."""
    path = epath.Path(path)
    return (path / "config.json").exists() and not (path / checkpointer.SUBDIR).exists()


# ---------------------------------------------------------------- the model record


def model_record_file(model_dir: str | epath.Path) -> epath.Path | None:
    """The model record of `model_dir` (either name), or None."""
    for name in (MODEL_RECORD, LEGACY_MODEL_RECORD):
        file = epath.Path(model_dir) / name
        if file.exists():
            return file
    return None


def write_model_record(
    model: BaseModel,
    model_dir: str | epath.Path,
    row_start: RowStart,
    hf_dir: str | epath.Path | None = None,
) -> None:
    """Writes `model_dir/model_record.json`, from which every later run rebuilds the model.

    Beside HF's config fields it keeps flaxlm's own config (`flaxlm_config`: padded
    vocabulary, scan_layers, dtypes), so the rebuilt model has exactly the checkpoint's
    params, and the run's row start (`flaxlm_decoder_start_id`), so every later run reads and
    samples as it trained. `hf_dir`, the HF directory the params came from, gives the special
    ids, EOS and generation config (a Gin-bound model knows none of them), and its tokenizer
    files are copied to `model_dir/tokenizer/`.
    """
    if hf_dir is not None:
        hf_config, generation = (
            hf_spec.text_tower(hf_files.read_hf_config(hf_dir)),
            hf_files.read_generation_config(hf_dir),
        )
        model = copy.copy(model)
        model.special_ids = hf.special_ids(hf_config)
        model.generation_config = generation
        model.eos_ids = eos_tuple(hf.hf_eos_id(hf_config, generation))
        hf_files.copy_tokenizer(hf_dir, epath.Path(model_dir) / TOKENIZER_DIR)
    if jax.process_index() == 0:
        out = epath.Path(model_dir)
        out.mkdir(parents=True, exist_ok=True)
        spec = hf.spec_for_config(model.config)
        try:
            record = hf.hf_config_dict(model)
        except ValueError:  # a variant HF cannot express (e.g. ALiBi GPT-2): flaxlm's own only
            record = {"model_type": spec.model_types[0], **hf.model_special_ids(model)}
        record["flaxlm_config"] = dataclasses.asdict(model.config)
        record["flaxlm_eos_ids"] = list(model.eos_ids)
        record["flaxlm_generation_config"] = model.generation_config
        record[RECORD_ROW_START] = row_start.decoder_start_id
        tmp = out / (MODEL_RECORD + ".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(out / MODEL_RECORD)  # a resumed run writes it again


def record_if_known(model: BaseModel, model_dir: str | epath.Path, row_start: RowStart) -> None:
    """Writes the model record of a training run (once), for families HF knows."""
    if model_record_file(model_dir) is not None:
        return
    try:
        hf.spec_for_config(model.config)
    except ValueError:  # a model defined outside flaxlm's families: the Gin binding it is
        return
    write_model_record(model, model_dir, row_start)


def model_from_record(
    file: str | epath.Path, partitioner: Partitioner | None = None, **overrides: Any
) -> BaseModel:
    """The model of a model record, or of an HF config.json (vocabulary padded for
    `partitioner`)."""
    file = epath.Path(file)
    record = json.loads(file.read_text())
    if "flaxlm_config" in record:
        spec = hf.spec_for_model_type(record.get("model_type", "<missing>"))
        config = dataclasses.replace(spec.config_cls(**record["flaxlm_config"]), **overrides)
        generation = record.get("flaxlm_generation_config")
    else:  # an HF directory's config.json (a multimodal file's: its text tower's)
        record = hf_spec.text_tower(record)
        multiple = hf.vocab_multiple_for(partitioner)
        spec, config = hf.config_from_hf_dict(record, multiple, overrides=overrides)
        generation = hf_files.read_generation_config(file.parent)
    eos = record.get("flaxlm_eos_ids", None)
    if "flaxlm_eos_ids" not in record:
        eos = hf.hf_eos_id(record, generation)
    return spec.model_cls(
        config, eos_id=eos, special_ids=hf.special_ids(record), generation_config=generation
    )


# ---------------------------------------------------------------- the row start


def recorded_row_start(model_dir: str | epath.Path) -> RowStart | None:
    """The row start a MODEL_DIR's model record keeps; None where it has no record. A record
    from before the field was kept is seqio's start (its run read token 0); a legacy record
    holding an HF config.json only is the HF form."""
    file = model_record_file(model_dir)
    if file is None:
        return None
    record = json.loads(file.read_text())
    if "flaxlm_config" not in record:
        return HF_START
    start = record.get(RECORD_ROW_START, 0)
    if start is not None and not isinstance(start, int):
        raise ValueError(
            f"{file}: {RECORD_ROW_START}={start!r}; expected an integer token id or null."
        )
    return RowStart(start)


def hf_row_start(model: BaseModel) -> RowStart:
    """How a model from an HF checkpoint reads its rows: a decoder-only model as HF and TRL
    feed it (the HF form); an encoder-decoder's decoder starts with seqio's token 0, which
    is T5's `decoder_start_token_id` too."""
    return HF_START if isinstance(model, DecoderOnlyModel) else SEQIO_START


def checkpoint_row_start(checkpoint: str | epath.Path, model: BaseModel) -> RowStart:
    """The row start of `model`, as the checkpoint it came from holds it: an HF or PEFT
    directory's is `hf_row_start`'s; a MODEL_DIR's is its record's (seqio's start where it
    records none)."""
    path = epath.Path(checkpoint)
    if peft_config.is_peft_dir(path) or is_hf_dir(path):
        return hf_row_start(model)
    return recorded_row_start(path) or SEQIO_START


def run_row_start(model: BaseModel, model_dir: str | epath.Path, init_from: str | None) -> RowStart:
    """The row start of a training or GRPO run, decided once: a MODEL_DIR that has trained
    keeps its record's (a run resumes as it trained); else the checkpoint it starts from
    says (`checkpoint_row_start`: a fine-tune of an HF checkpoint reads its rows as HF and
    TRL feed them); else (a model trained from scratch) seqio's start."""
    recorded = recorded_row_start(model_dir)
    if recorded is not None:
        return recorded
    return checkpoint_row_start(init_from, model) if init_from else SEQIO_START


def read_model(model_dir: str | epath.Path, partitioner: Partitioner | None = None) -> BaseModel:
    """The model recorded in a MODEL_DIR."""
    file = model_record_file(model_dir)
    if file is None:
        raise ValueError(
            f"{epath.Path(model_dir) / MODEL_RECORD} not found: bind the model (include its "
            "gin/models/ file) to read a checkpoint whose run did not record it."
        )
    return model_from_record(file, partitioner)


# ---------------------------------------------------------------- the LoRA record


def write_lora_record(
    model_dir: str | epath.Path, cfg: lora.LoraConfig, base: Mapping[str, Any]
) -> None:
    """`MODEL_DIR/lora.json`: the config and the base params' source (`{"hf": dir}` or
    `{"checkpoint": model_dir, "step": n}`), so that infer/eval/export can merge."""
    if jax.process_index() == 0:
        record = {"config": cfg.to_json(), "base": dict(base)}
        (epath.Path(model_dir) / LORA_RECORD).write_text(json.dumps(record, indent=2))


def read_lora_record(
    model_dir: str | epath.Path,
) -> tuple[lora.LoraConfig, dict[str, Any]] | None:
    """`(cfg, base source)` of a LoRA run's MODEL_DIR; None for any other directory."""
    file = epath.Path(model_dir) / LORA_RECORD
    if not file.exists():
        return None
    record = json.loads(file.read_text())
    return lora.LoraConfig.from_json(record["config"]), record["base"]


# ---------------------------------------------------------------- params


def restore_params(
    model_dir: str | epath.Path, abstract: Any, step: int | None = None
) -> tuple[Params, int]:
    """`(params, step)`: the params of `model_dir`'s checkpoint at `step` (the latest if
    None), placed on the shardings `abstract` carries (see `pytrees.abstract_params`)."""
    ckpt = checkpointer.Checkpointer(str(model_dir))
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise ValueError(
                f"No checkpoint in {ckpt.directory}: expected a flaxlm MODEL_DIR with "
                "checkpoints or a HuggingFace directory (config.json + *.safetensors)."
            )
        return ckpt.restore_params(step, abstract), step
    finally:
        ckpt.close()


def restore_lora_base(base: Mapping[str, Any], model: BaseModel, partitioner: Partitioner) -> Any:
    """The frozen base params of a LoRA run from their recorded source, on the model's
    shardings."""
    if "hf" in base:
        return hf.load_params(model, base["hf"], partitioner)
    abstract = pytrees.abstract_params(model, partitioner)
    return restore_params(base["checkpoint"], abstract, base.get("step"))[0]


def load_lora_base(
    setup: steps.Setup,
    model_dir: str,
    init_from_hf: str | None,
    base_checkpoint: str | None,
    row_start: RowStart,
) -> Any:
    """The frozen base params of a LoRA run (see `train`), and `model_dir/lora.json`."""
    model, partitioner = setup.model, setup.partitioner
    if init_from_hf:
        source: dict[str, Any] = {"hf": os.path.abspath(init_from_hf)}
        params = hf.load_params(model, init_from_hf, shardings=setup.base_shardings)
        write_model_record(model, model_dir, row_start, init_from_hf)
    elif base_checkpoint:
        step = checkpointer.Checkpointer(base_checkpoint).latest_step()
        source = {"checkpoint": os.path.abspath(base_checkpoint), "step": step}
        params = restore_lora_base(source, model, partitioner)
    else:
        base_dir = os.path.join(os.path.abspath(model_dir), LORA_BASE_DIR)
        source = {"checkpoint": base_dir, "step": 0}
        base_ckpt = checkpointer.Checkpointer(base_dir)
        if base_ckpt.latest_step() is None:
            params = setup.init_base()
            base_ckpt.save_params(0, params)
            base_ckpt.close()
        else:
            base_ckpt.close()
            params = restore_lora_base(source, model, partitioner)
    write_lora_record(model_dir, setup.lora, source)
    print(f"LoRA on {len(setup.lora_kernels)} kernels; frozen base params from {source}.")
    return params


def restore_merged(
    model_dir: str | epath.Path, model: BaseModel, partitioner: Partitioner, step: int | None = None
) -> tuple[Params, int]:
    """`(merged params, step)` of a LoRA run's MODEL_DIR: its adapters at `step` (the
    latest if None) folded into the recorded base params."""
    cfg, base_source, adapters, step = restore_adapters(model_dir, model, partitioner, step)
    base = restore_lora_base(base_source, model, partitioner)
    return merge_adapters(base, adapters, cfg), step


def restore_adapters(
    model_dir: str | epath.Path, model: BaseModel, partitioner: Partitioner, step: int | None = None
) -> tuple[lora.LoraConfig, dict[str, Any], Params, int]:
    """`(cfg, base source, adapters, step)` of a LoRA run's MODEL_DIR: its adapters at
    `step` (the latest if None), on their kernels' shardings."""
    record = read_lora_record(model_dir)
    if record is None:
        raise ValueError(f"{model_dir} has no {LORA_RECORD}: not a LoRA run.")
    cfg, base_source = record
    kernels = lora.plan(cfg, model, model.example_batch_shapes())
    abstract = jax.eval_shape(lambda: lora.init_adapters(jax.random.PRNGKey(0), kernels))
    abstract = pytrees.with_shardings(abstract, partitioner.sharding(lora.adapter_axes(kernels)))
    adapters, step = restore_params(model_dir, abstract, step)
    return cfg, base_source, adapters, step


def merge_adapters(base: Params, adapters: Params, cfg: lora.LoraConfig) -> Params:
    """`lora.merge` on the base params' shardings."""
    merge = jax.jit(lambda b, a: lora.merge(b, a, cfg), out_shardings=pytrees.shardings_of(base))
    return merge(base, adapters)


def load_peft(
    path: str | epath.Path,
    partitioner: Partitioner,
    model: BaseModel | None = None,
    base: str | None = None,
    dtype: str | None = None,
) -> tuple[BaseModel, Params]:
    """`(model, merged params)` of a PEFT adapter directory over its HF base (`base`, else
    its adapter_config.json's `base_model_name_or_path`; `dtype` as `load_model_and_params`
    takes it)."""
    base = base or peft_config.base_model_path(path)
    if model is None:
        model = hf.model_from_hf_dir(base, partitioner, *_hf_dtype(dtype, base))
    cfg, adapters = peft_dir.load_adapters(model, path)  # (checked before the base loads)
    params = hf.load_params(model, base, partitioner)
    return model, merge_adapters(params, adapters, cfg)


def checkpoint_vocabulary(path: str | epath.Path) -> vocabularies.HuggingFaceVocabulary | None:
    """An HF directory's own tokenizer, or the one a MODEL_DIR kept from its HF import, or a
    PEFT directory's (else its base's)."""
    path = epath.Path(path)
    if peft_config.is_peft_dir(path) and not (path / "tokenizer_config.json").exists():
        base = peft_config.read_adapter_config(path).get("base_model_name_or_path")
        path = epath.Path(base or path)
    elif not is_hf_dir(path) and not peft_config.is_peft_dir(path):
        path = path / TOKENIZER_DIR
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return vocabularies.HuggingFaceVocabulary(str(path))
    return None


def tokenizer_dir(model_dir: str | epath.Path) -> epath.Path | None:
    """Where a MODEL_DIR keeps its HF tokenizer files, if it does."""
    path = epath.Path(model_dir) / TOKENIZER_DIR
    return path if path.exists() else None


class Loaded(NamedTuple):
    """What `load_model_and_params` returns."""

    model: BaseModel
    params: Params
    step: int  # 0 for an HF directory
    row_start: RowStart  # what the model's rows started with in training (`checkpoint_row_start`)


def _hf_dtype(dtype: str | None, path: str | epath.Path) -> tuple[Any, ...]:
    """`model_from_hf_dir`'s dtype argument for an inference `dtype` (none: its default)."""
    return () if dtype is None else (hf_files.inference_dtype(dtype, path),)


def load_model_and_params(
    checkpoint: str | epath.Path,
    partitioner: Partitioner,
    step: int | None = None,
    model: BaseModel | None = None,
    peft_base: str | None = None,
    dtype: str | None = None,
) -> Loaded:
    """The model and params of a flaxlm MODEL_DIR (a LoRA run's merged), an HF directory or
    a PEFT adapter directory (merged into `peft_base`, else the HF directory its
    `base_model_name_or_path` names), placed on the partitioner's shardings one shard at a
    time. `model` (a Gin-bound one) wins over the recorded one; `step` defaults to the
    latest. The checkpoint's tokenizer, for a run that binds no vocabulary, is
    `checkpoint_vocabulary`'s.

    `dtype`, for the inference runs (`hf_files.INFERENCE_DTYPES`): an HF model's compute and
    param dtype, 'auto' the checkpoint's own (`hf_files.inference_dtype`: a bfloat16
    checkpoint is served in bfloat16, as transformers loads it); None: float32, as training
    starts from it. A MODEL_DIR computes as its run trained ('auto'; another is an error)."""
    path = epath.Path(checkpoint)
    if dtype is not None:
        hf_files.check_inference_dtype(dtype)
    if not path.exists():
        raise FileNotFoundError(f"CHECKPOINT {str(checkpoint)!r} does not exist.")
    if peft_config.is_peft_dir(path):
        model, params = load_peft(path, partitioner, model, peft_base, dtype)
        return Loaded(model, params, 0, hf_row_start(model))
    if is_hf_dir(path):
        if model is None:
            model, params = hf.from_pretrained(path, partitioner, *_hf_dtype(dtype, path))
        else:
            params = hf.load_params(model, path, partitioner)
        return Loaded(model, params, 0, hf_row_start(model))
    if dtype not in (None, "auto"):
        raise ValueError(
            f"dtype={dtype!r} chooses how a HuggingFace directory's model computes; "
            f"{str(checkpoint)!r} is a flaxlm MODEL_DIR, which computes as its run trained "
            "(its model record's dtype): leave dtype 'auto'."
        )
    if model is None:
        model = read_model(path, partitioner)
    if read_lora_record(path) is not None:
        params, step = restore_merged(path, model, partitioner, step)
    else:
        params, step = restore_params(path, pytrees.abstract_params(model, partitioner), step)
    return Loaded(model, params, step, recorded_row_start(path) or SEQIO_START)
