"""infer / score / eval runs end to end (subprocesses, multi-process included), and the
seqio task evaluation they and training share."""

import json
import os
import re

import jax
import numpy as np
import pytest
import seqio

from flaxlm.checkpoints import hf, run_dir
from flaxlm.data import jsonl_reader
from flaxlm.data.config import DatasetConfig
from flaxlm.inference import generation
from flaxlm.models import base, t5
from flaxlm.models.row_start import SEQIO_START
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs import evaluate, infer
from tasks import metrics as task_metrics
from tests.test_main import run_main
from tests.test_multiprocess import joined, launch

PROMPTS = ["def main(", "import os\nimport", "class Foo(", "x = [", "return", "# a comment"]
PAIRS = [("def f(x):\n    return", " x"), ("import", " os"), ("for i in", " range(3):")]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def in_process_outputs(model_dir, prompts, max_new_tokens):
    partitioner = Partitioner(mesh_shape=(1, 2, 4))
    model, params, step, row_start = run_dir.load_model_and_params(model_dir, partitioner)
    assert step == 8
    examples, vocab, _ = infer.read_examples_from_texts(prompts, model, row_start)
    return infer.generate_texts(
        model,
        params,
        examples,
        vocab,
        partitioner,
        generation.GenerationSettings(max_new_tokens=max_new_tokens),
        batch_size=4,
    )


