"""The official `openai` client against `serve`'s Server, in-process, over a tiny HF Llama
whose tokenizer has a ChatML chat template: what a user of any OpenAI-speaking tool sees."""

import json
import re
import types
import urllib.error
import urllib.request
from typing import Literal

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import openai
import pydantic
import pytest
import seqio
import torch
import transformers
from tokenizers import AddedToken

from flaxlm.checkpoints import run_dir
from flaxlm.data import vocabularies
from flaxlm.inference.sampling import Sampling
from flaxlm.models import gpt_oss, llama
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs import serve as serve_run
from flaxlm.runs.serve import api, guides, reasoning, responses, settings, tool_formats, tools
from flaxlm.runs.serve.engine import BatchEngine, Engine
from flaxlm.runs.serve.http import Server
from flaxlm.runs.serve.sockets import listen
from tests.hf_helpers import random_hf_model, save_byte_bpe_tokenizer

MODEL = "tiny-chat"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "def main():"},
]
TOKENS = 8
# ChatML, with what Qwen2.5's template renders besides: a sender's name, an assistant's tool
# calls (their arguments an object) and a tool result's call id.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}"
    "{% if m.get('name') %} ({{ m['name'] }}){% endif %}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}"
    "{% if m.get('tool_call_id') %} [{{ m['tool_call_id'] }}]{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# A tool-use history as a client sends it back: the assistant's message as the response held
