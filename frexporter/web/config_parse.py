"""Validating a parsed web config document (the YAML's mapping) into a ``WebConfig``.

Every key is checked against exporter-toolkit's format and what this exporter can honour; every problem is a
``WebConfigError`` naming the file and the key. Pure, but for one check: a ``*_file`` named in
``tls_server_config`` must exist (relative names resolve against the config file's directory).
"""

from __future__ import annotations

import os
import re
import ssl
from typing import Any

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

# Visible ASCII, space and tab (RFC 9110 field-value, less obs-text): no CR/LF to split the response, no NUL or
# other controls, nothing http.server could not encode.
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")
# Go's time.ParseDuration, which exporter-toolkit's rate_limit.interval goes through: "1s", "1m30s", "250ms".
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

_TOP_KEYS = ("tls_server_config", "basic_auth_users", "http_server_config", "rate_limit")
_TLS_KEYS = (
    "cert",
    "key",
    "client_ca",
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "client_allowed_sans",
    "min_version",
    "max_version",
    "cipher_suites",
    "curve_preferences",
    "prefer_server_cipher_suites",
)
_RATE_KEYS = ("interval", "burst")
_HTTP_KEYS = ("headers", "http2")
_BCRYPT = re.compile(r"^\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}$")
_HASH_HINT = "generate one with: htpasswd -nBC 10 \"\" | tr -d ':\\n'"


def parse(obj: Any, base_dir: str = ".", path: str = "<web config>") -> WebConfig:
    """Validate the parsed document; relative file names resolve against ``base_dir`` as exporter-toolkit does."""
    if obj is None:  # an empty file: exporter-toolkit serves plain HTTP without auth
        obj = {}
    top = _mapping(obj, path, "", _TOP_KEYS)
    tls = None
    if top.get("tls_server_config") is not None:
        tls = _parse_tls(_mapping(top["tls_server_config"], path, "tls_server_config", _TLS_KEYS), base_dir, path)
    users = _parse_users(top.get("basic_auth_users"), path)
    headers: dict[str, str] = {}
    if top.get("http_server_config") is not None:
        http = _mapping(top["http_server_config"], path, "http_server_config", _HTTP_KEYS)
        if "http2" in http and not isinstance(http["http2"], bool):
            raise WebConfigError(f"web config {path}: http_server_config.http2 must be true or false")
        headers = _parse_headers(http.get("headers"), path)
    rate_limit = _parse_rate_limit(top.get("rate_limit"), path)
    return WebConfig(path=path, tls=tls, basic_auth_users=users, headers=headers, rate_limit=rate_limit)


def _mapping(obj: Any, path: str, where: str, known: tuple[str, ...]) -> dict[str, Any]:
    label = where or "the top level"
    if not isinstance(obj, dict):
        raise WebConfigError(f"web config {path}: {label} must be a mapping, got {_kind(obj)}")
    for key in obj:
        if key not in known:
            name = f"{where}.{key}" if where else str(key)
            raise WebConfigError(f"web config {path}: unknown key {name!r} (known in {label}: {', '.join(known)})")
    return obj


def _string(value: Any, path: str, key: str) -> str:
    if not isinstance(value, str):
        raise WebConfigError(f"web config {path}: {key} must be a string, got {_kind(value)}")
    return value


