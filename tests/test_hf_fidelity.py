"""Every family against HuggingFace as users get it: checkpoints saved by the pinned
transformers from its own config defaults (plus the variants that used to load wrong),
hand-written v4-era config.json files, and import -> export round trips that keep the
special ids, generation_config.json and the tokenizer, and stop generating where HF does."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from safetensors.torch import save_file

from flaxlm.checkpoints import hf
from flaxlm.inference import generation
from flaxlm.models import base
from tests.hf_helpers import max_abs_diff, padded_batch, torch_logits

VOCAB = 96
PROMPT = [5, 17, 33, 8, 61]
NEW_TOKENS = 8
WORDS = ["<pad>", "<s>", "</s>", "<unk>", *(f"w{i}" for i in range(VOCAB - 4))]
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
SAMPLING = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=33)

# Each family's tiny model: transformers' config defaults but for the sizes.
FAMILIES = {
    "gptj": (
        transformers.GPTJConfig,
        transformers.GPTJForCausalLM,
        dict(n_positions=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4),
    ),
    "gpt2": (
        transformers.GPT2Config,
        transformers.GPT2LMHeadModel,
        dict(n_positions=64, n_embd=32, n_layer=2, n_head=4),
    ),
    "opt": (
        transformers.OPTConfig,
        transformers.OPTForCausalLM,
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        ),
    ),
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ),
    ),
    "gemma": (
        transformers.GemmaConfig,
        transformers.GemmaForCausalLM,
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=64,
        ),
    ),
    "t5": (
        transformers.T5Config,
        transformers.T5ForConditionalGeneration,
        dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
    ),
    "roberta": (
        transformers.RobertaConfig,
        transformers.RobertaForMaskedLM,
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=40,
        ),
    ),
}


def perturbed(torch_model):
    """HF starts biases and norms at 0/1: make every tensor count."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in torch_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return torch_model.eval()


def save_tokenizer(path) -> None:
    """A tiny word-level tokenizer with a chat template, as `save_pretrained` writes it."""
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def torch_inputs(family: str) -> dict[str, np.ndarray]:
    ids, mask = padded_batch(VOCAB, lengths=(9, 5, 9))
    if family == "t5":
        return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, ::-1].copy())
    if family == "roberta":  # keep HF's pad id (1) out of the real tokens, and mark padding
        ids = np.where(ids == 1, 5, ids)
        return dict(input_ids=np.where(mask == 1, ids, 1), attention_mask=mask)
    return dict(input_ids=ids, attention_mask=mask)


def flaxlm_batch(family: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    ids, mask = inputs["input_ids"].astype(np.int32), inputs["attention_mask"].astype(np.int32)
    positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
    if family == "t5":
        targets = inputs["decoder_input_ids"].astype(np.int32)
        return {
            "encoder_input_tokens": ids * mask,
            "decoder_input_tokens": targets,
            "decoder_target_tokens": targets,
            "decoder_loss_weights": np.ones_like(targets),
        }
    prefix = "encoder" if family == "roberta" else "decoder"
    return {
        f"{prefix}_input_tokens": ids,
        f"{prefix}_target_tokens": ids,
        f"{prefix}_loss_weights": mask,
        f"{prefix}_segment_ids": mask,
        f"{prefix}_positions": positions,
    }


def hf_greedy(torch_model, family: str, eos) -> list[int]:
    """HF's greedy continuation of PROMPT (new tokens only), stopping at `eos`."""
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        out = torch_model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=eos,
            pad_token_id=0,
            **({"decoder_start_token_id": 0} if family == "t5" else {}),
        )
    out = out[0].tolist()
    return out[1:] if family == "t5" else out[len(PROMPT) :]  # t5: drop the decoder start


def flaxlm_greedy(model, params) -> list[int]:
    """flaxlm's greedy continuation of PROMPT with the model's own EOS ids, padding cut."""
    batch = {"inputs": np.array([PROMPT], np.int32), "inputs_lengths": np.array([len(PROMPT)])}
    out = generation.generate(model, params, batch, max_new_tokens=NEW_TOKENS)[0].tolist()
    stops = [i for i, t in enumerate(out) if t in model.eos_ids]
    return out[: stops[0] + 1] if stops else out


