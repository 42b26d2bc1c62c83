"""What the scheduler side knows of one request, and the rules its planners share.

Pure Python over duck-typed vLLM ``Request`` objects (``request_id``,
``prompt_token_ids``, ``all_token_ids``, ``num_computed_tokens``,
``num_prompt_tokens``, ``kv_transfer_params``, ``cache_salt``,
``lora_request``, ``mm_features``).  :class:`RequestState` is one request's
row of the scheduler's table, composed of the parts each planner owns:
:class:`RestorePart` (:mod:`~sparkcache.connector.restores`),
:class:`SavePart` (:mod:`~sparkcache.connector.saves`) and
:class:`~sparkcache.connector.facts.Facts`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparkcache.connector.facts import Facts
from sparkcache.connector.fetcher import Fetch
from sparkcache.connector.groups import KVGroups
from sparkcache.hashing import common_prefix, prefix_hashes, prefix_seed
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.requestlog import printable
from sparkcache.store import Match

__all__ = [
    "MAX_KEEP_SECONDS",
    "MAX_PREFIX_TOKENS",
    "MAX_TENANT",
    "TENANT_KEY",
    "TENANT_LABELS",
    "Offer",
    "RequestParams",
    "RequestState",
    "RestorePart",
    "Rules",
    "SavePart",
    "TenantLabels",
    "breakpoints_of",
    "params_of",
    "scope_of",
    "tenant_of",
]

logger = logging.getLogger("vllm.sparkcache")

#: The longest tenant name (OpenAI's ``prompt_cache_key`` limit).
MAX_TENANT = 1024
#: Tenants one engine names in its Prometheus labels (the first it sees); the
#: later ones are counted under the label "other", so the series stay bounded.
TENANT_LABELS = 20
#: The longest tenant label (the name, its control characters escaped, cut).
TENANT_LABEL_CHARS = 64
#: A per-tenant counter's name is ``TENANT_KEY + label + "\x00" + counter``.
TENANT_KEY = "tenant\x00"
#: The longest ``ttl`` a breakpoint may ask for (a day: OpenAI's ``prompt_cache_retention``
#: ``24h``; Anthropic's longest is an hour, OpenAI's ``prompt_cache_options.ttl`` 12 hours).
MAX_KEEP_SECONDS = 86400.0
#: The most token ids a breakpoint's ``prefix`` may hold (above any model's context).
MAX_PREFIX_TOKENS = 1 << 21


def scope_of(request: Any) -> RequestScope | None:
    """The request's partition of the prefix space (cache salt, LoRA, multimodal,
    the tenant ``kv_transfer_params["sparkcache"]["tenant"]`` names)."""
    lora = getattr(request, "lora_request", None)
    mm = [str(f.identifier) for f in (getattr(request, "mm_features", None) or [])]
    scope = RequestScope(
        cache_salt=getattr(request, "cache_salt", None),
        lora=None if lora is None else f"{lora.lora_name}:{lora.lora_int_id}",
        mm_hashes=tuple(mm),
        tenant=tenant_of(request),
    )
    return None if scope.is_default else scope


def tenant_of(request: Any) -> str | None:
    """``kv_transfer_params["sparkcache"]["tenant"]``: a non-empty string of at most
    :data:`MAX_TENANT` characters of valid Unicode; anything else is ignored (logged)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    ours = params.get("sparkcache") if isinstance(params, dict) else None
    tenant = ours.get("tenant") if isinstance(ours, dict) else None
    if tenant is None:
        return None
    if isinstance(tenant, str) and 0 < len(tenant) <= MAX_TENANT:
        try:
            tenant.encode()
            return tenant
        except UnicodeEncodeError:
            pass
    logger.warning("sparkcache: ignoring the tenant of %s (want a string of 1 to %d "
                   "characters)", getattr(request, "request_id", "?"), MAX_TENANT)
    return None


