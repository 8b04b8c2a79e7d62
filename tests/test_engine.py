"""The serving engine over a paged KV cache (`inference/scheduler.py`, `inference/pages.py`)
on a tiny HF Llama: continuous batching gives each request what it gets alone and what HF's
`generate` gives; `n` samples of a prompt read it once; every page comes back."""

import os
import queue
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio
import torch
import transformers

from flaxlm.checkpoints import hf
from flaxlm.inference import generation, sampling
from flaxlm.inference.pages import PagePool, prefix_keys
from flaxlm.inference.sampling import Sampling
from flaxlm.inference.scheduler import Scheduler
from flaxlm.models import masks
from flaxlm.models.cached_decoding import CachedDecoding
from flaxlm.models.state_slots import gather, scatter
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs.serve.api import Completion
from flaxlm.runs.serve.engine import BatchEngine, Engine
from tests.hf_helpers import random_hf_model, save_torch_model

VOCAB = 96
PAGE = 4


def hf_llama(path, hidden_size=32):
    """(torch model, flaxlm model, params) of a tiny random Llama saved under `path` (no EOS:
    every request decodes its max_tokens). A wide initialisation keeps greedy choices far
    apart."""
    torch_model = random_hf_model(
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
    )
    model, params = hf.from_pretrained(save_torch_model(torch_model, path), Partitioner())
    return torch_model, model, params


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return hf_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def engine(llama):
    """One engine for the file (its programs compiled once): 8 rows, pages of 4 slots, a
    pool of 40 pages (fewer than 8 rows of 64 slots need)."""
    _, model, params = llama
    e = Engine(
        model,
        params,
        Partitioner(),
        seqio.ByteVocabulary(),
        max_batch_size=8,
        page_size=PAGE,
        num_pages=40,
        max_seq_len=64,
        decode_steps=4,
        prefill_chunk=8,
        prefill_rows=2,
    )
    e.start()
    yield e
    e.stop()


def job(prompt, max_tokens, temperature=0.0, seed=0, **settings):
    return Completion(list(prompt), max_tokens, Sampling(temperature, **settings), [], None, seed)


def result(c, timeout=120):
    """(token ids, final event) of a completion once it has ended."""
    tokens = []
    while True:
        event = c.events.get(timeout=timeout)
        if event[0] == "token":
            tokens.append(event[1])
        else:
            return tokens, event


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, int(rng.integers(1, 20))).tolist() for _ in range(n)]


def wait_idle(engine, timeout=30):
    deadline = time.monotonic() + timeout
    while engine.scheduler.busy and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.slow
def test_concurrent_greedy_requests_equal_each_alone_and_hf_generate(llama, engine):
    torch_model, model, params = llama
    cases = [(p, 3 + (i * 5) % 17) for i, p in enumerate(prompts(12))]
    together = [job(p, n) for p, n in cases]
    for c in together:
        engine.submit(c)
    outputs = [result(c) for c in together]
    for (_, n), (tokens, last) in zip(cases, outputs):
        assert last == ("done", "length") and len(tokens) == n
    for (p, n), (tokens, _) in zip(cases[:4], outputs[:4]):
        alone = job(p, n)
        engine.submit(alone)
        assert result(alone)[0] == tokens
    for (p, n), (tokens, _) in zip(cases, outputs):
        with torch.no_grad():
            out = torch_model.generate(
                torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0
            )
        assert tokens == out[0, len(p) :].tolist(), (p, n)
    # ... and what the contiguous-cache path (`generation.generate`) gives.
    p, n = cases[0]
    ours = generation.generate(model, params, {"inputs": np.asarray([p])}, max_new_tokens=n)
    assert ours[0].tolist() == outputs[0][0]