def stopping_eos(torch_model, family: str) -> list[int]:
    """Two EOS ids, the second one greedy decoding first reaches after a few tokens."""
    free = hf_greedy(torch_model, family, eos=None)
    k = next((i for i in range(2, len(free)) if free[i] not in free[:i]), 0)
    unused = next(t for t in range(VOCAB - 1, 0, -1) if t not in free)
    return [unused, free[k]]


def build_source(tmp_path, family: str, **variant):
    """The HF reference model (special ids, sampling defaults and a tokenizer) saved as
    transformers saves it."""
    config_cls, model_cls, sizes = FAMILIES[family]
    config = config_cls(vocab_size=VOCAB, **sizes, **variant)
    torch_model = perturbed(model_cls(config))
    if family != "roberta":
        eos = stopping_eos(torch_model, family)
        ids = dict(bos_token_id=1, eos_token_id=eos, pad_token_id=0)
        if family == "t5":
            ids = dict(eos_token_id=eos, pad_token_id=0, decoder_start_token_id=0)
        for key, value in ids.items():
            setattr(torch_model.config, key, value)
        torch_model.generation_config = transformers.GenerationConfig(**ids, **SAMPLING)
    path = tmp_path / "source"
    torch_model.save_pretrained(str(path))
    save_tokenizer(path)
    return torch_model, str(path)


