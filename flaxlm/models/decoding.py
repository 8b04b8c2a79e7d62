"""Autoregressive decoding over a KV cache: greedy, temperature / top-k / top-p sampling,
and beam search with a length penalty.

The algorithms here know no model. A model hands them the logits after its prompt and a
`step` function `(tokens [rows], t, cache) -> (logits [rows, vocab], cache)` that feeds the
token chosen at step `t` (0-based over the new tokens) and returns the logits for step
`t + 1`; the cache is any pytree whose leaves hold the rows in the axis `ndim - 4`
(`[rows, length, heads, head_dim]`, with a leading layers axis when layers are scanned).
Everything is traced inside one `jit` with static shapes: `lax.while_loop` runs until
every row has stopped or `max_new_tokens` are out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
Cache = Any
StepFn = Callable[[Array, Array, Cache], tuple[Array, Cache]]

NEG_INF = -1.0e9  # what HF adds to scores that must never be chosen


@dataclasses.dataclass(frozen=True)
class DecodingConfig:
    """How to choose tokens (hashable: one compiled decoder per distinct config).

    temperature 0 is greedy; otherwise sample from softmax(logits / temperature) restricted
    to the `top_k` most likely tokens (0: all) and to the smallest set whose probability
    reaches `top_p` (1.0: all). `repetition_penalty` != 1 divides the logit of every token
    of the prompt and of the tokens generated so far by it where positive, multiplies it
    where negative, before either (HF's `RepetitionPenaltyLogitsProcessor`); no EOS is
    chosen before `min_new_tokens` (HF's `MinNewTokensLengthLogitsProcessor`). `num_beams > 1`
    is beam search (deterministic); its scores are summed log-probabilities divided by
    `generated_length ** length_penalty`, as in HuggingFace's beam search with
    `early_stopping=False`.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    eos_ids: tuple[int, ...] = ()  # a row stops after any of these
    pad_id: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.num_beams < 1:
            raise ValueError(f"num_beams must be at least 1, got {self.num_beams}.")
        if self.num_beams > 1 and self.temperature > 0:
            raise ValueError("Beam search is deterministic: use temperature=0 with num_beams > 1.")
        if not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1: none), got {self.repetition_penalty}."
            )
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}.")
        if self.num_beams > 1 and (self.repetition_penalty != 1.0 or self.min_new_tokens):
            raise ValueError(
                "repetition_penalty and min_new_tokens are not supported with beam search "
                "(num_beams > 1)."
            )


# ---------------------------------------------------------------------------- sampling


CANDIDATES = 256  # the most likely tokens where `filter_sets` looks for a row's set first


def filter_logits(logits: Array, top_k: int = 0, top_p: float = 1.0) -> Array:
    """float32 `logits` `[rows, vocab]` with the tokens outside the top-k, then top-p set at
    the lowest float (`filter_sets`, every row alike)."""
    logits = logits.astype(jnp.float32)
    if not top_k and top_p >= 1.0:
        return logits
    rows = logits.shape[:1]
    return filter_sets(
        logits, jnp.full(rows, top_k), jnp.full(rows, top_p), jnp.zeros(rows, jnp.float32)
    )


