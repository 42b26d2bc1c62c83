"""OpenAI's prompt caching fields: checked, taken out of the request, and made cuts.

Chat completions and Responses requests may carry ``prompt_cache_options``
(``mode``, ``ttl``; Responses also ``prewarm`` and ``comparison_response_id``),
``prompt_cache_retention`` and ``prompt_cache_breakpoint`` on content parts,
as the ``openai`` SDK's types define them.  :func:`plan` checks them (an
:class:`OpenAICacheError` names the field, answered 400 in OpenAI's format),
removes them from the request (vLLM's request models do not know them) and
says what the request writes (:class:`Plan`): the latest three explicit
breakpoints and the prompt's end in ``implicit`` mode, the latest four and no
prompt end in ``explicit`` mode, and nothing at all in ``explicit`` mode
without a breakpoint.  Each breakpoint is a :class:`~sparkcache.serve.cache_control.Cut`:
the request up to its part, which the renderer turns into a token position.
Pure functions over the request's JSON: no vLLM, no I/O.  The rules for users:
docs/serve.md, "OpenAI prompt caching".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparkcache.errors import InvalidArgument
from sparkcache.serve.cache_control import Cut

__all__ = ["BREAKPOINT_PARTS", "IMPLICIT", "RETENTIONS", "TTLS", "OpenAICacheError", "Plan",
           "plan"]

#: Breakpoint and request ``ttl`` values, in seconds of the keep lease.
TTLS = {"30m": 1800.0, "12h": 43200.0}
DEFAULT_TTL = "30m"
#: The request ``ttl`` values each API accepts (a breakpoint may say "12h" on both).
REQUEST_TTLS = {"chat": ("30m",), "responses": ("30m", "12h")}
#: ``prompt_cache_retention``: the keep lease it puts on every breakpoint (None: none).
RETENTIONS: dict[str, float | None] = {"in_memory": None, "24h": 86400.0}
#: The keys of ``prompt_cache_options`` each API defines.
OPTION_KEYS = {"chat": ("mode", "ttl"),
               "responses": ("mode", "ttl", "prewarm", "comparison_response_id")}
#: The content parts that may carry ``prompt_cache_breakpoint``.
BREAKPOINT_PARTS = {"chat": ("text", "image_url", "file", "input_audio"),
                    "responses": ("input_text", "input_image", "input_file")}
#: The breakpoints a request writes, by mode (implicit mode: the prompt's end is one).
WRITTEN = {"implicit": 3, "explicit": 4}
#: The longest ``comparison_response_id`` accepted.
MAX_RESPONSE_ID = 256
#: A cut's ``where`` for the implicit breakpoint: the prompt's end (no render needed).
IMPLICIT = "prompt end"
#: Where each API keeps its messages.
_MESSAGES = {"chat": "messages", "responses": "input"}


class OpenAICacheError(InvalidArgument):
    """A malformed caching field; ``param`` names it (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Plan:
    """What an OpenAI request asks of the cache (:func:`plan`)."""

    cuts: tuple[Cut, ...] = ()  # in prompt order; the implicit one (IMPLICIT) last
    cache: bool = True  # False: explicit mode without a breakpoint, no caching at all
    ttl: float = TTLS[DEFAULT_TTL]  # the request's ttl (its written tokens' bucket)
    prewarm: bool = False  # Responses: write the breakpoints, generate nothing
    max_output_tokens: Any = None  # the client's, put back in a prewarm's answer
    comparison_response_id: str | None = None
    retention: str | None = None

    @property
    def write_ttl(self) -> float:
        """The keep lease the request's writes have when the facts do not say:
        its cuts' one ttl when they agree, else the request's ``ttl``."""
        ttls = {cut.ttl for cut in self.cuts}
        return ttls.pop() if len(ttls) == 1 else self.ttl


#: The plan of a request that says nothing of caching (or of another API).
NONE = Plan()


def _show(value: Any) -> str:
    """A client value for an error message, bounded."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _choice(value: Any, allowed: tuple[str, ...], param: str) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise OpenAICacheError(f"{param} must be one of {list(allowed)}, got {_show(value)}",
                               param)
    return value


def _known_keys(obj: dict[str, Any], allowed: tuple[str, ...], param: str) -> None:
    for key in obj:
        if key not in allowed:
            name = key if isinstance(key, str) and key.isidentifier() and len(key) <= 40 \
                else None
            raise OpenAICacheError(
                f"{param} has an unknown field {_show(key)}; it takes {list(allowed)}",
                f"{param}.{name}" if name else param)


def _options(api: str, options: Any) -> dict[str, Any]:
    """``prompt_cache_options`` checked, with its defaults."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise OpenAICacheError("prompt_cache_options must be an object, got "
                               f"{type(options).__name__}", "prompt_cache_options")
    _known_keys(options, OPTION_KEYS[api], "prompt_cache_options")
    out = {"mode": _choice(options.get("mode", "implicit"), tuple(WRITTEN),
                           "prompt_cache_options.mode"),
           "ttl": _choice(options.get("ttl", DEFAULT_TTL), REQUEST_TTLS[api],
                          "prompt_cache_options.ttl"),
           "prewarm": options.get("prewarm", False),
           "comparison_response_id": options.get("comparison_response_id")}
    if not isinstance(out["prewarm"], bool):
        raise OpenAICacheError("prompt_cache_options.prewarm must be true or false, got "
                               f"{_show(out['prewarm'])}", "prompt_cache_options.prewarm")
    rid = out["comparison_response_id"]
    if rid is not None and not (isinstance(rid, str) and 0 < len(rid) <= MAX_RESPONSE_ID):
        raise OpenAICacheError("prompt_cache_options.comparison_response_id must be a "
                               f"response id (a string of at most {MAX_RESPONSE_ID} "
                               "characters)", "prompt_cache_options.comparison_response_id")
    return out


