"""Cache-miss diagnostics in Anthropic's and OpenAI's formats, from the request log.

A request asks to be compared with an earlier one: Anthropic's
``diagnostics.previous_message_id`` (the ``diagnostics`` object is the opt-in;
the beta header ``cache-diagnosis-2026-04-07`` is accepted and not needed),
OpenAI Responses' ``prompt_cache_options.comparison_response_id``.  Each
such request, and every Responses request, records a *fingerprint* of its
prompt in its request log row: digests of its parts (model, tools, system or
instructions, each message or input item, the settings that change the
prompt), never their text, with the id the client sees on the answer.

:func:`compare` names the first part that differs (the reason) and its index;
:func:`missed` turns it into tokens: the previous request's prompt tokens
beyond the tokens the two prompts share before that part.  docs/serve.md
("Cache-miss diagnostics") states the rules.  Pure functions over JSON, but
:class:`Editor`, which puts the result into a streamed answer as it passes,
and :func:`resolve`, which awaits the log lookup and the renders it is given.
A request is compared only with its own tenant's (:func:`visible`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from sparkcache.errors import SparkCacheError
from sparkcache.serve.cache_control import common_prefix
from sparkcache.serve.checks import Refused
from sparkcache.serve.usage import event_data, with_data

__all__ = ["BETA", "MAX_PARTS", "NOT_FOUND", "Editor", "Plan", "Verdict", "anthropic_form",
           "compare", "edit_answer", "fingerprint", "missed", "openai_form", "plan", "probe_body",
           "resolve", "visible"]

#: Anthropic's beta header value for the feature (accepted, not required).
BETA: Final = "cache-diagnosis-2026-04-07"
#: The most message digests a fingerprint keeps; the rest are digested as one.
MAX_PARTS: Final = 512
#: The longest answer id a client may name.
MAX_ANSWER_ID: Final = 256
VERSION: Final = 1
#: The verdict of a previous request the log does not hold.
NOT_FOUND: Final = "not_found"

# The parts compared, in order, and the reason each names (Anthropic, OpenAI).
_MESSAGES_ORDER: Final = (("model", "model_changed"), ("tools", "tools_changed"),
                          ("system", "system_changed"))
_RESPONSES_ORDER: Final = (
    ("model", "model_changed"), ("key", "prompt_cache_key_changed"),
    ("tools", "tools_changed"), ("format", "text_format_changed"),
    ("effort", "reasoning_effort_changed"), ("verbosity", "verbosity_changed"),
    ("tier", "service_tier_changed"))


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _plain(value: Any) -> Any:
    """``value`` without ``cache_control`` marks (they change no prompt token)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()
                if k not in ("cache_control", "prompt_cache_breakpoint")}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _blocks(content: Any) -> Any:
    """A string content as the one text block it means."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else _plain(content)


def _digests(items: list[Any]) -> list[str]:
    digests = [_digest(item) for item in items[:MAX_PARTS - 1]]
    if len(items) >= MAX_PARTS:
        digests.append(_digest(items[MAX_PARTS - 1:]))
    return digests


def _message(message: Any) -> Any:
    if isinstance(message, dict):
        return {**_plain(message), "content": _blocks(message.get("content"))}
    return message


def fingerprint(api: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The digests of a request's prompt parts (``api``: messages or responses)."""
    if api == "messages":
        messages = body.get("messages")
        return {"v": VERSION, "model": _digest(body.get("model")),
                "tools": _digest(_plain(body.get("tools"))),
                "system": _digest(_blocks(body.get("system"))),
                "parts": _digests([_message(m) for m in messages]
                                  if isinstance(messages, list) else [messages]),
                "other": _digest([body.get("tool_choice"), body.get("thinking")])}
    text: dict[str, Any] = body["text"] if isinstance(body.get("text"), dict) else {}
    reasoning: dict[str, Any] = body["reasoning"] if isinstance(body.get("reasoning"), dict) \
        else {}
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    return {"v": VERSION, "model": _digest(body.get("model")),
            "key": _digest(body.get("prompt_cache_key")),
            "tools": _digest(_plain(body.get("tools"))),
            "format": _digest(text.get("format")), "verbosity": _digest(text.get("verbosity")),
            "effort": _digest(reasoning.get("effort")),
            "tier": _digest(body.get("service_tier") or "auto"),
            "parts": _digests([body.get("instructions"),
                               *(_message(i) for i in items)] if isinstance(items, list)
                              else [body.get("instructions"), items]),
            "other": _digest(body.get("previous_response_id"))}


@dataclass(frozen=True)
class Verdict:
    """What the comparison found: ``reason`` None is no divergence; ``index``
    the first differing part (-1: one before the parts, no token shared)."""

    reason: str | None
    index: int = -1