class TenantLabels:
    """Each tenant's Prometheus label, bounded: the first :data:`TENANT_LABELS`
    tenants get their own (escaped as ``sparkcache log`` prints it, cut to
    :data:`TENANT_LABEL_CHARS`), every later one is "other".  Counters that are
    never relabelled stay monotonic, which a "top N" that changes would break."""

    def __init__(self, limit: int = TENANT_LABELS) -> None:
        self.limit = limit
        self._known: dict[str, str] = {}

    def counter(self, scope: RequestScope | None, name: str) -> str | None:
        """The per-tenant counter ``name`` of a request's tenant; None: no tenant."""
        tenant = None if scope is None else scope.tenant
        if tenant is None:
            return None
        label = self._known.get(tenant)
        if label is None:
            if len(self._known) >= self.limit:
                return f"{TENANT_KEY}other\x00{name}"
            label = self._known[tenant] = (printable(tenant) or "")[:TENANT_LABEL_CHARS]
        return f"{TENANT_KEY}{label}\x00{name}"


@dataclass(frozen=True)
class RequestParams:
    """What a request asks of sparkcache in ``kv_transfer_params["sparkcache"]``.

    ``{"id": "...", "breakpoints": [812, {"at": 1500, "ttl": 3600}]}``: ``id``
    names the request in the request log (default vLLM's request id);
    each breakpoint is a token position, or ``{"at": position, "ttl": seconds}``
    to keep the prefix's snapshot at least that long after its last write or
    read (a lease retention respects; at most :data:`MAX_KEEP_SECONDS`), or
    ``{"prefix": [token ids], "ttl": seconds}``: the position where those
    tokens stop agreeing with the prompt (at most :data:`MAX_PREFIX_TOKENS`;
    ``sparkcache serve`` sends the render of the prompt up to a mark).
    ``"cache": false``: the request neither restores from the store nor saves
    to it (OpenAI's explicit mode without a breakpoint).
    """

    log_id: str | None = None
    breakpoints: tuple[int, ...] = ()
    keep: Mapping[int, float] = field(default_factory=dict)  # position -> seconds
    cache: bool = True


def _agreeing(prefix: Any, prompt: Any) -> int | None:
    """How many leading tokens ``prefix`` (a list of token ids) shares with
    ``prompt``; None when it is no such list."""
    if not isinstance(prefix, list) or len(prefix) > MAX_PREFIX_TOKENS or \
            not all(type(t) is int and 0 <= t < 2**32 for t in prefix):
        return None
    return common_prefix(prefix, prompt or ())


def _position(mark: Any, prompt: Any = ()) -> tuple[int, float | None] | None:
    if isinstance(mark, dict):
        at, ttl = mark.get("at"), mark.get("ttl")
        if "prefix" in mark:
            at = None if "at" in mark else _agreeing(mark["prefix"], prompt)
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                                or not 0 < ttl <= MAX_KEEP_SECONDS):
            return None
        keep = None if ttl is None else float(ttl)
    else:
        at, keep = mark, None
    if not isinstance(at, int) or isinstance(at, bool) or at < 0:
        return None
    return at, keep


