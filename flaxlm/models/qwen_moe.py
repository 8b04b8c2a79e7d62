"""Qwen2-MoE (Qwen1.5-MoE) and Qwen3-MoE: Qwen's attention with a mixture-of-experts MLP.

Qwen3-MoE is Qwen3 (per-head q/k RMSNorms, no biases, its own `head_dim`) whose MLPs are
`moe.MoE` layers (softmax then top k, `norm_topk_prob`). Qwen2-MoE is Qwen2 (q/k/v biases)
whose MoE layers add a shared expert scaled by a sigmoid gate. Both keep dense MLPs (of
`intermediate_size`) on the layers `mlp_only_layers` names and off the `decoder_sparse_step`.
Follows HuggingFace's `Qwen2MoeForCausalLM` and `Qwen3MoeForCausalLM`.

Qwen3-VL-MoE's files (`qwen3_vl_moe`: Qwen3-VL-30B-A3B, 235B-A22B) hold a Qwen3-MoE text tower
(`qwen3_vl_moe_text`, top-k always renormalised; on text its MRoPE is plain rotary) whose
experts are stored fused: in the Hub's files transposed from transformers' in-memory layout
(`experts.gate_up_proj` `[experts, embed, 2 * mlp]`, `experts.down_proj` `[experts, mlp,
embed]`), in transformers 5's `save_pretrained`'s not. `Qwen3VLMoeTextConfig` reads both, as
transformers does (`HFTensor.also_swapped`), and exports the model as a Qwen3-MoE.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import flax.linen as nn
import gin
import jax
import numpy as np

from flaxlm.models import llama, masks, moe, options, qwen, rope, stacks
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import (
    LLAVA_RENAMES,
    LLAVA_SKIP,
    HFSpec,
    HFTensor,
    Multimodal,
    linear,
    register_hf,
)

Array = jax.Array

MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
ARCHITECTURES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


class MoESizes(options.ParamCounts):
    """Parameter counts and FLOPs of a config with QwenFields' and MoEOptions' fields (every
    MoE family here); a family whose attention has other params overrides
    `attention_params`."""

    def attention_params(self) -> int:
        """One block's attention params: q, k, v, o, their biases, per-head q/k norms."""
        e, d = self.hidden_size, self.dim_per_head
        q, kv = self.num_heads * d, self.kv_heads * d
        attn = e * (q + 2 * kv) + q * e
        attn += (q + 2 * kv if self.qkv_bias else 0) + (e if self.attention_bias else 0)
        return attn + (2 * d if self.qk_norm else 0)

    def param_counts(self) -> tuple[int, int]:
        """(all, active per token) params."""
        e, v = self.hidden_size, self.vocab_size
        attn = self.attention_params()
        total = active = v * e + e + (0 if self.tie_word_embeddings else v * e)
        moe_all, moe_active = self.moe_params(e)
        for sparse in self.sparse_layers(self.num_layers):
            mlp_all, mlp_active = (
                (moe_all, moe_active) if sparse else (3 * e * self.intermediate_size,) * 2
            )
            total += attn + 2 * e + mlp_all
            active += attn + 2 * e + mlp_active
        return total, active

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x the active matmul params plus attention scores."""
        lookup = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return llama.windowed_flops_per_token(self, seq_len, self.active_params() - lookup)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class QwenMoeConfig(moe.DenseFirstScan, MoESizes, qwen.QwenFields, moe.MoEOptions):
    """Qwen2-MoE / Qwen3-MoE hyper-parameters: QwenFields' and MoEOptions' fields (HF's
    names); the defaults are Qwen3-30B-A3B's."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    num_layers: int = 48
    num_heads: int = 32
    num_kv_heads: int | None = 4
    head_dim: int | None = 128
    intermediate_size: int = 6144  # the dense layers' MLP (mlp_only_layers), if any
    max_position_embeddings: int = 40960
    model_type: str = "qwen3_moe"
    # Qwen2-MoE: biases on q, k and v (HF's qkv_bias; Qwen3-MoE has none).
    qkv_bias_qwen2: bool = True

    supported_model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_moe()
        if self.model_type == "qwen3_moe" and self.shared_expert_intermediate_size:
            raise ValueError(
                "shared_expert_intermediate_size is Qwen2-MoE's: set it 0 or model_type="
                "'qwen2_moe'."
            )

    @property
    def qkv_bias(self) -> bool:
        return (self.model_type == "qwen2_moe" and self.qkv_bias_qwen2) or self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3_moe"

    def make_module(self) -> QwenMoe:
        return QwenMoe(self)


