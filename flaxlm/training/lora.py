"""Low-rank adapters (LoRA) over any model's dense kernels.

`LoraConfig.rules` maps regexes over "/"-joined kernel paths (e.g. `decoder/layers_0/attn/
q_proj/kernel`) to ranks. Every matched kernel `W` (dims: [stacked layers...] + in + out)
gets `lora_a` (stack + in + [r], random) and `lora_b` (stack + [r] + out, zeros).

Training computes the textbook `x W + (alpha / r) (dropout(x) A) B`: `with_adapters` puts the
(scaled) adapters into the params tree beside their kernels, where `layers.DenseGeneral.adapt`
finds them (scanned layers slice them like any param), so every family works unchanged, the
frozen `W` gets no gradient, and nothing kernel-sized is built per step. `merge` folds them
into the kernels (`W + (alpha / r) A @ B`) once, for evaluation, inference and export.

The adapter tree mirrors the kernels' module paths (`.../q_proj/lora_a`), and the adapter
axes are the kernel's logical axes (the rank dim unsharded), so adapters shard under any
mesh as their kernels do.

The experts of an MoE layer (`.../mlp/experts/wi` `[expert, embed, 2, mlp]`, `wo`
`[expert, mlp, embed]`; rules such as `experts/(wi|wo)$`) get one pair per expert, the
expert dim stacked like a scanned layer's: `wi_lora_a` `[expert, embed, r]`, `wi_lora_b`
`[expert, r, 2, mlp]`, added to the weights inside the layer (`layers.with_lora`).

Serving many adapters over one base at once (`stack_adapters`, `adapters_per_row`): every
adapter's pair stacked beside its kernel, each row of a batch adding its own adapter's update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import string
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from flaxlm.models import layers

Params = Any


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which dense kernels get adapters, of which rank, and how they are scaled."""

    # (regex, rank) pairs; a kernel takes the rank of the first regex that `re.search`es
    # its "/"-joined path. Every regex must match at least one kernel.
    rules: Sequence[tuple[str, int]] = ((r"(q|v)_proj/kernel$", 8),)
    # The update is scaled by alpha / rank (as in the LoRA paper and PEFT).
    alpha: float = 16.0
    # Dropout on the input of the low-rank path (training only; PEFT's lora_dropout).
    dropout: float = 0.0

    def __post_init__(self) -> None:
        rules = tuple((str(p), r) for p, r in self.rules)
        if not rules:
            raise ValueError("LoraConfig.rules is empty: give (regex, rank) pairs.")
        for pattern, rank in rules:
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
                raise ValueError(
                    f"LoraConfig rule ({pattern!r}, {rank!r}): the rank must be an int >= 1."
                )
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"LoraConfig rule {pattern!r} is not a valid regex: {e}") from e
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraConfig.dropout={self.dropout!r}: expected 0 <= dropout < 1.")
        object.__setattr__(self, "rules", rules)

    def to_json(self) -> dict[str, Any]:
        return {
            "rules": [list(r) for r in self.rules],
            "alpha": self.alpha,
            "dropout": self.dropout,
        }

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> LoraConfig:
        return cls(
            rules=tuple((p, int(r)) for p, r in record["rules"]),
            alpha=record["alpha"],
            dropout=record.get("dropout", 0.0),
        )


@dataclasses.dataclass(frozen=True)
class AdaptedKernel:
    """One matched kernel: its shape split into stacked / input / output dims, and its rank."""

    path: tuple[str, ...]  # the kernel's key path in the params tree
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # the kernel's logical axes
    num_stacked: int  # leading dims added by scanned layers
    num_in: int
    rank: int

    @property
    def a_shape(self) -> tuple[int, ...]:
        return self.shape[: self.num_stacked + self.num_in] + (self.rank,)

    @property
    def b_shape(self) -> tuple[int, ...]:
        return (
            self.shape[: self.num_stacked]
            + (self.rank,)
            + self.shape[self.num_stacked + self.num_in :]
        )

    @property
    def a_axes(self) -> P:
        return P(*self.axes[: self.num_stacked + self.num_in], None)

    @property
    def b_axes(self) -> P:
        s, i = self.num_stacked, self.num_in
        return P(*self.axes[:s], None, *self.axes[s + i :])


