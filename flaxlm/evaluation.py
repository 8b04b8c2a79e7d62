"""Inference, scoring and evaluation of a checkpoint: the `infer`, `score` and `evaluate`
run functions, and the seqio evaluation that training also runs every `eval_period` steps.

A checkpoint is a flaxlm `MODEL_DIR` (its latest or a given step; the model comes from the
Gin binding or from `MODEL_DIR/hf_config.json`, which every training run records) or a
HuggingFace directory. Every process reads every example, so batches are identical on all
processes; the batch is split over the mesh's batch axes and process 0 writes the results,
one line per example in input order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import gin
import jax
import numpy as np
import seqio
import tensorflow as tf
from etils import epath

from flaxlm import checkpoints, data, hf, lora, metrics
from flaxlm.models.base import BaseModel, DecoderOnlyModel, EncoderDecoderModel
from flaxlm.partitioning import Partitioner

Params = Any


# ---------------------------------------------------------------------------- loading


def is_hf_dir(path: str | epath.Path) -> bool:
    path = epath.Path(path)
    return (path / "config.json").exists() and not (path / "checkpoints").exists()


def load_model_and_params(
    checkpoint: str,
    partitioner: Partitioner,
    model: BaseModel | None = None,
    step: int | None = None,
) -> tuple[BaseModel, Params, int]:
    """`(model, params, step)` from a flaxlm MODEL_DIR or an HF directory, placed on the
    partitioner's shardings (one shard at a time)."""
    path = epath.Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"CHECKPOINT {checkpoint!r} does not exist.")
    if is_hf_dir(path):
        if model is None:
            model, params = hf.from_pretrained(path, partitioner)
        else:
            params = hf.load_params(model, path, partitioner)
        return model, params, 0
    if model is None:
        model = hf.model_from_hf_config(path / "hf_config.json", partitioner)
    if lora.read_record(path) is not None:  # a LoRA run: its adapters merged into the base
        params, step = lora.restore_merged(path, model, partitioner, step)
        return model, params, step
    batch_shapes = model.example_batch_shapes()
    abstract = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0), batch_shapes))
    shardings = partitioner.sharding(model.params_axes(batch_shapes))
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    ckpt = checkpoints.Checkpointer(str(path))
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise ValueError(
            f"No checkpoint in {ckpt.directory}: CHECKPOINT must be a flaxlm MODEL_DIR with "
            "checkpoints or a HuggingFace directory (config.json + *.safetensors)."
        )
    params = ckpt.restore_params(step, abstract)
    ckpt.close()
    return model, params, step


# ---------------------------------------------------------------------------- examples


@dataclasses.dataclass
class Example:
    """One input (and optional target) as text and as token ids for the model."""

    input_text: str
    input_ids: list[int]
    target_text: str | None = None
    target_ids: list[int] | None = None


def _model_ids(
    model: BaseModel, vocabulary: seqio.Vocabulary, text: str, *, is_target: bool
) -> list[int]:
    """Token ids as the model reads them: a decoder-only prompt starts with the
    vocabulary's BOS (if it has one); encoder inputs and encoder-decoder targets end with
    EOS (as seqio's features do)."""
    ids = list(vocabulary.encode(text))
    is_encdec = isinstance(model, EncoderDecoderModel)
    if is_encdec:
        return ids + [vocabulary.eos_id]
    bos = getattr(vocabulary, "bos_id", None)
    if not is_target and bos is not None:
        ids = [bos] + ids
    return ids


def read_examples_from_texts(
    texts: Sequence[str],
    model: BaseModel,
    vocabulary: seqio.Vocabulary | None = None,
    targets: Sequence[str | None] | None = None,
) -> tuple[list[Example], seqio.Vocabulary, str]:
    """`(examples, vocabulary, "texts")` for input strings (and optional target strings)."""
    vocabulary = vocabulary or seqio.ByteVocabulary()
    targets = list(targets) if targets is not None else [None] * len(texts)
    examples = [
        Example(
            text,
            _model_ids(model, vocabulary, text, is_target=False),
            target,
            None if target is None else _model_ids(model, vocabulary, target, is_target=True),
        )
        for text, target in zip(texts, targets)
    ]
    return examples, vocabulary, "texts"


