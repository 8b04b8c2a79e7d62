"""An HTTP server for a checkpoint: OpenAI's completions and chat completions (streamed as
server-sent events), health and model listing, and a small page at `/` to try it.

One engine thread owns the model (`engine.py`). Requests wait in a queue; the engine takes
the first and every other that arrives within `batch_wait_ms` (up to `max_batch_size`),
decodes them as one batch step by step on the mesh (KV cache, per-row temperature and top-p),
and hands each request its tokens as they come. HTTP threads (`http.py`) only parse
(`api.py`), validate and stream (`stream.py`). LoRA adapters (`adapters.py`) are served
beside the base, a request's `model` picking one.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import gin
from etils import epath

from flaxlm.checkpoints import run_dir
from flaxlm.data import vocabularies
from flaxlm.inference import generation
from flaxlm.models import gpt_oss
from flaxlm.models.base import BaseModel
from flaxlm.models.paged_attention import check_paged_attention
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs import checks
from flaxlm.runs.serve import reasoning, tools
from flaxlm.runs.serve.adapters import load_adapters
from flaxlm.runs.serve.engine import Engine
from flaxlm.runs.serve.http import Server
from flaxlm.runs.serve.responses import KEPT
from flaxlm.runs.serve.sockets import listen

if TYPE_CHECKING:  # (serving loads neither seqio nor TensorFlow)
    import seqio


@gin.configurable
def serve(
    *,
    checkpoint: str = gin.REQUIRED,
    host: str = "127.0.0.1",
    port: int = 8000,
    model: BaseModel | None = None,
    partitioner: Partitioner | None = None,
    vocabulary: seqio.Vocabulary | None = None,
    model_name: str | None = None,
    max_batch_size: int = 8,
    batch_wait_ms: float = 10.0,
    max_tokens_limit: int = 512,
    step: int | None = None,
    lora_adapters: Mapping[str, str] | None = None,
    dtype: str = "auto",
    paged_attention: str = "gather",
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    responses_kept: int = KEPT,
    max_model_len: int | None = None,
    decode_steps: int | None = None,
    prefill_rows: int | None = None,
    prefill_chunk: int | None = None,
    page_size: int | None = None,
    num_pages: int | None = None,
    ready: Callable[[Server], None] | None = None,
) -> None:
    """Run function: serves `checkpoint` (a flaxlm MODEL_DIR or an HF directory) over HTTP
    until SIGINT (Ctrl-C) or SIGTERM: POST /v1/chat/completions (messages rendered with the
    checkpoint's chat template), POST /v1/completions, POST /v1/responses (OpenAI's
    Responses API: `responses.py`), GET /health, GET /v1/models, and a page at /. Sampling
    settings a request leaves unset come from the checkpoint's generation_config.json.

    Requests that arrive within `batch_wait_ms` of each other decode together (up to
    `max_batch_size` prompts per batch). The port is taken before the model loads (a port in
    use fails at once); on a signal, decodes in flight are cancelled after their current
    step, their requests answered, and the function returns.

    `lora_adapters` (`{'name': '/path', ...}`: flaxlm LoRA run directories or PEFT adapter
    directories trained over this base) are served beside it: GET /v1/models lists them, a
    request's `model` picks one (the base by its own name), and one batch mixes rows of
    different adapters and of the base (vLLM's `--lora-modules name=path`).

    `dtype`: how an HF directory's model is held and computes, 'auto' (the checkpoint's own
    dtype, as transformers and vLLM load it: bfloat16 for a bfloat16 checkpoint), 'float32',
    'bfloat16' or 'float16'; a MODEL_DIR computes as its run trained.

    `paged_attention`: how a decode step's attention reads the paged KV cache, 'gather'
    (each row's pages copied out, every platform) or 'pallas' (JAX's Pallas kernel reads
    them in place on an NVIDIA GPU; `flaxlm.models.paged_attention`).

    `tool_call_parser`: how a chat answer's tool calls are read when a request offers `tools`
    (the format of the model's family, named as vLLM's `--tool-call-parser` with
    `--enable-auto-tool-choice`: `tools.PARSERS`, e.g. 'hermes' for Qwen3); None: such
    requests are refused unless their `tool_choice` is 'none'.

    `reasoning_parser`: how a chat answer's thinking block is returned apart from its
    content, as the message's `reasoning` (named as vLLM's `--reasoning-parser`:
    `reasoning.PARSERS`, e.g. 'qwen3'); None: all of the answer is content, except that a
    gpt-oss checkpoint's harmony answers are read as such ('openai_gptoss', as vLLM).

    `responses_kept`: how many stored responses (/v1/responses with `store`, OpenAI's
    default) the server keeps in memory for `previous_response_id` and GET; the oldest go
    first (0: none is kept).

    `max_model_len` (vLLM's `--max-model-len`): the longest prompt plus completion served,
    a request beyond it a 400 naming it; None: the model's positions, at most 2048 (the
    paged engine holds that many slots per sequence unless told more).

    The paged engine's tuning (None: its defaults; a model that cannot page refuses them):
    `decode_steps` (tokens a running sequence generates per dispatch, 8), `prefill_rows`
    and `prefill_chunk` (each prefill dispatch reads up to this many prompts, 2, of this
    many tokens each, 64), `page_size` (KV-cache slots per page, 16: vLLM's `--block-size`),
    `num_pages` (pages of the pool; default: `max_batch_size` sequences of `max_model_len`:
    vLLM's `--num-gpu-blocks-override`)."""
    tuning = {
        "DECODE_STEPS": decode_steps,
        "PREFILL_ROWS": prefill_rows,
        "PREFILL_CHUNK": prefill_chunk,
        "PAGE_SIZE": page_size,
        "NUM_PAGES": num_pages,
    }
    checks.check_counts(
        RESPONSES_KEPT=(responses_kept, 0),
        **{k: (v, 2 if k == "NUM_PAGES" else 1) for k, v in tuning.items() if v is not None},
        **({} if max_model_len is None else {"MAX_MODEL_LEN": (max_model_len, 2)}),
    )
    check_paged_attention(paged_attention, "serve.paged_attention")
    tools.check_parser(tool_call_parser, reasoning_parser, final=False)
    reasoning.check_parser(reasoning_parser)
    httpd = listen(host, port)
    try:
        partitioner = partitioner or Partitioner()
        model, params, step, row_start = run_dir.load_model_and_params(
            checkpoint, partitioner, step, model, dtype=dtype
        )
        reasoning_parser = reasoning_parser_for(model.config, reasoning_parser)
        refusal, given = model.paged_refusal(), [k for k, v in tuning.items() if v is not None]
        if refusal is not None and given:
            raise ValueError(
                f"{', '.join(given)} tune the paged engine, which this model does not use "
                f"({refusal}); leave them unset."
            )
        tools.check_parser(tool_call_parser, reasoning_parser)
        name = model_name or epath.Path(checkpoint).name
        params, adapters = load_adapters(lora_adapters, model, params, partitioner, name)
        vocabulary = (
            vocabulary or run_dir.checkpoint_vocabulary(checkpoint) or vocabularies.ByteVocabulary()
        )
        engine = Engine(
            model,
            params,
            partitioner,
            vocabulary,
            max_batch_size=max_batch_size,
            batch_wait_ms=batch_wait_ms,
            adapters=adapters,
            paged_attention=paged_attention,
            max_seq_len=max_model_len,
            **{k.lower(): v for k, v in tuning.items() if v is not None},
        )
        server = Server(
            engine,
            name,
            httpd,
            row_start=row_start,
            max_tokens_limit=max_tokens_limit,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            responses_kept=responses_kept,
            max_model_len=max_model_len,
        )
        generation.file_settings_note(
            checkpoint,
            model.generation_config,
            "a request's settings (temperature, top_p, top_k, min_p, repetition_penalty and "
            "max_tokens the file's where a request leaves them unset, as vLLM reads them)",
            applied=("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty"),
        )
        with signals_awaited((signal.SIGINT, signal.SIGTERM)) as next_signal:
            server.start()
            try:
                print(
                    f"Serving {name} (step {step}, {type(model.config).__name__}) on "
                    f"{server.address} with batches of up to {max_batch_size}"
                    + (f" and LoRA adapters {list(adapters)}" if adapters else "")
                    + f"; open {server.address}/ to try it.",
                    flush=True,
                )
                if ready is not None:
                    ready(server)
                print(f"{next_signal().name}: stopping.", flush=True)
            finally:
                server.stop()
        print("Stopped.", flush=True)
    finally:
        httpd.server_close()


def reasoning_parser_for(config: object, chosen: str | None) -> str | None:
    """The reasoning parser a server uses: the one chosen, else the one vLLM picks by itself
    for the model's family (gpt-oss's answers are harmony: `openai_gptoss`)."""
    if chosen is None and isinstance(config, gpt_oss.GptOssConfig):
        return "openai_gptoss"
    return chosen


@contextlib.contextmanager
def signals_awaited(
    signals: Sequence[signal.Signals],
) -> Iterator[Callable[[], signal.Signals]]:
    """Within, `signals` no longer interrupt the main thread: the function it yields blocks
    until one arrives (or has arrived since entering), puts the handlers before back (a
    second Ctrl-C interrupts as usual) and returns the signal.

    Python's C-level handler writes the signal's number to the wakeup fd, read here; the
    Python-level handler does nothing, so it cannot break into the main thread inside a lock
    or a half-done call, and a signal taken by another thread still wakes this one."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = {s: signal.signal(s, _ignore) for s in signals}
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def restore() -> None:
        if previous:
            signal.set_wakeup_fd(previous_fd)
            for s, handler in previous.items():
                signal.signal(s, handler)
            previous.clear()

    def next_signal() -> signal.Signals:
        while True:
            number = reader.recv(1)[0]
            if number in signals:
                restore()
                return signal.Signals(number)

    try:
        yield next_signal
    finally:
        restore()
        reader.close()
        writer.close()


def _ignore(signum: int, frame: types.FrameType | None) -> None:
    del signum, frame  # the wakeup fd carries the signal to signals_awaited
