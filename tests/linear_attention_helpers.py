"""The checks the two linear-attention families' tests make alike: their delta rules and
layers (tests/test_gated_deltanet.py, tests/test_kimi_delta.py: against HF's torch
references, packed segments, decoding from the cache, the paged cache refused) and their
hybrid models (tests/test_hf_qwen3_next.py, tests/test_hf_kimi_linear.py: packed training
rows, the serving engine's refusal, the config errors both families share)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from flaxlm.inference.scheduler import Scheduler
from flaxlm.models import base, gated_deltanet, masks, qwen3_next
from flaxlm.parallel.partitioning import Partitioner

EPS = float(np.finfo(np.float32).eps)
ROWS = 2  # the rows of each layer check


def tolerance(reference: np.ndarray, depth: int) -> float:
    """float32 round-off through `depth` sequential updates of values of the reference's
    size (a state carried over `depth` positions)."""
    return 4 * EPS * depth * max(1.0, float(np.abs(reference).max()))


# ---------------------------------------------------------------------------- the rules


def hf_rule(rule, inputs, **kwargs):
    """HF's torch rule on numpy (q, k, v, g, beta, initial state), q and k L2-normalised in
    the kernel: (out, final state) as numpy."""
    q, k, v, g, beta, state = (torch.from_numpy(x) for x in inputs)
    out, final = rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, **kwargs,
    )  # fmt: skip
    return out.numpy(), final.numpy()


def check_chunked_rule_equals_recurrent_and_hf(
    chunked, hf_chunked, hf_recurrent, inputs, as_rule_reads, chunk_size: int
) -> None:
    """Our `chunked` rule (at `chunk_size`) and the recurrent one give HF's chunked (at
    the same chunk size) and recurrent outputs and final state; `as_rule_reads(q, k)`: q and
    k as our rules read them."""
    q, k, v, g, beta, state = inputs
    hf_out, hf_state = hf_rule(hf_chunked, inputs, chunk_size=chunk_size)
    rec_out, rec_state = hf_rule(hf_recurrent, inputs)
    qn, kn = as_rule_reads(q, k)
    out, final = chunked(qn, kn, v, g, beta, chunk_size=chunk_size, initial_state=state)
    tol = tolerance(rec_out, q.shape[1])
    for ours, theirs in ((out, hf_out), (out, rec_out), (final, hf_state), (final, rec_state)):
        np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=tol)
    out, final = gated_deltanet.recurrent_gated_delta_rule(qn, kn, v, g, beta, state)
    np.testing.assert_allclose(np.asarray(out), rec_out, rtol=0, atol=tol)
    np.testing.assert_allclose(np.asarray(final), rec_state, rtol=0, atol=tol)


def check_packed_segments_restart_the_rule(
    chunked, rule_inputs, chunk_size: int
) -> tuple[jax.Array, tuple[tuple[int, int], ...]]:
    """Rows packed with segments 1 | 2 | 3 (starting at 0, 10 and 25): `chunked` (at
    `chunk_size`) and the recurrent rule give each segment the outputs of the segment alone,
    from a zero state. `rule_inputs`: q, k, v, g, beta as the rules read them. Returns the
    rows' segment runs and the segments' (start, stop)."""
    length = rule_inputs[0].shape[1]
    bounds = ((0, 10), (10, 25), (25, length))
    segments = np.concatenate([np.full(stop - start, i + 1) for i, (start, stop) in
                               enumerate(bounds)])  # fmt: skip
    runs = gated_deltanet.segment_runs(jnp.asarray(np.stack([segments] * ROWS)))
    out, _ = chunked(*rule_inputs, chunk_size=chunk_size, runs=runs)
    rec, _ = gated_deltanet.recurrent_gated_delta_rule(*rule_inputs, runs=runs)
    for start, stop in bounds:
        piece = [x[:, start:stop] for x in rule_inputs]
        alone, _ = gated_deltanet.recurrent_gated_delta_rule(*piece)
        tol = tolerance(np.asarray(alone), stop - start)
        np.testing.assert_allclose(np.asarray(out[:, start:stop]), alone, rtol=0, atol=tol)
        np.testing.assert_allclose(np.asarray(rec[:, start:stop]), alone, rtol=0, atol=tol)
    return runs, bounds


# ---------------------------------------------------------------------------- the layers


def check_gated_norm_equals_hf(ours: nn.Module, theirs: torch.nn.Module, width: int) -> None:
    """Our gated RMSNorm and HF's (torch) with the same random scale, on random heads of
    `width` and gates."""
    rng = np.random.default_rng(4)
    x, gate = (rng.normal(size=(3, 5, width)).astype(np.float32) for _ in range(2))
    scale = rng.normal(size=(width,)).astype(np.float32)
    with torch.no_grad():
        theirs.weight.copy_(torch.from_numpy(scale))
        expected = theirs(torch.from_numpy(x), torch.from_numpy(gate)).numpy()
    got = ours.apply({"params": {"scale": scale}}, x, gate)
    np.testing.assert_allclose(got, expected, rtol=0, atol=4 * EPS * np.abs(expected).max())


def check_layer_and_gradients_equal_hf(
    module: nn.Module, theirs: torch.nn.Module, ours_of, width: int, depth_per_position: int
) -> None:
    """HF's layer `theirs` (torch, float32) and ours (`module`, its params `ours_of(HF's)`)
    on 21 positions of two rows: the output, and the gradients of a weighted sum of it with
    respect to the input and every param (each carried back through `depth_per_position`
    x length sequential updates)."""
    hf_params = {name: p.detach().numpy() for name, p in theirs.named_parameters()}
    length = 21
    rng = np.random.default_rng(6)
    h, weights = (rng.normal(size=(ROWS, length, width)).astype(np.float32) for _ in range(2))
    mask = masks.causal_mask(None, ROWS, length)

    def loss(params, h):
        out = module.apply({"params": params}, h, mask, None)
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
    depth = depth_per_position * length
    for got, reference in pairs:
        np.testing.assert_allclose(got, reference, rtol=0, atol=tolerance(reference, depth))


def check_layer_decodes_from_its_cache_as_it_reads(module: nn.Module, width: int) -> None:
    """A prompt of 6 (row 1 left-padded by 2 garbage positions), then one token at a time
    from the cached convolution inputs and state: the outputs of reading each row whole; a
    packed row's segments each as alone. `width`: the layer's input width."""
    length, prompt = 11, 6
    h = np.random.default_rng(5).normal(size=(ROWS, length, width)).astype(np.float32)
    whole = masks.causal_mask(None, ROWS, length)
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

    segments = jnp.asarray([[1] * 4 + [2] * 7] * ROWS)
    packed = module.apply({"params": params}, h, masks.causal_mask(segments, ROWS, length), None)
    alone = module.apply({"params": params}, h[:, 4:], masks.causal_mask(None, ROWS, 7), None)
    np.testing.assert_allclose(packed[:, :4], read[:, :4], rtol=0, atol=tol)
    np.testing.assert_allclose(packed[:, 4:], alone, rtol=0, atol=tol)


def check_layer_refuses_the_paged_cache(module: nn.Module, width: int) -> None:
    """Decoding over a paged cache: a ValueError that names the contiguous cache."""
    h = np.zeros((1, 4, width), np.float32)
    mask = masks.causal_mask(None, 1, 4)
    one = jnp.zeros((1, 1), jnp.int32)
    paged = masks.Decoding(jnp.int32(0), one[0], 4, one, one, 2, 4)
    with pytest.raises(ValueError, match="contiguous cache"):
        module.init(jax.random.PRNGKey(0), h, mask, paged)


# ---------------------------------------------------------------------------- the hybrids

L, F = qwen3_next.LINEAR, qwen3_next.FULL
# Config errors both hybrids name alike (each family's `tiny_config`: four layers).
HYBRID_CONFIG_ERRORS = [
    (dict(layer_types=(L, F)), "layer_types"),
    (dict(layer_types=(L, L, "sliding_attention", F)), "layer_types"),
    (dict(linear_attention_chunk_size=0), "linear_attention_chunk_size"),
    (dict(scan_layers=True), "scan_layers"),
]


def check_serving_engine_refuses_to_page(config, refusal: str) -> None:
    """The paged engine names why a hybrid of `config` is not paged (`refusal`, the recurrent
    state); the serve run then decodes in fixed batches."""
    model = base.DecoderOnlyModel(config)
    assert model.paged_refusal() == refusal
    partitioner = Partitioner(mesh_shape=(1, 1, 1), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="recurrent state"):
        Scheduler(model, None, partitioner)


def packed_batch(seed: int = 1) -> dict[str, np.ndarray]:
    """Eight rows of 32 positions, each two or three examples packed (seqio's features)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(8):
        cuts = np.sort(rng.choice(np.arange(4, 28), size=rng.integers(1, 3), replace=False))
        bounds = [0, *cuts.tolist(), 32]
        rows.append(np.concatenate([np.full(b - a, i + 1) for i, (a, b) in
                                    enumerate(zip(bounds, bounds[1:]))]))  # fmt: skip
    segments = np.stack(rows).astype(np.int32)
    starts = np.concatenate([np.ones((8, 1), bool), segments[:, 1:] != segments[:, :-1]], 1)
    index = np.arange(32)[None, :]
    positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    tokens = rng.integers(1, 300, size=(8, 32)).astype(np.int32)
    return {
        "decoder_input_tokens": tokens,
        "decoder_target_tokens": tokens,
        "decoder_segment_ids": segments,
        "decoder_positions": positions.astype(np.int32),
        "decoder_loss_weights": np.ones((8, 32), np.int32),
    }