def read_examples(
    source: str,
    model: BaseModel,
    vocabulary: seqio.Vocabulary | None,
    *,
    split: str = "validation",
    task_module: str | None = None,
    need_targets: bool = False,
    max_examples: int | None = None,
) -> tuple[list[Example], seqio.Vocabulary, str]:
    """`(examples, vocabulary, name)` from a JSONL file (`in_text`, `out_text`), a text
    file (one input per line) or a registered seqio task or mixture (its `inputs`, else its
    `targets`, as the task tokenizes them)."""
    examples: list[Example] = []
    if source.endswith(".jsonl") or source.endswith(".txt") or epath.Path(source).exists():
        if not epath.Path(source).exists():
            raise FileNotFoundError(f"Input file {source!r} does not exist.")
        vocabulary = vocabulary or seqio.ByteVocabulary()
        name = epath.Path(source).stem
        if source.endswith(".jsonl"):
            fields = ("in_text", "out_text") if need_targets else ("in_text",)
            records = [(r["in_text"], r.get("out_text")) for r in data.read_jsonl(source, fields)]
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
        data.import_task_module(task_module)
        data._check_registered(source)
        data.configure_tensorflow()
        task = seqio.get_mixture_or_task(source)
        features = task.output_features
        key = "inputs" if "inputs" in features else "targets"
        vocabulary = vocabulary or features[key].vocabulary
        ds = task.get_dataset(None, split=split, shuffle=False, num_epochs=1)
        if max_examples:
            ds = ds.take(max_examples)
        name = source
        for ex in ds.as_numpy_iterator():
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


def _batches(items: Sequence[Any], batch_size: int) -> Iterator[tuple[int, list[Any]]]:
    for start in range(0, len(items), batch_size):
        yield start, list(items[start : start + batch_size])


def _pad_rows(rows: list[list[int]], length: int, batch_size: int) -> np.ndarray:
    """int32 `[batch_size, length]`, right-padded with 0; missing rows repeat the first."""
    out = np.zeros((batch_size, length), np.int32)
    for i in range(batch_size):
        ids = rows[i] if i < len(rows) else rows[0]
        out[i, : len(ids)] = ids[:length]
    return out


