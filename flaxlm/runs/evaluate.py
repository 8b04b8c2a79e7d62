"""The `evaluate` run function, and the seqio evaluation training also runs every
`eval_period` steps (`TaskEvaluator`).

A checkpoint is a flaxlm `MODEL_DIR` (its latest or a given step) or a HuggingFace
directory (`run_dir.load_model_and_params`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gin
import numpy as np
import seqio
import tensorflow as tf
from etils import epath

from flaxlm.checkpoints import run_dir
from flaxlm.data import pipeline
from flaxlm.data.config import DatasetConfig
from flaxlm.inference import generation
from flaxlm.inference.generation import GenerationSettings
from flaxlm.models.base import BaseModel
from flaxlm.models.row_start import RowStart
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import metrics, steps

Params = Any


class TaskEvaluator:
    """seqio evaluation of one task or mixture: its metric functions over predictions
    (`generation.generate`) and scores (`model.score`) of its split. A task without metric
    functions evaluates nothing here (its loss, accuracy and perplexity come from the
    eval steps)."""

    def __init__(
        self,
        cfg: DatasetConfig,
        model: BaseModel,
        partitioner: Partitioner,
        row_start: RowStart,
        settings: GenerationSettings = generation.DEFAULT_SETTINGS,
        num_examples: int | None = None,
    ):
        pipeline.configure_tensorflow()
        pipeline.import_task_module(cfg.module)
        pipeline.check_registered(cfg.mixture_or_task_name)
        self.model = model
        self.partitioner = partitioner
        self.row_start = row_start
        self.settings = settings
        self.batch_size = cfg.batch_size
        self.evaluator = seqio.Evaluator(
            cfg.mixture_or_task_name,
            feature_converter=pipeline.ConverterFactory.create(
                model.FEATURE_CONVERTER_CLS, row_start, cfg.mixture_or_task_name
            )(pack=False),
            eval_split=cfg.split,
            sequence_length=dict(cfg.task_feature_lengths),
            num_examples=num_examples,
            use_memory_cache=True,
        )
        self._scorer: generation.Scorer | None = None

    @property
    def active(self) -> bool:
        return bool(self.evaluator.eval_tasks)

    def _examples(self, ds: tf.data.Dataset) -> list[tuple[int, dict[str, np.ndarray]]]:
        return [(int(i), ex) for i, ex in pipeline.without_autotune(ds).as_numpy_iterator()]

    def _prompt(self, ex: Mapping[str, np.ndarray]) -> list[int]:
        if "encoder_input_tokens" in ex:
            return [int(t) for t in ex["encoder_input_tokens"] if t]
        if "decoder_causal_attention" in ex or self.row_start.hf_form:
            # Prefix LM: what the model reads before the first target token, as in training
            # (seqio's start token 0 or the tokenizer's BOS first, then the inputs).
            first = int(np.argmax(ex["decoder_loss_weights"] > 0))
            return [int(t) for t in ex["decoder_input_tokens"][: first + 1]]
        raise ValueError(
            "Predict metrics need inputs: the task's examples have neither encoder inputs nor "
            "a prefix (decoder_causal_attention)."
        )

    def predict_fn(self, ds: tf.data.Dataset, model_feature_shapes: Any = None) -> list:
        indexed = self._examples(ds)
        prompts = [self._prompt(ex) for _, ex in indexed]
        outputs = generation.generate_ids(
            self.model,
            self.params,
            prompts,
            self.partitioner,
            self.settings,
            batch_size=self.batch_size,
        )
        return [(i, out) for (i, _), out in zip(indexed, outputs)]

    def score_fn(self, ds: tf.data.Dataset, model_feature_shapes: Any = None) -> list:
        indexed = self._examples(ds)
        self._scorer = self._scorer or generation.Scorer(self.model, self.partitioner)
        out = []
        for _, chunk in generation.chunks(indexed, self.batch_size):
            padded = chunk + [chunk[0]] * (self.batch_size - len(chunk))
            batch = {
                k: np.stack([ex[k] for _, ex in padded])
                for k in padded[0][1]
                if k != "decoder_causal_attention"
            }
            scores = self._scorer(self.params, batch)
            out += [(i, float(s)) for (i, _), s in zip(chunk, scores[: len(chunk)])]
        return out

    def evaluate(self, params: Params, step: int) -> dict[str, float]:
        """`{"eval/<task>/<metric>": value}` for every task metric."""
        if not self.active:
            return {}
        self.params = params
        future, _ = self.evaluator.evaluate(
            compute_metrics=True,
            step=step,
            predict_fn=self.predict_fn,
            score_fn=self.score_fn,
        )
        results = future.result() or {}
        self.params = None
        out = {}
        for task, task_metrics in results.items():
            for name, value in task_metrics.items():
                value = getattr(value, "value", value)
                if np.ndim(value) == 0:
                    out[f"eval/{task}/{name}"] = float(value)
        return out


@gin.configurable(module="evaluation")  # the run name users type: evaluation.evaluate
def evaluate(
    *,
    checkpoint: str = gin.REQUIRED,
    dataset_cfg: DatasetConfig = gin.REQUIRED,
    output_dir: str = gin.REQUIRED,
    model: BaseModel | None = None,
    partitioner: Partitioner | None = None,
    settings: GenerationSettings = generation.DEFAULT_SETTINGS,
    num_examples: int | None = None,
    max_batches: int | None = None,
    step: int | None = None,
    dtype: str = "auto",
) -> dict[str, float]:
    """Run function: evaluates a checkpoint on a task or mixture and writes the metrics
    (loss, token accuracy, perplexity over the whole split, plus the task's own metric
    functions, e.g. exact match / BLEU / ROUGE over generated text) to
    `output_dir/metrics.jsonl` and TensorBoard at the checkpoint's step. `num_examples`
    limits the task metrics, `max_batches` the loss/accuracy pass (None: the whole split).
    `dtype`: an HF directory's compute and param dtype, 'auto' the checkpoint's own (as
    `infer`'s); a MODEL_DIR computes as its run trained."""
    partitioner = partitioner or Partitioner()
    model, params, step, row_start = run_dir.load_model_and_params(
        checkpoint, partitioner, step, model, dtype=dtype
    )
    out_dir = epath.Path(output_dir)
    metrics.write_config(out_dir)
    scalars = steps.evaluate_split(model, params, partitioner, dataset_cfg, row_start, max_batches)
    task_evaluator = TaskEvaluator(
        dataset_cfg, model, partitioner, row_start, settings, num_examples
    )
    scalars.update(task_evaluator.evaluate(params, step))
    writer = metrics.create_writer(str(out_dir))
    writer.write_scalars(step, scalars)
    writer.close()
    metrics.print0(
        f"Evaluated step {step} of {checkpoint} on {dataset_cfg.mixture_or_task_name} "
        f"({dataset_cfg.split}):\n"
        + "\n".join(f"  {k} = {v:.6g}" for k, v in sorted(scalars.items()))
        + f"\nWrote {out_dir / 'metrics.jsonl'} and {out_dir / 'tensorboard'}."
    )
    return scalars
