# frexporter node exporter: `frexporter serve` with the serve, otlp and auth extras, without torch (the
# recorder runs in the training image, whose plain `pip install frexporter` pulls no dependency at all).
#   docker build -t frexporter .
#   docker run --rm -p 9477:9477 -v /run/frexporter:/run/frexporter:ro frexporter
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FREXPORTER_DIR=/run/frexporter
COPY --from=build /dist /tmp/dist
RUN pip install --no-cache-dir "$(ls /tmp/dist/*.whl)[serve,otlp,auth]" \
    && rm -rf /tmp/dist \
    && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)" \
    && groupadd --system --gid 65532 nonroot \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin nonroot \
    && install -d -o 65532 -g 65532 -m 0700 /run/frexporter
USER 65532:65532
EXPOSE 9477
# Kubernetes ignores HEALTHCHECK (the chart probes /healthz itself); docker and compose use it.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('FREXPORTER_HEALTHCHECK_URL', 'http://127.0.0.1:9477/healthz'), timeout=4)"]
ENTRYPOINT ["frexporter"]
CMD ["serve"]
