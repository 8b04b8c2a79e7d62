"""The `infer` and `score` run functions: generate a continuation of, or score a target
after, every input of a file or a seqio task with a checkpoint.

A checkpoint is a flaxlm `MODEL_DIR` (its latest or a given step) or a HuggingFace
directory (`run_dir.load_model_and_params`). Every process reads every example, so batches
are identical on all processes; process 0 writes the results, one line per example in input
order.

`infer` decodes through the serving engine's scheduler (`inference/paged_batch.py` over
`inference/scheduler.py`: every prompt queued at once, rows joining the running batch as
others end, a paged KV cache) where it can, and in fixed batches (`generation.generate_ids`,
split over the mesh's batch axes) where it cannot: beam search, top-k sampling, and the
models that decode over a contiguous cache only (Phi-3, encoder-decoders).
benchmarks/infer.py measures the two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from flaxlm.checkpoints import run_dir
from flaxlm.data import vocabularies
from flaxlm.data.input_process import load_pipeline
from flaxlm.data.jsonl_reader import read_jsonl
from flaxlm.data.vocabularies import Vocabulary
from flaxlm.inference import generation, guides
from flaxlm.inference.generation import GenerationSettings
from flaxlm.inference.paged_batch import BatchGenerator, BatchProgress
from flaxlm.inference.sampling import Sampling
from flaxlm.models.base import BaseModel, EncoderDecoderModel
from flaxlm.models.paged_attention import check_paged_attention
from flaxlm.models.row_start import RowStart
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import metrics

# ---------------------------------------------------------------------------- examples


@dataclasses.dataclass
class Example:
    """One input (and optional target) as text and as token ids for the model."""

    input_text: str
    input_ids: list[int]
    target_text: str | None = None
    target_ids: list[int] | None = None


def read_examples_from_texts(
    texts: Sequence[str],
    model: BaseModel,
    row_start: RowStart,
    vocabulary: Vocabulary | None = None,
    targets: Sequence[str | None] | None = None,
) -> tuple[list[Example], Vocabulary, str]:
    """`(examples, vocabulary, "texts")` for input strings (and optional target strings),
    each prompt starting as the checkpoint's training rows did (`row_start`)."""
    vocabulary = vocabulary or vocabularies.ByteVocabulary()
    targets = list(targets) if targets is not None else [None] * len(texts)

    def ids(text: str | None, is_target: bool) -> list[int] | None:
        if text is None:
            return None
        return generation.prompt_ids(model, vocabulary, text, row_start, is_target=is_target)

    examples = [
        Example(t, ids(t, False), target, ids(target, True)) for t, target in zip(texts, targets)
    ]
    return examples, vocabulary, "texts"


