"""PEFT's LoRA over an MoE layer's parameters (`target_parameters`): the fused expert weights
and the router <-> flaxlm's adapter pairs.

transformers 5 holds a layer's experts as two parameters of one module,
`model.layers.{i}.mlp.experts.gate_up_proj` `[expert, 2 * mlp, embed]` (gate rows, then up)
and `down_proj` `[expert, embed, mlp]`: expert e's slice is a torch `Linear` weight
`[out, in]`. PEFT (`LoraConfig(target_parameters=["mlp.experts.gate_up_proj", ...])`) adapts
such a parameter with a `ParamWrapper` holding one rank-r pair per expert: `lora_A.weight`
`[r * expert, in]`, read as `[expert, r, in]`, and `lora_B.weight` `[out, r * expert]`, read
as `[out, r, expert]` (the expert dim first in A, last in B); expert e's update is
`lora_alpha / r * B[:, :, e] @ A[e]`. flaxlm's pair over `experts/wi` `[expert, embed, 2, mlp]`
is `wi_lora_a` `[expert, embed, r]` and `wi_lora_b` `[expert, r, 2, mlp]` (training/lora.py),
with HF's row order (gate, then up), so `A[e] = a[e].T` and `B[:, :, e] = b[e].reshape(r,
out).T`: the same pairs, exactly.

PEFT wraps the targeted parameters of one module in turn, in the order the module registers
them (`gate_up_proj`, then `down_proj`), each wrapper around the one before, and saves a
pair under the module's name with one `base_layer.` for each wrapper outside its own: with
both adapted, `...experts.lora_A.weight` is `down_proj`'s and
`...experts.base_layer.lora_A.weight` is `gate_up_proj`'s.

Mapped: every expert weight whose HF layout is qwen_moe's (`wi_to_hf`, `wo_to_hf`): Qwen2-MoE,
Qwen3-MoE, Mixtral, OLMoE and DeepSeek-V3's routed experts. Not mapped: gpt-oss's experts
(`[expert, in, out]`, gate and up interleaved, with biases). Refused too: a dense MLP's or
shared expert's `gate_proj` / `up_proj` / `down_proj` Linear of Qwen3-MoE, OLMoE or
DeepSeek-V3, which PEFT itself would load onto the experts (`check_modules`).

The router (flaxlm's `mlp/gate/kernel` `[embed, expert]`) is no `nn.Linear` in transformers 5
either: a `...TopKRouter` module applying its `weight` `[expert, embed]` with `F.linear`
(`model.layers.{i}.mlp.gate`; gpt-oss's `mlp.router`, with a bias). As a `target_modules`
entry PEFT (0.21) refuses it (`Target module Qwen2MoeTopKRouter() is not supported`), except
for the model types it upgrades from transformers 4 (Qwen3-MoE, OLMoE, DeepSeek-V3, Mixtral),
where it reads `gate` as `target_parameters` `gate.weight` in every layer, whatever layers a
regex named (and a regex of Mixtral's Hub names, `block_sparse_moe.gate`, matches no module
in memory: not adapted at all). As a `target_parameters` entry (`mlp.gate.weight`) every
family's router weight gets a `ParamWrapper` whose 2-D pair is a Linear's (`lora_A = a.T`
`[r, embed]`, `lora_B = b.T` `[expert, r]`, saved under the router module's name), so
PEFT's `W + lora_alpha / r * B @ A` is flaxlm's `kernel + alpha / r * a @ b` transposed,
exactly. So router adapters leave that way (`router_weights`), and come back in either
spelling (their tensors are the same).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from flaxlm.models import hf_spec, qwen_moe, stacks
from flaxlm.models.base import BaseModel

# The HF layouts whose expert e is `kernel[e].reshape(in, out).T` (qwen_moe's records, which
# Mixtral, OLMoE and DeepSeek-V3 share): the `[expert, out, in]` a ParamWrapper adapts.
_LINEAR_LAYOUTS = (qwen_moe.wi_to_hf, qwen_moe.wo_to_hf)
# The order transformers' experts modules register their weights, which PEFT wraps them in
# (a router's `weight` is the one parameter of its module PEFT adapts).
_ORDER = ("gate_up_proj", "down_proj", "weight")
# flaxlm's router kernel in every MoE family (models/moe.py's `gate`).
_ROUTER = "mlp/gate/kernel"
# PEFT (0.21) upgrades the config of an adapter over a model type transformers 5 converts from
# transformers 4's per-expert layout (conversion pattern 'qwen2_moe', which Qwen2-MoE itself
# is not under) by reading `target_modules` named like transformers 4's expert Linears as the
# fused experts' parameters (peft/utils/transformers_weight_conversion.py): a dense layer's or
# a shared expert's Linear of such a name would load onto the experts.
_READ_AS_EXPERTS = {
    t: ("gate_proj", "up_proj", "down_proj")
    for t in (
        "qwen3_moe",
        "olmoe",
        "deepseek_v3",
        "deepseek_v32",
        "glm_moe_dsa",
        "glm4_moe_lite",
        "solar_open",
        "exaone_moe",
        "hunyuan_v1_moe",
    )
}


def expert_weights(model: BaseModel, spec: hf_spec.HFSpec) -> dict[str, list[str]]:
    """flaxlm expert weight (`layers_0/mlp/experts/wi`, scanned `layers/block/...`) -> the
    PEFT key of its HF parameter in each layer (`model.layers.0.mlp.experts.gate_up_proj`),
    for every expert weight of `model` whose layout PEFT adapts as above."""
    return _parameters(model, spec, lambda param, t, names: t.to_hf in _LINEAR_LAYOUTS)


def router_weights(model: BaseModel, spec: hf_spec.HFSpec) -> dict[str, list[str]]:
    """flaxlm router kernel (`layers_0/mlp/gate/kernel`) -> the PEFT key of its HF weight in
    each layer (`model.layers.0.mlp.gate.weight`, gpt-oss's `model.layers.0.mlp.router.weight`),
    the `[expert, embed]` weight a ParamWrapper adapts as above."""
    return _parameters(
        model,
        spec,
        lambda param, t, names: (
            param.endswith(_ROUTER) and t.transpose and names[0].endswith(".weight")
        ),
    )


def _parameters(
    model: BaseModel, spec: hf_spec.HFSpec, adapted: Callable[[str, Any, list[str]], bool]
) -> dict[str, list[str]]:
    """flaxlm param -> the PEFT key of its HF tensor in each layer, for the params (with their
    HF tensor record and names) that `adapted` picks."""
    out = {}
    scanned = stacks.scan_layout(model.config)
    for param, (t, names, _) in hf_spec.expand(spec.tensors(model.config), scanned).items():
        if adapted(param, t, names):
            out[param] = [_in_memory(spec, n) for n in names]
    return out


def check_modules(model_type: str, modules: Iterable[str]) -> None:
    """Refuses adapters on Linear `modules` that PEFT would load onto the experts (above)."""
    names = _READ_AS_EXPERTS.get(model_type, ())
    clash = sorted(m for m in modules if m.rsplit(".", 1)[-1] in names)
    if clash:
        raise ValueError(
            f"LoRA on {clash[:4]} cannot be a PEFT adapter: PEFT reads target_modules named "
            f"{'/'.join(names)} of a {model_type} model as its experts' fused parameters (its "
            "upgrade of transformers 4 adapters), so they would load onto the experts. Adapt "
            "other kernels, or export the merged model."
        )


def _in_memory(spec: hf_spec.HFSpec, name: str) -> str:
    """transformers 5's in-memory name of our HF tensor `name`, which PEFT names modules by:
    Mixtral's MoE block is `mlp` in memory and `block_sparse_moe` on the Hub (transformers'
    conversion mapping renames one to the other; the family's `renames` read it back)."""
    memory = name.replace(".block_sparse_moe.", ".mlp.")
    if spec.own_names([memory])[0] != {name: memory}:
        raise ValueError(f"{name}: no in-memory name for PEFT (the family's renames disagree).")
    return memory


def pair_modules(params: Iterable[str]) -> dict[str, str]:
    """PEFT parameter key -> the module name its `lora_A` / `lora_B` are saved under, for
    one adapter's adapted expert parameters `params` (PEFT's nesting, above)."""
    by_module: dict[str, list[str]] = {}
    for key in params:
        module, _, name = key.rpartition(".")
        by_module.setdefault(module, []).append(name)
    out = {}
    for module, names in by_module.items():
        for depth, name in enumerate(sorted(names, key=_ORDER.index, reverse=True)):
            out[f"{module}.{name}"] = module + ".base_layer" * depth
    return out


def targeted(config: Mapping[str, Any], every: Iterable[str], where: str) -> list[str]:
    """The parameter keys of `every` that adapter_config.json's `target_parameters` adapt
    (PEFT's match: the key, or its end after a '.'); a target flaxlm cannot place is an
    error."""
    targets = config.get("target_parameters") or []
    every = list(every)
    for target in targets:
        if not any(k == target or k.endswith(f".{target}") for k in every):
            some = sorted({k.split(".", 3)[-1] for k in every})
            raise ValueError(
                f"{where}: target_parameters entry {target!r} names no expert weight or router "
                f"flaxlm maps to PEFT for this model (those it maps: {some or 'none'}); "
                "gpt-oss's interleaved experts are not mapped."
            )
    return [k for k in every if any(k == t or k.endswith(f".{t}") for t in targets)]


def to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer's flaxlm pair (`[expert, in..., r]`, `[expert, r, out...]`) -> PEFT's
    `lora_A.weight` `[r * expert, in]` and `lora_B.weight` `[out, r * expert]`."""
    experts, rank = a.shape[0], a.shape[-1]
    a = a.reshape(experts, -1, rank).transpose(0, 2, 1)  # [expert, r, in]
    b = b.reshape(experts, rank, -1).transpose(2, 1, 0)  # [out, r, expert]
    return a.reshape(experts * rank, -1), b.reshape(-1, rank * experts)


def from_peft(
    lora_a: np.ndarray, lora_b: np.ndarray, a_shape: tuple[int, ...], b_shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's pair over one layer's expert weight -> flaxlm's, of `a_shape` `[expert, in...,
    r]` and `b_shape` `[expert, r, out...]` (the inverse of `to_peft`)."""
    experts, rank = a_shape[0], a_shape[-1]
    fan_in, fan_out = int(np.prod(a_shape[1:-1])), int(np.prod(b_shape[2:]))
    if lora_a.shape != (rank * experts, fan_in) or lora_b.shape != (fan_out, rank * experts):
        raise ValueError(
            f"lora_A {lora_a.shape} / lora_B {lora_b.shape}: expected {(rank * experts, fan_in)}"
            f" / {(fan_out, rank * experts)} for {experts} experts of rank {rank}."
        )
    a = lora_a.reshape(experts, rank, fan_in).transpose(0, 2, 1)
    b = lora_b.reshape(fan_out, rank, experts).transpose(2, 1, 0)
    return a.reshape(a_shape), b.reshape(b_shape)
