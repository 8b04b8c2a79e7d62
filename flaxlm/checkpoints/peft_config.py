"""A PEFT adapter directory's `adapter_config.json`: read, and checked to describe a LoRA that
flaxlm's (`training/lora.py`: `W + (alpha / r) B A` over the base as it is) expresses exactly;
any other setting is a ValueError naming it. `peft_dir.py` maps the tensors."""

from __future__ import annotations

import json
from typing import Any

from etils import epath

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# adapter_config.json settings whose non-default values flaxlm's LoRA cannot express.
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "lora_bias": False,
    "bias": "none",
    "layer_replication": None,
    "trainable_token_indices": None,
    # LoRA variants whose adapted layer is not W + s B A: activated LoRA (the adapter applies
    # from an invocation sequence on), KaSA (a truncated base weight and a diagonal), Arrow's
    # routing among adapters, block-diagonal factors.
    "alora_invocation_tokens": None,
    "kasa_config": None,
    "arrow_config": None,
    "use_bdlora": None,
}
# `init_lora_weights` values whose adapter is plain LoRA over the base as it is. PiSSA, OLoRA,
# CorDA and LoftQ rewrite the base model's weights when PEFT creates (and so loads) the adapter.
_PLAIN_INITS = (True, False, "gaussian", "orthogonal", "eva", "mica", "lora_ga")


def is_peft_dir(path: str | epath.Path) -> bool:
    """A PEFT adapter directory (adapter_config.json)."""
    return (epath.Path(path) / ADAPTER_CONFIG).exists()


def read_adapter_config(path: str | epath.Path) -> dict[str, Any]:
    """adapter_config.json of a PEFT directory, checked to be a LoRA flaxlm can express."""
    file = epath.Path(path) / ADAPTER_CONFIG
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: not a PEFT adapter directory.")
    config = json.loads(file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type {config['peft_type']!r}; flaxlm reads LORA only.")
    for key, default in _UNSUPPORTED.items():
        if config.get(key, default) not in (default, [], {}):
            raise ValueError(
                f"{file}: {key}={config[key]!r} is not expressible as flaxlm LoRA "
                f"(supported: {default!r})."
            )
    init = config.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise ValueError(
            f"{file}: init_lora_weights={init!r}: PEFT rewrites the base model's weights when it "
            "loads such an adapter, and flaxlm adds adapters to the base as it is. Save it as "
            "plain LoRA (PEFT's save_pretrained(..., "
            "path_initial_model_for_weight_conversion=...)), or with init_lora_weights true."
        )
    return config


def base_model_path(path: str | epath.Path) -> str:
    """The local HF directory a PEFT directory's `base_model_name_or_path` names."""
    config = read_adapter_config(path)
    base = config.get("base_model_name_or_path")
    if not base or not (epath.Path(base) / "config.json").exists():
        raise ValueError(
            f"{epath.Path(path) / ADAPTER_CONFIG}: base_model_name_or_path={base!r} is not a local "
            "HF directory; give the base explicitly (a local HF directory with config.json)."
        )
    return str(base)
