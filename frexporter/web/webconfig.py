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
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import ssl
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("frexporter.web.webconfig")

MAX_FILE_BYTES = 1024 * 1024

TLS_VERSIONS: Mapping[str, ssl.TLSVersion] = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
NO_CLIENT_CERT = "NoClientCert"
VERIFY_IF_GIVEN = "VerifyClientCertIfGiven"
REQUIRE_AND_VERIFY = "RequireAndVerifyClientCert"
CLIENT_AUTH_TYPES: Mapping[str, ssl.VerifyMode] = {
    NO_CLIENT_CERT: ssl.CERT_NONE,
    VERIFY_IF_GIVEN: ssl.CERT_OPTIONAL,
    REQUIRE_AND_VERIFY: ssl.CERT_REQUIRED,
}
# TLS 1.0 and 1.1 (deprecated by RFC 8996): OpenSSL 3 at its default security level fails their handshakes
# even with the context's minimum set to them, so accepting them would be a setting that is silently not honoured.
UNSUPPORTED_TLS_VERSIONS = ("TLS10", "TLS11")
# exporter-toolkit's allow-list: response headers a config may set, with the only values some of them may take
# (an empty tuple: any value). Anything else (Content-Type, WWW-Authenticate, Set-Cookie...) is refused.
HEADER_VALUES: Mapping[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (),
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": (),
    "Content-Security-Policy": (),
}
ALLOWED_HEADERS = tuple(HEADER_VALUES)
MAX_HEADER_VALUE = 8192
# Visible ASCII, space and tab (RFC 9110 field-value, less obs-text): no CR/LF to split the response, no NUL or
# other controls, nothing http.server could not encode.
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")
# Go's time.ParseDuration, which exporter-toolkit's rate_limit.interval goes through: "1s", "1m30s", "250ms".
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

_TOP_KEYS = ("tls_server_config", "basic_auth_users", "http_server_config", "rate_limit")
_TLS_KEYS = ("cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type", "client_ca_file",
             "client_allowed_sans", "min_version", "max_version", "cipher_suites", "curve_preferences",
             "prefer_server_cipher_suites")
_RATE_KEYS = ("interval", "burst")
_HTTP_KEYS = ("headers", "http2")
_BCRYPT = re.compile(r"^\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}$")
_HASH_HINT = "generate one with: htpasswd -nBC 10 \"\" | tr -d ':\\n'"


class WebConfigError(ValueError):
    """The web config file cannot be used; the message names the file and the key."""


# ---------------------------------------------------------------- model