def auto_class(family: str):
    name = {"t5": "AutoModelForSeq2SeqLM", "roberta": "AutoModelForMaskedLM"}
    return getattr(transformers, name.get(family, "AutoModelForCausalLM"))


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_export_keeps_logits_special_ids_generation_and_tokenizer(tmp_path, family):
    torch_model, source = build_source(tmp_path, family)
    inputs = torch_inputs(family)
    theirs = torch_logits(torch_model, **inputs)
    model, params = hf.from_pretrained(source)
    ours = np.asarray(jax.jit(model.compute_logits)(params, flaxlm_batch(family, inputs)))
    mask = inputs["attention_mask"] if family != "t5" else np.ones_like(inputs["decoder_input_ids"])
    assert max_abs_diff(ours, theirs, mask) < 1e-4

    out = tmp_path / "export"
    hf.save_pretrained(model, params, out, tokenizer_dir=source)
    reloaded, info = auto_class(family).from_pretrained(str(out), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    again = torch_logits(reloaded.eval(), **inputs)
    assert max_abs_diff(ours, again, mask) <= 1e-5 * np.abs(again).max()

    source_config, export_config = (
        read_json(f"{source}/config.json"),
        read_json(out / "config.json"),
    )
    for key in hf.special_ids(source_config):
        assert export_config[key] == source_config[key], key
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(f"{source}/{name}"):
            with open(f"{source}/{name}") as a, open(out / name) as b:
                assert a.read() == b.read(), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    if family == "roberta":  # masked LM: HF writes no generation config, nor do we
        assert not (out / "generation_config.json").exists()
        return
    assert read_json(out / "generation_config.json") == read_json(
        f"{source}/generation_config.json"
    )
    # Generation stops at the source's (second) EOS id, at the same token in both.
    ours_greedy = flaxlm_greedy(model, params)
    assert ours_greedy[-1] in source_config["eos_token_id"] and len(ours_greedy) < NEW_TOKENS
    assert hf_greedy(reloaded, family, eos=reloaded.generation_config.eos_token_id) == ours_greedy


def test_llama3_style_ids_survive_import_export_import(tmp_path):
    """Llama 3's shape of ids (in a small vocabulary): no pad id, and an EOS list in
    generation_config.json beside config.json's single id."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, **FAMILIES["llama"][2])
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 90, 91, None
    torch_model = perturbed(transformers.LlamaForCausalLM(config))
    torch_model.generation_config = transformers.GenerationConfig(
        bos_token_id=90, eos_token_id=[91, 95], do_sample=True, temperature=0.6, top_p=0.9
    )
    torch_model.save_pretrained(str(tmp_path / "source"))
    model, params = hf.from_pretrained(tmp_path / "source")
    assert model.eos_ids == (91, 95)
    hf.save_pretrained(model, params, tmp_path / "export")
    again, _ = hf.from_pretrained(tmp_path / "export")
    assert again.eos_ids == (91, 95)
    config = read_json(tmp_path / "export/config.json")
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        90,
        91,
        None,
    )
    generation = read_json(tmp_path / "export/generation_config.json")
    assert generation["eos_token_id"] == [91, 95] and generation["temperature"] == 0.6


# ---------------------------------------------------------------- T5's two spellings


def t5_source(tmp_path, config_json: dict, own_head: bool):
    """A T5 checkpoint from a config.json as written by hand (transformers 4 spelling) and
    tensors of a random v1.1-style model (with or without its own lm_head.weight)."""
    config_cls, model_cls, sizes = FAMILIES["t5"]
    hf_config = config_cls.from_dict({"vocab_size": VOCAB, **sizes, **config_json})
    torch_model = perturbed(model_cls(hf_config))
    state = {k: v.contiguous() for k, v in torch_model.state_dict().items()}
    if own_head:
        state["lm_head.weight"] = torch.randn(VOCAB, sizes["d_model"])
    else:
        state.pop("lm_head.weight", None)
    state.pop("encoder.embed_tokens.weight"), state.pop("decoder.embed_tokens.weight")
    path = tmp_path / "t5_v4"
    path.mkdir()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with open(path / "config.json", "w") as f:
        json.dump({"model_type": "t5", "vocab_size": VOCAB, **sizes, **config_json}, f)
    reference = model_cls.from_pretrained(str(path)).eval()
    return reference, str(path)


@pytest.mark.parametrize(
    "config_json, own_head",
    [
        # The Hub's t5-small (v1.0): tied head, scaled decoder output; no flag written.
        (dict(feed_forward_proj="relu"), False),
        # v1.1 and Flan-T5 as their config.json says it (transformers 4).
        (dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False), True),
        # What transformers 5 writes for a v1.1 config: tied flag, no scaling, no head.
        (dict(feed_forward_proj="gated-gelu", scale_decoder_outputs=False), False),
    ],
    ids=["v1_0_v4", "v1_1_v4", "v1_1_v5"],
)
def test_t5_config_spellings_load_with_hf_logits(tmp_path, config_json, own_head):
    reference, path = t5_source(tmp_path, config_json, own_head)
    inputs = torch_inputs("t5")
    theirs = torch_logits(reference, **inputs)
    model, params = hf.from_pretrained(path)
    ours = np.asarray(jax.jit(model.compute_logits)(params, flaxlm_batch("t5", inputs)))
    assert max_abs_diff(ours, theirs, np.ones_like(inputs["decoder_input_ids"])) < 1e-4


def test_t5_saved_by_transformers_5_from_a_v1_1_config_loads(tmp_path):
    """`save_pretrained` of a v1.1-style config: `tie_word_embeddings: true`,
    `scale_decoder_outputs: false` and no lm_head.weight (it was refused before)."""
    torch_model, source = build_source(
        tmp_path, "t5", feed_forward_proj="gated-gelu", tie_word_embeddings=False
    )
    saved = read_json(f"{source}/config.json")
    assert saved["tie_word_embeddings"] is True and saved["scale_decoder_outputs"] is False
    inputs = torch_inputs("t5")
    model, params = hf.from_pretrained(source)
    ours = np.asarray(jax.jit(model.compute_logits)(params, flaxlm_batch("t5", inputs)))
    theirs = torch_logits(torch_model, **inputs)
    assert max_abs_diff(ours, theirs, np.ones_like(inputs["decoder_input_ids"])) < 1e-4


# ---------------------------------------------------------------- RoBERTa's head


@pytest.mark.parametrize("hidden_act", ["gelu_new", "relu"])
def test_roberta_untied_head_and_any_activation_match_hf(tmp_path, hidden_act):
    torch_model, source = build_source(
        tmp_path, "roberta", tie_word_embeddings=False, hidden_act=hidden_act
    )
    inputs = torch_inputs("roberta")
    theirs = torch_logits(torch_model, **inputs)
    model, params = hf.from_pretrained(source)
    assert not model.config.tie_word_embeddings
    ours = np.asarray(jax.jit(model.compute_logits)(params, flaxlm_batch("roberta", inputs)))
    assert max_abs_diff(ours, theirs, inputs["attention_mask"]) < 1e-4
    hf.save_pretrained(model, params, tmp_path / "export")
    assert read_json(tmp_path / "export/config.json")["tie_word_embeddings"] is False
    reloaded, info = transformers.AutoModelForMaskedLM.from_pretrained(
        str(tmp_path / "export"), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    again = torch_logits(reloaded.eval(), **inputs)
    assert max_abs_diff(again, theirs, inputs["attention_mask"]) < 1e-4


def test_roberta_v4_config_json_loads_with_hf_logits(tmp_path):
    """roberta-base's config.json as the Hub has it (no tie flag: tied)."""
    config_cls, model_cls, sizes = FAMILIES["roberta"]
    v4 = dict(
        model_type="roberta",
        architectures=["RobertaForMaskedLM"],
        vocab_size=VOCAB,
        hidden_act="gelu",
        layer_norm_eps=1e-05,
        type_vocab_size=1,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=1,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        **sizes,
    )
    torch_model = perturbed(model_cls(config_cls.from_dict(v4)))
    state = {k: v.contiguous() for k, v in torch_model.state_dict().items()}
    state.pop("lm_head.decoder.weight", None), state.pop("lm_head.decoder.bias", None)
    path = tmp_path / "roberta_v4"
    path.mkdir()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with open(path / "config.json", "w") as f:
        json.dump(v4, f)
    reference = model_cls.from_pretrained(str(path)).eval()
    inputs = torch_inputs("roberta")
    model, params = hf.from_pretrained(str(path))
    assert isinstance(model, base.EncoderOnlyModel) and model.config.tie_word_embeddings
    ours = np.asarray(jax.jit(model.compute_logits)(params, flaxlm_batch("roberta", inputs)))
    theirs = torch_logits(reference, **inputs)
    assert max_abs_diff(ours, theirs, inputs["attention_mask"]) < 1e-4


# ---------------------------------------------------------------- heads that differ


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_head_that_differs_from_the_embedding_loads_untied_as_in_hf(tmp_path, family):
    """config.json says tied, but the file has an lm_head.weight of its own: transformers
    keeps it (untied), and so does flaxlm; a model bound tied refuses the file by name."""
    config_cls, model_cls, sizes = FAMILIES[family]
    torch_model = perturbed(
        model_cls(config_cls(vocab_size=VOCAB, tie_word_embeddings=True, **sizes))
    )
    state = {k: v.contiguous().clone() for k, v in torch_model.state_dict().items()}
    state["lm_head.weight"] = torch.randn(VOCAB, sizes.get("hidden_size", sizes.get("n_embd")))
    path = tmp_path / "hf"
    torch_model.config.save_pretrained(str(path))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    reference = model_cls.from_pretrained(str(path)).eval()
    inputs = torch_inputs(family)
    theirs = torch_logits(reference, **inputs)
    model, params = hf.from_pretrained(str(path))
    assert not model.config.tie_word_embeddings
    ours = np.asarray(jax.jit(model.compute_logits)(params, flaxlm_batch(family, inputs)))
    assert max_abs_diff(ours, theirs, inputs["attention_mask"]) < 1e-4

    tied = type(model)(dataclasses.replace(model.config, tie_word_embeddings=True))
    with pytest.raises(ValueError, match="lm_head.weight.*set tie_word_embeddings=False"):
        hf.load_params(tied, str(path))
