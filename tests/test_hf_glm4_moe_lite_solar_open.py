"""GLM-4.7-Flash (`glm4_moe_lite`) and Solar Open (`solar_open`) from and to HuggingFace:
every promise of `check_family` on two configs of each, greedy decoding through the serving
engine's paged cache, the Hub's MTP layer skipped, refused settings, the gin sizes.

Tiny random models of transformers' `Glm4MoeLiteForCausalLM` and `SolarOpenForCausalLM` with
their norms, biases and correction biases perturbed (HF starts them at 1 and 0).
GLM-4.7-Flash: `LITE` a dense layer between two MoE ones (`mlp_layer_types`), a query latent,
interleaved rotary under YaRN with mscale_all_dim, attention biases, group-limited routing;
`LITE_PLAIN` queries straight from the input (`q_lora_rank` None), half-split rotary, a tied
head, unnormalised routing weights, two shared experts and a `first_k_dense_replace` that HF
ignores (the first layer alone dense). Solar Open: `SOLAR` heads of 12 features (not the
width's 8), q/k/v biases, group-limited routing, YaRN; `SOLAR_PLAIN` one key/value head, a
tied head, two shared experts, unnormalised routing weights and GLM-4.5 keys HF ignores.
"""

import os
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from flaxlm.checkpoints import hf, peft_experts
from flaxlm.models import glm4_moe_lite, solar_open
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.parallel.partitioning import Partitioner
from tests.hf_helpers import (
    LIGHT,
    check_family,
    engine_greedy,
    gin_config,
    hf_greedy_batch,
    random_hf_model,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 120
GREEDY_TOKENS = 8
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_experts_per_tok=2,
    n_routed_experts=8,
    moe_intermediate_size=16,
    max_position_embeddings=96,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF's min_new_tokens would otherwise forbid one
)
# Past the original 32 positions: YaRN's frequencies and (MLA) its softmax scale.
YARN = dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=32)
LITE = dict(
    COMMON,
    num_hidden_layers=3,
    num_key_value_heads=4,
    intermediate_size=48,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    mlp_layer_types=["sparse", "dense", "sparse"],
    n_group=4,
    topk_group=2,
    attention_bias=True,
    rope_parameters=dict(YARN, rope_theta=10000.0, mscale=1.0, mscale_all_dim=0.8),
)
LITE_PLAIN = dict(
    COMMON,
    num_hidden_layers=2,
    num_key_value_heads=4,
    intermediate_size=40,
    q_lora_rank=None,
    kv_lora_rank=12,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
    rope_interleave=False,
    tie_word_embeddings=True,
    norm_topk_prob=False,
    routed_scaling_factor=2.5,
    n_shared_experts=2,
    first_k_dense_replace=2,  # not a key of HF's model: the first layer alone is dense
)
SOLAR = dict(
    COMMON,
    num_hidden_layers=2,
    num_key_value_heads=2,
    head_dim=12,
    attention_bias=True,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    rope_parameters=dict(YARN, rope_theta=1e6),
)
SOLAR_PLAIN = dict(
    COMMON,
    num_hidden_layers=2,
    num_key_value_heads=1,
    head_dim=8,
    tie_word_embeddings=True,
    norm_topk_prob=False,
    n_shared_experts=2,
    # GLM-4.5's keys that SolarOpenConfig drops and its model ignores.
    intermediate_size=48,
    first_k_dense_replace=1,
    use_qk_norm=True,
)
CONFIGS = {"lite": LITE, "lite_plain": LITE_PLAIN, "solar": SOLAR, "solar_plain": SOLAR_PLAIN}
CLASSES = {
    "lite": (transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM),
    "solar": (transformers.SolarOpenConfig, transformers.SolarOpenForCausalLM),
}
ONE = Partitioner(devices=jax.devices()[:1])


