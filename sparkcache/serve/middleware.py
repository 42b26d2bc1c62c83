"""The ASGI middleware ``sparkcache serve`` puts in front of vLLM's API server.

vLLM adds it with ``--middleware sparkcache.serve.middleware.SparkCacheMiddleware``
(:mod:`sparkcache.serve.launch` does that); its settings come from the
environment the launcher sets (:class:`ServeSettings`).  A request vLLM will
refuse for its ``--api-key`` passes straight to vLLM, unread and unlogged
(:class:`~sparkcache.serve.access.ApiKeys`).  For every other request to a
route that reaches the engine (:data:`ROUTES`) the body is read bounded and
parsed off the event loop (:mod:`sparkcache.serve.bodies`), then

* ``POST /v1/messages`` (Anthropic): validates ``cache_control`` (a 400 in
  Anthropic's error format when malformed), renders the prompt up to each
  marked block through vLLM's own ``/v1/messages/render`` to find the
  breakpoints' token positions, hands them to the connector in
  ``kv_transfer_params``, and rewrites the answer's usage from what the
  connector did (:mod:`sparkcache.serve.usage`): from the finished request's
  ``kv_transfer_params`` when the answer is whole, from the request log row
  the connector writes when the prompt has been scheduled when it streams;
  a pre-warm (``max_tokens: 0``) is answered as Anthropic does
  (:mod:`sparkcache.serve.prewarm`);
* ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` and
  SageMaker's ``/invocations`` (OpenAI): accepts ``prompt_cache_key``, checks and
  applies OpenAI's prompt caching fields (:mod:`sparkcache.serve.openai_cache`:
  breakpoints rendered as Anthropic's are) and adds ``cache_write_tokens`` to
  the usage (:mod:`sparkcache.serve.openai_usage`), whole answers and streams;

* Anthropic's ``diagnostics`` and the Responses' ``comparison_response_id``:
  cache-miss diagnostics (:mod:`sparkcache.serve.diagnostics`, hooks only here);

a request's tenant (its ``prompt_cache_key``, or an Anthropic request's
``x-sparkcache-tenant`` header) salts its cache apart from every other
tenant's (:mod:`sparkcache.serve.tenants`);

it names the request in the request log (``kv_transfer_params["sparkcache"]["id"]``,
always its own, whatever the client sent) and records the API, the model, the
key, the tenant, the status and the total time there; the connector records
the tokens and the engine's timings in the same row.  ``/sparkcache`` is the
page (:mod:`sparkcache.serve.pages`, :mod:`sparkcache.serve.page`), served only
to loopback clients unless an admin token is set.  Everything else passes through untouched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

from sparkcache.errors import InvalidArgument, SparkCacheError
from sparkcache.requestlog import RequestRow, log_rows_setting
from sparkcache.serve import page, warmup
from sparkcache.serve.access import ApiKeys
from sparkcache.serve.bodies import (
    BadBody,
    Gone,
    Message,
    Receive,
    Scope,
    Send,
    TooLarge,
    dumps,
    off_loop,
    parse_json,
    read_body,
    replay_lazy,
    respond,
    without_length,
)
from sparkcache.serve.cache_control import Cut
from sparkcache.serve.checks import Refused, api_of, error_body, prepare, transfer_params
from sparkcache.serve.diagnostics import Editor, edit_answer, resolve
from sparkcache.serve.diagnostics import Plan as Diagnosis
from sparkcache.serve.diagnostics import plan as diagnosis
from sparkcache.serve.launch import check_token
from sparkcache.serve.openai_cache import NONE, OpenAICacheError, Plan, plan
from sparkcache.serve.openai_usage import OpenAISseRewriter, rewrite_answer
from sparkcache.serve.pages import Pages
from sparkcache.serve.prewarm import prewarm_answer, prewarm_of
from sparkcache.serve.render import Renderer
from sparkcache.serve.tenants import apply_tenant
from sparkcache.serve.usage import SseRewriter, anthropic_usage, facts_of
from sparkcache.store import SnapshotStore

__all__ = ["ROUTES", "ServeSettings", "SparkCacheMiddleware"]

logger = logging.getLogger("sparkcache.serve")

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
T = TypeVar("T")

#: The routes that reach the engine and the API each speaks in the request log
#: (``/invocations``: chat or completions, as its body says; None: a route the
#: log names no API for).
ROUTES: dict[str, str | None] = {
    "/v1/messages": "messages",
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/invocations": None,
    "/inference/v1/generate": None,
    "/cohere/v2/chat": None,
}
#: The APIs whose answers' usage is rewritten from the connector's facts.
USAGE_APIS = ("messages", "chat", "completions", "responses")
#: A streamed Anthropic answer waits at most this long for the connector's
#: facts (they are written while the prompt's last chunk is computed, so
#: normally before its first token).
FACTS_WAIT_S = 10.0
#: A diagnosis waits at most this long for the facts of the answer it compares with
#: (committed by the connector's log writer just after that answer went out).
PREVIOUS_WAIT_S = 5.0
#: The largest API request body, in MB, unless SPARKCACHE_MAX_BODY_MB says otherwise.
MAX_BODY_MB = 64


# -- environment the launcher sets ---------------------------------------------------------
ENV_FOLDER = "SPARKCACHE_SERVE_FOLDER"
ENV_ADMIN_TOKEN = "SPARKCACHE_ADMIN_TOKEN"  # noqa: S105 - the variable's name, not a secret
ENV_MAX_BODY = "SPARKCACHE_MAX_BODY_MB"


def _max_body(env: MutableMapping[str, str]) -> int:
    raw = env.get(ENV_MAX_BODY, "").strip() or str(MAX_BODY_MB)
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not 0 < mb <= 1 << 20:
        raise InvalidArgument(f"{ENV_MAX_BODY}={raw[:40]!r} is not valid: give the largest "
                              f"request body in MB, a number > 0 (default {MAX_BODY_MB})")
    return int(mb * (1 << 20))


def _warming(scope: Scope, send: Send) -> Send:
    """``send`` of the server's lifespan, warming the engine up (:mod:`sparkcache.serve.warmup`)
    before the startup it reports complete lets uvicorn take requests."""

    async def sending(message: Message) -> None:
        if message.get("type") == "lifespan.startup.complete":
            await warmup.warm_up(scope.get("app"))
        await send(message)

    return sending


@dataclass(frozen=True)
class ServeSettings:
    """What the middleware needs; read from the environment ``sparkcache serve`` sets."""

    folder: str
    admin_token: str | None = None
    log_rows: int = 10_000
    max_body: int = MAX_BODY_MB << 20  # bytes
    warm_up: bool = True  # the engine answers one tiny request at start (serve.warmup)

    def __post_init__(self) -> None:
        if self.admin_token is not None:
            check_token(self.admin_token, ENV_ADMIN_TOKEN)

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None) -> ServeSettings:
        env = os.environ if env is None else env
        folder = env.get(ENV_FOLDER)
        if not folder:
            raise SparkCacheError(f"{ENV_FOLDER} is not set: start the server with "
                                  "`sparkcache serve`, which sets it")
        return cls(folder=folder, admin_token=env.get(ENV_ADMIN_TOKEN) or None,
                   log_rows=log_rows_setting(env), max_body=_max_body(env),
                   warm_up=warmup.wanted(env))


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """sparkcache's own handler in the server process."""


