"""Gin flags: --gin_file, --gin_search_paths, --gin.NAME=VALUE, --gin_bindings; the run.

Gin files are searched in the current directory, the repository's `gin/` and the installed
package's copy of it, so `--gin_file=gin/gptj_pretrain.gin` works from the repository root and
`--gin_file=gptj_pretrain.gin` from anywhere.
"""

from __future__ import annotations

import difflib
import glob
import importlib
import inspect
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import gin

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_DIR = os.path.dirname(_PACKAGE_DIR)

# Modules that moved when flaxlm/ became folders (DESIGN.md, "The house"): a Gin file (or a
# program) that imports an old path is told the new one. The one table of moves.
MOVED_MODULES = {
    "flaxlm.train": "flaxlm.runs.train",
    "flaxlm.grpo": "flaxlm.runs.grpo",
    "flaxlm.loop": "flaxlm.runs.loop",
    "flaxlm.evaluation": "flaxlm.runs.evaluate",
    "flaxlm.infer": "flaxlm.runs.infer",
    "flaxlm.convert": "flaxlm.runs.convert",
    "flaxlm.harness": "flaxlm.runs.harness",
    "flaxlm.serve": "flaxlm.runs.serve",
    "flaxlm.serve.api": "flaxlm.runs.serve.api",
    "flaxlm.serve.engine": "flaxlm.runs.serve.engine",
    "flaxlm.serve.http": "flaxlm.runs.serve.http",
    "flaxlm.serve.stream": "flaxlm.runs.serve.stream",
    "flaxlm.inference": "flaxlm.inference.generation",
    "flaxlm.decoding": "flaxlm.models.decoding",
    "flaxlm.inference.decoding": "flaxlm.models.decoding",
    "flaxlm.checkpoints": "flaxlm.checkpoints.checkpointer",
    "flaxlm.hf": "flaxlm.checkpoints.hf",
    "flaxlm.hf_files": "flaxlm.checkpoints.hf_files",
    "flaxlm.run_dir": "flaxlm.checkpoints.run_dir",
    "flaxlm.trainer": "flaxlm.training.steps",
    "flaxlm.train_state": "flaxlm.training.train_state",
    "flaxlm.optimizers": "flaxlm.training.optimizers",
    "flaxlm.lora": "flaxlm.training.lora",
    "flaxlm.preemption": "flaxlm.training.preemption",
    "flaxlm.metrics": "flaxlm.training.metrics",
    "flaxlm.objectives": "flaxlm.posttrain.loss_math",
    "flaxlm.preference": "flaxlm.posttrain.preference",
    "flaxlm.rl": "flaxlm.posttrain.rl",
    "flaxlm.rewards": "flaxlm.posttrain.rewards",
    "flaxlm.data": "flaxlm.data.pipeline",
    "flaxlm.vocabularies": "flaxlm.data.vocabularies",
    "flaxlm.packing": "flaxlm.data.packing",
    "flaxlm.partitioning": "flaxlm.parallel.partitioning",
    "flaxlm.pytrees": "flaxlm.parallel.pytrees",
    "flaxlm.platforms": "flaxlm.parallel.platforms",
    "flaxlm.aot": "flaxlm.plan.aot",
    "flaxlm.hlo": "flaxlm.plan.hlo",
    "flaxlm.chips": "flaxlm.plan.chips",
    "flaxlm.posttrain.objectives": "flaxlm.posttrain.loss_math",
    "flaxlm.data.jsonl": "flaxlm.data.jsonl_reader",
}


def moved_module_hint(error: BaseException) -> str | None:
    """ "flaxlm.X moved to flaxlm.Y" with the import to write, when `error` is an import of a
    module path in MOVED_MODULES; else None."""
    name = getattr(error, "name", None)
    text = str(error)
    for old in sorted(MOVED_MODULES, key=len, reverse=True):
        if name == old or f"'{old}'" in text or f"module {old} " in text:
            new = MOVED_MODULES[old]
            package, leaf = new.rsplit(".", 1)
            old_leaf = old.rsplit(".", 1)[1]
            alias = f" as {old_leaf}" if leaf != old_leaf else ""
            return (
                f"{old} moved to {new}: write `from {package} import {leaf}{alias}` "
                '(README.md, "What moved").'
            )
    return None


def default_search_paths() -> list[str]:
    """cwd, the repository root and its gin/, and the installed package's gin/ copy."""
    candidates = [
        os.getcwd(),
        _REPO_DIR,
        os.path.join(_REPO_DIR, "gin"),
        os.path.join(_PACKAGE_DIR, "gin"),
    ]
    return [p for p in dict.fromkeys(candidates) if os.path.isdir(p)]