def compare(api: str, previous: Mapping[str, Any], current: Mapping[str, Any]) -> Verdict:
    """The first part of ``previous`` that ``current`` lacks.  Previous parts must
    be a prefix of the current ones (a conversation grows at its end).  A
    fingerprint of another version, or another prompt-affecting setting that
    differs, is ``unavailable``."""
    if previous.get("v") != VERSION or current.get("v") != VERSION:
        return Verdict("unavailable")
    order = _MESSAGES_ORDER if api == "messages" else _RESPONSES_ORDER
    for name, reason in order:
        if previous.get(name) != current.get(name):
            return Verdict(reason)
    before, now = list(previous.get("parts") or []), list(current.get("parts") or [])
    for i, digest in enumerate(before):
        if i >= len(now) or now[i] != digest:
            return Verdict("messages_changed" if api == "messages" else "input_changed",
                           i - (api != "messages"))
    if previous.get("other") != current.get("other"):
        return Verdict("unavailable")
    return Verdict(None)


def probe_body(api: str, body: Mapping[str, Any], index: int) -> dict[str, Any] | None:
    """The request cut before part ``index``'s text: the parts before it and,
    when it is a message, that message with empty content (its header stays).
    Its render shares with the whole prompt exactly the tokens before that
    text.  None: nothing before it (no token shared)."""
    key = "messages" if api == "messages" else "input"
    items = body.get(key)
    if api != "messages" and isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if index < 0 or not isinstance(items, list) or index >= len(items):
        return None
    kept = list(items[:index])
    target = items[index]
    if isinstance(target, dict) and isinstance(target.get("role"), str):
        kept.append({"role": target["role"], "content": ""})
    if not kept:
        return None
    return {**body, key: kept}


def missed(previous_prompt: int, shared: int) -> int:
    """The previous request's prompt tokens beyond the ``shared`` ones (>= 0)."""
    return max(0, previous_prompt - min(shared, previous_prompt))


def anthropic_form(verdict: Verdict | None, previous_prompt: int, shared: int
                   ) -> dict[str, Any] | None:
    """The answer's ``diagnostics``: None (no divergence, or nothing compared),
    else ``{"cache_miss_reason": {...}}`` with ``cache_missed_input_tokens``
    for a reason that names a changed part."""
    if verdict is None or verdict.reason is None:
        return None
    kind = "previous_message_not_found" if verdict.reason == NOT_FOUND else verdict.reason
    reason: dict[str, Any] = {"type": kind}
    if verdict.reason.endswith("_changed"):
        reason["cache_missed_input_tokens"] = missed(previous_prompt, shared)
    return {"cache_miss_reason": reason}


def openai_form(verdict: Verdict | None, previous_prompt: int, shared: int) -> dict[str, Any]:
    """The Response's ``prompt_cache_diagnostics``."""
    if verdict is None or verdict.reason == NOT_FOUND:
        return {"type": "comparison_response_not_found"}
    if verdict.reason is None:
        return {"type": "cache_hit"}
    if verdict.reason == "unavailable":
        return {"type": "unavailable"}
    return {"type": "cache_miss", "reason": verdict.reason,
            "cache_missed_tokens": missed(previous_prompt, shared),
            "comparison_reusable_tokens": previous_prompt}


def visible(previous_tenant: str | None, tenant: str | None) -> bool:
    """Whether a request may be compared with a previous one: only with its own
    tenant's (requests without one are one tenant's).  Another tenant's reads
    as a changed ``prompt_cache_key`` with no tokens reusable (Responses) or as
    not found (Anthropic), and no part of it is compared."""
    return previous_tenant == tenant


# -- a request's plan ---------------------------------------------------------------------


@dataclass
class Plan:
    """What diagnostics do for one request: record ``fingerprint`` under
    ``answer_id``; with ``asked``, compare with ``previous`` (None: the first
    turn of an opt-in, nothing to compare) and put ``result`` in the answer."""

    api: str
    answer_id: str
    fingerprint: dict[str, Any]
    asked: bool
    previous: str | None
    result: dict[str, Any] | None = None


def _previous_id(value: Any, param: str) -> str | None:
    if value is not None and not (isinstance(value, str) and 0 < len(value) <= MAX_ANSWER_ID):
        raise Refused(400, f"{param} must be a response id, a string of 1 to "
                      f"{MAX_ANSWER_ID} characters, or null", param)
    return value


