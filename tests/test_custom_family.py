"""A causal family defined outside flaxlm, on `causal_lm.CausalLM`: IBM's Granite (Llama
with four multipliers: on the token embedding, on the attention scores instead of
head_dim**-0.5, on each residual branch, and a divisor of the logits). It trains, decodes
with the KV cache, and round-trips through transformers' `GraniteForCausalLM` without a
line of flaxlm changed; its HF tensor table is Llama's, imported like any public seam.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from flaxlm.checkpoints import hf
from flaxlm.inference import generation
from flaxlm.models import attention, layers, llama
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.models.causal_lm import CausalLM
from flaxlm.models.hf_spec import HF_SPECS, HFSpec, HFTensor, register_hf
from flaxlm.models.options import ComputeOptions
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import steps as train_steps
from tests.helpers import adamw, feature_lengths, random_batch
from tests.hf_helpers import (
    decoder_batch,
    max_abs_diff,
    padded_batch,
    random_hf_model,
    torch_logits,
)

# ------------------------------------------------------------------ the family

MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier")


@dataclasses.dataclass(frozen=True)
class GraniteConfig(ComputeOptions):
    """Granite hyper-parameters (HF names where they exist); compute options inherited."""

    vocab_size: int = 49152
    real_vocab_size: int | None = None
    hidden_size: int = 2048
    num_layers: int = 40
    num_heads: int = 32
    num_kv_heads: int = 8
    intermediate_size: int = 8192
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e4
    tie_word_embeddings: bool = True
    activation: str = "silu"
    embedding_multiplier: float = 12.0  # scales the token embedding
    attention_multiplier: float = 0.015625  # the attention scores' scale
    residual_multiplier: float = 0.22  # scales each block's attention and MLP outputs
    logits_scaling: float = 8.0  # the logits are divided by it

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def flops_per_token(self, seq_len: int) -> float:
        e, f, n = self.hidden_size, self.intermediate_size, self.num_layers
        block = 2 * e * e + 2 * e * self.num_kv_heads * self.head_dim + 3 * e * f
        return 6.0 * n * block + 12.0 * n * e * seq_len

    def make_module(self) -> Granite:
        return Granite(self)


class GraniteBlock(nn.Module):
    config: GraniteConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, mask, decoding, sin, cos):
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        h = layers.RMSNorm(cfg.rms_norm_eps, name="input_layernorm", **dense)(x)
        a = attention.rotary_self_attention(
            h,
            sin,
            cos,
            mask,
            decoding,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            hidden_size=cfg.hidden_size,
            qkv_bias=False,
            out_bias=False,
            attention=cfg.attention,
            chunk_size=cfg.attention_chunk_size,
            scale=cfg.attention_multiplier,  # what makes it Granite, with the three others
            **dense,
        )
        x = x + a * cfg.residual_multiplier
        h = layers.RMSNorm(cfg.rms_norm_eps, name="post_attention_layernorm", **dense)(x)
        m = layers.gated_mlp(
            h,
            intermediate_size=cfg.intermediate_size,
            hidden_size=cfg.hidden_size,
            activation=cfg.activation,
            use_bias=False,
            **dense,
        )
        return x + m * cfg.residual_multiplier


class Granite(CausalLM):
    block_cls = GraniteBlock

    def block_inputs(self, x, positions, decoding):
        inv_freq = attention.rotary_inv_freq(self.config.head_dim, self.config.rope_theta)
        return x * self.config.embedding_multiplier, attention.rotary_sin_cos(positions, inv_freq)

    def final_norm(self, x):
        cfg = self.config
        x = layers.RMSNorm(
            cfg.rms_norm_eps, dtype=jnp.float32, param_dtype=cfg.param_dtype, name="norm"
        )(x)
        # The head is linear without a bias: dividing its input divides the logits.
        return x / cfg.logits_scaling


def config_from_hf(hf_config: dict, **overrides) -> GraniteConfig:
    rope = hf_config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError("This Granite has plain rotary only.")
    if hf_config.get("attention_bias") or hf_config.get("mlp_bias"):
        raise ValueError("This Granite has no attention or MLP biases.")
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
        logits_scaling=float(hf_config.get("logits_scaling", 1.0)),
        **{name: float(hf_config.get(name, 1.0)) for name in MULTIPLIERS},
    )
    return GraniteConfig(**{**kwargs, **overrides})


def config_to_hf(cfg: GraniteConfig) -> dict:
    return {
        "model_type": "granite",
        "architectures": ["GraniteForCausalLM"],
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
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "logits_scaling": cfg.logits_scaling,
        **{name: getattr(cfg, name) for name in MULTIPLIERS},
    }


def hf_tensors(cfg: GraniteConfig) -> list[HFTensor]:
    # Granite kept Llama's tensor names: Llama's table for the same layers and tying.
    return llama.hf_tensors(
        llama.LlamaConfig(num_layers=cfg.num_layers, tie_word_embeddings=cfg.tie_word_embeddings)
    )


SPEC = HFSpec(
    model_types=("granite",),
    config_cls=GraniteConfig,
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
    embedding_multiplier=2.0,
    attention_multiplier=0.25,
    residual_multiplier=0.5,
    logits_scaling=2.0,
)


def test_training_steps_lower_the_loss():
    model = DecoderOnlyModel(GraniteConfig(**TINY))
    partitioner = Partitioner(mesh_shape=(1, 1, 1), devices=jax.devices()[:1])
    setup = train_steps.Setup(model, partitioner, adamw(), feature_lengths())
    step = setup.partition_train_step(train_steps.make_train_step(model, partitioner, 1e-2))
    state, batch = setup.init_state(), random_batch()
    losses = []
    for _ in range(5):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.slow
def test_greedy_decoding_with_the_cache_follows_the_full_forward_argmax():
    model = DecoderOnlyModel(GraniteConfig(**TINY, scan_layers=True))
    params = model.init_params(jax.random.PRNGKey(0), model.example_batch_shapes(16, 2))
    prompts = np.random.default_rng(0).integers(1, 128, (2, 6)).astype(np.int32)
    lengths = np.array([6, 4], np.int32)
    batch = {"inputs": prompts, "inputs_lengths": lengths}
    new = generation.generate(model, params, batch, max_new_tokens=8, eos_id=None)
    for row, n in enumerate(lengths):
        tokens = np.concatenate([prompts[row, :n], new[row]])[None]
        logits = jax.jit(model.compute_logits)(params, {"decoder_input_tokens": tokens})
        expected = np.asarray(logits)[0, n - 1 : -1].argmax(-1)
        np.testing.assert_array_equal(new[row], expected)


def tiny_hf_granite(tmp_path, **overrides):
    """A random tiny torch Granite (norms perturbed, every multiplier far from 1), saved to
    tmp_path/hf."""
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
        embedding_multiplier=3.0,
        attention_multiplier=0.3,
        residual_multiplier=0.6,
        logits_scaling=4.0,
    )
    kwargs.update(overrides)
    model = random_hf_model(transformers.GraniteConfig, transformers.GraniteForCausalLM, **kwargs)
    model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    return model, str(tmp_path / "hf")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_import_matches_transformers_and_export_reloads(tmp_path, tied, registered):
    torch_model, path = tiny_hf_granite(tmp_path, tie_word_embeddings=tied)
    ids, mask = padded_batch(250, (12, 7, 12, 3))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)

    model, params = hf.from_pretrained(path, scan_layers=tied)
    assert isinstance(model.config, GraniteConfig) and model.config.tie_word_embeddings == tied
    assert model.config.logits_scaling == 4.0
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    assert max_abs_diff(ours, theirs, mask) < 1e-4

    out = tmp_path / "out"
    hf.save_pretrained(model, params, out)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert isinstance(reloaded, transformers.GraniteForCausalLM)
    assert reloaded.config.residual_multiplier == pytest.approx(0.6)
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(again, theirs, mask) < 1e-5
