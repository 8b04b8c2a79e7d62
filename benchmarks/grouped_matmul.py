"""The dropless experts' grouped matmul on a GPU (`flaxlm/models/grouped_matmul.py`): JAX's
Mosaic GPU kernels ('mosaic_gpu') checked against `jax.lax.ragged_dot`, then timed at a
Qwen3-30B-A3B MoE layer's shapes.

1. **Equal**: a small bfloat16 problem with an empty group and rows past the groups (as
   under expert parallelism): the forward, the rows' and the weights' gradients of
   `ragged_dot(impl='mosaic_gpu')` against XLA's `ragged_dot` on the same bfloat16 values
   in float32; the largest difference over the reference's largest value, and a pass at
   2**-6 (bfloat16 keeps 8 bits; the sums are a few hundred terms).
2. **Speed**: rows = batch x length x k (16 x 2048 x 8 = 262,144 assignments), 128 experts
   of the model's widths (embed 2048, expert mlp 768), routed at random: the gate+up
   product `[rows, 2048] x [128, 2048, 1536]` and the down product `[rows, 768] x [128, 768,
   2048]`, each kernel (forward, rows' gradient, weights' gradient) on its own, in TFLOP/s
   of the grouped FLOPs (2 x rows x k x n), the forward beside one dense matmul of the same
   FLOPs. With `--tune S`, other tiles first (`CANDIDATES`, at most S seconds), the fastest
   kept and written in the JSON's `tiles`.

    python benchmarks/grouped_matmul.py [--json FILE] [--rows 262144] [--tune 90]

Needs an NVIDIA Hopper GPU (H100, H200); elsewhere it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.models import grouped_matmul


def _bench(fn, *args, repeats: int = 5) -> float:
    """Median seconds of `fn(*args)` after a warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _sizes(key: jax.Array, rows: int, groups: int, empty: int = 0) -> jax.Array:
    """Random group sizes summing to `rows`, the group `empty` (if > 0) left empty."""
    ids = jax.random.randint(key, (rows,), 0, groups)
    if empty:
        ids = jnp.where(ids == empty, 0, ids)
    return jnp.bincount(ids, length=groups).astype(jnp.int32)


