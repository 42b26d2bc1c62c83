"""The ASGI middleware ``sparkcache serve`` puts in front of vLLM's API server.

vLLM adds it with ``--middleware sparkcache.serve.middleware.SparkCacheMiddleware``
(:mod:`sparkcache.serve.launch` does that); its settings come from the
environment the launcher sets (:class:`ServeSettings`).  For every request to

* ``POST /v1/messages`` (Anthropic): validates ``cache_control`` (a 400 in
  Anthropic's error format when malformed), renders the prompt up to each
  marked block through vLLM's own ``/v1/messages/render`` to find the
  breakpoints' token positions, hands them to the connector in
  ``kv_transfer_params``, and rewrites the answer's usage from what the
  connector did (:mod:`sparkcache.serve.usage`): from the finished request's
  ``kv_transfer_params`` when the answer is whole, from the request log row
  the connector writes when the prompt has been scheduled when it streams;
* ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``
  (OpenAI): accepts ``prompt_cache_key`` (recorded in the log; it isolates
  nothing: a ``cache_salt`` does that);

it names the request in the request log (``kv_transfer_params["sparkcache"]["id"]``)
and records the API, the model, the key, the status and the total time there;
the connector records the tokens and the engine's timings in the same row.
``/sparkcache`` is the page (:mod:`sparkcache.serve.page`), served only to
loopback clients unless an admin token is set.  Everything else passes
through untouched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs, quote, unquote

from sparkcache.errors import SparkCacheError
from sparkcache.requestlog import log_rows_setting
from sparkcache.serve import page
from sparkcache.serve.cache_control import CacheControlError, Cut, common_prefix, cuts, strip
from sparkcache.serve.usage import SseRewriter, anthropic_usage, facts_of
from sparkcache.store import SnapshotStore

__all__ = ["ServeSettings", "SparkCacheMiddleware"]

logger = logging.getLogger("sparkcache.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
T = TypeVar("T")

#: The endpoints whose requests are logged, and the API each speaks.
APIS = {
    "/v1/messages": "messages",
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
}
#: A streamed Anthropic answer waits at most this long for the connector's
#: facts (they are written while the prompt's last chunk is computed, so
#: normally before its first token).
FACTS_WAIT_S = 10.0
#: Renders of request prefixes remembered (a shared system prompt is rendered once).
RENDER_CACHE = 256
MAX_CACHE_KEY = 1024

#: Sent with the page and its login form: no caching, no framing, no scripts.
PAGE_HEADERS = [
    (b"cache-control", b"no-store"), (b"x-frame-options", b"DENY"),
    (b"content-security-policy",
     b"default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
     b"frame-ancestors 'none'"),
]

# -- environment the launcher sets ---------------------------------------------------------
ENV_FOLDER = "SPARKCACHE_SERVE_FOLDER"
ENV_ADMIN_TOKEN = "SPARKCACHE_ADMIN_TOKEN"  # noqa: S105 - the variable's name, not a secret


@dataclass(frozen=True)
class ServeSettings:
    """What the middleware needs; read from the environment ``sparkcache serve`` sets."""

    folder: str
    admin_token: str | None = None
    log_rows: int = 10_000

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None) -> ServeSettings:
        env = os.environ if env is None else env
        folder = env.get(ENV_FOLDER)
        if not folder:
            raise SparkCacheError(f"{ENV_FOLDER} is not set: start the server with "
                                  "`sparkcache serve`, which sets it")
        return cls(folder=folder, admin_token=env.get(ENV_ADMIN_TOKEN) or None,
                   log_rows=log_rows_setting(env))


class _Gone(Exception):
    """The client went away while its request was read."""


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Gone
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then the client's own messages
    (vLLM listens for the disconnect to cancel a request)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def _replay_lazy(make: Callable[[], Awaitable[bytes]], receive: Receive) -> Receive:
    """:func:`_replay` of a body made when it is first read."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": await make(), "more_body": False}
        return await receive()

    return again


def _with_body(scope: Scope, body: bytes) -> Scope:
    new = _without_length(scope)
    new["headers"].append((b"content-length", str(len(body)).encode()))
    return new


def _without_length(scope: Scope) -> Scope:
    """The scope without a content-length (the body read will differ in length)."""
    new = dict(scope)
    new["headers"] = [(k, v) for k, v in scope.get("headers", [])
                      if k.lower() != b"content-length"]
    return new


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


async def _respond(send: Send, status: int, body: bytes, content_type: str,
                   headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
        (b"x-content-type-options", b"nosniff"), *(headers or []),
    ]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _anthropic_error(message: str) -> bytes:
    return _json({"type": "error", "error": {"type": "invalid_request_error",
                                             "message": message}})


