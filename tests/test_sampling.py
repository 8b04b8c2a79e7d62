"""The serving engine's per-row sampling (`inference/sampling.py`) against HF's logits
processors and OpenAI's definition of the presence and frequency penalties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation import logits_process as hf

from flaxlm.inference import sampling
from flaxlm.inference.sampling import Sampling
from flaxlm.models import decoding

VOCAB = 50
ROWS = 6


def random_logits(seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(ROWS, VOCAB)) * 3, jnp.float32)


def hf_kept(logits, warpers):
    """Which tokens HF's `warpers`, applied in order to one row, leave a chance."""
    scores = torch.tensor(np.asarray(logits))[None]
    for w in warpers:
        scores = w(None, scores)
    return torch.isfinite(scores)[0].numpy()


def test_each_row_keeps_what_hfs_warpers_keep():
    """Temperature, top-k, top-p and min-p per row, as HF's warpers in their order (min-p
    beside top-k: either order keeps the same set); a row that sets none keeps all."""
    logits = random_logits()
    rows = [
        Sampling(1.0),
        Sampling(0.7, top_k=3),
        Sampling(1.3, top_p=0.6),
        Sampling(0.5, top_k=7, top_p=0.8),
        Sampling(1.0, min_p=0.2),
        Sampling(2.0, top_k=4, min_p=0.3),
    ]
    settings = sampling.rows(rows, ROWS)
    scaled = logits / settings.temperature[:, None]
    sets = jax.jit(decoding.filter_sets, static_argnums=4)
    filtered = sets(scaled, settings.top_k, settings.top_p, settings.min_p)
    # Looked for among a few candidates, the same sets: the whole vocabulary sorted where a
    # row's set may reach past them (row 3's top-k of 7 past 5 candidates), else not.
    few = sets(scaled, settings.top_k, settings.top_p, settings.min_p, 5)
    np.testing.assert_array_equal(few, filtered)
    k = np.asarray([1, 5])  # sets within their top 3 or 4
    few = sets(scaled[k], settings.top_k[k], settings.top_p[k], settings.min_p[k], 5)
    np.testing.assert_array_equal(few, filtered[k])
    for i, s in enumerate(rows):
        warpers = [hf.TemperatureLogitsWarper(s.temperature)]
        warpers += [hf.TopKLogitsWarper(s.top_k)] if s.top_k else []
        warpers += [hf.TopPLogitsWarper(s.top_p)] if s.top_p < 1 else []
        warpers += [hf.MinPLogitsWarper(s.min_p)] if s.min_p else []
        kept = np.asarray(filtered[i]) > jnp.finfo(jnp.float32).min
        np.testing.assert_array_equal(kept, hf_kept(logits[i], warpers), err_msg=str(s))
        assert 1 <= kept.sum() < VOCAB or s == Sampling(1.0)


def test_penalties_equal_hfs_repetition_penalty_and_openais_definition():
    """Through the engine's path (`histories` padded to a power of two, `seen`, then one
    more token `count`ed): the repetition penalty as HF's processor over prompt and output;
    the frequency and presence penalties as OpenAI defines them, over the output alone."""
    logits = random_logits(1)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, VOCAB, n) for n in (5, 9, 1, 3, 12, 4)]
    outputs = [rng.integers(0, VOCAB, n).tolist() for n in (0, 3, 7, 2, 5, 1)]
    rows = [
        Sampling(repetition_penalty=1.5),
        Sampling(repetition_penalty=0.8, frequency_penalty=0.5),
        Sampling(presence_penalty=1.2),
        Sampling(presence_penalty=-0.7, frequency_penalty=1.5),
        Sampling(),
        Sampling(0.9, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.2),
    ]
    prompt, output = sampling.histories(rows, prompts, [o[:-1] for o in outputs], ROWS)
    assert prompt.shape[1] == 16 and output.shape[1] == 8
    assert (prompt[2] == sampling.PAD).all()  # no repetition penalty: its prompt not read
    seen = sampling.seen(jnp.asarray(prompt), jnp.asarray(output), VOCAB)
    last = jnp.asarray([o[-1] if o else 0 for o in outputs])[:, None]
    seen = sampling.count(seen, last, jnp.asarray([bool(o) for o in outputs])[:, None])
    got = np.asarray(sampling.penalize(logits, seen, sampling.rows(rows, ROWS)))
    for i, (s, p, o) in enumerate(zip(rows, prompts, outputs)):
        scores = torch.tensor(np.asarray(logits[i]))[None]
        ids = torch.tensor(np.concatenate([p, np.asarray(o, int)]))[None]
        want = hf.RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(ids, scores)[0].numpy()
        counts = np.bincount(np.asarray(o, int), minlength=VOCAB)
        want = want - s.frequency_penalty * counts - s.presence_penalty * (counts > 0)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    assert sampling.histories([Sampling(1.0, top_k=3)], prompts[:1], [[]], ROWS) is None