def penalized_greedy(torch_model, prompt, n, repetition=1.0, presence=0.0, frequency=0.0):
    """The greedy tokens of a plain loop over HF's model: the repetition penalty as HF's
    processor (over prompt and output), presence and frequency as OpenAI defines them."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = torch_model(torch.tensor([ids])).logits[0, -1].double().numpy()
        seen = sorted(set(ids))
        logits[seen] = np.where(
            logits[seen] > 0, logits[seen] / repetition, logits[seen] * repetition
        )
        counts = np.bincount(out, minlength=VOCAB)
        logits -= frequency * counts + presence * (counts > 0)
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-3, "a near tie: another prompt is needed"
        out.append(int(np.argmax(logits)))
        ids.append(out[-1])
    return out


@pytest.mark.slow
def test_each_row_decodes_with_its_own_penalties_and_top_k(llama, engine):
    """Rows with their own penalties decode in the same dispatches as plain ones (over
    dispatches enqueued ahead, whose tokens the penalties count on the device): each greedy
    row equals the reference loop, the repetition penalty's HF `generate`'s, and top-k 1
    samples the argmax."""
    torch_model = llama[0]
    n = 18
    cases = [
        {},
        {"repetition_penalty": 1.6},
        {"presence_penalty": 1.5, "frequency_penalty": 0.6},
        {"repetition_penalty": 0.7, "frequency_penalty": 2.0},
    ]
    ps = prompts(len(cases), seed=21)
    jobs = [job(p, n, **settings) for p, settings in zip(ps, cases)]
    jobs.append(job(ps[0], n, temperature=1.0, seed=5, top_k=1))
    engine.submit_many(jobs)
    outputs = [result(c)[0] for c in jobs]
    for p, settings, tokens in zip(ps, cases, outputs):
        names = {"repetition": "repetition_penalty", "presence": "presence_penalty"}
        names["frequency"] = "frequency_penalty"
        kwargs = {k: settings[v] for k, v in names.items() if v in settings}
        assert tokens == penalized_greedy(torch_model, p, n, **kwargs), settings
    assert outputs[1] != outputs[0]  # (the penalties change something)
    with torch.no_grad():
        out = torch_model.generate(
            torch.tensor([ps[1]]), max_new_tokens=n, do_sample=False, repetition_penalty=1.6
        )
    assert outputs[1] == out[0, len(ps[1]) :].tolist()
    assert outputs[-1] == outputs[0]
    # vLLM's stop_token_ids: a row ends at the first of them (the model has no EOS).
    stopped = job(ps[0], n, stop_token_ids=(outputs[0][5],))
    engine.submit(stopped)
    first = outputs[0].index(outputs[0][5])
    tokens, event = result(stopped)
    assert tokens == outputs[0][:first] and event[:3] == ("done", "stop", outputs[0][5])
    # The contiguous-cache path (a model that cannot page) decodes them alike.
    _, model, params = llama
    jobs = [job(p, n, **settings) for p, settings in zip(ps, cases)]
    jobs.append(job(ps[0], n, stop_token_ids=(outputs[0][5],)))
    BatchEngine(model, params, Partitioner(), seqio.ByteVocabulary()).decode(jobs)
    assert [result(c)[0] for c in jobs] == outputs[:-1] + [outputs[0][:first]]


def test_n_samples_of_one_prompt_read_it_once_and_share_its_pages(engine):
    scheduler = engine.scheduler
    wait_idle(engine)
    prompt = prompts(1, seed=7)[0] + list(range(1, 11))  # ends inside a page
    read, shared = scheduler.prefilled_tokens, scheduler.pool.shared
    samples = [job(prompt, 6, temperature=1.0, seed=s) for s in range(4)]
    engine.submit_many(samples)
    outputs = [result(c)[0] for c in samples]
    assert scheduler.prefilled_tokens - read == len(prompt)
    assert scheduler.pool.shared - shared == 3 * (len(prompt) // PAGE)
    assert len({tuple(o) for o in outputs}) > 1  # own seeds, own samples
    # The same seed alone samples the same tokens (the copied page holds the same keys).
    again = job(prompt, 6, temperature=1.0, seed=2)
    engine.submit(again)
    assert result(again)[0] == outputs[2]
    # A later request with the same prefix finds its full pages in the prefix cache.
    read = scheduler.prefilled_tokens
    later = job(prompt + [5, 6, 7], 3)
    engine.submit(later)
    result(later)
    assert scheduler.prefilled_tokens - read == len(later.prompt_ids) - (len(prompt) // PAGE * PAGE)


def test_after_many_requests_cancelled_and_refused_every_page_is_free(engine):
    scheduler = engine.scheduler
    rng = np.random.default_rng(3)
    jobs = []
    for i, p in enumerate(prompts(60, seed=11)):
        if i % 10 == 3:
            c = job(p, 100)  # beyond 64 slots: refused
        else:
            c = job(p, int(rng.integers(1, 30)), temperature=float(i % 2), seed=i)
        engine.submit(c)
        jobs.append(c)
        if i % 7 == 5:
            engine.cancel(jobs[i - 2])
    ends = [result(c)[1] for c in jobs]
    assert all(e[0] == "error" and "slots per sequence" in e[1] for e in ends[3::10])
    kinds = {e[0] for e in ends}
    assert kinds <= {"done", "error", "cancelled"} and "cancelled" in kinds
    wait_idle(engine)
    pool = scheduler.pool
    assert pool.in_use() == 0 and pool.available() == pool.capacity


def test_a_request_larger_than_the_free_pages_waits_and_others_are_served(engine):
    wait_idle(engine)
    scheduler = engine.scheduler
    # Eight long requests hold 8 * 12 = 96 slots' pages of the pool's 39: some wait.
    long = [job(p, 40) for p in prompts(8, seed=5)]
    short = job([1, 2, 3], 2)
    for c in long:
        engine.submit(c)
    time.sleep(0.05)
    engine.submit(short)
    assert result(short)[1] == ("done", "length")
    assert all(result(c)[1] == ("done", "length") for c in long)
    wait_idle(engine)
    assert scheduler.pool.in_use() == 0


def test_page_pool_shares_caches_and_evicts_prefix_pages():
    pool = PagePool(5, 2)
    keys = prefix_keys([1, 2, 3, 4, 5], 2, 2)
    assert prefix_keys([1, 2, 3, 9], 2, 2)[0] == keys[0] != prefix_keys([1, 2, 3, 9], 2, 2)[1]
    pages = pool.allocate(3)
    for key, page in zip(keys, pages):
        pool.register(key, page)
    pool.release(pages)
    assert pool.available() == 4 and pool.in_use() == 0
    hits = pool.lookup(keys)
    assert hits == pages[:2]
    pool.share(hits)
    assert pool.available() == 2
    with pytest.raises(ValueError, match="available"):
        pool.allocate(3)
    pool.release(hits)
    pool.allocate(4)  # evicts the cached pages, least recently released first
    assert pool.lookup(keys) == [] and pool.available() == 0


class RunningSum(CachedDecoding):
    """A model with a recurrent state and nothing else: its next token is the sum of every
    token it has read (each plus one: a padding token read would show), mod VOCAB, kept in
    a state slot of the paged cache (`models/state_slots.py`), beside a pool of pages
    nobody reads. The scheduler's state slots alone, with nothing to compile but a sum."""

    eos_ids = ()

    def paged_refusal(self) -> None:
        return None

    def decoding_params(self, params):
        return params

    def position_limit(self) -> None:
        return None

    def paged_cache(self, num_pages, page_size, max_rows=1, max_seq_len=None):
        return {
            "key": jnp.zeros((1, num_pages, page_size, 1)),
            "recurrent_state": jnp.zeros((max_rows + 1, 1, 1, 1)),
        }

    def paged_logits(self, params, cache, tokens, slots, table, last, _="", state_slots=None):
        where = masks.Decoding(jnp.int32(0), slots[:, 0], 0, table, slots, state_slots=state_slots)
        pool = cache["recurrent_state"]
        total = gather(pool, where)[:, 0, 0, 0]
        total = total + jnp.sum(jnp.where(slots >= 0, tokens + 1, 0), axis=1)
        logits = 10.0 * jax.nn.one_hot(total.astype(jnp.int32) % VOCAB, VOCAB)
        state = total[:, None, None, None]
        return logits, {**cache, "recurrent_state": scatter(pool, where, state)}


