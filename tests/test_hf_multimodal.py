"""The Hub's multimodal files of families flaxlm reads as text models: a tiny
`Llama4ForConditionalGeneration` (how the Hub ships Llama 4 Scout and Maverick),
`Mistral3ForConditionalGeneration`s (Mistral Small 3.1 / 3.2 with a `mistral` text tower,
Mistral Small 4 with a `mistral4` one, Ministral 3 with a `ministral3` one) and Qwen3-VL's
dense and MoE files, built by transformers and saved by its `save_pretrained`: the text tower
loads, its logits and greedy tokens are the multimodal model's own on text, the vision tower
is skipped with a note, and the export is the text model, which transformers reloads to the
same logits."""

import json

import jax
import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from flaxlm.checkpoints import hf
from flaxlm.models import (
    deepseek,
    glm4,
    glm4_moe,
    hf_spec,
    llama,
    llama4,
    ministral3,
    mistral4,
    qwen,
    qwen_moe,
)
from flaxlm.parallel.partitioning import Partitioner
from tests.hf_helpers import (
    decoder_batch,
    flaxlm_greedy_batch,
    hf_greedy_batch,
    max_abs_diff,
    padded_batch,
    save_byte_bpe_tokenizer,
    torch_logits,
)
from tests.test_hf_compressed import KIMI as KIMI_TEXT
from tests.test_hf_ministral3 import FULL as MINISTRAL3_TEXT
from tests.test_hf_mistral4 import FULL as MISTRAL4_TEXT
from tests.test_hf_runs import finetune_hf
from tests.test_main import read_metrics

