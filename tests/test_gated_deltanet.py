"""The Gated DeltaNet kernels and layer (`models/gated_deltanet.py`) against transformers'
torch references (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
`causal_conv1d_fn` / `causal_conv1d_update`, `Qwen3NextRMSNormGated`, `Qwen3NextGatedDeltaNet`):
the chunked form at several chunk sizes (one that does not divide the length) equals the
recurrent one and HF's; the layer's gradients are torch autograd's; packed segments restart
the state and the convolution; the layer decodes one token at a time from its cache as it
reads the whole sequence, left padding unseen, and from the paged cache's state slots
(padding leaving them as they were), and reads it in pieces (context parallelism's,
`linear_context_parallel`) as whole. The checks Kimi Delta Attention's tests make alike:
tests/linear_attention_helpers.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from flaxlm.models import gated_deltanet, masks, qwen3_next_hf
from tests.linear_attention_helpers import (
    EPS,
    ROWS,
    check_chunked_rule_equals_recurrent_and_hf,
    check_gated_norm_equals_hf,
    check_layer_and_gradients_equal_hf,
    check_layer_decodes_from_its_cache_as_it_reads,
    check_layer_decodes_from_its_state_slots,
    check_packed_segments_restart_the_rule,
    tolerance,
)

BATCH, LENGTH, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = ROWS, 37, 2, 4, 8, 6


@pytest.fixture(scope="module")
def inputs():
    """q, k (two key heads), v, g, beta (four value heads), an initial state; numpy."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    q, k = normal(BATCH, LENGTH, KEY_HEADS, KEY_DIM), normal(BATCH, LENGTH, KEY_HEADS, KEY_DIM)
    v = normal(BATCH, LENGTH, VALUE_HEADS, VALUE_DIM)
    g = -np.abs(normal(BATCH, LENGTH, VALUE_HEADS))
    beta = (1 / (1 + np.exp(-normal(BATCH, LENGTH, VALUE_HEADS)))).astype(np.float32)
    state = normal(BATCH, VALUE_HEADS, KEY_DIM, VALUE_DIM)
    return q, k, v, g, beta, state


def as_rule_reads(q, k):
    """q and k as the rules read them: L2-normalised (q / sqrt(key_dim)), repeated to the
    value heads."""
    group = VALUE_HEADS // KEY_HEADS
    q = gated_deltanet.l2_normalize(q) * KEY_DIM**-0.5
    return jnp.repeat(q, group, axis=2), jnp.repeat(gated_deltanet.l2_normalize(k), group, axis=2)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunked_rule_equals_recurrent_and_hf(inputs, chunk_size):
    """Chunks of 1, 5 (37 = 7 x 5 + 2), 16 and 64 (one padded chunk) give HF's outputs and
    final state, chunked (at its own chunk size) and recurrent alike."""
    check_chunked_rule_equals_recurrent_and_hf(
        gated_deltanet.chunk_gated_delta_rule, hf_next.torch_chunk_gated_delta_rule,
        hf_next.torch_recurrent_gated_delta_rule, inputs, as_rule_reads, chunk_size,
    )  # fmt: skip


def test_packed_segments_restart_the_state_and_the_convolution(inputs):
    """Rows packed with segments 1 | 2 | 3 (boundaries inside chunks of 8 and across them):
    each segment's outputs are those of the segment alone, from a zero state."""
    q, k, v, g, beta, _ = inputs
    qn, kn = as_rule_reads(q, k)
    runs, bounds = check_packed_segments_restart_the_rule(
        gated_deltanet.chunk_gated_delta_rule, (qn, kn, v, g, beta), chunk_size=8
    )
    kernel = np.random.default_rng(2).normal(size=(4, VALUE_HEADS, VALUE_DIM)).astype(np.float32)
    context = jnp.zeros((BATCH, 3, VALUE_HEADS, VALUE_DIM))
    conv, _ = gated_deltanet.causal_conv1d(v, kernel, context, runs)
    for start, stop in bounds:
        conv_alone, _ = gated_deltanet.causal_conv1d(v[:, start:stop], kernel, context)
        np.testing.assert_allclose(conv[:, start:stop], conv_alone, rtol=0, atol=16 * EPS)


def test_convolution_and_its_decoding_update_equal_hf():
    """The convolution with SiLU over a sequence (HF's `causal_conv1d_fn`), then one token at
    a time from the carried inputs (HF's `causal_conv1d_update` with its conv state)."""
    rng = np.random.default_rng(3)
    channels, taps, length = 6, 4, 9
    x = rng.normal(size=(BATCH, length, channels)).astype(np.float32)
    kernel = rng.normal(size=(taps, channels)).astype(np.float32)
    weight = torch.from_numpy(kernel.T.copy())  # HF's conv1d.weight without its middle axis
    theirs = hf_next.causal_conv1d_fn(
        torch.from_numpy(x[:, :6].transpose(0, 2, 1).copy()), weight, activation="silu"
    ).numpy()
    # HF's conv state after the prompt: its last `taps` inputs, channels first.
    conv_state = torch.from_numpy(x[:, 6 - taps : 6].transpose(0, 2, 1).copy())
    context = jnp.zeros((BATCH, taps - 1, channels))
    out, context = gated_deltanet.causal_conv1d(x[:, :6], kernel, context)
    np.testing.assert_allclose(jax.nn.silu(out), theirs.transpose(0, 2, 1), rtol=0, atol=1e-6)
    for t in range(6, length):
        step = torch.from_numpy(x[:, t : t + 1].transpose(0, 2, 1).copy())
        theirs = hf_next.causal_conv1d_update(step, conv_state, weight, activation="silu").numpy()
        out, context = gated_deltanet.causal_conv1d(x[:, t : t + 1], kernel, context)
        np.testing.assert_allclose(jax.nn.silu(out), theirs.transpose(0, 2, 1), rtol=0, atol=1e-6)


