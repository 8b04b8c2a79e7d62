"""The Kimi Delta Attention kernels and layer (`models/kimi_delta.py`) against transformers'
torch references (`chunk_kimi_delta_attention`, `recurrent_kimi_delta_attention`,
`KimiLinearRMSNormGated`, `KimiLinearDeltaAttention`): the chunked form at several chunk
sizes (within one block of positions, across blocks, one that does not divide the length)
equals the recurrent one (Gated DeltaNet's, a decay a key channel) and HF's, and so do its
gradients; packed segments restart the state; the layer is HF's, decodes one token at a time
from its cache as it reads the whole sequence (left padding unseen), and from the paged
cache's state slots (padding leaving them as they were). The checks Gated DeltaNet's tests
make alike: tests/linear_attention_helpers.py.
Context parallelism: tests/test_linear_context_parallel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi

from flaxlm.models import gated_deltanet, kimi_delta, qwen3_next_hf
from tests.linear_attention_helpers import (
    ROWS,
    check_chunked_rule_equals_recurrent_and_hf,
    check_gated_norm_equals_hf,
    check_layer_and_gradients_equal_hf,
    check_layer_decodes_from_its_cache_as_it_reads,
    check_layer_decodes_from_its_state_slots,
    check_packed_segments_restart_the_rule,
    tolerance,
)

BATCH, LENGTH, HEADS, KEY_DIM, VALUE_DIM = ROWS, 37, 2, 8, 6


@pytest.fixture(scope="module")
def inputs():
    """q, k, v, per-channel log decays g (lognormal: some channels forget fast, some slowly),
    beta, an initial state; numpy."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    q, k = normal(BATCH, LENGTH, HEADS, KEY_DIM), normal(BATCH, LENGTH, HEADS, KEY_DIM)
    v = normal(BATCH, LENGTH, HEADS, VALUE_DIM)
    g = -np.exp(normal(BATCH, LENGTH, HEADS, KEY_DIM) - 1.0)
    beta = (1 / (1 + np.exp(-normal(BATCH, LENGTH, HEADS)))).astype(np.float32)
    state = normal(BATCH, HEADS, KEY_DIM, VALUE_DIM)
    return q, k, v, g, beta, state


def as_rule_reads(q, k):
    """q and k as the rules read them: L2-normalised, q also by key_dim^-0.5."""
    q = gated_deltanet.l2_normalize(q) * KEY_DIM**-0.5
    return q, gated_deltanet.l2_normalize(k)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 32, 64])
def test_chunked_rule_equals_recurrent_and_hf(inputs, chunk_size):
    """Chunks of 1, 5 (37 = 7 x 5 + 2), 16 (one block of pairs), 32 (two: 37 = 32 + 5) and
    64 (four, one padded chunk) give HF's outputs and final state, chunked (at its own chunk
    size) and recurrent alike."""
    check_chunked_rule_equals_recurrent_and_hf(
        kimi_delta.chunk_kimi_delta_rule, hf_kimi.chunk_kimi_delta_attention,
        hf_kimi.recurrent_kimi_delta_attention, inputs, as_rule_reads, chunk_size,
    )  # fmt: skip


def test_steep_decays_stay_finite_where_one_factor_would_overflow(inputs):
    """Log decays of -40 a step (exp(-cum) past float32's range within a chunk of 64): the
    chunked form splits each decay at a block start, both factors <= 1, and stays the
    recurrent one."""
    q, k, v, _, beta, state = inputs
    g = np.full(q.shape, -40.0, np.float32)
    g[..., ::2] = -0.01  # half the channels keep their memory
    qn, kn = as_rule_reads(q, k)
    out, final = kimi_delta.chunk_kimi_delta_rule(
        qn, kn, v, g, beta, chunk_size=64, initial_state=state
    )
    rec_out, rec_state = gated_deltanet.recurrent_gated_delta_rule(qn, kn, v, g, beta, state)
    assert np.isfinite(np.asarray(out)).all()
    tol = tolerance(np.asarray(rec_out), LENGTH)
    np.testing.assert_allclose(np.asarray(out), rec_out, rtol=0, atol=tol)
    np.testing.assert_allclose(np.asarray(final), rec_state, rtol=0, atol=tol)


def test_chunked_gradients_equal_the_recurrent_ones(inputs):
    """The gradients of a weighted sum of the outputs and the final state with respect to
    every input (chunks of 32: pairs within and across blocks, a padded chunk)."""
    q, k, v, g, beta, state = inputs
    rng = np.random.default_rng(1)
    w_out = rng.normal(size=(BATCH, LENGTH, HEADS, VALUE_DIM)).astype(np.float32)
    w_state = rng.normal(size=state.shape).astype(np.float32)

    def loss(rule, q, k, v, g, beta, state):
        qn, kn = as_rule_reads(q, k)
        out, final = rule(qn, kn, v, g, beta, state)
        return jnp.sum(out * w_out) + jnp.sum(final * w_state)

    def chunked(*args):
        return kimi_delta.chunk_kimi_delta_rule(*args[:5], chunk_size=32, initial_state=args[5])

    argnums = tuple(range(1, 7))
    ours = jax.grad(loss, argnums)(chunked, *inputs)
    reference = jax.grad(loss, argnums)(gated_deltanet.recurrent_gated_delta_rule, *inputs)
    for got, want in zip(ours, reference, strict=True):
        want = np.asarray(want)
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=tolerance(want, 2 * LENGTH))


def test_packed_segments_restart_the_state_and_the_convolution(inputs):
    """Rows packed with segments 1 | 2 | 3 (boundaries inside a block of 16 positions, across
    blocks and chunks of 32): each segment's outputs are those of the segment alone, from a
    zero state."""
    q, k, v, g, beta, _ = inputs
    qn, kn = as_rule_reads(q, k)
    check_packed_segments_restart_the_rule(
        kimi_delta.chunk_kimi_delta_rule, (qn, kn, v, g, beta), chunk_size=32
    )


