"""PEFT adapter directories (`adapter_config.json` + `adapter_model.safetensors`) <-> flaxlm
LoRA adapters.

    peft_dir.save_adapters(model, adapters, cfg, out_dir, base_model_name_or_path="/hf/base")
    cfg, adapters = peft_dir.load_adapters(model, "/peft/dir")

A flaxlm adapter pair over kernel `W` (stack + in dims + out dims) is `lora_a` (stack + in dims
+ [r]) and `lora_b` (stack + [r] + out dims), scaled by `alpha / r` (see training/lora.py);
PEFT's over the torch `Linear` HF stores `W` as (`[out, in]`) is `lora_A.weight` `[r, in]` and
`lora_B.weight` `[out, r]`, scaled by `lora_alpha / r` (`alpha_pattern` per module,
`/ sqrt(r)` with rsLoRA). So `lora_A = a.reshape(in, r).T`, `lora_B = b.reshape(r, out).T`,
and the family's HF mapping (models/hf_spec.py) names the module: flaxlm's
`layers_0/q_proj/kernel` is PEFT's `base_model.model.model.layers.0.self_attn.q_proj`.
An MoE layer's expert weights (`experts/wi`, `experts/wo`: one pair per expert) are PEFT's
`target_parameters` over transformers' fused `mlp.experts.gate_up_proj` / `down_proj`
(`peft_experts.py` maps them, for the layouts it names), and so is its router
(`mlp/gate/kernel`: `mlp.gate.weight`, the weight of a module that is no `Linear`). A
kernel HF does not store as a `Linear` of its own (a row block of Phi-3's fused `qkv_proj`,
the LM head over a padded vocabulary) has no PEFT counterpart here.

flaxlm has one `alpha`; an import with per-module scales (`alpha_pattern`, rsLoRA) folds each
module's scale ratio into its `lora_a`, so the adapted model is the same.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from etils import epath
from flax import traverse_util

from flaxlm.checkpoints import hf, peft_experts
from flaxlm.checkpoints.peft_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_config
from flaxlm.models import hf_spec, stacks
from flaxlm.models.base import BaseModel
from flaxlm.parallel import pytrees
from flaxlm.training import lora

Params = Any
# PeftModel wraps the HF model in a LoraModel (`base_model`) that holds it as `model`.
PREFIX = "base_model.model."
_TASK_TYPES = {"AutoModelForCausalLM": "CAUSAL_LM", "AutoModelForSeq2SeqLM": "SEQ_2_SEQ_LM"}


def hf_modules(model: BaseModel) -> dict[str, tuple[int, list[str]]]:
    """flaxlm kernel path -> (number of input dims, the HF module name of each layer: one
    name, or one a layer for a scanned stack) of every kernel HF stores as a torch `Linear`
    of its own (an MoE router's module is not one, `peft_experts.router_weights`)."""
    spec = hf.spec_for_config(model.config)
    routers = peft_experts.router_weights(model, spec)
    out = {}
    scanned = stacks.scan_layout(model.config)
    for param, (t, names, _) in hf_spec.expand(spec.tensors(model.config), scanned).items():
        own_linear = (
            t.transpose and t.split is not None and t.to_hf is None and t.rows is None
        ) and not (t.pieces or t.vocab_axis is not None or t.copies)
        if param.endswith("/kernel") and own_linear and names[0].endswith(".weight"):
            if param not in routers:
                out[param] = (t.split, [n.removesuffix(".weight") for n in names])
    return out


class _Target(NamedTuple):
    """How PEFT names and adapts one flaxlm kernel."""

    num_in: int  # the kernel's input dims
    names: list[str]  # PEFT's name of it in each layer: a module, or a parameter's key
    parameter: bool  # a parameter PEFT wraps (`target_parameters`), not a Linear module
    experts: bool  # one pair per expert (peft_experts.to_peft), not one Linear pair


def _targets(model: BaseModel) -> dict[str, _Target]:
    """flaxlm kernel path -> how PEFT names and adapts it, for every kernel PEFT can adapt."""
    spec = hf.spec_for_config(model.config)
    out = {k: _Target(n, names, False, False) for k, (n, names) in hf_modules(model).items()}
    for kernel, names in peft_experts.expert_weights(model, spec).items():
        out[kernel] = _Target(1, names, True, True)
    for kernel, names in peft_experts.router_weights(model, spec).items():
        out[kernel] = _Target(1, names, True, False)
    return out


def _pair_keys(kernel: str) -> tuple[str, str]:
    """The "/"-joined adapter keys of a "/"-joined kernel path (`lora.adapter_paths`)."""
    a, b = lora.adapter_paths(tuple(kernel.split("/")))
    return "/".join(a), "/".join(b)


def _kernels_for(model: BaseModel, adapters: Params) -> dict[str, _Target]:
    """`_targets` of the kernels `adapters` adapt; one PEFT cannot name, or would load as
    another, is an error."""
    targets = _targets(model)
    flat = traverse_util.flatten_dict(adapters, sep="/")
    kernels = sorted({"/".join(lora.kernel_path(tuple(k.split("/")))) for k in flat})
    missing = [k for k in kernels if k not in targets]
    experts = [k for k in missing if not k.endswith("/kernel")]
    if experts:
        raise ValueError(
            f"LoRA on the expert weights {experts[:4]} has no PEFT counterpart flaxlm maps: "
            "PEFT's target_parameters are mapped for experts transformers holds as per-expert "
            "Linear weights [expert, out, in] (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3), not "
            f"{type(model.config).__name__}'s. Adapt other kernels, or export the merged model."
        )
    if missing:
        raise ValueError(
            f"LoRA kernels {missing[:4]} have no PEFT module: HF does not store them as a torch "
            "Linear of their own (a fused tensor, or the LM head). Adapt others, or export the "
            "merged model."
        )
    spec = hf.spec_for_config(model.config)
    linears = [n for k in kernels if not targets[k].parameter for n in targets[k].names]
    peft_experts.check_modules(spec.config_to_hf(model.config)["model_type"], linears)
    return {k: targets[k] for k in kernels}


# ---------------------------------------------------------------- export


def adapter_state_dict(
    model: BaseModel, adapters: Params, rename: Callable[[str], str] = str
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """`(PEFT tensors by name, rank of each HF module or expert parameter)` of flaxlm
    adapters (unscaled), the modules named by `rename` (`hf.module_names` of the base)."""
    flat = traverse_util.flatten_dict(adapters, sep="/")
    chosen = _kernels_for(model, adapters)
    pair_modules = peft_experts.pair_modules(
        name for t in chosen.values() if t.parameter for name in t.names
    )
    tensors, ranks = {}, {}
    for kernel, (num_in, names, parameter, experts) in chosen.items():
        a_key, b_key = _pair_keys(kernel)
        a = pytrees.host_array(flat[a_key]).astype(np.float32)
        b = pytrees.host_array(flat[b_key]).astype(np.float32)
        stacked = len(names) > 1 or a.ndim > num_in + 1 + experts  # + the expert dim
        for i, name in enumerate(names):
            a_i, b_i = (a[i], b[i]) if stacked else (a, b)
            rank = a_i.shape[-1]
            if experts:
                lora_a, lora_b = peft_experts.to_peft(a_i, b_i)
            else:
                lora_a = a_i.reshape(math.prod(a_i.shape[:num_in]), rank).T  # [r, in]
                lora_b = b_i.reshape(rank, -1).T  # [out, r]
            module = rename(pair_modules[name] if parameter else name)
            tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(lora_a)
            tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(lora_b)
            ranks[name] = rank
    return tensors, ranks


def _suffix(name: str) -> str:
    """A module's or parameter's last name (`q_proj`, `down_proj`; a router's `gate.weight`),
    which PEFT's `rank_pattern` keys match as the end of the name."""
    head, _, last = name.rpartition(".")
    return f"{head.rpartition('.')[2]}.{last}" if last == "weight" else last


def adapter_config_dict(
    model: BaseModel,
    cfg: lora.LoraConfig,
    ranks: Mapping[str, int],
    base_model_name_or_path: str | None,
    rename: Callable[[str], str] = str,
) -> dict[str, Any]:
    """adapter_config.json for adapters over the HF modules and expert parameters `ranks`
    names.

    `target_modules` is the modules' last names where they cover every module of that name
    (else a regex that PEFT full-matches against module names); `target_parameters` the
    expert and router parameters' names below the layer (`mlp.experts.gate_up_proj`,
    `mlp.gate.weight`) where one covers every layer, else its full names; `r` is the
    commonest rank and `rank_pattern` gives the others. flaxlm's one `alpha` over each rank
    is PEFT's `lora_alpha / r`, so no `alpha_pattern` is needed. PEFT's parameter wrappers
    take no dropout, so an adapter with them says `lora_dropout` 0 (the dropout of training;
    the weights are the same).
    """
    spec = hf.spec_for_config(model.config)
    every = [n for _, names in hf_modules(model).values() for n in names]
    every_param = [
        n
        for weights in (peft_experts.expert_weights, peft_experts.router_weights)
        for ns in weights(model, spec).values()
        for n in ns
    ]
    params = sorted(n for n in ranks if n in set(every_param))
    modules = sorted(n for n in ranks if n not in set(params))
    suffixes = sorted({_suffix(n) for n in modules})
    if {n for n in every if _suffix(n) in suffixes} == set(modules):
        targets: list[str] | str = suffixes
    else:
        targets = "(" + "|".join(re.escape(rename(n)) for n in modules) + ")"
    target_parameters = []
    for below in sorted({re.sub(r"^(.*\.)?layers\.\d+\.", "", n) for n in params}):
        named = sorted(n for n in params if n.endswith(f".{below}"))
        every_layer = {n for n in every_param if n.endswith(f".{below}")} == set(named)
        target_parameters += [below] if every_layer else [rename(n) for n in named]
    counts: dict[int, int] = {}
    for rank in ranks.values():
        counts[rank] = counts.get(rank, 0) + 1
    r = max(sorted(counts), key=counts.__getitem__)
    rank_pattern = {}
    for suffix in sorted({_suffix(n) for n in ranks}):
        of_suffix = {ranks[n] for n in ranks if _suffix(n) == suffix}
        if of_suffix == {r}:
            continue
        if len(of_suffix) == 1:
            rank_pattern[suffix] = of_suffix.pop()
        else:  # PEFT matches a key as the end of a module name: the full name is exact
            rank_pattern.update(
                {
                    re.escape(rename(n)): k
                    for n, k in ranks.items()
                    if _suffix(n) == suffix and k != r
                }
            )
    return {
        "peft_type": "LORA",
        "task_type": _TASK_TYPES.get(spec.auto_class),
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": 0.0 if params else cfg.dropout,
        "target_modules": targets,
        "target_parameters": target_parameters or None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": {},
        "use_rslora": False,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_adapters(
    model: BaseModel,
    adapters: Params,
    cfg: lora.LoraConfig,
    out_dir: str | epath.Path,
    *,
    base_model_name_or_path: str | None = None,
    dtype: Any = None,
) -> None:
    """Writes `adapters` (flaxlm's, unscaled) as a PEFT adapter directory that
    `peft.PeftModel.from_pretrained(hf_base, out_dir)` loads. All processes call it; process
    0 writes."""
    from safetensors.numpy import save_file

    rename = hf.module_names(base_model_name_or_path)  # over a multimodal base: its names
    tensors, ranks = adapter_state_dict(model, adapters, rename)
    if dtype is not None:
        tensors = {k: v.astype(np.dtype(dtype)) for k, v in tensors.items()}
    config = adapter_config_dict(model, cfg, ranks, base_model_name_or_path, rename)
    if jax.process_index() != 0:
        return
    out = epath.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    umask = os.umask(0)  # safetensors creates its files 0600; exports are shared like any file
    os.umask(umask)
    os.chmod(str(out / ADAPTER_WEIGHTS), 0o666 & ~umask)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- import


def _pattern(config: Mapping[str, Any], pattern: str, name: str, default: Any) -> Any:
    """PEFT's value of a module's or parameter's `lora_alpha` or `r`: its `alpha_pattern` or
    `rank_pattern` (`pattern`) entry that matches the name's end (PEFT's first), else
    `default`."""
    for key, value in (config.get(pattern) or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _scale(config: Mapping[str, Any], module: str, rank: int) -> float:
    """PEFT's scale of one module's adapter (`alpha_pattern` as PEFT matches it)."""
    alpha = _pattern(config, "alpha_pattern", module, config.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _rank(pair: Mapping[str, tuple[str, np.ndarray]], experts: int, where: epath.Path) -> int:
    """The rank of one PEFT pair `{"A": (key, lora_A), "B": (key, lora_B)}`: `lora_A`
    `[r, in]`, `lora_B` `[out, r]` (over `experts` experts, `[r * experts, in]` and
    `[out, r * experts]`); factors that are not so, or of two ranks, are an error naming
    them."""
    (a_key, a), (b_key, b) = pair["A"], pair["B"]
    per, n = (f"r * {experts} experts", experts) if experts else ("r", 1)
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] % n or b.shape[1] % n:
        raise ValueError(
            f"{where}: tensors {a_key!r} {a.shape} and {b_key!r} {b.shape} are not LoRA "
            f"factors: lora_A is [{per}, in] and lora_B [out, {per}]."
        )
    if a.shape[0] != b.shape[1]:
        raise ValueError(
            f"{where}: tensor {a_key!r} {a.shape} has rank {a.shape[0] // n} but {b_key!r} "
            f"{b.shape} rank {b.shape[1] // n}: lora_A is [{per}, in] and lora_B [out, {per}] "
            "of one rank."
        )
    return a.shape[0] // n


def _peft_shapes(
    a_shape: tuple[int, ...], b_shape: tuple[int, ...], experts: bool
) -> tuple[tuple[int, int], tuple[int, int]]:
    """PEFT's `lora_A` and `lora_B` shapes of one layer's flaxlm pair of these shapes."""
    rank, n = a_shape[-1], a_shape[0] if experts else 1
    fan_in = math.prod(a_shape[1 if experts else 0 : -1])
    return (rank * n, fan_in), (math.prod(b_shape[2 if experts else 1 :]), rank * n)


def _rules(model: BaseModel, ranks: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """LoRA rules adapting exactly the kernels `ranks` names, at their ranks: by module name
    (`q_proj/kernel`, `experts/wi`) where that is exact, else by full path."""
    every = lora.dense_kernels(model, model.example_batch_shapes())
    rules = []
    for rank in sorted(set(ranks.values())):
        chosen = {k for k, r in ranks.items() if r == rank}
        dense = sorted({k.split("/")[-2] for k in chosen if k.endswith("/kernel")})
        other = sorted({"/".join(k.split("/")[-2:]) for k in chosen if not k.endswith("/kernel")})
        by_name = [f"(^|/)({'|'.join(dense)})/kernel$"] if dense else []
        by_name += [f"(^|/)({'|'.join(other)})$"] if other else []
        if {k for k in every if any(re.search(p, k) for p in by_name)} == chosen:
            rules += [(p, rank) for p in by_name]
        else:
            rules.append((f"^({'|'.join(re.escape(k) for k in sorted(chosen))})$", rank))
    return tuple(rules)


def load_adapters(
    model: BaseModel,
    path: str | epath.Path,
    cfg: lora.LoraConfig | None = None,
    shardings: Any = None,
) -> tuple[lora.LoraConfig, Params]:
    """`(cfg, adapters)` of a PEFT adapter directory over `model`'s HF base.

    `cfg` (a bound LoraConfig) must adapt the same kernels at the same ranks; its alpha and
    dropout are kept (the scale difference is folded into `lora_a`). Without it, the config
    comes from adapter_config.json. The adapters are float32 numpy arrays, or placed on
    `shardings` (a tree like them).
    """
    from safetensors.numpy import load_file

    config = read_adapter_config(path)
    weights = epath.Path(path) / ADAPTER_WEIGHTS
    if not weights.exists():
        raise FileNotFoundError(f"{weights} not found (flaxlm reads PEFT adapters in safetensors).")
    targets = _targets(model)
    by_name = {name: (kernel, i) for kernel, t in targets.items() for i, name in enumerate(t.names)}
    params = [n for t in targets.values() if t.parameter for n in t.names]
    # The module name PEFT saves each pair under: a Linear's own, a parameter's module with
    # one `base_layer.` per wrapper outside it (peft_experts.pair_modules). A router's is its
    # module's name whether target_parameters names it or (transformers 4's spelling, which
    # PEFT upgrades for some model types) target_modules does: the same pair either way.
    saved_as = {name: name for name in by_name if name not in set(params)}
    routers = [n for t in targets.values() if t.parameter and not t.experts for n in t.names]
    saved_as.update({n.removesuffix(".weight"): n for n in routers})
    targeted = peft_experts.targeted(config, params, str(epath.Path(path) / ADAPTER_CONFIG))
    saved_as.update({m: n for n, m in peft_experts.pair_modules(targeted).items()})
    stored = load_file(str(weights))
    pairs: dict[str, dict[str, np.ndarray]] = {}
    # Over a multimodal base the text modules have the outer model's names (`renames` read
    # them), and another tower's adapters are skipped (`skip`).
    spec, skipped = hf.spec_for_config(model.config), []
    for key, tensor in stored.items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.\w+)?\.weight", key)
        module, side = (match[1], match[2]) if match else ("", "")
        if module not in saved_as:  # PEFT's own names first (Mixtral's `mlp.` experts)
            own, skip = spec.own_names([module])
            if skip:
                skipped.append(key)
                continue
            module = next(iter(own))
        if module not in saved_as:
            raise ValueError(
                f"{weights}: tensor {key!r} is not a LoRA adapter of a "
                f"{type(model.config).__name__} module flaxlm maps (e.g. "
                f"{PREFIX}{next(iter(saved_as))}.lora_A.weight)."
            )
        pairs.setdefault(saved_as[module], {})[side] = (key, tensor.astype(np.float32))
    if skipped and jax.process_index() == 0:
        print(f"{weights}: skipped {len(skipped)} LoRA tensors of modules it lacks: {skipped[0]}")
    ranks: dict[str, int] = {}
    for name, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{weights}: module {name} has lora_{set('AB') - set(pair)} missing.")
        kernel = by_name[name][0]
        rank = _rank(pair, model.config.num_experts if targets[kernel].experts else 0, weights)
        said = _pattern(config, "rank_pattern", name, config.get("r", 8))
        if rank != said:  # PEFT builds the pair at the config's rank, then cannot load it
            raise ValueError(
                f"{weights}: tensor {pair['A'][0]!r} {pair['A'][1].shape} has rank {rank}, but "
                f"{epath.Path(path) / ADAPTER_CONFIG} says r={said} for {name} (its r, or a "
                "rank_pattern entry): set it to the tensors' rank."
            )
        if ranks.setdefault(kernel, rank) != rank:
            raise ValueError(
                f"{weights}: the layers of scanned kernel {kernel} have different ranks; load "
                "the model with scan_layers=False."
            )
    if cfg is None:
        cfg = lora.LoraConfig(
            rules=_rules(model, ranks),
            alpha=float(config.get("lora_alpha", 8)),
            dropout=float(config.get("lora_dropout", 0.0)),
        )
    planned = lora.plan(cfg, model, model.example_batch_shapes())
    if {k: p.rank for k, p in planned.items()} != ranks:
        raise ValueError(
            f"LoraConfig {cfg.rules} adapts other kernels or ranks than {path} "
            f"({sorted(ranks.items())[:4]} ...)."
        )
    flat = {}
    for kernel, plan in planned.items():
        _, names, _, experts = targets[kernel]
        a = np.zeros(plan.a_shape, np.float32)  # a scanned layer PEFT leaves alone: zeros
        b = np.zeros(plan.b_shape, np.float32)
        index: tuple[int, ...] = ()
        for name in (n for n in names if n in pairs):
            if plan.num_stacked > experts:  # scanned: the layer's slice
                index = (by_name[name][1],)
            shapes = a.shape[len(index) :], b.shape[len(index) :]
            (a_key, lora_a), (b_key, lora_b) = pairs[name]["A"], pairs[name]["B"]
            want = _peft_shapes(*shapes, experts)
            if (lora_a.shape, lora_b.shape) != want:
                raise ValueError(
                    f"{weights}: tensors {a_key!r} {lora_a.shape} and {b_key!r} "
                    f"{lora_b.shape} do not fit the base model's {kernel} {plan.shape}: "
                    f"expected {want[0]} and {want[1]} (rank {plan.rank}); is it an adapter of "
                    "another model?"
                )
            if experts:
                a_i, b_i = peft_experts.from_peft(lora_a, lora_b, *shapes)
            else:
                a_i, b_i = lora_a.T.reshape(shapes[0]), lora_b.T.reshape(shapes[1])
            ratio = _scale(config, name, plan.rank) / (cfg.alpha / plan.rank)
            a[index], b[index] = a_i * ratio, b_i
        a_key, b_key = _pair_keys(kernel)
        flat[a_key], flat[b_key] = a, b
    adapters = traverse_util.unflatten_dict(flat, sep="/")
    if shardings is not None:
        adapters = jax.device_put(adapters, shardings)
    return cfg, adapters
