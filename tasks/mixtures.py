"""A Gin-bound factory that registers a seqio mixture of tasks sampled at given rates."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

import gin
import seqio


@gin.configurable
def register_mixture(
    name: str = gin.REQUIRED,
    tasks_and_rates: Mapping[str, float] | Sequence[tuple[str, float]] = gin.REQUIRED,
) -> str:
    """Registers (once) a mixture named `name` and returns the name.

    Args:
      tasks_and_rates: {task or mixture name: rate} or [(name, rate), ...]; examples are drawn
        from each in proportion to its rate (seqio.MixtureRegistry). The tasks must be
        registered first and share output features (the same vocabulary and features).
    """
    if name in seqio.MixtureRegistry.names():
        return name
    if isinstance(tasks_and_rates, Mapping):
        tasks_and_rates = list(tasks_and_rates.items())
    pairs = list(tasks_and_rates)
    if not pairs:
        raise ValueError(f"Mixture {name!r}: tasks_and_rates is empty.")
    known = set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names())
    for task, rate in pairs:
        if task not in known:
            close = difflib.get_close_matches(task, sorted(known), n=3)
            hint = f" Did you mean {close}?" if close else ""
            raise ValueError(f"Mixture {name!r}: no task or mixture named {task!r}.{hint}")
        if not rate > 0:
            raise ValueError(f"Mixture {name!r}: rate {rate!r} of {task!r} must be positive.")
    seqio.MixtureRegistry.add(name, [(task, float(rate)) for task, rate in pairs])
    return name