def check(tolerance: float = 2.0**-6) -> dict:
    """Part 1: the kernels' forward and gradients against XLA's."""
    m, k, n, g = 1000, 256, 384, 8
    kx, kw, ks, kt = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (g, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    sizes = _sizes(ks, 900, g, empty=3)  # 100 rows past the groups, group 3 empty
    t = jax.random.normal(kt, (m, n), jnp.float32)

    def loss(impl: str, x: jax.Array, w: jax.Array) -> jax.Array:
        y = grouped_matmul.ragged_dot(x, w, sizes, impl=impl)
        return jnp.sum(y.astype(jnp.float32) * t), y

    out = {}
    got = jax.jit(jax.grad(lambda x, w: loss("mosaic_gpu", x, w), (0, 1), has_aux=True))(x, w)
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    want = jax.jit(jax.grad(lambda x, w: loss("xla", x, w), (0, 1), has_aux=True))(x32, w32)
    (gx, gw), y = got
    (wx, ww), wy = want
    for name, a, b in (("forward", y, wy), ("rows_grad", gx, wx), ("weights_grad", gw, ww)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
        out[name] = {"relative_max_error": err, "pass": bool(err < tolerance)}
    out["rows_past_zero"] = bool(np.all(np.asarray(y)[900:] == 0))
    out["empty_group_grad_zero"] = bool(np.all(np.asarray(gw)[3] == 0))
    out["pass"] = all(v["pass"] for v in out.values() if isinstance(v, dict)) and (
        out["rows_past_zero"] and out["empty_group_grad_zero"]
    )
    return out


def _problems(rows: int, embed: int, mlp: int, groups: int) -> list[tuple]:
    """The six grouped products of one MoE layer's step, as (name, kernel, operands,
    FLOPs): gate+up and down, each forward, rows' gradient and weights' gradient."""
    key = jax.random.key(1)
    sizes = _sizes(key, rows, groups)
    problems = []
    for name, k, n in (("gate+up", embed, 2 * mlp), ("down", mlp, embed)):
        kx, kw, kd = jax.random.split(jax.random.fold_in(key, k), 3)
        x = jax.random.normal(kx, (rows, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (groups, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
        dy = jax.random.normal(kd, (rows, n), jnp.bfloat16)
        flops = 2.0 * rows * k * n
        problems += [
            (f"{name} forward", "forward", (x, w, sizes), flops),
            (f"{name} rows_grad", "rows_grad", (dy, w, sizes), flops),
            (f"{name} weights_grad", "weights_grad", (x, dy, sizes), flops),
        ]
    return problems


def _time_kernel(kernel: str, args: tuple) -> float:
    """Median seconds of one of the Mosaic GPU kernels (`grouped_matmul.TILES` as they are
    now: a fresh jit, so a change of tiles recompiles)."""
    kernels = grouped_matmul.mosaic_gpu_kernels()
    return _bench(jax.jit(lambda *a: getattr(kernels, kernel)(*a)), *args)


def speed(problems: list[tuple]) -> list[dict]:
    """Part 2: each product's time and TFLOP/s, beside one dense matmul of its FLOPs."""
    results = []
    for name, kernel, args, flops in problems:
        row: dict = {"product": name, "shapes": [list(a.shape) for a in args[:2]]}
        try:
            s = _time_kernel(kernel, args)
            row.update(ms=round(s * 1e3, 3), tflops=round(flops / s / 1e12, 1))
        except Exception as e:  # noqa: BLE001 - a kernel that fails is a result here
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if kernel == "forward":
            x, w = args[0], args[1][0]
            s = _bench(jax.jit(jnp.matmul), x, w)
            row["dense_matmul"] = {"ms": round(s * 1e3, 3), "tflops": round(flops / s / 1e12, 1)}
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


CANDIDATES = {
    "ragged": [
        dict(block_m=m, block_n=128, block_k=64, max_concurrent_steps=c, grid_block_n=g)
        for m in (128, 64)
        for c in (4, 2, 6)
        for g in (1, 2, 4)
    ],
    "transposed": [
        dict(block_m=m, block_n=n, block_k=k, max_concurrent_steps=c, grid_block_n=1)
        for m, n in ((128, 128), (64, 128), (128, 64))
        for k in (64, 128)
        for c in (4, 2)
    ],
}


def tune(problems: list[tuple], seconds: float) -> dict:
    """`grouped_matmul.TILES` candidates per kernel, timed over that kernel's products of
    the layer (summed), within `seconds` in all; leaves the fastest of each in TILES."""
    start, chosen = time.monotonic(), {}
    # Each family its share of the time: the ragged kernel runs four of the six products.
    for family, kernels, share in (
        ("ragged", ("forward", "rows_grad"), 2 / 3),
        ("transposed", ("weights_grad",), 1.0),
    ):
        deadline = start + share * seconds
        default = dict(grouped_matmul.TILES[family])
        best, best_s, tried = default, float("inf"), []
        for tiles in [default] + [t for t in CANDIDATES[family] if t != default]:
            if time.monotonic() > deadline - 5:
                break
            grouped_matmul.TILES[family] = tiles
            try:
                s = sum(_time_kernel(k, a) for _, k, a, _ in problems if k in kernels)
            except Exception as e:  # noqa: BLE001 - e.g. past the shared memory
                tried.append({"tiles": tiles, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            tried.append({"tiles": tiles, "ms": round(s * 1e3, 3)})
            print(family, json.dumps(tried[-1]), flush=True)
            if s < best_s:
                best, best_s = tiles, s
        grouped_matmul.TILES[family] = best
        ms = round(best_s * 1e3, 3) if best_s < float("inf") else None
        chosen[family] = {"tiles": best, "ms": ms, "tried": tried}
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rows", type=int, default=16 * 2048 * 8)
    parser.add_argument(
        "--tune",
        type=float,
        metavar="SECONDS",
        help="first try other tiles for the kernels for at most this long, keep the fastest, "
        "and write them in the JSON's 'tiles' (accelerator.py --grouped-matmul-tiles reads it)",
    )
    args = parser.parse_args()
    if not grouped_matmul.hopper():
        print(f"error: needs an NVIDIA Hopper GPU; this is {jax.devices()[0].device_kind}")
        return 2
    print(jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    result: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    try:
        result["check"] = check()
    except Exception as e:  # noqa: BLE001
        result["check"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}", "pass": False}
    print("check", json.dumps(result["check"]), flush=True)
    if result["check"].get("pass"):
        problems = _problems(args.rows, embed=2048, mlp=768, groups=128)
        if args.tune:
            result["tuning"] = tune(problems, args.tune)
        result["tiles"] = grouped_matmul.TILES
        result["speed"] = speed(problems)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["check"].get("pass") else 1


if __name__ == "__main__":
    sys.exit(main())
