"""A tiny HTTP client for torch's C++ worker server on a unix socket: the transport.

Which handlers are called, with what query, by whom and how large their answers may be is the table in
``worker_handlers``. Every request carries ``Content-Length: 0`` (older torch hangs without it), has a hard
deadline for the whole exchange (a server that accepts and never answers cannot hold us), and a response size
cap.

The socket's name comes from the spool, which is untrusted: only a socket itself (not a link to one)
owned as the spool's mode expects is connected to, and the peer must be the socket file's owner before a
byte is sent (SO_PEERCRED), which closes the race of a name swapped between the check and the connect.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import time
from typing import Any

from frexporter import reasons, spool
from frexporter.sources.base import SourceError

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_MAX_HEAD_BYTES = 65536  # a response's status line and headers
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


def trusted_owner(path: str, trust: spool.Trust) -> int:
    """The uid owning the socket at ``path`` when it may be connected to; SourceError otherwise.

    lstat: ``path``'s last component is a name from the spool, never followed.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError as e:
        raise SourceError(reasons.SOCKET_MISSING, f"{path}: no such socket") from e
    except PermissionError as e:
        raise SourceError(reasons.PERMISSION, f"{path}: permission denied") from e
    except OSError as e:
        raise SourceError(reasons.SOCKET_ERROR, f"{path}: {e.strerror or e}") from e
    problem = spool.socket_problem(st, trust)
    if problem is not None:
        raise SourceError(reasons.SOCKET_UNTRUSTED, f"{path}: {problem}; not connecting")
    return st.st_uid