# it (content and refusal null, arguments a JSON string).
CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
RE = {"structured_outputs": {"regex": "[0-9]{3}"}}
TOOL_HISTORY = [
    {"role": "user", "name": "alice", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": CALL}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An HF directory: a tiny Llama, a ChatML tokenizer (<|endoftext|> and <|im_end|> end
    generation) and a generation_config.json that samples (temperature 0.7, top_p 0.9)."""
    path = tmp_path_factory.mktemp("tiny_chat")
    length = save_byte_bpe_tokenizer(path, style="qwen")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(str(path))
    eos = [length - 3, length - 1]
    torch_model = random_hf_model(
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        vocab_size=length,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=eos[0],
    )
    torch_model.generation_config = transformers.GenerationConfig(
        eos_token_id=eos, pad_token_id=eos[0], do_sample=True, temperature=0.7, top_p=0.9
    )
    torch_model.save_pretrained(str(path))
    return str(path), torch_model, eos


@pytest.fixture(scope="module")
def served(checkpoint):
    """(Server, openai.OpenAI) over the checkpoint, one for the module."""
    path, _, _ = checkpoint
    partitioner = Partitioner((1, 8, 1))
    model, params, _, row_start = run_dir.load_model_and_params(path, partitioner)
    engine = Engine(
        model,
        params,
        partitioner,
        run_dir.checkpoint_vocabulary(path),
        max_batch_size=8,
        batch_wait_ms=20,
    )
    server = Server(
        engine,
        MODEL,
        listen("127.0.0.1", 0),
        row_start=row_start,
        max_tokens_limit=64,
        tool_call_parser="hermes",
    )
    server.start()
    try:
        yield (
            server,
            openai.OpenAI(base_url=server.address + "/v1", api_key="x", max_retries=0, timeout=120),
        )
    finally:
        server.stop()


@pytest.fixture(scope="module")
def greedy(checkpoint):
    """HF `generate`'s greedy answer to MESSAGES, rendered by the same template: (text,
    new token ids, prompt ids)."""
    path, torch_model, eos = checkpoint
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        out = torch_model.generate(
            torch.tensor([ids]),
            do_sample=False,
            max_new_tokens=TOKENS,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    new = out[0, len(ids) :].tolist()
    ended = next((i for i, t in enumerate(new) if t in eos), None)
    new = new if ended is None else new[:ended]
    return tokenizer.decode(new, skip_special_tokens=True), new, ids, ended is not None


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)


def test_models_lists_the_served_model(served):
    _, client = served
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_chat_equals_hf_generate_on_the_rendered_prompt(served, greedy):
    _, client = served
    text, new, prompt_ids, stopped = greedy
    response = chat(client, temperature=0, max_completion_tokens=TOKENS)
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == ("stop" if stopped else "length")
    assert response.object == "chat.completion" and response.model == MODEL
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(new) + stopped  # the EOS counts
    # max_tokens (the older name) is the same setting.
    assert chat(client, temperature=0, max_tokens=TOKENS).choices[0].message.content == text


def test_chat_n_samples_each_cut_at_the_stop_string(served, greedy):
    _, client = served
    text, _, _, _ = greedy
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2].strip())
    response = chat(client, temperature=0, max_completion_tokens=TOKENS, n=2, stop=[stop])
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        assert choice.message.content == text[: text.find(stop)]
        assert choice.finish_reason == "stop"
    # Sampled: each sample its own seed (seed, seed + 1), sample 0 the n=1 answer.
    sampled = chat(client, temperature=1.0, max_completion_tokens=TOKENS, n=2, seed=7)
    first, second = (c.message.content for c in sampled.choices)
    assert first != second
    alone = chat(client, temperature=1.0, max_completion_tokens=TOKENS, seed=7)
    assert alone.choices[0].message.content == first
    # vLLM's include_stop_str_in_output: the stop string kept.
    kept = {"include_stop_str_in_output": True}
    kept = chat(client, temperature=0, max_tokens=TOKENS, stop=[stop], extra_body=kept)
    assert kept.choices[0].message.content == text[: text.find(stop) + len(stop)]


def test_streamed_chat_ends_with_a_usage_chunk(served, greedy):
    _, client = served
    text, new, prompt_ids, stopped = greedy
    chunks = list(
        chat(
            client,
            temperature=0,
            max_completion_tokens=TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *parts, last = chunks
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in parts) == text
    assert parts[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in parts)
    assert last.choices == []
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert last.usage.completion_tokens == len(new) + stopped


def test_vllms_return_token_ids_give_the_prompts_and_the_answers_ids(served, checkpoint, greedy):
    """vLLM's `return_token_ids`: a chat's `prompt_token_ids` (once, in the first chunk when
    streamed) and each choice's `token_ids` (the stop token that ended it included; when
    streamed, each chunk's own); a completion's both per choice."""
    _, client = served
    _, new, prompt_ids, stopped = greedy
    eos = checkpoint[2]
    flags = {"extra_body": {"return_token_ids": True}}
    answer = chat(client, temperature=0, max_completion_tokens=TOKENS, **flags)
    ids = answer.choices[0].token_ids
    assert answer.prompt_token_ids == prompt_ids and ids[: len(new)] == new
    assert len(ids) == len(new) + stopped and (not stopped or ids[-1] in eos)
    chunks = list(chat(client, temperature=0, max_tokens=TOKENS, stream=True, **flags))
    assert chunks[0].prompt_token_ids == prompt_ids
    assert all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].model_dump().get("token_ids") or []] == ids
    assert "token_ids" not in chat(client, max_tokens=1).choices[0].model_dump()
    prompts, whole = ["def f(", "x = "], {}
    for stream in (False, True):
        out = client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=3, temperature=0, stream=stream, **flags
        )
        choices = [c for chunk in out for c in chunk.choices] if stream else out.choices
        for index, prompt in enumerate(prompts):
            mine = [c for c in choices if c.index == index]
            assert mine[0].prompt_token_ids == served[0].encode(prompt), stream
            got = [t for c in mine for t in c.token_ids]
            assert len(got) == 3 or got[-1] in eos
            assert whole.setdefault(index, got) == got  # streamed as whole


def test_chat_logprobs_give_each_token_and_its_alternatives(served, greedy):
    _, client = served
    _, new, _, _ = greedy
    response = chat(
        client, temperature=0, max_completion_tokens=TOKENS, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert len(content) == len(new)
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        # Greedy: the chosen token is the likeliest.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= 0.0


def test_penalties_top_k_and_min_tokens_reach_the_engine(served, checkpoint, greedy):
    """vLLM's sampling parameters through the client's extra_body: a greedy answer with a
    repetition penalty is HF `generate`'s with the same penalty; top-k 1 samples the greedy
    answer; min_tokens holds the EOS back; OpenAI's logit_bias; ignore_eos, stop_token_ids
    and chat_template_kwargs."""
    path, torch_model, eos = checkpoint
    _, client = served
    text, new, ids, _ = greedy
    with torch.no_grad():
        out = torch_model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=TOKENS, eos_token_id=eos,
            pad_token_id=eos[0], repetition_penalty=0.5,
        )  # fmt: skip
    penalized = [t for t in out[0, len(ids) :].tolist() if t not in eos]
    assert penalized != new
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    response = chat(
        client, temperature=0, max_tokens=TOKENS, extra_body={"repetition_penalty": 0.5}
    )
    assert response.choices[0].message.content == tokenizer.decode(
        penalized, skip_special_tokens=True
    )
    top1 = chat(client, temperature=1.0, seed=3, max_tokens=TOKENS, extra_body={"top_k": 1})
    assert top1.choices[0].message.content == text
    held = chat(client, temperature=0, max_tokens=TOKENS, extra_body={"min_tokens": TOKENS})
    assert held.usage.completion_tokens == TOKENS and held.choices[0].finish_reason == "length"
    # OpenAI's logit_bias: a token pushed to the top is the whole answer.
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    biased = chat(client, temperature=0, max_tokens=3, logit_bias={str(a): 100})
    assert biased.choices[0].message.content == "aaa"
    # vLLM's ignore_eos and stop_token_ids: an EOS pushed to the top ends the answer at once,
    # or does not end it; a token of the request's own ends it.
    first_eos = {str(eos[0]): 100}
    assert chat(client, max_tokens=3, logit_bias=first_eos).choices[0].finish_reason == "stop"
    ignored = chat(client, max_tokens=3, logit_bias=first_eos, extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage.completion_tokens == 3
    stopped = chat(
        client, max_tokens=3, logit_bias={str(a): 100}, extra_body={"stop_token_ids": [a]}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].message.content == ""
    # vLLM's chat_template_kwargs reach the template (Qwen3's enable_thinking).
    quiet = chat(
        client,
        temperature=0,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    rendered = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert rendered.endswith("<think>\n\n</think>\n\n")
    rendered = tokenizer.encode(rendered, add_special_tokens=False)
    assert quiet.usage.prompt_tokens == len(rendered) > len(ids)


def test_completions_take_n_stop_and_stream_usage(served):
    _, client = served
    whole = client.completions.create(
        model=MODEL, prompt=["x = ", "def f("], max_tokens=6, temperature=0, n=2
    )
    texts = [c.text for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: the samples agree
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="x = ",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks[:-1]) == texts[0]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0


def hf_logps(torch_model, ids):
    """HF's log-softmax of each position's logits for `ids` (float64 numpy)."""
    with torch.no_grad():
        logits = torch_model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()


def test_echo_with_logprobs_scores_the_prompt_as_hf_and_lm_eval_reads_it(served, checkpoint):
    """A prompt of token ids with echo and logprobs (what lm-eval's local-completions sends
    to score a continuation): each prompt token's log-prob and the most likely there, as HF's
    model gives them, then the new token; and lm-eval's own client reads them."""
    server, client = served
    path, torch_model, eos = checkpoint
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer.encode("def main():\n    return 1 + 2", add_special_tokens=False)
    response = client.completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=1, temperature=0
    )
    choice, ref = response.choices[0], hf_logps(torch_model, ids)
    listed = choice.logprobs
    assert choice.text.startswith(tokenizer.decode(ids))
    assert "".join(listed.tokens[: len(ids)]) == tokenizer.decode(ids)
    assert listed.token_logprobs[0] is None and listed.top_logprobs[0] is None
    # The new token, or the EOS that ended the completion at once, listed last (as vLLM).
    assert len(listed.tokens) == len(ids) + 1 and response.usage.prompt_tokens == len(ids)
    expected = [ref[t - 1, ids[t]] for t in range(1, len(ids))]
    # float32 logits of O(1) through 2 layers: log-probs agree well inside 1e-4.
    np.testing.assert_allclose(listed.token_logprobs[1 : len(ids)], expected, atol=1e-4)
    for t in range(1, len(ids) + 1):
        best = {}  # ids that decode alike (a byte of a character) keep the likelier
        for i in np.argsort(-ref[t - 1])[:2]:
            best.setdefault(tokenizer.decode([int(i)]), ref[t - 1, i])
        top = listed.top_logprobs[t]
        assert list(top) == list(best), t
        np.testing.assert_allclose(list(top.values()), list(best.values()), atol=1e-4)
    # Two prompts of ids in one request, each scored on its own.
    both = client.completions.create(
        model=MODEL, prompt=[ids[:5], ids], echo=True, logprobs=0, max_tokens=1, temperature=0
    )
    assert both.choices[1].logprobs.token_logprobs[: len(ids)] == listed.token_logprobs[: len(ids)]
    assert both.choices[0].logprobs.top_logprobs is None
    # max_tokens=0 with echo (OpenAI's and vLLM's): the prompt alone, scored.
    alone = client.completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    (choice,) = alone.choices
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == listed.token_logprobs[: len(ids)]
    assert choice.logprobs.tokens == listed.tokens[: len(ids)]
    assert (alone.usage.prompt_tokens, alone.usage.completion_tokens) == (len(ids), 0)
    with pytest.raises(openai.BadRequestError, match="needs echo=true"):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=0)
    # Streamed, as vLLM streams it: the prompt with the first piece, its logprobs with it;
    # the chunks add up to the whole answer (max_tokens=0: the prompt alone, scored).
    for max_tokens in (4, 0):
        kwargs = dict(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=max_tokens)
        kwargs["temperature"] = 0
        whole = client.completions.create(**kwargs).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)]
        assert chunks[0].text.startswith(tokenizer.decode(ids)) and chunks[0].logprobs
        assert "".join(c.text for c in chunks) == whole.text
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            streamed = [x for c in chunks if c.logprobs for x in getattr(c.logprobs, key)]
            assert streamed == getattr(whole.logprobs, key), key
        assert chunks[-1].finish_reason == whole.finish_reason
    # lm-eval's local-completions client as a user starts it (its tokenizer found on the
    # server: /tokenizer_info, /tokenize, /detokenize; tokenized requests): its
    # log-likelihoods and greedy flags are HF's, continuation by continuation.
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=server.address + "/v1/completions", model=MODEL, max_retries=1
    )
    assert lm.tokenizer_backend == "remote"
    for path_, body, status, message in [
        ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "does not exist"),
        ("/detokenize", {"tokens": [10**6]}, 400, "outside the model's vocabulary"),
        ("/tokenize", {"prompt": 3}, 400, "'prompt' must be a string"),
    ]:
        request = urllib.request.Request(server.address + path_, json.dumps(body).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request)
        assert refused.value.code == status
        assert message in json.loads(refused.value.read())["error"]["message"]
    assert lm.tokenizer.eos_token_id == eos[0]
    assert lm.tokenizer.decode(ids) == tokenizer.decode(ids)
    pairs = [("def main():", "\n    return"), ("x = 1", " + 2"), ("print(", "x)")]
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(pairs)
    ]
    results = lm.loglikelihood(requests, disable_tqdm=True)
    for (context, continuation), (logp, greedy) in zip(pairs, results):
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        start = len(tokenizer.encode(context, add_special_tokens=False))
        ref = hf_logps(torch_model, whole)
        predicted = ref[start - 1 : len(whole) - 1]
        targets = whole[start:]
        np.testing.assert_allclose(logp, predicted[range(len(targets)), targets].sum(), atol=1e-4)
        assert greedy == bool((predicted.argmax(-1) == targets).all())