def running_sums(prompt, n):
    """`RunningSum`'s greedy tokens after `prompt`."""
    total, out = sum(t + 1 for t in prompt), []
    for _ in range(n):
        out.append(total % VOCAB)
        total += out[-1] + 1
    return out


def running_sum_scheduler(**kwargs) -> Scheduler:
    settings = dict(max_rows=3, page_size=PAGE, max_seq_len=32, decode_steps=3, prefill_rows=2)
    return Scheduler(RunningSum(), None, Partitioner(devices=jax.devices()[:1]),
                     **{**settings, **kwargs})  # fmt: skip


def run(scheduler, cases):
    """The (tokens, last event) of each (prompt, max_tokens) of `cases`, queued at once."""
    jobs = [job(p, n) for p, n in cases]
    for j in jobs:
        scheduler.add(j)
    while scheduler.busy:
        scheduler.step()
    return [result(j) for j in jobs]


@pytest.mark.parametrize("snapshots", [0, None])
def test_each_sequence_decodes_from_its_own_state_slot_shared_prompts_copied_cancels_freed(
    snapshots,
):
    """Three rows for five jobs over a model that keeps a running sum in its state slot
    (prompts in chunks of 4 beside others, padded; decode dispatches of 3 tokens): each job
    gets the tokens of its prompt alone. The second follows the first's identical prompt
    (read once, the state copied); the first is cancelled before its prompt is read (its
    follower queued again: a slot of its own, its prompt read from a fresh state, or with
    prefix snapshots from the state the first kept after its first page); the fifth waits
    for a slot another job freed. Every slot and page comes back; without snapshots no
    prefix is cached: pages do not hold the state."""
    scheduler = running_sum_scheduler(prefill_chunk=4, prefix_snapshots=snapshots)
    rng = np.random.default_rng(2)
    shared, other = rng.integers(1, VOCAB, 10).tolist(), rng.integers(1, VOCAB, 9).tolist()
    cases = [(shared, 5), (shared, 7), (other, 6), (other, 4), ([7, 8, 9], 8)]
    jobs = [job(p, n) for p, n in cases]
    for j in jobs:
        scheduler.add(j)
    scheduler.step()  # the first's and the third's first chunks read
    assert jobs[1] in [s.job for s in scheduler.running if s.leader is not None]
    scheduler.cancel(jobs[0], "gone")
    while scheduler.busy:
        scheduler.step()
    assert result(jobs[0])[1] == ("cancelled", "gone")
    for (p, n), j in zip(cases[1:], jobs[1:]):
        assert result(j) == (running_sums(p, n), ("done", "length")), (p, n)
    assert scheduler.pool.shared > 0  # the fourth followed the third
    assert sorted(scheduler.states.free) == [1, 2, 3]
    assert scheduler.pool.in_use() == 0
    if snapshots == 0:
        assert scheduler.pool.cached() == scheduler.cached_tokens == 0
    else:  # the second resumed after the first's first page
        assert scheduler.cached_tokens == PAGE and scheduler.states.held() > 0


