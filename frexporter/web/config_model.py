"""What a web config file says once validated: the error, the values each key may take, and the frozen
``TLSServerConfig``, ``RateLimit`` and ``WebConfig``.

No I/O here: reading and validating the file is ``config_file`` and ``config_parse``; building the SSL context
from a ``TLSServerConfig`` is ``tls_context``.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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


class WebConfigError(ValueError):
    """The web config file cannot be used; the message names the file and the key."""


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
        # Imported here: tls_context builds on this module's types, and this module stays free of I/O.
        from frexporter.web.tls_context import build_context

        return build_context(self)

    def peer_allowed(self, peer_cert: Mapping[str, Any] | None) -> bool:
        """``client_allowed_sans``: the verified client certificate must carry one of these SANs."""
        if not self.client_allowed_sans:
            return True
        if not peer_cert:
            return False
        sans = {str(value) for _kind, value in peer_cert.get("subjectAltName", ())}
        return any(san in sans for san in self.client_allowed_sans)


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
