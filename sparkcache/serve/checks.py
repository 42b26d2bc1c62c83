"""What the middleware checks of an API request before vLLM sees it.

:func:`prepare` finds a request's ``cache_control`` marks and its
``prompt_cache_key`` and checks its ``kv_transfer_params``; a request it
refuses raises :class:`Refused`, which the middleware answers in the API's own
error format (:func:`error_body`).  Pure functions over the request's JSON.
"""

from __future__ import annotations

from typing import Any

from sparkcache.errors import InvalidArgument
from sparkcache.serve.bodies import anthropic_error, openai_error
from sparkcache.serve.cache_control import CacheControlError, Cut, cuts

__all__ = ["MAX_CACHE_KEY", "Refused", "api_of", "cache_key", "error_body", "prepare",
           "transfer_params"]

MAX_CACHE_KEY = 1024


class Refused(InvalidArgument):
    """A request the middleware answers itself: (status, message, param)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(api: str | None, refused: Refused) -> bytes:
    """The error body in the API's own format."""
    if api == "messages":
        kind = "request_too_large" if refused.status == 413 else "invalid_request_error"
        return anthropic_error(refused.message, kind)
    return openai_error(refused.message, refused.param)


def api_of(route: str | None, path: str, body: dict[str, Any]) -> str | None:
    """The API a request speaks: its route's, or for SageMaker's ``/invocations``
    what its body is (chat with ``messages``, completions with ``prompt``)."""
    if route is not None or path != "/invocations":
        return route
    if "messages" in body:
        return "chat"
    return "completions" if "prompt" in body else None


def cache_key(api: str | None, body: dict[str, Any]) -> str | None:
    """The request's ``prompt_cache_key`` (taken out of chat and completions
    requests, which vLLM does not know it in); Refused when malformed."""
    if api not in ("chat", "completions", "responses"):
        return None
    key = body.pop("prompt_cache_key", None) if api != "responses" \
        else body.get("prompt_cache_key")
    if key is not None and not (isinstance(key, str) and len(key) <= MAX_CACHE_KEY):
        raise Refused(400, f"prompt_cache_key must be a string of at most {MAX_CACHE_KEY} "
                       f"characters, got {type(key).__name__}", "prompt_cache_key")
    return key


def transfer_params(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The request's ``kv_transfer_params`` and its ``sparkcache`` part, copied;
    Refused when they are not objects or the breakpoints not a list."""
    params = body.get("kv_transfer_params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise Refused(400, "kv_transfer_params must be an object", "kv_transfer_params")
    ours = params.get("sparkcache")
    if ours is None:
        ours = {}
    if not isinstance(ours, dict):
        raise Refused(400, "kv_transfer_params.sparkcache must be an object",
                       "kv_transfer_params")
    if not isinstance(ours.get("breakpoints") or [], list):
        raise Refused(400, "kv_transfer_params.sparkcache.breakpoints must be a list of "
                       'token positions or {"at": position, "ttl": seconds}',
                       "kv_transfer_params")
    return dict(params), dict(ours)


def prepare(api: str | None, body: dict[str, Any]) -> tuple[list[Cut], str | None]:
    """The request's marks and ``prompt_cache_key``; Refused when malformed."""
    transfer_params(body)
    if api != "messages":
        return [], cache_key(api, body)
    try:
        return cuts(body), None
    except CacheControlError as exc:
        raise Refused(400, str(exc)) from None