def test_sigmoid_gated_rms_norm_equals_hf():
    theirs = hf_kimi.KimiLinearRMSNormGated(KEY_DIM, eps=1e-5)
    check_gated_norm_equals_hf(kimi_delta.SigmoidGatedRMSNorm(1e-5), theirs, KEY_DIM)


WIDTH, TAPS = 16, 3


def layer() -> kimi_delta.KimiDeltaAttention:
    return kimi_delta.KimiDeltaAttention(
        hidden_size=WIDTH, num_heads=HEADS, head_dim=KEY_DIM, conv_kernel_size=TAPS, chunk_size=4
    )


def ours_of(hf: dict) -> dict:
    """HF's `KimiLinearDeltaAttention` params (or their gradients) in our layout."""
    width = HEADS * KEY_DIM
    out = {
        p: {"kernel": hf[f"{p}.weight"].T.reshape(WIDTH, HEADS, KEY_DIM)}
        for p in ("q_proj", "k_proj", "v_proj")
    }
    out["b_proj"] = {"kernel": hf["b_proj.weight"].T}
    for p in ("forget_gate.f", "g"):
        name = p.rpartition(".")[-1]
        out[f"{name}_a_proj"] = {"kernel": hf[f"{p}_a_proj.weight"].T}
        out[f"{name}_b_proj"] = {"kernel": hf[f"{p}_b_proj.weight"].T.reshape(KEY_DIM, HEADS, -1)}
    out["A_log"] = hf["forget_gate.A_log"].reshape(HEADS)
    out["dt_bias"] = hf["forget_gate.dt_bias"].reshape(HEADS, KEY_DIM)
    out["o_norm"] = {"scale": hf["o_norm.weight"]}
    out["o_proj"] = {"kernel": hf["o_proj.weight"].T.reshape(HEADS, KEY_DIM, WIDTH)}
    for i, x in enumerate("qkv"):
        rows = hf["conv1d.weight"][i * width : (i + 1) * width]
        out[f"conv_{x}"] = qwen3_next_hf.conv_from_hf(rows, (TAPS, HEADS, KEY_DIM))
    return out


@pytest.mark.slow
def test_layer_and_its_gradients_equal_hf_autograd():
    """HF's `KimiLinearDeltaAttention` (chunks of 64) and ours (chunks of 4) on 21 positions,
    its params perturbed: the output, and the gradients of a weighted sum of it with respect
    to the input and every param."""
    config = transformers.KimiLinearConfig(
        hidden_size=WIDTH, linear_num_heads=HEADS, linear_head_dim=KEY_DIM,
        linear_conv_kernel_dim=TAPS, num_hidden_layers=1, layer_types=["linear_attention"],
        mlp_layer_types=["dense"],
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = hf_kimi.KimiLinearDeltaAttention(config, 0).float()
    gate = theirs.forget_gate  # its A_log and dt_bias are left uninitialised outside a model
    with torch.no_grad():
        gate.A_log.copy_(torch.log(torch.rand_like(gate.A_log) * 15 + 1))
        gate.dt_bias.copy_(torch.randn_like(gate.dt_bias) - 3)
        for p in theirs.parameters():
            p.add_(0.3 * torch.randn_like(p))
    check_layer_and_gradients_equal_hf(layer(), theirs, ours_of, WIDTH, 2)


@pytest.mark.slow
def test_layer_decodes_from_its_cache_as_it_reads_the_sequence():
    """A prompt of 6 (row 1 left-padded by 2 garbage positions), then one token at a time
    from the cached convolution inputs and state: the outputs of reading each row whole; a
    packed row's segments each as alone."""
    check_layer_decodes_from_its_cache_as_it_reads(layer(), WIDTH)


@pytest.mark.slow
def test_layer_decodes_from_its_state_slots_padding_leaving_them_as_they_were():
    """The serving engine's paged cache: each row's state and convolution inputs in a state
    slot, read and written back by prefill chunks (padding after a row's tokens) and a
    decode step; a padding row's slot is left bit for bit."""
    check_layer_decodes_from_its_state_slots(layer(), WIDTH)


@pytest.mark.parametrize("rule", ["kimi", "gated"])
def test_the_chunked_rules_backward_holds_o_chunk_of_their_products(rule):
    """Each chunk's `[c, c]` products (KDA's pairwise decays per key channel, `c/16 x 16 x 16
    x key_dim` a chunk) are recomputed in the backward, not kept for every chunk: the
    compiled gradient's temporaries grow with the length by a few per-token arrays (the
    inputs' chunked copies, the states a chunk starts from), ~5 of q's bytes a token here,
    where keeping them cost 125 (KDA) and 35 (Gated DeltaNet)."""
    heads, dk = 2, 32

    def temporaries(length: int) -> int:
        def loss(q, k, v, g, beta):
            if rule == "kimi":
                out = kimi_delta.chunk_kimi_delta_rule(q, k, v, g, beta, chunk_size=64)[0]
            else:
                out = gated_deltanet.chunk_gated_delta_rule(
                    q, k, v, g[..., 0], beta, chunk_size=64
                )[0]
            return jnp.sum(out**2)

        f32 = jnp.float32
        shapes = [jax.ShapeDtypeStruct((1, length, heads, dk), f32)] * 4
        shapes.append(jax.ShapeDtypeStruct((1, length, heads), f32))
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*shapes).compile()
        return step.memory_analysis().temp_size_in_bytes

    per_token_q = heads * dk * 4
    growth = (temporaries(2048) - temporaries(512)) / (1536 * per_token_q)
    assert growth <= 8, growth
