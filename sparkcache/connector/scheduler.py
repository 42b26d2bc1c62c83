"""The scheduler side's decisions: what to restore, what to save, who waits.

Pure Python over duck-typed vLLM ``Request`` objects (``request_id``,
``prompt_token_ids``, ``all_token_ids``, ``num_computed_tokens``,
``num_prompt_tokens``, ``kv_transfer_params``, ``cache_salt``,
``lora_request``, ``mm_features``), so it is unit-tested without vLLM.

* **restore**: the prompt's block-boundary hashes are computed once per
  request; the index returns the longest snapshot every rank of this topology
  can restore; the tokens beyond vLLM's own prefix hit are offered, never the
  prompt's last ``compute_tokens`` (vLLM computes one to sample from; two
  where a lone token takes another kernel path than a prefill).  When the snapshot goes
  on past the match (the same prompt was answered and stored before), the
  block holding the prompt's last tokens is restored too (``tail_block``):
  vLLM then computes that one token, where its own prefix cache recomputes up
  to a block.
* **lease**: a planned restore leases its snapshot until the load has
  landed (or the request is gone), so neither the sweeper nor another
  process's eviction can delete it between the lookup and the read.
* **coalescing**: while an asynchronous load is in flight, a request sharing
  a prefix with it that its own local hit does not cover waits ("ask again":
  ``None``); when the load is done vLLM caches the blocks and the follower
  hits vLLM's own prefix cache.  One base is read from disk once.
* **save**: a finished request's whole computed blocks (prompt and output) are
  published, with alias boundaries at the prompt's end and at the request's
  breakpoints (``kv_transfer_params={"sparkcache": {"breakpoints": [n, ...]}}``);
  when a stored snapshot is a whole prefix, only the tail is written (the
  snapshot becomes its copy-on-write parent).
* **breakpoints mid-request**: once a step computes past a breakpoint, the
  prefix up to it (whole blocks) is published at once, while the request
  still runs - an agent's system prompt is restorable before its first answer
  is finished, and survives an abort or a crash of the rest.  Such a save is
  not reported back per request; the request's blocks are held at its finish
  until every one of its saves was copied out (the workers see to that).
* **KV cache groups**: block ids are one list per group inside (vLLM's
  shapes are normalised at the entry points: :meth:`SchedulerSide.after_alloc`,
  :meth:`~SchedulerSide.finished`, :meth:`~SchedulerSide.plan_breakpoints`);
  what a sliding-window group changes (ends only, no copy-on-write, copies
  in the step, the prompt's own save point) is decided by
  :class:`~sparkcache.connector.groups.KVGroups` (docs/connector.md,
  "Several KV cache groups").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparkcache.connector.fetcher import Fetch, Fetcher
from sparkcache.connector.groups import KVGroups
from sparkcache.connector.jobs import Counters, LoadJob, SaveJob
from sparkcache.core import KEEP_HOLDER, KEEP_LEASE
from sparkcache.errors import CorruptSnapshot, InvalidArgument, NotFound, SparkCacheError
from sparkcache.hashing import prefix_hashes, prefix_seed
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.store import Match, SnapshotStore

__all__ = ["MAX_KEEP_SECONDS", "RequestParams", "SchedulerSide", "breakpoints_of", "params_of",
           "scope_of"]

logger = logging.getLogger("vllm.sparkcache")

#: How long a planned restore protects its snapshot from eviction at most; the
#: lease is released as soon as the load landed (or the request is gone).
LOAD_LEASE_SECONDS = 300.0


def scope_of(request: Any) -> RequestScope | None:
    """The request's partition of the prefix space (cache salt, LoRA, multimodal)."""
    lora = getattr(request, "lora_request", None)
    mm = [str(f.identifier) for f in (getattr(request, "mm_features", None) or [])]
    scope = RequestScope(
        cache_salt=getattr(request, "cache_salt", None),
        lora=None if lora is None else f"{lora.lora_name}:{lora.lora_int_id}",
        mm_hashes=tuple(mm),
    )
    return None if scope.is_default else scope


#: The longest ``ttl`` a breakpoint may ask for (Anthropic's longest cache lifetime).
MAX_KEEP_SECONDS = 3600.0


