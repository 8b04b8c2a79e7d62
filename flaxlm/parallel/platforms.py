"""Which JAX platforms flaxlm starts on a host, and libtpu's settings for compile-only use.

JAX tries every installed backend when `JAX_PLATFORMS` is unset. With libtpu installed (the
`tpu` and `test` extras) that includes the TPU runtime even on a host with no TPU: each process
then loads libtpu, prints its start-up errors ("could not determine TPU accelerator type", an
`E0000 ... unexpected worker hostname` line) and holds `/tmp/libtpu_lockfile` while it lives,
so a second process that needs libtpu (an ahead-of-time TPU compile) fails with "Internal error
when accessing libtpu multi-process lockfile". `exclude_absent_tpu` keeps JAX off libtpu on such
a host; `prepare_tpu_compile_only` lets libtpu compile for a TPU topology beside other processes.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import sys

# The GPU plugins JAX discovers (module names under the `jax_plugins` namespace package, e.g.
# xla_cuda12 from jax[cuda12]) and the platform each registers.
_GPU_PLUGIN_PLATFORMS = {"cuda": "cuda", "rocm": "rocm"}

# The targets flaxlm compiles for ahead of time (`flaxlm.plan.aot.target_devices`), named here
# so that a command line is checked before JAX starts.
TOPOLOGY_HELP = (
    "a TPU slice as <generation>:<chips per dimension> (v5e:2x4, v5p:2x2x2), NVIDIA GPUs as "
    "<gpu>:<hosts>x<gpus per host> or <gpu>:<gpus> for one host (h100:16x8, h200:8), cpu:N "
    "(N CPU devices of this process) or `this` (the devices JAX runs on here)"
)
TPU_TOPOLOGY_RE = re.compile(r"v\d+[a-z]*:\d+(x\d+)*")
GPU_TOPOLOGY_RE = re.compile(r"(h100|h200):([1-9]\d*)(?:x([1-9]\d*))?")


def tpu_attached() -> bool:
    """Whether this host has a TPU that libtpu could drive.

    TPU chips reach user space only as device nodes: /dev/accel* (v2 to v4) or VFIO groups
    /dev/vfio/<n> (v5e and later). A VFIO group can also be another passed-through device; that
    errs on the side of starting libtpu, JAX's default.
    """
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _installed_plugin_platforms() -> list[str] | None:
    """Platforms of the installed JAX PJRT plugins other than libtpu; None if one of them is
    not a GPU plugin flaxlm knows (its platform name cannot be listed without loading it)."""
    names = set()
    if importlib.util.find_spec("jax_plugins") is not None:
        import pkgutil

        import jax_plugins  # a namespace package: importing it loads no plugin

        names |= {m.name for m in pkgutil.iter_modules(jax_plugins.__path__)}
    from importlib.metadata import entry_points

    names |= {e.value.rsplit(".", 1)[-1] for e in entry_points(group="jax_plugins")}
    platforms = []
    for name in sorted(names):
        known = [p for key, p in _GPU_PLUGIN_PLATFORMS.items() if key in name]
        if not known:
            return None
        platforms += known
    # A ROCm plugin registers nothing without an AMD GPU, and listing an unregistered
    # platform is an error; the CUDA plugin started with no NVIDIA GPU (flaxlm[gpu-compile] on
    # a CPU host, to compile for GPUs) logs a traceback and is skipped: neither is listed
    # where its device nodes are absent (/dev/dxg: WSL's GPUs).
    if not os.path.exists("/dev/kfd"):
        platforms = [p for p in platforms if p != "rocm"]
    if not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg")):
        platforms = [p for p in platforms if p != "cuda"]
    return list(dict.fromkeys(platforms))


def exclude_absent_tpu() -> str | None:
    """Sets `JAX_PLATFORMS` to this host's platforms without `tpu` when libtpu is installed
    but no TPU is attached, so that JAX never starts libtpu; returns what it set, else None.

    Call it before JAX initialises its backends (importing flaxlm does). A `JAX_PLATFORMS` the
    user set, even to '' (JAX's own choice), wins, as do `jax_platforms` set in JAX's config
    and `JAX_FORCE_TPU_INIT`. GPU plugins stay listed ahead of `cpu`, so the default device
    is the same as JAX's own choice. An unrecognised plugin (or `PJRT_NAMES_AND_LIBRARY_PATHS`)
    leaves JAX's default, as there is no naming its platform without loading it.
    """
    if "JAX_PLATFORMS" in os.environ or "JAX_FORCE_TPU_INIT" in os.environ:
        return None
    if os.environ.get("PJRT_NAMES_AND_LIBRARY_PATHS"):
        return None
    jax = sys.modules.get("jax")
    if jax is not None and getattr(jax, "config", None) is not None:
        if jax.config.jax_platforms is not None:
            return None
    if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
        return None  # without libtpu, JAX's TPU backend fails quietly without loading anything
    if tpu_attached():
        return None
    gpus = _installed_plugin_platforms()
    if gpus is None:
        return None
    platforms = ",".join([*gpus, "cpu"])
    # The environment reaches JAX if it is imported later, and child processes; the config
    # reaches a JAX already imported (before its backends start, or it has no effect).
    os.environ["JAX_PLATFORMS"] = platforms
    if jax is not None and getattr(jax, "config", None) is not None:
        jax.config.update("jax_platforms", platforms)
    return platforms


def host_device_flags(count: int | None, flags: str | None = None) -> str:
    """`flags` (default: `XLA_FLAGS` now) with `count` simulated CPU devices in place of any
    device count they set (None: no count; the process that reads them sets its own). XLA
    reads them when JAX's backends start, so they act only in a process that has not."""
    kept = [f for f in (os.environ.get("XLA_FLAGS", "") if flags is None else flags).split()]
    kept = [f for f in kept if not f.startswith("--xla_force_host_platform_device_count")]
    if count is not None:
        kept.append(f"--xla_force_host_platform_device_count={count}")
    return " ".join(kept)


def prepare_tpu_compile_only() -> None:
    """Lets libtpu compile for a TPU topology on this host beside other libtpu processes.

    Call it before libtpu is first loaded (`jax.experimental.topologies.get_topology_desc`).
    On a host with no TPU the compile touches no chip, so the lockfile that guards the chips
    is shared (`ALLOW_MULTIPLE_LIBTPU_LOAD`) instead of failing while another process holds
    it, and the host is described as the single-host slice it is (worker `localhost`, host
    bounds 1,1,1) so that libtpu does not log errors looking for TPU workers. The topology
    compiled for is the one named; these settings describe only this host. Values already in
    the environment win; on a host with a TPU nothing is changed.
    """
    if tpu_attached():
        return
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
