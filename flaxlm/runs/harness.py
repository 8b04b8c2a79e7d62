"""lm-evaluation-harness on a flaxlm or HuggingFace checkpoint: the `flaxlm` model of
lm-eval (`loglikelihood`, `loglikelihood_rolling`, `generate_until`), computed directly on
the model and sharded by a Partitioner (no HTTP hop).

    python -m flaxlm.runs.harness --model flaxlm --tasks hellaswag --batch_size 8 \\
      --model_args checkpoint=/tmp/flaxlm_gptj,gin_file=partitioning/fsdp.gin

`python -m flaxlm.runs.harness` takes lm-eval's own arguments and runs lm-eval's CLI with this
model registered: lm-eval 0.4.13 finds models only in its built-in table or among classes
already imported into its registry (it reads no plugin entry points), so the bare `lm_eval`
command cannot know `flaxlm`. In Python, importing this module registers it:
`lm_eval.simple_evaluate(model="flaxlm", model_args={...}, ...)`.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
import seqio

try:
    from lm_eval import utils as lm_eval_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "flaxlm.runs.harness needs lm-evaluation-harness: pip install 'flaxlm[lm_eval]' "
        "(lm_eval==0.4.13)."
    ) from e

from flaxlm import gin_utils
from flaxlm.checkpoints import run_dir
from flaxlm.data import vocabularies
from flaxlm.inference import generation
from flaxlm.models import losses
from flaxlm.models.base import BaseModel, EncoderDecoderModel
from flaxlm.parallel.partitioning import Partitioner

Params = Any
logger = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 2048  # for models whose positions have no limit (T5's relative ones)
_GENERATION_KEYS = {
    "until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
}  # fmt: skip


def _split_list(value: str | Sequence[str] | None, separator: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(separator) if v.strip()]
    return list(value)


def score_and_greedy(
    model: BaseModel, params: Params, batch: dict[str, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """float32 `[batch]` summed target log-likelihood (as `model.score`) and bool `[batch]`:
    whether every target token is the model's argmax."""
    logits = model.compute_logits(params, batch)
    targets, weights = model.targets_and_weights(batch)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    target = losses.select_tokens(log_probs, targets)
    scores = jnp.sum(target * weights.astype(jnp.float32), axis=-1)
    greedy = jnp.all((jnp.argmax(logits, axis=-1) == targets) | (weights == 0), axis=-1)
    return scores, greedy


def _pad_length(batch: dict[str, np.ndarray], bucket: int, limit: int) -> dict[str, np.ndarray]:
    """Right-pads every `[rows, length]` feature with 0 to a multiple of `bucket` (at most
    `limit` unless already longer), so that few shapes compile; padding has weight 0."""
    out = {}
    for key, x in batch.items():
        length = x.shape[1]
        target = max(length, min(generation.round_up(length, bucket), limit))
        out[key] = np.pad(x, ((0, 0), (0, target - length)))
    return out


