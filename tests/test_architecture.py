"""The house rules of DESIGN.md ("The house": Arrows and Never), checked on the source text.

Every module under flaxlm/ and tasks/ is parsed with `ast`, never imported. Every import counts,
including one inside a function: a cycle through a lazy import is still a cycle.

  - no import cycle among flaxlm/tasks modules;
  - no forbidden arrow (FORBIDDEN below: rings entry -> runs -> services -> core, plus the
    Never list);
  - no `_private` name of one module used in another (`mod._x` on an imported module, or
    `from mod import _x`); attributes of objects (`self._x`, `model._x`) are not module names;
  - no file under flaxlm/ longer than MAX_LINES lines.
"""

from __future__ import annotations

import ast
import fnmatch
import textwrap
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flaxlm", "tasks")
MAX_LINES = 500
LONG_FILES_ALLOWED = {"flaxlm/models/t5.py"}

# ---------------------------------------------------------------------------------------------
# Rings (DESIGN.md, "The house"). Patterns are fnmatch globs on dotted module names.

RUNS = ("flaxlm.runs", "flaxlm.runs.*", "flaxlm.plan", "flaxlm.plan.*")
SERVICES = ("flaxlm.inference", "flaxlm.inference.*", "flaxlm.checkpoints", "flaxlm.checkpoints.*")
MODELS = ("flaxlm.models", "flaxlm.models.*")
# The folders of DESIGN.md's house; flaxlm/'s root holds only ENTRY_MODULES.
FOLDERS = (
    "runs",
    "inference",
    "checkpoints",
    "posttrain",
    "training",
    "data",
    "models",
    "parallel",
    "plan",
)
# main's flags and Gin, and --profile_startup's timeline of main's start.
ENTRY_MODULES = ("__init__.py", "main.py", "gin_utils.py", "startup.py")