def mlp_or_experts(module: nn.Module, cfg: Any, h: Array, mask: masks.Mask) -> Array:
    """A block's MLP scoped `mlp`: `moe.MoE` on its sparse layers, else a SwiGLU of
    `intermediate_size` (in `module`'s scope, where it is called)."""
    dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    sparse = cfg.sparse_layers(cfg.num_layers)
    # scanned: the layer its block stands for (a cycle on, the same kind: `stacks.cycle_of`)
    if sparse[stacks.layer_of(module, cfg.first_scanned_layer)]:
        return moe.MoE(cfg, name="mlp", **dense)(h, moe.real_tokens(mask, h.shape[1]))
    return moe.GatedMLP(
        cfg.intermediate_size, cfg.hidden_size, cfg.activation, name="mlp", **dense
    )(h)


class QwenMoeBlock(llama.LlamaBlock):
    """Llama's block with the mixture of experts (or a dense MLP, `mlp_only_layers`) as its
    feed-forward: the block of every MoE family on QwenFields (a family whose attention
    differs overrides `attention_options`, as OLMoE)."""

    config: Any  # QwenFields + MoEOptions

    def feed_forward(self, h: Array, mask: masks.Mask) -> Array:
        return mlp_or_experts(self, self.config, h, mask)


class QwenMoe(qwen.Qwen):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = QwenMoeBlock


# ------------------------------------------------------------------ HuggingFace


def config_from_hf(hf: dict, **overrides: Any) -> QwenMoeConfig:
    """A QwenMoeConfig from a Qwen2-MoE or Qwen3-MoE config.json dict (+ field overrides)."""
    qwen3 = hf["model_type"] == "qwen3_moe"
    window = hf.get("sliding_window") or None  # Qwen2-MoE writes 0 for none
    layer_types = hf.get("layer_types")
    kwargs = dict(
        llama.shared_fields_from_hf(hf),
        head_dim=hf.get("head_dim"),
        attention_bias=hf.get("attention_bias", False) if qwen3 else False,
        qkv_bias_qwen2=hf.get("qkv_bias", True),
        use_sliding_window=bool(hf.get("use_sliding_window")) and window is not None,
        sliding_window=window,
        # Qwen3-MoE windows every layer when it windows any.
        max_window_layers=0 if qwen3 else hf.get("max_window_layers", 28),
        layer_types=tuple(layer_types) if layer_types is not None and not qwen3 else None,
        model_type=hf["model_type"],
        **moe.options_from_hf(hf),
        **rope.from_hf(hf),
    )
    kwargs.update(overrides)
    return QwenMoeConfig(**kwargs)


def config_to_hf(cfg: QwenMoeConfig) -> dict:
    out = {
        "model_type": cfg.model_type,
        "architectures": [ARCHITECTURES[cfg.model_type]],
        **llama.shared_hf_fields(cfg),
        "head_dim": cfg.dim_per_head,
        "rope_parameters": rope.to_hf(cfg),
        "use_sliding_window": cfg.use_sliding_window,
        "sliding_window": cfg.sliding_window,
        **moe.options_to_hf(
            cfg, "num_local_experts" if cfg.model_type == "qwen3_moe" else "num_experts"
        ),
    }
    if cfg.model_type == "qwen3_moe":
        out["attention_bias"] = cfg.attention_bias
    else:
        out.update(
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            qkv_bias=cfg.qkv_bias_qwen2,
            max_window_layers=cfg.max_window_layers,
            layer_types=list(cfg.attention_layer_types),
        )
    return out