def _write_jsonl(path: epath.Path, records: Sequence[Mapping[str, Any]]) -> None:
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / (path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        tmp.rename(path)


def _write_config(output_dir: epath.Path) -> None:
    if jax.process_index() == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.gin").write_text(gin.operative_config_str())


def _cut(ids: list[int], length: int, keep_end: bool) -> list[int]:
    return ids[-length:] if keep_end else ids[:length]


def _until_eos(tokens: np.ndarray, eos_ids: Sequence[int]) -> list[int]:
    out = []
    for t in tokens.tolist():
        if t in eos_ids:
            break
        out.append(t)
    return out


# ---------------------------------------------------------------------------- infer


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """How `infer` decodes (see `BaseModel.generate`)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    seed: int = 0


def generate_ids(
    model: BaseModel,
    params: Params,
    prompts: Sequence[list[int]],
    partitioner: Partitioner,
    settings: GenerationSettings,
    *,
    batch_size: int,
    input_length: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[list[int]]:
    """The new token ids after each prompt (up to EOS), in order (every process gets all).
    Prompts are padded to `input_length` (the longest if None; longer ones are cut)."""
    longest = max(len(p) for p in prompts)
    length = input_length or longest
    cut = sum(len(p) > length for p in prompts)
    if cut and progress:
        progress(f"{cut} prompt(s) longer than {length} tokens are cut to {length}.")
    is_encdec = isinstance(model, EncoderDecoderModel)
    outputs: list[list[int]] = []
    total_batches = math.ceil(len(prompts) / batch_size)
    start_time = time.perf_counter()
    generated = 0
    for number, (start, chunk) in enumerate(_batches(prompts, batch_size), 1):
        rows = [_cut(p, length, keep_end=not is_encdec) for p in chunk]
        inputs = _pad_rows(rows, length, batch_size)
        lengths = np.asarray([len(r) for r in rows] + [len(rows[0])] * (batch_size - len(rows)))
        tokens = model.generate(
            params,
            {"inputs": inputs, "inputs_lengths": lengths},
            settings.max_new_tokens,
            settings.temperature,
            settings.top_k,
            settings.top_p,
            settings.num_beams,
            jax.random.fold_in(jax.random.PRNGKey(settings.seed), start),
            length_penalty=settings.length_penalty,
            partitioner=partitioner,
        )
        for row in range(len(chunk)):
            ids = _until_eos(tokens[row], model.eos_ids)
            generated += len(ids) + (len(ids) < settings.max_new_tokens)
            outputs.append(ids)
        if progress:
            elapsed = time.perf_counter() - start_time
            rate = generated / max(elapsed, 1e-9)
            eta = elapsed / number * (total_batches - number)
            progress(
                f"batch {number}/{total_batches} | {len(outputs)}/{len(prompts)} examples | "
                f"decode {rate:,.0f} tokens/s | ETA {metrics.format_duration(eta)}"
            )
    return outputs


def generate_texts(
    model: BaseModel,
    params: Params,
    examples: Sequence[Example],
    vocabulary: seqio.Vocabulary,
    partitioner: Partitioner,
    settings: GenerationSettings,
    *,
    batch_size: int,
    input_length: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[str]:
    """The decoded continuation of each example, in order (every process gets all)."""
    ids = generate_ids(
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


def _print(message: str) -> None:
    if jax.process_index() == 0:
        print(message, flush=True)


@gin.configurable
def infer(
    *,
    checkpoint: str = gin.REQUIRED,
    source: str = gin.REQUIRED,
    output_dir: str = gin.REQUIRED,
    model: BaseModel | None = None,
    partitioner: Partitioner | None = None,
    vocabulary: seqio.Vocabulary | None = None,
    settings: GenerationSettings = GenerationSettings(),
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
        tokenizer, else seqio's ByteVocabulary.
      input_length: prompts are padded (and cut) to this many tokens; the longest if None.
    """
    partitioner = partitioner or Partitioner()
    model, params, step = load_model_and_params(checkpoint, partitioner, model, step)
    vocabulary = vocabulary or _checkpoint_vocabulary(checkpoint)
    examples, vocabulary, name = read_examples(
        source, model, vocabulary, split=split, task_module=task_module, max_examples=max_examples
    )
    out_dir = epath.Path(output_dir)
    _write_config(out_dir)
    _print(f"Generating for {len(examples)} examples of {name} with step {step} of {checkpoint}.")
    outputs = generate_texts(
        model,
        params,
        examples,
        vocabulary,
        partitioner,
        settings,
        batch_size=batch_size,
        input_length=input_length,
        progress=_print,
    )
    path = out_dir / f"{name}.jsonl"
    _write_jsonl(path, [{"input": e.input_text, "output": o} for e, o in zip(examples, outputs)])
    _print(f"Wrote {len(outputs)} outputs to {path} (config: {out_dir / 'config.gin'}).")
    return str(path)


def _checkpoint_vocabulary(checkpoint: str) -> seqio.Vocabulary | None:
    """An HF directory's own tokenizer, or the one a MODEL_DIR kept from its HF import."""
    path = epath.Path(checkpoint)
    if not is_hf_dir(path):
        path = path / hf.TOKENIZER_DIR
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from flaxlm.vocabularies import HuggingFaceVocabulary

        return HuggingFaceVocabulary(str(path))
    return None


# ---------------------------------------------------------------------------- score


def _length_mask(lengths: Sequence[int], length: int) -> np.ndarray:
    return (np.arange(length)[None] < np.asarray(lengths)[:, None]).astype(np.int32)


def score_batch_features(
    model: BaseModel, inputs: Sequence[list[int]], targets: Sequence[list[int]]
) -> dict[str, np.ndarray]:
    """Unpacked model features whose loss weights cover exactly the targets.

    Decoder-only: the sequence is input + target, and the weights mark the target tokens
    (the log-likelihood of the target given the input). Encoder-decoder: the encoder reads
    the input, the decoder the target shifted right (seqio's features)."""
    rows = len(inputs)
    if isinstance(model, EncoderDecoderModel):
        enc_len = max(len(i) for i in inputs)
        dec_len = max(len(t) for t in targets)
        enc = np.zeros((rows, enc_len), np.int32)
        tgt = np.zeros((rows, dec_len), np.int32)
        for r, (i, t) in enumerate(zip(inputs, targets)):
            enc[r, : len(i)], tgt[r, : len(t)] = i, t
        shifted = np.concatenate([np.zeros((rows, 1), np.int32), tgt[:, :-1]], axis=1)
        return {
            "encoder_input_tokens": enc,
            "decoder_input_tokens": shifted,
            "decoder_target_tokens": tgt,
            "decoder_loss_weights": _length_mask([len(t) for t in targets], dec_len),
            "encoder_segment_ids": _length_mask([len(i) for i in inputs], enc_len),
        }
    if not isinstance(model, DecoderOnlyModel):
        raise TypeError(f"{type(model).__name__} does not score targets given inputs.")
    seqs = [list(i) + list(t) for i, t in zip(inputs, targets)]
    length = max(len(s) for s in seqs) - 1
    tokens_in = np.zeros((rows, length), np.int32)
    tokens_out = np.zeros((rows, length), np.int32)
    weights = np.zeros((rows, length), np.int32)
    segments = np.zeros((rows, length), np.int32)
    for r, (i, s) in enumerate(zip(inputs, seqs)):
        n = len(s) - 1
        tokens_in[r, :n], tokens_out[r, :n] = s[:-1], s[1:]
        weights[r, max(len(i) - 1, 0) : n] = 1
        segments[r, :n] = 1
    return {
        "decoder_input_tokens": tokens_in,
        "decoder_target_tokens": tokens_out,
        "decoder_loss_weights": weights,
        "decoder_segment_ids": segments,
        "decoder_positions": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)),
    }