@dataclass(frozen=True)
class RequestParams:
    """What a request asks of sparkcache in ``kv_transfer_params["sparkcache"]``.

    ``{"id": "...", "breakpoints": [812, {"at": 1500, "ttl": 3600}]}``: ``id``
    names the request in the request log (default vLLM's request id);
    each breakpoint is a token position, or ``{"at": position, "ttl": seconds}``
    to keep the prefix's snapshot at least that long after its last write or
    read (a lease retention respects; at most :data:`MAX_KEEP_SECONDS`).
    """

    log_id: str | None = None
    breakpoints: tuple[int, ...] = ()
    keep: Mapping[int, float] = field(default_factory=dict)  # position -> seconds


def _position(mark: Any) -> tuple[int, float | None] | None:
    if isinstance(mark, dict):
        at, ttl = mark.get("at"), mark.get("ttl")
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
    parsed = [_position(m) for m in marks] if isinstance(marks, (list, tuple)) else [None]
    if any(p is None for p in parsed):
        logger.warning("sparkcache: ignoring breakpoints %r of %s (want a list of token "
                       "positions or {\"at\": position, \"ttl\": seconds})", marks,
                       getattr(request, "request_id", "?"))
        parsed = []
    keep: dict[int, float] = {}
    for at, ttl in (p for p in parsed if p is not None):
        if ttl is not None:
            keep[at] = max(ttl, keep.get(at, 0.0))
    return RequestParams(log_id, tuple(p[0] for p in parsed if p is not None), keep)


def breakpoints_of(request: Any) -> tuple[int, ...]:
    """``kv_transfer_params["sparkcache"]["breakpoints"]``: token positions to alias."""
    return params_of(request).breakpoints


@dataclass
class _ReqState:
    scope: RequestScope | None
    seed: bytes
    request: Any
    params: RequestParams
    hashes: list[bytes] = field(default_factory=list)  # of tokens [0, len * block_size)
    waited: bool = False
    marks: list[int] = field(default_factory=list)  # breakpoints not published yet
    #: A windowed model's own save point, the prompt's last whole block (where
    #: the same prompt sent again restores): a mark that is no breakpoint.
    prompt_end: int | None = None
    mid_saves: int = 0  # breakpoint saves planned while the request ran
    # -- what the request log and the usage report (wall-clock times) --
    local: int | None = None  # vLLM's own prefix hit at the last admission
    restored: int = 0  # tokens a planned restore supplies
    new_prefixes: list[tuple[int, int]] = field(default_factory=list)  # (n, stored before)
    admitted_at: float | None = None
    loaded_at: float | None = None  # an asynchronous restore landed
    first_token_at: float | None = None
    reported: bool = False  # the prefill's facts went out
    # -- the shared tier --
    fetch: Fetch | None = None  # a fetch from the tier, started for this request
    fetch_done: bool = False  # asked the tier already (or gave up waiting)
    before_fetch: int = 0  # tokens local (vLLM's or ours) before the fetch
    remote: int = 0  # tokens of the pending offer the tier supplied
    remote_restored: int = 0  # of ``restored``, those the tier supplied

    def facts(self, *, final: bool) -> dict[str, Any]:
        """The request's row of the request log (``requestlog.LOG_FIELDS``).

        ``written_tokens`` counts the tokens its breakpoint saves add to the
        store beyond what it read (vLLM's own hit and the restore) and what
        was stored before: a breakpoint already stored adds none.
        """
        request = self.request
        arrival = float(getattr(request, "arrival_time", 0.0) or 0.0) or None
        covered = (self.local or 0) + self.restored
        written = 0
        for n, before in sorted(self.new_prefixes):
            base = max(covered, before)
            written += max(0, n - base)
            covered = max(covered, n)
        row: dict[str, Any] = {
            "request_id": self.params.log_id or str(request.request_id),
            "created_at": arrival,
            "prompt_tokens": int(request.num_prompt_tokens),
            "live_tokens": self.local,
            "restored_tokens": self.restored,
            "remote_tokens": self.remote_restored,
            "written_tokens": written,
            "breakpoints": list(self.params.breakpoints),
            "queue_s": _since(arrival, self.admitted_at),
            "restore_s": _since(self.admitted_at, self.loaded_at),
        }
        if final:
            row["output_tokens"] = max(0, len(request.all_token_ids)
                                       - int(request.num_prompt_tokens))
            row["ttft_s"] = _since(arrival, self.first_token_at)
        return row


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start)


