"""The LoRA adapters a server serves beside its base (`LORA_ADAPTERS`): flaxlm LoRA run
directories and PEFT adapter directories, read over the served model, checked at start-up
and stacked per kernel (`lora.stack_adapters`) beside the base's own params, which are
neither merged into nor copied. A request's `model` then picks its adapter per row."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from etils import epath

from flaxlm.checkpoints import peft_config, peft_dir, run_dir
from flaxlm.models.base import BaseModel
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import lora

Params = Any


def load_adapters(
    adapters: Mapping[str, str] | None,
    model: BaseModel,
    params: Params,
    partitioner: Partitioner,
    base_name: str,
) -> tuple[Params, tuple[str, ...]]:
    """`(params, names)`: `params` with the adapters of `adapters` (name -> directory)
    stacked beside its kernels, adapter `names[i]` at index `i + 1` (0 is the base); `params`
    and `()` when there are none. An adapter that cannot be read over `model` (a module the
    base lacks, other shapes, an unknown directory) is a ValueError naming it."""
    if not adapters:
        return params, ()
    if not isinstance(adapters, Mapping):
        raise ValueError(
            f"LORA_ADAPTERS must be a dict {{'name': '/path', ...}}, got {adapters!r}."
        )
    kernels: dict[str, lora.AdaptedKernel] = {}
    trees, alphas = [], []
    for name, path in adapters.items():
        if not isinstance(name, str) or not name or name == base_name:
            raise ValueError(
                f"LORA_ADAPTERS: adapter name {name!r} must be a non-empty string other than "
                f"the base model's name {base_name!r}."
            )
        try:
            cfg, tree = _read(str(path), model, partitioner)
            planned = lora.plan(cfg, model, model.example_batch_shapes())
        except (ValueError, OSError) as e:
            raise ValueError(f"LORA_ADAPTERS[{name!r}] ({path}): {e}") from e
        for kernel in planned.values():
            if kernel.path[-1] != "kernel":
                raise ValueError(
                    f"LORA_ADAPTERS[{name!r}] ({path}) adapts {'/'.join(kernel.path)}, a weight "
                    "stacked over experts, which cannot be served per row: serve the merged "
                    "model (convert.export_hf) instead."
                )
        kernels.update(planned)
        trees.append(tree)
        alphas.append(cfg.alpha)

    def stack(trees: list[Params]) -> Params:
        return lora.stack_adapters(kernels, list(zip(trees, alphas)))

    shardings = partitioner.sharding(lora.stacked_adapter_axes(kernels))
    with partitioner.context():
        stacked = jax.jit(stack, out_shardings=shardings)(trees)
    return lora.with_row_adapters(params, stacked), tuple(adapters)


def _read(path: str, model: BaseModel, partitioner: Partitioner) -> tuple[lora.LoraConfig, Params]:
    """`(cfg, adapters)` of a PEFT adapter directory or a flaxlm LoRA run's MODEL_DIR (its
    latest step), read over `model`."""
    if not epath.Path(path).exists():
        raise ValueError("no such directory.")
    if peft_config.is_peft_dir(path):
        return peft_dir.load_adapters(model, path)
    if run_dir.read_lora_record(path) is not None:
        cfg, _, adapters, _ = run_dir.restore_adapters(path, model, partitioner)
        return cfg, adapters
    raise ValueError(
        f"neither a PEFT adapter directory ({peft_config.ADAPTER_CONFIG}) nor a flaxlm LoRA run "
        f"({run_dir.LORA_RECORD})."
    )
