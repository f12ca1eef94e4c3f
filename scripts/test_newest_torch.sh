#!/usr/bin/env bash
# The recorder and the live-rank tests against the newest torch on PyPI, in .venv-newest-torch: the recorder
# feature-detects torch, so a new release can change what it finds (recorders, handlers, dump shapes) while
# .venv keeps the CPU build scripts/setup.sh pins. Called at the end of scripts/test.sh (no arguments), after
# scripts/setup.sh --test. It installs PyPI's default build of torch, with its CUDA libraries (several GB; its
# ranks run on the CPU all the same).
set -euo pipefail
cd "$(dirname "$0")/.."

# The newest torch release on PyPI. Bump it when a new release appears (and see whether these tests still pass).
NEWEST_TORCH=2.14.1
VENV=.venv-newest-torch
# The modules that start real torch ranks and read what their recorders write, wherever they are under tests/
# (a name may be there twice, its unit and its e2e half: both run).
MODULES=(test_recorder.py test_live_ranks.py test_verdicts_live.py test_activity.py)

log() { printf '\033[1m[newest-torch]\033[0m %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
if [ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null)" \
    != "$NEWEST_TORCH" ]; then
  log "installing torch==$NEWEST_TORCH"
  "$VENV/bin/pip" install --quiet "torch==$NEWEST_TORCH"
fi
log "installing frexporter (editable)"
"$VENV/bin/pip" install --quiet -e '.[serve,test]'

files=()
for module in "${MODULES[@]}"; do
  found="$(find tests -name "$module" -not -path '*/__pycache__/*' | sort)"
  if [ -z "$found" ]; then
    echo "$0: no $module under tests/" >&2
    exit 2
  fi
  while IFS= read -r path; do files+=("$path"); done <<< "$found"
done

if [ "${CI:-}" = "true" ]; then
  export FREXPORTER_REQUIRE_TOOLS=1  # as scripts/test.sh: a skip is a failure
fi
log "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'): ${files[*]}"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${files[@]}"
