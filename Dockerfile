# frexporter node exporter: `frexporter serve` with the serve, otlp and auth extras, without torch (the
# recorder runs in the training image, whose plain `pip install frexporter` pulls no dependency at all).
#   docker build -t frexporter .
#   docker run --rm -p 9477:9477 -v /run/frexporter:/run/frexporter:ro frexporter
# BASE_IMAGE is any image with python3 (>= 3.10) and its venv module: the official python image (the default),
# or a Debian one with the python3, python3-venv and ca-certificates packages, whose system Python has no pip
# (PEP 668). Both stages install into a virtual environment, so either works, e.g.
#   podman build --build-arg BASE_IMAGE=localhost/frexporter-base:debian-bookworm -t frexporter .
# (scripts/build_image.sh builds such a base from Debian packages and the image from it, as CI does.)
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY . .
RUN python3 -m venv /tmp/build-venv \
    && /tmp/build-venv/bin/pip wheel --no-cache-dir --disable-pip-version-check --no-deps --wheel-dir /dist .

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FREXPORTER_DIR=/run/frexporter \
    PATH=/opt/frexporter/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY --from=build /dist /tmp/dist
RUN python3 -m venv /opt/frexporter \
    && /opt/frexporter/bin/pip install --no-cache-dir "$(ls /tmp/dist/*.whl)[serve,otlp,auth]" \
    && rm -rf /tmp/dist \
    && /opt/frexporter/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)" \
    && groupadd --system --gid 65532 nonroot \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin nonroot \
    && install -d -o 65532 -g 65532 -m 0700 /run/frexporter
USER 65532:65532
EXPOSE 9477
# Kubernetes ignores HEALTHCHECK (the chart probes /healthz itself); docker and compose use it. `python` is the
# venv's (first on PATH).
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('FREXPORTER_HEALTHCHECK_URL', 'http://127.0.0.1:9477/healthz'), timeout=4)"]
ENTRYPOINT ["frexporter"]
CMD ["serve"]