def test_vllms_prompt_logprobs_give_each_prompt_tokens_logprob_rank_and_alternatives(
    served, checkpoint
):
    """vLLM's `prompt_logprobs` (extra_body): per prompt token (the first None) its log-prob,
    its rank and the k most likely there, keyed by token id, as HF's model gives them; per
    choice of a completion, once at the top of a chat answer; a 400 when streamed."""
    _, client = served
    path, torch_model, _ = checkpoint
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer.encode("def main():\n    return 1 + 2", add_special_tokens=False)
    ref = hf_logps(torch_model, ids)
    text = client.completions.create(
        model=MODEL, prompt=[ids, ids[:4]], max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer.encode(rendered, add_special_tokens=False)
    answer = chat(client, max_tokens=1, extra_body={"prompt_logprobs": 0})
    for listed, prompt, k in (
        (text.choices[0].prompt_logprobs, ids, 2),
        (text.choices[1].prompt_logprobs, ids[:4], 2),
        (answer.prompt_logprobs, chat_ids, 0),
    ):
        scores = hf_logps(torch_model, prompt) if prompt is not ids else ref
        assert listed[0] is None and len(listed) == len(prompt)
        for t in range(1, len(prompt)):
            row, token = scores[t - 1], prompt[t]
            mine = listed[t][str(token)]
            # float32 logits of O(1) through 2 layers: log-probs agree well inside 1e-4; a
            # rank may differ only where another token's log-prob is that close.
            np.testing.assert_allclose(mine["logprob"], row[token], atol=1e-4)
            close = np.abs(row - row[token]) < 1e-4
            higher = int((row > row[token]).sum()) + 1
            assert higher - close.sum() < mine["rank"] <= higher + close.sum()
            assert mine["decoded_token"] == tokenizer.decode([token])
            best = np.argsort(-row)[:k].tolist()
            assert set(listed[t]) == {str(i) for i in [token, *best]}
            for rank, i in enumerate(best, 1):
                np.testing.assert_allclose(listed[t][str(i)]["logprob"], row[i], atol=1e-4)
                assert listed[t][str(i)]["rank"] == rank or i == token
    assert text.choices[0].logprobs is None  # not asked for
    # With echo (and no logprobs): the same scores.
    echoed = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, echo=True, extra_body={"prompt_logprobs": 2}
    )
    assert echoed.choices[0].prompt_logprobs == text.choices[0].prompt_logprobs
    with pytest.raises(openai.BadRequestError, match="not streamed"):
        chat(client, stream=True, extra_body={"prompt_logprobs": 1})


def test_a_tool_use_history_reaches_the_template_as_vllm_hands_it_on(served, checkpoint):
    """Names, tool calls and call ids go to the checkpoint's template (rendered as HF's
    apply_chat_template renders the same messages, a call's arguments parsed into an object);
    null fields a response carried are dropped."""
    _, client = served
    response = client.chat.completions.create(
        model=MODEL, messages=TOOL_HISTORY, max_tokens=1, temperature=0
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint[0])
    call = {"id": "c1", "type": "function", "function": {**CALL, "arguments": {"city": "Paris"}}}
    rendered = [
        TOOL_HISTORY[0],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        TOOL_HISTORY[2],
    ]
    prompt = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    assert "(alice)" in prompt and '{"city": "Paris"}</tool_call>' in prompt and "[c1]" in prompt
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert response.usage.prompt_tokens == len(ids)


def test_vllms_continue_final_message_and_add_generation_prompt_render_as_hf_does(
    served, checkpoint
):
    """vLLM's `continue_final_message` (the assistant's last message continued, not closed:
    a prefilled answer) and `add_generation_prompt=false` reach `apply_chat_template`."""
    _, client = served
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint[0])
    prefilled = [*MESSAGES, {"role": "assistant", "content": "def"}]
    for messages, flags in (
        (prefilled, {"continue_final_message": True}),
        (MESSAGES, {"add_generation_prompt": False}),
    ):
        answer = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, extra_body=flags
        )
        hf_flags = {"add_generation_prompt": False, **flags}
        text = tokenizer.apply_chat_template(messages, tokenize=False, **hf_flags)
        assert answer.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
        # Neither opens a new assistant turn: one ends in "def", the other closed.
        assert text.endswith("def" if "continue_final_message" in flags else "<|im_end|>\n")


def rendered_length(tokenizer, messages, **kwargs):
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs
    )
    return len(tokenizer.encode(prompt, add_special_tokens=False))


def scripted(tokenizer, text):
    """An engine's `submit_many` that answers every completion with the tokens of `text` (the
    tiny random model writes no tool calls or think blocks)."""
    ids = tokenizer.encode(text, add_special_tokens=False)

    def submit_many(completions):
        for c in completions:
            for t in ids:
                c.events.put(("token", t, 0.0, []))
            c.events.put(("done", "stop", tokenizer.eos_token_id, 0.0, []))

    return submit_many


