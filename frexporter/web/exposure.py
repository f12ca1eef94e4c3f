"""Exposure policy: which listen addresses other machines can reach, and what the debug endpoints need on
those (TLS and authentication from the web config). Pure.
"""

from __future__ import annotations

import ipaddress

from frexporter.web.config_model import WebConfig, WebConfigError


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
        "or listen on 127.0.0.1"
    )