@pytest.mark.slow
def test_infer_score_and_eval_runs_from_a_training_run(trained_gptj, tmp_path, repo_dir):
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"in_text": p}) + "\n" for p in PROMPTS))
    out_dir = tmp_path / "infer"
    result = run_main(
        [
            "--gin_file=gin/runs/infer.gin",
            f"--gin.CHECKPOINT='{trained_gptj}'",
            f"--gin.INFER_SOURCE='{jsonl}'",
            f"--gin.OUTPUT_DIR='{out_dir}'",
            "--gin.MAX_NEW_TOKENS=12",
            "--gin.INFER_BATCH_SIZE=4",
            "--gin.Partitioner.mesh_shape=(1, 2, 4)",
        ],
        repo_dir,
        devices=8,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "decode" in result.stdout and "tokens/s" in result.stdout
    records = read_jsonl(out_dir / "prompts.jsonl")
    assert [r["input"] for r in records] == PROMPTS
    assert (out_dir / "config.gin").exists()
    assert [r["output"] for r in records] == in_process_outputs(trained_gptj, PROMPTS, 12)

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"in_text": i, "out_text": o}) + "\n" for i, o in PAIRS))
    score_dir = tmp_path / "score"
    result = run_main(
        [
            "--gin_file=gin/runs/score.gin",
            f"--gin.CHECKPOINT='{trained_gptj}'",
            f"--gin.SCORE_SOURCE='{pairs}'",
            f"--gin.OUTPUT_DIR='{score_dir}'",
            "--gin.SCORE_BATCH_SIZE=2",
        ],
        repo_dir,
        devices=8,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    scores = read_jsonl(score_dir / "pairs.jsonl")
    assert [(r["input"], r["target"]) for r in scores] == PAIRS
    assert [r["num_tokens"] for r in scores] == [len(o.encode()) for _, o in PAIRS]
    # Each score is the target's log-likelihood from the model's logits, the input read as
    # the training rows were: after seqio's start token 0 (a model trained from scratch).
    partitioner = Partitioner(mesh_shape=(1, 8, 1))
    model, params, _, row_start = run_dir.load_model_and_params(trained_gptj, partitioner)
    assert row_start == SEQIO_START
    vocab = seqio.ByteVocabulary()
    for record, (i, o) in zip(scores, PAIRS):
        i_ids = [0, *vocab.encode(i)]
        seq = i_ids + vocab.encode(o)
        logits = np.asarray(
            jax.jit(model.compute_logits)(params, {"decoder_input_tokens": np.asarray([seq[:-1]])})
        )[0].astype(np.float64)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        target = [log_probs[t, seq[t + 1]] for t in range(len(i_ids) - 1, len(seq) - 1)]
        assert record["score"] == pytest.approx(sum(target), rel=1e-4)

    eval_dir = tmp_path / "eval"
    result = run_main(
        [
            "--gin_file=gin/runs/eval.gin",
            f"--gin.CHECKPOINT='{trained_gptj}'",
            "--gin.MIXTURE_OR_TASK_NAME='stdlib_py'",
            "--gin.TASK_FEATURE_LENGTHS={'targets': 64}",
            f"--gin.OUTPUT_DIR='{eval_dir}'",
            "--gin.EVAL_STEPS=3",
        ],
        repo_dir,
        devices=8,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = read_jsonl(eval_dir / "metrics.jsonl")
    assert record["step"] == 8
    assert record["eval/perplexity"] == pytest.approx(np.exp(record["eval/loss"]), rel=1e-4)
    assert 0 < record["eval/accuracy"] < 1
    assert os.listdir(eval_dir / "tensorboard")


@pytest.mark.slow
@pytest.mark.slow
def test_infer_with_structured_outputs_writes_only_what_the_grammar_allows(
    trained_gptj, tmp_path, repo_dir
):
    """STRUCTURED_OUTPUTS (vLLM's offline structured outputs) through gin/runs/infer.gin:
    every output of the byte-level model follows the regex (the paged engine's grammar);
    with fixed batches, which cannot follow one, the run stops before writing, named."""
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"in_text": p}) + "\n" for p in PROMPTS))
    args = [
        "--gin_file=gin/runs/infer.gin",
        f"--gin.CHECKPOINT='{trained_gptj}'",
        f"--gin.INFER_SOURCE='{jsonl}'",
        "--gin.MAX_NEW_TOKENS=6",
        "--gin.STRUCTURED_OUTPUTS=('regex', '[0-9]{1,3}')",
    ]
    out_dir = tmp_path / "guided"
    result = run_main([*args, f"--gin.OUTPUT_DIR='{out_dir}'"], repo_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = [r["output"] for r in read_jsonl(out_dir / "prompts.jsonl")]
    assert len(outputs) == len(PROMPTS)
    assert all(re.fullmatch("[0-9]{1,3}", o) for o in outputs), outputs
    refused = run_main(
        [*args, f"--gin.OUTPUT_DIR='{tmp_path / 'batch'}'", "--gin.INFER_ENGINE='batch'"],
        repo_dir,
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "STRUCTURED_OUTPUTS: outputs follow a grammar through the paged engine" in (
        refused.stderr
    )
    assert not (tmp_path / "batch").exists()


def test_settings_refuse_a_structured_output_that_is_not_one():
    with pytest.raises(ValueError, match=r"expected \(kind, source text\)"):
        generation.GenerationSettings(structured_outputs=("xml", "a"))
    with pytest.raises(ValueError, match="not JSON text"):
        generation.GenerationSettings(structured_outputs=("json", "{"))
    guided = generation.GenerationSettings(structured_outputs=["regex", "a"])  # gin's list
    assert guided.structured_outputs == ("regex", "a")
    # Fixed batches (eval's, the harness's) cannot follow a grammar: refused, not ignored.
    with pytest.raises(ValueError, match="paged engine"):
        generation.generate_ids(None, None, [[1]], None, guided, batch_size=1)


def test_two_process_infer_writes_every_output_once_in_order(trained_gptj, tmp_path, repo_dir):
    prompts = [p.replace("\n", " ") for p in PROMPTS]  # one prompt per line
    text = tmp_path / "prompts.txt"
    text.write_text("\n".join(prompts) + "\n")
    out_dir = tmp_path / "infer2"
    args = [
        "-m",
        "flaxlm.main",
        "--gin_file=gin/runs/infer.gin",
        f"--gin.CHECKPOINT='{trained_gptj}'",
        f"--gin.INFER_SOURCE='{text}'",
        f"--gin.OUTPUT_DIR='{out_dir}'",
        "--gin.MAX_NEW_TOKENS=12",
        "--gin.INFER_BATCH_SIZE=4",
        # tensor spans both processes: every process runs every dispatch of the paged
        # engine (the same on each), its page pool split over the heads; the outputs are
        # those of fixed batches in one process.
        "--gin.INFER_ENGINE='paged'",
        "--gin.Partitioner.mesh_shape=(1, 2, 4)",
    ]
    results = launch(
        joined(args),
        num_processes=2,
        devices_per_process=4,
        cwd=repo_dir,
    )
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    records = read_jsonl(out_dir / "prompts.jsonl")
    assert [r["input"] for r in records] == prompts
    assert [r["output"] for r in records] == in_process_outputs(trained_gptj, prompts, 12)

    # Scoring too: 2 processes, batch split over fsdp, every pair once and in order.
    pairs = tmp_path / "pairs.jsonl"
    many = PAIRS * 3
    pairs.write_text("".join(json.dumps({"in_text": i, "out_text": o}) + "\n" for i, o in many))
    score_args = [
        "-m",
        "flaxlm.main",
        "--gin_file=gin/runs/score.gin",
        f"--gin.CHECKPOINT='{trained_gptj}'",
        f"--gin.SCORE_SOURCE='{pairs}'",
        f"--gin.OUTPUT_DIR='{tmp_path / 'score2'}'",
        "--gin.SCORE_BATCH_SIZE=4",
        "--gin.Partitioner.mesh_shape=(2, 4, 1)",
    ]
    results = launch(
        joined(score_args),
        num_processes=2,
        devices_per_process=4,
        cwd=repo_dir,
    )
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    scores = read_jsonl(tmp_path / "score2" / "pairs.jsonl")
    assert [(r["input"], r["target"]) for r in scores] == many
    by_pair = {}
    for r in scores:
        by_pair.setdefault((r["input"], r["target"]), []).append(r["score"])
    for values in by_pair.values():
        assert max(values) - min(values) < 1e-4 * max(1.0, abs(values[0]))


def test_bad_jsonl_line_is_named_with_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"in_text": "ok"}\n{"in_text": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        list(jsonl_reader.read_jsonl(str(path)))
    path.write_text('{"in_text": "ok"}\n{"text": "no in_text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing string field\(s\) \['in_text'\]"):
        list(jsonl_reader.read_jsonl(str(path)))


def test_text_metrics():
    assert task_metrics.exact_match(["a b", "c"], [" a b", "d"]) == {"exact_match": 50.0}
    assert task_metrics.bleu(["the cat sat on the mat"], ["the cat sat on the mat"])[
        "bleu"
    ] == pytest.approx(100.0)
    assert task_metrics.bleu(["the cat sat on the mat"], ["a dog ran"])["bleu"] < 5
    scores = task_metrics.rouge(["the cat sat"], ["the cat sat"])
    assert scores == pytest.approx({"rouge1": 100.0, "rouge2": 100.0, "rougeLsum": 100.0})


@pytest.mark.slow
def test_task_evaluator_runs_the_tasks_metrics_on_generated_text():
    """A T5 on stdlib_py_continuation: predictions come from `generate`; with a model that
    copies nothing the metrics are computed, finite, and keyed by task."""
    config = t5.T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    model = base.EncoderDecoderModel(config)
    partitioner = Partitioner(mesh_shape=(1, 4, 2))
    params = model.init_params(jax.random.PRNGKey(0), model.example_batch_shapes())
    cfg = DatasetConfig(
        mixture_or_task_name="stdlib_py_continuation",
        task_feature_lengths={"inputs": 16, "targets": 16},
        split="validation",
        batch_size=4,
        module="tasks",
    )
    evaluator = evaluate.TaskEvaluator(
        cfg,
        model,
        partitioner,
        SEQIO_START,
        generation.GenerationSettings(max_new_tokens=8),
        num_examples=6,
    )
    assert evaluator.active
    scalars = evaluator.evaluate(params, step=3)
    assert set(scalars) == {
        f"eval/stdlib_py_continuation/{k}"
        for k in ("exact_match", "bleu", "rouge1", "rouge2", "rougeLsum")
    }
    assert all(np.isfinite(v) for v in scalars.values())


def test_infer_from_an_hf_directory_equals_generate(tmp_path, capsys):
    """... and says which of its generation_config.json's settings it does not apply."""
    from tests.test_hf_gpt2 import tiny_hf_gpt2

    _, path = tiny_hf_gpt2(tmp_path, "standard", vocab_size=300)
    file_settings = {"do_sample": True, "temperature": 0.6, "repetition_penalty": 1.3}
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({**file_settings, "eos_token_id": 299, "top_k": 50}, f)
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps({"in_text": p}) + "\n" for p in PROMPTS[:3]))
    vocab = seqio.ByteVocabulary()
    out = infer.infer(
        checkpoint=path,
        source=str(jsonl),
        output_dir=str(tmp_path / "out"),
        vocabulary=vocab,
        settings=generation.GenerationSettings(max_new_tokens=6),
        batch_size=2,
    )
    records = read_jsonl(out)
    model, params = hf.from_pretrained(path)
    for record in records:
        ids = np.asarray([vocab.encode(record["input"])])
        tokens = generation.generate(model, params, {"inputs": ids}, max_new_tokens=6)[0]
        assert record["output"] == vocab.decode(generation.until_eos(tokens, model.eos_ids))
    note = "generation_config.json's do_sample=True, temperature=0.6, repetition_penalty=1.3 not"
    assert note in capsys.readouterr().out  # (top_k 50: transformers' default, no change)
    # serve takes the file's temperature (and top_p) as a request's defaults, as vLLM does.
    assert generation.unapplied_file_settings(
        file_settings, ("do_sample", "temperature", "top_p")
    ) == {"repetition_penalty": 1.3}
    assert generation.unapplied_file_settings({"temperature": 0.6, "num_beams": 1}) == {}
    served = generation.unapplied_file_settings(
        {"temperature": 0.7, "top_k": 20}, ("do_sample", "temperature", "top_p")
    )
    assert served == {"top_k": 20}  # serve samples at the file's temperature, do_sample or not
    no_top_k = {"do_sample": True, "top_k": 0}  # (top-k off: as flaxlm's TOP_K=0)
    assert generation.unapplied_file_settings(no_top_k) == {"do_sample": True}


def test_inference_holds_an_hf_checkpoint_in_its_own_dtype(tmp_path):
    """`dtype='auto'` (serve, infer, score, eval, the harness): a bfloat16 checkpoint
    computes and is held in bfloat16, as transformers 5 loads it; a float32 one in float32;
    a named dtype wins; None (training's start) is float32; a bad name or a dtype for a
    MODEL_DIR is refused before anything loads."""
    import jax.numpy as jnp
    import torch

    from tests.test_hf_llama import tiny_hf_llama

    torch_model, f32_path = tiny_hf_llama(tmp_path)
    bf16_path = str(tmp_path / "bf16")
    torch_model.to(torch.bfloat16).save_pretrained(bf16_path)
    partitioner = Partitioner()

    def dtypes(path, dtype):
        model, params, *_ = run_dir.load_model_and_params(path, partitioner, dtype=dtype)
        floats = {x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)}
        return jnp.dtype(model.config.dtype).name, sorted(jnp.dtype(d).name for d in floats)

    assert dtypes(bf16_path, "auto") == ("bfloat16", ["bfloat16"])
    assert dtypes(f32_path, "auto") == ("float32", ["float32"])
    assert dtypes(bf16_path, "float32") == ("float32", ["float32"])
    assert dtypes(f32_path, "bfloat16") == ("bfloat16", ["bfloat16"])
    assert dtypes(bf16_path, None) == ("float32", ["float32"])
    from flaxlm.runs import harness  # lm-eval's model arg, as its `hf` model's (auto)

    assert jnp.dtype(harness.FlaxLM(checkpoint=bf16_path).model.config.dtype) == jnp.bfloat16
    with pytest.raises(ValueError, match="expected one of"):
        run_dir.load_model_and_params(bf16_path, partitioner, dtype="fp8")
    (tmp_path / "run").mkdir()
    with pytest.raises(ValueError, match="MODEL_DIR"):
        run_dir.load_model_and_params(tmp_path / "run", partitioner, dtype="bfloat16")


def test_prompts_from_a_seqio_task_keep_the_tasks_tokens():
    config = t5.T5Config(vocab_size=384, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    model = base.EncoderDecoderModel(config)
    examples, vocab, name = infer.read_examples(
        "stdlib_py_continuation", model, SEQIO_START, None, task_module="tasks", max_examples=3
    )
    assert name == "stdlib_py_continuation" and len(examples) == 3
    for e in examples:
        assert e.input_ids[-1] == 1  # the task's inputs end with EOS
        assert e.input_text == vocab.decode(e.input_ids)
        assert e.target_ids is not None