class Scorer:
    """`model.score` (or `fn(params, batch)`, any pytree of `[batch, ...]` arrays) jitted
    under a partitioner; numpy in, numpy out on every process."""

    def __init__(
        self,
        model: BaseModel,
        partitioner: Partitioner,
        fn: Callable[[Params, Mapping[str, Any]], Any] | None = None,
    ):
        self._partitioner = partitioner
        self._fn = jax.jit(
            fn or model.score,
            out_shardings=jax.sharding.NamedSharding(
                partitioner.mesh, jax.sharding.PartitionSpec()
            ),
        )

    def __call__(self, params: Params, batch: Mapping[str, np.ndarray]) -> Any:
        from jax.experimental import multihost_utils

        from flaxlm.decoding import _global_array

        global_batch = {k: _global_array(v, self._partitioner) for k, v in batch.items()}
        with self._partitioner.context():
            out = self._fn(params, global_batch)
        return jax.tree.map(np.asarray, multihost_utils.process_allgather(out, tiled=True))


def score_examples(
    model: BaseModel,
    params: Params,
    inputs: Sequence[list[int]],
    targets: Sequence[list[int]],
    partitioner: Partitioner,
    *,
    batch_size: int,
    scorer: Scorer | None = None,
) -> list[float]:
    """Summed target log-likelihood of each (input, target) pair, in order."""
    if not isinstance(model, EncoderDecoderModel) and any(not i for i in inputs):
        raise ValueError("A decoder-only model scores a target after at least one input token.")
    scorer = scorer or Scorer(model, partitioner)
    pairs = list(zip(inputs, targets))
    out: list[float] = []
    for _, chunk in _batches(pairs, batch_size):
        padded = chunk + [chunk[0]] * (batch_size - len(chunk))
        batch = score_batch_features(model, [p[0] for p in padded], [p[1] for p in padded])
        out += scorer(params, batch)[: len(chunk)].tolist()
    return out


