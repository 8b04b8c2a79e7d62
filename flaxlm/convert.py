"""The `import_hf` and `export_hf` run functions: HuggingFace directory <-> MODEL_DIR.

python -m flaxlm.main --gin_file=gin/runs/import_hf.gin --gin.HF_DIR=... --gin.MODEL_DIR=...
python -m flaxlm.main --gin_file=gin/runs/export_hf.gin --gin.MODEL_DIR=... --gin.OUT_DIR=...
"""

from __future__ import annotations

import gin
import jax.numpy as jnp
from etils import epath

from flaxlm import checkpoints, hf, run_dir
from flaxlm.models.base import BaseModel
from flaxlm.partitioning import Partitioner


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
    ckpt = checkpoints.Checkpointer(model_dir)
    ckpt.save_params(0, params)
    ckpt.close()
    run_dir.write_model_record(model, epath.Path(model_dir), hf_dir)
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
) -> None:
    """Run function: the params of a flaxlm checkpoint -> an HF directory (a LoRA run's
    adapters merged into its base params), with the tokenizer the run started from.

    The model is the bound one, else the recorded one; `step` defaults to the latest.
    """
    partitioner = partitioner or Partitioner()
    if run_dir.is_hf_dir(model_dir):
        raise ValueError(f"MODEL_DIR {model_dir!r} is already a HuggingFace directory.")
    loaded = run_dir.load_model_and_params(model_dir, partitioner, step, model)
    tokenizer_dir = run_dir.tokenizer_dir(model_dir)
    hf.save_pretrained(
        loaded.model, loaded.params, out_dir, dtype=dtype, tokenizer_dir=tokenizer_dir
    )
    merged = " (LoRA adapters merged)" if run_dir.read_lora_record(model_dir) else ""
    print(f"Exported step {loaded.step} of {model_dir}{merged} to {out_dir}.")