def plan(api: str | None, body: dict[str, Any], request_hex: str) -> Plan | None:
    """The diagnostics of a request (None: none); Refused when its field is
    malformed.  A Responses request is always fingerprinted (any later one may
    name it), under vLLM's ``request_id``, which it sets when the client did not."""
    if api == "messages":
        opt = body.get("diagnostics")
        if opt is None:
            return None
        if not isinstance(opt, dict):
            raise Refused(400, "diagnostics must be an object", "diagnostics")
        previous = _previous_id(opt.get("previous_message_id"), "diagnostics.previous_message_id")
        return Plan(api, f"msg_{request_hex}", fingerprint(api, body), True, previous)
    if api != "responses":
        return None
    options = body.get("prompt_cache_options")
    previous = None
    if isinstance(options, dict):  # its other fields are checked with prompt caching's
        previous = _previous_id(options.get("comparison_response_id"),
                                "prompt_cache_options.comparison_response_id")
    own = body.get("request_id")
    if not (isinstance(own, str) and 0 < len(own) <= MAX_ANSWER_ID):
        own = body["request_id"] = f"resp_{request_hex}"
    return Plan(api, own, fingerprint(api, body), previous is not None, previous)


# -- the answer -----------------------------------------------------------------------------


def edit_answer(plan_: Plan, answer: dict[str, Any]) -> None:
    """Put the plan's result (and, for Anthropic, its id) in a whole answer."""
    if plan_.api == "messages":
        answer["id"] = plan_.answer_id
        answer["diagnostics"] = plan_.result
    elif plan_.asked:
        answer["prompt_cache_diagnostics"] = plan_.result


class Editor:
    """Edits the events of a streamed answer as their bytes pass: Anthropic's
    ``message_start`` message, the Responses' ``response.completed`` response."""

    def __init__(self, plan_: Plan) -> None:
        self.plan = plan_
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """The whole events in ``chunk`` (plus what was pending), edited."""
        head, sep, self._pending = (self._pending + chunk).rpartition(b"\n\n")
        if not sep:
            self._pending = head + self._pending
            return b""
        return b"\n\n".join(self._event(e) for e in head.split(b"\n\n")) + b"\n\n"

    def rest(self) -> bytes:
        """Whatever incomplete event is left when the stream ends."""
        rest, self._pending = self._pending, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        found = event_data(event)
        holder = None if found is None else _holder(self.plan.api, found[2])
        if found is None or holder is None:
            return event
        edit_answer(self.plan, holder)
        return with_data(found, found[2])


def _holder(api: str, payload: Any) -> dict[str, Any] | None:
    if not isinstance(payload, dict):
        return None
    kind, name = ("message_start", "message") if api == "messages" \
        else ("response.completed", "response")
    inner = payload.get(name)
    return inner if payload.get("type") == kind and isinstance(inner, dict) else None


# -- the comparison -------------------------------------------------------------------------

#: An answer's log row by its id (None: never recorded or trimmed).
Lookup = Callable[[str], Awaitable[Any]]
#: A request body's prompt token ids (None: it did not render).
Render = Callable[[dict[str, Any]], Awaitable["list[int] | None"]]


async def resolve(plan_: Plan, body: dict[str, Any], lookup: Lookup, render: Render, *,
                  log_on: bool, tenant: str | None = None) -> None:
    """Compare the request with the one it names and set ``plan_.result``.
    ``lookup`` raising SparkCacheError, or no log (``log_on`` False), is
    ``unavailable``; a row of another API or without a fingerprint is not
    found; one of another tenant is told as :func:`visible` says."""
    if not plan_.asked or plan_.previous is None:
        return
    verdict, prompt, shared = await _verdict(plan_, body, lookup, render, log_on, tenant)
    plan_.result = (anthropic_form if plan_.api == "messages" else openai_form)(
        verdict, prompt, shared)


async def _verdict(plan_: Plan, body: dict[str, Any], lookup: Lookup, render: Render,
                   log_on: bool, tenant: str | None) -> tuple[Verdict, int, int]:
    if not log_on:
        return Verdict("unavailable"), 0, 0
    try:
        row = await lookup(plan_.previous or "")
    except SparkCacheError:
        return Verdict("unavailable"), 0, 0
    if row is None or row.api != plan_.api or row.fingerprint is None:
        return Verdict(NOT_FOUND), 0, 0
    if not visible(getattr(row, "tenant", None), tenant):
        # Another tenant's: nothing of it is reusable, and nothing of its prompt
        # is told (no counts, no part compared: no probing across tenants).
        return Verdict("prompt_cache_key_changed" if plan_.api == "responses"
                       else NOT_FOUND), 0, 0
    try:
        before = json.loads(row.fingerprint)
    except ValueError:
        before = {}
    if row.prompt_tokens is None or not isinstance(before, dict):
        return Verdict("unavailable"), 0, 0
    verdict = compare(plan_.api, before, plan_.fingerprint)
    shared = 0
    probe = probe_body(plan_.api, body, verdict.index) \
        if verdict.reason in ("messages_changed", "input_changed") else None
    if probe is not None:
        whole, part = await render(body), await render(probe)
        if whole is not None and part is not None:
            shared = common_prefix(part, whole)
    return verdict, int(row.prompt_tokens), shared
