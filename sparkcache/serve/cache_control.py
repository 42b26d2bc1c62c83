"""Anthropic ``cache_control`` blocks: validated, and turned into prompt cuts.

A ``cache_control`` on a tool, a system block, a message, a content block or
a block inside a ``tool_result``'s content marks the prompt prefix up to and
including that block; a top-level ``cache_control`` marks everything up to the
last message (on a last block marked already: a no-op with the same ttl, an
error with another, as Anthropic has it).  Anthropic's prompt
order is tools, then system, then messages.  For each mark, :func:`cuts`
returns the request with everything after the marked block removed (a
:class:`Cut`); the server renders it with the model's chat template and the
breakpoint's token position is where that rendering stops agreeing with the
full prompt's (:func:`common_prefix`; the connector rounds it down to a whole
block).  Whatever the template does, the position is a prefix of the real
prompt: the comparison makes sure of that.

Pure functions over the request's JSON: no vLLM, no I/O.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparkcache.errors import InvalidArgument
from sparkcache.hashing import common_prefix

__all__ = ["MAX_BREAKPOINTS", "TTLS", "CacheControlError", "Cut", "common_prefix", "cuts",
           "strip"]

#: Anthropic's limit on blocks with ``cache_control`` per request.
MAX_BREAKPOINTS = 4
#: The ``ttl`` values Anthropic accepts, in seconds; "5m" is the default.
TTLS = {"5m": 300.0, "1h": 3600.0}
DEFAULT_TTL = "5m"
#: Stands in for the first message when a cut leaves none (chat templates
#: render at least one); nothing after it is compared.
PLACEHOLDER = {"role": "user", "content": "\u2400"}


class CacheControlError(InvalidArgument):
    """A malformed ``cache_control`` (the server answers 400 with this message)."""


@dataclass(frozen=True)
class Cut:
    """The request up to one marked block."""

    where: str  # e.g. "system[1]", "messages[3].content[0]", "tools[0]", "cache_control"
    ttl: float  # seconds to keep the snapshot at least
    body: dict[str, Any]  # the request with everything after the block removed


def _shown(value: Any) -> str:
    """``repr(value)``, at most 60 characters: an error never repeats a whole input."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _ttl(mark: Any, where: str) -> float | None:
    """The mark's ttl in seconds; None when there is no mark."""
    if mark is None:
        return None
    if not isinstance(mark, dict):
        raise CacheControlError(f"{where}.cache_control must be an object like "
                                f'{{"type": "ephemeral"}}, got {_shown(mark)}')
    kind = mark.get("type")
    if kind != "ephemeral":
        raise CacheControlError(f"{where}.cache_control.type must be 'ephemeral', "
                                f"got {_shown(kind)}")
    ttl = mark.get("ttl", DEFAULT_TTL)
    if not isinstance(ttl, str) or ttl not in TTLS:
        raise CacheControlError(f"{where}.cache_control.ttl must be one of "
                                f"{sorted(TTLS)}, got {_shown(ttl)}")
    return TTLS[ttl]


#: A breakpoint found in a request: (where, ttl, the request up to it).
_Mark = tuple[str, float, dict[str, Any]]


def _up_to(body: dict[str, Any], tools: int | None, system: Any,
           messages: list[Any] | None) -> dict[str, Any]:
    """A copy of the request cut after a mark: its first ``tools`` tools (None:
    all), ``system`` (``_KEEP``: as it is; None: none), ``messages`` (None: all;
    empty: one placeholder message)."""
    cut = {k: v for k, v in body.items() if k not in ("cache_control", "stream")}
    if tools is not None:
        cut["tools"] = body["tools"][:tools]
    if system is not _KEEP:
        if system is None:
            cut.pop("system", None)
        else:
            cut["system"] = system
    if messages is not None:
        cut["messages"] = messages or [dict(PLACEHOLDER)]
    return copy.deepcopy(cut)


def _list_marks(body: dict[str, Any], key: str,
                cut: Callable[[list[Any], int], dict[str, Any]]) -> list[_Mark]:
    """The marks of the blocks of list ``body[key]`` (tools, system): block ``i``'s
    request up to it is ``cut(blocks, i)``."""
    blocks = body.get(key)
    if not isinstance(blocks, list):
        return []
    found: list[_Mark] = []
    for i, block in enumerate(blocks):
        if isinstance(block, dict):
            ttl = _ttl(block.get("cache_control"), f"{key}[{i}]")
            if ttl is not None:
                found.append((f"{key}[{i}]", ttl, cut(blocks, i)))
    return found


