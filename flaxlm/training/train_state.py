"""TrainState: step, params and optimizer state, and the logical axes of each."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import optax
from jax.sharding import PartitionSpec as P

from flaxlm.parallel.pytrees import path_name


class TrainState(flax.struct.PyTreeNode):
    """Immutable training state; `tx` rides along as static metadata."""

    step: jax.Array
    params: Any
    opt_state: Any
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)

    @classmethod
    def create(cls, params: Any, tx: optax.GradientTransformation) -> TrainState:
        return cls(
            step=jax.numpy.zeros((), jax.numpy.int32),
            params=params,
            opt_state=tx.init(params),
            tx=tx,
        )

    def apply_gradients(self, grads: Any) -> TrainState:
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state)

    def logical_axes(self, params_axes: Any) -> TrainState:
        """The same tree with a PartitionSpec of logical names at each leaf.

        `self` may be abstract (`jax.eval_shape`). Optimizer-state leaves that mirror a param
        (same key path suffix and rank) take that param's axes; others are replicated.
        """
        axes_leaves = jax.tree_util.tree_flatten_with_path(
            params_axes, is_leaf=lambda x: isinstance(x, P)
        )[0]
        shapes = [tuple(x.shape) for x in jax.tree.leaves(self.params)]
        by_path = {
            path_name(path): (axes, shape)
            for (path, axes), shape in zip(axes_leaves, shapes, strict=True)
        }

        def opt_leaf(path: tuple[Any, ...], leaf: Any) -> P:
            name = path_name(path)
            # The longest param path that ends this leaf's path, with the same shape
            # (factored moments, e.g. Adafactor's v_row, have other shapes: replicated).
            matches = [
                (len(param_path), axes)
                for param_path, (axes, shape) in by_path.items()
                if (name == param_path or name.endswith("/" + param_path))
                and tuple(leaf.shape) == shape
            ]
            return max(matches, key=lambda m: m[0])[1] if matches else P()

        opt_axes = jax.tree_util.tree_map_with_path(opt_leaf, self.opt_state)
        return self.replace(step=P(), params=params_axes, opt_state=opt_axes)
