"""The checks the two linear-attention families' tests make alike: their delta rules and
layers (tests/test_gated_deltanet.py, tests/test_kimi_delta.py: against HF's torch
references, packed segments, decoding from the cache and from the paged cache's state
slots) and their hybrid models (tests/test_hf_qwen3_next.py, tests/test_hf_kimi_linear.py:
packed training rows, greedy tokens through the serving engine, the config errors both
families share)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch

from flaxlm.checkpoints import hf
from flaxlm.models import gated_deltanet, masks, qwen3_next
from flaxlm.parallel.partitioning import Partitioner
from tests.hf_helpers import engine_tokens, hf_greedy_batch, paged_engine

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


def check_layer_decodes_from_its_state_slots(module: nn.Module, width: int) -> None:
    """Over the paged cache, three rows as the serving engine feeds them, each from its
    state slot (`models/state_slots.py`): row 0 (slot 2) a prompt of 6 in a chunk of 8 (2
    padding tokens after it), its next 3 tokens in another chunk (5 padding), then one
    token; row 1 (slot 1) a prompt of 8, then padding only (a row with nothing to read);
    row 2 padding throughout (slot 0, the scratch). Each row's real outputs are those of
    reading its tokens whole; padding leaves every state as it was: row 1's slot bit for
    bit, the scratch slot zeros. `width`: the layer's input width."""
    rng = np.random.default_rng(8)
    h = rng.normal(size=(2, 10, width)).astype(np.float32)
    garbage = 30 * rng.normal(size=(3, 8, width)).astype(np.float32)  # padding's inputs
    whole = masks.causal_mask(None, 2, 10)

    @jax.jit
    def init_and_read() -> tuple:
        params = module.init(jax.random.PRNGKey(0), h, whole, None)["params"]
        return params, module.apply({"params": params}, h, whole, None)

    params, read = init_and_read()
    read = np.asarray(read)  # (causal: each prefix's outputs too)

    def paged(slots: list[list[int]]) -> masks.Decoding:
        page_table = jnp.zeros((3, 1), jnp.int32)  # unread: no attention layer here
        return masks.Decoding(
            jnp.int32(0), jnp.zeros((3,), jnp.int32), 4, page_table, jnp.asarray(slots),
            num_pages=2, page_size=4, state_slots=jnp.asarray([2, 1, 0]), num_state_slots=4,
        )  # fmt: skip

    pad = [-1] * 8
    chunks = [  # (inputs, slots) of each dispatch
        (
            np.stack([np.concatenate([h[0, :6], garbage[0, :2]]), h[1, :8], garbage[2]]),
            [[0, 1, 2, 3, 4, 5, -1, -1], list(range(8)), pad],
        ),
        (
            np.stack([np.concatenate([h[0, 6:9], garbage[0, :5]]), *garbage[1:]]),
            [[6, 7, 8] + pad[:5], pad, pad],
        ),
        (np.stack([h[0, 9:], garbage[1, :1], garbage[2, :1]]), [[9], [-1], [-1]]),
    ]
    init = jax.jit(lambda: module.init(jax.random.PRNGKey(0), garbage, None, paged([pad] * 3)))
    cache = jax.tree.map(jnp.zeros_like, jax.eval_shape(init)["cache"])
    step = jax.jit(
        lambda cache, x, slots: module.apply(
            {"params": params, "cache": cache}, x, None, paged(slots), mutable=["cache"]
        )
    )
    outs, caches = [], []
    for x, slots in chunks:
        out, variables = step(cache, x, jnp.asarray(slots))
        cache = variables["cache"]
        outs.append(np.asarray(out))
        caches.append(cache)
    tol = tolerance(read, 10)
    decoded = np.concatenate([outs[0][0, :6], outs[1][0, :3], outs[2][0]])
    np.testing.assert_allclose(decoded, read[0], rtol=0, atol=tol)
    np.testing.assert_allclose(outs[0][1], read[1, :8], rtol=0, atol=tol)
    assert all(pool.shape[0] == 4 for pool in jax.tree.leaves(cache))
    for after_read, last in zip(jax.tree.leaves(caches[0]), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(last[1], after_read[1])  # row 1's: as its prompt left it
        np.testing.assert_array_equal(last[0], np.zeros_like(last[0]))  # the scratch


# ---------------------------------------------------------------------------- the hybrids

L, F = qwen3_next.LINEAR, qwen3_next.FULL
# Config errors both hybrids name alike (each family's `tiny_config`: four layers).
HYBRID_CONFIG_ERRORS = [
    (dict(layer_types=(L, F)), "layer_types"),
    (dict(layer_types=(L, L, "sliding_attention", F)), "layer_types"),
    (dict(linear_attention_chunk_size=0), "linear_attention_chunk_size"),
]


ENGINE_TOKENS = 8  # each prompt's greedy tokens through the engine


def check_engine_greedy_is_hf_generate(torch_model, path, vocab_size: int) -> None:
    """HF `generate`'s greedy tokens through the serving engine's pages and state slots
    (`hf_helpers.paged_engine`) for the hybrid saved at `path` (`torch_model`'s): prompts of
    7, 5, 7, 8 and 6 tokens, the third the first's (a follower: the prompt read once, its
    last page and the state copied), the fifth waiting for a row and taking the state slot
    of one that ended; rows start decoding at different dispatches. Then a second wave
    whose prompts share the first's and the second's first page resumes after it from the
    state snapshot kept there (a chunk ends there), and a new prompt is read whole. Short
    enough for few programs (page tables of up to 4 pages; a prompt over several prefill
    chunks: `check_layer_decodes_from_its_state_slots`)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, vocab_size, n).tolist() for n in (7, 5, 8, 6)]
    prompts.insert(2, prompts[0])
    fresh = rng.integers(1, vocab_size, 6).tolist()
    later = [prompts[0][:4] + [5, 6, 7], prompts[1][:4] + [8, 9], fresh]
    expected = hf_greedy_batch(torch_model, prompts + later, ENGINE_TOKENS)
    model, params = hf.from_pretrained(path, Partitioner(devices=jax.devices()[:1]))
    assert model.paged_refusal() is None
    with paged_engine(model, params) as engine:
        assert engine_tokens(engine, prompts, ENGINE_TOKENS) == expected[:5]
        assert engine.scheduler.cached_tokens == 0
        assert engine_tokens(engine, later, ENGINE_TOKENS) == expected[5:]
        assert engine.scheduler.cached_tokens == 4 + 4


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