VOCAB = 120
# float32 logits of 2-layer models whose values are O(1): other summation orders round
# at ~eps x sqrt(width) x depth ~ 1e-6; 1e-4 is what every family meets.
LOGITS_TOL = 1e-4
# The smallest vision towers transformers builds (the text tower is what flaxlm reads).
TOWER = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
# The Qwen-VL and GLM-V towers' spelling of it, their output the text tower's width.
DEPTH_TOWER = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
VISION = {
    "llama4": dict(
        TOWER,
        image_size=28,
        patch_size=14,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
    ),
    "mistral3": dict(TOWER, model_type="pixtral", image_size=28, patch_size=14, head_dim=8),
    "glm4v": dict(DEPTH_TOWER, image_size=28, patch_size=14),
    "internvl": dict(TOWER, image_size=[28, 28], patch_size=[14, 14]),
    "llava": dict(TOWER, model_type="clip_vision_model", image_size=28, patch_size=14),
    "llava_onevision": dict(TOWER, model_type="siglip_vision_model", image_size=28, patch_size=14),
    "kimi": dict(TOWER, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2),
    "qwen2": dict(DEPTH_TOWER, fullatt_block_indexes=[0]),
    "qwen3": dict(DEPTH_TOWER, num_position_embeddings=16, deepstack_visual_indexes=[0]),
}
LLAMA4_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=16,
    intermediate_size_mlp=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=2,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    attention_chunk_size=8,
    max_position_embeddings=96,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF's min_new_tokens would otherwise forbid one
)
MISTRAL_TEXT = dict(
    model_type="mistral",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=2,
    sliding_window=None,
    max_position_embeddings=96,
    initializer_range=0.1,
)
# Qwen3-VL's text tower: Qwen3's, its rotary an interleaved MRoPE of 2 + 1 + 1 frequencies.
QWEN3_VL_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=2,
    max_position_embeddings=96,
    initializer_range=0.1,
    rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1], mrope_interleaved=True
    ),
)
# Qwen2.5-VL's: a Qwen2 (q/k/v biases), its MRoPE of 2 + 1 + 1 frequencies in sections.
QWEN2_5_VL_TEXT = dict(
    {k: v for k, v in QWEN3_VL_TEXT.items() if k != "head_dim"},
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]),
    bos_token_id=None,
    eos_token_id=None,
)
# GLM-4.5V's: a GLM-4.5 (half its head rotated, q/k/v biases, no q/k norms), its first layer
# dense, a shared expert beside 4 routed ones.
GLM4V_MOE_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    max_position_embeddings=96,
    initializer_range=0.1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 1, 1]
    ),
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
# GLM-4.1V's: a GLM-4 (q/k/v biases, GLM-4's output norms), half its heads rotated.
GLM4V_TEXT = dict(
    {k: v for k, v in QWEN3_VL_TEXT.items() if k != "head_dim"},
    rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[1, 1, 0]
    ),
)
# Qwen3-VL-MoE's: a Qwen3-MoE, its first layer dense, its experts stored fused and transposed.
QWEN3_VL_MOE_TEXT = dict(
    QWEN3_VL_TEXT,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=8,  # 2 x 8 != 32: the stored layout's axes tell apart
    mlp_only_layers=[0],
)
# name: (outer config class, model class, its text config, outer fields, flaxlm's config)
FILES = {
    "llama4": (
        transformers.Llama4Config,
        transformers.Llama4ForConditionalGeneration,
        LLAMA4_TEXT,
        {},
        llama4.Llama4Config,
    ),
    # Tied by the outer config's default (the head is the outer model's): no head stored.
    "mistral3": (
        transformers.Mistral3Config,
        transformers.Mistral3ForConditionalGeneration,
        MISTRAL_TEXT,
        {},
        llama.LlamaConfig,
    ),
    # Mistral Small 4's file: untied, its text tower a `mistral4`.
    "mistral3_mistral4": (
        transformers.Mistral3Config,
        transformers.Mistral3ForConditionalGeneration,
        {**MISTRAL4_TEXT, "model_type": "mistral4"},
        {"tie_word_embeddings": False},
        mistral4.Mistral4Config,
    ),
    # Ministral 3's file: its text tower a `ministral3`, tied (the 3B's).
    "mistral3_ministral3": (
        transformers.Mistral3Config,
        transformers.Mistral3ForConditionalGeneration,
        {**MINISTRAL3_TEXT, "model_type": "ministral3"},
        {},
        ministral3.Ministral3Config,
    ),
    # GLM-4.1V's / GLM-4.6V-Flash's file: `model.language_model.`, `model.visual.`.
    "glm4v": (
        transformers.Glm4vConfig,
        transformers.Glm4vForConditionalGeneration,
        GLM4V_TEXT,
        {},
        glm4.Glm4Config,
    ),
    # GLM-4.5V's / 4.6V's file: `model.language_model.`, `model.visual.`, its own head.
    "glm4v_moe": (
        transformers.Glm4vMoeConfig,
        transformers.Glm4vMoeForConditionalGeneration,
        GLM4V_MOE_TEXT,
        {},
        glm4_moe.Glm4MoeConfig,
    ),
    # InternVL 3.5's file (InternVL3's alike, with a Qwen2 tower): a Qwen3 text tower in
    # llava's layout, tied by the outer default.
    "internvl": (
        transformers.InternVLConfig,
        transformers.InternVLForConditionalGeneration,
        {**QWEN3_VL_TEXT, "model_type": "qwen3", "rope_parameters": None},
        {},
        qwen.QwenConfig,
    ),
    # LLaVA-1.5's file: a Llama tower in llava's layout, untied.
    "llava": (
        transformers.LlavaConfig,
        transformers.LlavaForConditionalGeneration,
        {k: v for k, v in MISTRAL_TEXT.items() if k != "sliding_window"} | {"model_type": "llama"},
        {},
        llama.LlamaConfig,
    ),
    # LLaVA-OneVision's file: a Qwen2 tower in LLaVA-NeXT's layout (`image_newline` beside).
    "llava_onevision": (
        transformers.LlavaOnevisionConfig,
        transformers.LlavaOnevisionForConditionalGeneration,
        {**QWEN2_5_VL_TEXT, "model_type": "qwen2", "rope_parameters": None},
        {},
        qwen.QwenConfig,
    ),
    # Kimi K2.5's file: a Kimi K2 text tower (its latent attention and experts as
    # test_hf_compressed's), untied; transformers saves its layers as `blocks`.
    "kimi_k25": (
        transformers.Kimi_K25Config,
        transformers.Kimi_K25ForConditionalGeneration,
        {**KIMI_TEXT, "model_type": "kimi_k2", "bos_token_id": None, "eos_token_id": None},
        {"tie_word_embeddings": False, "projection_hidden_size": 16},
        deepseek.DeepseekV3Config,
    ),
    # Qwen2.5-VL's file (3B to 72B; Qwen2-VL's alike): `model.`, `visual.`, its own head.
    "qwen2_5_vl": (
        transformers.Qwen2_5_VLConfig,
        transformers.Qwen2_5_VLForConditionalGeneration,
        QWEN2_5_VL_TEXT,
        {},
        qwen.QwenConfig,
    ),
    # Qwen3-VL's file (2B to 32B): `model.language_model.`, `model.visual.`, its own head.
    "qwen3_vl": (
        transformers.Qwen3VLConfig,
        transformers.Qwen3VLForConditionalGeneration,
        QWEN3_VL_TEXT,
        {},
        qwen.QwenConfig,
    ),
    # Qwen3-VL-MoE's file (30B-A3B, 235B-A22B): as Qwen3-VL's, its experts fused.
    "qwen3_vl_moe": (
        transformers.Qwen3VLMoeConfig,
        transformers.Qwen3VLMoeForConditionalGeneration,
        QWEN3_VL_MOE_TEXT,
        {},
        qwen_moe.Qwen3VLMoeTextConfig,
    ),
}
# The files whose greedy tokens and export are checked too: the type each exports as.
EXPORTS = {
    "glm4v": "glm4",
    "glm4v_moe": "glm4_moe",
    "internvl": "qwen3",
    "kimi_k25": "deepseek_v3",
    "llama4": "llama4_text",
    "qwen2_5_vl": "qwen2",
    "qwen3_vl": "qwen3",
    "qwen3_vl_moe": "qwen3_moe",
}