def test_a_think_block_comes_back_as_reasoning_whole_and_streamed(served, checkpoint, monkeypatch):
    """With a reasoning parser (vLLM's --reasoning-parser qwen3), an answer's <think> block
    is the message's `reasoning`, the rest its content; streamed, the deltas add up to the
    same (the tags split across tokens held back, never shown)."""
    server, client = served
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint[0])
    text = "<think>\nThe user wants a function.\n</think>\n\nHere it is."
    monkeypatch.setattr(server.engine, "submit_many", scripted(tokenizer, text))
    monkeypatch.setattr(server, "reasoning_parser", "qwen3")
    response = chat(client)
    message = response.choices[0].message
    # The stop token counts, as vLLM's and OpenAI's usage count it.
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert response.usage.completion_tokens == len(ids) + 1
    assert message.reasoning == "\nThe user wants a function.\n"
    # The message sent back as the client holds it (its `reasoning` reaches the template as
    # `reasoning_content`, the field Qwen3's template reads).
    history = [*MESSAGES, message, {"role": "user", "content": "More."}]
    assert client.chat.completions.create(model=MODEL, messages=history, max_tokens=1).choices
    body = json.dumps({"messages": [message.model_dump(exclude_unset=True)]}).encode()
    parsed = api.parse_chat_request(body, 512, 64)["messages"][0]
    assert parsed["reasoning_content"] == message.reasoning
    assert message.content == "\n\nHere it is."
    deltas = [c.choices[0].delta for c in chat(client, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    assert len([d for d in deltas if getattr(d, "reasoning", None)]) > 1  # as it came


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"tool_call_parser": "json"}, "serve.tool_call_parser='json': expected None or one of"),
        ({"reasoning_parser": "r1"}, "serve.reasoning_parser='r1': expected None or one of"),
        (
            {"tool_call_parser": "openai", "reasoning_parser": "qwen3"},
            "set serve.reasoning_parser='openai_gptoss' too",
        ),
        ({"responses_kept": -1}, "RESPONSES_KEPT=-1 must be a whole number >= 0"),
        ({"decode_steps": 0}, "DECODE_STEPS=0 must be a whole number >= 1"),
        ({"max_model_len": "4k"}, "MAX_MODEL_LEN='4k' must be a whole number >= 2"),
    ],
)
def test_a_parser_serve_cannot_use_is_named_before_the_model_loads(settings, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        serve_run.serve(checkpoint=str(tmp_path / "never_read"), port=0, **settings)


def test_the_paged_engines_settings_are_refused_for_a_model_that_does_not_page(
    monkeypatch, tmp_path
):
    refusal = "T5Model decodes over a contiguous KV cache only."
    model = types.SimpleNamespace(config=None, paged_refusal=lambda: refusal)
    loaded = lambda *args, **kwargs: (model, None, 0, None)  # noqa: E731
    monkeypatch.setattr(serve_run.run_dir, "load_model_and_params", loaded)
    message = (
        f"DECODE_STEPS, PAGE_SIZE tune the paged engine, which this model does not use ({refusal})"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        serve_run.serve(checkpoint=str(tmp_path), port=0, decode_steps=4, page_size=8)


def test_a_gpt_oss_checkpoint_reads_harmony_unless_told_otherwise():
    """As vLLM: gpt-oss's answers are harmony, read so where no parser was chosen; 'openai'
    alone is then allowed for it, refused (once the model is known) for any other family."""
    oss, llama_ = gpt_oss.GptOssConfig(), llama.LlamaConfig()
    assert serve_run.reasoning_parser_for(oss, None) == "openai_gptoss"
    assert serve_run.reasoning_parser_for(oss, "qwen3") == "qwen3"
    assert serve_run.reasoning_parser_for(llama_, None) is None
    tools.check_parser("openai", None, final=False)
    tools.check_parser("openai", serve_run.reasoning_parser_for(oss, None))
    with pytest.raises(ValueError, match="openai_gptoss"):
        tools.check_parser("openai", serve_run.reasoning_parser_for(llama_, None))


def test_think_tags_a_tokenizer_marks_special_stay_in_the_text_the_parser_reads(
    checkpoint, tmp_path
):
    """Chat answers leave out every token the tokenizer marks special, but with a reasoning
    parser not its think tags (vLLM's parsers read them as ids; flaxlm's read the text)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint[0])
    tags = [AddedToken(t, special=True, normalized=False) for t in ("<think>", "</think>")]
    tokenizer.add_tokens(tags, special_tokens=True)
    tokenizer.save_pretrained(str(tmp_path))
    tag_ids = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    special = vocabularies.special_token_ids(tokenizer)
    added = tokenizer.get_added_vocab()
    assert set(tag_ids) <= special and reasoning.tag_ids(added, "qwen3") == set(tag_ids)
    vocabulary = vocabularies.HuggingFaceVocabulary(str(tmp_path))
    ids = tokenizer.encode("<think>a</think>b", add_special_tokens=False)
    assert set(tag_ids) <= set(ids)
    request = {"chat": True, "stop": [], "tools": None, "echo": False, "logprobs": None}
    request.update(skip_special_tokens=True, include_stop=False)  # a chat's, as settled
    for parser, text in (("qwen3", "<think>a</think>b"), (None, "ab")):
        server = types.SimpleNamespace(
            special_ids=special,
            added_vocab=added,
            reasoning_parser=parser,
            tool_parser=None,
            engine=types.SimpleNamespace(vocabulary=vocabulary),
        )
        stream = Server.text_stream(server, request)
        assert "".join(stream.add(i, 0.0, []) for i in ids) + stream.flush() == text


HARMONY_ANALYSIS = "<|channel|>analysis<|message|>a<|end|>"
HARMONY_FINAL = "<|channel|>final<|message|>b"


@pytest.mark.parametrize(
    "parser, kwargs, text, reasoning_, content",
    [
        ("qwen3", {}, "<think>a</think>b", "a", "b"),
        ("qwen3", {}, "no block", None, "no block"),  # enable_thinking=False
        ("qwen3", {}, "<think>cut at max_tokens", "cut at max_tokens", None),
        ("qwen3", {}, "<thinking> is not the tag", None, "<thinking> is not the tag"),
        ("glm45", {}, "<think>a</think>b", "a", "b"),
        ("deepseek_r1", {}, "opened by the prompt</think>b", "opened by the prompt", "b"),
        ("deepseek_r1", {}, "<think>a</think>", "a", None),
        ("deepseek_r1", {}, "still thinking", "still thinking", None),
        ("minimax_m2", {}, "opened by the prompt</think>b", "opened by the prompt", "b"),
        ("seed_oss", {}, "<seed:think>a</seed:think>b", "a", "b"),
        ("seed_oss", {}, "still thinking", "still thinking", None),
        # DeepSeek-V3.1's template opens the block where the request turns thinking on
        ("deepseek_v3", {"thinking": True}, "a</think>b", "a", "b"),
        ("deepseek_v3", {}, "a</think>b", None, "a</think>b"),
        ("mistral", {}, "[THINK]a[/THINK]b", "a", "b"),
        ("mistral", {}, "<think>a</think>b", None, "<think>a</think>b"),
        # gpt-oss's harmony channels (a header cut off at max_tokens gives nothing)
        ("openai_gptoss", {}, f"{HARMONY_ANALYSIS}<|start|>assistant{HARMONY_FINAL}", "a", "b"),
        ("openai_gptoss", {}, f"{HARMONY_FINAL}<|end|><|start|>assistant<|chan", None, "b"),
        ("openai_gptoss", {}, "no channels", None, "no channels"),
    ],
)
def test_reasoning_splits_whole_and_in_any_pieces_alike(parser, kwargs, text, reasoning_, content):
    assert reasoning.split(text, parser, kwargs) == (reasoning_, content)
    for size in (1, 2, 3, 7):
        splitter = reasoning.splitter(parser, kwargs)
        parts = [splitter.feed(text[i : i + size]) for i in range(0, len(text), size)]
        parts.append(splitter.flush())
        assert "".join(p[0] for p in parts) == (reasoning_ or "")
        assert "".join(p[1] for p in parts) == (content or "")


def test_tools_reach_the_template_and_a_hermes_call_comes_back_as_tool_calls(
    served, checkpoint, monkeypatch
):
    """A request's tools rendered by the template (not with tool_choice 'none', as vLLM);
    an answer holding a Hermes `<tool_call>` block comes back as the message's tool_calls,
    whole or streamed (the engine scripted: the tiny random model writes no calls); the
    history the client then sends back is accepted."""
    server, client = served
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint[0])
    offered = chat(client, tools=TOOLS, max_tokens=2, temperature=0)
    assert offered.usage.prompt_tokens == rendered_length(tokenizer, MESSAGES, tools=TOOLS)
    assert offered.choices[0].message.tool_calls is None  # no call in the model's text
    hidden = chat(client, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert hidden.usage.prompt_tokens == rendered_length(tokenizer, MESSAGES)
    text = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    monkeypatch.setattr(server.engine, "submit_many", scripted(tokenizer, text + "</tool_call>"))
    choice = chat(client, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    result = {"role": "tool", "tool_call_id": call.id, "content": "18C"}
    again = client.chat.completions.create(
        model=MODEL, messages=[*MESSAGES, choice.message, result], tools=TOOLS
    )
    assert again.choices[0].finish_reason == "tool_calls"
    # Streamed: the content as deltas, then the call whole in one delta (as OpenAI's clients
    # accumulate it), then the finish reason.
    chunks = [c for c in chat(client, tools=TOOLS, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me look."
    (streamed,) = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert streamed.index == 0 and streamed.id.startswith("call_")
    assert (streamed.function.name, streamed.function.arguments) == (
        call.function.name,
        call.function.arguments,
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Two calls; parallel_tool_calls=false keeps the first, as vLLM's (whole and streamed).
    second = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    both = scripted(tokenizer, text + "</tool_call>" + second)
    monkeypatch.setattr(server.engine, "submit_many", both)
    assert len(chat(client, tools=TOOLS).choices[0].message.tool_calls) == 2
    (first,) = chat(client, tools=TOOLS, parallel_tool_calls=False).choices[0].message.tool_calls
    assert json.loads(first.function.arguments) == {"city": "Paris"}
    chunks = chat(client, tools=TOOLS, parallel_tool_calls=False, stream=True)
    assert len([t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]) == 1
    # With tools offered, an answer keeps its special tokens (some formats write their
    # markers as special tokens; vLLM's parsers decode with skip_special_tokens=false).
    special = "<|im_start|>"
    assert tokenizer.convert_tokens_to_ids(special) in server.special_ids
    monkeypatch.setattr(server.engine, "submit_many", scripted(tokenizer, f"a{special}b"))
    assert chat(client, tools=TOOLS).choices[0].message.content == f"a{special}b"
    assert chat(client).choices[0].message.content == "ab"
    # vLLM's skip_special_tokens chooses (a completion shows them unless told); not where
    # calls are read from them.
    shown = {"skip_special_tokens": False}
    assert chat(client, extra_body=shown).choices[0].message.content == f"a{special}b"
    completion = client.completions.create(model=MODEL, prompt="x", max_tokens=4)
    assert completion.choices[0].text == f"a{special}b"
    hidden = {"skip_special_tokens": True}
    completion = client.completions.create(model=MODEL, prompt="x", extra_body=hidden)
    assert completion.choices[0].text == "ab"
    with pytest.raises(openai.BadRequestError, match="skip_special_tokens=true"):
        chat(client, tools=TOOLS, extra_body=hidden)
    # gpt-oss (vLLM's --reasoning-parser openai_gptoss --tool-call-parser openai): harmony's
    # analysis channel is the reasoning, a commentary message to a function the call.
    harmony = (
        "<|channel|>analysis<|message|>Paris, then.<|end|><|start|>assistant to=functions."
        'get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}'
    )
    monkeypatch.setattr(server.engine, "submit_many", scripted(tokenizer, harmony))
    monkeypatch.setattr(server, "reasoning_parser", "openai_gptoss")
    monkeypatch.setattr(server, "tool_parser", "openai")
    for stream in (False, True):
        answer = chat(client, tools=TOOLS, stream=stream)
        if stream:
            deltas = [c.choices[0].delta for c in answer if c.choices]
            thought = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
            content = "".join(d.content or "" for d in deltas) or None
            calls = [t for d in deltas for t in d.tool_calls or []]
        else:
            message = answer.choices[0].message
            thought, content, calls = message.reasoning, message.content, message.tool_calls
        assert (thought, content) == ("Paris, then.", None), stream
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})
        ]
    monkeypatch.setattr(server, "tool_parser", "hermes")
    # A Qwen3 answer that thinks, then calls: reasoning, no content, the call (both ways).
    thinking = "<think>Paris, then.</think>\n\n" + second
    monkeypatch.setattr(server.engine, "submit_many", scripted(tokenizer, thinking))
    monkeypatch.setattr(server, "reasoning_parser", "qwen3")
    message = chat(client, tools=TOOLS).choices[0].message
    assert (message.reasoning, message.content) == ("Paris, then.", None)
    assert len(message.tool_calls) == 1
    deltas = [c.choices[0].delta for c in chat(client, tools=TOOLS, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "Paris, then."
    assert "".join(d.content or "" for d in deltas) == ""
    assert len([t for d in deltas for t in d.tool_calls or []]) == 1


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("no call", "no call", []),
        ('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', None, [("f", {"x": 1})]),
        (
            'a <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {"y": "é"}}',  # the last block unclosed
            "a ",
            [("f", {}), ("g", {"y": "é"})],
        ),
        ('<tool_call>{"name": "f", "arguments": </tool_call>', None, None),  # not JSON
        ('<tool_call>["f"]</tool_call>', None, None),  # not a call
        ('\n\n<tool_call>{"name": "f", "arguments": {}}</tool_call>', None, [("f", {})]),
        ("a <tool_ca and more", "a <tool_ca and more", []),  # a tag's start, held, then not
    ],
)
def test_hermes_calls_are_read_as_vllms_parser_reads_them(text, content, calls):
    check_parsed("hermes", text, content, calls)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Paris is sunny.", "Paris is sunny.", []),
        ('{"name": "f", "parameters": {"x": 1}}', None, [("f", {"x": 1})]),
        (
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"y": 2}}',
            None,
            [("f", {}), ("g", {"y": 2})],
        ),
        ('{"name": "f", "parameters": ', None, None),  # cut off: not JSON
        ('{"city": "Paris"}', None, None),  # JSON, not a call
        (' {"name": "f", "parameters": {}}', ' {"name": "f", "parameters": {}}', []),
        ("<|python is not the tag", "<|python is not the tag", []),
    ],
)
def test_llama3_json_calls_are_read_as_vllms_parser_reads_them(text, content, calls):
    check_parsed("llama3_json", text, content, calls)


# The arguments the XML formats write as text are typed by the tool's schema.
TYPED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "w",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
DS = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{}<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>"
)
DSML = "｜DSML｜"


@pytest.mark.parametrize(
    "parser, text, content, calls",
    [
        (  # a string parameter keeps its text ("007"), an integer one is read, an unknown
            # one (not in the schema) is text
            "qwen3_coder",
            "Checking.\n<tool_call>\n<function=w>\n<parameter=city>\n007\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=note>\n[1]\n</parameter>\n"
            "</function>\n</tool_call>",
            "Checking.\n",
            [("w", {"city": "007", "days": 3, "note": "[1]"})],
        ),
        ("qwen3_coder", "<tool_call>\nnot a function\n</tool_call>", None, None),
        (
            "seed_oss",
            "Ok.<seed:tool_call>\n<function=w>\n<parameter=city>007</parameter>\n"
            "<parameter=days>3</parameter>\n</function>\n</seed:tool_call>",
            "Ok.",
            [("w", {"city": "007", "days": 3})],
        ),
        (
            "glm45",
            "<tool_call>w\n<arg_key>city</arg_key>\n<arg_value>007</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
            None,
            [("w", {"city": "007", "days": 3})],
        ),
        (  # GLM-4.7's: no newline after the name
            "glm47",
            "So: <tool_call>w<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>",
            "So: ",
            [("w", {"city": "Oslo"})],
        ),
        ("glm45", "<tool_call>w\n<arg_key>city", None, None),  # cut off: no whole call
        (
            "deepseek_v31",
            "Ok." + DS.format("w", '{"city": "Oslo"}'),
            "Ok.",
            [("w", {"city": "Oslo"})],
        ),
        (
            "deepseek_v3",
            DS.format("function", 'w\n```json\n{"city": "Oslo"}\n```'),
            None,
            [("w", {"city": "Oslo"})],
        ),
        ("deepseek_v31", DS.format("w", "{not json"), None, None),
        (
            "deepseek_v32",
            f'<{DSML}function_calls>\n<{DSML}invoke name="w">\n<{DSML}parameter name="city" '
            f'string="true">007</{DSML}parameter>\n<{DSML}parameter name="days" '
            f'string="false">3</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}function_calls>',
            None,
            [("w", {"city": "007", "days": 3})],
        ),
        (
            "kimi_k2",
            "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.w:0"
            '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
            "<|tool_calls_section_end|>",
            "Sure.",
            [("w", {"city": "Oslo"})],
        ),
        (
            "mistral",
            '[TOOL_CALLS]w[ARGS]{"city": "Oslo"}[TOOL_CALLS]w[ARGS]{"days": 2}',
            None,
            [("w", {"city": "Oslo"}), ("w", {"days": 2})],
        ),
        (  # before Mistral's tokenizers v11
            "mistral",
            '[TOOL_CALLS][{"name": "w", "arguments": {"city": "Oslo"}}]',
            None,
            [("w", {"city": "Oslo"})],
        ),
        ("mistral", "[TOOL_CALLS]w[ARGS]{cut", None, None),
        (
            "pythonic",
            '[w(city="Oslo", days=2), w(note=[1, {"a": None}], ok=True)]',
            None,
            [("w", {"city": "Oslo", "days": 2}), ("w", {"note": [1, {"a": None}], "ok": True})],
        ),
        (
            "llama4_pythonic",
            "<|python_start|>[w(city='Oslo')]<|python_end|>",
            None,
            [("w", {"city": "Oslo"})],
        ),
        ("pythonic", "[w('Oslo')]", None, None),  # positional: not a call vLLM reads
        ("pythonic", "[w(city=x)]", None, None),  # not a literal
        ("pythonic", "[1, 2] and more", None, None),
        ("pythonic", "Sure: [w(city='Oslo')]", "Sure: [w(city='Oslo')]", []),  # not first
        (  # as the openai_gptoss reasoning parser hands harmony's calls on
            "openai",
            'Let me look.<|channel|>commentary to=functions.w<|message|>{"city": "Oslo"}',
            "Let me look.",
            [("w", {"city": "Oslo"})],
        ),
    ],
)
def test_each_familys_calls_are_read_as_vllms_parser_of_that_name_reads_them(
    parser, text, content, calls
):
    got = check_parsed(parser, text, content, calls)
    # Kimi's ids are the template's own (functions.NAME:N); Mistral's templates take ids of
    # 9 letters and digits.
    if parser == "kimi_k2":
        assert got[0]["id"] == "functions.w:0"
    if parser == "mistral" and got:
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got)


def check_parsed(parser, text, content, calls):
    """The whole answer read as vLLM's parser reads it; streamed in pieces of any size, the
    content deltas and calls add up to the same."""
    got_content, got_calls = tool_formats.read(tools.PARSERS[parser], text, TYPED_TOOLS)
    if calls is None:  # a block that does not parse: all of it is content, no calls
        assert (got_content, got_calls) == (text, [])
    else:
        assert got_content == content
        assert named(got_calls) == calls
    for size in (1, 2, 3, 7):
        stream = tools.CallStream(tools.PARSERS[parser], TYPED_TOOLS)
        sent = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
        rest, streamed_calls = stream.flush()
        assert "".join(sent) + rest == (got_content or "")
        assert named(streamed_calls) == named(got_calls)
    return got_calls


def named(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        ({"temperature": 3}, "temperature", "temperature must be between 0 and 2"),
        ({"n": 40}, "n", "n must be at least 1"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "role"),
        ({"max_completion_tokens": 1000}, "max_completion_tokens", "between 1 and 64"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate", "Unknown field 'frobnicate'"),
        ({"store": True}, "store", "keeps no completions"),
        (
            {"extra_body": {"chat_template_kwargs": {"tokenize": True}}},
            "chat_template_kwargs",
            "apply_chat_template's own arguments",
        ),
        ({"presence_penalty": 2.5}, "presence_penalty", "between -2 and 2"),
        (
            {"extra_body": {"continue_final_message": True, "add_generation_prompt": True}},
            "continue_final_message",
            "Cannot set both",
        ),
        ({"extra_body": {"top_k": -2}}, "top_k", "top_k must be -1 or 0"),
        ({"extra_body": {"top_k": 2**40}}, "top_k", "top_k must be -1 or 0"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "must be > 0"),
        ({"max_tokens": 4, "extra_body": {"min_tokens": 5}}, "min_tokens", "between 0 and"),
        ({"logit_bias": {"5": 300}}, "logit_bias", "between -100 and 100"),
        ({"logit_bias": {"999999": 3}}, "logit_bias", "outside the model's vocabulary"),
        ({"extra_body": {"stop_token_ids": ["a"]}}, "stop_token_ids", "list of token ids"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "'required' or"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": RE},
            "structured_outputs",
            "ask for one structured output",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "'json_schema'"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs {'json_schema'",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "(", "choice": ["a"]}}},
            "structured_outputs",
            "one of",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(["}}}, "structured_outputs", "regex"),
        (
            {"extra_body": {"structured_outputs": {"backend": "x"}}},
            "structured_outputs",
            "not read",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0]", "must be {'type': 'function'"),
        ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
        (
            {"messages": [{"role": "assistant", "content": "no", "refusal": "I cannot."}]},
            "messages[0].refusal",
            "not supported",
        ),
    ],
)
def test_a_bad_request_is_a_bad_request_error_naming_the_field(served, kwargs, param, message):
    _, client = served
    kwargs = {"model": MODEL, "messages": MESSAGES, **kwargs}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**kwargs)
    assert raised.value.status_code == 400
    assert raised.value.param == param and message in raised.value.message
    assert raised.value.type == "invalid_request_error"


def test_a_tokenizer_without_a_chat_template_is_named(tmp_path):
    save_byte_bpe_tokenizer(tmp_path, style="llama3")  # no chat template
    for vocabulary in (vocabularies.HuggingFaceVocabulary(str(tmp_path)), seqio.ByteVocabulary()):
        with pytest.raises(settings.BadRequest, match="no chat template") as raised:
            api.render_chat(vocabulary, MESSAGES)
        assert raised.value.param == "messages"


def test_unset_settings_come_from_the_generation_config(served):
    server, _ = served
    assert server.defaults == settings.Defaults(temperature=0.7, top_p=0.9, max_tokens=None)
    parsed = api.parse_chat_request(
        json.dumps({"messages": MESSAGES, "temperature": None}).encode(), 128, 64, server.defaults
    )
    assert parsed["sampling"] == Sampling(0.7, 0.9) and parsed["max_tokens"] is None
    defaults = settings.Defaults.from_generation_config(
        {"max_new_tokens": 500, "top_p": 7, "top_k": 2**40}, 64
    )
    assert defaults == settings.Defaults(temperature=1.0, top_p=1.0, max_tokens=64)
    # vLLM's reading of a file: top_k, min_p and repetition_penalty too.
    file = {"temperature": 0.6, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}
    read = settings.Defaults.from_generation_config(file, 64)
    parsed = api.parse_chat_request(json.dumps({"messages": MESSAGES}).encode(), 128, 64, read)
    assert parsed["sampling"] == Sampling(0.6, 1.0, 20, 0.05, repetition_penalty=1.05)
    body = {"messages": MESSAGES, "presence_penalty": 0.5, "frequency_penalty": -1, "top_k": -1}
    parsed = api.parse_chat_request(json.dumps(body).encode(), 128, 64, read)
    assert parsed["sampling"] == Sampling(0.6, 1.0, 0, 0.05, 0.5, -1.0, repetition_penalty=1.05)
    parsed = api.parse_request(b'{"prompt": "a"}', 128, 64, defaults)
    assert parsed["max_tokens"] == 64 and parsed["seed"] is None
    seeds = settings.sample_seeds(2**32 - 1, 3)
    assert seeds == [2**32 - 1, 0, 1] and len(set(settings.sample_seeds(None, 4))) == 4
    assert np.all(np.asarray(seeds) < settings.SEED_LIMIT)


# Structured outputs (serve/guides.py): a schema whose every answer ends (enums, booleans, no
# other keys), so that the tiny random model's answers are whole.
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
CITIES = ["Rome", "Oslo"]  # short: the tiny tokenizer writes about a token a character
ENUM_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": CITIES}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    for name in ("wx", "tm")
]


class Verdict(pydantic.BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


def obeys(text):
    value = json.loads(text)
    assert set(value) == {"color", "ok"}, value
    assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
    return value


@pytest.mark.slow
def test_structured_outputs_through_the_official_client(served):
    """OpenAI's `response_format` (the client's own `parse` with a pydantic model: a strict
    json_schema), sampled and streamed; vLLM's `structured_outputs` choice and regex (the
    completions endpoint too); `tool_choice` required and named: every answer follows its
    grammar, as Python's json.dumps lays JSON out."""
    _, client = served
    parsed = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Verdict, max_tokens=48, temperature=0
    )
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Verdict)
    assert choice.message.content == json.dumps(choice.message.parsed.model_dump())
    schema = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    sampled = chat(client, response_format=schema, n=3, temperature=1.0, max_tokens=48, seed=5)
    for c in sampled.choices:
        assert c.finish_reason == "stop", c
        obeys(c.message.content)
    chunks = [c for c in chat(client, response_format=schema, stream=True, max_tokens=48)]
    obeys("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    answer = chat(
        client, max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert answer.choices[0].message.content in ("yes", "no")
    text = client.completions.create(model=MODEL, prompt="n:", max_tokens=8, extra_body=RE)
    assert re.fullmatch("[0-9]{3}", text.choices[0].text), text.choices[0].text
    # tool_choice: 'required' gives tool_calls (finish reason tool_calls), a named function
    # its call (finish reason stop, as OpenAI answers a forced function), whole or streamed,
    # whatever the server's tool-call parser (hermes here).
    for tool_choice, reason in (
        ("required", "tool_calls"),
        ({"type": "function", "function": {"name": "tm"}}, "stop"),
    ):
        kwargs = dict(tools=ENUM_TOOLS, tool_choice=tool_choice, max_tokens=64)
        one = chat(client, parallel_tool_calls=False, **kwargs).choices[0]
        assert one.finish_reason == reason and one.message.content is None, one
        (call,) = one.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        if reason == "stop":
            assert call.function.name == "tm"
        assert json.loads(call.function.arguments)["city"] in CITIES
        chunks = [c for c in chat(client, parallel_tool_calls=False, stream=True, **kwargs)]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        (streamed,) = [t for d in deltas for t in d.tool_calls or []]
        assert streamed.function.name in ("wx", "tm")
        assert json.loads(streamed.function.arguments)["city"] in CITIES
        assert "".join(d.content or "" for d in deltas) == ""
        assert chunks[-1].choices[0].finish_reason == reason


def hf_guided(torch_model, tokenizer, ids, grammar, eos, new):
    """HF `generate`'s greedy tokens with llguidance's mask for `grammar` applied to each
    step's logits (its own matcher, as a `LogitsProcessor`)."""
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=torch_model.vocab_size, eos_token=eos)
    matcher = llguidance.LLMatcher(lltok, grammar)

    def guided(input_ids, scores):
        if input_ids.shape[1] > len(ids):
            assert matcher.consume_token(int(input_ids[0, -1]))
        mask = llguidance.numpy.allocate_token_bitmask(1, scores.shape[-1])
        llguidance.numpy.fill_next_token_bitmask(matcher, mask)
        masked = scores.numpy().copy()
        llguidance.numpy.apply_token_bitmask_inplace(masked, mask)
        return torch.from_numpy(masked)

    with torch.no_grad():
        out = torch_model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=new, eos_token_id=eos,
            pad_token_id=eos[0], logits_processor=transformers.LogitsProcessorList([guided]),
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_guided_greedy_tokens_are_hf_generates_under_the_same_mask(served, checkpoint):
    """Greedy guided rows (a JSON schema, a regex) give HF `generate`'s tokens under the same
    grammar's mask, beside an unguided row that gives HF's plain greedy tokens, in one batch
    of the paged engine and of the batch engine (models that cannot page)."""
    server, _ = served
    path, torch_model, eos = checkpoint
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    new, stops = 20, list(eos)
    specs = [guides.Spec("json", SCHEMA), guides.Spec("regex", "[a-z ]{3,30}[.!]")]
    grammars = [guides.grammar(server.grammars, s, None, True) for s in specs]
    want = [hf_guided(torch_model, tokenizer, ids, g, eos, new) for g in grammars]
    with torch.no_grad():
        plain = torch_model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=new, eos_token_id=eos,
            pad_token_id=eos[0],
        )[0, len(ids) :].tolist()  # fmt: skip
    partitioner = Partitioner((1, 8, 1))
    model, params, _, _ = run_dir.load_model_and_params(path, partitioner)
    batch_engine = BatchEngine(model, params, partitioner, run_dir.checkpoint_vocabulary(path))
    for engine in (server.engine, batch_engine):
        jobs = [
            api.Completion(
                ids, new, Sampling(), [], None, 0, guide=server.grammars.guide(g, stops, ids)
            )
            for g in grammars
        ] + [api.Completion(ids, new, Sampling(), [], None, 0)]
        if engine is batch_engine:
            engine.decode(jobs)
        else:
            engine.submit_many(jobs)
        for job, expected in zip(jobs, [*want, plain]):
            got = []
            while (event := job.events.get(timeout=120))[0] == "token":
                got.append(event[1])
            assert event[0] == "done", event
            if event[1] == "stop":
                got.append(event[2])
            assert got == expected, (type(engine).__name__, tokenizer.decode(got))
    assert tokenizer.decode(want[0]).startswith('{"color": "')  # the mask is at work
    assert want[1] != plain[: len(want[1])]