def test_a_later_prompt_resumes_from_the_state_snapshot_after_its_cached_pages():
    """Prompts read in chunks of 8 on pages of 4: a chunk ends at a page's end, and at the
    prompt's last full page (a snapshot of the state is kept at each). A later prompt that
    extends the first's last full page, or its first chunk, reads only the rest; one that
    shares a page with no snapshot after it reads all. Each gets the tokens it gets with no
    prefix cache."""
    scheduler = running_sum_scheduler(prefill_chunk=8)
    rng = np.random.default_rng(4)
    first = rng.integers(1, VOCAB, 14).tolist()
    assert run(scheduler, [(first, 3)]) == [(running_sums(first, 3), ("done", "length"))]
    keys = prefix_keys(first, PAGE, 3)
    assert [scheduler.states.has(k) for k in keys] == [False, True, True]
    later = [first[:12] + [5, 6], first[:9] + [1, 2, 3], first[:6] + [7]]
    read = scheduler.prefilled_tokens
    for prompt in later:
        assert run(scheduler, [(prompt, 4)]) == [(running_sums(prompt, 4), ("done", "length"))]
    assert scheduler.cached_tokens == 12 + 8
    assert scheduler.prefilled_tokens - read == 2 + 4 + 7
    assert scheduler.pool.in_use() == 0 and scheduler.states.skipped == 0
    scheduler.reset()  # e.g. new params: every page and snapshot free
    assert scheduler.pool.cached() == scheduler.states.held() == 0