def filter_sets(
    logits: Array, top_k: Array, top_p: Array, min_p: Array, candidates: int = CANDIDATES
) -> Array:
    """float32 `logits` `[rows, vocab]` (after temperature) with the tokens outside each
    row's set at the lowest float: those at least `min_p` x the most likely one's
    probability, of them the `top_k` most likely (0: all), and of those the smallest that
    reaches `top_p` of their probability (HF's warpers' sets; at least one kept; tokens tied
    with the last kept stay). `top_k`, `top_p`, `min_p`: `[rows]`.

    Each row's set is looked for among its `candidates` most likely tokens (`lax.top_k`); only
    where a row's set may reach past them is the whole vocabulary sorted (the same set)."""
    vocab = logits.shape[-1]
    n = min(candidates, vocab)
    top = jax.lax.top_k(logits, n)[0]  # [rows, n], descending
    # The top one from a reduction, and the k-th largest as the least of the first k: a
    # second slice of `top`, or a gather from it, keeps XLA:CPU from reading it off its top-k
    # kernel, and it sorts the whole row instead.
    floor = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    first_k = jnp.arange(n)[None] < jnp.clip(top_k, 1, n)[:, None]
    kth = jnp.min(jnp.where(first_k, top, jnp.inf), axis=-1, keepdims=True)
    bound = jnp.where(((top_k > 0) & (top_k <= n))[:, None], jnp.maximum(kth, floor), floor)
    in_set = logits >= bound  # min-p and top-k, over the vocabulary
    log_mass = jax.nn.logsumexp(jnp.where(in_set, logits, -jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(top >= bound, jnp.exp(top - log_mass), 0.0)
    # Keep a token while the mass of the tokens ranked above it is still below top_p.
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where((top >= bound) & (before < top_p[:, None]), top, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    # The set is found among the candidates where it holds no more of them, or where their
    # mass reaches top_p (a token past them has at least that much above it).
    found = (top_k <= n) & ((in_set.sum(-1) <= n) | (probs.sum(-1) >= top_p))
    cut = (top_p < 1.0) | (top_k > 0) | (min_p > 0)
    threshold = jax.lax.cond(
        (found | ~cut).all(),
        lambda: threshold,
        lambda: _sorted_threshold(logits, top_k, top_p, min_p),
    )
    return jnp.where(logits < threshold, jnp.finfo(jnp.float32).min, logits)


def _sorted_threshold(logits: Array, top_k: Array, top_p: Array, min_p: Array) -> Array:
    """`filter_sets`' lowest kept logit of each row `[rows, 1]`, from the whole vocabulary
    sorted."""
    vocab = logits.shape[-1]
    ranked = jnp.sort(logits, axis=-1)[..., ::-1]
    floor = ranked[:, :1] + jnp.log(min_p)[:, None]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(ranked, (k - 1)[:, None], axis=-1)
    kept = (ranked >= kth) & (ranked >= floor)
    probs = jax.nn.softmax(jnp.where(kept, ranked, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where(kept & (before < top_p[:, None]), ranked, jnp.inf)
    return jnp.min(kept, axis=-1, keepdims=True)


def penalize_repeats(logits: Array, repeated: Array, penalty: Array | float) -> Array:
    """float32 `logits` `[rows, vocab]` with those of the `repeated` tokens (bool, like
    `logits`) divided by `penalty` (`[rows, 1]` or a number) where positive, multiplied by it
    where negative (HF's `RepetitionPenaltyLogitsProcessor`)."""
    logits = logits.astype(jnp.float32)
    penalized = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(repeated, penalized, logits)


def seen_tokens(tokens: Array, lengths: Array, vocab: int) -> Array:
    """bool `[rows, vocab]`: which tokens each row's first `lengths` of `tokens` hold."""
    rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], tokens.shape)
    real = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
    out = jnp.zeros((tokens.shape[0], vocab), bool)
    return out.at[rows, jnp.where(real, tokens, vocab)].set(True, mode="drop")


def is_eos(tokens: Array, config: DecodingConfig) -> Array:
    """bool, like `tokens`: which are one of the config's EOS ids."""
    hit = jnp.zeros(tokens.shape, bool)
    for eos in config.eos_ids:
        hit = hit | (tokens == eos)
    return hit


def choose_tokens(logits: Array, rng: Array, config: DecodingConfig) -> Array:
    """int32 `[rows]`: argmax, or a sample under the config's temperature/top-k/top-p."""
    if config.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / config.temperature
    filtered = filter_logits(scaled, config.top_k, config.top_p)
    return jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)


def sample(
    first_logits: Array,
    cache: Cache,
    step: StepFn,
    config: DecodingConfig,
    rng: Array,
    seen: Array | None = None,
) -> tuple[Array, Array]:
    """Greedy or sampled decoding of `max_new_tokens` per row; `seen` (bool `[rows, vocab]`:
    the prompts' tokens, `seen_tokens`) where the config has a repetition penalty.

    Returns (tokens int32 `[rows, max_new_tokens]` with `pad_id` after a row's EOS,
    lengths int32 `[rows]`: the tokens each row generated, its EOS included).
    """
    rows = first_logits.shape[0]
    n = config.max_new_tokens
    if (seen is None) != (config.repetition_penalty == 1.0):
        raise ValueError("sample: `seen` is needed with a repetition penalty, and only then.")

    def emit(t, logits, done, tokens, lengths, seen):
        if config.min_new_tokens and config.eos_ids:  # no EOS before min_new_tokens
            early = logits.at[:, jnp.asarray(config.eos_ids)].set(-jnp.inf)
            logits = jnp.where(t < config.min_new_tokens, early, logits)
        if seen is not None:
            logits = penalize_repeats(logits, seen, config.repetition_penalty)
        token = choose_tokens(logits, jax.random.fold_in(rng, t), config)
        token = jnp.where(done, config.pad_id, token)
        if seen is not None:
            seen = seen.at[jnp.arange(rows), token].set(True)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, t))
        lengths = lengths + (~done).astype(jnp.int32)
        return token, done | is_eos(token, config), tokens, lengths, seen

    # The loop feeds each token but the last, which needs no logits after it: it is chosen
    # after the loop. (A `cond` around the step inside the loop would skip the last step
    # too, but XLA copies every layer's whole cache in and out of a conditional's branches
    # at each step.)
    def cond(carry):
        t, _, _, done, *_ = carry
        return (t < n - 1) & ~jnp.all(done)

    def body(carry):
        t, logits, cache, *rest = carry
        token, *rest = emit(t, logits, *rest)
        logits, cache = step(token, t, cache)
        return t + 1, logits, cache, *rest

    carry = (
        jnp.int32(0),
        first_logits.astype(jnp.float32),
        cache,
        jnp.zeros((rows,), bool),
        jnp.full((rows, n), config.pad_id, jnp.int32),
        jnp.zeros((rows,), jnp.int32),
        seen,
    )
    t, logits, _, *rest = jax.lax.while_loop(cond, body, carry)
    # The last token (past an early stop every row is done: it writes padding).
    _, _, tokens, lengths, _ = emit(jnp.minimum(t, n - 1), logits, *rest)
    return tokens, lengths