def test_with_a_reasoning_parser_the_grammar_starts_where_thinking_ends(
    served, checkpoint, monkeypatch
):
    """As vLLM's: a guided answer thinks freely until its block's closing tag, then follows
    its grammar; where the prompt closed the block (Qwen3's enable_thinking=false) the grammar
    holds from the first token."""
    server, client = served
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint[0])
    monkeypatch.setattr(server, "reasoning_parser", "qwen3")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    schema = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    answer = chat(client, response_format=schema, max_tokens=48, extra_body=off)
    obeys(answer.choices[0].message.content)
    grammar = guides.grammar(server.grammars, guides.Spec("json", SCHEMA), None, True)
    words = (server.grammars.vocab_size + 31) // 32  # the model's (padded) vocabulary

    def mask(guide):
        row = np.zeros(words, np.int32)
        guide.fill(row)
        return row

    fresh = mask(server.grammars.guide(grammar, [0]))
    assert (fresh != -1).any()
    tags = guides.thinking_tags("qwen3", {})
    for kwargs, waits in (({}, True), ({"enable_thinking": False}, False)):
        text = tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        guide = server.grammars.guide(grammar, [0], ids, tags)
        if waits:
            for t in tokenizer.encode("Hmm.</think>", add_special_tokens=False):
                assert (mask(guide) == -1).all()  # thinking: any token
                guide.advance(t)
        assert (mask(guide) == fresh).all()
    assert guides.thinking_tags("deepseek_v3", {}) is None  # thinking off: no block
    assert guides.thinking_tags("deepseek_v3", {"thinking": True}) == ("<think>", "</think>")
    # gpt-oss: the grammar starts with the final channel's message (after the analysis).
    tags = guides.thinking_tags("openai_gptoss", {})
    guide = server.grammars.guide(grammar, [0], tokenizer.encode("<|start|>assistant"), tags)
    answer = "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant"
    for t in tokenizer.encode(answer + "<|channel|>final<|message|>"):
        assert (mask(guide) == -1).all()
        guide.advance(t)
    assert (mask(guide) == fresh).all()


