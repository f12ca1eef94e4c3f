"""Basic auth at run time: an ``Authorization: Basic`` header checked against the web config's bcrypt hashes.

``parse_basic`` (the header to user and password) is pure; ``BasicAuth`` adds the bcrypt check, its caches
and its locks. The users themselves are validated when the file is loaded (``config_parse``).
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import hmac
import secrets
import threading
from collections.abc import Mapping


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
        credentials = parse_basic(authorization)
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


def parse_basic(header: str | None) -> tuple[str, bytes] | None:
    """The user and password of an ``Authorization: Basic`` header; None for any other or malformed header."""
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