def hf_tensors(cfg: QwenMoeConfig) -> list[HFTensor]:
    """Qwen's attention and norms, then each layer's MLP: the router, the experts (fused as
    transformers 5 holds them) and the shared expert, or a dense MLP."""
    table = [
        t
        for t in qwen.hf_tensors(
            qwen.QwenConfig(
                num_layers=cfg.num_layers,
                model_type="qwen3" if cfg.qk_norm else "qwen2",
                attention_bias=cfg.attention_bias,
                tie_word_embeddings=cfg.tie_word_embeddings,
            )
        )
        if not t.hf.startswith("model.layers.{i}.mlp.")
    ]
    if not cfg.qkv_bias and cfg.model_type == "qwen2_moe":
        table = [t for t in table if not t.param.endswith("/bias")]
    return table + moe_hf_tensors(cfg, "model.layers.{i}.mlp")


def wi_to_hf(wi: np.ndarray) -> np.ndarray:
    """`experts/wi` `[experts, embed, 2, mlp]` -> transformers 5's `experts.gate_up_proj`
    `[experts, 2 * mlp, embed]` (gate rows, then up rows)."""
    e, d, _, f = wi.shape
    return wi.transpose(0, 2, 3, 1).reshape(e, 2 * f, d)


def wi_from_hf(gate_up: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    e, d, _, f = shape
    return gate_up.reshape(e, 2, f, d).transpose(0, 3, 1, 2)


def wo_to_hf(wo: np.ndarray) -> np.ndarray:
    """`experts/wo` `[experts, mlp, embed]` -> `experts.down_proj` `[experts, embed, mlp]`."""
    return wo.transpose(0, 2, 1)


def wo_from_hf(down: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return down.transpose(0, 2, 1).reshape(shape)


SWIGLU = ("gate_proj", "up_proj", "down_proj")  # HF's names of a SwiGLU's projections


def moe_hf_tensors(
    cfg: Any, prefix: str, gate: str = "gate", expert_names: tuple[str, str, str] = SWIGLU
) -> list[HFTensor]:
    """Every layer's MLP records under the HF module `prefix` (with `{i}`): one `{i}` record
    a tensor for the dense layers and one for the sparse ones (`HFTensor.only`; a scanned
    model stacks each cycle's blocks).
    `expert_names`: the Hub's names of each expert's gate, up and down projections
    (`{prefix}.experts.{e}.<name>.weight`, Mixtral: w1, w3, w2)."""
    records = functools.partial(_mlp_records, cfg, gate=gate, expert_names=expert_names)
    sparse = sparse_only(cfg)
    dense = tuple(i for i in range(cfg.num_layers) if i not in sparse)
    out: list[HFTensor] = []
    for is_sparse, only in ((False, dense), (True, sparse)):
        if only:
            table = records("layers_{i}", prefix, is_sparse, cfg.num_layers)
            out += [dataclasses.replace(t, only=only) for t in table]
    return out


def sparse_only(cfg: Any) -> tuple[int, ...]:
    """The layers whose MLP is the mixture of experts (`HFTensor.only` of their records)."""
    return tuple(i for i, s in enumerate(cfg.sparse_layers(cfg.num_layers)) if s)


def _mlp_records(
    cfg: Any,
    scope: str,
    prefix: str,
    sparse: bool,
    n: int,
    gate: str,
    expert_names: tuple[str, str, str],
) -> list[HFTensor]:
    mlp = f"{scope}/mlp"
    if not sparse:
        return [linear(f"{mlp}/{p}/kernel", f"{prefix}.{p}.weight", layers=n) for p in SWIGLU]
    piece = f"{prefix}.experts.{{e}}.{{name}}.weight"
    w_gate, w_up, w_down = (piece.replace("{name}", name) for name in expert_names)
    out = [
        linear(f"{mlp}/gate/kernel", f"{prefix}.{gate}.weight", layers=n),
        HFTensor(
            f"{mlp}/experts/wi",
            f"{prefix}.experts.gate_up_proj",
            layers=n,
            to_hf=wi_to_hf,
            to_flax=wi_from_hf,
            pieces=(w_gate, w_up),
            experts=cfg.num_experts,
        ),
        HFTensor(
            f"{mlp}/experts/wo",
            f"{prefix}.experts.down_proj",
            layers=n,
            to_hf=wo_to_hf,
            to_flax=wo_from_hf,
            pieces=(w_down,),
            experts=cfg.num_experts,
        ),
    ]
    if cfg.shared_expert_intermediate_size:
        out += [
            linear(
                f"{mlp}/shared_expert/{p}/kernel", f"{prefix}.shared_expert.{p}.weight", layers=n
            )
            for p in SWIGLU
        ]
        out.append(
            linear(
                f"{mlp}/shared_expert_gate/kernel", f"{prefix}.shared_expert_gate.weight", layers=n
            )
        )
    return out


HF_SPEC = register_hf(
    HFSpec(
        model_types=MODEL_TYPES,
        config_cls=QwenMoeConfig,
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=llama.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=llama.HF_SPEC.tied_head,
        # InternVL 3.5's MoE files (`internvl`, registered by qwen.py), in llava's layout.
        renames=LLAVA_RENAMES,
        skip=LLAVA_SKIP,
    )
)


# ------------------------------------------------------------------ Qwen3-VL-MoE's text tower

VL_MOE_TEXT = "qwen3_vl_moe_text"
# transformers' Qwen3VLMoeTextConfig defaults, for keys a Qwen3-VL-MoE text_config omits.
VL_MOE_DEFAULTS = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    rope_theta=500000.0,
    moe_intermediate_size=1408,
    num_experts_per_tok=4,
)
VL_MOE_EXPERTS = 60  # its default num_experts (transformers 5 writes num_local_experts)


@dataclasses.dataclass(frozen=True)
class Qwen3VLMoeTextConfig(QwenMoeConfig):
    """A Qwen3-MoE read from a Qwen3-VL-MoE file: its own HF spec reads the experts in the
    file's layout (`vl_moe_hf_tensors`); it computes and exports as a Qwen3-MoE."""


def vl_moe_config_from_hf(hf: dict, **overrides: Any) -> Qwen3VLMoeTextConfig:
    """The text tower of a Qwen3-VL-MoE config.json (transformers' defaults where it is
    silent): a Qwen3-MoE renormalising its top k, without shared experts or windows."""
    windows = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
    hf = {k: v for k, v in {**VL_MOE_DEFAULTS, **hf}.items() if k not in windows}
    hf.update(model_type="qwen3_moe", norm_topk_prob=True, shared_expert_intermediate_size=0)
    if "num_experts" not in hf and "num_local_experts" not in hf:
        hf["num_experts"] = VL_MOE_EXPERTS
    config = config_from_hf(hf, **overrides)
    return Qwen3VLMoeTextConfig(
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    )


def vl_moe_hf_tensors(cfg: Qwen3VLMoeTextConfig) -> list[HFTensor]:
    """Qwen3-MoE's records, the fused experts also read in the Hub's layout, their last two
    axes swapped (exported as Qwen3-MoE's, per expert)."""
    return [dataclasses.replace(t, also_swapped=(1, 2)) if t.pieces else t for t in hf_tensors(cfg)]


VL_MOE_SPEC = register_hf(
    dataclasses.replace(
        HF_SPEC,
        model_types=(VL_MOE_TEXT,),
        config_cls=Qwen3VLMoeTextConfig,
        config_from_hf=vl_moe_config_from_hf,
        tensors=vl_moe_hf_tensors,
        multimodal=(Multimodal("qwen3_vl_moe", VL_MOE_TEXT, tied=False),),
        renames=qwen.HF_SPEC.renames,
        skip=qwen.HF_SPEC.skip,
    )
)
