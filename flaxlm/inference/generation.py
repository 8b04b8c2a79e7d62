"""Generation and scoring under a Partitioner: the service every inference run uses.

`generate` compiles one decoding program per (model, settings, mesh), places the prompts on
the mesh (split over its batch axes when they divide) and hands every process the whole
result; the loops themselves are `decoding.py`'s, over the model's `prefill` / `decode_step`.

    tokens = inference.generate(model, params, {"inputs": prompts}, partitioner=partitioner,
                                max_new_tokens=32)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.inference import guides
from flaxlm.models import decoding
from flaxlm.models.base import BaseModel, DecoderOnlyModel, EncoderDecoderModel
from flaxlm.models.options import MODEL_EOS, eos_tuple
from flaxlm.models.row_start import RowStart
from flaxlm.parallel import pytrees
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import metrics

if TYPE_CHECKING:
    import seqio

Array = jax.Array
Params = Any
Decoder = Callable[[Params, np.ndarray, np.ndarray, Array], np.ndarray]
# Compiled decoders of each model, per (decoding config, partitioner): dropped with the model.
_DECODERS: weakref.WeakKeyDictionary[BaseModel, dict[Any, Decoder]] = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------------------- generate


def prompts_of(batch: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """int32 `(inputs [batch, prompt_len], lengths [batch])` of a generation batch:
    `batch["inputs"]` right-padded with 0, `batch["inputs_lengths"]` (optional) their
    lengths, else each row ends at its last non-zero token."""
    if "inputs" not in batch:
        raise ValueError(
            f"generate needs batch['inputs'] (int [batch, prompt_len], right-padded with "
            f"0); got keys {sorted(batch)}."
        )
    inputs = np.asarray(batch["inputs"]).astype(np.int32)
    if inputs.ndim != 2:
        raise ValueError(f"batch['inputs'] must be [batch, prompt_len], got {inputs.shape}.")
    lengths = batch.get("inputs_lengths")
    if lengths is None:
        nonzero = inputs != 0
        lengths = np.where(nonzero.any(1), inputs.shape[1] - np.argmax(nonzero[:, ::-1], axis=1), 0)
    lengths = np.asarray(lengths).astype(np.int32).reshape(-1)
    if lengths.shape[0] != inputs.shape[0] or (lengths > inputs.shape[1]).any():
        raise ValueError(
            f"inputs_lengths {lengths.tolist()} do not fit inputs of shape {inputs.shape}."
        )
    return inputs, lengths


def decode_tokens(
    model: BaseModel,
    params: Params,
    inputs: Array,
    lengths: Array,
    rng: Array,
    *,
    config: decoding.DecodingConfig,
) -> Array:
    """int32 `[batch, max_new_tokens]`: prefill, then `decoding.decode` over decode steps
    (pure: jit it, or run it under a mesh)."""
    params = model.decoding_params(params)  # once, outside the loop over steps
    first_logits, state = model.prefill(params, inputs, lengths, config)

    def step(token: Array, t: Array, state: Any) -> tuple[Array, Any]:
        return model.decode_step(params, token, t, state, config)

    seen = None
    if config.repetition_penalty != 1.0:  # the prompts' tokens are penalized too
        seen = decoding.seen_tokens(inputs, lengths, first_logits.shape[-1])
    return decoding.decode(first_logits, state, step, config, rng, seen)


def compile_decoder(
    model: BaseModel, config: decoding.DecodingConfig, partitioner: Partitioner | None = None
) -> Decoder:
    """`run(params, inputs, lengths, rng) -> tokens`, jitted; numpy in and out.

    With a Partitioner, it traces under the partitioner's mesh and logical rules (so the
    model's logical constraints shard the cache and activations), takes the params as they
    are sharded, splits the prompts over the batch axes, and hands every process the whole
    result. Every process must pass the same prompts.
    """
    fn = functools.partial(decode_tokens, model, config=config)
    if partitioner is None:
        jitted = jax.jit(fn)

        def run(params: Any, inputs: np.ndarray, lengths: np.ndarray, rng: Array) -> np.ndarray:
            return np.asarray(jitted(params, jnp.asarray(inputs), jnp.asarray(lengths), rng))

        return run

    jitted_sharded = jax.jit(fn, out_shardings=partitioner.replicated())

    def run_sharded(params: Any, inputs: np.ndarray, lengths: np.ndarray, rng: Array) -> np.ndarray:
        placed = [partitioner.global_array(x) for x in (inputs, lengths)]
        with partitioner.context():
            out = jitted_sharded(params, *placed, rng)
        return pytrees.host_array(out)

    return run_sharded


def generate(
    model: BaseModel,
    params: Params,
    batch: Mapping[str, Any],
    *,
    partitioner: Partitioner | None = None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    num_beams: int = 1,
    rng: Array | None = None,
    length_penalty: float = 1.0,
    repetition_penalty: float = 1.0,
    min_new_tokens: int = 0,
    eos_id: int | Sequence[int] | None = MODEL_EOS,
) -> np.ndarray:
    """int32 numpy `[batch, max_new_tokens]`: the tokens generated after each prompt, 0
    after its EOS (which is kept).

    `batch` as `prompts_of` reads it (for an encoder-decoder model, the prompts are the
    encoder's inputs). Rows of different lengths decode as if alone. Greedy when
    `temperature` is 0, else sampled (seeded by `rng`) from the `top_k` / `top_p` set;
    `num_beams > 1` is beam search; `repetition_penalty` as HF's over prompt and new tokens
    (decoder-only models, no beams); no EOS before `min_new_tokens`. `eos_id` overrides the
    model's EOS ids (None: never stop early). With a `partitioner`, the prompts are split
    over its batch axes (when the batch divides) and the whole decoding loop runs as one
    program on its mesh, on every process.
    """
    inputs, lengths = prompts_of(batch)
    config = decoding.DecodingConfig(
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        num_beams=int(num_beams),
        length_penalty=float(length_penalty),
        repetition_penalty=float(repetition_penalty),
        min_new_tokens=int(min_new_tokens),
        eos_ids=model.eos_ids if eos_id == MODEL_EOS else eos_tuple(eos_id),
    )
    if config.repetition_penalty != 1.0 and isinstance(model, EncoderDecoderModel):
        raise ValueError(
            "repetition_penalty is supported for decoder-only models (an encoder-decoder's "
            "decoder prompt is not its inputs)."
        )
    model.check_decoding(inputs, lengths, config)
    decoders = _DECODERS.setdefault(model, {})
    key = (config, partitioner)
    if key not in decoders:
        decoders[key] = compile_decoder(model, config, partitioner)
    rng = jax.random.PRNGKey(0) if rng is None else rng
    return decoders[key](params, inputs, lengths, rng)


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """How a run decodes (see `generate`)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    seed: int = 0
    # (kind, source): every output follows a grammar (`guides.KINDS`; a JSON schema or the
    # choices as JSON text); the paged engine's (infer).
    structured_outputs: tuple[str, str] | None = None

    def __post_init__(self):  # a setting out of range fails where the run is configured
        decoding.DecodingConfig(
            self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.num_beams,
            self.length_penalty, self.repetition_penalty, self.min_new_tokens,
        )  # fmt: skip
        object.__setattr__(self, "structured_outputs", guides.check_spec(self.structured_outputs))


DEFAULT_SETTINGS = GenerationSettings()

# generation_config.json settings that change the tokens transformers' `generate` makes, each
# at the value that changes nothing. flaxlm decodes with the run's settings (GenerationSettings,
# a server request's), not the file's: `unapplied_file_settings` names those a file sets.
FILE_SETTINGS = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "min_p": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "min_new_tokens": None,
    "min_length": 0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "guidance_scale": None,
    "watermarking_config": None,
    "num_beams": 1,
    "length_penalty": 1.0,
    "early_stopping": False,
    "stop_strings": None,
    "num_return_sequences": 1,
}
# Read only where sampling or beams are on (transformers: top_k 50 is its default).
_SAMPLING_ONLY = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
)
_BEAMS_ONLY = ("length_penalty", "early_stopping")