def read_examples(
    source: str,
    model: BaseModel,
    row_start: RowStart,
    vocabulary: Vocabulary | None,
    *,
    split: str = "validation",
    task_module: str | None = None,
    need_targets: bool = False,
    max_examples: int | None = None,
) -> tuple[list[Example], Vocabulary, str]:
    """`(examples, vocabulary, name)` from a JSONL file (`in_text`, `out_text`), a text
    file (one input per line) or a registered seqio task or mixture (its `inputs`, else its
    `targets`, as the task tokenizes them), each prompt after `row_start`'s ids. Only a
    task loads seqio and TensorFlow."""
    examples: list[Example] = []
    if source.endswith(".jsonl") or source.endswith(".txt") or epath.Path(source).exists():
        if not epath.Path(source).exists():
            raise FileNotFoundError(f"Input file {source!r} does not exist.")
        vocabulary = vocabulary or vocabularies.ByteVocabulary()
        name = epath.Path(source).stem
        if source.endswith(".jsonl"):
            fields = ("in_text", "out_text") if need_targets else ("in_text",)
            records = [(r["in_text"], r.get("out_text")) for r in read_jsonl(source, fields)]
        else:
            if need_targets:
                raise ValueError(
                    f"Scoring needs targets: give a JSONL file with in_text and out_text, not "
                    f"{source!r}."
                )
            lines = epath.Path(source).read_text().splitlines()
            records = [(line, None) for line in lines if line.strip()]
        records = records[:max_examples]
        examples, vocabulary, _ = read_examples_from_texts(
            [r[0] for r in records], model, row_start, vocabulary, [r[1] for r in records]
        )
    else:
        # The input pipeline (seqio, TensorFlow) loads where a run reads a task only.
        pipeline = load_pipeline()
        features, rows = pipeline.task_examples(
            source, split, module=task_module, max_examples=max_examples
        )
        key = "inputs" if "inputs" in features else "targets"
        vocabulary = vocabulary or features[key].vocabulary
        name = source
        start = [] if isinstance(model, EncoderDecoderModel) else list(row_start.ids(vocabulary))
        for ex in rows:
            ids = [int(i) for i in ex[key]]
            target_ids = [int(i) for i in ex["targets"]] if key == "inputs" else None
            if need_targets and target_ids is None:
                raise ValueError(f"Task {source!r} has no inputs to score targets against.")
            examples.append(
                Example(
                    vocabulary.decode(ids),
                    start + ids,
                    None if target_ids is None else vocabulary.decode(target_ids),
                    target_ids,
                )
            )
    if not examples:
        raise ValueError(f"{source!r} ({split}) holds no examples.")
    return examples, vocabulary, name


def checkpoint_examples(
    checkpoint: str,
    partitioner: Partitioner,
    step: int | None,
    model: BaseModel | None,
    dtype: str,
    vocabulary: Vocabulary | None,
    source: str,
    **kwargs: Any,
) -> tuple[run_dir.Loaded, list[Example], Vocabulary, str]:
    """The checkpoint and `read_examples` of `source` from its row start (and tokenizer)."""
    loaded = run_dir.load_model_and_params(checkpoint, partitioner, step, model, dtype=dtype)
    vocabulary = vocabulary or run_dir.checkpoint_vocabulary(checkpoint)
    read = read_examples(source, loaded.model, loaded.row_start, vocabulary, **kwargs)
    return (loaded, *read)


# ---------------------------------------------------------------------------- engines

ENGINES = ("auto", "paged", "batch")
# 'auto' takes the paged engine where fixed batches would make the average sequence this
# many times longer (`padding_ratio`): on the 2-core CPU, since the contiguous cache is held
# head-major (fixed batches' decode steps 1.3-1.5x faster), the engine ran 0.75x the fixed
# batches' speed at a ratio of 2.6, 0.81x at 3.5, 1.49x at 5.0 and 1.78x at 6.5 (break-even
# ~4; benchmarks/HISTORY.md, "Sixteenth session"), and its first run compiles ~2x longer.
PADDING_RATIO = 5.0
DECODE_STEPS = 16  # tokens a row generates per engine dispatch
PREFILL_ROWS = 2  # prompts each engine prefill dispatch reads
PREFILL_CHUNK = 128  # of this many tokens each
PAGE_SIZE = 16  # KV-cache slots per page


def check_engine(engine: str) -> None:
    """Refuses an `engine` setting that is none of `ENGINES`, before any device work."""
    if engine not in ENGINES:
        raise ValueError(f"infer.engine must be one of {list(ENGINES)}, got {engine!r}.")


def paged_refusal(model: BaseModel, settings: GenerationSettings) -> str | None:
    """Why the paged engine cannot decode `settings` for `model`, or None."""
    if settings.num_beams > 1:
        return "Beam search (NUM_BEAMS > 1) decodes in fixed batches."
    return model.paged_refusal()


def padding_ratio(
    prompt_lengths: Sequence[int], max_new_tokens: int, input_length: int | None = None
) -> float:
    """How many times longer than the average sequence (prompt and new tokens) fixed
    batches make each: they pad every prompt to `input_length`, else to the longest."""
    length = input_length or max(prompt_lengths)
    mean = sum(min(n, length) for n in prompt_lengths) / len(prompt_lengths)
    return (length + max_new_tokens) / (mean + max_new_tokens)