def _retention(value: Any) -> str | None:
    if value is None:
        return None
    return _choice(value, tuple(RETENTIONS), "prompt_cache_retention")


def _breakpoint(api: str, part: dict[str, Any], where: str) -> str | None:
    """The part's breakpoint ttl ("" for the request's), taken out of it; None: no mark."""
    if "prompt_cache_breakpoint" not in part:
        return None
    mark = part.pop("prompt_cache_breakpoint")
    param = f"{where}.prompt_cache_breakpoint"
    if mark is None:
        return None
    kind = part.get("type")
    if kind not in BREAKPOINT_PARTS[api]:
        raise OpenAICacheError(f"{param}: a {_show(kind)} part cannot carry a breakpoint; "
                               f"{list(BREAKPOINT_PARTS[api])} parts can", param)
    if not isinstance(mark, dict):
        raise OpenAICacheError(f'{param} must be an object like {{"mode": "explicit"}}, got '
                               f"{type(mark).__name__}", param)
    _known_keys(mark, ("mode", "ttl"), param)
    if "mode" not in mark:
        raise OpenAICacheError(f'{param}.mode is required ("explicit")', f"{param}.mode")
    _choice(mark["mode"], ("explicit",), f"{param}.mode")
    return _choice(mark["ttl"], tuple(TTLS), f"{param}.ttl") if "ttl" in mark else ""


def _marks(api: str, body: dict[str, Any]) -> list[tuple[int, int, str]]:
    """Every breakpoint as (message, part, ttl or ""), in prompt order; the
    fields are taken out of the parts."""
    key = _MESSAGES[api]
    messages = body.get(key)
    found: list[tuple[int, int, str]] = []
    if not isinstance(messages, list):
        return found
    for k, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict):
                ttl = _breakpoint(api, part, f"{key}[{k}].content[{j}]")
                if ttl is not None:
                    found.append((k, j, ttl))
    return found


def _cut(api: str, body: dict[str, Any], k: int, j: int) -> dict[str, Any]:
    """The request up to part ``j`` of message ``k`` (shallow: the renderer copies)."""
    key = _MESSAGES[api]
    messages = body[key]
    cut = {name: value for name, value in body.items()
           if name not in ("stream", "stream_options", "kv_transfer_params")}
    cut[key] = [*messages[:k], {**messages[k], "content": messages[k]["content"][:j + 1]}]
    return cut


def plan(api: str | None, body: dict[str, Any]) -> Plan:
    """Check and take out ``body``'s caching fields; what the request writes.

    A request that says nothing of caching gets :data:`NONE` (it is cached
    automatically, as before).  Raises :class:`OpenAICacheError`."""
    if api not in _MESSAGES:
        return NONE
    said = any(name in body for name in ("prompt_cache_options", "prompt_cache_retention"))
    options = _options(api, body.pop("prompt_cache_options", None))
    retention = _retention(body.pop("prompt_cache_retention", None))
    marks = _marks(api, body)
    if not said and not marks:
        return NONE
    mode, ttl = options["mode"], TTLS[options["ttl"]]
    floor = RETENTIONS[retention] if retention else None

    def keep(seconds: float) -> float:
        return max(seconds, floor or 0.0)

    cuts = [Cut(f"{_MESSAGES[api]}[{k}].content[{j}]", keep(TTLS[t] if t else ttl),
                _cut(api, body, k, j))
            for k, j, t in marks[-WRITTEN[mode]:]]
    if mode == "implicit":
        cuts.append(Cut(IMPLICIT, keep(ttl), {}))
    prewarm = bool(options["prewarm"])
    limit = body.get("max_output_tokens")
    if prewarm:
        if body.get("stream"):
            raise OpenAICacheError("prompt_cache_options.prewarm cannot be streamed: send it "
                                   "without stream", "prompt_cache_options.prewarm")
        body["max_output_tokens"] = 1  # the cheapest forward that prefills the prompt
    return Plan(tuple(cuts), cache=bool(cuts), ttl=ttl, prewarm=prewarm,
                max_output_tokens=limit,
                comparison_response_id=options["comparison_response_id"], retention=retention)
