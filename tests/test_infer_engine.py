"""`infer` through the paged engine (issue 47): the batch path's greedy outputs, sampling
seeded per example, and which engine 'auto' picks."""

import jax
import pytest

from flaxlm.checkpoints import run_dir
from flaxlm.inference.generation import GenerationSettings
from flaxlm.models import base, phi3, t5
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs import infer

# Prompts of 2 to 41 bytes (a long one beside short ones: rows end and are replaced at
# different times, and pages of several widths are read).
PROMPTS = [
    "def main(",
    "x",
    "import os\nimport sys\nfrom typing import Any\n",
    "class Foo(",
    "return self.",
    "for i in range(10):\n    ",
    "# a comment",
    "a = [1, 2,",
    "if __name__ ==",
    "with open(path) as f:",
    '"""Doc',
    "print(",
]


@pytest.fixture(scope="module")
def loaded(trained_gptj):
    """The session's tiny GPT-J on 2 devices, tensor-parallel (the engine's page pool split
    over the heads; tests/test_inference_runs.py runs it on 8 over two processes), and the
    prompts as infer reads them."""
    partitioner = Partitioner(mesh_shape=(1, 1, 2), devices=jax.devices()[:2])
    model, params, _, row_start = run_dir.load_model_and_params(trained_gptj, partitioner)
    examples, vocab, _ = infer.read_examples_from_texts(PROMPTS, model, row_start)
    return model, params, partitioner, examples, vocab


def generate(loaded, engine, batch_size=4, count=None, **settings):
    model, params, partitioner, examples, vocab = loaded
    return infer.generate_texts(
        model,
        params,
        examples[:count],
        vocab,
        partitioner,
        GenerationSettings(max_new_tokens=10, **settings),
        batch_size=batch_size,
        engine=engine,
    )


@pytest.mark.slow
def test_paged_engine_gives_the_batch_paths_greedy_outputs(loaded):
    paged = generate(loaded, "paged")
    assert len(paged) == len(PROMPTS) and any(paged)
    # Token-identical: the same model and argmax over the same float32 logits, computed
    # over a paged cache instead of a contiguous one (a tie within rounding would show).
    assert paged == generate(loaded, "batch")
    # With a repetition penalty (over each prompt and its reply), as well.
    penalized = generate(loaded, "paged", repetition_penalty=1.5)
    assert penalized == generate(loaded, "batch", repetition_penalty=1.5) != paged


@pytest.mark.slow
def test_a_sampled_example_depends_on_the_seed_and_itself_not_on_its_batch_mates(loaded):
    sampled = generate(loaded, "paged", temperature=1.0, seed=3)
    # Other rows decoded beside it (the file cut to its first 5 examples): the same samples,
    # each drawn from its own key (`example_seeds`).
    assert generate(loaded, "paged", count=5, temperature=1.0, seed=3) == sampled[:5]
    assert generate(loaded, "paged", temperature=1.0, seed=4) != sampled


def test_auto_takes_the_paged_engine_where_fixed_batches_pad_and_it_can_decode(loaded):
    model = loaded[0]
    greedy = GenerationSettings(max_new_tokens=16)
    even, skewed = [20] * 15, [20] * 15 + [400]
    assert infer.padding_ratio(even, 16) == 1.0
    assert infer.padding_ratio(skewed, 16) == pytest.approx(416 / (36 + 380 / 16))
    assert infer.padding_ratio(skewed, 16, input_length=20) == 1.0  # cut to 20 tokens
    assert infer.choose_engine("auto", model, greedy, even) == "batch"
    assert infer.choose_engine("auto", model, greedy, skewed) == "paged"
    assert infer.choose_engine("batch", model, greedy, skewed) == "batch"
    assert infer.choose_engine("paged", model, greedy, even) == "paged"
    sampled = GenerationSettings(max_new_tokens=16, temperature=0.7, top_p=0.9)
    assert infer.choose_engine("auto", model, sampled, skewed) == "paged"
    top_k = GenerationSettings(max_new_tokens=16, temperature=0.7, top_k=5)
    assert infer.choose_engine("auto", model, top_k, skewed) == "paged"
    # What the engine cannot decode stays in fixed batches; asking for it names the setting.
    phi = base.DecoderOnlyModel(
        phi3.Phi3Config(vocab_size=128, hidden_size=32, num_layers=2, num_heads=2)
    )
    enc_dec = base.EncoderDecoderModel(
        t5.T5Config(vocab_size=128, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    )
    cases = [
        (model, GenerationSettings(num_beams=2), "NUM_BEAMS"),
        (phi, greedy, "contiguous KV cache"),
        (enc_dec, greedy, "contiguous KV cache"),
    ]
    for m, settings, named in cases:
        assert infer.choose_engine("auto", m, settings, skewed) == "batch"
        with pytest.raises(ValueError, match=f"infer.engine='paged'.*{named}"):
            infer.choose_engine("paged", m, settings, skewed)
    with pytest.raises(ValueError, match="infer.engine must be one of"):
        infer.choose_engine("vllm", model, greedy, even)
