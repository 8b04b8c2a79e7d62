"""The commands in README.md, docs/*.md and benchmarks/README.md name what exists, and their
links resolve.

From each fenced code block the commands flaxlm knows are collected (`python -m flaxlm.main`,
`python -m flaxlm.plan`, `python -m <module>`, `python benchmarks/<script>.py`, `bash <script>`,
also inside `srun ...` or a quoted `--command "..."`), and each is checked without running it:

  - every `--gin_file` is found as flaxlm finds it (`gin_utils.find_gin_files`);
  - the Gin files and the `--gin.X=Y` / `--gin_bindings` overrides parse with Gin
    (configurables, parameters and references checked against the registry that
    `flaxlm.main` imports), and a macro set on the command line is one a Gin file uses
    (`gin_utils.check_macros`); a value that is a shell placeholder (`$VAR`, `<...>`) is
    parsed as `None`, so its selector is still checked;
  - every other `--flag` is one of `flaxlm.main`'s absl flags (`flaxlm.plan`'s own first);
  - `python -m X` names an importable module, `python benchmarks/X.py` a script with each
    `--flag` given, and `bash X` a file; the lm-eval harness's `gin_file=` model args exist.

Gin parsing only: nothing trains, nothing compiles.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gin
import pytest
from absl import flags

from flaxlm import gin_utils, main
from flaxlm.plan import __main__ as plan_cli

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted(REPO.glob("docs/*.md")), REPO / "benchmarks/README.md"]
GUIDES = (
    "configuring",
    "data",
    "hf_checkpoints",
    "posttraining",
    "generation",
    "multiprocess",
    "reliability",
    "planner",
    "architecture",
    "adding_a_family",
    "moved",
)

FENCE = re.compile(r"^ {0,3}```([^\n]*)\n(.*?)^ {0,3}```", re.MULTILINE | re.DOTALL)
SHELL_INFO = ("", "sh", "bash", "shell", "console")
COMMAND_WORD = re.compile(r"\b(python3?|bash) ")
SEPARATORS = ";&|\n"
PLACEHOLDER = re.compile(r"\$|<[^>]*>")
PYTHONS = ("python", "python3")


@dataclass
class Command:
    where: str  # "docs/data.md:12"
    argv: list[str]  # from `python`/`bash` on

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


# ------------------------------------------------------------------ collecting commands


def code_blocks(text: str) -> Iterator[tuple[int, str]]:
    """(line number of the block's first line, its text) for each fenced shell block that
    holds a command (not python, JSON or Gin text)."""
    for m in FENCE.finditer(text):
        if m.group(1).strip() in SHELL_INFO and COMMAND_WORD.search(m.group(2)):
            yield text.count("\n", 0, m.start(2)) + 1, m.group(2)


def without_comments(script: str) -> str:
    """The script with its comments cut (a `#` that starts a word outside quotes, to the end
    of its line) and its line continuations joined."""
    out, quote, i = [], None, 0
    while i < len(script):
        c = script[i]
        if quote is None and c == "#" and (i == 0 or script[i - 1].isspace()):
            i = script.find("\n", i)
            i = len(script) if i < 0 else i
            continue
        if c == "\\" and quote != "'":
            out.append(script[i : i + 2])
            i += 2
            continue
        if c in "'\"" and quote in (None, c):
            quote = None if quote else c
        out.append(c)
        i += 1
    return "".join(out).replace("\\\n", " ")


def shell_words(script: str) -> list[list[str]]:
    """The simple commands of a shell script as word lists: split at ; & && | || and
    newlines, continuations joined, quotes removed, comments dropped."""
    lexer = shlex.shlex(without_comments(script), posix=True, punctuation_chars=SEPARATORS)
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    lexer.commenters = ""
    segments: list[list[str]] = [[]]
    for token in lexer:
        if all(c in SEPARATORS for c in token):
            segments.append([])
        else:
            segments[-1].append(token)
    return [words for words in segments if words]


def commands_in(script: str, where: str) -> list[Command]:
    found = []
    for words in shell_words(script):
        for i, word in enumerate(words):
            name = word.rsplit("/", 1)[-1]
            if (name in PYTHONS or word == "bash") and i + 1 < len(words):
                found.append(Command(where, words[i:]))
                break
            if any(f"{p} " in word for p in (*PYTHONS, "bash")):  # `--command "cd x && python ..."`
                found += commands_in(word, where)
    return found


def commands_of(text: str, name: str) -> list[Command]:
    """The commands of every block; a block that is not valid shell is a ValueError."""
    found = []
    for line, block in code_blocks(text):
        try:
            found += commands_in(block, f"{name}:{line}")
        except ValueError as e:
            raise ValueError(f"{name}:{line}: not a shell command: {e}") from e
    return found


# ------------------------------------------------------------------ checking commands


@pytest.fixture(scope="module")
def registry() -> Iterator[None]:
    """The configurables `flaxlm.main` registers before it parses Gin, and the tasks."""
    for module in (*main.REGISTERING_MODULES, "tasks"):
        importlib.import_module(module)
    yield
    gin.clear_config()


def flag_problem(arg: str, known: flags.FlagValues) -> str | None:
    name = arg.lstrip("-").split("=", 1)[0]
    if name in known or name.startswith("no") and name[2:] in known:
        return None
    return f"flag {arg.split('=', 1)[0]} is not a flag of flaxlm.main"


def split_main_args(args: list[str]) -> tuple[list[str], list[str], list[str], list[str]]:
    """(gin files, search paths, Gin bindings, problems) of `flaxlm.main`'s arguments."""
    files, paths, bindings, problems = [], [], [], []
    known = flags.FLAGS
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg.startswith("--gin.") and "=" in arg:
            selector, value = arg[len("--gin.") :].split("=", 1)
            bindings.append(f"{selector} = {value}")
            continue
        if not arg.startswith("-"):
            problems.append(f"unexpected argument {arg!r} (flaxlm.main takes flags only)")
            continue
        problem = flag_problem(arg, known)
        if problem:
            problems.append(problem)
            continue
        name, eq, value = arg.lstrip("-").partition("=")
        if not eq and name in known and not known[name].boolean and i < len(args):
            value, i = args[i], i + 1
        if name == "gin_file":
            files.append(value)
        elif name == "gin_search_paths":
            paths += value.split(",")
        elif name == "gin_bindings":
            bindings.append(value)
    return files, paths, bindings, problems


def unplaceholder(binding: str) -> str:
    """A binding whose value is a shell placeholder, with `None` for the value."""
    selector, _, value = binding.partition("=")
    return f"{selector.strip()} = None" if PLACEHOLDER.search(value) else binding


def gin_problems(files: list[str], paths: list[str], bindings: list[str]) -> list[str]:
    try:
        gin_utils.find_gin_files(files, paths)
    except FileNotFoundError as e:
        return [str(e)]
    if not files:
        return ["no --gin_file"]
    bindings = [unplaceholder(b) for b in bindings]
    gin.clear_config()
    logging.disable(logging.ERROR)  # Gin logs every search-path miss of an include
    try:
        gin_utils.parse_gin(files, bindings, paths, finalize=False)
        gin_utils.check_macros(bindings, paths)
    except Exception as e:  # noqa: BLE001 - any Gin mistake is the guide's mistake
        return [gin_utils.with_suggestion(str(e)).split("\n")[0]]
    finally:
        logging.disable(logging.NOTSET)
        gin.clear_config()
    return []


def main_problems(args: list[str]) -> list[str]:
    files, paths, bindings, problems = split_main_args(args)
    return problems + gin_problems(files, paths, bindings)


def harness_problems(args: list[str]) -> list[str]:
    """The `gin_file=` of `--model_args` (joined by `+`) exist."""
    problems = []
    for flag, value in zip(args, args[1:], strict=False):
        if flag != "--model_args":
            continue
        if value.startswith("{"):
            model_args = json.loads(value)
        else:
            model_args = dict(kv.split("=", 1) for kv in value.split(",") if "=" in kv)
        for name in str(model_args.get("gin_file", "")).split("+"):
            if name:
                try:
                    gin_utils.find_gin_files([name])
                except FileNotFoundError as e:
                    problems.append(str(e))
    return problems


def benchmark_problems(script: str, args: list[str]) -> list[str]:
    path = REPO / script
    if not path.is_file():
        return [f"{script} does not exist"]
    source = path.read_text() + (REPO / "benchmarks" / "bench_common.py").read_text()
    problems = []
    for arg in args:
        name = arg.split("=", 1)[0]
        if not name.startswith("--") or name == "--help":
            continue
        if f'"{name}"' not in source and f'"--{name[len("--no-") :]}"' not in source:
            problems.append(f"{script} has no flag {name}")
    return problems


def problems_of(command: Command) -> list[str]:
    argv = command.argv
    if argv[0] == "bash":
        script = argv[1]
        if PLACEHOLDER.search(script) or (REPO / script).is_file():
            return []
        return [f"bash script {script} does not exist"]
    if argv[1] == "-m":
        module, args = argv[2], argv[3:]
        if module == "flaxlm.main":
            return main_problems(args)
        if module == "flaxlm.plan":
            main_args, _ = plan_cli.translate(args)
            return main_problems(main_args)
        if importlib.util.find_spec(module) is None:
            hint = gin_utils.MOVED_MODULES.get(module)
            return [f"no module {module}" + (f" (it moved to {hint})" if hint else "")]
        return harness_problems(args) if module == "flaxlm.runs.harness" else []
    if argv[1].startswith("benchmarks/"):
        return benchmark_problems(argv[1], argv[2:])
    return []


def doc_problems(text: str, name: str) -> list[str]:
    return [f"{c}\n    {p}" for c in commands_of(text, name) for p in problems_of(c)]


# ------------------------------------------------------------------ links


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose(text: str) -> str:
    """The text outside fenced blocks and inline code."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose(path.read_text()), re.MULTILINE)}


def link_problems(path: Path, root: Path = REPO) -> list[str]:
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(root)}: ({target})"
        if not resolved.exists():
            problems.append(f"{where}: {file} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where}: no heading #{anchor} in {resolved.name}")
    return problems


# ------------------------------------------------------------------ the tests


def test_the_front_page_links_every_guide():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    for guide in GUIDES:
        assert (REPO / "docs" / f"{guide}.md").is_file(), guide
        assert f"(docs/{guide}.md)" in readme, guide


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_in_the_docs_names_what_exists(doc, registry):
    assert doc_problems(doc.read_text(), str(doc.relative_to(REPO))) == []


def test_the_docs_hold_the_commands_they_promise():
    found = {d: commands_of(d.read_text(), d.name) for d in DOCS}
    assert sum(len(c) for c in found.values()) >= 30, found
    quick_start = [c.argv for c in found[REPO / "README.md"]]
    assert ["python", "-m", "flaxlm.main", "--gin_file=gin/gptj_pretrain.gin"] in quick_start
    assert ["bash", ".ci/run"] in quick_start


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    assert link_problems(doc) == []


def test_what_moved_lists_gin_utils_table():
    page = (REPO / "docs" / "moved.md").read_text()
    rows = dict(re.findall(r"^\| `(flaxlm[\w.]*)` \| `(flaxlm[\w.]*)` \|$", page, re.MULTILINE))
    assert rows == gin_utils.MOVED_MODULES


def test_the_checker_flags_what_does_not_exist(registry, tmp_path):
    doc = """
```
python -m flaxlm.main --gin_file=gin/gptj_pretrain.gin --gin.TRAIN_STEPS=3
python -m flaxlm.main --gin_file=gin/no_such_file.gin
python -m flaxlm.main --gin_file=gin/gptj_pretrain.gin --gin_fiel=runs/eval.gin
python -m flaxlm.main --gin_file=gin/gptj_pretrain.gin --gin.Partitionr.mesh_shape="(1, -1, 1)"
python -m flaxlm.main --gin_file=gin/gptj_pretrain.gin --gin.train.totl_steps=3
python -m flaxlm.main --gin_file=gin/gptj_pretrain.gin --gin.TRAIN_STEP=3
srun python -m flaxlm.plan --gin_file=gin/gptj_pretrain.gin --topology=cpu:8 --mesure=2
python -m flaxlm.harness --model flaxlm --tasks hellaswag
python benchmarks/no_such_benchmark.py
python benchmarks/memory.py --seq-len 64 --sequense 8
bash .ci/no_such_script
```
"""
    problems = doc_problems(doc, "synthetic.md")
    expected = [
        "no_such_file.gin' not found",
        "--gin_fiel is not a flag",
        "No configurable matching 'Partitionr'",
        "doesn't have a parameter named 'totl_steps'. Did you mean 'total_steps'",
        "--gin.TRAIN_STEP sets a macro that nothing in the Gin files uses",
        "--mesure is not a flag",
        "no module flaxlm.harness (it moved to flaxlm.runs.harness)",
        "benchmarks/no_such_benchmark.py does not exist",
        "benchmarks/memory.py has no flag --sequense",
        "bash script .ci/no_such_script does not exist",
    ]
    assert len(problems) == len(expected), "\n".join(problems)
    for problem, words in zip(problems, expected, strict=True):
        assert words in problem, problem
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](missing.md) [anchor](#nowhere)\n# A heading\n")
    assert [p.split(": ", 2)[-1] for p in link_problems(page, tmp_path)] == [
        "missing.md does not exist",
        "no heading #nowhere in page.md",
    ]