def _own_logging() -> None:
    """Give the ``sparkcache`` loggers their own handler and level: vLLM's
    SageMaker support sets the root logger to ERROR, which would hide every
    warning of the middleware."""
    ours = logging.getLogger("sparkcache")
    if any(isinstance(h, _Handler) for h in ours.handlers):
        return
    handler = _Handler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


async def _ready(body: bytes) -> bytes:
    return body


class SparkCacheMiddleware:
    """See the module docstring.  One per server process (vLLM adds it)."""

    def __init__(self, app: ASGIApp, settings: ServeSettings | None = None) -> None:
        if settings is None:  # in vLLM's server (which passes none), not in a test's process
            _own_logging()
        self.app = app
        self.settings = settings or ServeSettings.from_env()
        # One thread owns the index connection: its calls never interleave.
        self._db = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sparkcache-db")
        self._store: SnapshotStore | None = None
        self._renderer = Renderer()
        self._keys = ApiKeys(app)  # vLLM's --api-key, when it has one
        self.pages = Pages(self.settings.admin_token, self.db, self,
                           needs_key=self._keys.auth is not None)

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

    async def _poll(self, work: Callable[[SnapshotStore], T], ready: Callable[[T], bool],
                    wait_s: float) -> tuple[T, bool]:
        """Run ``work`` on the index thread until ``ready`` says its result is (pauses
        doubling from 2 ms to 50 ms), at most ``wait_s`` seconds: (the last result,
        whether it was ready).  SparkCacheError propagates."""
        deadline = time.monotonic() + wait_s
        pause = 0.002
        while True:
            got = await self.db(work)
            if ready(got) or time.monotonic() > deadline:
                return got, ready(got)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)

    async def _facts(self, request_id: str) -> dict[str, Any] | None:
        """The connector's row for the request, once it has the prompt's facts."""
        try:
            row, ready = await self._poll(
                lambda store: store.request(request_id),
                lambda r: r is not None and r.prompt_tokens is not None, FACTS_WAIT_S)
        except SparkCacheError as exc:
            logger.warning("sparkcache: request log: %s", exc)
            return None
        if not ready or row is None:
            logger.warning("sparkcache: no facts from the connector for %s within %.0f s; "
                           "usage is vLLM's own", request_id, FACTS_WAIT_S)
            return None
        return {"prompt_tokens": row.prompt_tokens, "live_tokens": row.live_tokens,
                "restored_tokens": row.restored_tokens, "written_tokens": row.written_tokens,
                "written_by_ttl": row.written_by_ttl}

    async def _previous(self, answer_id: str) -> RequestRow | None:
        """The log row of the answer a request compares with, once the connector's
        facts are in it.  An answer reaches its client before the connector's
        log writer has committed its prompt's facts (or, still running, before
        its prefill's end): a row with a fingerprint waits for them at most
        PREVIOUS_WAIT_S, unless its request was answered with an error."""
        def ready(row: RequestRow | None) -> bool:
            return row is None or row.fingerprint is None or row.prompt_tokens is not None \
                or (row.status is not None and row.status != 200)
        row, _ = await self._poll(lambda store: store.request_by_answer(answer_id), ready,
                                  PREVIOUS_WAIT_S)
        return row

    # -- dispatch -------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" and self.settings.warm_up:
            return await self.app(scope, receive, _warming(scope, send))
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if path == page.PATH or path.startswith(page.PATH + "/"):
            return await self.pages(scope, receive, send)
        if path not in ROUTES or scope.get("method") != "POST" or self._keys.refuses(scope):
            # A request vLLM refuses for its --api-key goes to vLLM unread: its 401.
            return await self.app(scope, receive, send)
        return await self._api(ROUTES[path], scope, receive, send)

    # -- the APIs -------------------------------------------------------------------------

    async def _api(self, route: str | None, scope: Scope, receive: Receive,
                   send: Send) -> None:
        """Read, check and forward one API request; log its row whatever happens
        (but a client that went away while sending it)."""
        started = time.monotonic()
        request_id = f"sc-{uuid.uuid4().hex}"  # the row's key: never the client's
        row: dict[str, Any] = {"request_id": request_id, "created_at": time.time(),
                               "api": route}

        async def log(status: int) -> None:
            await self._log({**row, "status": status, "total_s": time.monotonic() - started})

        try:
            raw = await read_body(scope, receive, self.settings.max_body)
            body = await parse_json(raw)
            if not isinstance(body, dict):  # vLLM answers that one itself
                return await log(await self._forward(
                    route, scope, lambda: _ready(raw), receive, send, request_id))
            row["api"] = api = api_of(route, scope.get("path", ""), body)
            if isinstance(body.get("model"), str):
                row["model"] = body["model"]
            prewarm = prewarm_of(api, body)  # before the marks' cuts copy max_tokens
            # In this order: the diagnosis reads prompt_cache_options, which plan takes out.
            (marks, row["cache_key"]), diag, caching = await off_loop(
                len(raw), lambda: (prepare(api, body), diagnosis(api, body, request_id[3:]),
                                   plan(api, body)))
            row["tenant"] = apply_tenant(api, body, scope.get("headers", []), row["cache_key"])
        except Gone:
            return None
        except TooLarge as exc:
            refused = Refused(413, str(exc))
        except BadBody as exc:
            refused = Refused(400, str(exc))
        except Refused as exc:
            refused = exc
        except OpenAICacheError as exc:
            refused = Refused(400, str(exc), exc.param)
        else:
            final = self._final(scope, body, marks, request_id, len(raw), api, caching,
                                diag, row["tenant"])
            return await log(await self._forward(api, scope, final, receive, send, request_id,
                                                 caching, diag, prewarm=prewarm))
        await respond(send, refused.status, error_body(row["api"], refused), "application/json")
        return await log(refused.status)

    async def _diagnose(self, scope: Scope, body: dict[str, Any], diag: Diagnosis,
                        request_id: str, tenant: str | None) -> None:
        """Compare the request with the one it names; record its fingerprint
        (before the answer, so that the client's next request finds it)."""
        await resolve(diag, body, self._previous,
                      lambda b: self._renderer.render(scope, b, diag.api),
                      log_on=self.settings.log_rows > 0, tenant=tenant)
        if self.settings.log_rows > 0:
            await self._log({"request_id": request_id, "answer_id": diag.answer_id,
                             "fingerprint": dumps(diag.fingerprint).decode()})

    def _final(self, scope: Scope, body: dict[str, Any], marks: list[Cut], request_id: str,
               size: int, api: str | None = None, caching: Plan = NONE,
               diag: Diagnosis | None = None,
               tenant: str | None = None) -> Callable[[], Awaitable[bytes]]:
        """The body vLLM reads: the request named for the log, its breakpoints set."""
        marks = [*marks, *caching.cuts]

        async def final_body() -> bytes:
            # Runs when vLLM's route reads the body, after vLLM's own checks.
            if diag is not None:
                await self._diagnose(scope, body, diag, request_id, tenant)
            breakpoints = await self._renderer.positions(
                scope, body, marks, api if api in ("chat", "responses") else "messages") \
                if marks else []
            params, ours = transfer_params(body)  # checked already: they are objects
            ours["id"] = request_id
            if not caching.cache:
                ours["cache"] = False
            if breakpoints:
                ours["breakpoints"] = [*(ours.get("breakpoints") or []), *breakpoints]
            params["sparkcache"] = ours
            body["kv_transfer_params"] = params
            return await off_loop(size, lambda: dumps(body))

        return final_body

    async def _forward(self, api: str | None, scope: Scope,
                       body: Callable[[], Awaitable[bytes]], receive: Receive, send: Send,
                       request_id: str, caching: Plan = NONE,
                       diag: Diagnosis | None = None, *, prewarm: bool = False) -> int:
        """Pass the request to vLLM (its body made when vLLM reads it); rewrite the
        answer's usage (Anthropic's, OpenAI's) and put diagnostics in it.  Returns
        the status sent."""
        status = 500
        start: Message | None = None
        buffered: list[bytes] = []
        rewriter: SseRewriter | None = None
        editor: Editor | None = None
        edits = api in USAGE_APIS or (diag is not None and diag.asked)

        async def relay(message: Message) -> None:
            nonlocal status, start, rewriter, editor
            if message["type"] == "http.response.start":
                status = int(message["status"])
                content_type = ""
                for key, value in message.get("headers", []):
                    if key.lower() == b"content-type":
                        content_type = value.decode("latin-1")
                if not edits or status != 200:
                    return await send(message)
                if content_type.startswith("text/event-stream"):
                    if api in USAGE_APIS:
                        rewriter = SseRewriter(lambda: self._facts(request_id)) \
                            if api == "messages" else \
                            OpenAISseRewriter(api, caching, lambda: self._facts(request_id))
                    editor = Editor(diag) if diag is not None else None
                    return await send(message)
                start = message  # a whole JSON answer: held until its body is rewritten
                return None
            if message["type"] != "http.response.body":
                return await send(message)
            if rewriter is not None or editor is not None:
                return await _stream(send, message, rewriter, editor)
            if start is None:
                return await send(message)
            buffered.append(message.get("body", b""))
            if message.get("more_body"):
                return None
            whole = await self._rewrite_whole(api, caching, request_id, b"".join(buffered),
                                              diag, prewarm=prewarm)
            headers = [(k, v) for k, v in start.get("headers", [])
                       if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(whole)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": whole, "more_body": False})
            return None

        await self.app(without_length(scope), replay_lazy(body, receive), relay)
        return status

    async def _rewrite_whole(self, api: str | None, caching: Plan, request_id: str,
                             body: bytes, diag: Diagnosis | None = None, *,
                             prewarm: bool = False) -> bytes:
        try:
            answer = await parse_json(body)
        except BadBody:
            return body
        if not isinstance(answer, dict):
            return body
        facts = facts_of(answer) if api in USAGE_APIS else None
        edited = diag is not None and (diag.asked or api == "messages")
        if diag is not None:
            edit_answer(diag, answer)
        if api != "messages":
            if api in USAGE_APIS:
                if facts is None and isinstance(answer.get("usage"), dict):
                    facts = await self._facts(request_id)  # not in the answer: the log's row
                if facts is not None or caching.prewarm:
                    rewrite_answer(str(api), answer, facts, caching)
                    edited = True
            return dumps(answer) if edited else body
        if facts is None and not prewarm and not edited:
            return body
        if facts is not None:
            answer["usage"] = anthropic_usage(answer.get("usage"), facts)
        return dumps(prewarm_answer(answer) if prewarm else answer)


async def _stream(send: Send, message: Message, rewriter: SseRewriter | None,
                  editor: Editor | None) -> None:
    """Pass one piece of a streamed answer on, its events rewritten."""
    chunk = message.get("body", b"")
    more = bool(message.get("more_body"))
    if rewriter is not None:
        chunk = await rewriter.feed(chunk)
        if not more:
            chunk += rewriter.rest()
    if editor is not None:
        chunk = editor.feed(chunk)
        if not more:
            chunk += editor.rest()
    if chunk or not more:
        await send({"type": "http.response.body", "body": chunk, "more_body": more})
