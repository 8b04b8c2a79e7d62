"""The Kimi Delta Attention kernels and layer (`models/kimi_delta.py`) against transformers'
torch references (`chunk_kimi_delta_attention`, `recurrent_kimi_delta_attention`,
`KimiLinearRMSNormGated`, `KimiLinearDeltaAttention`): the chunked form at several chunk
sizes (within one block of positions, across blocks, one that does not divide the length)
equals the recurrent one and HF's, and so do its gradients; packed segments restart the
state and the convolution; the layer is HF's, decodes one token at a time from its cache as
it reads the whole sequence (left padding unseen), and refuses the paged cache. Context
parallelism: tests/test_linear_context_parallel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi

from flaxlm.models import gated_deltanet, kimi_delta, masks, qwen3_next_hf

EPS = float(np.finfo(np.float32).eps)
BATCH, LENGTH, HEADS, KEY_DIM, VALUE_DIM = 2, 37, 2, 8, 6


def tolerance(reference: np.ndarray, depth: int) -> float:
    """float32 round-off through `depth` sequential updates of values of the reference's
    size (a state carried over `depth` positions)."""
    return 4 * EPS * depth * max(1.0, float(np.abs(reference).max()))


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


def hf_rule(rule, inputs, **kwargs):
    q, k, v, g, beta, state = (torch.from_numpy(x) for x in inputs)
    out, final = rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, **kwargs,
    )  # fmt: skip
    return out.numpy(), final.numpy()


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 32, 64])
def test_chunked_rule_equals_recurrent_and_hf(inputs, chunk_size):
    """Chunks of 1, 5 (37 = 7 x 5 + 2), 16 (one block of pairs), 32 (two: 37 = 32 + 5) and
    64 (four, one padded chunk) give HF's outputs and final state, chunked (at its own chunk
    size) and recurrent alike."""
    q, k, v, g, beta, state = inputs
    hf_out, hf_state = hf_rule(hf_kimi.chunk_kimi_delta_attention, inputs, chunk_size=chunk_size)
    rec_out, rec_state = hf_rule(hf_kimi.recurrent_kimi_delta_attention, inputs)
    qn, kn = as_rule_reads(q, k)
    out, final = kimi_delta.chunk_kimi_delta_rule(
        qn, kn, v, g, beta, chunk_size=chunk_size, initial_state=state
    )
    tol = tolerance(rec_out, LENGTH)
    for ours, theirs in ((out, hf_out), (out, rec_out), (final, hf_state), (final, rec_state)):
        np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=tol)
    out, final = kimi_delta.recurrent_kimi_delta_rule(qn, kn, v, g, beta, state)
    np.testing.assert_allclose(np.asarray(out), rec_out, rtol=0, atol=tol)
    np.testing.assert_allclose(np.asarray(final), rec_state, rtol=0, atol=tol)


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
    rec_out, rec_state = kimi_delta.recurrent_kimi_delta_rule(qn, kn, v, g, beta, state)
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
    reference = jax.grad(loss, argnums)(kimi_delta.recurrent_kimi_delta_rule, *inputs)
    for got, want in zip(ours, reference, strict=True):
        want = np.asarray(want)
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=tolerance(want, 2 * LENGTH))


def test_packed_segments_restart_the_state_and_the_convolution(inputs):
    """Rows packed with segments 1 | 2 | 3 (boundaries inside a block of 16 positions, across
    blocks and chunks of 32): each segment's outputs are those of the segment alone, from a
    zero state."""
    q, k, v, g, beta, _ = inputs
    qn, kn = as_rule_reads(q, k)
    bounds = ((0, 10), (10, 25), (25, LENGTH))
    segments = np.concatenate([np.full(stop - start, i + 1) for i, (start, stop) in
                               enumerate(bounds)])  # fmt: skip
    runs = gated_deltanet.segment_runs(jnp.asarray(np.stack([segments, segments])))
    out, _ = kimi_delta.chunk_kimi_delta_rule(qn, kn, v, g, beta, chunk_size=32, runs=runs)
    rec, _ = kimi_delta.recurrent_kimi_delta_rule(qn, kn, v, g, beta, runs=runs)
    for start, stop in bounds:
        piece = [x[:, start:stop] for x in (qn, kn, v, g, beta)]
        alone, _ = kimi_delta.recurrent_kimi_delta_rule(*piece)
        tol = tolerance(np.asarray(alone), stop - start)
        np.testing.assert_allclose(np.asarray(out[:, start:stop]), alone, rtol=0, atol=tol)
        np.testing.assert_allclose(np.asarray(rec[:, start:stop]), alone, rtol=0, atol=tol)


def test_sigmoid_gated_rms_norm_equals_hf():
    rng = np.random.default_rng(4)
    x, gate = (rng.normal(size=(3, 5, KEY_DIM)).astype(np.float32) for _ in range(2))
    scale = rng.normal(size=(KEY_DIM,)).astype(np.float32)
    norm = hf_kimi.KimiLinearRMSNormGated(KEY_DIM, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(scale))
        theirs = norm(torch.from_numpy(x), torch.from_numpy(gate)).numpy()
    ours = kimi_delta.SigmoidGatedRMSNorm(1e-5).apply({"params": {"scale": scale}}, x, gate)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=4 * EPS * np.abs(theirs).max())


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
    hf_params = {name: p.detach().numpy() for name, p in theirs.named_parameters()}

    length = 21
    rng = np.random.default_rng(6)
    h, weights = (rng.normal(size=(BATCH, length, WIDTH)).astype(np.float32) for _ in range(2))
    mask = masks.causal_mask(None, BATCH, length)

    def loss(params, h):
        out = layer().apply({"params": params}, h, mask, None)
        return jnp.sum(out * weights), out

    (grads, grad_h), out = jax.grad(loss, argnums=(0, 1), has_aux=True)(ours_of(hf_params), h)
    h_torch = torch.from_numpy(h).requires_grad_(True)
    expected = theirs(h_torch)
    (expected * torch.from_numpy(weights)).sum().backward()
    expected = expected.detach().numpy()
    np.testing.assert_allclose(out, expected, rtol=0, atol=tolerance(expected, length))
    hf_grads = {name: p.grad.numpy() for name, p in theirs.named_parameters()}
    pairs = [(grad_h, h_torch.grad.numpy())]
    pairs += list(zip(jax.tree.leaves(grads), jax.tree.leaves(ours_of(hf_grads)), strict=True))
    for got, reference in pairs:
        np.testing.assert_allclose(got, reference, rtol=0, atol=tolerance(reference, 2 * length))


@pytest.mark.slow
def test_layer_decodes_from_its_cache_as_it_reads_the_sequence():
    """A prompt of 6 (row 1 left-padded by 2 garbage positions), then one token at a time
    from the cached convolution inputs and state: the outputs of reading each row whole; a
    packed row's segments each as alone."""
    module, length, prompt = layer(), 11, 6
    h = np.random.default_rng(5).normal(size=(BATCH, length, WIDTH)).astype(np.float32)
    whole = masks.causal_mask(None, BATCH, length)
    params = module.init(jax.random.PRNGKey(0), h, whole, None)["params"]
    read = module.apply({"params": params}, h, whole, None)
    row1 = module.apply({"params": params}, h[1:, 2:], masks.causal_mask(None, 1, length - 2), None)

    start = jnp.asarray([0, 2], jnp.int32)
    where = masks.Decoding(jnp.int32(0), start, length)
    cache = module.init(jax.random.PRNGKey(0), h[:, :prompt], whole, where)["cache"]
    cache = jax.tree.map(jnp.zeros_like, cache)
    assert all(x.ndim == 4 for x in jax.tree.leaves(cache))  # rows in axis ndim - 4
    outs = []
    for index, stop in [(0, prompt), *((t, t + 1) for t in range(prompt, length))]:
        where = masks.Decoding(jnp.int32(index), start, length)
        out, variables = module.apply(
            {"params": params, "cache": cache}, h[:, index:stop], whole, where, mutable=["cache"]
        )
        cache = variables["cache"]
        outs.append(out)
    decoded = np.concatenate(outs, axis=1)
    tol = tolerance(np.asarray(read), length)
    np.testing.assert_allclose(decoded[0], read[0], rtol=0, atol=tol)
    np.testing.assert_allclose(decoded[1, 2:], row1[0], rtol=0, atol=tol)

    segments = jnp.asarray([[1] * 4 + [2] * 7] * BATCH)
    packed = module.apply({"params": params}, h, masks.causal_mask(segments, BATCH, length), None)
    alone = module.apply({"params": params}, h[:, 4:], masks.causal_mask(None, BATCH, 7), None)
    np.testing.assert_allclose(packed[:, :4], read[:, :4], rtol=0, atol=tol)
    np.testing.assert_allclose(packed[:, 4:], alone, rtol=0, atol=tol)


def test_layer_refuses_the_paged_cache():
    module = layer()
    h = np.zeros((1, 4, WIDTH), np.float32)
    mask = masks.causal_mask(None, 1, 4)
    one = jnp.zeros((1, 1), jnp.int32)
    paged = masks.Decoding(jnp.int32(0), one[0], 4, one, one, 2, 4)
    with pytest.raises(ValueError, match="contiguous cache"):
        module.init(jax.random.PRNGKey(0), h, mask, paged)
