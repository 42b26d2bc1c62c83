"""Request bodies as the middleware reads them: bounded, parsed off the event loop,
and answered in each API's own error format.

Every body the middleware reads goes through :func:`read_body` with a limit:
a ``content-length`` above it is refused before a byte is read, a body that
grows past it is refused as soon as it does (:class:`TooLarge`), so no client
holds more than the limit in the server's memory.  :func:`parse_json` turns an
API body into Python, on a worker thread when it is large (a 20 MB body parsed
on the event loop stalls every other request, ``/health`` too), and refuses
nesting deeper than :data:`MAX_DEPTH` (:class:`BadBody`): Python's recursion
limit would otherwise turn such a body into a 500 in the parser or in a copy
made later.  Pure ASGI helpers: no vLLM.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from sparkcache.errors import InvalidArgument

__all__ = ["MAX_DEPTH", "MAX_FORM", "OFF_LOOP_BYTES", "BadBody", "Gone", "TooLarge",
           "anthropic_error", "dumps", "header", "off_loop", "openai_error", "parse_json",
           "read_body", "replay", "replay_lazy", "respond", "without_length"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
T = TypeVar("T")

#: The deepest nesting of arrays and objects an API body may have (Anthropic's
#: and OpenAI's requests need a handful of levels; tool schemas a few more).
MAX_DEPTH = 64
#: The largest form the page accepts (the login and clear forms are a few fields).
MAX_FORM = 4096
#: Bodies at least this large are parsed and serialised on a worker thread.
OFF_LOOP_BYTES = 64 * 1024


class Gone(Exception):
    """The client went away while its request was read."""


class TooLarge(InvalidArgument):
    """A body longer than its limit (answered 413)."""


class BadBody(InvalidArgument):
    """A body that is JSON no API request can be (answered 400)."""


def header(scope: Scope, name: bytes) -> str | None:
    """The first header ``name`` (lower case) of the request, as latin-1 text."""
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes (:class:`TooLarge` beyond it, before
    reading more); :class:`Gone` when the client disconnects first."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body ({int(declared)} bytes) is larger than "
                       f"{limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Gone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the request body is larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def off_loop(size: int, work: Callable[[], T]) -> T:
    """``work()``, on a worker thread when ``size`` bytes make it slow."""
    if size < OFF_LOOP_BYTES:
        return work()
    return await asyncio.to_thread(work)


def _depth_ok(value: Any) -> bool:
    """Whether ``value`` nests at most :data:`MAX_DEPTH` levels (no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_DEPTH:
            return False
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return True


def _parse(raw: bytes) -> Any:
    """JSON, or None when it is not JSON (vLLM answers that itself)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise BadBody(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError:
        return None
    if not _depth_ok(value):
        raise BadBody(f"the request body nests deeper than {MAX_DEPTH} levels")
    return value


async def parse_json(raw: bytes) -> Any:
    """The body as JSON (None: not JSON); :class:`BadBody` when it nests deeper
    than :data:`MAX_DEPTH`.  Parsed on a worker thread when large."""
    return await off_loop(len(raw), lambda: _parse(raw))


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def anthropic_error(message: str, kind: str = "invalid_request_error") -> bytes:
    return dumps({"type": "error", "error": {"type": kind, "message": message}})


def openai_error(message: str, param: str | None,
                 kind: str = "invalid_request_error") -> bytes:
    return dumps({"error": {"message": message, "type": kind, "param": param, "code": None}})


async def respond(send: Send, status: int, body: bytes, content_type: str,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
        (b"x-content-type-options", b"nosniff"), *(headers or []),
    ]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then the client's own messages
    (vLLM listens for the disconnect to cancel a request)."""
    return replay_lazy(lambda: _ready(body), receive)


async def _ready(body: bytes) -> bytes:
    return body


def replay_lazy(make: Callable[[], Awaitable[bytes]], receive: Receive) -> Receive:
    """:func:`replay` of a body made when it is first read."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": await make(), "more_body": False}
        return await receive()

    return again


def without_length(scope: Scope) -> Scope:
    """The scope without a content-length (the body passed on may differ in length)."""
    new = dict(scope)
    new["headers"] = [(k, v) for k, v in scope.get("headers", [])
                      if k.lower() != b"content-length"]
    return new