def _matches(module: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def _is_entry(module: str) -> bool:
    """A module at flaxlm/'s root (`flaxlm.main`, `flaxlm.startup`, ...): the entry, the ring
    above the runs (the root holds nothing else; the package `flaxlm` itself is no ring)."""
    package, _, name = module.partition(".")
    return package == "flaxlm" and bool(name) and "." not in name and name not in FOLDERS


def _is_core(module: str) -> bool:
    if module == "tasks" or module.startswith("tasks."):
        return True  # SeqIO registrations sit at core level: data, vocabularies, not services
    return (
        module.startswith("flaxlm.")
        and not _matches(module, RUNS)
        and not _matches(module, SERVICES)
        and not _is_entry(module)
    )


def _group(*patterns: str) -> Callable[[str], bool]:
    return lambda module: _matches(module, patterns)


def _anything(module: str) -> bool:
    return True


CORE = _is_core


def SERVICE(module: str) -> bool:  # noqa: N802  (a ring, like CORE and RUN)
    return _matches(module, SERVICES)


RUN = _group(*RUNS)
ENTRY = _is_entry

# (source, target, reason): an import from a source module to a target module is forbidden.
FORBIDDEN: list[tuple[Callable[[str], bool], Callable[[str], bool], str]] = [
    (
        _group(*MODELS),
        _group("flaxlm.parallel.partitioning"),
        "a model knows logical axis names only, never the partitioner or a mesh",
    ),
    (_group("flaxlm.parallel.partitioning"), _group(*MODELS), "partitioning never imports a model"),
    (
        _group("flaxlm.models.decoding"),
        _group("flaxlm", "flaxlm.*"),
        "decoding is pure (the loops over any step function): it imports nothing of flaxlm's",
    ),
    (
        _group("flaxlm.checkpoints.hf"),
        _group("flaxlm.checkpoints.checkpointer"),
        "hf.py knows no orbax",
    ),
    (_group("flaxlm.checkpoints.hf"), _group("flaxlm.training.lora"), "hf.py knows no LoRA"),
    (
        _group("flaxlm.training.lora"),
        _group("flaxlm.checkpoints.hf"),
        "lora.py knows no file format",
    ),
    (
        _group("flaxlm.training.lora"),
        _group("flaxlm.checkpoints.checkpointer"),
        "lora.py knows no file format",
    ),
    (_group("flaxlm.checkpoints.checkpointer"), _group(*MODELS), "checkpoints.py knows no model"),
    (
        _group("flaxlm.models", "flaxlm.models.*", "flaxlm.parallel.*", "flaxlm.data.*"),
        _group(
            "flaxlm.runs",
            "flaxlm.runs.*",
            "flaxlm.inference",
            "flaxlm.inference.generation",
            "flaxlm.checkpoints",
            "flaxlm.checkpoints.*",
            "flaxlm.posttrain",
            "flaxlm.posttrain.*",
        ),
        "models, parallel and data know no run, generation service, checkpoint or objective",
    ),
    (
        _group("flaxlm.training", "flaxlm.training.*"),
        _group("flaxlm.posttrain", "flaxlm.posttrain.*"),
        "objectives plug into the steps through objective.Objective: training knows none of them",
    ),
    (
        lambda m: not _matches(m, ("flaxlm.runs", "flaxlm.runs.*", "flaxlm.main")),
        _group("flaxlm.runs.*"),
        "only main (and runs/ itself) imports a run",
    ),
    (CORE, SERVICE, "arrows point inward: the core never imports a service"),
    (CORE, RUN, "arrows point inward: the core never imports a run"),
    (SERVICE, RUN, "arrows point inward: a service never imports a run"),
    (CORE, ENTRY, "arrows point inward: the core never imports the entry"),
    (SERVICE, ENTRY, "arrows point inward: a service never imports the entry"),
    (_anything, _group("flaxlm.main"), "nothing imports main"),
]

# ---------------------------------------------------------------------------------------------
# Parsing


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: str  # file of the source module, relative to the repo
    line: int


@dataclass(frozen=True)
class PrivateUse:
    user: str
    owner: str
    name: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.user} -> {self.owner}.{self.name}  ({self.path}:{self.line})"


@dataclass
class Source:
    module: str
    path: str
    text: str
    is_package: bool = False
    tree: ast.Module = field(init=False)

    def __post_init__(self) -> None:
        self.tree = ast.parse(self.text, filename=self.path)


