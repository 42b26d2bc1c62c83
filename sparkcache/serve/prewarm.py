"""Anthropic's pre-warm: a ``/v1/messages`` request with ``max_tokens: 0``.

Anthropic answers such a request without generating anything: the prompt is
prefilled and its ``cache_control`` breakpoints are written, the answer has
no content, ``stop_reason: "max_tokens"`` and the whole usage.  vLLM refuses
``max_tokens: 0``, so :func:`prewarm_of` sends it ``max_tokens: 1`` (the engine
computes the prompt and samples one token) and :func:`prewarm_answer` makes
the answer Anthropic's.  A pre-warm with ``stream: true``, with thinking
enabled or with a forced tool (``tool_choice`` of type ``tool`` or ``any``)
is refused, as Anthropic refuses it.  Pure functions over the JSON: no vLLM.
"""

from __future__ import annotations

from typing import Any

from sparkcache.serve.checks import Refused

__all__ = ["ENGINE_MAX_TOKENS", "prewarm_answer", "prewarm_of"]

#: What a pre-warm asks of vLLM (its least ``max_tokens``).
ENGINE_MAX_TOKENS = 1


def _is_zero(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == 0


def _refusal(body: dict[str, Any]) -> str | None:
    """Why a pre-warm request cannot be one (None: it can)."""
    if body.get("stream") is True:
        return "stream: true"
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        return "thinking enabled"
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("tool", "any"):
        return f"a forced tool (tool_choice of type {choice['type']!r})"
    return None


def prewarm_of(api: str | None, body: dict[str, Any]) -> bool:
    """Whether ``body`` is an Anthropic pre-warm (``max_tokens: 0``); when it is,
    its ``max_tokens`` becomes :data:`ENGINE_MAX_TOKENS` (in place).  Raises
    :class:`~sparkcache.serve.checks.Refused` (400) for a pre-warm that
    streams, thinks or forces a tool."""
    if api != "messages" or not _is_zero(body.get("max_tokens")):
        return False
    why = _refusal(body)
    if why is not None:
        raise Refused(400, f"max_tokens: 0 (a cache pre-warm) cannot be combined with {why}: "
                           "send the pre-warm without it, or ask for max_tokens >= 1")
    body["max_tokens"] = ENGINE_MAX_TOKENS
    return True


def prewarm_answer(answer: dict[str, Any]) -> dict[str, Any]:
    """A whole ``/v1/messages`` answer as a pre-warm's: no content, ``stop_reason``
    ``max_tokens``, no stop sequence, ``output_tokens`` 0 (the rest of its
    usage as it is)."""
    out = {**answer, "content": [], "stop_reason": "max_tokens", "stop_sequence": None}
    usage = answer.get("usage")
    out["usage"] = {**(usage if isinstance(usage, dict) else {}), "output_tokens": 0}
    return out