# ---------------------------------------------------------------------------- beam search


def gather_rows(cache: Cache, rows: Array) -> Cache:
    """Reorders the cache's rows (axis `ndim - 4` of each leaf) by `rows`."""

    def one(x: Array) -> Array:
        return jnp.take(x, rows, axis=x.ndim - 4) if x.ndim >= 4 else x

    return jax.tree.map(one, cache)


def _gather(x: Array, index: Array) -> Array:
    """x `[batch, beams, ...]`, index `[batch, k]` -> `[batch, k, ...]`."""
    return jax.vmap(lambda a, i: a[i])(x, index)


def beam_search(
    first_logits: Array, cache: Cache, step: StepFn, config: DecodingConfig
) -> tuple[Array, Array]:
    """Beam search over `num_beams` copies of each row (rows = batch * num_beams, beams of
    one example adjacent). The algorithm is HuggingFace's (`early_stopping=False`): keep
    the 2 * beams best continuations (more with several EOS ids), finish those among the
    top `beams` that end in EOS (or reach `max_new_tokens`), continue the best unfinished
    `beams`, and stop a row once no running beam can beat its worst finished one.

    Returns (tokens int32 `[batch, max_new_tokens]` of the best finished beam, `pad_id`
    after EOS; its score float32 `[batch]`).
    """
    k = config.num_beams
    rows, vocab = first_logits.shape
    batch = rows // k
    n = config.max_new_tokens
    # Enough candidates that `k` survive even if every EOS id ends one of them.
    width = max(2, 1 + len(config.eos_ids)) * k
    top_k_mask = jnp.arange(width) < k
    penalty = config.length_penalty

    def going(state):
        t, *_, improvable, all_hit = state
        return (t < n) & jnp.any(improvable) & ~all_hit

    def choose(state):
        """The beams after step `t`'s logits; the cache rows they continue from."""
        t, logits, seqs, scores, done_seqs, done_scores, done_flags, improvable, _ = state
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        log_probs = log_probs.reshape(batch, k, vocab) + scores[:, :, None]
        top_scores, top_index = jax.lax.top_k(log_probs.reshape(batch, k * vocab), width)
        origin, token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
        top_seqs = _gather(seqs, origin).at[:, :, t].set(token)
        hits = is_eos(token, config) | (t + 1 >= n)

        # The best `k` unfinished continuations run on.
        running_scores = top_scores + hits.astype(jnp.float32) * NEG_INF
        keep = jax.lax.top_k(running_scores, k)[1]
        seqs = _gather(top_seqs, keep)
        scores = _gather(running_scores, keep)
        beam_rows = _gather(origin, keep) + jnp.arange(batch)[:, None] * k

        # Finished ones among the top `k` compete with the finished so far.
        finished = hits & top_k_mask[None]
        candidate = top_scores / ((t + 1) ** penalty)
        candidate = candidate + (~improvable[:, None]).astype(jnp.float32) * NEG_INF
        candidate = candidate + (~finished).astype(jnp.float32) * NEG_INF
        merged_scores = jnp.concatenate([done_scores, candidate], axis=1)
        best = jax.lax.top_k(merged_scores, k)[1]
        done_seqs = _gather(jnp.concatenate([done_seqs, top_seqs], axis=1), best)
        done_scores = _gather(merged_scores, best)
        done_flags = _gather(jnp.concatenate([done_flags, finished], axis=1), best)

        # Could the best running beam still beat the worst finished one?
        best_running = scores[:, :1] / ((t + 1) ** penalty)
        worst_done = jnp.where(done_flags, jnp.min(done_scores, axis=1, keepdims=True), NEG_INF)
        improvable = improvable & jnp.any(best_running > worst_done, axis=1)
        state = (
            t + 1, logits, seqs, scores, done_seqs, done_scores, done_flags, improvable,
            jnp.all(hits),
        )  # fmt: skip
        return state, beam_rows

    # As in `sample`, the loop steps the model after each choice but the last, which
    # follows the loop: no `cond` around the step (XLA would copy the cache at each step).
    def body(carry):
        state, cache = carry
        state, beam_rows = choose(state)
        cache = gather_rows(cache, beam_rows.reshape(-1))
        t, seqs = state[0] - 1, state[2]
        logits, cache = step(seqs[:, :, t].reshape(-1), t, cache)
        return (state[0], logits, *state[2:]), cache

    first_scores = jnp.where(jnp.arange(k) == 0, 0.0, NEG_INF)
    state = (
        jnp.int32(0),
        first_logits.astype(jnp.float32),
        jnp.full((batch, k, n), config.pad_id, jnp.int32),
        jnp.broadcast_to(first_scores, (batch, k)).astype(jnp.float32),
        jnp.full((batch, k, n), config.pad_id, jnp.int32),
        jnp.full((batch, k), NEG_INF, jnp.float32),
        jnp.zeros((batch, k), bool),
        jnp.ones((batch,), bool),
        jnp.bool_(False),
    )
    state, _ = jax.lax.while_loop(
        lambda carry: going(carry[0]) & (carry[0][0] < n - 1), body, (state, cache)
    )
    out = jax.lax.cond(going(state), lambda: choose(state)[0], lambda: state)
    done_seqs, done_scores = out[4], out[5]
    return done_seqs[:, 0], done_scores[:, 0]


