#!/usr/bin/env bash
# Sets up a virtualenv (frexporter[serve] + CPU torch) and runs `frexporter demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/frexporter demo "$@"
