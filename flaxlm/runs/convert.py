"""The `import_hf` and `export_hf` run functions: HuggingFace directory <-> MODEL_DIR, and
`model_from_hf`, the model of any HF directory for a Gin file's `MODEL`.

python -m flaxlm.main --gin_file=gin/runs/import_hf.gin --gin.HF_DIR=... --gin.MODEL_DIR=...
python -m flaxlm.main --gin_file=gin/runs/export_hf.gin --gin.MODEL_DIR=... --gin.OUT_DIR=...
python -m flaxlm.main --gin_file=gin/finetune_hf.gin --gin.INIT_FROM_HF=...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gin
import jax
import jax.numpy as jnp
from etils import epath

from flaxlm.checkpoints import checkpointer, hf, hf_files, peft_dir, run_dir
from flaxlm.models import hf_spec
from flaxlm.models.base import BaseModel
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import metrics


@gin.configurable
def model_from_hf(
    path: str = gin.REQUIRED,
    *,
    partitioner: Partitioner | None = None,
    param_dtype: str = "float32",
    dtype: str | None = None,
    scan_layers: bool | None = None,
    remat_policy: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> BaseModel:
    """The model (family, shape, special ids) an HF directory's config.json describes, for
    `MODEL = @convert.model_from_hf()` (`gin/finetune_hf.gin`): no model file to choose.

    `param_dtype` stores the params, `dtype` computes (default: param_dtype);
    `scan_layers` / `remat_policy` / `overrides` (any other config field) as in a model's
    gin file; None keeps the family's default. `partitioner` pads the vocabulary for its
    tensor axis.
    """
    options: dict[str, Any] = {"dtype": dtype or param_dtype}
    if scan_layers is not None:
        options["scan_layers"] = scan_layers
    if remat_policy is not None:
        options["remat_policy"] = remat_policy
    options.update(overrides or {})
    model = hf.model_from_hf_dir(path, partitioner, jnp.dtype(param_dtype), options)
    dropouts = hf_files.file_dropouts(hf_spec.text_tower(hf_files.read_hf_config(path)))
    if dropouts:
        listed = ", ".join(f"{k} {v:g}" for k, v in dropouts.items())
        metrics.print0(
            f"{path}: config.json's dropout ({listed}) is not read: flaxlm trains with the "
            f"model's dropout_rate, {model.config.dropout_rate:g} here (transformers' training "
            "would apply the file's); set it with "
            "--gin.convert.model_from_hf.overrides=\"{'dropout_rate': 0.1}\"."
        )
    return model


@gin.configurable
def import_hf(
    *,
    hf_dir: str = gin.REQUIRED,
    model_dir: str = gin.REQUIRED,
    partitioner: Partitioner | None = None,
    dtype: str = "float32",
) -> None:
    """Run function: HF directory -> flaxlm params checkpoint (step 0) in `model_dir`.

    Writes `model_dir/checkpoints/0` (params only), the model record (special ids and
    generation config included) and the tokenizer files to `model_dir/tokenizer/`; a
    training run over that `model_dir` (the same model bound) starts from it with a fresh
    optimizer state, and an export writes them all back.
    """
    partitioner = partitioner or Partitioner()
    model, params = hf.from_pretrained(hf_dir, partitioner, jnp.dtype(dtype))
    ckpt = checkpointer.Checkpointer(model_dir)
    ckpt.save_params(0, params)
    ckpt.close()
    run_dir.write_model_record(model, epath.Path(model_dir), run_dir.hf_row_start(model), hf_dir)
    print(f"Imported {hf_dir} ({model.config.__class__.__name__}) into {ckpt.directory}.")


@gin.configurable
def export_hf(
    *,
    model_dir: str = gin.REQUIRED,
    out_dir: str = gin.REQUIRED,
    model: BaseModel | None = None,
    partitioner: Partitioner | None = None,
    step: int | None = None,
    dtype: str | None = None,
    peft: bool = False,
) -> None:
    """Run function: the params of a flaxlm checkpoint -> an HF directory (a LoRA run's
    adapters merged into its base params), with the tokenizer the run started from.

    The model is the bound one, else the recorded one; `step` defaults to the latest.
    `peft`: a LoRA run's adapters alone, as a PEFT adapter directory (`adapter_config.json`
    + `adapter_model.safetensors`, instead of the merged model) over the HF base the run
    started from; a base that is no HF directory is exported beside them, to `out_dir/base`.
    """
    partitioner = partitioner or Partitioner()
    if run_dir.is_hf_dir(model_dir):
        raise ValueError(f"MODEL_DIR {model_dir!r} is already a HuggingFace directory.")
    if peft:
        export_peft(model_dir, out_dir, model, partitioner, step, dtype)
        return
    loaded = run_dir.load_model_and_params(model_dir, partitioner, step, model)
    tokenizer_dir = run_dir.tokenizer_dir(model_dir)
    hf.save_pretrained(
        loaded.model, loaded.params, out_dir, dtype=dtype, tokenizer_dir=tokenizer_dir
    )
    merged = " (LoRA adapters merged)" if run_dir.read_lora_record(model_dir) else ""
    print(f"Exported step {loaded.step} of {model_dir}{merged} to {out_dir}.")


def export_peft(
    model_dir: str,
    out_dir: str,
    model: BaseModel | None,
    partitioner: Partitioner,
    step: int | None,
    dtype: str | None,
) -> None:
    """`export_hf(peft=True)`: a LoRA run's adapters -> a PEFT adapter directory."""
    if run_dir.read_lora_record(model_dir) is None:
        raise ValueError(f"export_hf.peft: {model_dir} is not a LoRA run (no lora.json).")
    model = model or run_dir.read_model(model_dir, partitioner)
    cfg, source, adapters, step = run_dir.restore_adapters(model_dir, model, partitioner, step)
    tokenizer_dir = run_dir.tokenizer_dir(model_dir)
    base = source.get("hf")
    if base is None:  # a flaxlm base: PEFT needs it as an HF directory
        base = str(epath.Path(out_dir) / "base")
        params = run_dir.restore_lora_base(source, model, partitioner)
        hf.save_pretrained(model, params, base, dtype=dtype, tokenizer_dir=tokenizer_dir)
    peft_dir.save_adapters(model, adapters, cfg, out_dir, base_model_name_or_path=base, dtype=dtype)
    if tokenizer_dir is not None and jax.process_index() == 0:
        hf_files.copy_tokenizer(tokenizer_dir, out_dir)
    print(f"Exported the LoRA adapters of step {step} of {model_dir} (PEFT) to {out_dir}.")