def module_name(rel_path: str) -> tuple[str, bool]:
    """`flaxlm/models/llama.py` -> ('flaxlm.models.llama', False); `__init__` -> (package, True)."""
    parts = list(Path(rel_path).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def load_repo_sources(root: Path = REPO) -> dict[str, Source]:
    sources = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            name, is_package = module_name(rel)
            sources[name] = Source(name, rel, path.read_text(encoding="utf-8"), is_package)
    return sources


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _import_base(source: Source, node: ast.ImportFrom) -> str:
    """The absolute module a `from X import ...` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = source.module.split(".")
    if not source.is_package:
        package = package[:-1]
    if node.level > 1:
        package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


class _Scope:
    def __init__(self, local_names: set[str] | None = None) -> None:
        self.modules: dict[str, str] = {}  # name -> the flaxlm/tasks module it is bound to
        self.local_names = local_names or set()  # other local bindings (they shadow outer ones)


def _function_locals(node: ast.AST) -> set[str]:
    """Names a function / lambda / comprehension binds itself (not in nested scopes)."""
    names: set[str] = set()
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is not None:
                names.add(arg.arg)
        body = [node.body] if isinstance(node, ast.Lambda) else node.body
    else:  # a comprehension: its targets
        body = [gen.target for gen in node.generators]
    declared_global: set[str] = set()
    stack = list(body)
    while stack:
        child = stack.pop()
        if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
            names.add(child.id)
        elif isinstance(child, ast.ExceptHandler) and child.name:
            names.add(child.name)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(child.name)
            stack.extend(child.decorator_list)
            continue  # a nested scope
        elif isinstance(child, ast.Global | ast.Nonlocal):
            declared_global.update(child.names)
        if isinstance(
            child, ast.Lambda | ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp
        ):
            continue
        stack.extend(ast.iter_child_nodes(child))
    return names - declared_global


class _ModuleVisitor(ast.NodeVisitor):
    """Collects a module's import edges and its uses of other modules' private names."""

    def __init__(self, source: Source, modules: set[str]) -> None:
        self.source = source
        self.modules = modules
        self.edges: list[Edge] = []
        self.private: list[PrivateUse] = []
        self.scopes = [_Scope()]

    def _ours(self, name: str) -> bool:
        return name.split(".")[0] in PACKAGES

    def _edge(self, target: str, node: ast.AST) -> None:
        if target in self.modules and target != self.source.module:
            self.edges.append(Edge(self.source.module, target, self.source.path, node.lineno))

    def _private(self, owner: str, name: str, node: ast.AST) -> None:
        if owner != self.source.module:
            self.private.append(
                PrivateUse(self.source.module, owner, name, self.source.path, node.lineno)
            )

    # imports ---------------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if not self._ours(alias.name):
                continue
            self._edge(alias.name, node)
            if alias.asname:
                if alias.name in self.modules:
                    self.scopes[-1].modules[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                if top in self.modules:
                    self.scopes[-1].modules[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _import_base(self.source, node)
        if not self._ours(base):
            return
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            if alias.name != "*" and submodule in self.modules:
                self._edge(submodule, node)
                self.scopes[-1].modules[alias.asname or alias.name] = submodule
            else:
                self._edge(base, node)
                if _is_private(alias.name) and base in self.modules:
                    self._private(base, alias.name, node)

    # scopes ----------------------------------------------------------------------------------
    def _visit_scope(self, node: ast.AST, inner: list[ast.AST]) -> None:
        self.scopes.append(_Scope(_function_locals(node)))
        for child in inner:
            self.visit(child)
        self.scopes.pop()

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        # Decorators, defaults and annotations are evaluated in the enclosing scope.
        args = node.args
        outer: list[ast.AST] = [*args.defaults, *filter(None, args.kw_defaults)]
        if not isinstance(node, ast.Lambda):
            every_arg = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            annotations = [a.annotation for a in every_arg if a is not None]
            outer += [
                *node.decorator_list,
                *filter(None, annotations),
                *filter(None, [node.returns]),
            ]
        for child in outer:
            self.visit(child)
        self._visit_scope(node, [node.body] if isinstance(node, ast.Lambda) else node.body)

    def _visit_comprehension(self, node: ast.AST) -> None:
        self._visit_scope(node, [g for g in ast.iter_child_nodes(node)])

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function
    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _visit_comprehension

    def _lookup(self, name: str) -> str | None:
        for scope in reversed(self.scopes):
            if name in scope.modules:
                return scope.modules[name]
            if name in scope.local_names:
                return None
        return None

    # `module._x`, `package.submodule._x` -------------------------------------------------------
    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = []
        base: ast.AST = node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and (module := self._lookup(base.id)):
            for attr in reversed(chain):
                if f"{module}.{attr}" in self.modules:
                    module = f"{module}.{attr}"
                    continue
                if _is_private(attr):
                    self._private(module, attr, node)
                break
            return  # the inner attributes of this chain were resolved here
        self.generic_visit(node)


@dataclass
class Graph:
    edges: list[Edge]
    private: list[PrivateUse]

    def adjacency(self) -> dict[str, dict[str, str]]:
        """source -> target -> where: `path:line` of every import of target in source."""
        lines: dict[tuple[str, str], list[int]] = {}
        paths = {}
        for edge in self.edges:
            lines.setdefault((edge.source, edge.target), []).append(edge.line)
            paths[edge.source] = edge.path
        adj: dict[str, dict[str, str]] = {}
        for (source, target), numbers in lines.items():
            where = f"{paths[source]}:{', '.join(map(str, sorted(set(numbers))))}"
            adj.setdefault(source, {})[target] = where
        return adj


def analyse(sources: dict[str, Source]) -> Graph:
    modules = set(sources)
    graph = Graph([], [])
    for source in sources.values():
        visitor = _ModuleVisitor(source, modules)
        visitor.visit(source.tree)
        graph.edges.extend(visitor.edges)
        graph.private.extend(visitor.private)
    return graph


def analyse_texts(files: dict[str, str]) -> Graph:
    """For the self-tests: {relative path: source text} -> Graph."""
    sources = {}
    for rel, text in files.items():
        name, is_package = module_name(rel)
        sources[name] = Source(name, rel, textwrap.dedent(text), is_package)
    return analyse(sources)


# ---------------------------------------------------------------------------------------------
# Checks: each returns every violation as a readable line.


def _strongly_connected(adj: dict[str, dict[str, str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    nodes = sorted(set(adj) | {t for targets in adj.values() for t in targets})

    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(adj.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(adj.get(child, {})))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def _shortest_path(adj: dict[str, dict[str, str]], start: str, goal: str, within: set[str]):
    previous = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = [node]
            while previous[path[-1]] is not None:
                path.append(previous[path[-1]])
            return path[::-1]
        for child in sorted(adj.get(node, {})):
            if child in within and child not in previous:
                previous[child] = node
                queue.append(child)
    return None


def find_cycles(graph: Graph) -> list[str]:
    """One line per cycle: each import edge that lies on a cycle appears in at least one."""
    adj = graph.adjacency()
    lines = []
    for component in _strongly_connected(adj):
        if len(component) < 2:
            continue
        members = set(component)
        seen: set[tuple[str, ...]] = set()
        for source in component:
            for target in sorted(adj[source]):
                if target not in members:
                    continue
                back = _shortest_path(adj, target, source, members)
                cycle = [source, *back]  # source -> target -> ... -> source
                ring = cycle[:-1]
                start = ring.index(min(ring))
                key = tuple(ring[start:] + ring[:start])
                if key in seen:
                    continue
                seen.add(key)
                hops = [key[0]]
                for a, b in zip(key, key[1:] + key[:1]):
                    hops.append(f"-> {b} ({adj[a][b]})")
                lines.append(" ".join(hops))
    return lines


def find_forbidden_arrows(graph: Graph) -> list[str]:
    lines = []
    for source, targets in sorted(graph.adjacency().items()):
        for target, where in sorted(targets.items()):
            for source_ok, target_ok, reason in FORBIDDEN:
                if source_ok(source) and target_ok(target):
                    lines.append(f"{source} -> {target} ({where}): {reason}")
    return lines


def find_private_uses(graph: Graph) -> list[str]:
    uses = sorted(set(graph.private), key=lambda u: (u.user, u.owner, u.name, u.line))
    return [str(use) for use in uses]


def find_long_files(root: Path = REPO) -> list[str]:
    lines = []
    for path in sorted((root / "flaxlm").rglob("*")):
        rel = path.relative_to(root).as_posix()
        if not path.is_file() or "__pycache__" in path.parts or rel in LONG_FILES_ALLOWED:
            continue
        try:
            count = len(path.read_text(encoding="utf-8").splitlines())
        except UnicodeDecodeError:
            continue  # not text
        if count > MAX_LINES:
            lines.append(f"{rel}: {count} lines (limit {MAX_LINES})")
    return lines


def _report(title: str, violations: list[str]) -> str:
    return f"{title} ({len(violations)}):\n  " + "\n  ".join(violations)


# ---------------------------------------------------------------------------------------------
# The tree as it is


@pytest.fixture(scope="module")
def repo_sources() -> dict[str, Source]:
    return load_repo_sources()


@pytest.fixture(scope="module")
def repo_graph(repo_sources) -> Graph:
    return analyse(repo_sources)


def test_sources_are_found(repo_sources, repo_graph):
    assert {"flaxlm", "flaxlm.parallel.partitioning", "flaxlm.models.base", "tasks"} <= set(
        repo_sources
    )
    assert repo_graph.edges, "no import edges found: the parser is broken"


def test_no_import_cycle(repo_graph):
    cycles = find_cycles(repo_graph)
    assert not cycles, _report("import cycles (an import inside a function counts)", cycles)


def test_no_forbidden_arrow(repo_graph):
    arrows = find_forbidden_arrows(repo_graph)
    assert not arrows, _report("forbidden imports (DESIGN.md, Arrows / Never)", arrows)


def test_no_private_name_used_outside_its_module(repo_graph):
    uses = find_private_uses(repo_graph)
    assert not uses, _report("private names used outside their module (user -> owner._x)", uses)


def test_the_folders_of_the_house_exist_and_the_root_holds_only_the_entry():
    root = REPO / "flaxlm"
    assert all((root / folder / "__init__.py").is_file() for folder in FOLDERS)
    modules = sorted(p.name for p in root.glob("*.py"))
    assert modules == sorted(ENTRY_MODULES), f"flaxlm/ holds {modules}: move them into a folder"
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(FOLDERS)


def find_reexports(root: Path = REPO) -> list[str]:
    """Names imported in flaxlm/ to be used elsewhere: `from x import y  # noqa: F401`, or
    an imported name listed in the module's `__all__`."""
    out = []
    for path in sorted((root / "flaxlm").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        lines = path.read_text(encoding="utf-8").splitlines()
        where = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and "noqa: F401" in lines[node.lineno - 1]:
                out.append(f"{where}:{node.lineno}")
        imported = {
            (alias.asname or alias.name).split(".")[0]
            for node in tree.body
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        for node in tree.body:
            targets = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            if "__all__" in targets and isinstance(node.value, ast.List | ast.Tuple):
                listed = {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
                out += [f"{where}:{node.lineno} __all__ {n}" for n in sorted(listed & imported)]
    return out


def test_no_module_reexports_another_modules_names():
    found = find_reexports()
    assert not found, _report("re-exports (import from the defining module instead)", found)


def test_no_file_names_collide_across_the_house():
    """No two modules named `infer`/`inference` or `train`/`trainer`, and no module named
    after a library it would shadow."""
    names = {p.stem for p in (REPO / "flaxlm").rglob("*.py")}
    for pair in ({"infer", "inference"}, {"train", "trainer"}):
        assert not pair <= names, pair
    assert not names & {"orbax", "seqio", "jax", "flax", "transformers", "optax"}


def test_no_long_file():
    long_files = find_long_files()
    assert not long_files, _report("files under flaxlm/ that are too long", long_files)


# ---------------------------------------------------------------------------------------------
# The checker on synthetic sources (so the checks above cannot pass vacuously)


def test_checker_finds_a_cycle_through_an_import_inside_a_function():
    graph = analyse_texts(
        {
            "flaxlm/__init__.py": "",
            "flaxlm/trainer.py": """
                from flaxlm import data

                def train():
                    from flaxlm import evaluation
                    return evaluation
            """,
            "flaxlm/evaluation.py": "import flaxlm.trainer\n",
            "flaxlm/data.py": "",
        }
    )
    cycles = find_cycles(graph)
    assert cycles == [
        "flaxlm.evaluation -> flaxlm.trainer (flaxlm/evaluation.py:1)"
        " -> flaxlm.evaluation (flaxlm/trainer.py:5)"
    ]


def test_checker_reports_every_edge_of_a_tangle():
    graph = analyse_texts(
        {
            "flaxlm/a.py": "import flaxlm.b\n",
            "flaxlm/b.py": "def f():\n    from flaxlm import c\n",
            "flaxlm/c.py": "from flaxlm import a, b\nfrom flaxlm.b import f\n",
            "flaxlm/d.py": "from flaxlm import a\n",  # leads into the tangle, not part of it
        }
    )
    assert find_cycles(graph) == [
        "flaxlm.a -> flaxlm.b (flaxlm/a.py:1) -> flaxlm.c (flaxlm/b.py:2)"
        " -> flaxlm.a (flaxlm/c.py:1)",
        "flaxlm.b -> flaxlm.c (flaxlm/b.py:2) -> flaxlm.b (flaxlm/c.py:1, 2)",
    ]


def test_checker_resolves_from_imports_of_submodules_and_packages():
    graph = analyse_texts(
        {
            "flaxlm/__init__.py": "X = 1\n",
            "flaxlm/other.py": "",
            "flaxlm/models/__init__.py": "from . import base\nfrom .base import Model\n",
            "flaxlm/models/base.py": "from ..parallel.partitioning import P\nfrom .. import X\n",
            "flaxlm/parallel/partitioning.py": "",
            "flaxlm/user.py": """
                from flaxlm import other, X
                import flaxlm.models.base as b
                from flaxlm.models import *
            """,
        }
    )
    edges = {(e.source, e.target) for e in graph.edges}
    assert edges == {
        ("flaxlm.models", "flaxlm.models.base"),
        ("flaxlm.models.base", "flaxlm.parallel.partitioning"),
        ("flaxlm.models.base", "flaxlm"),
        ("flaxlm.user", "flaxlm.other"),
        ("flaxlm.user", "flaxlm"),
        ("flaxlm.user", "flaxlm.models.base"),
        ("flaxlm.user", "flaxlm.models"),
    }
    assert find_cycles(graph) == []
    assert find_forbidden_arrows(graph) == [
        "flaxlm.models.base -> flaxlm.parallel.partitioning (flaxlm/models/base.py:1): "
        "a model knows logical axis names only, never the partitioner or a mesh"
    ]


def test_checker_applies_the_rings():
    graph = analyse_texts(
        {
            "flaxlm/__init__.py": "",
            "flaxlm/main.py": "from flaxlm.runs import train\n",
            "flaxlm/runs/train.py": (
                "from flaxlm.runs import evaluate\nfrom flaxlm.checkpoints import checkpointer\n"
                "from flaxlm.training import steps\n"
            ),
            "flaxlm/runs/evaluate.py": "from flaxlm.checkpoints import checkpointer\n",
            "flaxlm/checkpoints/checkpointer.py": (
                "from flaxlm.training import steps\nfrom flaxlm import gin_utils\n"
            ),
            "flaxlm/training/steps.py": "def f():\n    import flaxlm.checkpoints.checkpointer\n",
            "flaxlm/gin_utils.py": "",
            "flaxlm/logs.py": "",
            "flaxlm/startup.py": "",
            "flaxlm/data/input_process.py": (
                "from flaxlm import logs, startup\n\ndef serve():\n    from flaxlm import main\n"
            ),
            "flaxlm/inference/generation.py": "",
            "flaxlm/models/base.py": "from flaxlm.inference import generation\n",
            "flaxlm/runs/serve/__init__.py": "",
            "flaxlm/runs/serve/api.py": "from flaxlm import main\n",
            "tasks/__init__.py": "from flaxlm.runs.serve import api\n",
        }
    )
    assert sorted(find_forbidden_arrows(graph)) == [
        "flaxlm.checkpoints.checkpointer -> flaxlm.gin_utils "
        "(flaxlm/checkpoints/checkpointer.py:2): arrows point inward: a service never imports "
        "the entry",
        "flaxlm.data.input_process -> flaxlm.logs (flaxlm/data/input_process.py:1): "
        "arrows point inward: the core never imports the entry",
        "flaxlm.data.input_process -> flaxlm.main (flaxlm/data/input_process.py:4): "
        "arrows point inward: the core never imports the entry",
        "flaxlm.data.input_process -> flaxlm.main (flaxlm/data/input_process.py:4): "
        "nothing imports main",
        "flaxlm.data.input_process -> flaxlm.startup (flaxlm/data/input_process.py:1): "
        "arrows point inward: the core never imports the entry",
        "flaxlm.models.base -> flaxlm.inference.generation (flaxlm/models/base.py:1): "
        "arrows point inward: the core never imports a service",
        "flaxlm.models.base -> flaxlm.inference.generation (flaxlm/models/base.py:1): "
        "models, parallel and data know no run, generation service, checkpoint or objective",
        "flaxlm.runs.serve.api -> flaxlm.main (flaxlm/runs/serve/api.py:1): nothing imports main",
        "flaxlm.training.steps -> flaxlm.checkpoints.checkpointer (flaxlm/training/steps.py:2): "
        "arrows point inward: the core never imports a service",
        "tasks -> flaxlm.runs.serve.api (tasks/__init__.py:1): "
        "arrows point inward: the core never imports a run",
        "tasks -> flaxlm.runs.serve.api (tasks/__init__.py:1): only main (and runs/ itself) "
        "imports a run",
    ]
    assert len(find_cycles(graph)) == 1  # checkpointer <-> steps


def test_checker_finds_private_names_of_modules_only():
    graph = analyse_texts(
        {
            "flaxlm/__init__.py": "__version__ = '1'\n",
            "flaxlm/inference/decoding.py": "def _global_array(x): ...\n",
            "flaxlm/models/__init__.py": "",
            "flaxlm/models/base.py": "class BaseModel: ...\n",
            "flaxlm/runs/serve.py": """
                import flaxlm
                import flaxlm.models.base
                from flaxlm.inference import decoding as dec
                from flaxlm.inference.decoding import _global_array
                from flaxlm.models.base import BaseModel

                print(flaxlm.__version__, flaxlm.models.base._helper, BaseModel._boxed_init)

                def f(self, model, dec2=dec):
                    model._boxed_init()
                    self._x = dec._global_array(1)._shape
                    return dec2

                def g(dec):
                    return dec._not_the_module

                def h():
                    import flaxlm.inference.decoding as d
                    return d._lazy, [dec._in_comp for dec in ()]
            """,
        }
    )
    assert find_private_uses(graph) == [
        "flaxlm.runs.serve -> flaxlm.inference.decoding._global_array  (flaxlm/runs/serve.py:5)",
        "flaxlm.runs.serve -> flaxlm.inference.decoding._global_array  (flaxlm/runs/serve.py:12)",
        "flaxlm.runs.serve -> flaxlm.inference.decoding._lazy  (flaxlm/runs/serve.py:20)",
        "flaxlm.runs.serve -> flaxlm.models.base._helper  (flaxlm/runs/serve.py:8)",
    ]


def test_checker_finds_long_files(tmp_path):
    (tmp_path / "flaxlm" / "models").mkdir(parents=True)
    (tmp_path / "flaxlm" / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "flaxlm" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "flaxlm" / "models" / "t5.py").write_text("x = 1\n" * 900)
    assert find_long_files(tmp_path) == [f"flaxlm/long.py: {MAX_LINES + 1} lines (limit 500)"]


def test_checker_finds_reexports(tmp_path):
    (tmp_path / "flaxlm" / "runs").mkdir(parents=True)
    (tmp_path / "flaxlm" / "shim.py").write_text("from flaxlm.masks import Mask  # noqa: F401\n")
    (tmp_path / "flaxlm" / "runs" / "__init__.py").write_text(
        "from flaxlm.runs.api import parse, used\n\n__all__ = ['parse', 'run']\n\n"
        "def run():\n    return used\n"
    )
    assert find_reexports(tmp_path) == [
        "flaxlm/runs/__init__.py:3 __all__ parse",
        "flaxlm/shim.py:1",
    ]