# OpenAI's Responses API (/v1/responses), through the client's `responses` resource.
RESPONSE = {"model": MODEL, "instructions": "You are terse.", "input": "def main():"}


def event_text(events, kind):
    return "".join(e.delta for e in events if e.type == kind)


def test_responses_greedy_stored_streamed_and_continued_through_the_official_client(
    served, checkpoint, greedy
):
    """`client.responses.create`: the instructions and input rendered as the chat's system
    and user messages, the greedy answer HF's; streamed, its events add up to the same
    response (the client's own `responses.stream` accumulates them); stored (OpenAI's
    default), it is retrieved, continued by `previous_response_id` (the earlier input and
    output before the new input, its instructions not) and deleted."""
    _, client = served
    text, new, prompt_ids, stopped = greedy
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint[0])
    response = client.responses.create(**RESPONSE, temperature=0, max_output_tokens=TOKENS)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == text and [o.type for o in response.output] == ["message"]
    assert response.status == ("completed" if stopped else "incomplete")
    assert response.usage.input_tokens == len(prompt_ids)
    assert response.usage.output_tokens == len(new) + stopped
    assert (response.instructions, response.max_output_tokens) == ("You are terse.", TOKENS)
    assert response.text.format.type == "text" and response.tools == []
    # Cached tokens: a prompt's full pages (16 tokens) the prefix cache held, as the second
    # request of a new prompt finds them; the chat endpoint reports them too.
    fresh = {"model": MODEL, "input": "A prompt no test sent before, " * 3, "store": False}
    asked = [{"role": "user", "content": fresh["input"]}]
    pages = (rendered_length(tokenizer, asked) - 1) // 16 * 16  # the last token is read
    first, second = (client.responses.create(**fresh, max_output_tokens=1) for _ in range(2))
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens == pages > 0
    again = client.chat.completions.create(model=MODEL, messages=asked, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == pages
    # reasoning.effort reaches the template as `reasoning_effort` (gpt-oss's variable).
    effort = {"effort": "low", "summary": "auto"}
    low = client.responses.create(**RESPONSE, reasoning=effort, max_output_tokens=1)
    assert low.reasoning.effort == "low"
    body = json.dumps({**RESPONSE, "reasoning": effort}).encode()
    parsed = responses.Responses().parse(body, 512, 64)
    assert parsed["chat_template_kwargs"] == {"reasoning_effort": "low"}
    # Streamed: created, in progress, the message's item and part opened, its text deltas,
    # closed, then the whole response; sequence numbers count up from 0.
    events = list(
        client.responses.create(
            **RESPONSE, temperature=0, max_output_tokens=TOKENS, stream=True, top_logprobs=2
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if stopped else "response.incomplete",
    ]
    assert event_text(events, "response.output_text.delta") == text
    final = events[-1].response
    assert final.output_text == text
    cached = {"input_tokens_details"}  # the same prompt's pages, cached by now
    assert final.usage.model_dump(exclude=cached) == response.usage.model_dump(exclude=cached)
    # Logprobs (top_logprobs): each generated token's with its two likeliest, as a chat's.
    listed = final.output[0].content[0].logprobs
    assert len(listed) == len(new) and all(len(e.top_logprobs) == 2 for e in listed)
    assert sum(len(e.logprobs) for e in events if e.type.endswith("text.delta")) == len(new)
    # The client's `responses.stream` (it needs `response.completed`: an answer cut at a stop
    # string, vLLM's `stop`, is complete).
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2].strip())
    with client.responses.stream(
        **RESPONSE, temperature=0, max_output_tokens=TOKENS, extra_body={"stop": [stop]}
    ) as stream:
        done = stream.get_final_response()
        assert done.output_text == text[: text.find(stop)] and done.status == "completed"
    # Stored: retrieved as answered; continued (the instructions are not carried over).
    assert client.responses.retrieve(response.id).output_text == text
    more = client.responses.create(
        model=MODEL, previous_response_id=response.id, input="More.", max_output_tokens=1
    )
    history = [
        {"role": "user", "content": "def main():"},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "More."},
    ]
    assert more.usage.input_tokens == rendered_length(tokenizer, history)
    assert more.previous_response_id == response.id
    assert client.responses.delete(response.id) is None
    for call in (
        lambda: client.responses.retrieve(response.id),
        lambda: client.responses.create(model=MODEL, previous_response_id=response.id, input="x"),
        lambda: client.responses.retrieve(
            client.responses.create(**RESPONSE, max_output_tokens=1, store=False).id
        ),
    ):
        with pytest.raises(openai.NotFoundError, match="not found"):
            call()


