"""DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`): DeepSeek-V3's block
(`deepseek.py`) whose latent attention is sparse: each query attends to the `index_topk`
keys a lightning indexer picks (DeepSeek Sparse Attention, `sparse_attention.py`).

What differs from DeepSeek-V3: every layer's attention carries an indexer
(`self_attn.indexer`: `wq_b`, `wk`, `k_norm`, `weights_proj`); queries always come through
their latent (`q_lora_rank`: HF's attention has no `q_proj`) and the attention's rotary
pairs are always interleaved (no `rope_interleave` setting); dense and MoE layers may come
in any order (`mlp_layer_types`, by default the first `first_k_dense_replace` dense). GLM-5
differs from DeepSeek-V3.2 in its sizes, in its indexer's rotary pairs (interleaved, V3.2's
half-split) and in layers that may share a choice (`indexer_types`: a 'shared' layer has no
indexer and attends to the keys the last 'full' one chose). Follows HuggingFace's
`DeepseekV32ForCausalLM` and `GlmMoeDsaForCausalLM`; block-FP8 files are dequantized
(`checkpoints/fp8.py`). The multi-token-prediction layer of the Hub's files
(`model.layers.61`, GLM-5's `model.layers.78`) is skipped on import, as transformers'
causal LM skips it, unless `num_mtp_layers` asks for it: then it is DeepSeek-V3's MTP layer
(`mtp.py`) around a block of this family (its own full indexer, a mixture of experts), as
transformers' `MtpModel` builds one from these models.

Refused (a ValueError naming the setting, where HF's model fails or flaxlm cannot run it):
`q_lora_rank` None, `index_head_dim` narrower than `qk_rope_head_dim`, `layer_types` other
than 'indexed_attention' (HF's cache holds no indexer keys for another kind), fewer
`mlp_layer_types` than layers, GLM-5's `indexer_types` other than 'full' / 'shared' or
with the first layer 'shared', `scan_layers` with shared indexers, and what DeepSeek-V3
refuses (`deepseek.fields_from_hf`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import gin
import jax

from flaxlm.models import (
    deepseek,
    glm4_moe,
    layers,
    masks,
    mtp_hf,
    sparse_attention,
    stacks,
)
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.hf_spec import HFSpec, HFTensor, linear, register_hf

Array = jax.Array

INDEXER_KINDS = ("full", "shared")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DeepseekV32Config(deepseek.DeepseekV3Config):
    """DeepSeek-V3.2 hyper-parameters: DeepSeek-V3's fields (HF's names where they exist;
    `mlp_only_layers` are HF's dense `mlp_layer_types`) and the indexer's; the defaults are
    DeepSeek-V3.2's (DeepSeek-V3's shapes, transformers' `DeepseekV32Config`)."""

    index_topk: int = 2048  # keys each query attends to
    index_n_heads: int = 64
    index_head_dim: int = 128  # its first qk_rope_head_dim features rotated

    model_type: ClassVar[str] = "deepseek_v32"
    architecture: ClassVar[str] = "DeepseekV32ForCausalLM"
    # HF's DeepseekV32Indexer pairs its rotary features half-split (the attention's interleaved).
    indexer_rope_interleave: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        glm4_moe.check_fixed(self, {"rope_interleave": True}, self.architecture)
        if self.q_lora_rank is None:
            raise ValueError(
                f"q_lora_rank None: HF's {self.architecture} always has a query latent (the "
                "indexer's queries come from it); set it."
            )
        for name in ("index_topk", "index_n_heads", "index_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be positive.")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim {self.index_head_dim} < qk_rope_head_dim "
                f"{self.qk_rope_head_dim}: the indexer rotates its first qk_rope_head_dim "
                "features."
            )
        kinds = self.layer_indexers
        if len(kinds) != self.num_layers or not set(kinds) <= set(INDEXER_KINDS):
            raise ValueError(
                f"indexer_types {kinds}: one of {INDEXER_KINDS} for each of the "
                f"{self.num_layers} layers."
            )
        if kinds and kinds[0] != "full":
            raise ValueError(
                "indexer_types: the first layer is 'shared', but a shared layer reuses an "
                "earlier full layer's choice (HF fails): make it 'full'."
            )
        if self.scan_layers and self.shares_indexers:
            raise ValueError(
                "scan_layers=True needs every layer alike, but indexer_types has shared "
                "layers (no indexer): set scan_layers=False."
            )

    def check_dense_layers(self) -> None:
        """Dense layers anywhere (HF's `mlp_layer_types`); a scan stacks the MoE layers
        after dense first ones (`first_scanned_layer`), or the cycle dense and MoE layers
        repeat among them (`moe.DenseFirstScan`)."""
        if self.decoder_sparse_step != 1:
            raise ValueError(
                f"decoder_sparse_step {self.decoder_sparse_step}: HF's {self.architecture} "
                "names its dense layers (mlp_only_layers); 1 only."
            )

    @property
    def layer_indexers(self) -> tuple[str, ...]:
        """Each layer's indexer: 'full' (its own) or 'shared' (the last full layer's)."""
        return ("full",) * self.num_layers

    @property
    def shares_indexers(self) -> bool:
        """Whether some layer attends to an earlier layer's choice (the blocks carry it)."""
        return "shared" in self.layer_indexers

    @property
    def mlp_layer_types(self) -> tuple[str, ...]:
        """HF's per-layer MLP kinds, 'dense' or 'sparse'."""
        return tuple("sparse" if s else "dense" for s in self.sparse_layers(self.num_layers))

    @property
    def first_k_dense_replace(self) -> int:
        """How many layers lead dense (HF's default pattern; `mlp_layer_types` says all)."""
        kinds = self.mlp_layer_types
        return next((i for i, kind in enumerate(kinds) if kind == "sparse"), len(kinds))

    def indexer_params(self) -> int:
        """One indexer's params: `wq_b`, `wk`, `k_norm`'s scale and bias, `weights_proj`."""
        e, h, d = self.hidden_size, self.index_n_heads, self.index_head_dim
        return self.q_lora_rank * h * d + e * d + 2 * d + e * h

    def param_counts(self) -> tuple[int, int]:
        """(all, active per token) params: DeepSeek-V3's (the MTP layers' included) and
        every full layer's and MTP layer's indexer."""
        total, active = super().param_counts()
        indexers = self.indexer_params() * self.indexers()
        return total + indexers, active + indexers

    def indexers(self) -> int:
        """How many indexers the model holds: its full layers' and its MTP layers'."""
        return self.layer_indexers.count("full") + self.num_mtp_layers

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x the active matmul params but the indexers' (2 x:
        they take no gradient), the attention over `min(seq_len, index_topk)` keys and the
        indexers' scores over `seq_len` (forward only); with MTP layers, each one's block
        and its pass through the head too."""
        lookup = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        full = self.indexers()
        indexers = self.indexer_params() * full
        widths = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        keys = min(seq_len, self.index_topk)
        layers = self.num_layers + self.num_mtp_layers
        scores = 6.0 * self.num_heads * widths * keys * layers
        index = 2.0 * self.index_n_heads * self.index_head_dim * seq_len * full
        head = self.num_mtp_layers * self.vocab_size * self.hidden_size
        matmuls = self.active_params() - lookup - indexers + head
        return 6.0 * matmuls + 2.0 * indexers + scores + index

    def make_module(self) -> DeepseekV32:
        return DeepseekV32(self)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class GlmMoeDsaConfig(DeepseekV32Config):
    """GLM-5 hyper-parameters: DeepSeek-V3.2's fields and `indexer_types`; the defaults are
    transformers' `GlmMoeDsaConfig`'s (GLM-5's shapes)."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    num_layers: int = 78
    num_heads: int = 64
    intermediate_size: int = 12288
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    q_lora_rank: int | None = 2048
    qk_nope_head_dim: int = 192
    v_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    index_n_heads: int = 32
    rope_scaling_type: str | None = None
    rope_scaling_factor: float = 1.0
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    # Each layer's indexer, 'full' or 'shared' (None: every layer full).
    indexer_types: tuple[str, ...] | None = None

    model_type: ClassVar[str] = "glm_moe_dsa"
    architecture: ClassVar[str] = "GlmMoeDsaForCausalLM"
    indexer_rope_interleave: ClassVar[bool] = True  # HF's GlmMoeDsaIndexer

    def __post_init__(self) -> None:
        if self.indexer_types is not None:
            object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        super().__post_init__()

    @property
    def layer_indexers(self) -> tuple[str, ...]:
        return self.indexer_types or ("full",) * self.num_layers

    def mtp_block_fields(self) -> dict[str, Any]:
        """An MTP block has its own indexer (transformers' MTP config keeps the first
        layer's kind, always 'full')."""
        return {**super().mtp_block_fields(), "indexer_types": None}


class DeepseekV32Block(deepseek.DeepseekBlock):
    """DeepSeek-V3's block with sparse latent attention. Called `(carry, index, mask,
    decoding, sin, cos)`; where layers share a choice (`shares_indexers`) the carry is
    `(hidden states, chosen key slots or None)` after the first block, else the hidden
    states alone (so the layers scan)."""

    @nn.compact
    def __call__(
        self,
        carry: Array | tuple[Array, Array | None],
        index: Array,
        mask: masks.Mask,
        decoding: masks.Decoding | None,
        sin: Array,
        cos: Array,
    ) -> Array | tuple[Array, Array | None]:
        cfg = self.config
        x, chosen = carry if isinstance(carry, tuple) else (carry, None)
        i = stacks.unrolled_layer(self)  # None when scanned: every layer full (checked)
        shared = i is not None and cfg.layer_indexers[i] == "shared"
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        norm = dict(epsilon=cfg.rms_norm_eps, scale_plus_one=cfg.norm_scale_plus_one, **dense)
        x = layers.constrain(x, layers.ACTIVATION_AXES)
        h = layers.RMSNorm(name="input_layernorm", **norm)(x)
        attn, chosen = sparse_attention.SparseLatentAttention(cfg, shared=shared, name="self_attn")(
            h, sin, cos, mask, decoding, chosen
        )
        x = layers.constrain(x + self.dropped(attn), layers.ACTIVATION_AXES)
        h = layers.RMSNorm(name="post_attention_layernorm", **norm)(x)
        x = layers.constrain(x + self.dropped(self.feed_forward(h, mask)), layers.ACTIVATION_AXES)
        return (x, chosen) if cfg.shares_indexers else x


class DeepseekV32(deepseek.Deepseek):
    """`(tokens, positions, segment_ids) -> float32 logits [batch, length, vocab]`."""

    block_cls = DeepseekV32Block

    def final_norm(self, x: Array | tuple[Array, Array | None]) -> Array:
        return super().final_norm(x[0] if isinstance(x, tuple) else x)


# ------------------------------------------------------------------ HuggingFace

# transformers' config defaults, for keys a config.json omits.
INDEX_DEFAULTS = dict(index_topk=2048, index_n_heads=64, index_head_dim=128)
HF_DEFAULTS = {
    "deepseek_v32": dict(deepseek.HF_DEFAULTS, **INDEX_DEFAULTS),
    "glm_moe_dsa": dict(
        deepseek.HF_DEFAULTS,
        **INDEX_DEFAULTS,
        q_lora_rank=2048,
        qk_nope_head_dim=192,
        v_head_dim=256,
        n_group=1,
        topk_group=1,
    ),
}
HF_DEFAULTS["glm_moe_dsa"]["index_n_heads"] = 32
CONFIGS = {"deepseek_v32": DeepseekV32Config, "glm_moe_dsa": GlmMoeDsaConfig}
RMS_NORM_EPS = {"deepseek_v32": 1e-6, "glm_moe_dsa": 1e-5}
# The Hub's files carry a multi-token-prediction layer after the last (transformers'
# _keys_to_ignore_on_load_unexpected): DeepSeek-V3.2's 61st, GLM-5's 78th.
MTP_LAYER = {"deepseek_v32": 61, "glm_moe_dsa": 78}


def config_from_hf(hf: dict, **overrides: Any) -> DeepseekV32Config:
    """A DeepseekV32Config (a GlmMoeDsaConfig for `glm_moe_dsa`) from a config.json dict
    (+ field overrides)."""
    model_type = hf["model_type"]
    defaults = HF_DEFAULTS[model_type]
    if hf.get("q_lora_rank", defaults["q_lora_rank"]) is None:
        raise ValueError(
            "q_lora_rank is null in config.json: HF's DeepSeek-V3.2 / GLM-5 attention always "
            "has a query latent (and fails without one)."
        )
    kinds = set(hf.get("layer_types") or ("indexed_attention",))
    if kinds != {"indexed_attention"}:
        raise ValueError(
            f"layer_types {sorted(kinds)}: every layer of HF's {model_type} is "
            "'indexed_attention' (its cache holds no indexer keys for another kind)."
        )
    kwargs = deepseek.fields_from_hf(hf, defaults, RMS_NORM_EPS[model_type])
    n = kwargs["num_layers"]
    kwargs.update(
        rope_interleave=True,  # the attention always interleaves (HF ignores the key)
        mlp_only_layers=dense_layers(hf, n, defaults["first_k_dense_replace"]),
        index_topk=hf.get("index_topk", defaults["index_topk"]),
        index_n_heads=hf.get("index_n_heads", defaults["index_n_heads"]),
        index_head_dim=hf.get("index_head_dim", defaults["index_head_dim"]),
    )
    if model_type == "glm_moe_dsa":
        kwargs["indexer_types"] = indexer_types_from_hf(hf, n)
    kwargs.update(overrides)
    return CONFIGS[model_type](**kwargs)


def dense_layers(hf: dict, num_layers: int, first_k_default: int) -> tuple[int, ...]:
    """The dense layers of `mlp_layer_types` (HF: any kind but 'sparse' is dense), or of
    the first `first_k_dense_replace` when config.json has none (HF's default)."""
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        k = hf.get("first_k_dense_replace", first_k_default) or 0
        return tuple(range(min(k, num_layers)))
    if len(kinds) < num_layers:
        raise ValueError(
            f"mlp_layer_types has {len(kinds)} kinds for {num_layers} layers: HF reads one "
            "per layer."
        )
    return tuple(i for i, kind in enumerate(kinds[:num_layers]) if kind != "sparse")


def indexer_types_from_hf(hf: dict, num_layers: int) -> tuple[str, ...] | None:
    """GLM-5's per-layer indexers as HF's GlmMoeDsaConfig resolves them: `indexer_types`,
    else `index_topk_pattern` ('F'ull / 'S'hared letters, or a list), else every
    `index_topk_freq`-th layer from `index_skip_topk_offset` on full (the others shared);
    None when every layer is full."""
    kinds = hf.get("indexer_types")
    pattern = hf.get("index_topk_pattern")
    if kinds is None and pattern is not None:
        letters = {"F": "full", "S": "shared"}
        kinds = [letters.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if kinds is None:
        freq = max(hf.get("index_topk_freq", 1), 1)
        offset = hf.get("index_skip_topk_offset", 2)
        kinds = [
            "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)
        ]
    kinds = tuple(kinds)
    return None if kinds == ("full",) * num_layers else kinds


def config_to_hf(cfg: DeepseekV32Config) -> dict:
    out = deepseek.config_to_hf(cfg)
    del out["rope_interleave"]  # not a setting of these models: always interleaved
    out.update(
        model_type=cfg.model_type,
        architectures=[cfg.architecture],
        mlp_layer_types=list(cfg.mlp_layer_types),
        index_topk=cfg.index_topk,
        index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
    )
    if isinstance(cfg, GlmMoeDsaConfig):
        out["indexer_types"] = list(cfg.layer_indexers)
    return out


def hf_tensors(cfg: DeepseekV32Config) -> list[HFTensor]:
    """DeepSeek-V3's table (`deepseek.hf_tensors`), each full layer's indexer and the MTP
    layers' (`mtp_hf.tables`, each block with its indexer)."""
    full = [kind == "full" for kind in cfg.layer_indexers]
    if all(full):  # one record a tensor for all layers (scanned or not)
        scopes = [("layers_{i}", "model.layers.{i}", cfg.num_layers)]
    else:
        scopes = [(f"layers_{i}", f"model.layers.{i}", 0) for i, f in enumerate(full) if f]
    trunk = dataclasses.replace(cfg, num_mtp_layers=0, mtp_loss_weight=0.0)
    table = deepseek.hf_tensors(trunk) + mtp_hf.tables(cfg, hf_tensors)
    for scope, prefix, n in scopes:
        ours, theirs = f"{scope}/self_attn/indexer", f"{prefix}.self_attn.indexer"
        table += [
            linear(f"{ours}/{p}/kernel", f"{theirs}.{p}.weight", layers=n)
            for p in ("wq_b", "wk", "weights_proj")
        ]
        table += [
            HFTensor(f"{ours}/k_norm/{p}", f"{theirs}.k_norm.{hf}", layers=n)
            for p, hf in (("scale", "weight"), ("bias", "bias"))
        ]
    return table


def hf_spec(model_type: str) -> HFSpec:
    """How `model_type`'s files are read and written."""
    return HFSpec(
        model_types=(model_type,),
        config_cls=CONFIGS[model_type],
        model_cls=DecoderOnlyModel,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=hf_tensors,
        ignore=deepseek.HF_SPEC.ignore,
        base_model_prefix="model",
        tied_head=deepseek.HF_SPEC.tied_head,
        skip=(rf"^model\.layers\.{MTP_LAYER[model_type]}\.",),
        config_fields=lambda cfg: mtp_hf.spec_fields(cfg, deepseek.HF_SPEC.ignore),
    )


HF_SPEC = register_hf(hf_spec("deepseek_v32"))
GLM5_HF_SPEC = register_hf(hf_spec("glm_moe_dsa"))
