"""TLS and basic auth for the exporter's HTTP endpoints, from a Prometheus exporter-toolkit web config file.

``frexporter serve --web-config FILE`` reads the same file format as every Prometheus exporter's
``--web.config.file`` (https://prometheus.io/docs/prometheus/latest/configuration/https/), so the
Prometheus side (``scheme: https``, ``tls_config``, ``basic_auth``) is configured as for any exporter::

    tls_server_config:
      cert_file: server.crt            # relative paths are relative to this file; or inline PEM in `cert`
      key_file: server.key             # or inline PEM in `key`
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: ca.crt           # or inline PEM in `client_ca`
      min_version: TLS12
    basic_auth_users:
      prometheus: $2y$10$...           # bcrypt hash, e.g. `htpasswd -nBC 10 "" | tr -d ':\\n'`
    http_server_config:
      headers:
        Strict-Transport-Security: max-age=31536000
    rate_limit:                        # a token bucket over every request; over it: 429
      interval: 100ms                  # one request per interval on average (0 turns it off)
      burst: 20

Everything is validated when the file is loaded; a :class:`WebConfigError` names the key at fault.
Differences from exporter-toolkit, each refused with a message rather than silently ignored:
``cipher_suites`` and ``curve_preferences`` (Go names; OpenSSL's defaults apply), the client auth
types that ask for a certificate without verifying it (Python's ``ssl`` always verifies what it asks for),
``min_version``/``max_version`` TLS10 and TLS11 (OpenSSL 3 refuses those handshakes at its default security
level, so the setting could not be honoured), and a ``rate_limit`` burst of 0 (Go refuses every request then).
Certificate and key files are reloaded when they change on disk (cert-manager rotation); inline PEM
(``cert``, ``key``, ``client_ca``) and the users are read once at start-up.

The file is YAML (PyYAML, ``pip install 'frexporter[auth]'``); without PyYAML a JSON file is accepted.
Basic auth needs ``bcrypt`` (the same extra).

This module is the entry point; the pieces, each with one job:

- ``config_model``: the validated types (``WebConfig``, ``TLSServerConfig``, ``RateLimit``), the values each key
  may take, ``WebConfigError``; no I/O
- ``config_parse``: the parsed document to a ``WebConfig``, key by key (``parse``)
- ``config_file``: reading the file (``load_web_config``)
- ``tls_context``: the SSL context, built and rebuilt when its files change (``TLSContextSource``)
- ``basic_auth``: checking ``Authorization: Basic`` (``BasicAuth``)
- ``exposure``: where the debug endpoints may listen (``check_debug_exposure``)
"""

from __future__ import annotations

from frexporter.web.basic_auth import BasicAuth, parse_basic
from frexporter.web.config_file import MAX_FILE_BYTES, load_web_config
from frexporter.web.config_model import (
    ALLOWED_HEADERS,
    CLIENT_AUTH_TYPES,
    HEADER_VALUES,
    MAX_HEADER_VALUE,
    NO_CLIENT_CERT,
    REQUIRE_AND_VERIFY,
    TLS_VERSIONS,
    UNSUPPORTED_TLS_VERSIONS,
    VERIFY_IF_GIVEN,
    RateLimit,
    TLSServerConfig,
    WebConfig,
    WebConfigError,
)
from frexporter.web.config_parse import parse
from frexporter.web.exposure import check_debug_exposure, is_loopback
from frexporter.web.tls_context import TLSContextSource

# The name benchmarks/fuzz.py looks up for the Authorization header's parser.
_parse_basic = parse_basic

__all__ = [
    "ALLOWED_HEADERS",
    "CLIENT_AUTH_TYPES",
    "HEADER_VALUES",
    "MAX_FILE_BYTES",
    "MAX_HEADER_VALUE",
    "NO_CLIENT_CERT",
    "REQUIRE_AND_VERIFY",
    "TLS_VERSIONS",
    "UNSUPPORTED_TLS_VERSIONS",
    "VERIFY_IF_GIVEN",
    "BasicAuth",
    "RateLimit",
    "TLSContextSource",
    "TLSServerConfig",
    "WebConfig",
    "WebConfigError",
    "_parse_basic",
    "check_debug_exposure",
    "is_loopback",
    "load_web_config",
    "parse",
    "parse_basic",
]