def params_of(request: Any) -> RequestParams:
    """The request's :class:`RequestParams`; malformed parts are ignored (logged)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    ours = params.get("sparkcache") if isinstance(params, dict) else None
    if not isinstance(ours, dict):
        return RequestParams()
    log_id = ours.get("id")
    if log_id is not None and not (isinstance(log_id, str) and 0 < len(log_id) <= 128):
        logger.warning("sparkcache: ignoring request log id %r of %s", log_id,
                       getattr(request, "request_id", "?"))
        log_id = None
    marks = ours.get("breakpoints") or ()
    prompt = getattr(request, "prompt_token_ids", None)
    parsed = [_position(m, prompt) for m in marks] if isinstance(marks, (list, tuple)) \
        else [None]
    if any(p is None for p in parsed):
        logger.warning("sparkcache: ignoring breakpoints %s of %s (want a list of token "
                       "positions, {\"at\": position, \"ttl\": seconds} or {\"prefix\": "
                       "[token ids], \"ttl\": seconds})", printable(repr(marks)[:200]),
                       getattr(request, "request_id", "?"))
        parsed = []
    keep: dict[int, float] = {}
    for at, ttl in (p for p in parsed if p is not None):
        if ttl is not None:
            keep[at] = max(ttl, keep.get(at, 0.0))
    cache = ours.get("cache", True)
    if not isinstance(cache, bool):
        logger.warning("sparkcache: ignoring cache %r of %s (want true or false)", cache,
                       getattr(request, "request_id", "?"))
        cache = True
    return RequestParams(log_id, tuple(p[0] for p in parsed if p is not None), keep, cache)


def breakpoints_of(request: Any) -> tuple[int, ...]:
    """``kv_transfer_params["sparkcache"]["breakpoints"]``: token positions to alias."""
    return params_of(request).breakpoints


@dataclass(frozen=True)
class Rules:
    """The engine's settings both planners read."""

    identity: ModelIdentity
    groups: KVGroups
    min_tokens: int
    #: The prompt's last tokens vLLM computes after a restore (at least the
    #: one it samples from; two where a lone token takes another kernel path).
    compute_tokens: int

    @property
    def bs(self) -> int:
        return self.identity.block_size

    @property
    def floor(self) -> int:
        """The fewest tokens worth a snapshot (and a fetch from the tier)."""
        return max(self.min_tokens, self.bs)

    def restorable(self, n_tokens: int) -> int:
        """Of a prompt of ``n_tokens``, the most a restore may supply."""
        return max(0, n_tokens - self.compute_tokens)


@dataclass(frozen=True)
class Offer:
    """A restore offered to vLLM and not yet allocated for."""

    match: Match
    local: int  # vLLM's own prefix hit
    load_async: bool
    claim: int  # tokens offered in all (up to the match, or into its last block)


@dataclass
class RestorePart:
    """The restore planner's part of a request."""

    offer: Offer | None = None  # replaced by every answer, used up by after_alloc
    waited: bool = False  # counted as coalesced once
    fetch: Fetch | None = None  # a fetch from the tier, started for this request
    fetch_done: bool = False  # asked the tier already (or gave up waiting)
    before_fetch: int = 0  # tokens local (vLLM's or ours) before the fetch
    remote: int = 0  # tokens of the pending offer the tier supplied
    too_slow: bool = False  # the tier was not asked: slower than recomputing (costs)


@dataclass
class SavePart:
    """The save planner's part of a request."""

    marks: list[int] = field(default_factory=list)  # breakpoints not published yet
    #: A windowed model's own save point, the prompt's last whole block (where
    #: the same prompt sent again restores): a mark that is no breakpoint.
    prompt_end: int | None = None
    mid_saves: int = 0  # breakpoint saves planned while the request ran


@dataclass
class RequestState:
    """One request's row of the scheduler's table; ``hashes`` is a memo."""

    request: Any
    scope: RequestScope | None
    seed: bytes
    params: RequestParams
    facts: Facts
    restore: RestorePart = field(default_factory=RestorePart)
    save: SavePart = field(default_factory=SavePart)
    _hashes: list[bytes] = field(default_factory=list)  # of tokens [0, len * block_size)

    @classmethod
    def of(cls, request: Any, identity: ModelIdentity) -> RequestState:
        scope, params = scope_of(request), params_of(request)
        return cls(request, scope, prefix_seed(identity, scope), params,
                   Facts(log_id=params.log_id, breakpoints=params.breakpoints))

    def hashes(self, n_tokens: int, block_size: int) -> list[bytes]:
        """Chained hashes of the first ``n_tokens`` (whole blocks), extended as needed."""
        have, want = len(self._hashes), n_tokens // block_size
        if want > have:
            tokens = np.asarray(self.request.all_token_ids[have * block_size:
                                                           want * block_size], np.uint32)
            self._hashes.extend(prefix_hashes(self._hashes[-1] if have else self.seed,
                                              tokens, block_size))
        return self._hashes[:want]