def decode(
    first_logits: Array,
    cache: Cache,
    step: StepFn,
    config: DecodingConfig,
    rng: Array | None = None,
    seen: Array | None = None,
) -> Array:
    """int32 `[batch, max_new_tokens]` new tokens (`pad_id` after EOS) by the config's method
    (`seen`: the prompts' tokens, for a repetition penalty).

    With beams, `first_logits` and the cache hold `num_beams` adjacent copies of each row.
    """
    if config.num_beams > 1:
        return beam_search(first_logits, cache, step, config)[0]
    rng = jax.random.PRNGKey(0) if rng is None else rng
    return sample(first_logits, cache, step, config, rng, seen)[0]


# Cache leaves of a recurrent state (linear attention: `gated_deltanet.GatedDeltaNet`), rows
# in axis `ndim - 4` as every leaf, but no slots.
# A sequence's state that is not keys and values in pages: a linear-attention layer's
# convolution inputs and recurrent state, and DeepSeek-V4's per-layer caches (its sliding
# window, its compressors' open windows and compressed entries: `deepseek_v4_attention`).
# Over the paged engine each is a pool of state slots (`models/state_slots.py`).
RECURRENT_STATE = (
    "conv_q", "conv_k", "conv_v", "recurrent_state",
    "sliding_kv", "window_kv", "window_gate", "entries",
    "ple_context", "ple_conv",  # Qwen4-Exp's PLE: its n-gram context, its convolution's inputs
)  # fmt: skip


def is_recurrent_state(path: tuple) -> bool:
    """Whether the cache leaf at `path` (its `jax.tree_util` keys) is a recurrent state's
    (`RECURRENT_STATE`; in the paged cache a pool of state slots, `models/state_slots.py`)."""
    return getattr(path[-1], "key", None) in RECURRENT_STATE


def recurrent_states(cache: Any) -> list[Any]:
    """The leaves of `cache` that hold a recurrent state (`is_recurrent_state`)."""
    return [x for path, x in jax.tree_util.tree_leaves_with_path(cache) if is_recurrent_state(path)]


def cache_length(cache: Any) -> int:
    """Slots of a KV cache: axis `ndim - 2` of its leaves, `[(layers,) rows, heads, slots,
    width]`, the values' aside (named "value", `[..., width, slots]`:
    `attention.write_cache`) and the recurrent states' (`RECURRENT_STATE`: 0 when nothing
    else is cached)."""
    states = False
    for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
        name = getattr(path[-1], "key", None)
        states = states or name in RECURRENT_STATE
        if name != "value" and name not in RECURRENT_STATE:
            return leaf.shape[leaf.ndim - 2]
    if states:
        return 0
    raise ValueError("a KV cache without keys")


def empty_cache(init_cache: Callable[[], Any]) -> Any:
    """Zeros shaped as the cache `init_cache()` creates (nothing else is computed)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(init_cache))
