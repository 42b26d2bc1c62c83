"""OpenAI usage in OpenAI's terms, from what the connector did for the request.

From the connector's facts (:mod:`sparkcache.serve.usage`):

* ``cache_write_tokens`` (chat completions and completions:
  ``usage.prompt_tokens_details``; Responses: ``usage.input_tokens_details``,
  where it replaces vLLM's count of its own in-memory block creations) =
  ``written_tokens``, the tokens the request's breakpoints added to the store;
* Responses' ``cache_write_tokens_details`` splits them by ttl
  (``ttl_30m_tokens``, ``ttl_12h_tokens``), from the facts' ``written_by_ttl``
  (keep seconds -> tokens) when the connector reports it, else all in the
  one ttl of the request's breakpoints (the request's own when they differ);
* ``cached_tokens`` stays vLLM's count (live + restored), ``prompt_tokens`` /
  ``input_tokens`` the whole prompt, so that ``input_tokens - cached_tokens -
  cache_write_tokens`` is what the request computed without caching it.

:func:`rewrite_answer` edits a whole answer, :class:`OpenAISseRewriter` a
stream's usage-carrying events (chat and completions chunks with ``usage``,
Responses' ``response.completed``); :func:`prewarm_answer` turns a prewarm's
one-token answer into the empty one OpenAI sends.  Pure functions: no I/O.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sparkcache.serve.openai_cache import TTLS, Plan
from sparkcache.serve.usage import Facts, SseRewriter, event_data, prompt_counts, with_data

__all__ = ["OpenAISseRewriter", "chat_usage", "prewarm_answer", "responses_usage",
           "rewrite_answer", "written_split"]

#: Responses' stream events whose ``response`` carries the final usage.
_FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def written_split(facts: Facts, plan: Plan) -> tuple[int, int, int]:
    """(written, of them kept 30 minutes, of them kept 12 hours or more).

    ``written_by_ttl`` maps keep seconds (a string; "0": no keep) to tokens;
    a bucket of 12 hours or more is ``ttl_12h``, a shorter one ``ttl_30m``, "0"
    the request's own.  Absent, or not adding up to the written tokens, all go
    to :attr:`Plan.write_ttl`'s bucket."""
    _prompt, _read, written = prompt_counts(facts)
    own_long = plan.write_ttl >= TTLS["12h"]
    by_ttl = facts.get("written_by_ttl")
    short = long = 0
    if isinstance(by_ttl, Mapping):
        try:
            for seconds, tokens in by_ttl.items():
                keep = float(seconds)
                if keep >= TTLS["12h"] or (keep == 0 and own_long):
                    long += int(tokens)
                else:
                    short += int(tokens)
        except (TypeError, ValueError):
            short = long = -1
    if short + long != written or short < 0:
        short, long = (0, written) if own_long else (written, 0)
    return written, short, long


def chat_usage(usage: Mapping[str, Any] | None, facts: Facts) -> dict[str, Any]:
    """A chat completions or completions ``usage`` with ``cache_write_tokens``."""
    out = dict(usage or {})
    details = dict(out.get("prompt_tokens_details") or {})
    _prompt, read, written = prompt_counts(facts)
    details.setdefault("cached_tokens", read)
    details["cache_write_tokens"] = written
    out["prompt_tokens_details"] = details
    return out


def responses_usage(usage: Mapping[str, Any] | None, facts: Facts,
                    plan: Plan) -> dict[str, Any]:
    """A Responses ``usage`` with ``cache_write_tokens`` and its split by ttl."""
    out = dict(usage or {})
    details = dict(out.get("input_tokens_details") or {})
    details.setdefault("cached_tokens", prompt_counts(facts)[1])
    written, short, long = written_split(facts, plan)
    details["cache_write_tokens"] = written
    details["cache_write_tokens_details"] = {"ttl_30m_tokens": short, "ttl_12h_tokens": long}
    out["input_tokens_details"] = details
    return out


def prewarm_answer(answer: dict[str, Any], plan: Plan) -> None:
    """A prewarm's answer as OpenAI sends it: completed, no output, no output tokens."""
    answer["status"] = "completed"
    answer["incomplete_details"] = None
    answer["output"] = []
    answer["max_output_tokens"] = plan.max_output_tokens
    usage = answer.get("usage")
    if isinstance(usage, dict):
        usage["output_tokens"] = 0
        usage["output_tokens_details"] = {**(usage.get("output_tokens_details") or {}),
                                          "reasoning_tokens": 0}
        usage["total_tokens"] = int(usage.get("input_tokens") or 0)


def rewrite_answer(api: str, answer: dict[str, Any], facts: Facts | None, plan: Plan) -> None:
    """Edit a whole answer of ``api`` in place: its usage (when there are facts)
    and a prewarm's output."""
    if plan.prewarm:
        prewarm_answer(answer, plan)
    usage = answer.get("usage")
    if facts is None or not isinstance(usage, dict):
        return
    if api == "responses":
        answer["usage"] = responses_usage(usage, facts, plan)
    else:
        answer["usage"] = chat_usage(usage, facts)


class OpenAISseRewriter(SseRewriter):
    """Rewrites the usage of an OpenAI stream's events as the bytes pass
    (``facts`` is awaited once, at the first event that carries usage)."""

    def __init__(self, api: str, plan: Plan,
                 facts: Callable[[], Awaitable[Facts | None]]) -> None:
        super().__init__(facts)
        self.api, self.plan = api, plan

    async def _event(self, event: bytes) -> bytes:
        found = event_data(event)
        holder = None if found is None else self._holder(found[2])
        if found is None or holder is None:
            return event
        facts = await self._get()
        if facts is None:
            return event
        if self.api == "responses":
            holder["usage"] = responses_usage(holder["usage"], facts, self.plan)
        else:
            holder["usage"] = chat_usage(holder["usage"], facts)
        return with_data(found, found[2])

    def _holder(self, payload: Any) -> dict[str, Any] | None:
        """The object in an event whose ``usage`` is to be rewritten, if any."""
        if not isinstance(payload, dict):
            return None
        if self.api == "responses":
            holder = payload.get("response") if payload.get("type") in _FINAL_EVENTS else None
        else:
            holder = payload
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            return holder
        return None