def _tool_result_marks(body: dict[str, Any], messages: list[Any], k: int,
                       j: int) -> list[_Mark]:
    """The marks inside block ``j`` of message ``k`` when it is a ``tool_result``
    whose ``content`` is a list of blocks: each cuts the message after that
    block, inside the tool result (its earlier inner blocks kept)."""
    message = messages[k]
    block = message["content"][j]
    inner = block.get("content")
    if block.get("type") != "tool_result" or not isinstance(inner, list):
        return []
    found: list[_Mark] = []
    for i, part in enumerate(inner):
        if isinstance(part, dict):
            where = f"messages[{k}].content[{j}].content[{i}]"
            ttl = _ttl(part.get("cache_control"), where)
            if ttl is not None:
                cut_block = {**block, "content": inner[:i + 1]}
                cut = {**message, "content": [*message["content"][:j], cut_block]}
                found.append((where, ttl, _up_to(body, None, _KEEP, [*messages[:k], cut])))
    return found


def _message_marks(body: dict[str, Any], messages: list[Any], k: int) -> list[_Mark]:
    """The marks of message ``k``: its content blocks' (a tool result's inner
    blocks' before its own), then its own."""
    message = messages[k]
    found: list[_Mark] = []
    content = message.get("content")
    for j, block in enumerate(content if isinstance(content, list) else []):
        if isinstance(block, dict):
            found += _tool_result_marks(body, messages, k, j)
            where = f"messages[{k}].content[{j}]"
            ttl = _ttl(block.get("cache_control"), where)
            if ttl is not None:
                cut = {**message, "content": content[:j + 1]}
                found.append((where, ttl, _up_to(body, None, _KEEP, [*messages[:k], cut])))
    ttl = _ttl(message.get("cache_control"), f"messages[{k}]")
    if ttl is not None:
        found.append((f"messages[{k}]", ttl, _up_to(body, None, _KEEP, messages[:k + 1])))
    return found


def _marks(body: dict[str, Any]) -> list[_Mark]:
    """Every mark in prompt order: tools, system, messages, the request's own."""
    found = _list_marks(body, "tools", lambda _tools, i: _up_to(body, i + 1, None, []))
    found += _list_marks(body, "system",
                         lambda system, j: _up_to(body, None, system[:j + 1], []))
    messages = body.get("messages")
    if isinstance(messages, list):
        for k, message in enumerate(messages):
            if isinstance(message, dict):
                found += _message_marks(body, messages, k)
    ttl = _ttl(body.get("cache_control"), "request")
    if ttl is not None:
        _automatic(found, ttl, _up_to(body, None, _KEEP, None))
    return found


def _automatic(found: list[_Mark], ttl: float, cut: dict[str, Any]) -> None:
    """Add the request's own mark (automatic caching: the last block) to ``found``,
    as Anthropic does: where the last block carries a mark already, the same
    ttl makes it a no-op (one breakpoint) and another ttl is an error."""
    if found and found[-1][2] == cut:
        where, last_ttl, _ = found[-1]
        if last_ttl == ttl:
            return
        raise CacheControlError(
            f"the request's cache_control (ttl {_ttl_name(ttl)!r}) marks the last block, "
            f"which {where}.cache_control marks with ttl {_ttl_name(last_ttl)!r} already: "
            "give them the same ttl, or drop one of them")
    found.append(("cache_control", ttl, cut))


def _ttl_name(seconds: float) -> str:
    return next((name for name, s in TTLS.items() if s == seconds), str(seconds))


_KEEP: Any = object()  # "leave this part of the request as it is"


def cuts(body: dict[str, Any]) -> list[Cut]:
    """The request's breakpoints in prompt order; raises :class:`CacheControlError`
    for a malformed ``cache_control``, more than :data:`MAX_BREAKPOINTS`, or a
    longer ttl after a shorter one (Anthropic's rule: "1h" marks come first)."""
    found = _marks(body)
    if len(found) > MAX_BREAKPOINTS:
        raise CacheControlError(
            f"at most {MAX_BREAKPOINTS} blocks may carry cache_control, found {len(found)} "
            f"({', '.join(where for where, _, _ in found)})")
    for (before, short, _), (after, long, _) in itertools.pairwise(found):
        if long > short:
            raise CacheControlError(
                f"{after} asks for a longer ttl than {before}, which comes before it: "
                "marks with ttl '1h' must come before marks with ttl '5m'")
    return [Cut(where, ttl, cut) for where, ttl, cut in found]


def strip(body: dict[str, Any]) -> dict[str, Any]:
    """The request without its ``cache_control`` fields (for a render of the whole prompt)."""
    return {k: v for k, v in body.items() if k not in ("cache_control", "stream")}

