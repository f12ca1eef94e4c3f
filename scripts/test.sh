#!/usr/bin/env bash
# The whole test suite, with its own set-up. In CI (CI=true) a missing tool is a failure, never a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
if [ "${CI:-}" = "true" ]; then
  export FREXPORTER_REQUIRE_TOOLS=1
fi
.venv/bin/ruff check frexporter tests benchmarks scripts
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