def choose_engine(
    engine: str,
    model: BaseModel,
    settings: GenerationSettings,
    prompt_lengths: Sequence[int],
    input_length: int | None = None,
) -> str:
    """'paged' or 'batch': `engine` itself, or for 'auto' the paged engine where it can
    decode and fixed batches would pad the prompts `PADDING_RATIO` times or more (a
    ValueError naming the setting when 'paged' is asked for where it cannot decode)."""
    check_engine(engine)
    refusal = paged_refusal(model, settings)
    if settings.structured_outputs is not None and (refusal or engine == "batch"):
        raise ValueError(
            "STRUCTURED_OUTPUTS: outputs follow a grammar through the paged engine only: "
            f"{refusal or 'set INFER_ENGINE to paged or auto.'}"
        )
    if engine == "paged" and refusal is not None:
        raise ValueError(f"infer.engine='paged': {refusal} Use 'batch' or 'auto'.")
    if engine == "auto":
        ratio = padding_ratio(prompt_lengths, settings.max_new_tokens, input_length)
        guided = settings.structured_outputs is not None
        return "paged" if refusal is None and (ratio >= PADDING_RATIO or guided) else "batch"
    return engine


def example_seeds(seed: int, count: int) -> np.ndarray:
    """uint32 `[count]`: example i's sampling seed, from `seed` and i alone (so its sample
    is the same whatever else the file holds and however rows are batched)."""
    key = jax.random.PRNGKey(seed)
    bits = jax.vmap(lambda i: jax.random.bits(jax.random.fold_in(key, i), (), jnp.uint32))
    return np.asarray(bits(jnp.arange(count)))


def paged_generate_ids(
    model: BaseModel,
    params: Any,
    prompts: Sequence[list[int]],
    partitioner: Partitioner,
    settings: GenerationSettings,
    *,
    max_rows: int,
    input_length: int | None = None,
    progress: Callable[[str], None] | None = None,
    decode_steps: int = DECODE_STEPS,
    prefill_rows: int = PREFILL_ROWS,
    prefill_chunk: int = PREFILL_CHUNK,
    page_size: int = PAGE_SIZE,
    paged_attention: str = "gather",
    guide: Callable[[], Any] | None = None,
) -> list[list[int]]:
    """The new token ids after each prompt (up to EOS), in order, through the paged engine
    (`paged_batch.BatchGenerator`): every prompt queued at once, `max_rows` decoded
    together, a row's place taken by the next prompt as soon as it ends; `guide`: makes each
    row's grammar (`guides.guide_factory`). Prompts longer
    than `input_length` keep their end, as `generation.generate_ids` cuts them. Greedy
    decoding gives `generate_ids`' tokens; a sampled example draws from its own seed
    (`example_seeds`). Every process must pass the same prompts: each runs the same
    dispatches and reads every result."""
    length = input_length or max(len(p) for p in prompts)
    cut = sum(len(p) > length for p in prompts)
    if cut and progress:
        progress(f"{cut} prompt(s) longer than {length} tokens are cut to {length}.")
    prompts = [p[-length:] for p in prompts]
    longest = max(len(p) for p in prompts)
    generator = BatchGenerator(
        model,
        params,
        partitioner,
        max_rows=min(max_rows, len(prompts)),
        max_prompt_length=longest,
        max_new_tokens=settings.max_new_tokens,
        decode_steps=decode_steps,
        prefill_chunk=min(prefill_chunk, generation.round_up(longest, 16)),
        prefill_rows=prefill_rows,
        page_size=page_size,
        paged_attention=paged_attention,
    )

    def report(at: BatchProgress) -> None:
        rate = at.generated / max(at.elapsed, 1e-9)
        eta = at.elapsed / max(at.ended, 1) * (at.total - at.ended)
        progress(
            f"{at.ended}/{at.total} examples | decode {rate:,.0f} tokens/s | "
            f"ETA {metrics.format_duration(eta)}"
        )

    jobs = generator.generate(
        prompts,
        example_seeds(settings.seed, len(prompts)),
        sampling=Sampling(
            settings.temperature,
            settings.top_p,
            settings.top_k,
            repetition_penalty=settings.repetition_penalty,
            min_tokens=settings.min_new_tokens,
        ),  # fmt: skip
        progress=report if progress else None,
        guide=guide,
    )
    return [j.tokens for j in jobs]


