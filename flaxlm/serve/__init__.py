"""An HTTP server for a checkpoint: OpenAI-style completions (streamed as server-sent
events), health and model listing, and a small page at `/` to try it.

One engine thread owns the model (`engine.py`). Requests wait in a queue; the engine takes
the first and every other that arrives within `batch_wait_ms` (up to `max_batch_size`),
decodes them as one batch step by step on the mesh (KV cache, per-row temperature and top-p),
and hands each request its tokens as they come. HTTP threads (`http.py`) only parse
(`api.py`), validate and stream (`stream.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import gin
import seqio
from etils import epath

from flaxlm import run_dir
from flaxlm.models.base import BaseModel
from flaxlm.partitioning import Partitioner
from flaxlm.serve.api import BadRequest, Completion, parse_request
from flaxlm.serve.engine import Engine
from flaxlm.serve.http import Server
from flaxlm.serve.stream import TextStream

__all__ = [
    "BadRequest",
    "Completion",
    "Engine",
    "Server",
    "TextStream",
    "parse_request",
    "serve",
]


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
    ready: Callable[[Server], None] | None = None,
) -> None:
    """Run function: serves `checkpoint` (a flaxlm MODEL_DIR or an HF directory) over HTTP
    until interrupted: POST /v1/completions, GET /health, GET /v1/models, and a page at /.

    Requests that arrive within `batch_wait_ms` of each other decode together (up to
    `max_batch_size` prompts per batch)."""
    partitioner = partitioner or Partitioner()
    model, params, step = run_dir.load_model_and_params(checkpoint, partitioner, step, model)
    vocabulary = vocabulary or run_dir.checkpoint_vocabulary(checkpoint) or seqio.ByteVocabulary()
    engine = Engine(
        model,
        params,
        partitioner,
        vocabulary,
        max_batch_size=max_batch_size,
        batch_wait_ms=batch_wait_ms,
    )
    name = model_name or epath.Path(checkpoint).name
    server = Server(engine, name, host=host, port=port, max_tokens_limit=max_tokens_limit)
    print(
        f"Serving {name} (step {step}, {type(model.config).__name__}) on {server.address} "
        f"with batches of up to {max_batch_size}; open {server.address}/ to try it.",
        flush=True,
    )
    if ready is not None:
        ready(server)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("Stopped.", flush=True)
    finally:
        server.httpd.server_close()