def tiny_hf(name: str):
    """A random tiny HF model of config `name`, its norms, biases and correction biases
    perturbed; the correction bias at the scale of the sigmoid scores, so it moves choices."""
    config_cls, model_cls = CLASSES[name.split("_")[0]]
    perturb = ("norm.weight", "layernorm.weight", ".bias")
    model = random_hf_model(config_cls, model_cls, perturb, **CONFIGS[name])
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`name -> (torch model, its save_pretrained directory)`, each built once."""
    built = {}

    def get(name):
        if name not in built:
            torch_model = tiny_hf(name)
            path = tmp_path_factory.mktemp(name)
            torch_model.save_pretrained(str(path))
            built[name] = (torch_model, path)
        return built[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_keeps_every_promise(saved, name, tmp_path):
    """HF's logits (each attention implementation and mesh on the first config of each
    family, the second mesh alone on the other: `LIGHT`), greedy tokens and reloaded export;
    the settings read as HF reads them."""
    torch_model, path = saved(name)
    check_family(torch_model, path, VOCAB, tmp_path=tmp_path, **(LIGHT if "_" in name else {}))
    config = hf.config_from_hf_dict(torch_model.config.to_dict())[1]
    exported = transformers.AutoConfig.from_pretrained(str(tmp_path / "export")).to_dict()
    if name.startswith("lite"):
        kinds = torch_model.config.mlp_layer_types
        assert list(config.mlp_layer_types) == kinds == exported["mlp_layer_types"]
        assert config.q_lora_rank == torch_model.config.q_lora_rank
        assert config.rope_interleave == torch_model.config.rope_interleave
    else:
        assert config.dim_per_head == config.rotary_dim == torch_model.config.head_dim
        assert "intermediate_size" not in exported and "use_qk_norm" not in exported
    assert config.tie_word_embeddings == torch_model.config.tie_word_embeddings


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lite", "solar"])
def test_greedy_through_the_engines_paged_cache_is_hf_generate(saved, name):
    """The serving engine's pages (GLM-4.7-Flash's latent cache past YaRN's original
    context; Solar Open's grouped keys and values): HF `generate`'s tokens."""
    torch_model, path = saved(name)
    model, params = hf.from_pretrained(str(path), ONE)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (11, 4, 29)]
    assert model.paged_refusal() is None
    expected = hf_greedy_batch(torch_model, prompts, GREEDY_TOKENS)
    assert engine_greedy(model, params, prompts, GREEDY_TOKENS) == expected


def test_the_hubs_mtp_layer_is_skipped_and_other_extra_layers_refused(saved, tmp_path):
    """GLM-4.7-Flash's files carry its multi-token-prediction layer as `model.layers.47`:
    skipped, as transformers skips it; a layer past `num_layers` that is no such thing is
    refused."""
    _, path = saved("lite_plain")
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    mtp = {
        f"model.layers.47.{name}": torch.zeros(4, 4)
        for name in ("eh_proj.weight", "enorm.weight", "self_attn.kv_b_proj.weight")
    }
    for extra, refused in ((mtp, False), ({"model.layers.2.x": torch.zeros(4)}, True)):
        save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"))
        if refused:
            with pytest.raises(ValueError, match="model.layers.2.x"):
                hf.from_pretrained(str(tmp_path), ONE)
        else:
            model, _ = hf.from_pretrained(str(tmp_path), ONE)
            assert isinstance(model.config, glm4_moe_lite.Glm4MoeLiteConfig)


LITE_BASE = dict(num_layers=3, num_experts=8, num_experts_per_tok=2)
SOLAR_BASE = dict(num_experts=8, num_experts_per_tok=2)


@pytest.mark.parametrize(
    "config_cls, kwargs, field",
    [
        (glm4_moe_lite.Glm4MoeLiteConfig, dict(LITE_BASE, num_mtp_layers=1), "num_mtp_layers"),
        (glm4_moe_lite.Glm4MoeLiteConfig, dict(LITE_BASE, mlp_only_layers=(3,)), "mlp_only"),
        (glm4_moe_lite.Glm4MoeLiteConfig, dict(LITE_BASE, decoder_sparse_step=2), "decoder_"),
        (glm4_moe_lite.Glm4MoeLiteConfig, dict(LITE_BASE, n_shared_experts=0), "n_shared"),
        (glm4_moe_lite.Glm4MoeLiteConfig, dict(LITE_BASE, n_group=8), "n_group"),
        (glm4_moe_lite.Glm4MoeLiteConfig, dict(LITE_BASE, router="softmax_topk"), "router"),
        (glm4_moe_lite.Glm4MoeLiteConfig, dict(LITE_BASE, qk_rope_head_dim=7), "qk_rope"),
        (solar_open.SolarOpenConfig, dict(SOLAR_BASE, mlp_only_layers=(0,)), "mlp_only_layers"),
        (solar_open.SolarOpenConfig, dict(SOLAR_BASE, n_shared_experts=0), "n_shared_experts"),
        (solar_open.SolarOpenConfig, dict(SOLAR_BASE, n_group=8), "n_group"),
        (solar_open.SolarOpenConfig, dict(SOLAR_BASE, num_kv_heads=5), "num_kv_heads"),
        (solar_open.SolarOpenConfig, dict(SOLAR_BASE, head_dim=7), "head_dim"),
        (solar_open.SolarOpenConfig, dict(SOLAR_BASE, expert_bias=True), "expert_bias"),
    ],
    ids=str,
)
def test_settings_that_cannot_be_are_errors_naming_them(config_cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        config_cls(**kwargs)


@pytest.mark.parametrize(
    "name, change, field",
    [
        # HF's rotary tables narrow but its attention rotates every rotary feature: fails.
        (
            "lite",
            dict(rope_parameters=dict(rope_type="default", partial_rotary_factor=0.5)),
            "partial_rotary_factor",
        ),
        ("lite", dict(partial_rotary_factor=0.5, rope_parameters=None), "partial_rotary_factor"),
        ("lite", dict(num_key_value_heads=2), "num_key_value_heads"),
        ("lite", dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types"),
        ("lite", dict(n_group=3, topk_group=1), "n_group"),
        ("lite", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)), "dynamic"),
        ("lite", dict(quantization_config={"quant_method": "gptq"}), "quant_method"),
        ("solar", dict(partial_rotary_factor=0.5, rope_parameters=None), "partial_rotary_factor"),
        ("solar", dict(n_shared_experts=0), "n_shared_experts"),
        ("solar", dict(num_key_value_heads=3), "num_kv_heads"),
        ("solar", dict(head_dim=None), "head_dim"),
        ("solar", dict(quantization_config={"quant_method": "awq"}), "quant_method"),
    ],
    ids=str,
)
def test_configs_flaxlm_cannot_read_are_refused_naming_the_field(name, change, field):
    read = {"lite": glm4_moe_lite.config_from_hf, "solar": solar_open.config_from_hf}[name]
    config = {**CLASSES[name][0](**CONFIGS[name]).to_dict(), **change}
    with pytest.raises(ValueError, match=field):
        read(config)


def test_config_json_defaults_and_aliases_read_as_transformers_reads_them():
    """Keys a config.json omits take transformers' defaults (Solar Open's rope_theta 1e6 and
    head_dim 128, GLM-4.7-Flash's dense first layer whatever `first_k_dense_replace` says);
    the names its attribute_map reads (`num_local_experts`, GLM's `head_dim`) count."""
    lite = glm4_moe_lite.config_from_hf(
        {"model_type": "glm4_moe_lite", "first_k_dense_replace": 3, "num_local_experts": 16}
    )
    theirs = transformers.Glm4MoeLiteConfig(first_k_dense_replace=3, num_local_experts=16)
    assert list(lite.mlp_layer_types) == theirs.mlp_layer_types
    assert lite.num_experts == theirs.n_routed_experts == 16
    assert lite.rope_theta == theirs.rope_parameters["rope_theta"]
    assert glm4_moe_lite.config_from_hf({"head_dim": 32}).qk_rope_head_dim == 32
    solar = solar_open.config_from_hf({"model_type": "solar_open", "hidden_size": 2048})
    theirs = transformers.SolarOpenConfig(hidden_size=2048)
    assert solar.rope_theta == theirs.rope_parameters["rope_theta"] == 1e6
    assert solar.dim_per_head == theirs.head_dim == 128


@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "solar_open"])
def test_lora_on_dense_or_shared_mlps_is_refused_as_a_peft_adapter(model_type):
    """PEFT reads `gate_proj` / `up_proj` / `down_proj` targets of these model types
    (transformers converts them as Qwen2-MoE's) as the fused experts' parameters: a dense
    layer's or shared expert's adapter would load onto the experts."""
    with pytest.raises(ValueError, match="experts"):
        peft_experts.check_modules(model_type, ["model.layers.0.mlp.shared_experts.up_proj"])