def saved_file(name, path, **text_changes):
    """A seeded random multimodal model of `FILES[name]` (norms perturbed), saved."""
    import torch

    config_cls, model_cls, text, outer, _ = FILES[name]
    text = {**text, **text_changes}
    vision = VISION.get(name, VISION.get(name.split("_")[0]))
    torch.manual_seed(0)
    config = config_cls(text_config=text, vision_config=vision, **outer)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch_model = model_cls(config).eval()
    with torch.no_grad():
        for param_name, p in torch_model.named_parameters():
            if param_name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    torch_model.save_pretrained(str(path))
    return torch_model


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FILES))
def test_the_text_tower_of_a_multimodal_file_loads_with_its_logits(name, tmp_path, capsys):
    torch_model = saved_file(name, tmp_path / "hub")
    stored = load_file(str(tmp_path / "hub" / "model.safetensors"))
    text = ("language_model.", "model.language_model.", "model.layers.")  # the Hub's spellings
    assert any(k.startswith(text) for k in stored)
    model, params = hf.from_pretrained(tmp_path / "hub")
    assert type(model.config) is FILES[name][4]
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    ours = np.asarray(jax.jit(model.compute_logits)(params, decoder_batch(ids, mask)))
    assert max_abs_diff(ours, theirs, mask) < LOGITS_TOL
    assert "tensors the model does not use" in capsys.readouterr().out  # the vision tower's

    if name == "mistral3":
        # As transformers holds the model (`model.language_model.`, `model.vision_tower.`):
        # the same params.
        held = {held_name(k): v for k, v in stored.items()}
        (tmp_path / "held").mkdir()
        save_file(held, str(tmp_path / "held" / "model.safetensors"), metadata={"format": "pt"})
        config = (tmp_path / "hub" / "config.json").read_text()
        (tmp_path / "held" / "config.json").write_text(config)
        _, again = hf.from_pretrained(tmp_path / "held")
        assert jax.tree.all(jax.tree.map(np.array_equal, again, params))
    if name == "qwen2_5_vl":
        # The Hub's flat config.json (the text fields at its top level, 'mrope' rope type, the
        # tying in them) with the names as transformers holds the model: the same params.
        flat = json.loads((tmp_path / "hub" / "config.json").read_text())
        flat.update(flat.pop("text_config"), model_type="qwen2_5_vl")
        flat["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 1, 1]}
        flat.update(rope_theta=10000.0, rope_parameters=None)
        held = {k.replace("model.", "model.language_model.", 1): v for k, v in stored.items()}
        (tmp_path / "flat").mkdir()
        save_file(held, str(tmp_path / "flat" / "model.safetensors"), metadata={"format": "pt"})
        (tmp_path / "flat" / "config.json").write_text(json.dumps(flat))
        flat_model, again = hf.from_pretrained(tmp_path / "flat")
        assert flat_model.config == model.config
        assert jax.tree.all(jax.tree.map(np.array_equal, again, params))
    if name == "qwen3_vl_moe":
        # The Hub's files store the fused experts transposed (transformers 5 writes them as
        # it holds them): the same params either way.
        hub = {
            k: np.ascontiguousarray(v.swapaxes(1, 2)) if ".experts." in k else v
            for k, v in stored.items()
        }
        assert hub["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 32, 16)
        (tmp_path / "hub_layout").mkdir()
        save_file(
            hub, str(tmp_path / "hub_layout" / "model.safetensors"), metadata={"format": "pt"}
        )
        config = (tmp_path / "hub" / "config.json").read_text()
        (tmp_path / "hub_layout" / "config.json").write_text(config)
        # transformers reads that layout (its conversion mapping transposes it) to the same
        # model, and so does flaxlm: each device the experts its shard holds (2 of the 4).
        hub_model = FILES[name][1].from_pretrained(str(tmp_path / "hub_layout")).eval()
        hub_logits = torch_logits(hub_model, input_ids=ids, attention_mask=mask)
        # (its default attention here, not the eager one: summed in another order)
        assert max_abs_diff(hub_logits, theirs, mask) <= 1e-5 * max(1.0, np.abs(theirs).max())
        mesh = Partitioner((1, 2, 2, 2), ("data", "fsdp", "expert", "tensor"))
        _, again = hf.from_pretrained(tmp_path / "hub_layout", mesh)
        assert jax.tree.all(jax.tree.map(np.array_equal, again, params))
    if name in EXPORTS:
        rng = np.random.default_rng(3)
        prompts = [rng.integers(1, VOCAB, n).tolist() for n in (11, 4, 17)]
        # Llama 4's causal text model; Qwen3-VL's whole model (it has no text-only one).
        reference = torch_model.language_model if name == "llama4" else torch_model
        assert flaxlm_greedy_batch(model, params, prompts) == hf_greedy_batch(reference, prompts)

        hf.save_pretrained(model, params, tmp_path / "export")
        exported = json.loads((tmp_path / "export" / "config.json").read_text())
        assert exported["model_type"] == EXPORTS[name]
        reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "export"), output_loading_info=True
        )
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
        assert max_abs_diff(ours, again, mask) <= 1e-5 * max(1.0, np.abs(again).max())


