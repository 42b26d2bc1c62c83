"""Who may do what, decided from a request's headers alone, before any body is read.

* :class:`ApiKeys`: vLLM's own ``--api-key`` rule (its ``AuthenticationMiddleware``,
  found in the app the middleware wraps), so that the middleware passes a
  request vLLM will refuse straight to vLLM (its 401), reading, parsing and
  logging nothing of it.
* :class:`Admin`: the ``/sparkcache`` page's admin token.  A login sets a
  session cookie derived from the token (an HMAC of it with the session's
  expiry), never the token itself; failed attempts are bounded per client
  address (:data:`ATTEMPTS` in :data:`WINDOW_S`, then 429 until the window
  passes).
* an admin token must be printable ASCII (HTTP headers are latin-1: another
  token could not be sent as ``Bearer``): :func:`check_token` refuses others
  when the server starts.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, MutableMapping
from typing import Any

from sparkcache.serve.launch import check_token
from sparkcache.serve.page import COOKIE

__all__ = ["ATTEMPTS", "SESSION_S", "WINDOW_S", "Admin", "ApiKeys", "check_token", "loopback"]

Scope = MutableMapping[str, Any]

#: Failed admin logins (or wrong admin credentials) a client address may make
#: in WINDOW_S seconds; past them it is answered 429 until the window passes.
ATTEMPTS = 5
WINDOW_S = 60.0
#: Client addresses whose failures are remembered at most (the oldest are forgotten).
TRACKED = 4096
#: How long a login's session cookie opens the page.
SESSION_S = 12 * 3600
#: vLLM's guarded path prefixes, when its middleware does not name them.
GUARDED = ("/v1", "/v2", "/inference", "/cohere")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def loopback(scope: Scope) -> bool:
    client = scope.get("client")
    try:
        return client is not None and ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


class ApiKeys:
    """vLLM's ``--api-key`` check, as vLLM's ``AuthenticationMiddleware`` inside
    ``app`` does it (None of it when that middleware is not there)."""

    def __init__(self, app: Any) -> None:
        self.auth: Any = None
        self.guarded: tuple[str, ...] = GUARDED
        seen = 0
        while app is not None and seen < 64:
            if type(app).__name__ == "AuthenticationMiddleware" and hasattr(app,
                                                                           "verify_token"):
                self.auth = app
                module = sys.modules.get(type(app).__module__)
                self.guarded = tuple(getattr(module, "GUARDED_PREFIX", GUARDED))
                break
            app, seen = getattr(app, "app", None), seen + 1

    def refuses(self, scope: Scope) -> bool:
        """Whether vLLM answers this request 401 (its rule: a guarded path without
        one of its keys as ``Bearer``)."""
        if self.auth is None or scope.get("method") == "OPTIONS":
            return False
        path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))
        if not path.startswith(self.guarded):
            return False
        from starlette.datastructures import Headers  # vLLM's server brings it

        return not bool(self.auth.verify_token(Headers(scope=scope)))


class Admin:
    """The admin token's rules: sessions and bounded attempts."""

    def __init__(self, token: str, clock: Callable[[], float] = time.time) -> None:
        self.token = token
        self.clock = clock
        self._failures: OrderedDict[str, list[float]] = OrderedDict()

    def session(self, expires: int | None = None) -> str:
        """A session cookie's value: its expiry and an HMAC of it under the token."""
        expires = int(self.clock()) + SESSION_S if expires is None else expires
        mac = hmac.new(self.token.encode(), f"session:{expires}".encode(), hashlib.sha256)
        return f"{expires}.{mac.hexdigest()}"

    def _session_ok(self, value: str) -> bool:
        expires, _, _mac = value.partition(".")
        if not expires.isdigit() or int(expires) < self.clock():
            return False
        return hmac.compare_digest(value.encode(), self.session(int(expires)).encode())

    def token_ok(self, given: str) -> bool:
        return hmac.compare_digest(given.encode("utf-8", "replace"), self.token.encode())

    def presented(self, scope: Scope) -> bool | None:
        """True when the request carries the token (Bearer) or a live session
        cookie, False for a wrong Bearer token (an attempt), None otherwise (an
        expired session is no attempt: the page asks for the token again)."""
        auth = _header(scope, b"authorization")
        if auth and auth.lower().startswith("bearer "):
            return self.token_ok(auth[7:].strip())
        cookies = (part.strip().partition("=") for part in
                   (_header(scope, b"cookie") or "").split(";"))
        if any(self._session_ok(value) for name, _, value in cookies if name == COOKIE):
            return True
        return None

    def _key(self, scope: Scope) -> str:
        client = scope.get("client")
        return str(client[0]) if client else "?"

    def locked(self, scope: Scope) -> bool:
        """Whether this client made :data:`ATTEMPTS` failed attempts within the window."""
        now = self.clock()
        times = [t for t in self._failures.get(self._key(scope), []) if now - t < WINDOW_S]
        return len(times) >= ATTEMPTS

    def failed(self, scope: Scope) -> int:
        """Count a failed attempt; returns the client's failures in the window."""
        now, key = self.clock(), self._key(scope)
        times = [t for t in self._failures.pop(key, []) if now - t < WINDOW_S]
        times.append(now)
        self._failures[key] = times[-ATTEMPTS:]
        while len(self._failures) > TRACKED:
            self._failures.popitem(last=False)
        return len(times)
