"""Pytree helpers every ring shares: key-path names and abstract trees carrying shardings.

`abstract_params` is the one place that builds a model's abstract params on a mesh (shapes
and dtypes from `jax.eval_shape` of the init, shardings from the logical axes): restores,
HF loads and LoRA all place arrays onto what it returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def path_name(path: tuple[Any, ...]) -> str:
    """'a/b/c' for a jax key path."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """`jax.ShapeDtypeStruct`s of `abstract`'s leaves carrying the matching shardings."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def abstract_params(
    model: Any, partitioner: Any = None, batch_shapes: Mapping[str, tuple[int, ...]] | None = None
) -> Any:
    """A model's params as ShapeDtypeStructs on `partitioner`'s shardings, or all on the
    first local device without one (nothing is allocated). `model` is a `BaseModel`,
    `partitioner` a `Partitioner`."""
    shapes = batch_shapes or model.example_batch_shapes()
    abstract = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0), shapes))
    if partitioner is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return with_shardings(abstract, jax.tree.map(lambda _: device, abstract))
    return with_shardings(abstract, partitioner.sharding(model.params_axes(shapes)))


def host_array(x: jax.Array) -> np.ndarray:
    """A global array (any sharding, spread over any processes) as one numpy array on every
    process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def shardings_of(abstract: Any) -> Any:
    """The shardings an abstract tree carries (see `with_shardings`)."""
    return jax.tree.map(lambda a: a.sharding, abstract)