def held_name(stored: str) -> str:
    """A Mistral 3 file's tensor name as transformers holds it in memory."""
    if stored.startswith("language_model.model."):
        return stored.replace("language_model.model.", "model.language_model.", 1)
    if stored.startswith("language_model."):  # the LM head
        return stored.removeprefix("language_model.")
    return f"model.{stored}"  # the vision tower and projector


def test_a_multimodal_config_reads_as_its_text_tower():
    """The outer config's tying (where its model holds the head), quantization config and
    special ids reach the text tower's; an unknown file names the multimodal ones, and a
    text tower flaxlm does not know is named with its file's type."""
    text = {k: v for k, v in MISTRAL_TEXT.items() if k != "model_type"}  # the default's
    outer = {"model_type": "mistral3", "text_config": {**text, "tie_word_embeddings": False}}
    _, config = hf.config_from_hf_dict(outer)
    assert type(config) is llama.LlamaConfig and config.tie_word_embeddings  # Mistral 3's default
    outer.update(eos_token_id=2, quantization_config={"quant_method": "gptq"})
    text = hf_spec.text_tower(outer)
    assert text["model_type"] == "mistral" and text["eos_token_id"] == 2
    assert text["quantization_config"] == {"quant_method": "gptq"}
    with pytest.raises(ValueError, match="'llama4'"):
        hf.spec_for_model_type("llava_next")
    # Qwen2-VL / 2.5-VL: a pre-v5 save's tying in its text config ties (transformers' rule);
    # Qwen3-VL's head is the outer config's to tie alone.
    for kind, tied in (("qwen2_5_vl", True), ("qwen2_vl", True), ("qwen3_vl", False)):
        text = {**QWEN2_5_VL_TEXT, "tie_word_embeddings": True}
        _, config = hf.config_from_hf_dict({"model_type": kind, "text_config": text})
        assert config.tie_word_embeddings is tied, kind
    # LLaVA-1.5's config forwards its text config's tying, LLaVA-NeXT's does not.
    for kind in ("llava", "llava_next"):
        tied_text = {"model_type": kind, "text_config": {**MISTRAL_TEXT}}
        tied_text["text_config"]["tie_word_embeddings"] = True
        theirs = transformers.AutoConfig.for_model(**tied_text).tie_word_embeddings
        _, config = hf.config_from_hf_dict(tied_text)
        assert config.tie_word_embeddings is theirs is (kind == "llava"), kind
    outer["text_config"]["model_type"] = "ministral"  # Ministral 8B (2024): not read
    with pytest.raises(ValueError, match="a 'mistral3' file whose text_config has model_type 'mi"):
        hf.config_from_hf_dict(outer)