# Published sizes (model cards), in billions: (config class, all params, active params, how
# many vocabulary tables the active count leaves out). GLM-4.7-Flash's "30B-A3B": 29.9B, and
# 3.3B active outside the embedding and the head (3.6B with the head); Solar-Open-100B's
# 102.6B and 12B active (12.05B counted with both tables).
PUBLISHED = {
    "glm4_7_flash": (glm4_moe_lite.Glm4MoeLiteConfig, 30.0, 3.0, 2),
    "solar_open_100b": (solar_open.SolarOpenConfig, 102.6, 12.0, 0),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_gin_sizes_are_transformers_and_the_model_cards(name):
    """The published gin file's params, counted: transformers' model of its config
    (`config_to_hf`, built on the meta device; the correction biases are its buffers) and
    the model card's rounded figures."""
    config_cls, total, active, tables = PUBLISHED[name]
    cfg = gin_config(REPO, name, config_cls)
    spec = hf.spec_for_config(cfg)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**spec.config_to_hf(cfg))
        )
    counted = sum(p.numel() for p in theirs.parameters())
    counted += sum(b.numel() for k, b in theirs.named_buffers() if "e_score_correction" in k)
    assert cfg.num_params() == counted
    assert abs(cfg.num_params() / 1e9 - total) / total < 0.01, cfg.num_params()
    matmul = cfg.active_params() - tables * cfg.vocab_size * cfg.hidden_size
    # The cards round the active count ("A3B").
    assert abs(matmul / 1e9 - active) / active < 0.1, matmul
    lookup = cfg.vocab_size * cfg.hidden_size
    assert cfg.flops_per_token(4096) > 6 * (cfg.active_params() - lookup)


@pytest.mark.parametrize(
    "name, config_cls",
    [
        ("glm4_moe_lite_tiny", glm4_moe_lite.Glm4MoeLiteConfig),
        ("solar_open_tiny", solar_open.SolarOpenConfig),
    ],
)
def test_tiny_gin_models_count_their_params(name, config_cls):
    model = DecoderOnlyModel(gin_config(REPO, name, config_cls))
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    assert sum(x.size for x in jax.tree.leaves(shapes)) == model.config.num_params()
