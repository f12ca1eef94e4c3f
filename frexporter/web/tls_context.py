"""The server's SSL context from a ``TLSServerConfig``: built from the certificate, key and CA (files or inline
PEM), and rebuilt at run time when those files change on disk (``TLSContextSource``, cert-manager rotation).
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from frexporter.web.config_model import CLIENT_AUTH_TYPES, TLS_VERSIONS, TLSServerConfig, WebConfigError

# The logger name of the web config, which this was split from: log filters that name it keep working.
log = logging.getLogger("frexporter.web.webconfig")


def build_context(config: TLSServerConfig) -> ssl.SSLContext:
    """A server context from the files as they are now; raises WebConfigError naming the file."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _set_versions(ctx, config.min_version, config.max_version)
    _load_cert_chain(ctx, config)
    ctx.verify_mode = CLIENT_AUTH_TYPES[config.client_auth_type]
    if config.has_client_ca:
        where = "inline client_ca" if config.client_ca else f"client_ca_file {config.client_ca_file}"
        try:
            # Inline CA certificates need no file: OpenSSL reads them from memory (cadata).
            if config.client_ca:
                ctx.load_verify_locations(cadata=config.client_ca)
            else:
                ctx.load_verify_locations(cafile=config.client_ca_file)
        except (OSError, ssl.SSLError, ValueError) as e:
            raise WebConfigError(f"tls_server_config: cannot load {where}: {_reason(e)}") from e
    return ctx


def _load_cert_chain(ctx: ssl.SSLContext, config: TLSServerConfig) -> None:
    where = (
        f"{'inline cert' if config.cert else f'cert_file {config.cert_file}'} with "
        f"{'inline key' if config.key else f'key_file {config.key_file}'}"
    )
    try:
        # load_cert_chain reads files only: inline PEM goes through a private file that is gone once loaded.
        with _pem_file(config.cert) as cert_path, _pem_file(config.key) as key_path:
            # A password callback: an encrypted key fails to load instead of OpenSSL prompting on a terminal.
            ctx.load_cert_chain(cert_path or config.cert_file, key_path or config.key_file, password=_no_password)
    except (OSError, ssl.SSLError) as e:
        raise WebConfigError(f"tls_server_config: cannot load {where}: {_reason(e)}") from e


def _set_versions(ctx: ssl.SSLContext, min_version: str, max_version: str) -> None:
    wanted = TLS_VERSIONS[min_version], TLS_VERSIONS[max_version]
    ctx.minimum_version, ctx.maximum_version = wanted
    # Read back: a bound the TLS library adjusted on its own would not be the one the config asked for.
    if (ctx.minimum_version, ctx.maximum_version) != wanted:
        raise WebConfigError(
            f"tls_server_config: this OpenSSL ({ssl.OPENSSL_VERSION}) cannot set TLS versions "
            f"{min_version} to {max_version}"
        )


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


def _reason(e: BaseException) -> str:
    if isinstance(e, ssl.SSLError):
        # OpenSSL's reason codes read as words: KEY_VALUES_MISMATCH -> "key values mismatch".
        return e.reason.lower().replace("_", " ") if e.reason else str(e)
    if isinstance(e, OSError):
        return str(e.strerror or e)
    return str(e)


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
                    log.warning("TLS certificate files changed but cannot be loaded, keeping the previous ones: %s", e)
            return self._context
