"""A causal family defined outside flaxlm, on `causal_lm.CausalLM`: Qwen2 (Llama with biases
on the q, k and v projections). It trains, decodes with the KV cache, and round-trips through
transformers' `Qwen2ForCausalLM` without a line of flaxlm changed.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from flaxlm import hf, inference, trainer
from flaxlm.models import attention, layers
from flaxlm.models.base import ComputeOptions, DecoderOnlyModel
from flaxlm.models.causal_lm import CausalLM
from flaxlm.models.hf_spec import HF_SPECS, HFSpec, HFTensor, linear, register_hf
from flaxlm.partitioning import Partitioner
from tests.helpers import adamw, feature_lengths, random_batch
from tests.hf_helpers import decoder_batch, max_abs_diff, padded_batch, torch_logits

# ------------------------------------------------------------------ the family


@dataclasses.dataclass(frozen=True)
class Qwen2Config(ComputeOptions):
    """Qwen2 hyper-parameters (HF names where they exist); compute options inherited."""

    vocab_size: int = 151936
    real_vocab_size: int | None = None
    hidden_size: int = 896
    num_layers: int = 24
    num_heads: int = 14
    num_kv_heads: int = 2
    intermediate_size: int = 4864
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_word_embeddings: bool = True
    activation: str = "silu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def flops_per_token(self, seq_len: int) -> float:
        e, f, n = self.hidden_size, self.intermediate_size, self.num_layers
        block = 2 * e * e + 2 * e * self.num_kv_heads * self.head_dim + 3 * e * f
        return 6.0 * n * block + 12.0 * n * e * seq_len

    def make_module(self) -> Qwen2:
        return Qwen2(self)


class Qwen2Block(nn.Module):
    config: Qwen2Config
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, mask, decoding, sin, cos):
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        h = layers.RMSNorm(cfg.rms_norm_eps, name="input_layernorm", **dense)(x)
        x = x + attention.rotary_self_attention(
            h,
            sin,
            cos,
            mask,
            decoding,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            hidden_size=cfg.hidden_size,
            qkv_bias=True,  # what makes it Qwen2
            out_bias=False,
            attention=cfg.attention,
            chunk_size=cfg.attention_chunk_size,
            **dense,
        )
        h = layers.RMSNorm(cfg.rms_norm_eps, name="post_attention_layernorm", **dense)(x)
        return x + layers.gated_mlp(
            h,
            intermediate_size=cfg.intermediate_size,
            hidden_size=cfg.hidden_size,
            activation=cfg.activation,
            use_bias=False,
            **dense,
        )


class Qwen2(CausalLM):
    block_cls = Qwen2Block

    def block_inputs(self, x, positions, decoding):
        inv_freq = attention.rotary_inv_freq(self.config.head_dim, self.config.rope_theta)
        return x, attention.rotary_sin_cos(positions, inv_freq)

    def final_norm(self, x):
        cfg = self.config
        return layers.RMSNorm(
            cfg.rms_norm_eps, dtype=jnp.float32, param_dtype=cfg.param_dtype, name="norm"
        )(x)


def config_from_hf(hf_config: dict, **overrides) -> Qwen2Config:
    rope = hf_config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or hf_config.get("use_sliding_window"):
        raise ValueError("This Qwen2 has plain rotary and full attention only.")
    kwargs = dict(
        vocab_size=hf_config["vocab_size"],
        hidden_size=hf_config["hidden_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_heads=hf_config["num_attention_heads"],
        num_kv_heads=hf_config["num_key_value_heads"],
        intermediate_size=hf_config["intermediate_size"],
        max_position_embeddings=hf_config["max_position_embeddings"],
        rms_norm_eps=hf_config["rms_norm_eps"],
        rope_theta=float(rope.get("rope_theta", hf_config.get("rope_theta", 1e4))),
        tie_word_embeddings=hf_config.get("tie_word_embeddings", False),
        activation=hf_config.get("hidden_act", "silu"),
    )
    return Qwen2Config(**{**kwargs, **overrides})


def config_to_hf(cfg: Qwen2Config) -> dict:
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": cfg.real_vocab_size or cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.activation,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
    }


def hf_tensors(cfg: Qwen2Config) -> list[HFTensor]:
    n, hf_layer = cfg.num_layers, "model.layers.{i}"
    out = [HFTensor("embed_tokens/embedding", "model.embed_tokens.weight", 1, vocab_axis=0)]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out.append(HFTensor(f"layers_{{i}}/{norm}/scale", f"{hf_layer}.{norm}.weight", layers=n))
    for p in ("q_proj", "k_proj", "v_proj"):
        out.append(linear(f"layers_{{i}}/{p}/kernel", f"{hf_layer}.self_attn.{p}.weight", layers=n))
        out.append(HFTensor(f"layers_{{i}}/{p}/bias", f"{hf_layer}.self_attn.{p}.bias", layers=n))
    out.append(
        linear("layers_{i}/o_proj/kernel", f"{hf_layer}.self_attn.o_proj.weight", 2, layers=n)
    )
    for p in ("gate_proj", "up_proj", "down_proj"):
        out.append(linear(f"layers_{{i}}/{p}/kernel", f"{hf_layer}.mlp.{p}.weight", layers=n))
    out.append(HFTensor("norm/scale", "model.norm.weight"))
    if not cfg.tie_word_embeddings:
        out.append(linear("lm_head/kernel", "lm_head.weight", vocab_axis=1))
    return out


SPEC = HFSpec(
    model_types=("qwen2",),
    config_cls=Qwen2Config,
    model_cls=DecoderOnlyModel,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=hf_tensors,
    ignore=(r"rotary_emb\.inv_freq$", r"^lm_head\.weight$"),
    base_model_prefix="model",
    tied_head=("lm_head.weight", "model.embed_tokens.weight"),
)


@pytest.fixture
def registered():
    """The family registered (`register_hf`, as its module would on import) for one test;
    the registry is restored after it, so flaxlm's own families are untouched."""
    saved = dict(HF_SPECS)
    register_hf(SPEC)
    yield SPEC
    HF_SPECS.clear()
    HF_SPECS.update(saved)