def generate_texts(
    model: BaseModel,
    params: Any,
    examples: Sequence[Example],
    vocabulary: Vocabulary,
    partitioner: Partitioner,
    settings: GenerationSettings,
    *,
    batch_size: int,
    input_length: int | None = None,
    progress: Callable[[str], None] | None = None,
    engine: str = "auto",
    paged_attention: str = "gather",
) -> list[str]:
    """The decoded continuation of each example, in order (every process gets all), from
    the paged engine (`batch_size` rows decoded together, its attention reading the pages as
    `paged_attention` says: `Scheduler`) or fixed batches of `batch_size`
    (`choose_engine`)."""
    prompts = [e.input_ids for e in examples]
    lengths = [len(p) for p in prompts]
    if choose_engine(engine, model, settings, lengths, input_length) == "paged":
        ids = paged_generate_ids(
            model,
            params,
            prompts,
            partitioner,
            settings,
            max_rows=batch_size,
            input_length=input_length,
            progress=progress,
            paged_attention=paged_attention,
            guide=guides.guide_factory(
                settings.structured_outputs, vocabulary, model.config.vocab_size, model.eos_ids
            ),
        )
    else:
        ids = generation.generate_ids(
            model,
            params,
            prompts,
            partitioner,
            settings,
            batch_size=batch_size,
            input_length=input_length,
            progress=progress,
        )
    return [vocabulary.decode(i) for i in ids]


@gin.configurable
def infer(
    *,
    checkpoint: str = gin.REQUIRED,
    source: str = gin.REQUIRED,
    output_dir: str = gin.REQUIRED,
    model: BaseModel | None = None,
    partitioner: Partitioner | None = None,
    vocabulary: Vocabulary | None = None,
    settings: GenerationSettings = generation.DEFAULT_SETTINGS,
    split: str = "validation",
    task_module: str | None = None,
    batch_size: int = 8,
    input_length: int | None = None,
    max_examples: int | None = None,
    step: int | None = None,
    engine: str = "auto",
    dtype: str = "auto",
    paged_attention: str = "gather",
) -> str:
    """Run function: generates a continuation of every input of `source` and writes
    `output_dir/<name>.jsonl` (`{"input": ..., "output": ...}` per line, input order) and
    `output_dir/config.gin`.

    Args:
      checkpoint: a flaxlm MODEL_DIR or a HuggingFace directory.
      source: a `.jsonl` file (`{"in_text": ...}` per line), a text file (one input per
        line) or a registered seqio task or mixture (its `split`).
      vocabulary: how text becomes tokens; default the task's, else the HF directory's
        tokenizer, else the byte vocabulary (`vocabularies.ByteVocabulary`, seqio's ids).
      batch_size: prompts decoded together.
      input_length: prompts are cut to this many tokens (and on the batch path padded to
        it); the longest if None.
      engine: 'paged' (the serving engine's continuous batching over a paged KV cache),
        'batch' (fixed batches, split over the mesh's batch axes) or 'auto': paged where it
        can decode (`choose_engine`), which is faster (docs/generation.md).
      dtype: how an HF directory's model is held and computes: 'auto' (the checkpoint's own
        dtype, as transformers loads it), 'float32', 'bfloat16' or 'float16'; a MODEL_DIR
        computes as its run trained.
      paged_attention: how the paged engine's decode steps read the KV cache's pages:
        'gather' (copied out first; every platform) or 'pallas' (JAX's Pallas kernel reads
        them in place; NVIDIA GPU). See `flaxlm.models.paged_attention`.
    """
    check_engine(engine)
    check_paged_attention(paged_attention, "infer.paged_attention")
    partitioner = partitioner or Partitioner()
    (model, params, step, _), examples, vocabulary, name = checkpoint_examples(
        checkpoint, partitioner, step, model, dtype, vocabulary, source, split=split,
        task_module=task_module, max_examples=max_examples,
    )  # fmt: skip
    lengths = [len(e.input_ids) for e in examples]
    engine = choose_engine(engine, model, settings, lengths, input_length)
    generation.file_settings_note(
        checkpoint,
        model.generation_config,
        f"infer's settings (temperature {settings.temperature:g}, top_k {settings.top_k}, top_p "
        f"{settings.top_p:g}, num_beams {settings.num_beams}, repetition_penalty "
        f"{settings.repetition_penalty:g}, min_new_tokens {settings.min_new_tokens}: "
        "TEMPERATURE, TOP_K, TOP_P, NUM_BEAMS, REPETITION_PENALTY, MIN_NEW_TOKENS in "
        "gin/runs/infer.gin)",
    )
    out_dir = epath.Path(output_dir)
    metrics.write_config(out_dir)
    ratio = padding_ratio(lengths, settings.max_new_tokens, input_length)
    metrics.print0(
        f"Generating for {len(examples)} examples of {name} with step {step} of {checkpoint} "
        f"({'the paged engine' if engine == 'paged' else 'fixed batches'}; fixed batches "
        f"pad the sequences {ratio:.1f}x)."
    )
    outputs = generate_texts(
        model,
        params,
        examples,
        vocabulary,
        partitioner,
        settings,
        batch_size=batch_size,
        input_length=input_length,
        progress=metrics.print0,
        engine=engine,
        paged_attention=paged_attention,
    )
    path = out_dir / f"{name}.jsonl"
    metrics.write_jsonl(
        path, [{"input": e.input_text, "output": o} for e, o in zip(examples, outputs)]
    )
    metrics.print0(f"Wrote {len(outputs)} outputs to {path} (config: {out_dir / 'config.gin'}).")
    return str(path)