def test_select_by_row_penalized_sampled_and_eos_held_back_until_min_tokens():
    """Greedy rows take the argmax after their logit bias or penalties, sampled rows a draw
    from their filtered distribution with their own key; the reported log-probs are the
    model's own; an EOS is not chosen before a row's min_tokens; a batch of greedy rows
    skips sampling."""
    logits = random_logits(3)
    logits = logits.at[5].set(logits[4])
    eos = int(jnp.argmax(logits[4]))
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(ROWS, dtype=jnp.uint32))
    least = int(jnp.argmin(logits[0]))
    rows = [
        Sampling(logit_bias=((least, 100.0), (int(jnp.argmax(logits[0])), -5.0))),
        Sampling(0.7),
        Sampling(1.3, top_p=0.5),
        Sampling(repetition_penalty=2.0),
        Sampling(min_tokens=3),
        Sampling(min_tokens=3),
    ]
    settings = sampling.rows(rows, ROWS, eos_ids=(eos,))
    prompt, output = sampling.histories(rows, [np.argsort(-logits[3])[:2]] * ROWS, [[]] * 6, 6)
    seen = sampling.seen(jnp.asarray(prompt), jnp.asarray(output), VOCAB)
    generated = jnp.asarray([0, 0, 0, 0, 2, 3])
    select = jax.jit(sampling.select, static_argnums=3)
    token, lp, top_ids, _ = select(logits, keys, settings, 3, seen=seen, generated=generated)
    argmax = np.asarray(jnp.argmax(logits, -1))
    scaled = logits / settings.temperature[:, None]
    cut = decoding.filter_sets(scaled, settings.top_k, settings.top_p, settings.min_p)
    penalized = sampling.penalize(logits, seen, settings)
    expected = [
        least,  # biased to the top
        jax.random.categorical(keys[1], logits[1] / 0.7),
        jax.random.categorical(keys[2], cut[2]),
        jnp.argmax(penalized[3]),
        np.argsort(-logits[4])[1],  # the EOS held back
        eos,
    ]
    assert np.asarray(token).tolist() == [int(t) for t in expected]
    assert int(token[3]) != argmax[3]  # the penalty moved it off the prompt's token
    log_probs = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(lp, log_probs[jnp.arange(ROWS), token], rtol=1e-6)
    np.testing.assert_array_equal(top_ids[:, 0], argmax)
    greedy = sampling.rows([Sampling()] * ROWS, ROWS)
    np.testing.assert_array_equal(select(logits, keys, greedy, 3)[0], argmax)
    # A row's stop tokens: the model's EOS ids unless it ignores them, and its own.
    assert Sampling(stop_token_ids=(7,)).stops((1, 2)) == (1, 2, 7)
    assert Sampling(ignore_eos=True, stop_token_ids=(7,)).stops((1, 2)) == (7,)
    held = sampling.rows([Sampling(ignore_eos=True, stop_token_ids=(eos,), min_tokens=3)], 1)
    assert int(select(logits[4:5], keys[:1], held, 3, generated=jnp.zeros(1, int))[0][0]) != eos


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_p": 0}, "top_p must be in"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"min_p": 1.5}, "min_p must be in"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be a finite"),
        ({"min_tokens": -2}, "min_tokens must be >= 0"),
        ({"logit_bias": ((-1, 2.0),)}, "logit_bias -1: 2.0 is not a token id"),
        ({"stop_token_ids": (3, -4)}, "stop_token_ids must be token ids"),
    ],
)
def test_a_setting_out_of_range_is_named(settings, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**settings)
