#!/usr/bin/env bash
# Install time and venv size of `pip install -e .` at two revisions, back to back with the
# same pip cache (run it twice: the first pass fills the cache).
#   bash benchmarks/install_size.sh [BEFORE_REV] [AFTER_REV]   (default ae9dbee HEAD)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for rev in "${1:-ae9dbee}" "${2:-HEAD}"; do
  mkdir -p "$work/$rev/src"
  git archive "$rev" | tar -x -C "$work/$rev/src"
  "$PYTHON" -m venv "$work/$rev/venv"
  "$work/$rev/venv/bin/pip" install -q --upgrade pip >/dev/null 2>&1
  start=$(date +%s.%N)
  (cd "$work/$rev/src" && "$work/$rev/venv/bin/pip" install -q -e . >/dev/null 2>&1)
  end=$(date +%s.%N)
  tf=$("$work/$rev/venv/bin/pip" list 2>/dev/null | grep -i '^tensorflow' | tr -s ' ' | paste -sd';')
  printf '%s install_s=%.1f venv_MiB=%s %s\n' "$rev" "$(echo "$end - $start" | bc)" \
    "$(du -sm "$work/$rev/venv" | cut -f1)" "$tf"
done
