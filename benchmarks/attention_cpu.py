"""One layer's causal self-attention on CPU: flaxlm's implementations against torch's.

Times `flaxlm.models.attention.dot_product_attention` ('xla', 'jax', 'chunked') and the same
attention written in torch einsums (scores, softmax, probabilities @ values: what HF's eager
GPT-J computes), forward alone and forward + backward of `sum(out ** 2)`, on device-resident
float32 inputs of the gptj shape of train_step.py (batch 16, length 256, 4 heads of 64).
The step-time gap of train_step.py's gptj shape is here (benchmarks/RESULTS.md).

    python benchmarks/attention_cpu.py
    python benchmarks/attention_cpu.py --length 1024 --batch 4
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import bench_common  # noqa: F401  (a sibling script; puts the repository on sys.path)
import numpy as np


def seconds_per_call(fn: Callable[[], Any], calls: int, block: Callable[[Any], Any]) -> float:
    block(fn())  # compiles (JAX) or warms up (torch)
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    block(out)
    return (time.perf_counter() - start) / calls


def flaxlm_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, args: argparse.Namespace) -> list:
    import jax
    import jax.numpy as jnp

    from flaxlm.models.attention import dot_product_attention
    from flaxlm.models.masks import causal_mask

    q, k, v = map(jnp.asarray, (q, k, v))
    mask = causal_mask(None, q.shape[0], q.shape[1])
    rows = []
    for implementation in ("xla", "jax", "chunked"):

        def attention(q, k, v, implementation=implementation):
            return dot_product_attention(
                q, k, v, mask, implementation=implementation, chunk_size=args.chunk_size
            )

        forward = jax.jit(attention)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(attention(*a) ** 2), argnums=(0, 1, 2)))
        rows.append(
            {
                "side": f"flaxlm '{implementation}'",
                "forward_ms": 1e3
                * seconds_per_call(partial(forward, q, k, v), args.calls, jax.block_until_ready),
                "forward_backward_ms": 1e3
                * seconds_per_call(partial(grads, q, k, v), args.calls, jax.block_until_ready),
            }
        )
    return rows


def torch_row(q: np.ndarray, k: np.ndarray, v: np.ndarray, args: argparse.Namespace) -> dict:
    import torch

    length = q.shape[1]
    hidden = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    q, k, v = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))

    def attention() -> torch.Tensor:
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(hidden, torch.finfo(torch.float32).min)
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v)

    def backward() -> None:
        q.grad = k.grad = v.grad = None
        (attention() ** 2).sum().backward()

    with torch.no_grad():
        forward = seconds_per_call(attention, args.calls, lambda _: None)
    both = seconds_per_call(backward, args.calls, lambda _: None)
    return {
        "side": f"torch einsum ({torch.get_num_threads()} threads)",
        "forward_ms": 1e3 * forward,
        "forward_backward_ms": 1e3 * both,
    }


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=128, help="'chunked''s block")
    p.add_argument("--calls", type=int, default=20, help="timed calls per row")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    shape = (args.batch, args.length, args.heads, args.head_dim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    rows = [*flaxlm_rows(q, k, v, args), torch_row(q, k, v, args)]
    print(f"\nB{args.batch} L{args.length} {args.heads}x{args.head_dim}, causal, float32\n")
    bench_common.print_table(
        ["side", "forward ms", "forward + backward ms"],
        [[r["side"], f"{r['forward_ms']:.1f}", f"{r['forward_backward_ms']:.1f}"] for r in rows],
    )
    return rows


if __name__ == "__main__":
    main()