@register_model("flaxlm")
class FlaxLM(TemplateLM):
    """A flaxlm model (from a MODEL_DIR or an HF directory) for lm-eval.

    model_args (`--model_args key=value,...`, or a JSON object):
      checkpoint: a flaxlm MODEL_DIR (latest step, or `step=`) or a HuggingFace directory.
      gin_file: Gin file(s) parsed first, separated by `+` (e.g. `partitioning/fsdp_tp.gin`
        for the mesh; a file that binds `MODEL` overrides the checkpoint's recorded model).
      gin_bindings: extra bindings, separated by `;` (e.g. `Partitioner.mesh_shape=(1,-1,2)`
        in a JSON `--model_args`, since lm-eval splits plain model_args on commas).
      tokenizer: an HF tokenizer directory; default the HF checkpoint's own tokenizer, else
        seqio's ByteVocabulary (flaxlm's default runs).
      max_length: the longest sequence scored or prompted; default the model's positions.
        Longer contexts lose their beginning (as lm-eval's HF model does).
      max_gen_toks: default generation length (a task's `max_gen_toks` wins).
      add_bos_token: start every context as the model's training rows started (default True:
        an HF checkpoint's tokenizer's own BOS, nothing where it adds none; 0, the decoder
        start, for a seqio-trained flaxlm model).
      length_bucket: lengths are padded to a multiple of this (fewer compiles).
      dtype: an HF checkpoint's compute and param dtype, 'auto' its own (lm-eval's HF model's
        default too), 'float32', 'bfloat16' or 'float16'; a MODEL_DIR computes as it trained.
    `--batch_size N` is rounded up to a multiple of the mesh's data-parallel degree.
    """

    def __init__(
        self,
        checkpoint: str,
        gin_file: str | Sequence[str] | None = None,
        gin_bindings: str | Sequence[str] | None = None,
        tokenizer: str | None = None,
        batch_size: int | str | None = 8,
        max_batch_size: int | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool = True,
        prefix_token_id: int | None = None,
        length_bucket: int = 64,
        step: int | None = None,
        dtype: str = "auto",
        device: str | None = None,
        **unknown: Any,
    ):
        super().__init__()
        if unknown:
            raise ValueError(
                f"Unknown flaxlm model_args {sorted(unknown)}; supported: checkpoint, gin_file, "
                "gin_bindings, tokenizer, max_length, max_gen_toks, add_bos_token, "
                "prefix_token_id, length_bucket, step, dtype (and --batch_size)."
            )
        del device  # the Partitioner's mesh decides placement
        gin_model = _parse_gin(_split_list(gin_file, "+"), _split_list(gin_bindings, ";"))
        self.partitioner = Partitioner()
        self.model, self.params, self.step, self.row_start = run_dir.load_model_and_params(
            str(checkpoint), self.partitioner, step, gin_model, dtype=dtype
        )
        self.vocabulary = _vocabulary(str(checkpoint), tokenizer)
        self.backend = "seq2seq" if isinstance(self.model, EncoderDecoderModel) else "causal"
        self.checkpoint = str(checkpoint)
        self.batch_size = self._batch_size(batch_size, max_batch_size)
        limit = self.model.position_limit()
        self.max_length = int(max_length or limit or DEFAULT_MAX_LENGTH)
        if limit is not None and self.max_length > limit:
            raise ValueError(
                f"max_length={self.max_length} exceeds the model's positions ({limit})."
            )
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = bool(add_bos_token)
        self._prefix_token_id = prefix_token_id
        self.length_bucket = int(length_bucket)
        self._scorer = generation.Scorer(
            self.model,
            self.partitioner,
            fn=lambda params, batch: score_and_greedy(self.model, params, batch),
        )

    def _batch_size(self, batch_size: int | str | None, max_batch_size: int | None) -> int:
        if batch_size is None or str(batch_size).startswith("auto"):
            size = max_batch_size or 8
        else:
            try:
                size = int(batch_size)
            except ValueError:
                raise ValueError(
                    f"batch_size must be an integer or 'auto', got {batch_size!r}."
                ) from None
        if size < 1:
            raise ValueError(f"batch_size must be at least 1, got {size}.")
        return generation.round_up(size, self.partitioner.data_parallel_degree())

    # ------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        return int(self.vocabulary.eos_id)

    @property
    def prefix_token_id(self) -> int:
        if self._prefix_token_id is not None:
            return int(self._prefix_token_id)
        start = self._start_ids()
        # An HF tokenizer that adds no BOS: an empty context starts with EOS (as lm-eval's).
        return start[0] if start else self.eot_token_id

    def _start_ids(self) -> list[int]:
        """What the model's training rows started with (the checkpoint's row start), or the
        `prefix_token_id` given."""
        if self._prefix_token_id is not None:
            return [int(self._prefix_token_id)]
        return list(self.row_start.ids(self.vocabulary))

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.vocabulary, "path", type(self.vocabulary).__name__))

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **_: Any
    ) -> list[int]:
        """Token ids of `string`. Decoder-only: after `prefix_token_id` when
        `add_special_tokens` (None: `add_bos_token`); encoder-decoder: EOS-terminated
        unless `add_special_tokens` is False (as seqio's inputs)."""
        ids = [int(i) for i in self.vocabulary.encode(string)]
        if self.backend == "seq2seq":
            return ids + [self.eot_token_id] if add_special_tokens is not False else ids
        add = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return [*self._start_ids(), *ids] if add else ids

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.vocabulary.decode([int(i) for i in ids])

    # ------------------------------------------------------------------ scoring

    def _fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """`(inputs, targets)` within max_length: the context loses its beginning."""
        if len(continuation) > self.max_length or not continuation:
            raise ValueError(
                f"A continuation of {len(continuation)} tokens cannot be scored: it must have "
                f"1 to max_length={self.max_length} tokens."
            )
        if self.backend == "seq2seq":
            return context[-self.max_length :], continuation
        room = self.max_length + 1 - len(continuation)  # inputs are the sequence minus one
        return context[-room:] if room > 0 else context[-1:], continuation

    def score_tokens(
        self, pairs: Sequence[tuple[list[int], list[int]]], disable_tqdm: bool = True
    ) -> list[tuple[float, bool]]:
        """`(log-likelihood of continuation given context, is greedy)` per token pair, in
        order; batched longest first."""
        fitted = [self._fit(list(c), list(t)) for c, t in pairs]
        order = sorted(range(len(fitted)), key=lambda i: -sum(map(len, fitted[i])))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(fitted)
        for start in _progress(range(0, len(order), self.batch_size), disable_tqdm, "scoring"):
            rows = order[start : start + self.batch_size]
            padded = rows + [rows[0]] * (self.batch_size - len(rows))
            batch = generation.score_batch_features(
                self.model, [fitted[i][0] for i in padded], [fitted[i][1] for i in padded]
            )
            batch = _pad_length(batch, self.length_bucket, self.max_length)
            scores, greedy = self._scorer(self.params, batch)
            for row, index in enumerate(rows):
                results[index] = (float(scores[row]), bool(greedy[row]))
        return results

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str], list[int], list[int]]],
        disable_tqdm: bool = False,
        **_: Any,
    ) -> list[tuple[float, bool]]:
        results = self.score_tokens([(c, t) for _, c, t in requests], disable_tqdm)
        for (key, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood after `prefix_token_id`, in max_length windows that
        each score new tokens only (lm-eval's rolling windows, context of 1 token)."""
        if self.backend == "seq2seq":
            raise TypeError("loglikelihood_rolling needs a decoder-only model.")
        windows: list[tuple[list[int], list[int]]] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            tokens = self.tok_encode(text, add_special_tokens=False)
            for window in map(
                lm_eval_utils.make_disjoint_window,
                lm_eval_utils.get_rolling_token_windows(
                    tokens, self.prefix_token_id, self.max_length, context_len=1
                ),
            ):
                windows.append(window)
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(owners, self.score_tokens(windows, disable_tqdm)):
            totals[owner] += score
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------------ generation

    def _settings(self, gen_kwargs: dict[str, Any]) -> tuple[generation.GenerationSettings, list]:
        unknown = set(gen_kwargs) - _GENERATION_KEYS
        if unknown:
            logger.warning("flaxlm ignores generation arguments %s.", sorted(unknown))
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        # As lm-eval's HF model: do_sample=False is greedy whatever the temperature;
        # do_sample=True without a temperature samples at 1.
        sample = gen_kwargs.get("do_sample")
        temperature = float(gen_kwargs.get("temperature", 1.0 if sample else 0.0))
        max_new_tokens = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
        if max_new_tokens < 1:
            raise ValueError(f"max_gen_toks must be at least 1, got {max_new_tokens}.")
        settings = generation.GenerationSettings(
            max_new_tokens=max_new_tokens,
            temperature=0.0 if sample is False else temperature,
            top_k=int(gen_kwargs.get("top_k") or 0),
            top_p=float(gen_kwargs.get("top_p") or 1.0),
            repetition_penalty=float(gen_kwargs.get("repetition_penalty") or 1.0),
        )
        if self.backend == "causal" and settings.max_new_tokens >= self.max_length:
            raise ValueError(
                f"max_gen_toks={settings.max_new_tokens} leaves no room for a prompt within "
                f"max_length={self.max_length}."
            )
        return settings, until

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with `do_sample`) continuations of each context, cut before
        the first `until` string; contexts lose their beginning to fit max_length."""
        results: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            key = json.dumps(request.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(index)
        for indices in groups.values():
            settings, until = self._settings(dict(requests[indices[0]].args[1]))
            room = self.max_length
            if self.backend == "causal":
                room -= settings.max_new_tokens
            prompts = {i: self.tok_encode(requests[i].args[0])[-room:] for i in indices}
            order = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in _progress(
                range(0, len(order), self.batch_size), disable_tqdm, "generating"
            ):
                rows = order[start : start + self.batch_size]
                longest = max(len(prompts[i]) for i in rows)
                outputs = generation.generate_ids(
                    self.model,
                    self.params,
                    [prompts[i] for i in rows],
                    self.partitioner,
                    settings,
                    batch_size=self.batch_size,
                    input_length=min(generation.round_up(longest, self.length_bucket), room),
                )
                for index, ids in zip(rows, outputs):
                    text = cut_at_stops(self.tok_decode(ids), until)
                    results[index] = text
                    self.cache_hook.add_partial("generate_until", requests[index].args, text)
        return results

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_name": self.checkpoint,
            "model_step": self.step,
            "model_class": type(self.model.config).__name__,
            "mesh_shape": dict(self.partitioner.mesh.shape),
        }


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """`text` up to (not including) the earliest of the stop strings."""
    cut = len(text)
    for stop in stops:
        if stop:
            found = text.find(stop)
            if found != -1:
                cut = min(cut, found)
    return text[:cut]


def _progress(items: range, disable: bool, what: str) -> Iterator[int]:
    if disable or jax.process_index() != 0:
        return iter(items)
    from tqdm import tqdm

    return iter(tqdm(items, desc=f"flaxlm {what} (batches)"))


def _parse_gin(files: list[str], bindings: list[str]) -> BaseModel | None:
    """Parses the Gin files and bindings; the `MODEL` they bind, if any."""
    if not files and not bindings:
        return None
    try:
        gin_utils.parse_gin(files, bindings, finalize=False)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - any Gin mistake names itself
        raise ValueError(f"bad Gin configuration: {gin_utils.with_suggestion(str(e))}") from e
    try:
        reference = gin.query_parameter("%MODEL")
    except ValueError:
        return None
    return reference.scoped_configurable_fn() if reference is not None else None


def _vocabulary(checkpoint: str, tokenizer: str | None) -> seqio.Vocabulary:
    if tokenizer:
        return vocabularies.HuggingFaceVocabulary(tokenizer)
    return run_dir.checkpoint_vocabulary(checkpoint) or seqio.ByteVocabulary()


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line (same arguments) with the `flaxlm` model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