@gin.configurable
def score(
    *,
    checkpoint: str = gin.REQUIRED,
    source: str = gin.REQUIRED,
    output_dir: str = gin.REQUIRED,
    model: BaseModel | None = None,
    partitioner: Partitioner | None = None,
    vocabulary: seqio.Vocabulary | None = None,
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
    model, params, step = load_model_and_params(checkpoint, partitioner, model, step)
    vocabulary = vocabulary or _checkpoint_vocabulary(checkpoint)
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
    _write_config(out_dir)
    _print(f"Scoring {len(examples)} examples of {name} with step {step} of {checkpoint}.")
    scores = score_examples(
        model,
        params,
        [e.input_ids for e in examples],
        [e.target_ids or [] for e in examples],
        partitioner,
        batch_size=batch_size,
    )
    path = out_dir / f"{name}.jsonl"
    _write_jsonl(
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
    _print(f"Wrote {len(scores)} scores to {path}.")
    return str(path)


# ---------------------------------------------------------------------------- evaluate


class TaskEvaluator:
    """seqio evaluation of one task or mixture: its metric functions over predictions
    (`model.generate`) and scores (`model.score`) of its split. A task without metric
    functions evaluates nothing here (its loss, accuracy and perplexity come from the
    eval steps)."""

    def __init__(
        self,
        cfg: data.DatasetConfig,
        model: BaseModel,
        partitioner: Partitioner,
        settings: GenerationSettings = GenerationSettings(),
        num_examples: int | None = None,
    ):
        data.configure_tensorflow()
        data.import_task_module(cfg.module)
        self.model = model
        self.partitioner = partitioner
        self.settings = settings
        self.batch_size = cfg.batch_size
        self.evaluator = seqio.Evaluator(
            cfg.mixture_or_task_name,
            feature_converter=model.FEATURE_CONVERTER_CLS(pack=False),
            eval_split=cfg.split,
            sequence_length=dict(cfg.task_feature_lengths),
            num_examples=num_examples,
            use_memory_cache=True,
        )
        self._scorer: Scorer | None = None

    @property
    def active(self) -> bool:
        return bool(self.evaluator.eval_tasks)

    def _examples(self, ds: tf.data.Dataset) -> list[tuple[int, dict[str, np.ndarray]]]:
        return [(int(i), ex) for i, ex in ds.as_numpy_iterator()]

    def _prompt(self, ex: Mapping[str, np.ndarray]) -> list[int]:
        if "encoder_input_tokens" in ex:
            return [int(t) for t in ex["encoder_input_tokens"] if t]
        if "decoder_causal_attention" in ex:  # prefix LM: the inputs part of the sequence
            n = int(ex["decoder_causal_attention"].sum()) - 1
            return [int(t) for t in ex["decoder_target_tokens"][:n]]
        raise ValueError(
            "Predict metrics need inputs: the task's examples have neither encoder inputs nor "
            "a prefix (decoder_causal_attention)."
        )

    def predict_fn(self, ds: tf.data.Dataset, model_feature_shapes: Any = None) -> list:
        indexed = self._examples(ds)
        prompts = [self._prompt(ex) for _, ex in indexed]
        outputs = generate_ids(
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
        self._scorer = self._scorer or Scorer(self.model, self.partitioner)
        out = []
        for _, chunk in _batches(indexed, self.batch_size):
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


@gin.configurable
def evaluate(
    *,
    checkpoint: str = gin.REQUIRED,
    dataset_cfg: data.DatasetConfig = gin.REQUIRED,
    output_dir: str = gin.REQUIRED,
    model: BaseModel | None = None,
    partitioner: Partitioner | None = None,
    settings: GenerationSettings = GenerationSettings(),
    num_examples: int | None = None,
    max_batches: int | None = None,
    step: int | None = None,
) -> dict[str, float]:
    """Run function: evaluates a checkpoint on a task or mixture and writes the metrics
    (loss, token accuracy, perplexity over the whole split, plus the task's own metric
    functions, e.g. exact match / BLEU / ROUGE over generated text) to
    `output_dir/metrics.jsonl` and TensorBoard at the checkpoint's step. `num_examples`
    limits the task metrics, `max_batches` the loss/accuracy pass (None: the whole split)."""
    from flaxlm import trainer  # trainer imports this module

    partitioner = partitioner or Partitioner()
    model, params, step = load_model_and_params(checkpoint, partitioner, model, step)
    out_dir = epath.Path(output_dir)
    _write_config(out_dir)
    scalars = trainer.evaluate_split(model, params, partitioner, dataset_cfg, max_batches)
    task_evaluator = TaskEvaluator(dataset_cfg, model, partitioner, settings, num_examples)
    scalars.update(task_evaluator.evaluate(params, step))
    writer = metrics.create_writer(str(out_dir))
    writer.write_scalars(step, scalars)
    writer.close()
    _print(
        f"Evaluated step {step} of {checkpoint} on {dataset_cfg.mixture_or_task_name} "
        f"({dataset_cfg.split}):\n"
        + "\n".join(f"  {k} = {v:.6g}" for k, v in sorted(scalars.items()))
        + f"\nWrote {out_dir / 'metrics.jsonl'} and {out_dir / 'tensorboard'}."
    )
    return scalars
