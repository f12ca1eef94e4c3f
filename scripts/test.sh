#!/usr/bin/env bash
# The whole test suite, with its own set-up. In CI (CI=true) a missing tool is a failure, never a skip.
# With no arguments it also runs the unit tests (not the e2e ones) against the lowest dependency versions
# pyproject.toml allows (.venv-lowest); with arguments it runs just `pytest ARGS` in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
if [ "${CI:-}" = "true" ]; then
  export FREXPORTER_REQUIRE_TOOLS=1
fi
.venv/bin/ruff check .  # every Python file in the repository (.gitignore'd ones aside)
.venv/bin/mypy  # the package, as pyproject.toml's [tool.mypy] says
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
if [ $# -eq 0 ]; then
  ./scripts/setup.sh --lowest
  # The unit tests (tests/unit/, which tests/conftest.py leaves unmarked: -m "not e2e" is the same set), and
  # the e2e halves of the modules that exercise the optional dependencies (prometheus-client's exposition,
  # OpenTelemetry, bcrypt and PyYAML, ssl), whose tests start processes (openssl for certificates, the OTLP
  # receiver, `frexporter serve`); their unit halves ran in the first command.
  .venv-lowest/bin/python -m pytest -q -p no:cacheprovider -m "not e2e"
  .venv-lowest/bin/python -m pytest -q -p no:cacheprovider -m e2e tests/e2e/test_otlp.py tests/e2e/test_security.py \
    tests/e2e/test_web_hostile.py tests/e2e/test_http_hardening.py tests/e2e/test_golden_metrics.py
  # The recorder and live-rank tests once more, against the newest torch release (its pin is in that script).
  ./scripts/test_newest_torch.sh
fi
