"""Decoding with the KV cache: token-for-token against transformers' generate, against
re-running the whole sequence, sharded against unsharded; sampling; beam search; score."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from flaxlm.checkpoints import hf
from flaxlm.inference import generation
from flaxlm.models import decoding
from flaxlm.parallel.partitioning import Partitioner
from tests.helpers import jaxpr_equations, tiny_gptj
from tests.hf_helpers import decoder_batch, padded_batch
from tests.test_hf_gemma import tiny_hf_gemma
from tests.test_hf_gpt2 import tiny_hf_gpt2
from tests.test_hf_gptj import tiny_hf_gptj
from tests.test_hf_llama import VARIANTS as LLAMA_VARIANTS
from tests.test_hf_llama import tiny_hf_llama
from tests.test_hf_opt import tiny_hf_opt
from tests.test_hf_t5 import tiny_hf_t5

NEW_TOKENS = 20
PROMPT_LENGTHS = (5, 12, 3, 9)


def _llama(variant):
    kwargs = dict(LLAMA_VARIANTS[variant])
    return lambda tmp: tiny_hf_llama(tmp, kwargs.pop("model_type", "llama"), **kwargs)


FAMILIES = {
    "gptj": lambda tmp: tiny_hf_gptj(tmp),
    "opt_pre_ln": lambda tmp: tiny_hf_opt(tmp, "pre_ln"),
    "opt_post_ln_proj": lambda tmp: tiny_hf_opt(tmp, "post_ln_proj"),
    "gpt2": lambda tmp: tiny_hf_gpt2(tmp, "standard"),
    "llama_gqa": _llama("gqa_theta"),
    "llama3_rope": _llama("llama3_rope"),
    # A window of 8 over prompts of up to 12 tokens plus 20 new ones.
    "mistral_window": _llama("mistral_window"),
    "gemma_mqa": lambda tmp: tiny_hf_gemma(tmp, num_key_value_heads=1),
}
SHARDED = {
    "gptj": FAMILIES["gptj"],
    # Grouped-query attention whose 4 key/value heads split over tensor=4.
    "llama_gqa": lambda tmp: tiny_hf_llama(tmp, num_attention_heads=8, num_key_value_heads=4),
    "gemma_mqa": FAMILIES["gemma_mqa"],
}
# The mesh each decodes on: GPT-J's has a `sequence` axis (context parallelism, which
# training uses and decoding leaves alone: its prompts and cache are split like any array).
MESHES = {
    "gptj": ((1, 2, 2, 2), ("data", "fsdp", "sequence", "tensor")),
    "llama_gqa": ((1, 2, 4), ("data", "fsdp", "tensor")),
    "gemma_mqa": ((1, 2, 4), ("data", "fsdp", "tensor")),
}


def hf_greedy(torch_model, ids, lengths, max_new_tokens=NEW_TOKENS, **kwargs):
    """transformers' greedy generate of each prompt alone, new tokens only, padded with 0
    after EOS (as ours)."""
    out = np.zeros((len(lengths), max_new_tokens), np.int64)
    for row, n in enumerate(lengths):
        prompt = torch.from_numpy(ids[row : row + 1, :n])
        with torch.no_grad():
            generated = torch_model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                **kwargs,
            )
        new = generated[0, n:].numpy()
        out[row, : len(new)] = new
    return out


def naive_greedy(model, params, ids, lengths, max_new_tokens):
    """Greedy decoding that re-runs the whole sequence for every token (no cache)."""
    logits_fn = jax.jit(model.compute_logits)
    out = np.zeros((len(lengths), max_new_tokens), np.int64)
    # One fixed-size buffer per row (causal attention: what follows a position is unseen).
    buffer = np.zeros((1, max(lengths) + max_new_tokens), np.int32)
    for row, n in enumerate(lengths):
        buffer[:] = 0
        buffer[0, :n] = ids[row, :n]
        for t in range(max_new_tokens):
            logits = np.asarray(logits_fn(params, {"decoder_input_tokens": buffer}))
            token = int(np.argmax(logits[0, n + t - 1]))
            out[row, t] = token
            buffer[0, n + t] = token
            if token in model.eos_ids:
                break
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers_for_prompts_of_different_lengths(tmp_path, family):
    torch_model, path = FAMILIES[family](tmp_path)
    model, params = hf.from_pretrained(path)
    vocab = torch_model.config.vocab_size
    ids, _ = padded_batch(vocab, PROMPT_LENGTHS, seed=1)
    ours = generation.generate(model, params, {"inputs": ids}, max_new_tokens=NEW_TOKENS)
    theirs = hf_greedy(torch_model, ids, PROMPT_LENGTHS)
    np.testing.assert_array_equal(ours, theirs)
    # The padded prompts decoded as a batch, and a prompt alone, agree: row 1 (12 tokens, the
    # batch's width) without the other prompts, its copies filling the batch (the decoder
    # compiled above, not a second one for one row).
    alone = np.repeat(ids[1:2, :12], len(PROMPT_LENGTHS), axis=0)
    alone = generation.generate(model, params, {"inputs": alone}, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(alone, np.broadcast_to(ours[1], alone.shape))


def test_eos_stops_a_row_and_pads_after_it(tmp_path):
    torch_model, path = tiny_hf_gpt2(tmp_path, "standard")
    model, params = hf.from_pretrained(path)
    ids, _ = padded_batch(torch_model.config.vocab_size, PROMPT_LENGTHS, seed=1)
    free = generation.generate(
        model, params, {"inputs": ids}, max_new_tokens=NEW_TOKENS, eos_id=None
    )
    # Make the third token of row 0 the EOS: the row stops there, the others go on.
    eos = int(free[0, 2])
    stopped = generation.generate(
        model, params, {"inputs": ids}, max_new_tokens=NEW_TOKENS, eos_id=eos
    )
    np.testing.assert_array_equal(stopped[0, :3], free[0, :3])
    assert (stopped[0, 3:] == 0).all()
    theirs = hf_greedy(torch_model, ids, PROMPT_LENGTHS, eos_token_id=eos)
    np.testing.assert_array_equal(stopped, theirs)
    # HF's min_new_tokens: no EOS before it (row 0 goes on past its third token).
    held = generation.generate(
        model, params, {"inputs": ids}, max_new_tokens=NEW_TOKENS, eos_id=eos, min_new_tokens=5
    )
    theirs = hf_greedy(torch_model, ids, PROMPT_LENGTHS, eos_token_id=eos, min_new_tokens=5)
    np.testing.assert_array_equal(held, theirs)
    assert held[0, 2] != eos and (held[0] != 0).sum() > 3


@pytest.mark.parametrize("family", ["llama_gqa", "gptj"])
def test_cached_decoding_equals_rerunning_the_sequence(tmp_path, family):
    _, path = FAMILIES[family](tmp_path)
    # Scanned layers and a remat policy change neither the params nor the tokens.
    model, params = hf.from_pretrained(path, scan_layers=True, remat_policy="full")
    ids, _ = padded_batch(model.config.real_vocab_size, (6, 2, 10), seed=2)
    ours = generation.generate(model, params, {"inputs": ids}, max_new_tokens=12)
    np.testing.assert_array_equal(ours, naive_greedy(model, params, ids, (6, 2, 10), 12))
    # Decoding runs over unrolled layers: the scanned stack laid out as the unrolled model's.
    _, unrolled = hf.from_pretrained(path)
    laid_out = model.decoding_params(params)
    assert jax.tree.structure(laid_out) == jax.tree.structure(unrolled)
    for a, b in zip(jax.tree.leaves(laid_out), jax.tree.leaves(unrolled)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SHARDED))
def test_sharded_decoding_equals_unsharded(tmp_path, family):
    _, path = SHARDED[family](tmp_path)
    model, params = hf.from_pretrained(path)
    ids, _ = padded_batch(model.config.real_vocab_size, PROMPT_LENGTHS, seed=3)
    single = generation.generate(model, params, {"inputs": ids}, max_new_tokens=16)
    mesh_shape, axis_names = MESHES[family]
    partitioner = Partitioner(mesh_shape=mesh_shape, mesh_axis_names=axis_names)
    sharded_model, sharded_params = hf.from_pretrained(path, partitioner)
    kernel = jax.tree.leaves(sharded_params)[0]
    assert len(kernel.sharding.device_set) == 8
    sharded = generation.generate(
        sharded_model, sharded_params, {"inputs": ids}, max_new_tokens=16, partitioner=partitioner
    )
    np.testing.assert_array_equal(sharded, single)
    # Beam search too, under the mesh.
    beams = generation.generate(model, params, {"inputs": ids}, max_new_tokens=8, num_beams=3)
    sharded_beams = generation.generate(
        sharded_model,
        sharded_params,
        {"inputs": ids},
        max_new_tokens=8,
        num_beams=3,
        partitioner=partitioner,
    )
    np.testing.assert_array_equal(sharded_beams, beams)


@pytest.mark.slow
@pytest.mark.parametrize("version", ["v1_0", "v1_1"])
def test_t5_greedy_and_beam_search_match_transformers(tmp_path, version):
    torch_model, path = tiny_hf_t5(tmp_path, version)
    model, params = hf.from_pretrained(path)
    lengths = (10, 4, 12)
    ids, mask = padded_batch(torch_model.config.vocab_size, lengths, seed=4)
    batch = {"inputs": ids}
    for num_beams in (1, 4):
        ours = generation.generate(
            model, params, batch, max_new_tokens=NEW_TOKENS, num_beams=num_beams
        )
        with torch.no_grad():
            theirs = torch_model.generate(
                torch.from_numpy(ids),
                attention_mask=torch.from_numpy(mask),
                max_new_tokens=NEW_TOKENS,
                num_beams=num_beams,
                do_sample=False,
                decoder_start_token_id=0,
                pad_token_id=0,
                # transformers sizes T5's cache by the encoder's depth; v1_1 here has a
                # deeper decoder, so HF re-runs the sequence instead.
                use_cache=version == "v1_0",
            ).numpy()[:, 1:]  # drop the decoder start token
        expected = np.zeros_like(ours)
        expected[:, : theirs.shape[1]] = theirs
        np.testing.assert_array_equal(ours, expected, err_msg=f"num_beams={num_beams}")


def test_beam_search_with_length_penalty_matches_transformers_decoder_only(tmp_path):
    torch_model, path = tiny_hf_llama(tmp_path, **LLAMA_VARIANTS["gqa_theta"])
    model, params = hf.from_pretrained(path)
    ids, _ = padded_batch(torch_model.config.vocab_size, (7,), seed=5)
    # An EOS that the beams meet early, so finished hypotheses compete under the penalty.
    free = generation.generate(model, params, {"inputs": ids}, max_new_tokens=10, eos_id=None)
    eos = int(free[0, 3])
    for penalty in (0.5, 2.0):
        ours = generation.generate(
            model,
            params,
            {"inputs": ids},
            max_new_tokens=10,
            num_beams=4,
            length_penalty=penalty,
            eos_id=eos,
        )
        theirs = hf_greedy(
            torch_model, ids, (7,), 10, num_beams=4, length_penalty=penalty, eos_token_id=eos
        )
        np.testing.assert_array_equal(ours, theirs, err_msg=f"length_penalty={penalty}")


def test_sampling_is_seeded_and_respects_top_k(tmp_path):
    _, path = tiny_hf_gpt2(tmp_path, "standard")
    model, params = hf.from_pretrained(path)
    ids, _ = padded_batch(model.config.real_vocab_size, PROMPT_LENGTHS, seed=6)
    batch = {"inputs": ids}
    key = jax.random.PRNGKey(7)
    a = generation.generate(model, params, batch, max_new_tokens=12, temperature=1.0, rng=key)
    b = generation.generate(model, params, batch, max_new_tokens=12, temperature=1.0, rng=key)
    c = generation.generate(
        model, params, batch, max_new_tokens=12, temperature=1.0, rng=jax.random.PRNGKey(8)
    )
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    greedy = generation.generate(model, params, batch, max_new_tokens=12)
    top1 = generation.generate(
        model, params, batch, max_new_tokens=12, temperature=0.7, top_k=1, rng=key
    )
    np.testing.assert_array_equal(top1, greedy)
    tiny_p = generation.generate(
        model, params, batch, max_new_tokens=12, temperature=1.3, top_p=1e-6, rng=key
    )
    np.testing.assert_array_equal(tiny_p, greedy)


def test_repetition_penalty_matches_transformers(tmp_path):
    """HF's repetition penalty over each row's own prompt and new tokens (the batch's
    padding not among them), greedy, token for token; beams refuse it."""
    torch_model, path = tiny_hf_gpt2(tmp_path, "standard")
    model, params = hf.from_pretrained(path)
    ids, _ = padded_batch(model.config.real_vocab_size, PROMPT_LENGTHS, seed=1)
    ours = generation.generate(
        model, params, {"inputs": ids}, max_new_tokens=NEW_TOKENS, repetition_penalty=0.6
    )
    theirs = hf_greedy(torch_model, ids, PROMPT_LENGTHS, repetition_penalty=0.6)
    np.testing.assert_array_equal(ours, theirs)
    assert (theirs != hf_greedy(torch_model, ids, PROMPT_LENGTHS)).any()  # it changes tokens
    with pytest.raises(ValueError, match="not supported with beam search"):
        generation.GenerationSettings(num_beams=2, repetition_penalty=1.2)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        generation.GenerationSettings(repetition_penalty=0.0)


def test_filter_logits_keeps_top_k_and_the_top_p_nucleus():
    logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = lambda x: np.isfinite(np.asarray(x)) & (np.asarray(x) > -1e30)  # noqa: E731
    assert kept(decoding.filter_logits(logits, top_k=2)).tolist() == [[1, 1, 0, 0, 0]]
    # 0.5 + 0.2 = 0.7 < 0.8, so the third token is needed to reach 0.8.
    assert kept(decoding.filter_logits(logits, top_p=0.8)).tolist() == [[1, 1, 1, 0, 0]]
    assert kept(decoding.filter_logits(logits, top_p=0.5)).tolist() == [[1, 0, 0, 0, 0]]
    assert kept(decoding.filter_logits(logits, top_k=3, top_p=0.6)).tolist() == [[1, 1, 0, 0, 0]]


def test_sampled_tokens_follow_the_model_distribution():
    """With a fixed first-step distribution, sample frequencies approach softmax(logits/T)."""
    probs = np.asarray([0.6, 0.3, 0.1])
    logits = jnp.log(jnp.asarray(probs))[None].repeat(4000, 0)
    config = decoding.DecodingConfig(max_new_tokens=1, temperature=1.0)
    tokens = decoding.choose_tokens(logits, jax.random.PRNGKey(0), config)
    freq = np.bincount(np.asarray(tokens), minlength=3) / 4000
    np.testing.assert_allclose(freq, probs, atol=0.03)


def _output_shapes(jaxpr) -> list[tuple[int, ...]]:
    """The output shape of every equation of `jaxpr` and the jaxprs inside it."""
    return [tuple(v.aval.shape) for e in jaxpr_equations(jaxpr) for v in e.outvars]


def _stepping_conds(jaxpr) -> list:
    """The `cond`s in `jaxpr` with a matmul in a branch: a model step taken conditionally."""
    return [
        e
        for e in jaxpr_equations(jaxpr)
        if e.primitive.name == "cond"
        and any(
            d.primitive.name == "dot_general"
            for branch in e.params["branches"]
            for d in jaxpr_equations(branch.jaxpr)
        )
    ]


def test_decoding_stacks_no_kernels_steps_unconditionally_and_prefills_one_position():
    """A decoding step runs one product per projection (`layers.decoding_products`): the
    stacked kernels training contracts at once would be a copy of them at every token. The
    decode loops (sampling and beam search) step the model outside any `cond`: around it,
    XLA:GPU copies each layer's whole KV cache at every step (seen in the H100's compiled
    program, `benchmarks/decode_hlo.py`; not on CPU). The prefill's head reads the prompts'
    last position alone, the batch path's and the paged engine's."""
    model = tiny_gptj(vocab_size=256)  # not the MLP's width
    cfg = model.config
    shapes = model.example_batch_shapes()
    params = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0), shapes))
    stacked = (3, cfg.hidden_size, cfg.num_heads, cfg.hidden_size // cfg.num_heads)  # q, k, v
    rows, prompt_len = 4, 12
    tokens = jnp.zeros((rows, prompt_len), jnp.int32)

    forward = jax.make_jaxpr(lambda p: model.module.apply({"params": p}, tokens))(params)
    assert stacked in _output_shapes(forward.jaxpr)  # what training stacks

    config = decoding.DecodingConfig(max_new_tokens=4)
    decode = jax.make_jaxpr(
        lambda p: generation.decode_tokens(
            model, p, tokens, jnp.full((rows,), prompt_len), jax.random.PRNGKey(0), config=config
        )
    )(params)
    cache = model.paged_cache(num_pages=8, page_size=4)
    slots = jnp.broadcast_to(jnp.arange(prompt_len), (rows, prompt_len))
    table = jnp.zeros((rows, 4), jnp.int32)
    paged = jax.make_jaxpr(
        lambda p, c: model.paged_logits(p, c, tokens, slots, table, jnp.full((rows,), 11))
    )(params, cache)
    beams = jax.make_jaxpr(
        lambda p: generation.decode_tokens(
            model,
            p,
            jnp.repeat(tokens, 2, axis=0),
            jnp.full((2 * rows,), prompt_len),
            jax.random.PRNGKey(0),
            config=dataclasses.replace(config, num_beams=2),
        )
    )(params)
    assert not _stepping_conds(decode.jaxpr) and not _stepping_conds(beams.jaxpr)
    for jaxpr in (decode.jaxpr, paged.jaxpr):
        shapes = _output_shapes(jaxpr)
        assert stacked not in shapes
        assert not [s for s in shapes if s[-1:] == (cfg.vocab_size,) and prompt_len in s]
        assert (rows, 1, cfg.vocab_size) in shapes  # the head, once


def test_a_one_row_decoding_step_takes_half_precision_products_in_float32():
    """`layers.decoding_products`: at batch 1 a bfloat16 model's projections are
    matrix-vector products, asked of XLA in float32 (in bfloat16 XLA:GPU wrote a weight-sized
    intermediate); two rows keep bfloat16 products (matmuls either way)."""
    model = tiny_gptj(vocab_size=256, dtype="bfloat16")
    shapes = model.example_batch_shapes()
    params = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0), shapes))
    config = decoding.DecodingConfig(max_new_tokens=4)

    def step_products(rows):
        tokens = jnp.zeros((rows, 12), jnp.int32)
        jaxpr = jax.make_jaxpr(
            lambda p: generation.decode_tokens(
                model, p, tokens, jnp.full((rows,), 12), jax.random.PRNGKey(0), config=config
            )
        )(params).jaxpr
        return [
            e.params["preferred_element_type"]
            for e in jaxpr_equations(jaxpr)
            if e.primitive.name == "dot_general"
            and e.invars[0].aval.dtype == jnp.bfloat16
            and e.invars[0].aval.shape[:2] == (rows, 1)  # a step's one token per row
        ]

    one, two = step_products(1), step_products(2)
    assert len(one) >= 6 and all(t == jnp.float32 for t in one)  # 3 projections x 2 layers
    assert sum(t is None for t in two) >= 6


def test_score_is_the_sum_of_target_log_probabilities(tmp_path):
    _, path = tiny_hf_llama(tmp_path, **LLAMA_VARIANTS["gqa_theta"])
    model, params = hf.from_pretrained(path)
    ids, mask = padded_batch(model.config.real_vocab_size, PROMPT_LENGTHS, seed=7)
    batch = decoder_batch(ids, mask)
    weights = mask.copy()
    weights[:, :2] = 0  # a prefix that is not scored
    batch["decoder_loss_weights"] = weights.astype(np.int32)
    scores = np.asarray(jax.jit(model.score)(params, batch))
    logits = np.asarray(jax.jit(model.compute_logits)(params, batch), np.float64)
    log_probs = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))[..., None]
        - logits.max(-1, keepdims=True)
    )
    target = np.take_along_axis(log_probs, ids[..., None], -1)[..., 0]
    np.testing.assert_allclose(scores, (target * weights).sum(-1), rtol=1e-5)


def test_bad_generate_requests_fail_before_device_work(tmp_path):
    _, path = tiny_hf_gpt2(tmp_path, "standard")
    model, params = hf.from_pretrained(path)
    ids, _ = padded_batch(model.config.real_vocab_size, (5, 3), seed=8)
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        generation.generate(model, params, {"inputs": ids}, max_new_tokens=60)
    with pytest.raises(ValueError, match="empty"):
        generation.generate(model, params, {"inputs": np.zeros((1, 4), np.int32)}, max_new_tokens=4)
    with pytest.raises(ValueError, match="batch\\['inputs'\\]"):
        generation.generate(model, params, {"decoder_input_tokens": ids}, max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        generation.generate(
            model, params, {"inputs": ids}, max_new_tokens=4, num_beams=2, temperature=0.5
        )
    with pytest.raises(ValueError, match="top_p"):
        generation.generate(
            model, params, {"inputs": ids}, max_new_tokens=4, temperature=1.0, top_p=0.0
        )