# ------------------------------------------------------------------ the tests

TINY = dict(
    vocab_size=128,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    rope_theta=1e4,
)


def test_training_steps_lower_the_loss():
    model = DecoderOnlyModel(Qwen2Config(**TINY))
    partitioner = Partitioner(mesh_shape=(1, 1, 1), devices=jax.devices()[:1])
    setup = trainer.Setup(model, partitioner, adamw(), feature_lengths())
    step = setup.partition_train_step(trainer.make_train_step(model, partitioner, 1e-2))
    state, batch = setup.init_state(), random_batch()
    losses = []
    for _ in range(5):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.3, losses


def test_greedy_decoding_with_the_cache_follows_the_full_forward_argmax():
    model = DecoderOnlyModel(Qwen2Config(**TINY, scan_layers=True))
    params = model.init_params(jax.random.PRNGKey(0), model.example_batch_shapes(16, 2))
    prompts = np.random.default_rng(0).integers(1, 128, (2, 6)).astype(np.int32)
    lengths = np.array([6, 4], np.int32)
    batch = {"inputs": prompts, "inputs_lengths": lengths}
    new = inference.generate(model, params, batch, max_new_tokens=8, eos_id=None)
    for row, n in enumerate(lengths):
        tokens = np.concatenate([prompts[row, :n], new[row]])[None]
        logits = model.compute_logits(params, {"decoder_input_tokens": tokens})
        expected = np.asarray(logits)[0, n - 1 : -1].argmax(-1)
        np.testing.assert_array_equal(new[row], expected)


def tiny_hf_qwen2(tmp_path, **overrides):
    """A random tiny torch Qwen2 (norms and q/k/v biases perturbed), saved to tmp_path/hf."""
    kwargs = dict(
        vocab_size=250,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 5e4},
        initializer_range=0.1,
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**kwargs, attn_implementation="eager")
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "proj.bias")):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    return model, str(tmp_path / "hf")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_import_matches_transformers_and_export_reloads(tmp_path, tied, registered):
    torch_model, path = tiny_hf_qwen2(tmp_path, tie_word_embeddings=tied)
    ids, mask = padded_batch(250, (12, 7, 12, 3))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)

    model, params = hf.from_pretrained(path, scan_layers=tied)
    assert isinstance(model.config, Qwen2Config) and model.config.tie_word_embeddings == tied
    ours = model.compute_logits(params, decoder_batch(ids, mask))
    assert max_abs_diff(ours, theirs, mask) < 1e-4

    out = tmp_path / "out"
    hf.save_pretrained(model, params, out)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert isinstance(reloaded, transformers.Qwen2ForCausalLM)
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(again, theirs, mask) < 1e-5
