"""Metric writers (TensorBoard, metrics.jsonl, optional W&B), the progress line, MFU.

Only process 0 writes; other processes get a writer that does nothing.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import gin
import jax
import numpy as np
from etils import epath

# Peak dense bf16 FLOP/s per device, for MFU. Unknown devices (CPUs) report TFLOP/s only.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
}


def peak_flops_per_device() -> float | None:
    kind = jax.devices()[0].device_kind
    if kind in PEAK_FLOPS:
        return PEAK_FLOPS[kind]
    for name, flops in PEAK_FLOPS.items():
        if kind.startswith(name):
            return flops
    return None


class MetricWriter(Protocol):
    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def flush(self) -> None: ...


class JsonlWriter:
    """One JSON object per logged step in `model_dir/metrics.jsonl`."""

    def __init__(self, model_dir: str):
        self.path = epath.Path(model_dir) / "metrics.jsonl"
        self._pending: list[str] = []

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        record = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
        self._pending.append(json.dumps(record))

    def flush(self) -> None:
        if not self._pending:
            return
        existing = self.path.read_text() if self.path.exists() else ""
        # epath has no append mode on every backend: rewrite (the file stays small), through
        # a temporary file and a rename so that a kill mid-write never truncates the log.
        tmp = self.path.parent / (self.path.name + ".tmp")
        tmp.write_text(existing + "".join(line + "\n" for line in self._pending))
        tmp.replace(self.path)
        self._pending = []


class TensorBoardWriter:
    """TensorBoard event files under `model_dir/<subdir>`: the records TensorFlow's summary
    writer writes (`events.out.tfevents.*.v2`, scalars as `tf.summary.scalar` makes them),
    written with TensorBoard's own protos and record framing, so the run's process need not
    load TensorFlow (its input pipeline may run in another process)."""

    _count = itertools.count()

    def __init__(self, model_dir: str, subdir: str = "tensorboard"):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event = event_pb2.Event
        self._scalar = scalar_pb
        directory = epath.Path(model_dir) / subdir
        directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        name = (
            f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}."
            f"{next(self._count)}.v2"
        )
        self._file = (directory / name).open("wb")
        self._records = RecordWriter(self._file)
        self._write(self._event(wall_time=now, file_version="brain.Event:2"))

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        now = time.time()
        for k, v in scalars.items():
            self._write(self._event(wall_time=now, step=int(step), summary=self._scalar(k, v)))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@gin.configurable
class WandbWriter:
    """Weights & Biases logging (extra `[wandb]`); `mode='offline'` needs no network."""

    def __init__(
        self,
        model_dir: str,
        project: str = "flaxlm",
        name: str | None = None,
        mode: str = "online",
        config: Mapping[str, Any] | None = None,
    ):
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            project=project, name=name, mode=mode, dir=str(model_dir), config=dict(config or {})
        )

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({k: float(v) for k, v in scalars.items()}, step=int(step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class MultiWriter:
    def __init__(self, writers: Sequence[MetricWriter]):
        self.writers = list(writers)

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for w in self.writers:
            w.write_scalars(step, scalars)

    def flush(self) -> None:
        for w in self.writers:
            w.flush()

    def close(self) -> None:
        self.flush()
        for w in self.writers:
            if hasattr(w, "close"):
                w.close()


@gin.configurable
def create_writer(
    model_dir: str, use_tensorboard: bool = True, use_wandb: bool = False
) -> MultiWriter:
    """The writers for `model_dir` (none on processes other than 0)."""
    if jax.process_index() != 0:
        return MultiWriter([])
    writers: list[MetricWriter] = [JsonlWriter(model_dir)]
    if use_tensorboard:
        writers.append(TensorBoardWriter(model_dir))
    if use_wandb:
        writers.append(WandbWriter(model_dir))
    return MultiWriter(writers)


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """The progress line: step, loss, learning rate, tokens/s, TFLOP/s (MFU), ETA."""

    def __init__(self, total_steps: int, start_step: int, flops_per_token: float | None):
        self.total_steps = total_steps
        self.start_step = start_step
        self.flops_per_token = flops_per_token
        self.peak = peak_flops_per_device()
        self.num_devices = jax.device_count()
        self._t0 = time.perf_counter()

    def rates(self, tokens: float, seconds: float) -> dict[str, float]:
        tps = tokens / max(seconds, 1e-9)
        out = {"tokens_per_second": tps}
        if self.flops_per_token:
            flops = tps * self.flops_per_token
            out["tflops_per_second"] = flops / 1e12
            if self.peak:
                out["mfu"] = flops / (self.peak * self.num_devices)
        return out

    def line(self, step: int, scalars: Mapping[str, float]) -> str:
        elapsed = time.perf_counter() - self._t0
        done = max(step - self.start_step, 1)
        eta = elapsed / done * (self.total_steps - step)
        parts = [f"step {step}/{self.total_steps}"]
        for key, fmt in (
            ("loss", "loss {:.4f}"),
            ("reward", "reward {:.3f}"),
            ("learning_rate", "lr {:.2e}"),
            ("tokens_per_second", "{:,.0f} tok/s"),
            ("tflops_per_second", "{:.3f} TFLOP/s"),
            ("mfu", "MFU {:.1%}"),
        ):
            if key in scalars and np.isfinite(scalars[key]):
                parts.append(fmt.format(scalars[key]))
        parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)


def eval_line(step: int, scalars: Mapping[str, float]) -> str:
    """An evaluation's line: loss, accuracy and perplexity (a preference loss: its reward
    accuracy and margin), then the task's own metrics (`eval/<task>/<metric>`)."""
    shown = {
        "loss": ".4f",
        "accuracy": ".4f",
        "perplexity": ".4g",
        "rewards/accuracies": ".4f",
        "rewards/margins": ".4g",
    }
    parts = [f"step {step}"] + [
        f"eval {k} {scalars['eval/' + k]:{f}}" for k, f in shown.items() if f"eval/{k}" in scalars
    ]
    task = [k for k in scalars if k.count("/") > 1 and k[len("eval/") :] not in shown]
    parts += [f"{k[len('eval/') :]} {scalars[k]:.4g}" for k in task]
    return " | ".join(parts)


# ---------------------------------------------------------------- what runs write


def print0(message: str) -> None:
    """Prints on process 0 only."""
    if jax.process_index() == 0:
        print(message, flush=True)


def write_jsonl(path: epath.Path, records: Sequence[Mapping[str, Any]]) -> None:
    """One JSON line per record (process 0; written whole, then renamed into place)."""
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / (path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        tmp.replace(path)  # over an earlier run's file (rename refuses)


def write_config(output_dir: epath.Path) -> None:
    """`output_dir/config.gin`: the run's operative Gin config (process 0)."""
    if jax.process_index() == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.gin").write_text(gin.operative_config_str())