def unapplied_file_settings(
    generation_config: dict[str, Any] | None, applied: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The settings of an HF checkpoint's generation_config.json that change what
    transformers' `generate` makes and that a flaxlm run does not take from the file (all of
    `FILE_SETTINGS` but `applied`, those the run reads from it): for a run to say so."""
    config = generation_config or {}
    # (a run that takes the file's temperature whatever its do_sample, as serve does, samples)
    sampling = bool(config.get("do_sample")) or "do_sample" in applied
    beams = (config.get("num_beams") or 1) > 1
    out = {}
    for key, unset in FILE_SETTINGS.items():
        value = config.get(key, unset)
        if key in applied or value in (unset, None, [], {}) or (key == "top_k" and value == 0):
            continue
        if key in _SAMPLING_ONLY and not sampling:
            continue
        if key in _BEAMS_ONLY and not beams:
            continue
        out[key] = value
    return out


def file_settings_note(
    where: str, generation_config: dict[str, Any] | None, run: str, applied: tuple[str, ...] = ()
) -> None:
    """Prints (process 0) which of generation_config.json's settings `where` (a checkpoint)
    sets that the run (`run`: what it decodes with instead) does not apply."""
    unapplied = unapplied_file_settings(generation_config, applied)
    if unapplied:
        listed = ", ".join(f"{k}={v!r}" for k, v in unapplied.items())
        metrics.print0(
            f"{where}: generation_config.json's {listed} not applied: flaxlm decodes with "
            f"{run} (transformers' generate would take the file's)."
        )


def prompt_ids(
    model: BaseModel,
    vocabulary: seqio.Vocabulary,
    text: str,
    row_start: RowStart,
    *,
    is_target: bool = False,
) -> list[int]:
    """Token ids as the model reads them, as in training: a decoder-only prompt starts with
    what its training rows started with (`row_start.ids`: seqio's start token, or the
    tokenizer's own prefix); encoder inputs and encoder-decoder targets end with EOS (as
    seqio's features do)."""
    ids = list(vocabulary.encode(text))
    if isinstance(model, EncoderDecoderModel):
        return ids + [vocabulary.eos_id]
    if is_target:
        return ids
    return [*row_start.ids(vocabulary), *ids]


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is at least `n`."""
    return -(-n // multiple) * multiple


def chunks(items: Sequence[Any], size: int) -> Iterator[tuple[int, list[Any]]]:
    """`(start, items[start:start + size])` over `items`."""
    for start in range(0, len(items), size):
        yield start, list(items[start : start + size])


def until_eos(tokens: np.ndarray, eos_ids: Sequence[int]) -> list[int]:
    """The tokens before the first EOS."""
    out = []
    for t in tokens.tolist():
        if t in eos_ids:
            break
        out.append(t)
    return out


def _pad_rows(rows: list[list[int]], length: int, batch_size: int) -> np.ndarray:
    """int32 `[batch_size, length]`, right-padded with 0; missing rows repeat the first."""
    out = np.zeros((batch_size, length), np.int32)
    for i in range(batch_size):
        ids = rows[i] if i < len(rows) else rows[0]
        out[i, : len(ids)] = ids[:length]
    return out


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
    Prompts are padded to `input_length` (the longest if None; longer ones are cut: a
    decoder-only prompt keeps its end, an encoder's input its start)."""
    if settings.structured_outputs is not None:
        raise ValueError("STRUCTURED_OUTPUTS: guided through the paged engine (infer), not here.")
    length = input_length or max(len(p) for p in prompts)
    cut = sum(len(p) > length for p in prompts)
    if cut and progress:
        progress(f"{cut} prompt(s) longer than {length} tokens are cut to {length}.")
    keep_end = not isinstance(model, EncoderDecoderModel)
    outputs: list[list[int]] = []
    total_batches = math.ceil(len(prompts) / batch_size)
    start_time = time.perf_counter()
    generated = 0
    for number, (start, chunk) in enumerate(chunks(prompts, batch_size), 1):
        rows = [p[-length:] if keep_end else p[:length] for p in chunk]
        lengths = [len(r) for r in rows] + [len(rows[0])] * (batch_size - len(rows))
        tokens = generate(
            model,
            params,
            {"inputs": _pad_rows(rows, length, batch_size), "inputs_lengths": np.asarray(lengths)},
            partitioner=partitioner,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            num_beams=settings.num_beams,
            rng=jax.random.fold_in(jax.random.PRNGKey(settings.seed), start),
            length_penalty=settings.length_penalty,
            repetition_penalty=settings.repetition_penalty,
            min_new_tokens=settings.min_new_tokens,
        )
        for row in range(len(chunk)):
            ids = until_eos(tokens[row], model.eos_ids)
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
        self._fn = jax.jit(fn or model.score, out_shardings=partitioner.replicated())

    def __call__(self, params: Params, batch: Mapping[str, np.ndarray]) -> Any:
        placed = {k: self._partitioner.global_array(v) for k, v in batch.items()}
        with self._partitioner.context():
            out = self._fn(params, placed)
        return jax.tree.map(pytrees.host_array, out)


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
    for _, chunk in chunks(pairs, batch_size):
        padded = chunk + [chunk[0]] * (batch_size - len(chunk))
        batch = score_batch_features(model, [p[0] for p in padded], [p[1] for p in padded])
        out += scorer(params, batch)[: len(chunk)].tolist()
    return out
