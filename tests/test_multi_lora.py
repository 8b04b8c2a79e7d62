"""Many LoRA adapters served at once over one base (`serve.serve(lora_adapters=...)`): two
PEFT adapters made by `peft` on a tiny HF Llama, served beside the base by one engine, each
request's greedy answer equal to HF + PEFT's for its adapter, in one batch with base rows."""

import copy
import json
import threading

import jax
import numpy as np
import openai
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from flaxlm.checkpoints import checkpointer, peft_config, peft_dir, run_dir
from flaxlm.inference.sampling import Sampling
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs.serve.adapters import load_adapters
from flaxlm.runs.serve.api import Completion
from flaxlm.runs.serve.engine import Engine
from flaxlm.runs.serve.http import Server
from flaxlm.runs.serve.sockets import listen
from tests.hf_helpers import random_hf_model, save_byte_bpe_tokenizer

BASE = "tiny-base"
TOKENS = 8
# 21 and 24 tokens, longer than a page (PAGE): a full prompt page enters the prefix cache,
# which must not hand one adapter's keys and values to another. Prompt + TOKENS fit in two
# pages, read in one chunk: one page-table width, one compiled program per dispatch kind.
PROMPTS = ["def main(args):\n    x = 1\n    return", "class Parser(object):\n    def"]
PAGE = 16


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(torch model, HF dir): a tiny random Llama with a ChatML byte-BPE tokenizer (its
    <|endoftext|> ends generation). A wide initialisation keeps greedy choices apart."""
    path = tmp_path_factory.mktemp("base")
    length = save_byte_bpe_tokenizer(path, style="qwen")
    torch_model = random_hf_model(
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        vocab_size=length,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=length - 3,
    )
    torch_model.save_pretrained(str(path))
    return torch_model, str(path)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Two PEFT adapter dirs made by `peft` (random A and B, so they change the answers):
    both adapt q_proj, at ranks 4 and 2 (the engine pads to 4); the second also o_proj and
    down_proj (rank 3), with rsLoRA (a scale flaxlm folds into A)."""
    configs = {
        "qv": peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        ),
        "qod": peft.LoraConfig(
            r=2,
            lora_alpha=4,
            target_modules=["q_proj", "o_proj", "down_proj"],
            rank_pattern={"down_proj": 3},
            use_rslora=True,
            init_lora_weights=False,
        ),
    }
    torch_model, path = base
    out = {}
    for i, (name, config) in enumerate(configs.items()):
        torch.manual_seed(i + 1)
        model = peft.get_peft_model(copy.deepcopy(torch_model), config)
        with torch.no_grad():  # a B large enough that greedy answers change
            for p_name, p in model.named_parameters():
                if "lora_B" in p_name:
                    p.copy_(torch.randn_like(p))
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(str(directory))
        config_file = directory / peft_config.ADAPTER_CONFIG
        record = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**record, "base_model_name_or_path": path}))
        out[name] = str(directory)
    return out


@pytest.fixture(scope="module")
def expected(base, adapters):
    """{(model name, prompt): HF greedy token ids (to EOS or TOKENS)}: the base alone, and
    `PeftModel.from_pretrained` over it for each adapter."""
    torch_model, path = base
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    eos = torch_model.config.eos_token_id
    models = {BASE: torch_model}
    for name, directory in adapters.items():
        models[name] = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), directory)
    encoded = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    width = max(len(ids) for ids in encoded)
    ids = torch.tensor([[eos] * (width - len(x)) + x for x in encoded])  # left-padded
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in encoded])
    out = {}
    for name, model in models.items():
        with torch.no_grad():
            new = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=TOKENS,
                eos_token_id=eos,
                pad_token_id=eos,
            )[:, width:].tolist()
        for prompt, row in zip(PROMPTS, new):
            out[name, prompt] = row[: row.index(eos)] if eos in row else row
    return out


@pytest.fixture(scope="module")
def served(base, adapters):
    """(Server, openai.OpenAI) serving the base and both adapters, one for the module."""
    _, path = base
    partitioner = Partitioner((1, 8, 1))
    model, params, _, row_start = run_dir.load_model_and_params(path, partitioner)
    params, names = load_adapters(adapters, model, params, partitioner, BASE)
    engine = Engine(
        model,
        params,
        partitioner,
        run_dir.checkpoint_vocabulary(path),
        max_batch_size=8,
        batch_wait_ms=20,
        page_size=PAGE,
        max_seq_len=2 * PAGE,
        decode_steps=4,
        prefill_chunk=2 * PAGE,
        adapters=names,
    )
    server = Server(engine, BASE, listen("127.0.0.1", 0), row_start=row_start, max_tokens_limit=32)
    server.start()
    try:
        client = openai.OpenAI(
            base_url=server.address + "/v1", api_key="x", max_retries=0, timeout=120
        )
        yield server, client
    finally:
        server.stop()


