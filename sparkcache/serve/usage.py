"""Usage in each API's terms, from what the connector did for the request.

The connector reports a request's facts (``kv_transfer_params["sparkcache"]``
of a finished request, and the same row in the request log while it runs):
``prompt_tokens``, ``live_tokens`` (vLLM's own prefix cache),
``restored_tokens`` (read from snapshots) and ``written_tokens`` (added to the
store at the request's breakpoints, beyond what it read and what was stored).
Anthropic's usage is then

* ``cache_read_input_tokens`` = live + restored,
* ``cache_creation_input_tokens`` = written, and ``cache_creation`` its split
  by the ttl of the breakpoint each token belongs to (``written_by_ttl``):
  ``ephemeral_1h_input_tokens`` those of breakpoints kept longer than five
  minutes, ``ephemeral_5m_input_tokens`` the rest,
* ``input_tokens`` = the rest of the prompt,

so that the three add up to the prompt.  OpenAI's
``prompt_tokens_details.cached_tokens`` is vLLM's own count, which is live +
restored already.

:class:`SseRewriter` rewrites the usage of a streamed Anthropic answer
(``message_start`` and ``message_delta``) event by event.  Pure functions: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

__all__ = ["SseRewriter", "anthropic_usage", "event_data", "facts_of", "prompt_counts",
           "with_data"]

#: A stream event's lines, the index of its JSON ``data:`` line, and that JSON.
EventData = tuple[list[bytes], int, Any]


def event_data(event: bytes) -> EventData | None:
    """A server-sent event's first JSON ``data:`` line, parsed (OpenAI's
    ``[DONE]`` is no JSON line); None when it has none or it is not JSON."""
    lines = event.split(b"\n")
    for i, line in enumerate(lines):
        data = line[5:].strip()
        if not line.startswith(b"data:") or data == b"[DONE]":
            continue
        try:
            return lines, i, json.loads(data)
        except ValueError:
            return None
    return None


def with_data(found: EventData, payload: Any) -> bytes:
    """The event of :func:`event_data` with its data line holding ``payload``."""
    lines, i, _old = found
    lines[i] = b"data: " + json.dumps(payload, separators=(",", ":")).encode()
    return b"\n".join(lines)

Facts = Mapping[str, Any]


def facts_of(response: Mapping[str, Any]) -> Facts | None:
    """The connector's facts in a response's ``kv_transfer_params``, if any."""
    params = response.get("kv_transfer_params")
    ours = params.get("sparkcache") if isinstance(params, Mapping) else None
    return ours if isinstance(ours, Mapping) and "prompt_tokens" in ours else None


def prompt_counts(facts: Facts) -> tuple[int, int, int]:
    """(prompt, read, written) tokens of the connector's facts: read from vLLM's
    live cache or restored, and written at breakpoints beyond those (never more
    than the rest of the prompt)."""
    prompt = int(facts.get("prompt_tokens") or 0)
    read = int(facts.get("live_tokens") or 0) + int(facts.get("restored_tokens") or 0)
    return prompt, read, min(int(facts.get("written_tokens") or 0), max(0, prompt - read))


def anthropic_usage(usage: Mapping[str, Any] | None, facts: Facts) -> dict[str, Any]:
    """vLLM's Anthropic ``usage`` with the cache fields from the connector's facts."""
    out = dict(usage or {})
    prompt, read, written = prompt_counts(facts)
    out["cache_read_input_tokens"] = read
    out["cache_creation_input_tokens"] = written
    one_hour = min(written, _longer_than_5m(facts.get("written_by_ttl")))
    out["cache_creation"] = {"ephemeral_5m_input_tokens": written - one_hour,
                             "ephemeral_1h_input_tokens": one_hour}
    out["input_tokens"] = max(0, prompt - read - written)
    out.setdefault("output_tokens", 0)
    return out


#: A breakpoint kept longer than this (seconds) writes Anthropic's 1-hour cache.
FIVE_MINUTES = 300


def _longer_than_5m(by_ttl: Any) -> int:
    """Of a ``written_by_ttl`` (keep seconds as text -> tokens), the tokens of
    breakpoints kept longer than five minutes; 0 when there is none."""
    if not isinstance(by_ttl, Mapping):
        return 0
    total = 0
    for seconds, tokens in by_ttl.items():
        key = str(seconds)
        if len(key) <= 12 and key.isdigit() and int(key) > FIVE_MINUTES \
                and isinstance(tokens, int):
            total += max(0, tokens)
    return total


class SseRewriter:
    """Rewrites the usage of Anthropic stream events as the bytes pass.

    ``facts`` is awaited once, at the first event that carries usage; None
    leaves vLLM's usage as it is.  Events are split on blank lines; an event
    is passed on as soon as it is whole.
    """

    def __init__(self, facts: Callable[[], Awaitable[Facts | None]]) -> None:
        self._facts = facts
        self._known: Facts | None = None
        self._asked = False
        self._pending = b""
        self.output_tokens: int | None = None  # from the last message_delta seen

    async def feed(self, chunk: bytes) -> bytes:
        """The whole events in ``chunk`` (plus what was pending), rewritten."""
        data = self._pending + chunk
        head, sep, self._pending = data.rpartition(b"\n\n")
        if not sep:
            self._pending = data
            return b""
        out = [await self._event(event) for event in head.split(b"\n\n")]
        return b"\n\n".join(out) + b"\n\n"

    def rest(self) -> bytes:
        """Whatever incomplete event is left when the stream ends (passed on as is)."""
        rest, self._pending = self._pending, b""
        return rest

    async def _event(self, event: bytes) -> bytes:
        found = event_data(event)
        if found is None or not isinstance(found[2], dict):
            return event
        payload = found[2]
        kind = payload.get("type")
        if kind == "message_start" and isinstance(payload.get("message"), dict):
            holder: dict[str, Any] = payload["message"]
        elif kind == "message_delta":
            holder = payload
            usage = holder.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("output_tokens"), int):
                self.output_tokens = usage["output_tokens"]
        else:
            return event
        facts = await self._get()
        if facts is None:
            return event
        holder["usage"] = anthropic_usage(holder.get("usage"), facts)
        return with_data(found, payload)

    async def _get(self) -> Facts | None:
        if not self._asked:
            self._asked = True
            self._known = await self._facts()
        return self._known