def test_the_next_decode_dispatch_is_enqueued_before_the_last_ones_tokens_are_read():
    """While the decoding rows go on, each decode dispatch is enqueued before the tokens of
    the one before it are read (the device never waits on the host between them), fed that
    dispatch's last tokens on the device; a row's max_tokens, a new row or a cancel makes the
    scheduler read first. Every job gets the tokens it gets alone, a cancelled one none
    after its cancel, and every slot and page comes back."""
    scheduler = running_sum_scheduler(prefill_chunk=8, prefix_snapshots=0)
    log = []

    class Read:  # a dispatch's output: logs when the host reads it
        def __init__(self, x, n):
            self.x, self.n = x, n

        def __getitem__(self, index):
            return self.x[index]

        def __array__(self, dtype=None, copy=None):
            log.append(("read", self.n))
            return np.asarray(self.x, dtype)

    decode = scheduler.programs.decode

    def logged(*args):
        cache, *out = decode(*args)
        n = sum(1 for e in log if e[0] == "enqueue") + 1
        log.append(("enqueue", n))
        return (cache, *(Read(x, n) for x in out))

    scheduler.programs.decode = logged
    rng = np.random.default_rng(5)
    cases = [(rng.integers(1, VOCAB, 5).tolist(), 20), (rng.integers(1, VOCAB, 3).tolist(), 11)]
    jobs = [job(p, n) for p, n in cases]
    for j in jobs:
        scheduler.add(j)
    while scheduler.busy:
        scheduler.step()
    for (p, n), j in zip(cases, jobs):
        assert result(j) == (running_sums(p, n), ("done", "length")), (p, n)
    order = [e for i, e in enumerate(log) if e not in log[:i]]  # a dispatch's first read
    ahead = [n for kind, n in order if kind == "read" and ("enqueue", n + 1) in order]
    ahead = [n for n in ahead if order.index(("enqueue", n + 1)) < order.index(("read", n))]
    assert len(ahead) >= 2, order  # 20 tokens in dispatches of 3: most go on ahead
    assert scheduler.pool.in_use() == 0 and sorted(scheduler.states.free) == [1, 2, 3]

    # A cancel between dispatches: the job ends with no token after it, the other goes on.
    first, second = job(cases[0][0], 20), job(cases[1][0], 11)
    scheduler.add(first)
    scheduler.add(second)
    for _ in range(4):
        scheduler.step()
    scheduler.cancel(first, "gone")
    while scheduler.busy:
        scheduler.step()
    tokens, event = result(first)
    assert event == ("cancelled", "gone") and tokens == running_sums(cases[0][0], len(tokens))
    assert result(second) == (running_sums(cases[1][0], 11), ("done", "length"))
    assert scheduler.pool.in_use() == 0 and sorted(scheduler.states.free) == [1, 2, 3]


def test_evicting_a_cached_page_frees_its_snapshot_and_a_full_pool_keeps_none():
    """A snapshot lives as long as its page in the prefix cache: a long reply that needs
    every page evicts them and frees their snapshots (the prompt is then read again). With
    one snapshot slot taken, a snapshot after a page no sequence holds is replaced; one
    after a page a sequence holds is kept, and another prompt read beside it keeps none
    (counted, no error)."""
    scheduler = running_sum_scheduler(prefill_chunk=8, num_pages=9, prefix_snapshots=1)
    prompt = list(range(1, 11))
    run(scheduler, [(prompt, 2)])
    assert scheduler.states.held() == 1 and scheduler.pool.cached() == 2
    assert run(scheduler, [([3], 31)]) == [(running_sums([3], 31), ("done", "length"))]
    assert scheduler.states.held() == scheduler.pool.cached() == 0
    assert run(scheduler, [(prompt, 2)])[0][0] == running_sums(prompt, 2)
    assert scheduler.cached_tokens == 0 and scheduler.states.held() == 1

    a, b = list(range(20, 29)), list(range(40, 49))
    outputs = run(scheduler, [(a, 2), (b, 2)])
    assert [o[0] for o in outputs] == [running_sums(a, 2), running_sums(b, 2)]
    kept = [scheduler.states.has(prefix_keys(p, PAGE, 2)[1]) for p in (prompt, a, b)]
    assert kept == [False, True, False]
    assert scheduler.states.skipped == 1 and scheduler.states.held() == 1