@pytest.mark.slow
def test_finetune_hf_gin_trains_the_text_tower_of_a_multimodal_file(tmp_path, repo_dir):
    """gin/finetune_hf.gin from a Llama 4 file as the Hub ships it (`INIT_FROM_HF`, with its
    own tokenizer): the run trains the text tower, its record is the text model's, and it
    stops at the text config's EOS (the outer config names none)."""
    source = tmp_path / "hub"
    length = save_byte_bpe_tokenizer(source, style="llama3")
    bos, eos = length - 3, length - 2  # <|begin_of_text|>, <|end_of_text|>
    saved_file("llama4", source, vocab_size=length, bos_token_id=bos, eos_token_id=eos)
    assert "eos_token_id" not in json.loads((source / "config.json").read_text())
    model_dir = tmp_path / "run"
    result = finetune_hf(source, model_dir, repo_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((model_dir / "model_record.json").read_text())
    assert record["model_type"] == "llama4_text" and record["flaxlm_eos_ids"] == [eos]
    assert [r["step"] for r in read_metrics(str(model_dir)) if "loss" in r] == [1, 2]


@pytest.mark.slow
def test_peft_adapters_over_a_multimodal_file_serve_with_peft_logits(tmp_path, capsys):
    """PEFT's LoRA over a Llama 4 file as the Hub ships it (random A and B on every q, v and
    o projection, the vision tower's too, its text modules named as the outer model holds
    them: `language_model.model.layers...`): flaxlm serves the text tower with PEFT's logits
    and skips the vision tower's adapters with a note; exported over that base, the adapters
    are named so again, and PEFT loads them to the same logits."""
    import copy

    import peft
    import torch

    from flaxlm.checkpoints import peft_dir, run_dir
    from flaxlm.parallel.partitioning import Partitioner

    torch_model = saved_file("llama4", tmp_path / "hub")
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    adapted = peft.get_peft_model(copy.deepcopy(torch_model), config).eval()
    adapted.save_pretrained(str(tmp_path / "adapter"))
    keys = list(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    assert any(".language_model.model.layers.1.self_attn.q_proj." in k for k in keys)
    assert any(".vision_model." in k for k in keys)
    record = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    record["base_model_name_or_path"] = str(tmp_path / "hub")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(record))

    model, params, _, _ = run_dir.load_model_and_params(
        str(tmp_path / "adapter"), Partitioner(mesh_shape=(1, 4, 2))
    )
    ids, mask = padded_batch(VOCAB, (24, 13, 24, 6))
    theirs = torch_logits(adapted, input_ids=ids, attention_mask=mask)
    base = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(base, theirs, mask) > 1e-2  # the adapters matter
    ours = np.asarray(jax.jit(model.compute_logits)(params, decoder_batch(ids, mask)))
    assert max_abs_diff(ours, theirs, mask) < LOGITS_TOL
    assert "LoRA tensors of modules it lacks: base_model.model.vision_model." in (
        capsys.readouterr().out
    )

    # Exported again over the same base: named as the outer model holds the text tower, so
    # that PEFT loads every tensor onto the multimodal model, with the same logits.
    cfg, adapters = peft_dir.load_adapters(model, tmp_path / "adapter")
    peft_dir.save_adapters(
        model, adapters, cfg, tmp_path / "again", base_model_name_or_path=str(tmp_path / "hub")
    )
    again = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), tmp_path / "again")
    saved = set(peft.utils.load_peft_weights(str(tmp_path / "again")))
    loaded = {k.replace(".default", "") for k in peft.get_peft_model_state_dict(again)}
    assert saved and saved <= loaded and all(".language_model.model." in k for k in saved)
    exported = torch_logits(again.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(exported, theirs, mask) < LOGITS_TOL


def test_an_fp8_ministral3_file_reads_its_dequantized_weights(tmp_path):
    """Ministral 3's Instruct files as the Hub ships them: a `mistral3` file whose outer
    config.json says FP8 with static activation scales and one scale a tensor; each Linear
    of the text tower's layers a float8 `weight`, its `weight_scale_inv` and its
    `activation_scale`, the embedding, head and vision tower unquantized. The text model's
    params are the dequantized values, bit for bit."""
    import torch
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    from flaxlm.checkpoints import fp8

    saved_file("mistral3_ministral3", tmp_path / "hub")
    stored = load_torch(str(tmp_path / "hub" / "model.safetensors"))
    quantized, dequantized = dict(stored), {}
    for name, tensor in stored.items():
        if name.startswith("language_model.model.layers.") and tensor.ndim == 2:
            scale = tensor.abs().max() / 448.0  # float8_e4m3fn's largest finite value
            values = (tensor / scale).to(torch.float8_e4m3fn)
            quantized[name], quantized[name + "_scale_inv"] = values, scale.reshape(())
            quantized[fp8.activation_scale_name(name)] = torch.tensor(0.5)
            dequantized[name.removeprefix("language_model.")] = values.float() * scale
    assert "model.layers.1.mlp.down_proj.weight" in dequantized
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    config["quantization_config"] = dict(
        quant_method="fp8",
        activation_scheme="static",
        weight_block_size=None,
        modules_to_not_convert=["model.vision_tower", "model.multi_modal_projector", "lm_head"],
    )
    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    save_torch(quantized, str(tmp_path / "fp8" / "model.safetensors"), metadata={"format": "pt"})
    model, params = hf.from_pretrained(tmp_path / "fp8")
    assert type(model.config) is ministral3.Ministral3Config
    ours = dict(hf.hf_state_dict(model, params))
    for name, theirs in dequantized.items():
        np.testing.assert_array_equal(ours[name], theirs.numpy(), err_msg=name)
