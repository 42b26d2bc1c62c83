"""The ``/sparkcache`` page's routes: who may see it, its login, Clear and playground forms.

The HTML is :mod:`sparkcache.serve.page`'s; this module decides who gets it
(loopback clients with a loopback ``Host``, or holders of the admin token:
:class:`~sparkcache.serve.access.Admin`), reads the forms bounded, checks that
a form comes from a page this server process rendered (an HMAC of a
per-process secret, and the browser's ``Origin`` and ``Sec-Fetch-Site``),
carries out Clear (of a model, or of one of its tenants) on the index thread
the middleware gives it, and hands a playground turn to
:class:`~sparkcache.serve.playground.Playground`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import parse_qs, quote

from sparkcache.errors import SparkCacheError
from sparkcache.serve import page, playground
from sparkcache.serve.access import ATTEMPTS, SESSION_S, WINDOW_S, Admin
from sparkcache.serve.access import loopback as is_loopback
from sparkcache.serve.bodies import (
    MAX_FORM,
    Gone,
    Receive,
    Scope,
    Send,
    TooLarge,
    header,
    read_body,
    respond,
)
from sparkcache.serve.playground import Api, Draft, Playground, parse_state, served_models
from sparkcache.store import SnapshotStore

__all__ = ["PAGE_HEADERS", "Pages"]

logger = logging.getLogger("sparkcache.serve")

#: Sent with the login form: no caching, no framing, no scripts (the page: playground.HEADERS).
PAGE_HEADERS = [
    (b"cache-control", b"no-store"), (b"x-frame-options", b"DENY"),
    (b"content-security-policy",
     b"default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
     b"frame-ancestors 'none'"),
]
TEXT = "text/plain; charset=utf-8"

#: Runs a function of the store on the middleware's index thread.
Db = Callable[[Callable[[SnapshotStore], Any]], Coroutine[Any, Any, Any]]


class Pages:
    """The page's routes (one per server process, held by the middleware)."""

    def __init__(self, admin_token: str | None, db: Db, api: Api | None = None, *,
                 needs_key: bool = False) -> None:
        self.db = db
        self._secret = secrets.token_bytes(32)  # CSRF tokens of this server process
        self.admin = Admin(admin_token) if admin_token else None
        # A turn of the playground goes through ``api`` (the middleware) as any request.
        self.playground = Playground(api, db, needs_key=needs_key) if api is not None else None

    def _admit(self, scope: Scope) -> str | None:
        """Why this client may not use the page (None: it may; "login": it needs
        the admin token).  A wrong Bearer token counts as a failed attempt."""
        if self.admin is not None:
            given = self.admin.presented(scope)
            if given is False:
                self._failed(scope)
            return None if given else "login"
        if not is_loopback(scope):
            return ("the page is served to loopback clients only; set an admin token "
                    "(sparkcache serve --admin-token) to open it to others")
        host = (header(scope, b"host") or "").lower()
        name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
        if name not in ("127.0.0.1", "localhost", "[::1]"):
            # A page of another site whose name resolves to 127.0.0.1 (DNS rebinding).
            return f"the page answers only to 127.0.0.1 or localhost, not {host[:80]!r}"
        return None

    def _failed(self, scope: Scope) -> None:
        """Count a failed admin attempt; say so once a client reaches the bound."""
        assert self.admin is not None  # only called with a token
        if self.admin.failed(scope) == ATTEMPTS:
            client = scope.get("client")
            logger.warning("sparkcache: %d failed admin attempts from %s within %.0f s: its "
                           "attempts are refused (429) until they are older than that",
                           ATTEMPTS, client[0] if client else "?", WINDOW_S)

    def csrf(self, action: str) -> str:
        """The form token of an action: only a page this server rendered has it."""
        return hmac.new(self._secret, action.encode(), hashlib.sha256).hexdigest()

    def _same_origin(self, scope: Scope) -> bool:
        """Whether a POST comes from this server's own page (browsers send Origin
        and Sec-Fetch-Site with every cross-site form)."""
        site = header(scope, b"sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            return False
        origin = header(scope, b"origin")
        if origin is None or origin == "null":
            return origin is None
        host = header(scope, b"host") or ""
        return origin.split("://", 1)[-1] == host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one request to the page or its forms."""
        method, path = scope.get("method", "GET"), scope.get("path", "")
        if self.admin is not None and self.admin.locked(scope):
            return await respond(send, 429, b"too many failed attempts: wait a minute\n", TEXT,
                                 [(b"retry-after", str(int(WINDOW_S)).encode())])
        why = self._admit(scope)
        if why == "login" and path == page.PATH + "/login" and method == "POST":
            return await self._login(scope, receive, send)
        if why == "login":
            return await respond(send, 401, page.login_form().encode(), page.HTML,
                                 PAGE_HEADERS)
        if why is not None:
            return await respond(send, 403, why.encode() + b"\n", TEXT)
        if method == "GET" and path == page.PATH:
            query = parse_qs(scope.get("query_string", b"")[:4096].decode("latin-1"))
            note = (query.get("note") or [""])[0][:200]
            return await self._page(scope, send, note=note)
        if method == "POST" and path == page.PATH + "/clear":
            return await self._clear(scope, receive, send)
        if method == "POST" and path == playground.ACTION and self.playground is not None:
            return await self._turn(scope, receive, send)
        return await respond(send, 404, b"not found\n", TEXT)

    def _top(self, scope: Scope, turns: list[playground.Turn] | None = None,
             draft: Draft | None = None) -> str:
        """The playground's section of the page ("" without one)."""
        if self.playground is None:
            return ""
        return self.playground.section(served_models(scope), self.csrf("playground"), turns,
                                       draft)

    async def _page(self, scope: Scope, send: Send, *, note: str = "", top: str | None = None,
                    status: int = 200) -> None:
        top = self._top(scope) if top is None else top
        html = await self.db(lambda store: page.render(store, csrf=self.csrf("clear"),
                                                       note=note, top=top))
        await respond(send, status, html.encode(), page.HTML, playground.HEADERS)

    async def _turn(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One playground turn: the whole page back, or (asked by the page's
        script, ``Accept: application/json``) the playground's section as JSON."""
        assert self.playground is not None  # routed only then
        form = await self._form(scope, receive, send, playground.MAX_FORM)
        if form is None:
            return None
        if not self._same_origin(scope) or not hmac.compare_digest(
                form.get("csrf", "").encode(), self.csrf("playground").encode()):
            return await respond(send, 403, b"this form did not come from this server's page\n",
                                 TEXT)
        turns = parse_state(form.get("state", ""))
        models = served_models(scope)
        draft = Draft(model=form.get("model", ""), system=form.get("system", "")[
            :playground.MAX_TEXT], marked=form.get("cache") == "on")
        message = form.get("message", "").strip()[:playground.MAX_TEXT]
        if turns is None:
            turns, draft.note = [], "The conversation was not one this page wrote: it starts anew."
        elif draft.model not in models:
            draft.note = "Choose a model this server serves."
        elif not message:
            draft.note = "Write a message first."
        elif len(turns) >= playground.MAX_TURNS:
            draft.note = f"A conversation here holds {playground.MAX_TURNS} turns: start a new one."
        else:
            turns = [*turns, await self.playground.turn(scope, receive, turns, draft, message,
                                                        form.get("api_key", ""))]
        top = self.playground.section(models, self.csrf("playground"), turns, draft)
        if "application/json" in (header(scope, b"accept") or ""):
            body = json.dumps({"html": top}).encode()
            return await respond(send, 200, body, "application/json", playground.HEADERS)
        return await self._page(scope, send, top=top)

    async def _form(self, scope: Scope, receive: Receive, send: Send,
                    limit: int = MAX_FORM) -> dict[str, str] | None:
        """The posted form (at most ``limit`` bytes: a 413 beyond); None when answered."""
        try:
            raw = await read_body(scope, receive, limit)
        except Gone:
            return None
        except TooLarge as exc:
            await respond(send, 413, f"{exc}\n".encode(), TEXT)
            return None
        fields = parse_qs(raw.decode("utf-8", "replace"), max_num_fields=32)
        return {k: v[0] for k, v in fields.items()}

    async def _clear(self, scope: Scope, receive: Receive, send: Send) -> None:
        form = await self._form(scope, receive, send)
        if form is None:
            return None
        if not self._same_origin(scope) or not hmac.compare_digest(
                form.get("csrf", "").encode(), self.csrf("clear").encode()):
            return await respond(send, 403, b"this form did not come from this server's page\n",
                                 TEXT)
        try:
            model_id = int(form.get("model", ""))
        except ValueError:
            return await respond(send, 400, b"no model chosen\n", TEXT)
        tenant = form.get("tenant")
        if tenant is not None and not re.fullmatch(r"[0-9a-f]{32}", tenant):
            return await respond(send, 400, b"no tenant chosen\n", TEXT)
        try:
            note = await self.db(lambda store: page.clear(store, model_id, tenant))
        except SparkCacheError as exc:
            note = f"not cleared: {exc}"
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        # A tenant's live blocks are its own (salted): resetting vLLM's cache
        # would drop every other tenant's too.
        if tenant is None and engine is not None and hasattr(engine, "reset_prefix_cache"):
            try:
                reset = await engine.reset_prefix_cache()
            except Exception as exc:  # vLLM's own reasons; the snapshots are gone anyway
                logger.warning("sparkcache: vLLM's prefix cache was not reset: %s", exc)
                reset = False
            note += "; vLLM's live prefix cache " + (
                "reset" if reset is not False else "not reset (requests are running)")
        location = f"{page.PATH}?note={_quote(note)}"
        await send({"type": "http.response.start", "status": 303, "headers": [
            (b"location", location.encode()), (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return None

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The token form: a session cookie for the right token, a counted failure else."""
        assert self.admin is not None  # a login is asked only then
        form = await self._form(scope, receive, send)
        if form is None:
            return None
        if not self._same_origin(scope) or not self.admin.token_ok(form.get("token", "")):
            self._failed(scope)
            return await respond(send, 401, page.login_form("wrong token").encode(), page.HTML,
                                 PAGE_HEADERS)
        cookie = (f"{page.COOKIE}={self.admin.session()}; Path={page.PATH}; "
                  f"Max-Age={SESSION_S}; HttpOnly; SameSite=Strict")
        await send({"type": "http.response.start", "status": 303, "headers": [
            (b"location", page.PATH.encode()), (b"set-cookie", cookie.encode()),
            (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return None


def _quote(text: str) -> str:
    return quote(text, safe="")
