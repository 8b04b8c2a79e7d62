"""The `infer` and `score` run functions: generate a continuation of, or score a target
after, every input of a file or a seqio task with a checkpoint.

A checkpoint is a flaxlm `MODEL_DIR` (its latest or a given step) or a HuggingFace
directory (`run_dir.load_model_and_params`). Every process reads every example, so batches
are identical on all processes; the batch is split over the mesh's batch axes and process 0
writes the results, one line per example in input order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import gin
from etils import epath

from flaxlm.checkpoints import run_dir
from flaxlm.data import vocabularies
from flaxlm.data.jsonl import read_jsonl
from flaxlm.data.vocabularies import Vocabulary
from flaxlm.inference import generation
from flaxlm.inference.generation import GenerationSettings
from flaxlm.models.base import BaseModel
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
    vocabulary: Vocabulary | None = None,
    targets: Sequence[str | None] | None = None,
) -> tuple[list[Example], Vocabulary, str]:
    """`(examples, vocabulary, "texts")` for input strings (and optional target strings)."""
    vocabulary = vocabulary or vocabularies.ByteVocabulary()
    targets = list(targets) if targets is not None else [None] * len(texts)
    examples = [
        Example(
            text,
            generation.prompt_ids(model, vocabulary, text, is_target=False),
            target,
            None
            if target is None
            else generation.prompt_ids(model, vocabulary, target, is_target=True),
        )
        for text, target in zip(texts, targets)
    ]
    return examples, vocabulary, "texts"


def read_examples(
    source: str,
    model: BaseModel,
    vocabulary: Vocabulary | None,
    *,
    split: str = "validation",
    task_module: str | None = None,
    need_targets: bool = False,
    max_examples: int | None = None,
) -> tuple[list[Example], Vocabulary, str]:
    """`(examples, vocabulary, name)` from a JSONL file (`in_text`, `out_text`), a text
    file (one input per line) or a registered seqio task or mixture (its `inputs`, else its
    `targets`, as the task tokenizes them). Only a task loads seqio and TensorFlow."""
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
            [r[0] for r in records], model, vocabulary, [r[1] for r in records]
        )
    else:
        # The input pipeline (seqio, TensorFlow) loads where a run reads a task only, after
        # Gin's config is locked: it registers configurables, and binds nothing.
        with gin.unlock_config():
            from flaxlm.data import pipeline

        features, rows = pipeline.task_examples(
            source, split, module=task_module, max_examples=max_examples
        )
        key = "inputs" if "inputs" in features else "targets"
        vocabulary = vocabulary or features[key].vocabulary
        name = source
        for ex in rows:
            ids = [int(i) for i in ex[key]]
            target_ids = [int(i) for i in ex["targets"]] if key == "inputs" else None
            if need_targets and target_ids is None:
                raise ValueError(f"Task {source!r} has no inputs to score targets against.")
            examples.append(
                Example(
                    vocabulary.decode(ids),
                    ids,
                    None if target_ids is None else vocabulary.decode(target_ids),
                    target_ids,
                )
            )
    if not examples:
        raise ValueError(f"{source!r} ({split}) holds no examples.")
    return examples, vocabulary, name


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
) -> list[str]:
    """The decoded continuation of each example, in order (every process gets all)."""
    ids = generation.generate_ids(
        model,
        params,
        [e.input_ids for e in examples],
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
      input_length: prompts are padded (and cut) to this many tokens; the longest if None.
    """
    partitioner = partitioner or Partitioner()
    model, params, step = run_dir.load_model_and_params(checkpoint, partitioner, step, model)
    vocabulary = vocabulary or run_dir.checkpoint_vocabulary(checkpoint)
    examples, vocabulary, name = read_examples(
        source, model, vocabulary, split=split, task_module=task_module, max_examples=max_examples
    )
    out_dir = epath.Path(output_dir)
    metrics.write_config(out_dir)
    metrics.print0(
        f"Generating for {len(examples)} examples of {name} with step {step} of {checkpoint}."
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
) -> str:
    """Run function: the log-likelihood of each target given its input, to
    `output_dir/<name>.jsonl` (`{"input", "target", "score", "num_tokens"}` per line, input
    order) and `output_dir/config.gin`. `source`: a JSONL file with `in_text` and
    `out_text`, or a seqio task with inputs and targets."""
    partitioner = partitioner or Partitioner()
    model, params, step = run_dir.load_model_and_params(checkpoint, partitioner, step, model)
    vocabulary = vocabulary or run_dir.checkpoint_vocabulary(checkpoint)
    examples, vocabulary, name = read_examples(
        source,
        model,
        vocabulary,
        split=split,
        task_module=task_module,
        need_targets=True,
        max_examples=max_examples,
    )
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