def _openai_error(message: str, param: str) -> bytes:
    return _json({"error": {"message": message, "type": "invalid_request_error",
                            "param": param, "code": None}})


class SparkCacheMiddleware:
    """See the module docstring.  One per server process (vLLM adds it)."""

    def __init__(self, app: ASGIApp, settings: ServeSettings | None = None) -> None:
        self.app = app
        self.settings = settings or ServeSettings.from_env()
        # One thread owns the index connection: its calls never interleave.
        self._db = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sparkcache-db")
        self._store: SnapshotStore | None = None
        self._renders: OrderedDict[str, list[int]] = OrderedDict()
        self._secret = secrets.token_bytes(32)  # CSRF tokens of this server process

    # -- the index, on its own thread ---------------------------------------------------

    def _open(self) -> SnapshotStore:
        if self._store is None:
            self._store = SnapshotStore(self.settings.folder)
        return self._store

    async def db(self, work: Callable[[SnapshotStore], T]) -> T:
        """Run ``work(store)`` on the index thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._db, lambda: work(self._open()))

    async def _log(self, row: dict[str, Any]) -> None:
        try:
            await self.db(lambda store: store.log_requests([row], keep=self.settings.log_rows))
        except SparkCacheError as exc:
            logger.warning("sparkcache: request log: %s", exc)

    async def _facts(self, request_id: str) -> dict[str, Any] | None:
        """The connector's row for the request, once it has the prompt's facts."""
        deadline = time.monotonic() + FACTS_WAIT_S
        pause = 0.002
        while True:
            try:
                row = await self.db(lambda store: store.request(request_id))
            except SparkCacheError as exc:
                logger.warning("sparkcache: request log: %s", exc)
                return None
            if row is not None and row.prompt_tokens is not None:
                return {"prompt_tokens": row.prompt_tokens, "live_tokens": row.live_tokens,
                        "restored_tokens": row.restored_tokens,
                        "written_tokens": row.written_tokens}
            if time.monotonic() > deadline:
                logger.warning("sparkcache: no facts from the connector for %s within %.0f s; "
                               "usage is vLLM's own", request_id, FACTS_WAIT_S)
                return None
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)

    # -- dispatch -------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if path == page.PATH or path.startswith(page.PATH + "/"):
            return await self._page(scope, receive, send)
        api = APIS.get(path)
        if api is None or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        try:
            body = await _read_body(receive)
        except _Gone:
            return None
        return await self._api(api, scope, body, receive, send)

    # -- the APIs -------------------------------------------------------------------------

    async def _api(self, api: str, scope: Scope, raw: bytes, receive: Receive,
                   send: Send) -> None:
        started, wall = time.monotonic(), time.time()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):  # vLLM answers that one itself
            return await self.app(_with_body(scope, raw), _replay(raw, receive), send)
        request_id = f"sc-{uuid.uuid4().hex}"
        row: dict[str, Any] = {"request_id": request_id, "created_at": wall, "api": api,
                               "model": body.get("model") if isinstance(body.get("model"),
                                                                        str) else None}
        marks: list[Cut] = []
        if api == "messages":
            try:
                marks = cuts(body)
            except CacheControlError as exc:
                await _respond(send, 400, _anthropic_error(str(exc)), "application/json")
                await self._log({**row, "status": 400, "total_s": time.monotonic() - started})
                return None
        else:
            key = body.pop("prompt_cache_key", None) if api != "responses" \
                else body.get("prompt_cache_key")
            if key is not None and not (isinstance(key, str) and len(key) <= MAX_CACHE_KEY):
                message = f"prompt_cache_key must be a string of at most {MAX_CACHE_KEY} " \
                          f"characters, got {type(key).__name__}"
                await _respond(send, 400, _openai_error(message, "prompt_cache_key"),
                               "application/json")
                await self._log({**row, "status": 400, "total_s": time.monotonic() - started})
                return None
            row["cache_key"] = key

        async def final_body() -> bytes:
            # Runs when vLLM's route reads the body: after vLLM's own checks
            # (--api-key), so an unauthenticated request renders nothing.
            breakpoints = await self._positions(scope, body, marks) if marks else []
            params = body.get("kv_transfer_params")
            params = dict(params) if isinstance(params, dict) else {}
            ours = params.get("sparkcache")
            ours = dict(ours) if isinstance(ours, dict) else {}
            ours["id"] = request_id
            if breakpoints:
                ours["breakpoints"] = [*(ours.get("breakpoints") or []), *breakpoints]
            params["sparkcache"] = ours
            body["kv_transfer_params"] = params
            return _json(body)

        status = await self._forward(api, scope, final_body, receive, send, request_id)
        await self._log({**row, "status": status, "total_s": time.monotonic() - started})
        return None

    async def _forward(self, api: str, scope: Scope, body: Callable[[], Awaitable[bytes]],
                       receive: Receive, send: Send, request_id: str) -> int:
        """Pass the request to vLLM (its body made when vLLM reads it); rewrite an
        Anthropic answer's usage.  Returns the status sent."""
        status = 500
        start: Message | None = None
        buffered: list[bytes] = []
        rewriter: SseRewriter | None = None

        async def relay(message: Message) -> None:
            nonlocal status, start, rewriter
            if message["type"] == "http.response.start":
                status = int(message["status"])
                content_type = ""
                for key, value in message.get("headers", []):
                    if key.lower() == b"content-type":
                        content_type = value.decode("latin-1")
                if api != "messages" or status != 200:
                    return await send(message)
                if content_type.startswith("text/event-stream"):
                    rewriter = SseRewriter(lambda: self._facts(request_id))
                    return await send(message)
                start = message  # a whole JSON answer: held until its body is rewritten
                return None
            if message["type"] != "http.response.body":
                return await send(message)
            if rewriter is not None:
                chunk = await rewriter.feed(message.get("body", b""))
                more = bool(message.get("more_body"))
                if not more:
                    chunk += rewriter.rest()
                if chunk or not more:
                    await send({"type": "http.response.body", "body": chunk, "more_body": more})
                return None
            if start is None:
                return await send(message)
            buffered.append(message.get("body", b""))
            if message.get("more_body"):
                return None
            whole = self._rewrite_whole(b"".join(buffered))
            headers = [(k, v) for k, v in start.get("headers", [])
                       if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(whole)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": whole, "more_body": False})
            return None

        await self.app(_without_length(scope), _replay_lazy(body, receive), relay)
        return status

    @staticmethod
    def _rewrite_whole(body: bytes) -> bytes:
        try:
            answer = json.loads(body)
        except ValueError:
            return body
        if not isinstance(answer, dict):
            return body
        facts = facts_of(answer)
        if facts is None:
            return body
        answer["usage"] = anthropic_usage(answer.get("usage"), facts)
        return _json(answer)

    # -- breakpoints ----------------------------------------------------------------------

    async def _positions(self, scope: Scope, body: dict[str, Any],
                         marks: list[Any]) -> list[dict[str, Any]]:
        """Each mark's token position: where the prompt rendered up to its block
        stops agreeing with the whole prompt.  A mark whose render fails is left
        out (logged); when the whole prompt does not render, none is set (vLLM
        then answers the request with its own error)."""
        full = await self._render(scope, strip(body))
        if full is None:
            return []
        positions: list[dict[str, Any]] = []
        for mark in marks:
            tokens = await self._render(scope, mark.body)
            if tokens is None:
                logger.warning("sparkcache: the prompt up to %s does not render; "
                               "no breakpoint there", mark.where)
                continue
            positions.append({"at": common_prefix(tokens, full), "ttl": mark.ttl})
        return positions

    async def _render(self, scope: Scope, body: dict[str, Any]) -> list[int] | None:
        """The token ids vLLM's own renderer makes of an Anthropic request, the
        same as ``/v1/messages`` prefills (remembered by content)."""
        body = copy.deepcopy(body)
        body.pop("kv_transfer_params", None)
        body["stream"] = False
        key = hashlib.sha256(_json(body)).hexdigest()
        if key in self._renders:
            self._renders.move_to_end(key)
            return self._renders[key]
        renderer = getattr(getattr(scope.get("app"), "state", None), "serving_render", None)
        if renderer is None:
            logger.warning("sparkcache: this vLLM server has no renderer; "
                           "cache_control sets no breakpoint")
            return None
        # vLLM's own request model: imported here, where vLLM's server has loaded it,
        # so that the page and the checks above load without vLLM.
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

        try:
            request = AnthropicMessagesRequest.model_validate(body)
            result = await renderer.render_messages_request(request)
        except Exception as exc:  # a breakpoint is never worth a failed request
            logger.warning("sparkcache: render failed (%s: %s); no breakpoint there",
                           type(exc).__name__, exc)
            return None
        tokens = getattr(result, "token_ids", None)
        if not isinstance(tokens, list):
            logger.debug("sparkcache: render answered %s", result)
            return None
        self._renders[key] = tokens
        if len(self._renders) > RENDER_CACHE:
            self._renders.popitem(last=False)
        return tokens

    # -- the page -------------------------------------------------------------------------

    def _allowed(self, scope: Scope) -> str | None:
        """Why this client may not use the page (None: it may)."""
        token = self.settings.admin_token
        if token:
            given = None
            auth = _header(scope, b"authorization")
            if auth and auth.lower().startswith("bearer "):
                given = auth[7:].strip()
            cookie = _header(scope, b"cookie") or ""
            for part in cookie.split(";"):
                name, _, value = part.strip().partition("=")
                if name == page.COOKIE:
                    given = given or unquote(value)
            if given is not None and hmac.compare_digest(given.encode(), token.encode()):
                return None
            return "login"
        client = scope.get("client")
        try:
            loopback = client is not None and ipaddress.ip_address(client[0]).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            return ("the page is served to loopback clients only; set an admin token "
                    "(sparkcache serve --admin-token) to open it to others")
        host = (_header(scope, b"host") or "").lower()
        name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
        if name not in ("127.0.0.1", "localhost", "[::1]"):
            # A page of another site whose name resolves to 127.0.0.1 (DNS rebinding).
            return f"the page answers only to 127.0.0.1 or localhost, not {host!r}"
        return None

    def csrf(self, action: str) -> str:
        """The form token of an action: only a page this server rendered has it."""
        return hmac.new(self._secret, action.encode(), hashlib.sha256).hexdigest()

    def _same_origin(self, scope: Scope) -> bool:
        """Whether a POST comes from this server's own page (browsers send Origin
        and Sec-Fetch-Site with every cross-site form)."""
        site = _header(scope, b"sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            return False
        origin = _header(scope, b"origin")
        if origin is None or origin == "null":
            return origin is None
        host = _header(scope, b"host") or ""
        return origin.split("://", 1)[-1] == host

    async def _page(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope.get("method", "GET"), scope.get("path", "")
        why = self._allowed(scope)
        if why == "login" and path == page.PATH + "/login" and method == "POST":
            return await self._login(scope, receive, send)
        if why == "login":
            return await _respond(send, 401, page.login_form().encode(), page.HTML,
                                  PAGE_HEADERS)
        if why is not None:
            return await _respond(send, 403, why.encode() + b"\n", "text/plain; charset=utf-8")
        if method == "GET" and path == page.PATH:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            note = (query.get("note") or [""])[0][:200]
            html = await self.db(lambda store: page.render(store, csrf=self.csrf("clear"),
                                                           note=note))
            return await _respond(send, 200, html.encode(), page.HTML, PAGE_HEADERS)
        if method == "POST" and path == page.PATH + "/clear":
            return await self._clear(scope, receive, send)
        return await _respond(send, 404, b"not found\n", "text/plain; charset=utf-8")

    async def _form(self, receive: Receive) -> dict[str, str]:
        raw = await _read_body(receive)
        return {k: v[0] for k, v in parse_qs(raw.decode("utf-8", "replace")).items()}

    async def _clear(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            form = await self._form(receive)
        except _Gone:
            return None
        if not self._same_origin(scope) or not hmac.compare_digest(
                form.get("csrf", "").encode(), self.csrf("clear").encode()):
            return await _respond(send, 403, b"this form did not come from this server's page\n",
                                  "text/plain; charset=utf-8")
        try:
            model_id = int(form.get("model", ""))
        except ValueError:
            return await _respond(send, 400, b"no model chosen\n", "text/plain; charset=utf-8")
        try:
            note = await self.db(lambda store: page.clear(store, model_id))
        except SparkCacheError as exc:
            note = f"not cleared: {exc}"
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        if engine is not None and hasattr(engine, "reset_prefix_cache"):
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
        try:
            form = await self._form(receive)
        except _Gone:
            return None
        token = self.settings.admin_token or ""
        if not self._same_origin(scope) or not hmac.compare_digest(
                form.get("token", "").encode(), token.encode()):
            return await _respond(send, 401, page.login_form("wrong token").encode(), page.HTML,
                                  PAGE_HEADERS)
        # Quoted: a token may hold what a cookie value cannot (";", spaces, non-ASCII).
        cookie = f"{page.COOKIE}={_quote(token)}; Path={page.PATH}; HttpOnly; SameSite=Strict"
        await send({"type": "http.response.start", "status": 303, "headers": [
            (b"location", page.PATH.encode()), (b"set-cookie", cookie.encode()),
            (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return None


def _quote(text: str) -> str:
    return quote(text, safe="")