def test_responses_read_reasoning_calls_and_their_outputs_back_as_the_chat_does(
    served, checkpoint, monkeypatch
):
    """A thinking answer that calls a tool (scripted: the tiny model writes neither) comes
    back as reasoning, message and function_call items, whole and streamed alike; its
    output, sent back as input with the call's output (or continued by its id), reaches the
    template as the chat history the same turn makes; text.format json_schema (the client's
    `responses.parse`) is followed; a forced tool_choice gives a function call."""
    server, client = served
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint[0])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    script = scripted(tokenizer, "<think>Paris, then.</think>\n\nLet me look." + call)
    monkeypatch.setattr(server.engine, "submit_many", script)
    monkeypatch.setattr(server, "reasoning_parser", "qwen3")
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    whole = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools)
    reasoning_, message, function_call = whole.output
    assert reasoning_.type == "reasoning" and reasoning_.content[0].text == "Paris, then."
    assert message.type == "message" and message.content[0].text == "\n\nLet me look."
    assert (function_call.type, function_call.name) == ("function_call", "get_weather")
    assert json.loads(function_call.arguments) == {"city": "Paris"}
    assert function_call.call_id.startswith("call_") and whole.status == "completed"
    assert whole.usage.output_tokens_details.reasoning_tokens == len(
        tokenizer.encode("Paris, then.", add_special_tokens=False)
    )
    events = list(
        client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, stream=True)
    )
    assert event_text(events, "response.reasoning_text.delta") == "Paris, then."
    assert event_text(events, "response.output_text.delta") == "\n\nLet me look."
    arguments = event_text(events, "response.function_call_arguments.delta")
    assert arguments == function_call.arguments
    streamed = events[-1].response
    assert [o.type for o in streamed.output] == ["reasoning", "message", "function_call"]
    assert [o.model_dump(exclude={"id", "call_id"}) for o in streamed.output] == [
        o.model_dump(exclude={"id", "call_id"}) for o in whole.output
    ]

    # A decode that fails mid-stream: an error event, then response.failed.
    def failing(completions):
        for c in completions:
            c.events.put(("token", tokenizer.encode("a")[0], 0.0, []))
            c.events.put(("error", "boom"))

    monkeypatch.setattr(server.engine, "submit_many", failing)
    *_, error, failed = client.responses.create(model=MODEL, input="x", stream=True)
    assert (error.type, error.message) == ("error", "Decoding failed: boom")
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.message == "Decoding failed: boom"
    monkeypatch.setattr(server.engine, "submit_many", script)
    # The output sent back with the call's output: the chat history of the same turn.
    monkeypatch.setattr(server, "reasoning_parser", None)
    back = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            *[o.model_dump(exclude_none=True) for o in whole.output],
            {"type": "function_call_output", "call_id": function_call.call_id, "output": "18C"},
        ],
        tools=tools,
    )
    chat_call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "\n\nLet me look.",
            "reasoning_content": "Paris, then.",
            "tool_calls": [
                {"id": function_call.call_id, "type": "function", "function": chat_call}
            ],
        },
        {"role": "tool", "tool_call_id": function_call.call_id, "content": "18C"},
    ]
    assert back.usage.input_tokens == rendered_length(tokenizer, history, tools=TOOLS)
    # The same turn continued from the stored response: the same conversation.
    output = {"type": "function_call_output", "call_id": function_call.call_id, "output": "18C"}
    continued = client.responses.create(
        model=MODEL, previous_response_id=whole.id, input=[output], tools=tools
    )
    assert continued.usage.input_tokens == back.usage.input_tokens
    # Stateless (Codex's way: store false, the reasoning as an opaque blob sent back).
    monkeypatch.setattr(server, "reasoning_parser", "qwen3")
    sealed = client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=tools,
        store=False,
        include=["reasoning.encrypted_content"],
    )
    thought = sealed.output[0].model_dump(exclude_none=True)
    assert thought["encrypted_content"] and "Paris" not in thought["encrypted_content"]
    streamed = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Paris?",
            tools=tools,
            stream=True,
            include=["reasoning.encrypted_content"],
        )
    )
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert done[0].encrypted_content == thought["encrypted_content"]
    monkeypatch.setattr(server, "reasoning_parser", None)
    opaque = {**thought, "content": []}
    items = [o.model_dump(exclude_none=True) for o in sealed.output[1:]]
    resent = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            opaque,
            *items,
            {**output, "call_id": sealed.output[2].call_id},
        ],
        tools=tools,
    )
    assert resent.usage.input_tokens == back.usage.input_tokens
    monkeypatch.undo()
    parsed = client.responses.parse(
        model=MODEL, input="def main():", text_format=Verdict, max_output_tokens=48, temperature=0
    )
    assert isinstance(parsed.output_parsed, Verdict)
    assert parsed.output_text == json.dumps(parsed.output_parsed.model_dump())
    forced = client.responses.create(
        model=MODEL,
        input="def main():",
        tools=[{"type": "function", **t["function"]} for t in ENUM_TOOLS],
        tool_choice={"type": "function", "name": "tm"},
        max_output_tokens=64,
    )
    (item,) = forced.output
    assert item.type == "function_call" and item.name == "tm"
    assert json.loads(item.arguments)["city"] in CITIES


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "function tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content",
            "only text parts",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "item references"),
        ({"background": True}, "background", "answers while the request waits"),
        ({"include": ["file_search_call.results"]}, "include", "flaxlm includes"),
        (
            {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}]},
            "input[0].encrypted_content",
            "another server's",
        ),
        ({"truncation": "auto"}, "truncation", "drops no input"),
        ({"reasoning": {"summary": "detailed"}}, "reasoning.summary", "not a summary"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "leave it out"),
        ({"max_output_tokens": 1000}, "max_output_tokens", "between 1 and 64"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "'schema'"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}},
            "text.format",
            "text.format:",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "["}]},
            "input[0].arguments",
            "JSON object",
        ),
        ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "one of []"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate", "Unknown field 'frobnicate'"),
    ],
)
def test_a_bad_responses_request_names_the_field(served, kwargs, param, message):
    _, client = served
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(**{**RESPONSE, **kwargs})
    assert raised.value.param == param and message in raised.value.message, raised.value.message