def _check_peer(sock: socket.socket, path: str, owner: int) -> None:
    """The process that accepted is the socket file's owner: a name swapped for a link to another service's
    socket after ``trusted_owner`` looked at it is caught here, before anything is sent."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:  # not Linux: the lstat check alone
        return
    try:
        _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _UCRED.size))
    except OSError as e:
        raise SourceError(reasons.SOCKET_ERROR, f"{path}: {e.strerror or e}") from e
    if uid != owner:
        raise SourceError(reasons.SOCKET_UNTRUSTED, f"{path}: answered by uid {uid}, but the socket belongs to uid "
                                                    f"{owner} (replaced while connecting?); nothing sent")


def post(path: str, handler: str, timeout: float, query: str = "",
         max_bytes: int = MAX_RESPONSE_BYTES, trust: spool.Trust | None = None) -> bytes | bytearray:
    """POST /handler/<name> and return the body, or raise SourceError with a reason.

    ``trust``: whose sockets may be used (default: check_permissions' rules for this process).
    """
    deadline = time.monotonic() + timeout
    owner = trusted_owner(path, trust or spool.Trust.current())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except FileNotFoundError as e:
            raise SourceError(reasons.SOCKET_MISSING, f"{path}: no such socket") from e
        except ConnectionRefusedError as e:
            raise SourceError(reasons.SOCKET_REFUSED, f"{path}: connection refused (rank gone?)") from e
        except PermissionError as e:
            raise SourceError(reasons.PERMISSION, f"{path}: permission denied") from e
        except TimeoutError as e:
            raise SourceError(reasons.SOCKET_TIMEOUT, f"{path}: connect timed out") from e
        except OSError as e:
            reason = reasons.SOCKET_REFUSED if e.errno in (errno.ECONNREFUSED, errno.ENOTSOCK) else reasons.SOCKET_ERROR
            raise SourceError(reason, f"{path}: {e.strerror or e}") from e
        _check_peer(sock, path, owner)
        target = f"/handler/{handler}" + (f"?{query}" if query else "")
        request = (
            f"POST {target} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        try:
            sock.sendall(request)
            data = _receive(sock, deadline, max_bytes, path)
        except TimeoutError as e:
            raise SourceError(reasons.SOCKET_TIMEOUT, f"{path}: no answer to {handler} within {timeout:.1f}s") from e
        except OSError as e:
            raise SourceError(reasons.SOCKET_ERROR, f"{path}: {e.strerror or e}") from e
    finally:
        sock.close()
    return _parse_response(data, path, handler)


def _receive(sock: socket.socket, deadline: float, max_bytes: int, path: str) -> bytearray:
    """The whole response, read into one growing buffer (no list of chunks joined into a second copy).

    An answer whose head announces a body over ``max_bytes`` is refused before its body is read; one without
    a length is refused once ``max_bytes`` of it arrived.
    """
    data = bytearray()
    expected: int | None = None  # whole response length, once the head has arrived
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)
        chunk = sock.recv(1 << 20)
        if not chunk:
            return data
        data += chunk
        if len(data) > max_bytes + _MAX_HEAD_BYTES:
            raise SourceError(reasons.OVERSIZED, f"{path}: response larger than {max_bytes} bytes")
        if expected is None and len(data) - len(chunk) < _MAX_HEAD_BYTES:
            # Only the start can hold the head; looking for it in every recv of a 1 MB FR dump would scan
            # the dump over and over.
            expected = _expected_length(bytes(data[:_MAX_HEAD_BYTES]))
            if expected is not None and expected > max_bytes + _MAX_HEAD_BYTES:
                raise SourceError(reasons.OVERSIZED, f"{path}: response of {expected} bytes announced, over the bound "
                                                     f"of {max_bytes}; not read")
        if expected is not None and len(data) >= expected:
            return data



def _expected_length(data: bytes) -> int | None:
    """Head + Content-Length, once the head is complete; None while unknown.

    cpp-httplib may keep the connection open despite "Connection: close", so the reader stops once this many
    bytes arrived instead of waiting for EOF.
    """
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    for line in data[:head_end].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return head_end + 4 + int(value.strip())
            except ValueError:
                return None
    return None


def _complete(chunks: list[bytes]) -> bool:
    data = b"".join(chunks)
    expected = _expected_length(data)
    return expected is not None and len(data) >= expected


def _parse_response(data: bytes | bytearray, path: str, handler: str) -> bytes | bytearray:
    """The body of ``data``; a bytearray's is cut out in place (an FR answer can be tens of MB)."""
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        raise SourceError(reasons.BAD_RESPONSE, f"{path}: incomplete HTTP response to {handler}")
    head = bytes(data[:head_end])
    if isinstance(data, bytearray):
        del data[: head_end + 4]
        body: bytes | bytearray = data
    else:
        body = data[head_end + 4 :]
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise SourceError(reasons.BAD_RESPONSE, f"{path}: not an HTTP response")
    try:
        code = int(parts[1])
    except ValueError as e:
        raise SourceError(reasons.BAD_RESPONSE, f"{path}: bad HTTP status line") from e
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = _dechunk(body, path)
    elif b"content-length" in headers:
        try:
            length = int(headers[b"content-length"])
        except ValueError as e:
            raise SourceError(reasons.BAD_RESPONSE, f"{path}: bad Content-Length") from e
        if length < 0:
            raise SourceError(reasons.BAD_RESPONSE, f"{path}: bad Content-Length")
        if len(body) < length:
            raise SourceError(reasons.BAD_RESPONSE, f"{path}: truncated response to {handler}")
        if len(body) > length:
            body = body[:length]
    if code == 404:
        raise SourceError(reasons.HANDLER_MISSING, f"{path}: handler {handler} not available in this torch")
    if code != 200:
        raise SourceError(reasons.HANDLER_FAILED, f"{path}: {handler} answered HTTP {code}: {body[:200]!r}")
    return body


def _dechunk(body: bytes | bytearray, path: str) -> bytes:
    out = bytearray()
    pos = 0
    while True:
        line_end = body.find(b"\r\n", pos)
        if line_end < 0:
            raise SourceError(reasons.BAD_RESPONSE, f"{path}: truncated chunked response")
        try:
            size = int(body[pos:line_end].split(b";")[0], 16)
        except ValueError as e:
            raise SourceError(reasons.BAD_RESPONSE, f"{path}: bad chunk size") from e
        if size < 0:  # would move pos backwards: the same chunk line again, forever
            raise SourceError(reasons.BAD_RESPONSE, f"{path}: bad chunk size")
        if size == 0:
            return bytes(out)
        start = line_end + 2
        out += body[start : start + size]
        pos = start + size + 2


def post_json(path: str, handler: str, timeout: float, query: str = "", trust: spool.Trust | None = None) -> Any:
    body = post(path, handler, timeout, query, trust=trust)
    try:
        return json.loads(body)
    except ValueError as e:
        raise SourceError(reasons.BAD_RESPONSE, f"{path}: {handler} returned invalid JSON") from e