def rewrite_gin_args(argv: Sequence[str]) -> list[str]:
    """Turns `--gin.NAME=VALUE` into `--gin_bindings=NAME = VALUE` (as t5x does)."""
    out = []
    for arg in argv:
        if arg.startswith("--gin.") and "=" in arg:
            name, value = arg[len("--gin.") :].split("=", 1)
            out.append(f"--gin_bindings={name} = {value}")
        else:
            out.append(arg)
    return out


def _find_file(name: str, search_paths: Sequence[str]) -> str:
    if os.path.isabs(name) or os.path.exists(name):
        if not os.path.exists(name):
            raise FileNotFoundError(f"Gin file {name!r} does not exist.")
        return name
    for root in search_paths:
        path = os.path.join(root, name)
        if os.path.exists(path):
            return path
    available = []
    for root in search_paths:
        for dirpath, _, files in os.walk(root):
            available += [
                os.path.relpath(os.path.join(dirpath, f), root) for f in files if f.endswith(".gin")
            ]
    close = difflib.get_close_matches(name, sorted(set(available)), n=3, cutoff=0.5)
    hint = f" Did you mean {close}?" if close else ""
    raise FileNotFoundError(f"Gin file {name!r} not found in {list(search_paths)}.{hint}")


# Gin's message for a name that no imported module has registered.
_UNREGISTERED = re.compile(r"^No configurable matching ")


def parse_gin(
    gin_files: Sequence[str],
    gin_bindings: Sequence[str] = (),
    search_paths: Sequence[str] = (),
    finalize: bool = True,
    registering_modules: Sequence[str] = (),
) -> None:
    """Parses files and bindings; raises with Gin's own message on any mistake.

    The modules a file imports (`from __gin__ import dynamic_registration`) register what it
    names, so a run loads the modules it uses and no others (an `infer` never imports the
    training input pipeline). A name that nothing imported has registered (a file without
    imports, a binding of a module no file imports) has `registering_modules` imported and
    everything parsed again; a name still unknown after that is the error."""
    paths = list(search_paths) + default_search_paths()
    for p in paths:
        gin.add_config_file_search_path(p)
    files = find_gin_files(gin_files, search_paths)
    try:
        _parse(files, gin_bindings, finalize)
    except ValueError as e:
        if not registering_modules or not _UNREGISTERED.match(str(e)):
            raise
        gin.clear_config()
        for module in registering_modules:
            importlib.import_module(module)
        _parse(files, gin_bindings, finalize)


def _parse(files: Sequence[str], gin_bindings: Sequence[str], finalize: bool) -> None:
    try:
        gin.parse_config_files_and_bindings(files, list(gin_bindings), finalize_config=finalize)
    except ImportError as e:
        hint = moved_module_hint(e)
        raise ImportError(f"{e}. {hint}" if hint else str(e)) from e


def find_gin_files(gin_files: Sequence[str], search_paths: Sequence[str] = ()) -> list[str]:
    """The path of each of `gin_files` (as given, else under `search_paths` and the default
    ones); a FileNotFoundError naming the closest files for one that is nowhere. Needs no
    configurable registered, so a mistyped path fails before the heavy imports."""
    paths = list(search_paths) + default_search_paths()
    return [_find_file(f, paths) for f in gin_files]


def _registered_configurables() -> dict[str, Any]:
    # Gin has no public listing of its registry; read it to suggest names, nothing more.
    return dict(gin.config._REGISTRY._selector_map)  # noqa: SLF001


