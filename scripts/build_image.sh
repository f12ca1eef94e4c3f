#!/usr/bin/env bash
# Builds the exporter image from the repository's Dockerfile (the one that ships, nothing else) with podman: no
# Docker engine, no registry. Where a Docker engine runs, `docker build -t frexporter .` does the same from the
# official python image (docs/kubernetes.md, "The container image").
#
#   scripts/build_image.sh [--tag TAG] [--base-image IMAGE] [--root DIR]
#
# Without --base-image, the base is made from Debian packages with mmdebstrap (python3, python3-venv,
# ca-certificates, passwd; suite $DEBIAN_SUITE, default bookworm) and imported into podman as
# localhost/frexporter-base:debian-SUITE (made once, reused while that storage keeps it); the Dockerfile gets it
# as its BASE_IMAGE. The base trusts the build machine's own extra CAs (/usr/local/share/ca-certificates), since
# pip inside the build fetches frexporter's dependencies from PyPI through the same network. frexporter itself
# comes from this checkout (the Dockerfile's build stage makes its wheel).
# The build runs with --isolation=chroot and the vfs storage driver, which need no container runtime, no
# overlay mounts and no user namespaces: they work as root in an unprivileged sandbox (CI; running a
# container does not work there, see tests/e2e/test_image.py for what runs the image's contents instead).
# --root DIR keeps podman's storage under DIR (DIR/storage, DIR/run) instead of podman's default.
# Prints the image's tag on its last line. Needs podman and mmdebstrap (Debian packages; scripts/setup.sh
# --test installs them).
set -euo pipefail
cd "$(dirname "$0")/.."

tag=localhost/frexporter:dev
base=""
root=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag="$2"; shift 2 ;;
    --base-image) base="$2"; shift 2 ;;
    --root) root="$2"; shift 2 ;;
    *) echo "usage: $0 [--tag TAG] [--base-image IMAGE] [--root DIR]" >&2; exit 2 ;;
  esac
done

log() { printf '\033[1m[build-image]\033[0m %s\n' "$*" >&2; }

podman_args=(--storage-driver=vfs)
if [ -n "$root" ]; then
  mkdir -p "$root"
  root="$(cd "$root" && pwd)"
  podman_args+=(--root "$root/storage" --runroot "$root/run")
fi
pod() { podman "${podman_args[@]}" "$@"; }

if [ -z "$base" ]; then
  suite="${DEBIAN_SUITE:-bookworm}"
  base="localhost/frexporter-base:debian-$suite"
  if pod image exists "$base"; then
    log "reusing $base"
  else
    log "making $base from Debian packages (mmdebstrap $suite)"
    # The build needs: python3 and its venv module (the Dockerfile installs into a venv: Debian's Python has no
    # pip, PEP 668), passwd (useradd), ca-certificates (pip's TLS). Docs, man pages and translations left out.
    # shellcheck disable=SC2016  # $1 is the hook's argument (the new tree), expanded by mmdebstrap's shell
    mmdebstrap --quiet --variant=essential --include=python3,python3-venv,ca-certificates,passwd \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
      --customize-hook='set -e; for crt in /usr/local/share/ca-certificates/*.crt; do
          [ -f "$crt" ] || continue; mkdir -p "$1/usr/local/share/ca-certificates"
          cp "$crt" "$1/usr/local/share/ca-certificates/"; done
        chroot "$1" update-ca-certificates --fresh >/dev/null' \
      "$suite" - ${DEBIAN_MIRROR:+"$DEBIAN_MIRROR"} | pod import --quiet - "$base" >/dev/null
  fi
fi

log "building $tag from Dockerfile (BASE_IMAGE=$base)"
# --format docker keeps the HEALTHCHECK (OCI image configs have none); --layers=false commits each stage once
# (with vfs every committed layer is a full copy of the tree).
pod build --quiet --isolation=chroot --format docker --layers=false --build-arg "BASE_IMAGE=$base" \
  --tag "$tag" --file Dockerfile . >/dev/null
echo "$tag"
