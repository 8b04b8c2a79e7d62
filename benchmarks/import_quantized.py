"""Importing the Hub's FP8 DeepSeek-V3 files on a slice: seconds and peak host memory a host.

Writes a DeepSeek-V3-shaped FP8 checkpoint cut in depth (1 dense + 1 MoE layer at the full
width: hidden 7168, MLA as published, the dense MLP's 18432, experts of 2048; FP8 e4m3
weights with 128 x 128 block scales, random bytes) and times `hf.load_params` (bfloat16
params) on 8 simulated CPU devices, mesh (data 1, fsdp 2, expert 2, tensor 2), as one host
holding all 8 and as the share of one host of 2 and of 4 (its 4 or 2 devices: every other
device's shard callback skipped, which is what `jax.make_array_from_callback` runs in each
process of a multi-host run). Each case runs in a fresh process; `peak_rss_GiB` is its
`ru_maxrss`. Cut to fit a 24 GiB machine: 16 experts (of 256) and a 16384-token vocabulary
(of 129280) by default; `--experts` / `--vocab` change that.

    python benchmarks/import_quantized.py                     # ~2 GB in /tmp, a few minutes
    PYTHONPATH=/old/tree python benchmarks/import_quantized.py --reuse DIR   # another tree
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402

bench_common.force_host_devices(8)

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import traverse_util  # noqa: E402

from flaxlm.checkpoints import hf  # noqa: E402
from flaxlm.models import hf_spec  # noqa: E402
from flaxlm.parallel import pytrees  # noqa: E402
from flaxlm.parallel.partitioning import Partitioner  # noqa: E402

MESH = ((1, 2, 2, 2), ("data", "fsdp", "expert", "tensor"))
BLOCK = 128


def hf_config(experts: int, vocab: int) -> dict[str, Any]:
    """DeepSeek-V3's config.json, two layers (the first dense), `experts` routed experts."""
    import transformers

    config = transformers.DeepseekV3Config(
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=experts,
        n_group=min(8, experts),
        topk_group=min(4, experts),
        num_experts_per_tok=min(8, experts),
        vocab_size=vocab,
    ).to_dict()
    config["quantization_config"] = dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[BLOCK] * 2
    )
    return config


def write_checkpoint(path: str, experts: int, vocab: int) -> int:
    """The FP8 checkpoint in `path`, written a tensor at a time; returns its bytes."""
    config = hf_config(experts, vocab)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    _, cfg = hf.config_from_hf_dict(config, dtype=jnp.bfloat16)
    spec = hf.spec_for_config(cfg)
    shapes = {
        k: v.shape
        for k, v in traverse_util.flatten_dict(
            pytrees.abstract_params(spec.model_cls(cfg)), sep="/"
        ).items()
    }
    tensors = spec.tensors(cfg)
    entries: dict[str, tuple[str, tuple[int, ...]]] = {}
    for param, (t, names, _) in hf_spec.expand(tensors, None).items():
        shape = list(shapes[param])
        if t.vocab_axis is not None:
            shape[t.vocab_axis] = vocab
        hf_shape = t.hf_shape(tuple(shape))
        if t.pieces:
            for expert in hf_spec.pieces_of(tensors)[names[0]]:
                for piece in expert:
                    entries[piece] = (hf_shape[1] // len(expert), hf_shape[2])
        else:
            entries[names[0]] = hf_shape
    header, offset, order = {}, 0, []
    for name, shape in sorted(entries.items()):
        quantized = len(shape) == 2 and name.endswith("proj.weight")
        dtype, size = ("F8_E4M3", 1) if quantized else ("BF16", 2)
        order.append((name, shape, quantized))
        n = int(np.prod(shape)) * size
        header[name] = dict(dtype=dtype, shape=list(shape), data_offsets=[offset, offset + n])
        offset += n
        if quantized:
            scales = [-(-d // BLOCK) for d in shape]
            m = int(np.prod(scales)) * 4
            header[name + "_scale_inv"] = dict(
                dtype="F32", shape=scales, data_offsets=[offset, offset + m]
            )
            offset += m
    rng = np.random.default_rng(0)
    raw = json.dumps(header).encode()
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, shape, quantized in order:
            n = int(np.prod(shape))
            if quantized:
                values = rng.integers(0, 256, n, dtype=np.uint8)
                values[(values & 0x7F) == 0x7F] = 0  # no NaN codes
                f.write(values.tobytes())
                scales = rng.uniform(1e-4, 1e-3, [-(-d // BLOCK) for d in shape])
                f.write(scales.astype(np.float32).tobytes())
            else:
                f.write((rng.standard_normal(n, np.float32) * 0.02).astype(jnp.bfloat16).tobytes())
    return 8 + len(raw) + offset


def import_share(path: str, hosts: int, host: int) -> dict[str, Any]:
    """Imports `path` as host `host` of `hosts` would: only its devices' shard callbacks run."""
    partitioner = Partitioner(*MESH)
    model = hf.model_from_hf_dir(path, partitioner, jnp.bfloat16)
    devices = list(partitioner.mesh.devices.flat)
    mine = set(devices[host * len(devices) // hosts : (host + 1) * len(devices) // hosts])
    real = jax.make_array_from_callback

    def host_share(shape: Any, sharding: Any, callback: Any) -> list[Any]:
        return [
            jax.device_put(callback(index), device)
            for device, index in sharding.devices_indices_map(shape).items()
            if device in mine
        ]

    jax.make_array_from_callback = host_share
    try:
        start = time.perf_counter()
        params = hf.load_params(model, path, partitioner)
        jax.block_until_ready(params)
        seconds = time.perf_counter() - start
    finally:
        jax.make_array_from_callback = real
    held = sum(a.nbytes for a in jax.tree.leaves(params))
    return dict(
        hosts=hosts,
        host=host,
        seconds=round(seconds, 2),
        held_GiB=round(held / 2**30, 2),
        peak_rss_GiB=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--hosts", default="1,2,4", help="host counts to time a share of")
    parser.add_argument("--reuse", help="a directory this script wrote before")
    parser.add_argument("--share", help=argparse.SUPPRESS)  # 'hosts,host': one case, here
    args = parser.parse_args()
    if args.share:
        print(json.dumps(import_share(args.reuse, *map(int, args.share.split(",")))))
        return
    path = args.reuse or tempfile.mkdtemp(prefix="deepseek_fp8_")
    if not args.reuse:
        start = time.perf_counter()
        size = write_checkpoint(path, args.experts, args.vocab)
        print(f"wrote {size / 2**30:.2f} GiB to {path} in {time.perf_counter() - start:.0f} s")
    rows = []
    for hosts in map(int, args.hosts.split(",")):
        command = [sys.executable, __file__, "--reuse", path, "--share", f"{hosts},0"]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    bench_common.print_table(
        ["hosts", "seconds (host 0)", "peak RSS GiB", "params held GiB"],
        [(r["hosts"], r["seconds"], r["peak_rss_GiB"], r["held_GiB"]) for r in rows],
    )


if __name__ == "__main__":
    main()