def dense_kernels(model: Any, batch_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """`{"a/b/kernel": (shape, logical_axes, num_in)}` for every `layers.DenseGeneral` kernel
    of `model`, and every weight stacked over experts (`.../experts/wi`), found by tracing
    its init (nothing is allocated)."""
    num_in: dict[tuple[str, ...], int] = {}

    def record(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if isinstance(module, layers.DenseGeneral) and context.method_name == "weights":
            num_in[tuple(str(p) for p in module.path)] = len(args[0])  # args: (in_shape,)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        boxed = jax.eval_shape(lambda: model.init_boxed(jax.random.PRNGKey(0), batch_shapes))
    axes_tree = nn.get_partition_spec(boxed)
    shapes = nn.unbox(boxed)
    flat_shapes = traverse_util.flatten_dict(shapes)
    flat_axes = traverse_util.flatten_dict(axes_tree, is_leaf=lambda _, x: isinstance(x, P))
    found = {}
    for path, leaf in flat_shapes.items():
        axes = tuple(flat_axes[path])
        if path[-1] == "kernel" and path[:-1] in num_in:
            found["/".join(path)] = (path, tuple(leaf.shape), axes, num_in[path[:-1]])
        elif "expert" in axes and len(axes) - axes.index("expert") >= 3 and path[-1] != "bi":
            # Experts' stacked weights ([expert, in, out...], models/experts.py): one pair
            # each; not gpt-oss's expert biases (bi [expert, 2, mlp]).
            found["/".join(path)] = (path, tuple(leaf.shape), axes, 1)
    return found


def plan(
    cfg: LoraConfig, model: Any, batch_shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, AdaptedKernel]:
    """The kernels `cfg` adapts, by path; a rule that matches no kernel, or a rank larger
    than a matched kernel allows, is an error."""
    kernels = dense_kernels(model, batch_shapes)
    chosen: dict[str, AdaptedKernel] = {}
    used = set()
    for name, (path, shape, axes, num_in) in sorted(kernels.items()):
        for pattern, rank in cfg.rules:
            if re.search(pattern, name):
                used.add(pattern)
                # Stacked (scanned) dims lead: the kernel has more dims than in + out.
                num_out = len(axes) - num_in
                num_stacked = 0
                if "expert" in axes:  # one adapter pair per expert (and per scanned layer)
                    num_stacked = axes.index("expert") + 1
                    num_out = len(axes) - num_stacked - num_in
                elif "layers" in axes:
                    num_stacked = axes.index("layers") + 1
                    num_out = len(axes) - num_stacked - num_in
                fan_in = math.prod(shape[num_stacked : num_stacked + num_in])
                fan_out = math.prod(shape[num_stacked + num_in :])
                if rank > min(fan_in, fan_out) or num_out < 1:
                    raise ValueError(
                        f"LoRA rule ({pattern!r}, {rank}): rank {rank} is larger than kernel "
                        f"{name} (shape {shape}) allows (at most {min(fan_in, fan_out)})."
                    )
                chosen[name] = AdaptedKernel(path, shape, axes, num_stacked, num_in, rank)
                break
    unused = [p for p, _ in cfg.rules if p not in used]
    if unused:
        some = sorted(kernels)[:12]
        raise ValueError(
            f"LoRA rule(s) {unused} match no dense kernel of {type(model.config).__name__}. "
            f"Kernel paths look like: {some}{' ...' if len(kernels) > 12 else ''}."
        )
    return chosen


def adapter_paths(kernel_path: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Where A and B of the weight at `kernel_path` sit: beside it, `lora_a`/`lora_b` for a
    dense `kernel` (what `layers.DenseGeneral.adapt` reads), `wi_lora_a`/`wi_lora_b` for
    another weight (`layers.with_lora`)."""
    module, name = kernel_path[:-1], kernel_path[-1]
    prefix = "" if name == "kernel" else f"{name}_"
    return module + (f"{prefix}lora_a",), module + (f"{prefix}lora_b",)


def kernel_path(adapter_path: tuple[str, ...]) -> tuple[str, ...]:
    """The weight an adapter (`.../lora_a`, `.../wi_lora_b`) belongs to."""
    name = adapter_path[-1].removesuffix("lora_a").removesuffix("lora_b").removesuffix("_")
    return adapter_path[:-1] + (name or "kernel",)


def init_adapters(rng: jax.Array, kernels: Mapping[str, AdaptedKernel]) -> Params:
    """A (normal, std 1/sqrt(fan_in)) and B (zeros) for each kernel: the adapted model
    starts equal to the base."""
    flat = {}
    for i, (_, k) in enumerate(sorted(kernels.items())):
        fan_in = math.prod(k.shape[k.num_stacked : k.num_stacked + k.num_in])
        a = jax.random.normal(jax.random.fold_in(rng, i), k.a_shape, jnp.float32)
        a_path, b_path = adapter_paths(k.path)
        flat[a_path] = a / math.sqrt(fan_in)
        flat[b_path] = jnp.zeros(k.b_shape, jnp.float32)
    return traverse_util.unflatten_dict(flat)


def adapter_axes(kernels: Mapping[str, AdaptedKernel]) -> Params:
    """The adapters' logical axes (the same tree as `init_adapters`)."""
    flat = {}
    for k in kernels.values():
        a_path, b_path = adapter_paths(k.path)
        flat[a_path], flat[b_path] = k.a_axes, k.b_axes
    return traverse_util.unflatten_dict(flat)


def delta(a: jax.Array, b: jax.Array, kernel_ndim: int, scale: float) -> jax.Array:
    """`scale * A @ B` in float32, shaped like the kernel (stacked dims batched)."""
    num_stacked = (a.ndim - 1) + (b.ndim - 1) - kernel_ndim
    num_in = a.ndim - 1 - num_stacked
    num_out = b.ndim - 1 - num_stacked
    letters = iter(string.ascii_letters)
    stack = "".join(next(letters) for _ in range(num_stacked))
    ins = "".join(next(letters) for _ in range(num_in))
    outs = "".join(next(letters) for _ in range(num_out))
    r = next(letters)
    spec = f"{stack}{ins}{r},{stack}{r}{outs}->{stack}{ins}{outs}"
    return scale * jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))


def apply_adapters(base: Params, adapters: Params, alpha: float) -> Params:
    """The effective params: each adapted kernel becomes `W + (alpha/r) A @ B` (in W's
    dtype); every other param is `base`'s own array."""
    flat_base = traverse_util.flatten_dict(base)
    flat_ad = traverse_util.flatten_dict(adapters)
    out = dict(flat_base)
    for path in [p for p in flat_ad if p[-1].endswith("lora_a")]:
        a, b = flat_ad[path], flat_ad[path[:-1] + (path[-1][: -len("a")] + "b",)]
        key = kernel_path(path)
        if key not in flat_base:
            raise ValueError(f"Adapter {'/'.join(path)} has no kernel in the base params.")
        w = flat_base[key]
        rank = a.shape[-1]
        d = delta(a, b, w.ndim, alpha / rank)
        out[key] = (w.astype(jnp.float32) + d).astype(w.dtype)
    return traverse_util.unflatten_dict(out)


def with_adapters(base: Params, adapters: Params, alpha: float) -> Params:
    """`base` with each adapter beside its kernel (`lora_a` scaled by `alpha / r`): the
    params under which `layers.DenseGeneral` computes `x W + (dropout(x) A) B`."""
    flat = traverse_util.flatten_dict(base)
    for path, x in traverse_util.flatten_dict(adapters).items():
        if kernel_path(path) not in flat:
            raise ValueError(f"Adapter {'/'.join(path)} has no kernel in the base params.")
        if path[-1].endswith("lora_a"):
            x = x * (alpha / x.shape[-1])
        flat[path] = x
    return traverse_util.unflatten_dict(flat)


def merge(base_params: Params, adapters: Params, cfg: LoraConfig) -> Params:
    """Base params with the adapters folded in: an ordinary params tree of the model."""
    return apply_adapters(base_params, adapters, cfg.alpha)


class LoraModel:
    """The loss of `model` as a function of the adapters alone (base params held fixed).

    Built inside the jitted train step with the base params as an argument of that step:
    `jax.grad` of `loss_fn` is taken with respect to the adapters only, so the base gets
    no gradient and no optimizer state.
    """

    def __init__(self, model: Any, cfg: LoraConfig, base_params: Params):
        self.model = model
        self.cfg = cfg
        self.base_params = base_params

    def normalizer(self, batch: Any) -> Any:
        return self.model.normalizer(batch)

    def loss_fn(self, adapters: Params, batch: Any, rng: Any, normalizer: Any = None) -> Any:
        return self._adapted(adapters, rng, self.model.loss_fn, batch, rng, normalizer)

    def token_logps(
        self, adapters: Params, batch: Any, rng: Any = None, temperature: float = 1.0
    ) -> Any:
        return self._adapted(adapters, rng, self.model.token_logps, batch, rng, temperature)

    def _adapted(self, adapters: Params, rng: Any, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(params, *args)` with the adapted params (and adapter dropout with `rng`)."""
        base = jax.lax.stop_gradient(self.base_params)
        params = with_adapters(base, adapters, self.cfg.alpha)
        rate = self.cfg.dropout if rng is not None else 0.0
        with layers.lora_dropout(rate):
            return fn(params, *args)


# ---------------------------------------------------------------- many adapters, one batch
#
# Serving several adapters over one base at once: each adapted kernel gets every adapter's
# pair stacked beside it (`lora_a_rows` `[stack..., adapters + 1, in..., R]`, `lora_b_rows`
# `[stack..., adapters + 1, R, out...]`; index 0 the base's zeros, each A already scaled, ranks
# zero-padded to the largest R: exact, the padded components add 0), and within
# `adapters_per_row(index)` each row `i` of a batch adds `x[i] A[index[i]] B[index[i]]` to its
# layer's output. The base is not merged into nor copied; the index is data, so one compiled
# program serves any mix of adapters.

ROWS_A, ROWS_B = "lora_a_rows", "lora_b_rows"


def stack_adapters(
    kernels: Mapping[str, AdaptedKernel], adapter_sets: Sequence[tuple[Params, float]]
) -> Params:
    """Each `(adapters, alpha)` of `adapter_sets` at index 1, 2, ... of every kernel in
    `kernels` (the union of the sets' kernels; their ranks are not read), beside index 0's
    zeros: the tree `with_row_adapters` puts beside the base's kernels. A set that leaves a
    kernel alone has zeros there. Adapters on a weight stacked over experts cannot be
    gathered per row (`layers.with_lora` adds them weight-sized): an error."""
    flat_sets = [(traverse_util.flatten_dict(a), alpha) for a, alpha in adapter_sets]
    out = {}
    for name, k in sorted(kernels.items()):
        if k.path[-1] != "kernel":
            raise ValueError(
                f"Adapters on {name} (a weight stacked over experts) cannot be served per row; "
                "merge the adapter into the base and serve that instead."
            )
        a_path, b_path = adapter_paths(k.path)
        pairs = [(f.get(a_path), f.get(b_path), alpha) for f, alpha in flat_sets]
        rank = max(a.shape[-1] for a, _, _ in pairs if a is not None)
        s = k.num_stacked
        a_rows = [jnp.zeros(k.a_shape[:-1] + (rank,), jnp.float32)]
        b_rows = [jnp.zeros(k.b_shape[:s] + (rank,) + k.b_shape[s + 1 :], jnp.float32)]
        for a, b, alpha in pairs:
            if a is None:
                a_rows.append(a_rows[0])
                b_rows.append(b_rows[0])
                continue
            r = a.shape[-1]
            pad = rank - r
            a = a.astype(jnp.float32) * (alpha / r)
            a_rows.append(jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]))
            b = b.astype(jnp.float32)
            b_rows.append(jnp.pad(b, [(0, 0)] * s + [(0, pad)] + [(0, 0)] * (b.ndim - s - 1)))
        module = k.path[:-1]
        out[module + (ROWS_A,)] = jnp.stack(a_rows, axis=s)
        out[module + (ROWS_B,)] = jnp.stack(b_rows, axis=s)
    return traverse_util.unflatten_dict(out)


def stacked_adapter_axes(kernels: Mapping[str, AdaptedKernel]) -> Params:
    """The logical axes of `stack_adapters`' tree: the kernel's, the adapter and rank dims
    unsharded."""
    flat = {}
    for k in kernels.values():
        s = k.num_stacked
        module = k.path[:-1]
        flat[module + (ROWS_A,)] = P(*k.a_axes[:s], None, *k.a_axes[s:])
        flat[module + (ROWS_B,)] = P(*k.b_axes[:s], None, *k.b_axes[s:])
    return traverse_util.unflatten_dict(flat)


def with_row_adapters(base: Params, stacked: Params) -> Params:
    """`base` with `stack_adapters`' tree beside its kernels (the base's own arrays, no
    copy): the params under which `adapters_per_row` adapts each row."""
    flat = traverse_util.flatten_dict(base)
    for path, x in traverse_util.flatten_dict(stacked).items():
        if path[:-1] + ("kernel",) not in flat:
            raise ValueError(f"Adapter {'/'.join(path)} has no kernel in the base params.")
        flat[path] = x
    return traverse_util.unflatten_dict(flat)


@contextlib.contextmanager
def adapters_per_row(index: jax.Array) -> Iterator[None]:
    """Within, every `layers.DenseGeneral` whose params hold stacked adapters
    (`with_row_adapters`) adds to row `i` of its output (the batch dim leads) the update of
    adapter `index[i]` (int32 `[rows]`; 0: none). Traced inside the caller's jit: the
    gather is part of its program, `index` an argument like any other."""

    def add_rows(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        y = next_fun(*args, **kwargs)
        module = context.module
        if (
            context.method_name != "adapt"
            or not isinstance(module, layers.DenseGeneral)
            or not module.has_variable("params", ROWS_A)
        ):
            return y
        x = args[0]
        axis = module.contracted(x.ndim)
        if 0 in axis or x.shape[0] != index.shape[0]:
            raise ValueError(
                f"{'/'.join(module.path)}: input {x.shape} has no leading dim of the "
                f"{index.shape[0]} rows that adapters_per_row indexes."
            )
        dtype = layers.as_dtype(module.dtype)
        a = module.get_variable("params", ROWS_A)[index].astype(dtype)  # [rows, in..., R]
        b = module.get_variable("params", ROWS_B)[index].astype(dtype)  # [rows, R, out...]
        batch = ((0,), (0,))
        xa = jax.lax.dot_general(
            x.astype(dtype), a, ((axis, tuple(range(1, len(axis) + 1))), batch)
        )  # [rows, free..., R]
        update = jax.lax.dot_general(xa, b, (((xa.ndim - 1,), (1,)), batch))
        return y + update.astype(y.dtype)

    with nn.intercept_methods(add_rows):
        yield