def with_suggestion(message: str) -> str:
    """Gin's error message plus "Did you mean ...?" for a misspelled configurable/parameter."""
    first, newline, rest = message.partition("\n")
    registry = _registered_configurables()
    close: list[str] = []
    unknown = re.search(r"No configurable matching (?:reference )?'@?([\w.]+)", first)
    no_param = re.search(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'", first)
    if unknown:
        wanted = unknown.group(1).split(".")[-1]
        names = sorted({selector.split(".")[-1] for selector in registry})
        close = difflib.get_close_matches(wanted, names, n=3, cutoff=0.6)
    elif no_param:
        selector, wanted = no_param.groups()
        matches = [c for s, c in registry.items() if s == selector or s.endswith("." + selector)]
        if len(matches) == 1:
            params = list(inspect.signature(matches[0].wrapped).parameters)
            close = difflib.get_close_matches(wanted, params, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return first + hint + newline + rest


def _macro_references(value: Any, out: set[str]) -> set[str]:
    """The macros (`%NAME`) that a bound value refers to, nested values included."""
    if isinstance(value, gin.config.ConfigurableReference):
        selector = value.scoped_selector
        if selector.endswith("/gin.macro"):
            out.add(selector[: -len("/gin.macro")])
    elif isinstance(value, dict):
        for v in value.values():
            _macro_references(v, out)
    elif isinstance(value, list | tuple):
        for v in value:
            _macro_references(v, out)
    return out


def check_macros(gin_bindings: Sequence[str], search_paths: Sequence[str] = ()) -> None:
    """A ValueError for a macro set on the command line (`--gin.TRAIN_STEP=2`) that this
    run's bindings never use, when it looks like a misspelling: close to a macro they use,
    or used by no Gin file anywhere on the search paths. Call after parsing."""
    # Gin has no public view of its bindings; read them to find macro uses, nothing more.
    config = gin.config._CONFIG  # noqa: SLF001
    used: set[str] = set()
    for values in config.values():
        _macro_references(values, used)
    for binding in gin_bindings:
        name = binding.partition("=")[0].strip()
        if not re.fullmatch(r"[A-Za-z_]\w*", name) or name in used:
            continue
        close = difflib.get_close_matches(name, sorted(used), n=3, cutoff=0.8)
        if not close and _used_by_some_file(name, [*search_paths, *default_search_paths()]):
            continue  # another run's macro: harmless here
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"--gin.{name} sets a macro that nothing in the Gin files uses.{hint}")


def _used_by_some_file(macro: str, search_paths: Sequence[str]) -> bool:
    pattern = re.compile(rf"%{re.escape(macro)}\b")
    for root in search_paths:
        for path in glob.glob(os.path.join(root, "**", "*.gin"), recursive=True):
            with open(path) as f:
                if pattern.search(f.read()):
                    return True
    return False


def _strings_for_callables(value: Any, annotation: str) -> list[str]:
    """The strings in `value` where `annotation` expects callables (a Callable, or a
    sequence or mapping of them)."""
    if "Callable" not in annotation:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return [v for v in value if isinstance(v, str)]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, str)]
    return []


def check_callables() -> None:
    """A ValueError for a string bound where a configurable expects a function
    (`GrpoConfig.reward_fns = ['exact_match']` for `[@rewards.exact_match]`): Gin passes
    the string on, and the run would fail only when it calls it, perhaps after an earlier
    stage has trained. Call after parsing."""
    registry = gin.config._REGISTRY  # noqa: SLF001 - no public lookup of a selector
    config = gin.config._CONFIG  # noqa: SLF001
    for (scope, selector), params in config.items():
        try:
            configurable = registry.get_match(selector)
            signature = inspect.signature(configurable.wrapped)
        except (KeyError, TypeError, ValueError):
            continue
        for name, value in params.items():
            parameter = signature.parameters.get(name)
            if parameter is None:
                continue
            strings = _strings_for_callables(value, str(parameter.annotation))
            if not strings:
                continue
            where = f"{scope}/" if scope else ""
            short = ".".join(selector.split(".")[-1:])
            refs = []
            for text in strings:
                matches = sorted(s for s in _registered_configurables() if s.endswith("." + text))
                refs.append("@" + ".".join(matches[0].split(".")[-2:]) if matches else f"@{text}")
            fix = f"[{', '.join(refs)}]" if isinstance(value, list | tuple) else refs[0]
            raise ValueError(
                f"{where}{short}.{name}={value!r}: a function is a Gin reference, not a "
                f"string: write {fix}."
            )


@gin.configurable
def run(fn: Callable[[], Any] = gin.REQUIRED) -> Any:
    """The run function bound in Gin (`run.fn = @train`)."""
    return fn()


def bound_runs() -> list[str]:
    """The run functions the parsed config binds (`run.fn`, or each of `run_in_order.fns`)
    as "module.function" ("flaxlm.runs.train.train"); [] if none is bound."""

    def name(reference: Any) -> str:
        fn = getattr(getattr(reference, "configurable", None), "wrapped", None)
        return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', '')}"

    try:
        bound = gin.query_parameter("run.fn")
        if name(bound) == f"{__name__}.run_in_order":
            bound = gin.query_parameter("run_in_order.fns")
    except ValueError:
        return []
    return [name(r) for r in (bound if isinstance(bound, list | tuple) else [bound])]


@gin.configurable
def run_in_order(fns: Sequence[Callable[[], Any]] = gin.REQUIRED) -> list[Any]:
    """Several run functions, one after another (`run.fn = @run_in_order`, e.g.
    `run_in_order.fns = [@train.train, @infer.infer]`: fine-tune, then generate)."""
    return [fn() for fn in fns]