@gin.configurable
def score(
    *,
    checkpoint: str = gin.REQUIRED,
    source: str = gin.REQUIRED,
    output_dir: str = gin.REQUIRED,
    model: BaseModel | None = None,
    partitioner: Partitioner | None = None,
    vocabulary: Vocabulary | None = None,
    split: str = "validation",
    task_module: str | None = None,
    batch_size: int = 8,
    max_examples: int | None = None,
    step: int | None = None,
    dtype: str = "auto",
) -> str:
    """Run function: the log-likelihood of each target given its input, to
    `output_dir/<name>.jsonl` (`{"input", "target", "score", "num_tokens"}` per line, input
    order) and `output_dir/config.gin`. `source`: a JSONL file with `in_text` and
    `out_text`, or a seqio task with inputs and targets. `dtype` as `infer`'s."""
    partitioner = partitioner or Partitioner()
    (model, params, step, _), examples, vocabulary, name = checkpoint_examples(
        checkpoint, partitioner, step, model, dtype, vocabulary, source, split=split,
        task_module=task_module, need_targets=True, max_examples=max_examples,
    )  # fmt: skip
    out_dir = epath.Path(output_dir)
    metrics.write_config(out_dir)
    metrics.print0(f"Scoring {len(examples)} examples of {name} with step {step} of {checkpoint}.")
    scores = generation.score_examples(
        model,
        params,
        [e.input_ids for e in examples],
        [e.target_ids or [] for e in examples],
        partitioner,
        batch_size=batch_size,
    )
    path = out_dir / f"{name}.jsonl"
    metrics.write_jsonl(
        path,
        [
            {
                "input": e.input_text,
                "target": e.target_text,
                "score": s,
                "num_tokens": len(e.target_ids or []),
            }
            for e, s in zip(examples, scores)
        ],
    )
    metrics.print0(f"Wrote {len(scores)} scores to {path}.")
    return str(path)