@dataclass(frozen=True)
class TLSServerConfig:
    cert_file: str = ""
    key_file: str = ""
    client_auth_type: str = NO_CLIENT_CERT
    client_ca_file: str = ""
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    # Inline PEM, exporter-toolkit's alternative to each file; the key is a secret, kept out of repr and logs.
    cert: str = field(default="", repr=False)
    key: str = field(default="", repr=False)
    client_ca: str = field(default="", repr=False)

    @property
    def authenticates_clients(self) -> bool:
        """Only a required, verified certificate identifies every client."""
        return self.client_auth_type == REQUIRE_AND_VERIFY

    @property
    def has_client_ca(self) -> bool:
        return bool(self.client_ca_file or self.client_ca)

    def build_context(self) -> ssl.SSLContext:
        """A server context from the files as they are now; raises WebConfigError naming the file."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        _set_versions(ctx, self.min_version, self.max_version)
        self._load_cert_chain(ctx)
        ctx.verify_mode = CLIENT_AUTH_TYPES[self.client_auth_type]
        if self.has_client_ca:
            where = "inline client_ca" if self.client_ca else f"client_ca_file {self.client_ca_file}"
            try:
                # Inline CA certificates need no file: OpenSSL reads them from memory (cadata).
                if self.client_ca:
                    ctx.load_verify_locations(cadata=self.client_ca)
                else:
                    ctx.load_verify_locations(cafile=self.client_ca_file)
            except (OSError, ssl.SSLError, ValueError) as e:
                raise WebConfigError(f"tls_server_config: cannot load {where}: {_reason(e)}") from e
        return ctx

    def _load_cert_chain(self, ctx: ssl.SSLContext) -> None:
        where = (f"{'inline cert' if self.cert else f'cert_file {self.cert_file}'} with "
                 f"{'inline key' if self.key else f'key_file {self.key_file}'}")
        try:
            # load_cert_chain reads files only: inline PEM goes through a private file that is gone once loaded.
            with _pem_file(self.cert) as cert_path, _pem_file(self.key) as key_path:
                # A password callback: an encrypted key fails to load instead of OpenSSL prompting on a terminal.
                ctx.load_cert_chain(cert_path or self.cert_file, key_path or self.key_file, password=_no_password)
        except (OSError, ssl.SSLError) as e:
            raise WebConfigError(f"tls_server_config: cannot load {where}: {_reason(e)}") from e

    def peer_allowed(self, peer_cert: Mapping[str, Any] | None) -> bool:
        """``client_allowed_sans``: the verified client certificate must carry one of these SANs."""
        if not self.client_allowed_sans:
            return True
        if not peer_cert:
            return False
        sans = {str(value) for _kind, value in peer_cert.get("subjectAltName", ())}
        return any(san in sans for san in self.client_allowed_sans)


def _set_versions(ctx: ssl.SSLContext, min_version: str, max_version: str) -> None:
    wanted = TLS_VERSIONS[min_version], TLS_VERSIONS[max_version]
    ctx.minimum_version, ctx.maximum_version = wanted
    # Read back: a bound the TLS library adjusted on its own would not be the one the config asked for.
    if (ctx.minimum_version, ctx.maximum_version) != wanted:
        raise WebConfigError(f"tls_server_config: this OpenSSL ({ssl.OPENSSL_VERSION}) cannot set TLS versions "
                             f"{min_version} to {max_version}")


@contextmanager
def _pem_file(text: str) -> Iterator[str]:
    """``text`` as a file that only this process can read, for the duration of the block; "" for no text."""
    if not text:
        yield ""
        return
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None and os.path.isdir("/proc/self/fd"):
        # Anonymous memory: the key never reaches a file system, and nothing is left behind if the process dies.
        fd = memfd_create("frexporter-pem", os.MFD_CLOEXEC)
        try:
            with open(fd, "w", encoding="utf-8", closefd=False) as f:
                f.write(text)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    fd, path = tempfile.mkstemp(prefix="frexporter-", suffix=".pem")  # mode 0600, created exclusively
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        yield path
    finally:
        os.unlink(path)


def _no_password() -> str:
    return ""


@dataclass(frozen=True)
class RateLimit:
    """exporter-toolkit's ``rate_limit``: a token bucket of ``burst`` requests, one more every ``interval`` s."""

    interval: float
    burst: int


@dataclass(frozen=True)
class WebConfig:
    path: str
    tls: TLSServerConfig | None = None
    basic_auth_users: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    rate_limit: RateLimit | None = None

    @property
    def authenticates(self) -> bool:
        """Every request must prove who it is: basic auth users, or a required client certificate."""
        return bool(self.basic_auth_users) or (self.tls is not None and self.tls.authenticates_clients)


# ---------------------------------------------------------------- loading