def test_gated_rms_norm_equals_hf():
    theirs = hf_next.Qwen3NextRMSNormGated(VALUE_DIM, eps=1e-6)
    check_gated_norm_equals_hf(gated_deltanet.GatedRMSNorm(1e-6), theirs, VALUE_DIM)


def layer(projection: str) -> gated_deltanet.GatedDeltaNet:
    return gated_deltanet.GatedDeltaNet(
        hidden_size=16, num_key_heads=KEY_HEADS, num_value_heads=VALUE_HEADS, key_dim=KEY_DIM,
        value_dim=VALUE_DIM, chunk_size=4, projection=projection,
    )  # fmt: skip


@pytest.mark.slow
def test_layer_and_its_gradients_equal_hf_autograd():
    """HF's `Qwen3NextGatedDeltaNet` (chunks of 64) and ours (chunks of 4) on 21 positions,
    its params perturbed: the output, and the gradients of a weighted sum of it with respect
    to the input and every param (each a sum over rows and positions, back through the
    sequence: depth 2 x length x rows)."""
    config = transformers.Qwen3NextConfig(
        hidden_size=16, linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM, num_hidden_layers=1,
        layer_types=["linear_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = hf_next.Qwen3NextGatedDeltaNet(config, 0).float()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.3 * torch.randn_like(p))
    key, value = KEY_HEADS * KEY_DIM, VALUE_HEADS * VALUE_DIM
    rows = {"q": (0, key), "k": (key, 2 * key), "v": (2 * key, 2 * key + value)}
    shapes = {"q": (KEY_HEADS, KEY_DIM), "k": (KEY_HEADS, KEY_DIM), "v": (VALUE_HEADS, VALUE_DIM)}

    def ours_of(hf: dict) -> dict:  # HF's layout -> ours
        out = {
            name: {"kernel": hf[f"{name}.weight"].T.reshape(16, KEY_HEADS, -1)}
            for name in ("in_proj_qkvz", "in_proj_ba")
        }
        out.update(A_log=hf["A_log"], dt_bias=hf["dt_bias"], norm={"scale": hf["norm.weight"]})
        out["out_proj"] = {"kernel": hf["out_proj.weight"].T.reshape(VALUE_HEADS, VALUE_DIM, 16)}
        for x, (a, b) in rows.items():
            weight = hf["conv1d.weight"][a:b]
            out[f"conv_{x}"] = qwen3_next_hf.conv_from_hf(weight, (4, *shapes[x]))
        return out

    check_layer_and_gradients_equal_hf(layer("grouped"), theirs, ours_of, 16, 2 * BATCH)


@pytest.mark.slow
@pytest.mark.parametrize("projection", gated_deltanet.PROJECTIONS)
def test_layer_decodes_from_its_cache_as_it_reads_the_sequence(projection):
    """A prompt of 6 (row 1 left-padded by 2 garbage positions), then one token at a time
    from the cached convolution inputs and state: the outputs of reading each row whole; a
    packed row's segments each as alone."""
    check_layer_decodes_from_its_cache_as_it_reads(layer(projection), 16)


@pytest.mark.slow
def test_layer_read_in_pieces_equals_read_whole():
    """Given slots (context parallelism's load-balanced order; here on one shard, in order)
    the layer reads a row as two pieces, the second from the state and the convolution
    inputs the first hands it (`linear_context_parallel`, folded without a mesh): the
    outputs of reading it whole, a row in one segment or packed (a segment starting at the
    second piece, another two positions into it), and packed the gradients."""
    module, length = layer("grouped"), 16
    rng = np.random.default_rng(7)
    h, weights = (rng.normal(size=(BATCH, length, 16)).astype(np.float32) for _ in range(2))
    params = module.init(jax.random.PRNGKey(0), h, masks.causal_mask(None, BATCH, length), None)
    params = nn.meta.unbox(params)
    # Slow decays (exp(A_log) 0.02-0.1 a position): the state reaches across the pieces.
    params["params"]["A_log"] = np.log(np.linspace(0.02, 0.1, VALUE_HEADS)).astype(np.float32)
    in_order = jnp.arange(length, dtype=jnp.int32)

    def loss(params, h, mask):
        out = module.apply(params, h, mask, None)
        return jnp.sum(out * weights), out

    whole = masks.causal_mask(None, BATCH, length)
    want = module.apply(params, h, whole, None)
    got = module.apply(params, h, whole.replace(slots=in_order), None)
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance(np.asarray(want), length))
    packed = masks.causal_mask(jnp.asarray([[1] * 8 + [2] * 8, [1] * 10 + [2] * 6]), BATCH, length)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    want_grads, want = grad(params, h, packed)
    grads, got = grad(params, h, packed.replace(slots=in_order))
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance(np.asarray(want), length))
    for ours, reference in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        atol = tolerance(np.asarray(reference), 2 * BATCH * length)
        np.testing.assert_allclose(ours, reference, rtol=0, atol=atol)


@pytest.mark.slow
def test_layer_decodes_from_its_state_slots_padding_leaving_them_as_they_were():
    """The serving engine's paged cache: each row's state and convolution inputs in a state
    slot, read and written back by prefill chunks (padding after a row's tokens) and a
    decode step; a padding row's slot is left bit for bit."""
    check_layer_decodes_from_its_state_slots(layer("grouped"), 16)