def _shared_blocks(a: list[bytes], b: list[bytes]) -> int:
    """Whole blocks two chained-hash lists share (equality is monotone: bisect)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SchedulerSide:
    """Per-engine scheduler state; every method runs on vLLM's scheduler thread."""

    def __init__(
        self,
        store: SnapshotStore,
        identity: ModelIdentity,
        counters: Counters,
        *,
        restore: bool = True,
        publish: bool = True,
        load_async: bool | None = True,
        min_tokens: int = 64,
        tail_block: bool = True,
        compute_tokens: int = 1,
        on_facts: Callable[[dict[str, Any]], None] | None = None,
        fetcher: Fetcher | None = None,
        groups: KVGroups | None = None,
    ) -> None:
        self.store = store
        #: Fetches from the shared tier when the local index holds less of a
        #: prompt than it may (None: no tier, or restoring from it is off).
        self.fetcher = fetcher
        #: The engine's KV cache groups (default: a plain model's one group).
        self.groups = KVGroups() if groups is None else groups
        if self.groups.ends_only != identity.ends_only:
            raise InvalidArgument("the KV cache groups' windows disagree with the identity's")
        #: Called with a request's log row when its prompt has been scheduled
        #: (what usage reports) and again when it finished (timings, output).
        self.on_facts = on_facts
        self.identity = identity
        self.counters = counters
        self.restore, self.publish = restore, publish
        self.load_async = True if self.groups.fails_by_request else load_async
        self.min_tokens = min_tokens
        self.tail_block = tail_block
        #: The prompt's last tokens vLLM computes after a restore (at least the
        #: one it samples from; two where a lone token takes another kernel path).
        self.compute_tokens = max(1, int(compute_tokens))
        self.bs = identity.block_size
        self._reqs: dict[str, _ReqState] = {}
        # match, local hit, async, tokens offered (up to the match, or into its last block)
        self._offers: dict[str, tuple[Match, int, bool, int]] = {}
        self._live: set[str] = set()  # requests vLLM asked about and has not finished
        self._inflight: dict[str, list[bytes]] = {}  # async loads: hashes of what they load
        self._saving: set[str] = set()  # blocks held until the workers copied them
        self._leases: dict[str, int] = {}  # request -> lease on the snapshot it loads
        self._loads: list[LoadJob] = []
        self._saves: list[SaveJob] = []
        self._kept: dict[int, float] = {}  # snapshot -> when our keep lease on it ends

    # -- hashing -----------------------------------------------------------------------

    def _state(self, request: Any) -> _ReqState:
        state = self._reqs.get(request.request_id)
        if state is None:
            scope = scope_of(request)
            params = params_of(request)
            state = _ReqState(scope, prefix_seed(self.identity, scope), request, params)
            if self.publish:
                floor = max(self.min_tokens, self.bs)
                marks = set(params.breakpoints)
                if request.prompt_token_ids is not None:
                    state.prompt_end = self.groups.prompt_end(
                        self._restorable(int(request.num_prompt_tokens)), self.bs)
                    if state.prompt_end is not None:
                        marks.add(state.prompt_end)
                state.marks = sorted(m for m in marks if m // self.bs * self.bs >= floor)
            self._reqs[request.request_id] = state
        return state

    def _hashes(self, request: Any, n_tokens: int) -> list[bytes]:
        """Chained hashes of the first ``n_tokens`` (whole blocks), extended as needed."""
        state = self._state(request)
        have = len(state.hashes)
        want = n_tokens // self.bs
        if want > have:
            tokens = np.asarray(request.all_token_ids[have * self.bs:want * self.bs], np.uint32)
            state.hashes.extend(prefix_hashes(state.hashes[-1] if have else state.seed,
                                              tokens, self.bs))
        return state.hashes[:want]

    # -- restore -----------------------------------------------------------------------

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: ``(tokens past num_computed that a
        restore supplies, whether they load asynchronously)``.

        ``(0, False)``: nothing to offer; ``(None, False)``: ask again on a later
        step (another request's asynchronous restore of a shared prefix is in
        flight).  Never the prompt's last ``compute_tokens`` (vLLM computes them).

        vLLM may ask several times for one request before :meth:`after_alloc`
        (its blocks did not fit this step, or the answer was None).  Each call
        answers afresh from the index, so an answer can change as the store
        does; nothing of vLLM's is touched.  What a call changes here:

        * the request's pending offer is replaced by this call's (or dropped):
          :meth:`after_alloc` plans the last one;
        * the request counts as live (``load_async`` auto) until :meth:`finished`;
        * memos, the same on every call: the request's scope, its breakpoints
          (noted on the first call; :meth:`plan_breakpoints` sees only requests
          asked about) and its block hashes;
        * counters: ``lookups`` and ``misses`` count every answer given from
          the index (a call that starts a fetch from the shared tier gives
          none: vLLM asks again); ``lookup_errors`` and ``lookup_seconds``
          every call that reaches the index; ``remote_*`` the shared tier's
          part (:mod:`sparkcache.connector.fetcher`), ``remote_hits`` once per
          planned restore it supplied;
          ``coalesced`` counts a request once, however often it is told to wait;
        * the store: a lookup that finds nothing counts a miss in the store's
          own counters, and a snapshot whose stored tail block fails its checks
          (``tail_block``) is quarantined - for every engine of the store.
        """
        self._offers.pop(request.request_id, None)
        self._live.add(request.request_id)
        if request.prompt_token_ids is None:
            return 0, False
        self._state(request).local = num_computed  # also notes its breakpoints
        if not self.restore:
            return 0, False
        tokens = request.all_token_ids
        want = self._restorable(len(tokens))  # vLLM computes the rest itself
        limit = want // self.bs * self.bs  # whole blocks: what the index can match
        # Past vLLM's own hit, or only the block holding the prompt's end.
        tail = self.tail_block and want > limit
        if limit == 0 or limit < num_computed or (limit == num_computed and not tail):
            return 0, False  # (under a block: nothing the index can match)
        hashes = self._hashes(request, limit)
        for other_id, loading in self._inflight.items():
            if other_id != request.request_id and \
                    _shared_blocks(hashes, loading) * self.bs > num_computed:
                state = self._state(request)
                if not state.waited:
                    state.waited = True
                    self.counters.add("coalesced")
                return None, False  # ask again once that load has landed
        state = self._state(request)
        if state.fetch is not None and not state.fetch_done:
            if not state.fetch.future.done():
                if not state.fetch.expired():
                    return None, False  # ask again once the tier answered
                self.counters.add("remote_timeouts")  # go on with what is local
                if self.fetcher is not None:
                    self.fetcher.failed()  # and do not make the next ones wait
            state.fetch_done = True
        found = self._find(state, tokens, limit, want, tail, hashes)
        if found is None:
            return 0, False
        match, claim = found
        have = max(claim, num_computed)
        if self._ask_tier(request, state, limit, have, hashes):
            return None, False  # ask again once the tier answered
        self.counters.add("lookups")  # once per answer, however often it was asked
        state.remote = 0
        if state.fetch is not None and state.fetch.future.done() and claim > state.before_fetch:
            result = state.fetch.future.result()
            if result.hit:
                state.remote = claim - state.before_fetch
        if match is None or claim <= num_computed:
            self.counters.add("misses")
            return 0, False
        load_async = self.load_async
        if load_async is None:
            # auto: alone in the engine, the restore feeds the step that prefills
            # it (read layer by layer under the forward); with others running it
            # lands while the request waits, so their steps never wait for it.
            load_async = len(self._live) > 1
        self._offers[request.request_id] = (match, num_computed, load_async, claim)
        return claim - num_computed, load_async

    def _find(self, state: _ReqState, tokens: Any, limit: int, want: int, tail: bool,
              hashes: list[bytes]) -> tuple[Match | None, int] | None:
        """The index's match for the prompt's first ``limit`` tokens (whole blocks),
        grown past an alias and into the block holding the prompt's first
        ``want`` tokens where the groups allow it, and the tokens it offers;
        None when the lookup failed (a miss, logged and counted)."""
        started = time.perf_counter()
        try:
            match = self.store.lookup(self.identity, np.asarray(tokens[:limit], np.uint32),
                                      scope=state.scope, hashes=hashes,
                                      ends_only=self.groups.ends_only)
        except SparkCacheError as exc:
            logger.warning("sparkcache lookup failed (a miss): %s", exc)
            self.counters.add("lookup_errors")
            return None
        finally:
            self.counters.add("lookup_seconds", time.perf_counter() - started)
        grows = not self.groups.ends_only  # past an alias, into the tail block
        if match is not None and match.n_tokens < limit and grows:
            match = self._grow(match, tokens[:limit])
        claim = 0 if match is None else match.n_tokens
        if match is not None and tail and match.n_tokens == limit and grows:
            match, claim = self._extend(match, tokens[:want])
        return match, claim

    def _restorable(self, n_tokens: int) -> int:
        """Of a prompt of ``n_tokens``, the most a restore may supply: vLLM
        computes the last ``compute_tokens`` itself (one to sample from)."""
        return max(0, n_tokens - self.compute_tokens)

    def _ask_tier(self, request: Any, state: _ReqState, limit: int, have: int,
                  hashes: list[bytes]) -> bool:
        """Start a fetch from the shared tier when it may hold more of the prompt
        than is local (at least a block more, of a prompt long enough to have
        been saved); True when one started (vLLM is told to ask again)."""
        if self.fetcher is None or state.fetch is not None or state.fetch_done:
            return False
        if limit < max(self.min_tokens, self.bs) or limit - have < self.bs:
            return False
        request_tokens = np.asarray(request.all_token_ids[:limit], np.uint32)
        breakpoints = state.params.breakpoints
        if self.groups.ends_only:  # only a whole snapshot past what is local is of use
            breakpoints = tuple(b for b in breakpoints if b >= have + self.bs)
        fetch = self.fetcher.start(request_tokens, state.scope, breakpoints, hashes)
        if fetch is None:
            state.fetch_done = True
            return False
        state.fetch, state.before_fetch = fetch, have
        return True

    def wait_fetches(self, timeout: float) -> None:
        """On a step that computes nothing: wait up to ``timeout`` for a fetch
        from the tier to end, instead of letting the engine spin."""
        if self.fetcher is not None and self.fetcher.busy:
            self.fetcher.wait_any(timeout)

    def _grow(self, match: Match, tokens: Any) -> Match | None:
        """The match grown to the last whole block the prompt shares with its
        snapshot (past the alias the lookup stopped at); None when that snapshot
        turned out broken."""
        started = time.perf_counter()
        try:
            return self.store.grow(match, np.asarray(tokens, np.uint32))
        except (CorruptSnapshot, NotFound) as exc:  # quarantined or gone: a miss
            logger.warning("sparkcache: snapshot %d not offered: %s", match.snapshot_id, exc)
            return None
        except SparkCacheError as exc:
            logger.warning("sparkcache: could not compare the stored blocks: %s", exc)
            return match
        finally:
            self.counters.add("lookup_seconds", time.perf_counter() - started)

    def _extend(self, match: Match, tokens: Any) -> tuple[Match | None, int]:
        """The match grown by the stored block holding the rest of ``tokens``, and
        the tokens it offers; (None, 0) when that snapshot turned out broken."""
        started = time.perf_counter()
        try:
            longer = self.store.extend(match, np.asarray(tokens, np.uint32))
        except (CorruptSnapshot, NotFound) as exc:  # quarantined or gone: a miss
            logger.warning("sparkcache: snapshot %d not offered: %s", match.snapshot_id, exc)
            return None, 0
        except SparkCacheError as exc:
            logger.warning("sparkcache: could not check the stored tail block: %s", exc)
            return match, match.n_tokens
        finally:
            self.counters.add("lookup_seconds", time.perf_counter() - started)
        return (match, match.n_tokens) if longer is None else (longer, len(tokens))

    def after_alloc(self, request: Any, block_ids: Any, num_external: int) -> None:
        """vLLM's ``update_state_after_alloc`` (``block_ids``: the request's blocks,
        one list, or one list per KV cache group: :meth:`KVGroups.per_group`).

        Uses up the request's pending offer.  When ``num_external`` tokens of it
        are to be loaded: plans the load (:meth:`take_jobs`), marks an
        asynchronous one in flight (followers wait), leases the snapshot until
        the load landed or the request is gone, and counts ``hits`` and
        ``hit_tokens``.  A count other than the one offered plans nothing (logged).
        """
        offer = self._offers.pop(request.request_id, None)
        state = self._reqs.get(request.request_id)
        if state is not None:
            if state.admitted_at is None:
                state.admitted_at = time.time()
            if offer is not None:  # (not the call after an asynchronous load landed)
                state.restored = state.remote_restored = 0
        if num_external == 0 or offer is None:
            return
        match, local, load_async, claim = offer
        start, end = local // self.bs, match.n_tokens // self.bs
        groups = self.groups.per_group(block_ids)
        shortest = min(len(ids) for ids in groups)
        if local + num_external != claim or local % self.bs or shortest < end:
            logger.warning("sparkcache: unexpected external token count %d (offered %d from "
                           "%d, %d blocks); not loading", num_external, claim - local, local,
                           shortest)
            return
        self._loads.append(LoadJob(
            req_id=request.request_id, snapshot_id=match.snapshot_id, n_tokens=match.n_tokens,
            token_ids=match.token_ids, start_block=start,
            blocks=self.groups.blocks(groups, start, end), in_step=not load_async,
        ))
        if load_async:
            self._inflight[request.request_id] = self._hashes(request, claim)
        try:
            self._leases[request.request_id] = self.store.acquire_lease(
                match.snapshot_id, kind="restore", ttl=LOAD_LEASE_SECONDS)
        except SparkCacheError as exc:  # gone meanwhile: the load fails, vLLM recomputes
            logger.warning("sparkcache: no lease on snapshot %d for %s: %s",
                           match.snapshot_id, request.request_id, exc)
            self.counters.add("lease_failures")
        self.counters.add("hits")
        self.counters.add("hit_tokens", num_external)
        if state is not None:
            state.restored = num_external
            if state.remote:  # the shared tier supplied the tokens past before_fetch
                state.remote_restored = min(state.remote, num_external)
                self.counters.add("remote_hits")
                self.counters.add("remote_hit_tokens", state.remote_restored)

    def plan_breakpoints(
        self, scheduled: Mapping[str, int], block_ids_of: Callable[[str], Any]
    ) -> None:
        """Plan saves of the prefixes whose breakpoint this step computes past, and
        report the facts of requests whose prompt this step finishes (``on_facts``).

        ``scheduled``: tokens each request computes in this step (vLLM's
        ``num_scheduled_tokens``, seen before vLLM advances ``num_computed_tokens``);
        ``block_ids_of``: a request's KV blocks (as vLLM gives them:
        :meth:`KVGroups.per_group`).  Workers copy the blocks out
        after the step's forward, so the planned tokens are computed by then.
        Notes the time a request's first output token is first seen.
        """
        now = time.time()
        for req_id, state in self._reqs.items():
            request = state.request
            if state.first_token_at is None and \
                    len(request.all_token_ids) > int(request.num_prompt_tokens):
                state.first_token_at = now
            step = scheduled.get(req_id)
            if step is None:
                continue
            if state.marks:
                self._plan_marks(req_id, state, int(step), block_ids_of)
            if not state.reported and int(request.num_computed_tokens) + int(step) >= \
                    int(request.num_prompt_tokens):
                state.reported = True
                self._report(state, final=False)

    def _plan_marks(self, req_id: str, state: _ReqState, step: int,
                    block_ids_of: Callable[[str], Any]) -> None:
        request = state.request
        # Only tokens already in the sequence: speculative drafts may be rejected.
        done = min(int(request.num_computed_tokens) + step, len(request.all_token_ids))
        reached = [m for m in state.marks if m <= done]
        if not reached:
            return
        state.marks = [m for m in state.marks if m > done]
        # The snapshots the reached marks make; the prompt's own save point
        # (``prompt_end``) is a mark that no request asked for.
        ends = self.groups.save_ends(reached, self.bs)
        asked = set(state.params.breakpoints)
        for n in ends:
            marks = tuple(m for m in reached if m // self.bs * self.bs <= n and m in asked)
            here = [m for m in marks if m // self.bs * self.bs == n] \
                if self.groups.ends_only else marks
            keep = max((state.params.keep.get(m, 0.0) for m in here), default=0.0) or None
            try:
                blocks = self.groups.per_group(block_ids_of(req_id))
                job, known = self._save_job(request, n, blocks, marks,
                                            mid_request=True, keep=keep)
            except (SparkCacheError, KeyError, IndexError) as exc:
                logger.warning("sparkcache: no breakpoint save for %s: %s", req_id, exc)
                continue
            if job is not None:
                self._saves.append(job)
                state.mid_saves += 1
                if not here:  # the prompt's end alone: no breakpoint wrote it
                    self.counters.add("prompt_saves_planned")
                    continue
                state.new_prefixes.append((n, 0 if known is None else known.n_tokens))
                self.counters.add("breakpoint_saves_planned")
            elif known is not None and known.n_tokens == n and here:
                state.new_prefixes.append((n, n))
                if keep is not None:
                    self._keep(known.snapshot_id, keep)

    def _keep(self, snapshot_id: int, seconds: float) -> None:
        """Renew the keep lease (a breakpoint's ``ttl``) on a stored snapshot, at
        most once per half ``seconds``: a read refreshes it as a write does."""
        now = time.time()
        if self._kept.get(snapshot_id, 0.0) - now > seconds / 2:
            return
        try:
            self.store.acquire_lease(snapshot_id, kind=KEEP_LEASE, ttl=seconds,
                                     holder=KEEP_HOLDER)
        except SparkCacheError as exc:
            logger.warning("sparkcache: could not keep snapshot %d: %s", snapshot_id, exc)
            return
        self._kept[snapshot_id] = now + seconds
        if len(self._kept) > 4096:  # forget the oldest renewals
            for sid in sorted(self._kept, key=self._kept.__getitem__)[:1024]:
                del self._kept[sid]

    def _report(self, state: _ReqState, *, final: bool) -> dict[str, Any]:
        facts = state.facts(final=final)
        if self.on_facts is not None:
            try:
                self.on_facts(facts)
            except Exception as exc:  # the log is never worth a failed step
                logger.warning("sparkcache: request log: %s", exc)
        return facts

    def preempted(self, req_ids: Iterable[str]) -> list[str]:
        """Of vLLM's preempted requests, those whose breakpoint saves may still be
        copying: their workers wait for (or cancel) those copies before the
        freed blocks are written again (``handle_preemptions``).  Changes nothing."""
        return [r for r in req_ids if (state := self._reqs.get(r)) and state.mid_saves]

    def take_jobs(self) -> tuple[list[LoadJob], list[SaveJob]]:
        """The loads and saves planned since the last call (``build_connector_meta``);
        they are forgotten here, each handed out once."""
        loads, saves = self._loads, self._saves
        self._loads, self._saves = [], []
        return loads, saves

    def on_output(self, finished_recving: Iterable[str], finished_sending: Iterable[str]) -> None:
        """``update_connector_output``: loads landed (their leases go, followers
        are answered again), saves copied (their blocks are no longer held)."""
        for req_id in finished_recving:
            self._inflight.pop(req_id, None)
            self._release_lease(req_id)
            if (state := self._reqs.get(req_id)) is not None:
                state.loaded_at = time.time()
        self._saving.difference_update(finished_sending)

    def _release_lease(self, req_id: str) -> None:
        lease = self._leases.pop(req_id, None)
        if lease is None:
            return
        try:
            self.store.release_lease(lease)
        except SparkCacheError as exc:  # it expires on its own
            logger.warning("sparkcache: could not release lease %d: %s", lease, exc)

    @property
    def pending_block_frees(self) -> bool:
        """Whether finished requests' blocks are held until the workers copied them."""
        return bool(self._saving)

    # -- save --------------------------------------------------------------------------

    def finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished`` (once per request): plan a save; True holds
        the blocks until the workers report them copied.  ``block_ids``: one
        list, or one list per KV cache group (:meth:`KVGroups.per_group`).

        Forgets the request: its offer, its state, its lease unless its
        asynchronous load is still in flight (that lease goes in
        :meth:`on_output`; the blocks are not saved then).  Returns ``(True,
        params)`` when a save is planned or a breakpoint save may still copy the
        blocks (a release job without blocks is then planned), else ``(False,
        params)``; ``params`` is ``{"sparkcache": <the request's log row>}``
        (vLLM returns it with the request's output), None for a request never
        admitted.
        """
        req_id = request.request_id
        self._offers.pop(req_id, None)
        self._live.discard(req_id)
        state = self._reqs.get(req_id)
        params: dict[str, Any] | None = None
        if state is not None:
            if state.first_token_at is None and \
                    len(request.all_token_ids) > int(request.num_prompt_tokens):
                state.first_token_at = time.time()
            facts = self._report(state, final=True)
            params = {"sparkcache": {k: v for k, v in facts.items() if k != "created_at"}}
        try:
            if self._inflight.pop(req_id, None) is not None:
                # Aborted while its restore is in flight: the blocks are still being
                # written (vLLM holds them until the load reports); nothing to save.
                # The lease goes when the load reports (on_output).
                return False, params
            self._release_lease(req_id)  # a sync load (never reported) or done
            hold = self._plan_save(request, self.groups.per_group(block_ids))
            if not hold and state is not None and state.mid_saves:
                # Nothing more to save, but breakpoint saves may still be copying
                # these blocks out: hold them until the workers say so.
                self._saves.append(SaveJob(
                    req_id=req_id, token_ids=np.empty(0, np.uint32), blocks=(),
                    parent=None, scope=None, breakpoints=(),
                ))
                self._saving.add(req_id)
                hold = True
            return hold, params
        finally:
            self._reqs.pop(req_id, None)

    def _plan_save(self, request: Any, groups: list[list[int]]) -> bool:
        if not self.publish or request.prompt_token_ids is None:
            return False
        tokens = request.all_token_ids
        held = max(len(ids) for ids in groups)
        n = min(request.num_computed_tokens, len(tokens), held * self.bs)
        marks = (self._restorable(int(request.num_prompt_tokens)), *breakpoints_of(request))
        job, _known = self._save_job(request, n // self.bs * self.bs, groups, marks)
        if job is None:
            return False
        self._saves.append(job)
        self._saving.add(request.request_id)
        self.counters.add("saves_planned")
        return True

    def _save_job(self, request: Any, n: int, groups: list[list[int]], marks: tuple[int, ...],
                  *, mid_request: bool = False, keep: float | None = None,
                  ) -> tuple[SaveJob | None, Match | None]:
        """A save of the request's tokens ``[0, n)`` (whole blocks), or None when
        too short or already stored; when a stored snapshot is a whole prefix,
        only the tail is written (copy-on-write).  Also returns the longest
        stored prefix found (None when none, or not looked up)."""
        if n < max(self.min_tokens, self.bs):
            return None, None
        for ids in groups:
            if len(ids) * self.bs < n:
                raise SparkCacheError(f"{len(ids)} blocks cannot hold {n} tokens")
        token_ids = np.asarray(request.all_token_ids[:n], dtype=np.uint32)
        hashes = self._hashes(request, n)
        scope = self._state(request).scope
        parent_id, parent_tokens = None, 0
        known: Match | None = None
        try:
            known = self.store.lookup(self.identity, token_ids, scope=scope, hashes=hashes,
                                      whole_first=True, ends_only=self.groups.ends_only)
            if known is not None:
                if known.n_tokens == n:
                    self.counters.add("saves_known")
                    return None, known  # already stored (perhaps restored from it)
                if self.store.snapshot(known.snapshot_id).n_tokens == known.n_tokens \
                        and self.groups.copy_on_write:
                    # A whole stored snapshot is our prefix: write only the tail.
                    parent_id, parent_tokens = known.snapshot_id, known.n_tokens
        except SparkCacheError as exc:
            logger.warning("sparkcache lookup before save failed; saving in full: %s", exc)
        start, end = parent_tokens // self.bs, n // self.bs
        blocks = self.groups.blocks(groups, start, end)
        if self.groups.window_gone(blocks, start, end):
            self.counters.add("saves_windowless")
            logger.info("sparkcache: not saving %s: blocks of its window below token %d "
                        "are gone", request.request_id, n)
            return None, known
        return SaveJob(
            req_id=request.request_id, token_ids=token_ids, blocks=blocks, parent=parent_id,
            scope=scope, breakpoints=marks, report=not mid_request, keep=keep,
            start_block=start, copy_in_step=self.groups.copy_in_step(mid_request=mid_request),
        ), known