def load_web_config(path: str) -> WebConfig:
    """Read and validate a web config file; every problem is a WebConfigError naming ``path``."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise WebConfigError(f"web config {path}: {e.strerror or e}") from e
    if len(data) > MAX_FILE_BYTES:
        raise WebConfigError(f"web config {path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WebConfigError(f"web config {path}: not UTF-8 text") from e
    config = parse(_load_yaml(text, path), base_dir=os.path.dirname(os.path.abspath(path)), path=path)
    if config.tls is not None:
        try:
            config.tls.build_context()  # a bad key or certificate fails now, not at the first scrape
        except WebConfigError as e:
            raise WebConfigError(f"web config {path}: {e}") from e
    return config


def _load_yaml(text: str, path: str) -> Any:
    try:
        import yaml
    except ImportError:
        try:
            return json.loads(text) if text.strip() else None
        except ValueError as e:
            raise WebConfigError(f"web config {path}: PyYAML is not installed, and the file is not JSON ({e}); "
                                 "pip install 'frexporter[auth]' or write the file as JSON") from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise WebConfigError(f"web config {path}: not valid YAML: {' '.join(str(e).split())}") from e
    except (ValueError, RecursionError) as e:  # e.g. an int of 5000 digits, or nesting thousands deep
        raise WebConfigError(f"web config {path}: cannot be read: {type(e).__name__}: {str(e)[:200]}") from e


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
            raise WebConfigError(f"web config {path}: tls_server_config.{unsupported} is not supported by "
                                 "frexporter (OpenSSL's defaults for the allowed TLS versions apply); remove it")
    if "prefer_server_cipher_suites" in raw and not isinstance(raw["prefer_server_cipher_suites"], bool):
        # Accepted for compatibility: Go itself ignores it since 1.18.
        raise WebConfigError(f"web config {path}: tls_server_config.prefer_server_cipher_suites must be a boolean")
    files = _parse_tls_files(raw, base_dir, path)
    inline = _parse_tls_inline(raw, files, path)
    auth = _string(raw.get("client_auth_type") or NO_CLIENT_CERT, path, "tls_server_config.client_auth_type")
    if auth in ("RequestClientCert", "RequireAnyClientCert"):
        raise WebConfigError(f"web config {path}: tls_server_config.client_auth_type {auth} is not supported "
                             f"(it accepts unverified certificates); use {VERIFY_IF_GIVEN} or {REQUIRE_AND_VERIFY}")
    if auth not in CLIENT_AUTH_TYPES:
        raise WebConfigError(f"web config {path}: tls_server_config.client_auth_type {auth!r} is not one of "
                             f"{', '.join(CLIENT_AUTH_TYPES)}")
    ca_key = "client_ca" if inline["client_ca"] else "client_ca_file"
    if (files["client_ca_file"] or inline["client_ca"]) and auth == NO_CLIENT_CERT:
        raise WebConfigError(f"web config {path}: tls_server_config.{ca_key} is set but client_auth_type is "
                             f"{NO_CLIENT_CERT}; set client_auth_type: {REQUIRE_AND_VERIFY}")
    if auth != NO_CLIENT_CERT and not (files["client_ca_file"] or inline["client_ca"]):
        raise WebConfigError(f"web config {path}: tls_server_config.client_auth_type {auth} needs client_ca_file "
                             "or client_ca (the CA that signs client certificates)")
    sans_raw = raw.get("client_allowed_sans") or []
    if not isinstance(sans_raw, list) or not all(isinstance(s, str) and s for s in sans_raw):
        raise WebConfigError(f"web config {path}: tls_server_config.client_allowed_sans must be a list of strings")
    if sans_raw and auth != REQUIRE_AND_VERIFY:
        raise WebConfigError(f"web config {path}: tls_server_config.client_allowed_sans needs client_auth_type "
                             f"{REQUIRE_AND_VERIFY}")
    versions = _parse_tls_versions(raw, path)
    return TLSServerConfig(cert_file=files["cert_file"], key_file=files["key_file"], client_auth_type=auth,
                           client_ca_file=files["client_ca_file"], client_allowed_sans=tuple(sans_raw),
                           min_version=versions["min_version"], max_version=versions["max_version"], **inline)


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
            raise WebConfigError(f"web config {path}: tls_server_config.{key} must be PEM text (-----BEGIN ...), "
                                 f"not a file name; for a file use {key}_file")
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
            raise WebConfigError(f"web config {path}: tls_server_config.{key} {value!r} is not one of "
                                 f"{', '.join(TLS_VERSIONS)}")
        if value in UNSUPPORTED_TLS_VERSIONS:
            raise WebConfigError(f"web config {path}: tls_server_config.{key} {value} is not supported: TLS 1.0 and "
                                 f"1.1 are deprecated (RFC 8996) and {ssl.OPENSSL_VERSION} refuses their handshakes "
                                 "at its default security level; use TLS12 or TLS13")
        if key == "min_version" and value == "TLS13" and not ssl.HAS_TLSv1_3:
            raise WebConfigError(f"web config {path}: tls_server_config.{key} TLS13: {ssl.OPENSSL_VERSION} has no "
                                 "TLS 1.3")
        versions[key] = value
    if TLS_VERSIONS[versions["min_version"]] > TLS_VERSIONS[versions["max_version"]]:
        raise WebConfigError(f"web config {path}: tls_server_config.min_version {versions['min_version']} is above "
                             f"max_version {versions['max_version']}")
    return versions


def _parse_users(raw: Any, path: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise WebConfigError(f"web config {path}: basic_auth_users must be a mapping of user name to bcrypt hash, "
                             f"got {_kind(raw)}")
    users = {}
    for user, hashed in raw.items():
        # YAML turns a bare `123` or `yes` into a number or a boolean; a user name must be text.
        if not isinstance(user, str) or not user or ":" in user:
            raise WebConfigError(f"web config {path}: basic_auth_users: user name {user!r} must be a non-empty "
                                 "string without ':'")
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            raise WebConfigError(f"web config {path}: basic_auth_users.{user}: not a bcrypt hash ($2y$, $2b$ or $2a$); "
                                 f"{_HASH_HINT}")
        cost = int(_BCRYPT.match(hashed).group(1))  # type: ignore[union-attr]
        if not 4 <= cost <= 31:
            raise WebConfigError(f"web config {path}: basic_auth_users.{user}: bcrypt cost {cost} is out of range")
        users[user] = hashed
    if users:
        try:
            import bcrypt  # noqa: F401
        except ImportError as e:
            raise WebConfigError(f"web config {path}: basic_auth_users needs the bcrypt package: "
                                 "pip install 'frexporter[auth]'") from e
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
            raise WebConfigError(f"web config {path}: http_server_config.headers: {name!r} cannot be set (allowed: "
                                 f"{', '.join(ALLOWED_HEADERS)})")
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
        raise WebConfigError(f"web config {path}: rate_limit.burst 0 with interval {rate['interval']} would refuse "
                             "every request; set burst to 1 or more (or interval: 0 to turn rate limiting off)")
    return RateLimit(interval=interval, burst=burst)


def _duration(value: Any, path: str, key: str) -> float:
    """Seconds from a Go duration ("1s", "1m30s", "250ms"); a bare 0 means none."""
    if value in (0, "0") and not isinstance(value, bool):  # Go's ParseDuration takes a bare "0" too
        return 0.0
    text = value if isinstance(value, str) else ""
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise WebConfigError(f"web config {path}: {key} must be a duration such as 1s, 500ms or 1m30s, got "
                             f"{value!r:.40}")
    seconds = sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
    if not seconds < 86400 * 365:
        raise WebConfigError(f"web config {path}: {key} {text} is longer than a year")
    return seconds


def _kind(obj: Any) -> str:
    return "nothing" if obj is None else type(obj).__name__


def _reason(e: BaseException) -> str:
    if isinstance(e, ssl.SSLError):
        # OpenSSL's reason codes read as words: KEY_VALUES_MISMATCH -> "key values mismatch".
        return e.reason.lower().replace("_", " ") if e.reason else str(e)
    if isinstance(e, OSError):
        return str(e.strerror or e)
    return str(e)


# ---------------------------------------------------------------- TLS at run time


class TLSContextSource:
    """The server's SSL context, rebuilt when a certificate, key or CA file changes on disk.

    exporter-toolkit reads the files on every handshake so that rotated certificates apply without a
    restart; checking modification times per connection gives the same without re-parsing keys.
    """

    def __init__(self, config: TLSServerConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._context = config.build_context()

    def _stat(self) -> tuple[tuple[int, int], ...]:
        stamps = []
        for name in (self.config.cert_file, self.config.key_file, self.config.client_ca_file):
            try:
                st = os.stat(name) if name else None
            except OSError:
                st = None
            stamps.append((st.st_mtime_ns, st.st_size) if st else (0, 0))
        return tuple(stamps)

    def context(self) -> ssl.SSLContext:
        stamp = self._stat()
        with self._lock:
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._context = self.config.build_context()
                    log.info("TLS certificate files changed; reloaded %s", self.config.cert_file or "them")
                except WebConfigError as e:
                    # Mid-rotation the key and the certificate may briefly disagree: keep serving the old pair.
                    log.warning("TLS certificate files changed but cannot be loaded, keeping the previous ones: %s",
                                e)
            return self._context


# ---------------------------------------------------------------- basic auth at run time


class BasicAuth:
    """Checks ``Authorization: Basic`` against bcrypt hashes, with exporter-toolkit's safeguards.

    - bcrypt at cost 10 takes about 70 ms, so results are cached: a scrape every 15 s with the same
      credentials costs one bcrypt per process, not one per scrape. Cache keys are HMACs under a
      per-process random key, so the cache holds no passwords.
    - Successes and failures are cached apart: a flood of wrong passwords cannot evict the right one.
    - bcrypt runs one at a time, so guessing costs at most one core.
    - An unknown user is checked against a dummy hash of the same cost: its timing does not reveal
      which users exist.
    """

    MAX_CACHED_OK = 64
    MAX_CACHED_BAD = 1024

    def __init__(self, users: Mapping[str, str]) -> None:
        import bcrypt

        self._bcrypt = bcrypt
        self._users = {u: h.encode() for u, h in users.items()}
        self._key = secrets.token_bytes(32)
        self._lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()
        self._ok: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._bad: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        cost = max((int(h[4:6]) for h in self._users.values()), default=10)
        self._dummy = bcrypt.hashpw(secrets.token_bytes(16), bcrypt.gensalt(rounds=cost))
        self.bcrypt_calls = 0

    def check(self, authorization: str | None) -> bool:
        credentials = _parse_basic(authorization)
        if credentials is None:
            return False
        user, password = credentials
        hashed = self._users.get(user)
        known = hashed is not None
        hashed = hashed if hashed is not None else self._dummy
        key = hmac.new(self._key, b"\0".join((user.encode(), hashed, password)), hashlib.sha256).digest()
        with self._lock:
            if key in self._ok:
                self._ok.move_to_end(key)
                return known
            if key in self._bad:
                return False
        with self._bcrypt_lock:
            self.bcrypt_calls += 1
            try:
                ok = bool(self._bcrypt.checkpw(password, hashed)) and known
            except ValueError:  # bcrypt refuses some inputs (e.g. NUL bytes); that is a failed login
                ok = False
        with self._lock:
            cache, limit = (self._ok, self.MAX_CACHED_OK) if ok else (self._bad, self.MAX_CACHED_BAD)
            cache[key] = None
            while len(cache) > limit:
                cache.popitem(last=False)
        return ok


def _parse_basic(header: str | None) -> tuple[str, bytes] | None:
    if not header:
        return None
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = decoded.partition(b":")
    if not sep:
        return None
    try:
        return user.decode("utf-8"), password
    except UnicodeDecodeError:
        return None


# ---------------------------------------------------------------- exposure policy


def is_loopback(host: str) -> bool:
    """True only for addresses no other machine can reach; a name other than localhost counts as exposed."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def check_debug_exposure(host: str, config: WebConfig | None) -> None:
    """Debug endpoints list evidence (ranks, collectives, hosts): loopback only, unless TLS and auth protect them."""
    if is_loopback(host):
        return
    if config is not None and config.tls is not None and config.authenticates:
        return
    missing = "TLS and authentication" if config is None or config.tls is None else "authentication"
    where = host or "all addresses"
    raise WebConfigError(
        f"--enable-debug-endpoints on {where}, a non-loopback address, needs {missing} from --web-config "
        "(tls_server_config plus basic_auth_users or client_auth_type: RequireAndVerifyClientCert); "
        "or listen on 127.0.0.1")
