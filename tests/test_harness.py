"""lm-evaluation-harness on flaxlm: lm-eval's evaluator over local tasks (YAML + JSONL in a
tmp dir, nothing downloaded) gives the numbers flaxlm's own scoring and generation give."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import seqio

lm_eval = pytest.importorskip("lm_eval")

from flaxlm.inference import generation  # noqa: E402
from flaxlm.parallel import platforms  # noqa: E402
from flaxlm.runs import harness  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = seqio.ByteVocabulary()
MAX_LENGTH = 64  # short enough that contexts are cut and documents need several windows
MAX_GEN_TOKS = 12
STOPS = ["\n", " "]

MC_DOCS = [
    {"question": "import numpy as", "choices": ["np", "pd", "tf"], "label": 0},
    {"question": "def __init__(self", "choices": ["):", "]]", "!!"], "label": 0},
    {"question": "for i in range(", "choices": ["10):", "xyz", ")))"], "label": 0},
    {"question": "return", "choices": ["None", "qqqq", "zz"], "label": 1},
    # Longer than MAX_LENGTH: the context loses its beginning.
    {"question": "# " + "a long comment line " * 6 + "\nx =", "choices": ["1", "["], "label": 0},
]
ROLLING_DOCS = [
    {"text": "def f(x):\n    return x + 1\n"},  # one window
    {"text": "import os\n" * 10},  # 100 bytes: a full window and a partial one
    {"text": ("class A:\n    pass\n" * 8)[:128]},  # exactly two full windows
]
GEN_DOCS = [
    {"prompt": "def main("},
    {"prompt": "import "},
    {"prompt": "# " + "long prompt " * 8 + "\nclass "},  # cut to MAX_LENGTH - MAX_GEN_TOKS
]


def _write_tasks(root) -> str:
    data = {"mc": MC_DOCS, "roll": ROLLING_DOCS, "gen": GEN_DOCS}
    for name, docs in data.items():
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
    common = (
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        "    test: {path}\n"
        f"  cache_dir: {root / 'hf_cache'}\n"
        "test_split: test\n"
    )
    tasks = {
        "flaxlm_test_mc": "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n",
        "flaxlm_test_roll": "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: byte_perplexity\n",
        "flaxlm_test_gen": "output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\n'
        'doc_to_target: ""\n'
        "generation_kwargs:\n"
        f"  until: {json.dumps(STOPS)}\n"
        f"  max_gen_toks: {MAX_GEN_TOKS}\n"
        "  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n",
    }
    for (task, body), name in zip(tasks.items(), data):
        path = root / f"{name}.jsonl"
        text = f"task: {task}\n" + common.format(path=path) + body
        (root / f"{task}.yaml").write_text(text)
    return str(root)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> str:
    return _write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="module")
def lm(trained_gptj):
    return harness.FlaxLM(checkpoint=trained_gptj, batch_size=8, max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def results(lm, task_dir):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=lm,
        tasks=["flaxlm_test_mc", "flaxlm_test_roll", "flaxlm_test_gen"],
        task_manager=TaskManager(include_path=task_dir, include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )


def _score(lm, inputs, targets):
    """Summed target log-likelihoods straight from `model.score` (flaxlm's score path),
    every batch padded to [8, MAX_LENGTH] so that one program serves all of them."""
    scorer = generation.Scorer(lm.model, lm.partitioner)
    out = []
    for start in range(0, len(inputs), 8):
        rows = list(zip(inputs, targets))[start : start + 8]
        rows += [rows[0]] * (8 - len(rows))
        batch = generation.score_batch_features(lm.model, *zip(*rows))
        batch = harness._pad_length(batch, MAX_LENGTH, MAX_LENGTH)
        out += scorer(lm.params, batch)[: min(8, len(inputs) - start)].tolist()
    return out, scorer


@pytest.mark.slow  # (trained_gptj: a training run in a subprocess)
def test_multiple_choice_accuracy_equals_direct_model_scores(lm, results):
    inputs, targets = [], []
    for doc in MC_DOCS:
        for choice in doc["choices"]:
            context = [0] + list(VOCAB.encode(doc["question"]))
            target = list(VOCAB.encode(" " + choice))
            inputs.append(context[-(MAX_LENGTH + 1 - len(target)) :])
            targets.append(target)
    scores = iter(_score(lm, inputs, targets)[0])
    expected = [[next(scores) for _ in doc["choices"]] for doc in MC_DOCS]
    accuracy = np.mean([np.argmax(s) == d["label"] for s, d in zip(expected, MC_DOCS)])
    assert results["results"]["flaxlm_test_mc"]["acc,none"] == pytest.approx(accuracy)
    samples = sorted(results["samples"]["flaxlm_test_mc"], key=lambda s: s["doc_id"])
    got = [[r[0] for r in s["filtered_resps"]] for s in samples]
    for ours, theirs in zip(got, expected):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-4)
    assert len(VOCAB.encode(MC_DOCS[-1]["question"])) > MAX_LENGTH  # the cut case ran


@pytest.mark.slow  # (trained_gptj: a training run in a subprocess)
def test_loglikelihood_rolling_equals_flaxlm_scores_and_eval_path(lm, results):
    docs = [list(VOCAB.encode(d["text"])) for d in ROLLING_DOCS]
    short, partial, full = docs
    assert len(short) <= MAX_LENGTH and len(partial) == 100 and len(full) == 2 * MAX_LENGTH
    # Windows of MAX_LENGTH predictions, each conditioned on everything before it in the
    # window: the last window's input (context + continuation minus its last token) is a
    # full MAX_LENGTH, so its context starts at 100 - MAX_LENGTH - 1.
    pairs = [
        ([0], short),
        ([0], partial[:64]),
        (partial[100 - MAX_LENGTH - 1 : 64], partial[64:]),
        ([0], full[:64]),
        (full[63:64], full[64:]),
    ]
    s, scorer = _score(lm, [p[0] for p in pairs], [p[1] for p in pairs])
    expected = [s[0], s[1] + s[2], s[3] + s[4]]
    samples = sorted(results["samples"]["flaxlm_test_roll"], key=lambda s: s["doc_id"])
    np.testing.assert_allclose([x["resps"][0][0] for x in samples], expected, rtol=1e-5)
    total_bytes = sum(len(d["text"].encode()) for d in ROLLING_DOCS)
    perplexity = math.exp(-sum(expected) / total_bytes)
    got = results["results"]["flaxlm_test_roll"]["byte_perplexity,none"]
    assert got == pytest.approx(perplexity, rel=1e-5)
    # A one-window document scores as seqio's decoder features (targets shifted right
    # after 0) do in the eval steps.
    n = len(short)
    row = np.zeros((8, MAX_LENGTH), np.int32)
    eval_batch = {
        "decoder_input_tokens": row.copy(),
        "decoder_target_tokens": row.copy(),
        "decoder_loss_weights": row.copy(),
        "decoder_segment_ids": row.copy(),
        "decoder_positions": np.broadcast_to(np.arange(MAX_LENGTH, dtype=np.int32), row.shape),
    }
    eval_batch["decoder_input_tokens"][:, :n] = [0] + short[:-1]
    eval_batch["decoder_target_tokens"][:, :n] = short
    eval_batch["decoder_loss_weights"][:, :n] = 1
    eval_batch["decoder_segment_ids"][:, :n] = 1
    assert expected[0] == pytest.approx(float(scorer(lm.params, eval_batch)[0]), rel=1e-5)


@pytest.mark.slow  # (trained_gptj: a training run in a subprocess)
def test_generate_until_equals_model_generate_cut_at_stops(lm, results):
    room = MAX_LENGTH - MAX_GEN_TOKS
    prompts = [([0] + list(VOCAB.encode(d["prompt"])))[-room:] for d in GEN_DOCS]
    inputs = np.zeros((8, room), np.int32)
    lengths = np.ones((8,), np.int32)
    for i, p in enumerate(prompts):
        inputs[i, : len(p)], lengths[i] = p, len(p)
    tokens = generation.generate(
        lm.model,
        lm.params,
        {"inputs": inputs, "inputs_lengths": lengths},
        max_new_tokens=MAX_GEN_TOKS,
        partitioner=lm.partitioner,
    )
    texts = [VOCAB.decode(generation.until_eos(tokens[i], lm.model.eos_ids)) for i in range(3)]
    expected = [harness.cut_at_stops(t, STOPS) for t in texts]
    samples = sorted(results["samples"]["flaxlm_test_gen"], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in samples] == expected
    assert any(e != t for e, t in zip(expected, texts))  # a stop string did cut
    assert len(VOCAB.encode(GEN_DOCS[-1]["prompt"])) > room  # the cut prompt ran
    # loglikelihood's is_greedy: true for the greedy continuation, false once it changes.
    greedy = [int(t) for t in generation.until_eos(tokens[0], lm.model.eos_ids)]
    assert greedy
    changed = greedy[:-1] + [(greedy[-1] + 1) % 256 + 3]
    [(_, is_greedy), (_, is_changed_greedy)] = lm.score_tokens(
        [(prompts[0], greedy), (prompts[0], changed)]
    )
    assert is_greedy and not is_changed_greedy


def test_cut_at_stops_takes_the_earliest():
    assert harness.cut_at_stops("ab\ncd ef", ["\n", " "]) == "ab"
    assert harness.cut_at_stops("ab cd\nef", ["\n", " "]) == "ab"
    assert harness.cut_at_stops("abc", ["\n"]) == "abc"


@pytest.mark.slow  # (trained_gptj: a training run in a subprocess)
def test_bad_model_args_are_named(trained_gptj):
    with pytest.raises(ValueError, match="Unknown flaxlm model_args"):
        harness.FlaxLM(checkpoint=trained_gptj, pretrained="gpt2")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        harness.FlaxLM(checkpoint="/nonexistent/flaxlm")


@pytest.mark.slow
def test_cli_runs_lm_eval_with_the_flaxlm_model(tmp_path, trained_gptj, task_dir, results):
    env = dict(os.environ)
    env["XLA_FLAGS"] = platforms.host_device_flags(8)
    env["JAX_PLATFORMS"] = "cpu"
    env["HF_DATASETS_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flaxlm.runs.harness",
            "--model",
            "flaxlm",
            "--model_args",
            f"checkpoint={trained_gptj},gin_file=partitioning/fsdp_tp.gin,max_length={MAX_LENGTH}",
            "--tasks",
            "flaxlm_test_mc",
            "--include_path",
            task_dir,
            "--batch_size",
            "8",
            "--output_path",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if "results" in f]
    with open(path) as f:
        written = json.load(f)
    accuracy = written["results"]["flaxlm_test_mc"]["acc,none"]
    assert accuracy == pytest.approx(results["results"]["flaxlm_test_mc"]["acc,none"])
    assert written["config"]["mesh_shape"]["tensor"] == 2