def _parse_tls(raw: dict[str, Any], base_dir: str, path: str) -> TLSServerConfig:
    for unsupported in ("cipher_suites", "curve_preferences"):
        if raw.get(unsupported):
            raise WebConfigError(
                f"web config {path}: tls_server_config.{unsupported} is not supported by "
                "frexporter (OpenSSL's defaults for the allowed TLS versions apply); remove it"
            )
    if "prefer_server_cipher_suites" in raw and not isinstance(raw["prefer_server_cipher_suites"], bool):
        # Accepted for compatibility: Go itself ignores it since 1.18.
        raise WebConfigError(f"web config {path}: tls_server_config.prefer_server_cipher_suites must be a boolean")
    files = _parse_tls_files(raw, base_dir, path)
    inline = _parse_tls_inline(raw, files, path)
    auth = _string(raw.get("client_auth_type") or NO_CLIENT_CERT, path, "tls_server_config.client_auth_type")
    if auth in ("RequestClientCert", "RequireAnyClientCert"):
        raise WebConfigError(
            f"web config {path}: tls_server_config.client_auth_type {auth} is not supported "
            f"(it accepts unverified certificates); use {VERIFY_IF_GIVEN} or {REQUIRE_AND_VERIFY}"
        )
    if auth not in CLIENT_AUTH_TYPES:
        raise WebConfigError(
            f"web config {path}: tls_server_config.client_auth_type {auth!r} is not one of "
            f"{', '.join(CLIENT_AUTH_TYPES)}"
        )
    ca_key = "client_ca" if inline["client_ca"] else "client_ca_file"
    if (files["client_ca_file"] or inline["client_ca"]) and auth == NO_CLIENT_CERT:
        raise WebConfigError(
            f"web config {path}: tls_server_config.{ca_key} is set but client_auth_type is "
            f"{NO_CLIENT_CERT}; set client_auth_type: {REQUIRE_AND_VERIFY}"
        )
    if auth != NO_CLIENT_CERT and not (files["client_ca_file"] or inline["client_ca"]):
        raise WebConfigError(
            f"web config {path}: tls_server_config.client_auth_type {auth} needs client_ca_file "
            "or client_ca (the CA that signs client certificates)"
        )
    sans_raw = raw.get("client_allowed_sans") or []
    if not isinstance(sans_raw, list) or not all(isinstance(s, str) and s for s in sans_raw):
        raise WebConfigError(f"web config {path}: tls_server_config.client_allowed_sans must be a list of strings")
    if sans_raw and auth != REQUIRE_AND_VERIFY:
        raise WebConfigError(
            f"web config {path}: tls_server_config.client_allowed_sans needs client_auth_type {REQUIRE_AND_VERIFY}"
        )
    versions = _parse_tls_versions(raw, path)
    return TLSServerConfig(
        cert_file=files["cert_file"],
        key_file=files["key_file"],
        client_auth_type=auth,
        client_ca_file=files["client_ca_file"],
        client_allowed_sans=tuple(sans_raw),
        min_version=versions["min_version"],
        max_version=versions["max_version"],
        **inline,
    )


def _parse_tls_files(raw: dict[str, Any], base_dir: str, path: str) -> dict[str, str]:
    files = {}
    for key in ("cert_file", "key_file", "client_ca_file"):
        value = raw.get(key)
        if value is None or value == "":
            files[key] = ""
            continue
        name = os.path.join(base_dir, _string(value, path, f"tls_server_config.{key}"))
        if not os.path.isfile(name):
            raise WebConfigError(f"web config {path}: tls_server_config.{key}: {name} does not exist or is not a file")
        files[key] = name
    return files


def _parse_tls_inline(raw: dict[str, Any], files: dict[str, str], path: str) -> dict[str, str]:
    """exporter-toolkit's inline PEM: ``cert``, ``key``, ``client_ca``, each instead of its ``*_file``."""
    inline = {}
    for key in ("cert", "key", "client_ca"):
        value = raw.get(key)
        text = "" if value is None else _string(value, path, f"tls_server_config.{key}")
        if text and files[f"{key}_file"]:
            # exporter-toolkit would quietly use the file; which one was meant is for the operator to say.
            raise WebConfigError(f"web config {path}: tls_server_config: set {key} or {key}_file, not both")
        if text and "-----BEGIN " not in text:
            # Never quoted back: for `key` that would put the secret in the logs.
            raise WebConfigError(
                f"web config {path}: tls_server_config.{key} must be PEM text (-----BEGIN ...), "
                f"not a file name; for a file use {key}_file"
            )
        inline[key] = text
    for key in ("cert", "key"):
        if not files[f"{key}_file"] and not inline[key]:
            raise WebConfigError(f"web config {path}: tls_server_config.{key}_file is required (or {key}, inline PEM)")
    return inline


def _parse_tls_versions(raw: dict[str, Any], path: str) -> dict[str, str]:
    versions = {}
    for key, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        value = _string(raw.get(key) or default, path, f"tls_server_config.{key}")
        if value not in TLS_VERSIONS:
            raise WebConfigError(
                f"web config {path}: tls_server_config.{key} {value!r} is not one of {', '.join(TLS_VERSIONS)}"
            )
        if value in UNSUPPORTED_TLS_VERSIONS:
            raise WebConfigError(
                f"web config {path}: tls_server_config.{key} {value} is not supported: TLS 1.0 and "
                f"1.1 are deprecated (RFC 8996) and {ssl.OPENSSL_VERSION} refuses their handshakes "
                "at its default security level; use TLS12 or TLS13"
            )
        if key == "min_version" and value == "TLS13" and not ssl.HAS_TLSv1_3:
            raise WebConfigError(
                f"web config {path}: tls_server_config.{key} TLS13: {ssl.OPENSSL_VERSION} has no TLS 1.3"
            )
        versions[key] = value
    if TLS_VERSIONS[versions["min_version"]] > TLS_VERSIONS[versions["max_version"]]:
        raise WebConfigError(
            f"web config {path}: tls_server_config.min_version {versions['min_version']} is above "
            f"max_version {versions['max_version']}"
        )
    return versions