@pytest.mark.slow
def test_one_batch_mixes_adapters_and_base_each_row_as_hf_peft(served, expected):
    """Every (model, prompt) pair submitted at once: one admission, the same dispatches; the
    same prompt under three models is three sequences (no page shared across adapters)."""
    server, _ = served
    names = list(server.models)
    assert names == [BASE, "qv", "qod"]
    jobs = {}
    for prompt in PROMPTS:
        ids = server.encode(prompt)
        for name in names:
            jobs[name, prompt] = Completion(
                ids, TOKENS, Sampling(), [], None, 0, adapter=server.models[name]
            )
    server.engine.submit_many(list(jobs.values()))
    got = {}
    for key, job in jobs.items():
        tokens = []
        while (event := job.events.get(timeout=120))[0] == "token":
            tokens.append(event[1])
        assert event[0] == "done", event
        got[key] = tokens
    assert got == expected
    # The adapters matter: each answers something other than the base.
    for prompt in PROMPTS:
        assert expected["qv", prompt] != expected[BASE, prompt]
        assert expected["qod", prompt] != expected[BASE, prompt]


def test_models_lists_the_adapters_and_a_request_model_picks_one(served, expected, base):
    server, client = served
    listed = client.models.list().data
    assert [m.id for m in listed] == [BASE, "qv", "qod"]
    assert [getattr(m, "parent", None) for m in listed] == [None, BASE, BASE]
    tokenizer = transformers.AutoTokenizer.from_pretrained(base[1])
    answers = {}

    def ask(name: str) -> None:  # concurrently: rows of every model in the same batches
        answers[name] = client.completions.create(
            model=name, prompt=PROMPTS[1], max_tokens=TOKENS, temperature=0
        )

    threads = [threading.Thread(target=ask, args=(name,)) for name in server.models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, response in answers.items():
        assert response.model == name
        assert response.choices[0].text == tokenizer.decode(expected[name, PROMPTS[1]])
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.code == "model_not_found" and "nope" in e.value.message


def test_an_adapters_prompt_log_probs_are_peft_models(served, base, adapters):
    """echo with logprobs under an adapter (lm-eval's local-completions scoring a LoRA
    model): each prompt token's log-prob as PEFT's model over HF's gives it."""
    _, client = served
    torch_model, path = base
    ids = transformers.AutoTokenizer.from_pretrained(path).encode(
        PROMPTS[0], add_special_tokens=False
    )
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), adapters["qod"])
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor([ids])).logits[0].double()
    ref = torch.log_softmax(logits, -1).numpy()
    response = client.completions.create(
        model="qod", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    listed = response.choices[0].logprobs.token_logprobs[1 : len(ids)]
    # float32 logits of O(1) through 2 layers: well inside 1e-4.
    np.testing.assert_allclose(listed, [ref[t - 1, ids[t]] for t in range(1, len(ids))], atol=1e-4)


def test_a_flaxlm_lora_run_serves_as_its_peft_adapters(base, adapters, tmp_path):
    """The same adapters as a flaxlm LoRA run directory (lora.json + a checkpoint) stack to
    the same arrays as the PEFT directory they came from."""
    _, path = base
    partitioner = Partitioner((1, 8, 1))
    model, params, *_ = run_dir.load_model_and_params(path, partitioner)
    cfg, tree = peft_dir.load_adapters(model, adapters["qod"])
    run = tmp_path / "run"
    run.mkdir()
    run_dir.write_lora_record(run, cfg, {"hf": path})
    ckpt = checkpointer.Checkpointer(str(run))
    ckpt.save_params(3, tree)
    ckpt.close()
    from_peft, _ = load_adapters({"a": adapters["qod"]}, model, params, partitioner, BASE)
    from_run, _ = load_adapters({"a": str(run)}, model, params, partitioner, BASE)
    assert jax.tree.structure(from_run) == jax.tree.structure(from_peft)
    for ours, theirs in zip(jax.tree.leaves(from_run), jax.tree.leaves(from_peft)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_an_adapter_for_modules_the_base_lacks_is_named_at_start_up(base, adapters, tmp_path):
    _, path = base
    partitioner = Partitioner((1, 8, 1))
    model, params, *_ = run_dir.load_model_and_params(path, partitioner)
    deeper = tmp_path / "deeper"
    deeper.mkdir()
    source = adapters["qv"]
    (deeper / peft_config.ADAPTER_CONFIG).write_text(
        open(f"{source}/{peft_config.ADAPTER_CONFIG}").read()
    )
    tensors = load_file(f"{source}/{peft_config.ADAPTER_WEIGHTS}")
    # An adapter trained on a deeper model: layer 5 does not exist in the 2-layer base.
    tensors = {k.replace("layers.1.", "layers.5."): v for k, v in tensors.items()}
    save_file(tensors, str(deeper / peft_config.ADAPTER_WEIGHTS))
    with pytest.raises(ValueError, match=r"LORA_ADAPTERS\['deep'\].*layers\.5\.self_attn"):
        load_adapters({"deep": str(deeper)}, model, params, partitioner, BASE)
    with pytest.raises(ValueError, match=r"LORA_ADAPTERS\['x'\].*neither a PEFT"):
        load_adapters({"x": str(tmp_path)}, model, params, partitioner, BASE)
    with pytest.raises(ValueError, match="other than the base model's name"):
        load_adapters({BASE: source}, model, params, partitioner, BASE)


def test_a_model_that_cannot_page_refuses_adapters(served):
    server, _ = served
    model = copy.copy(server.engine.model)
    model.paged_refusal = lambda: "Phi3 decodes over a contiguous KV cache only."
    with pytest.raises(ValueError, match="LORA_ADAPTERS: Phi3 decodes over a contiguous"):
        Engine(model, {}, Partitioner((1, 8, 1)), server.engine.vocabulary, adapters=("qv",))