def test_stop_cancels_what_is_queued(llama):
    _, model, params = llama
    e = Engine(model, params, Partitioner(), seqio.ByteVocabulary(), max_seq_len=32)
    c = job([1, 2], 3)
    e.submit(c)  # not started: stays queued
    e.stop()
    assert c.events.get_nowait()[0] == "cancelled"
    with pytest.raises(queue.Empty):
        c.events.get_nowait()


@pytest.fixture
def environment_kept():
    """The process environment as it was, after the test: importing Pallas sets
    `MOSAIC_GPU_CUDA_ROOT` (Mosaic GPU's tools), which every process a later test starts
    would inherit (tests/zygote.py then refuses to fork them)."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.mark.slow
@pytest.mark.usefixtures("environment_kept")
def test_the_pallas_kernel_reads_the_pages_in_place_as_the_gather_path_attends(tmp_path):
    """`paged_attention='pallas'`: a decode dispatch's attention is JAX's Pallas
    paged-attention kernel reading the pool in place (interpreted off a GPU), over
    grouped-query heads of 16 features and pages of 16 slots; every token and log-prob equals
    the gathering engine's (log-probs to float32 round-off: the kernel sums in another
    order). A page size, a name or a mesh splitting the pool's heads (the kernel is not
    partitioned) is refused when the engine is made."""
    import jax

    from flaxlm.inference.scheduler import Scheduler
    from tests.helpers import jaxpr_equations

    _, model, params = hf_llama(tmp_path, hidden_size=64)  # heads of 16 features
    cases = [(p, 6) for p in prompts(3, seed=1)] + [([5] * 20, 5)]  # one crosses a page

    def decode(paged_attention):
        scheduler = Scheduler(
            model,
            params,
            Partitioner(),
            max_rows=4,
            page_size=16,
            max_seq_len=32,
            decode_steps=3,
            prefill_chunk=16,
            prefill_rows=4,
            paged_attention=paged_attention,
        )
        jobs = [job(p, n) for p, n in cases]
        for j in jobs:
            scheduler.add(j)
        while scheduler.busy:
            scheduler.step()
        return scheduler, [[j.events.get_nowait() for _ in range(j.events.qsize())] for j in jobs]

    gathered = decode("gather")[1]
    scheduler, kernel = decode("pallas")
    for (p, n), a, b in zip(cases, gathered, kernel):
        assert [e[1] for e in a if e[0] == "token"] == [e[1] for e in b if e[0] == "token"]
        assert len([e for e in b if e[0] == "token"]) == n, p
        np.testing.assert_allclose(
            [e[2] for e in b if e[0] == "token"], [e[2] for e in a if e[0] == "token"], atol=1e-5
        )
    # The kernel is in the decode dispatch's program (and not in the prefill's).
    cache = model.paged_cache(scheduler.num_pages, 16)
    rows = np.zeros((4,), np.int32)
    decode_jaxpr = jax.make_jaxpr(scheduler.programs.decode_fn)(
        scheduler.params, cache, rows, rows, np.zeros((4, 2), np.int32), None,
        rows, rows, rows, sampling.rows([], 4),
    )  # fmt: skip
    assert any(e.primitive.name == "pallas_call" for e in jaxpr_equations(decode_jaxpr.jaxpr))

    with pytest.raises(ValueError, match="power of two >= 16"):
        Scheduler(model, params, Partitioner(), page_size=8, paged_attention="pallas")
    with pytest.raises(ValueError, match="paged_attention='paged'"):
        Scheduler(model, params, Partitioner(), paged_attention="paged")
    with pytest.raises(ValueError, match="splits the pool's heads"):
        Scheduler(model, params, Partitioner((1, -1, 2)), paged_attention="pallas")
