"""What a plain `pip install -e .` (no extras) brings is what a shipped run imports: every
module flaxlm's runs import, including those the libraries import lazily on the way (a chat
template's jinja2), comes from the standard library or from a distribution that
`install_requires` pulls in. (`.ci/run` also runs every shipped Gin file in a venv of
`pip install -e .` alone: `.ci/plain_install_smoke.py`.)"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

from packaging.requirements import Requirement

# Runs on a view of site-packages that holds only what `pip install -e .` installs (the
# distributions install_requires pulls in; transformers then runs without torch, as it does
# there): imports what the entry, every shipped Gin file and the task modules import, then
# takes the lazy path a chat run and `serve`'s chat completions take (the shipped
# tokenizer's chat template).
AUDIT = """
import glob, json, sys
import gin
import flaxlm.main, tasks
from flaxlm import gin_utils
for path in sorted(glob.glob("gin/*.gin")):
    gin.clear_config()
    gin_utils.parse_gin([path], finalize=False)
from flaxlm.data.vocabularies import HuggingFaceVocabulary
from tasks.chat import ChatRenderer
vocabulary = HuggingFaceVocabulary("data/chat/tokenizer")
ChatRenderer(vocabulary.tokenizer).ids([{"role": "user", "content": "hi"}], True)
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def plain_install_view(view: str, required: set[str]) -> None:
    """Links into `view` the top-level files and folders of every installed distribution in
    `required` (normalized names), and nothing else."""
    os.makedirs(view, exist_ok=True)
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"].lower().replace("_", "-")
        if name not in required or name == "flaxlm":
            continue
        for top in {f.parts[0] for f in dist.files or () if not f.parts[0].startswith("..")}:
            source = os.path.join(str(dist.locate_file("")), top)
            target = os.path.join(view, top)
            if os.path.exists(source) and not os.path.lexists(target):
                os.symlink(source, target)


def required_distributions(name: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """The normalized names of `name` and every distribution its requirements (with `extras`
    chosen) pull in, transitively."""
    seen: set[str] = set()
    todo = [(name, extras)]
    while todo:
        dist, chosen = todo.pop()
        key = dist.lower().replace("_", "-")
        if (key, chosen) in seen:
            continue
        seen.add((key, chosen))
        for text in importlib.metadata.requires(dist) or []:
            req = Requirement(text)
            marker_envs = [{"extra": e} for e in chosen] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in marker_envs):
                try:
                    importlib.metadata.distribution(req.name)
                except importlib.metadata.PackageNotFoundError:
                    continue  # a requirement for another platform
                todo.append((req.name, frozenset(req.extras)))
    return {key for key, _ in seen}


def test_every_module_a_shipped_run_imports_is_installed_by_a_plain_install(repo_dir, tmp_path):
    required = required_distributions("flaxlm")
    assert "torch" not in required  # (the test extra only)
    view = str(tmp_path / "site-packages")
    plain_install_view(view, required)
    result = subprocess.run(
        [sys.executable, "-S", "-c", AUDIT],  # -S: no site-packages but the view
        cwd=repo_dir,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([repo_dir, view])},
        timeout=300,
    )
    assert result.returncode == 0, (
        "a shipped run imports what `pip install -e .` does not install:\n" + result.stderr[-3000:]
    )
    modules = json.loads(result.stdout.strip().splitlines()[-1])
    assert "jinja2" in modules and "tensorflow" in modules  # the audit took both paths
    assert "torch" not in modules