def _parse_users(raw: Any, path: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise WebConfigError(
            f"web config {path}: basic_auth_users must be a mapping of user name to bcrypt hash, got {_kind(raw)}"
        )
    users = {}
    for user, hashed in raw.items():
        # YAML turns a bare `123` or `yes` into a number or a boolean; a user name must be text.
        if not isinstance(user, str) or not user or ":" in user:
            raise WebConfigError(
                f"web config {path}: basic_auth_users: user name {user!r} must be a non-empty string without ':'"
            )
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            raise WebConfigError(
                f"web config {path}: basic_auth_users.{user}: not a bcrypt hash ($2y$, $2b$ or $2a$); {_HASH_HINT}"
            )
        cost = int(_BCRYPT.match(hashed).group(1))  # type: ignore[union-attr]
        if not 4 <= cost <= 31:
            raise WebConfigError(f"web config {path}: basic_auth_users.{user}: bcrypt cost {cost} is out of range")
        users[user] = hashed
    if users:
        try:
            import bcrypt  # noqa: F401
        except ImportError as e:
            raise WebConfigError(
                f"web config {path}: basic_auth_users needs the bcrypt package: pip install 'frexporter[auth]'"
            ) from e
    return users


def _parse_headers(raw: Any, path: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise WebConfigError(f"web config {path}: http_server_config.headers must be a mapping")
    allowed = {h.lower(): h for h in ALLOWED_HEADERS}
    headers = {}
    for name, value in raw.items():
        canonical = allowed.get(str(name).lower())
        if canonical is None:
            raise WebConfigError(
                f"web config {path}: http_server_config.headers: {name!r} cannot be set (allowed: "
                f"{', '.join(ALLOWED_HEADERS)})"
            )
        text = _header_value(canonical, value, path)
        if text:  # exporter-toolkit: "unset if blank"
            headers[canonical] = text
    return headers


def _header_value(name: str, value: Any, path: str) -> str:
    where = f"web config {path}: http_server_config.headers.{name}"
    # YAML reads `X-XSS-Protection: 1` as a number; Go's decoder gives the string, so does this.
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    text = _string(value, path, f"http_server_config.headers.{name}").strip(" \t")
    if len(text) > MAX_HEADER_VALUE:
        raise WebConfigError(f"{where} is longer than {MAX_HEADER_VALUE} characters")
    if not _HEADER_VALUE.fullmatch(text):
        bad = next(c for c in text if not _HEADER_VALUE.fullmatch(c))
        what = "a line break" if bad in "\r\n" else f"the character {bad!r}"
        raise WebConfigError(f"{where} contains {what}: only printable ASCII, spaces and tabs may be sent")
    choices = HEADER_VALUES[name]
    if text and choices and text not in choices:
        raise WebConfigError(f"{where}: {text!r} is not one of {', '.join(choices)}")
    return text


def _parse_rate_limit(raw: Any, path: str) -> RateLimit | None:
    """exporter-toolkit's ``rate_limit: {interval, burst}``; None when it is off (no key, or interval 0)."""
    if raw is None:
        return None
    rate = _mapping(raw, path, "rate_limit", _RATE_KEYS)
    interval = _duration(rate.get("interval", 0), path, "rate_limit.interval")
    burst = rate.get("burst", 0)
    if not isinstance(burst, int) or isinstance(burst, bool) or burst < 0:
        raise WebConfigError(f"web config {path}: rate_limit.burst must be a whole number of requests, 0 or more")
    if interval == 0:
        return None
    if burst == 0:
        # Go's limiter with an empty bucket refuses every request: surely not what the file meant.
        raise WebConfigError(
            f"web config {path}: rate_limit.burst 0 with interval {rate['interval']} would refuse "
            "every request; set burst to 1 or more (or interval: 0 to turn rate limiting off)"
        )
    return RateLimit(interval=interval, burst=burst)


def _duration(value: Any, path: str, key: str) -> float:
    """Seconds from a Go duration ("1s", "1m30s", "250ms"); a bare 0 means none."""
    if value in (0, "0") and not isinstance(value, bool):  # Go's ParseDuration takes a bare "0" too
        return 0.0
    text = value if isinstance(value, str) else ""
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise WebConfigError(
            f"web config {path}: {key} must be a duration such as 1s, 500ms or 1m30s, got {value!r:.40}"
        )
    seconds = sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
    if not seconds < 86400 * 365:
        raise WebConfigError(f"web config {path}: {key} {text} is longer than a year")
    return seconds


def _kind(obj: Any) -> str:
    return "nothing" if obj is None else type(obj).__name__
