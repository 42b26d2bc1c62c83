"""Restore planning: what a request's prompt restores, and who waits for whom.

* **offer**: the index's longest snapshot every rank can restore, past
  vLLM's own prefix hit, never the prompt's last ``compute_tokens``; when the
  snapshot goes on past the match, the stored block where the prompt leaves it
  too, for the tokens they share (``tail_block``).
* **lease**: a planned restore leases its snapshot until the load has landed
  (or the request is gone), so no sweep or eviction deletes it while the load
  waits or reads; the release is written on a thread of its own
  (:class:`Leases`), off the step that schedules the prefill.
* **coalescing**: while an asynchronous load is in flight, a request sharing
  more of its prefix than its own local hit waits (``None``: ask again), then
  hits vLLM's prefix cache; one base is read from disk once.
* **tier**: where the shared tier may hold a block more than is local, a fetch
  starts and vLLM is told to ask again (:mod:`sparkcache.connector.fetcher`).

The mechanism: docs/connector.md, "Admission".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from sparkcache.connector.costs import CostPlanner
from sparkcache.connector.fetcher import Fetcher
from sparkcache.connector.jobs import Counters, LoadJob, SaveJob, save_tag
from sparkcache.connector.requests import Offer, RequestState, Rules, TenantLabels
from sparkcache.connector.resharded import Siblings, sibling_match
from sparkcache.errors import CorruptSnapshot, NotFound, SparkCacheError
from sparkcache.hashing import common_prefix, prefix_hashes, prefix_seed
from sparkcache.store import Match, SnapshotStore

__all__ = ["LOAD_LEASE_SECONDS", "Leases", "Restores"]

logger = logging.getLogger("vllm.sparkcache")

#: How long a planned restore protects its snapshot from eviction at most; the
#: lease is released as soon as the load landed (or the request is gone).
LOAD_LEASE_SECONDS = 300.0


class Leases:
    """The leases of planned restores, one per request: taken on the caller's
    thread, released on a thread of their own.

    Each is an index write (~0.3 ms).  The lease is written before the load is
    handed out, so nothing evicts the snapshot while the load waits or reads;
    its release comes once the load landed, and made on vLLM's thread it
    would delay the step that schedules the request's prefill.  (Written on a
    thread too, the acquire was measured slower: it ran beside the load's
    first reads and held them up more than it saved.)
    """

    def __init__(self, store: SnapshotStore, counters: Counters) -> None:
        self.store, self.counters = store, counters
        self._held: dict[str, int] = {}  # request -> lease id
        self._ops: queue.SimpleQueue[int | None] = queue.SimpleQueue()  # leases to release
        self._pending = 0  # queued releases not done yet
        self._done = threading.Condition()
        self._thread: threading.Thread | None = None  # started by the first release

    def acquire(self, req_id: str, snapshot_id: int) -> None:
        """Lease ``snapshot_id`` for ``req_id`` (a lease it held is released);
        a snapshot gone meanwhile is counted, and its load fails: a miss."""
        self.release(req_id)
        try:
            self._held[req_id] = self.store.acquire_lease(
                snapshot_id, kind="restore", ttl=LOAD_LEASE_SECONDS)
        except SparkCacheError as exc:  # gone meanwhile: the load fails, vLLM recomputes
            logger.warning("sparkcache: no lease on snapshot %d for %s: %s",
                           snapshot_id, req_id, exc)
            self.counters.add("lease_failures")

    def release(self, req_id: str) -> None:
        """Release ``req_id``'s lease, if it holds one, on the lease thread."""
        lease = self._held.pop(req_id, None)
        if lease is None:
            return
        with self._done:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sparkcache-leases",
                                            daemon=True)
            self._thread.start()
        self._ops.put(lease)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued release is written; False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Release every lease held, then stop (a lease left behind expires, and
        a dead holder's blocks nothing: docs/architecture.md, "Leases")."""
        for req_id in list(self._held):
            self.release(req_id)
        if self._thread is not None:
            self._ops.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        while (lease := self._ops.get()) is not None:
            try:
                self.store.release_lease(lease)
            except SparkCacheError as exc:  # it expires on its own
                logger.warning("sparkcache: could not release lease %d: %s", lease, exc)
            finally:
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()


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


#: How long a request waits at most for another request's save in flight (an
#: asked breakpoint, or a finished request's prompt and answer, being
#: published) that holds more of it.
WRITE_WAIT_SECONDS = 1.0


@dataclass(frozen=True)
class _Write:
    """A save planned, perhaps not published yet (:meth:`Restores.writing`)."""

    req_id: str
    tag: str  # its name in the workers' reports (``jobs.save_tag``)
    seed: bytes  # its scope's prefix seed: only requests in that scope wait for it
    token_ids: np.ndarray
    #: An explicit cache write's boundaries, which a lookup reaches exactly
    #: (into their block with the tail block; a windowed model: its end).
    marks: tuple[int, ...]
    #: Any save's whole-block boundaries a lookup starts from, growing block by
    #: block (none for a windowed model, which restores only ends).
    aliases: tuple[int, ...]
    since: float
    bs: int

    @cached_property
    def key(self) -> str:
        """The snapshot key it publishes (``Catalog.publish_ended``): hashed once,
        and only when a request would wait for it."""
        return prefix_hashes(self.seed, self.token_ids, self.bs)[-1].hex()


class Restores:
    """Offers, planned loads, the loads in flight and their leases.

    Owns which requests are live (asked about, not finished), which loads are
    in flight and the leases on what they read; the per-request part is
    :class:`~sparkcache.connector.requests.RestorePart`.
    """

    def __init__(self, store: SnapshotStore, rules: Rules, counters: Counters, *,
                 enabled: bool, load_async: bool | None, tail_block: bool,
                 fetcher: Fetcher | None) -> None:
        self.store, self.rules, self.counters = store, rules, counters
        self.enabled = enabled
        self.load_async = True if rules.groups.fails_by_request else load_async
        self.tail_block = tail_block
        #: Fetches from the shared tier (None: no tier, or restoring from it is off).
        self.fetcher = fetcher
        #: Restore or recompute, from measured rates (None: always restore).
        self.costs: CostPlanner | None = None
        self.tenants = TenantLabels()  # the per-tenant counters' bounded labels
        self._live: set[str] = set()
        self._inflight: dict[str, list[bytes]] = {}  # async loads: hashes of what they load
        self.leases = Leases(store, counters)  # on the snapshots planned loads read
        self._loads: list[LoadJob] = []
        #: Saves planned, until published or past their wait (``WRITE_WAIT_SECONDS``).
        self._writes: list[_Write] = []
        #: Requests whose saves a request waits for: published at once (``take_hurry``).
        self._hurry: set[str] = set()
        #: Ranks that reported each save's publish ended (``jobs.save_tag``), until all did.
        self._reported: dict[str, int] = {}
        #: The model's KV heads in all, set by the connector (0: unknown, no
        #: lookups of snapshots stored by engines of another TP size).
        self.total_kv_heads = 0
        self.siblings = Siblings(store, rules.identity)  # those other TP sizes

    def writing(self, job: SaveJob) -> None:
        """A save was planned: until it is published, at most
        :data:`WRITE_WAIT_SECONDS`, a request sharing more of its tokens than
        is stored or live waits for it (vLLM asks again) instead of computing
        what it is about to store, and the save is published at once
        (:meth:`take_hurry`): an asked breakpoint's, or a finished request's
        whose blocks vLLM has evicted since (the client's next turn)."""
        n, bs = job.token_ids.size, self.rules.bs
        # What a lookup reaches once it is published: a windowed model only the
        # snapshot's end; else each boundary (into its block with the tail
        # block), and from an alias (a stride, a boundary, the end) block by block.
        ends = self.rules.groups.ends_only
        marks = (n,) if ends else tuple(sorted(
            {m if self.tail_block else m // bs * bs for m in job.breakpoints if 0 < m <= n}))
        stride = max(bs, self.store.alias_stride // bs * bs)
        aliases = () if ends else tuple(sorted(
            {*range(stride, n + 1, stride), n, *(m // bs * bs for m in marks)}))
        if not job.explicit:  # only a whole block more is worth waiting for
            marks = (n,) if ends else ()
        seed = prefix_seed(self.rules.identity, job.scope)
        self._writes.append(_Write(job.req_id, save_tag(job), seed, job.token_ids,
                                   marks, aliases, time.monotonic(), bs))

    def ended(self, reports: dict[str, int]) -> None:
        """The workers report these saves' publishes ended (``SparkCacheWorkerMeta``:
        published, skipped, failed or dropped), with how many ranks did: once
        every rank did, nobody waits for the save any more (a lookup finds what
        it stored, if anything)."""
        for tag, ranks in reports.items():
            self._reported[tag] = self._reported.get(tag, 0) + ranks
        world = self.rules.identity.world_size
        self._writes = [w for w in self._writes if self._reported.get(w.tag, 0) < world]
        pending = {w.tag for w in self._writes}
        self._reported = {t: n for t, n in self._reported.items() if t in pending}

    def take_hurry(self) -> list[str]:
        """The requests whose saves a request waits for, since the last call:
        their publishes wait for no quiet moment (``publisher.Prefills.want``)."""
        hurry, self._hurry = sorted(self._hurry), set()
        return hurry

    def _waits_for_write(self, state: RequestState, tokens: Any, want: int, have: int) -> bool:
        """Whether a save in flight in the request's scope holds more of the prompt
        (up to ``want``) than the ``have`` tokens found now (its request is then
        hurried).  Saves past their wait are forgotten, and so is one whose
        publish the index shows ended (quarantined since, say) before the
        workers' report of it arrived."""
        now, bs = time.monotonic(), self.rules.bs
        self._writes = [w for w in self._writes if now - w.since < WRITE_WAIT_SECONDS]
        prompt = np.asarray(tokens[:want], np.uint32)
        for w in list(self._writes):
            if w.seed != state.seed:
                continue
            shared = common_prefix(w.token_ids, prompt)
            reach = max((m for m in w.marks if m <= shared), default=0)
            if any(a <= shared for a in w.aliases):
                reach = max(reach, shared // bs * bs)
            if have >= min(reach, want):
                continue
            try:
                ended = self.store.catalog.publish_ended(self.rules.identity, w.key)
            except SparkCacheError as exc:
                logger.warning("sparkcache: could not tell whether a save was published "
                               "(waiting for it): %s", exc)
                ended = False
            if ended:
                self._writes.remove(w)
                continue
            self._hurry.add(w.req_id)
            return True
        return False

    def asked(self, req_id: str) -> None:
        """vLLM asked about the request: it is live until :meth:`finished`."""
        self._live.add(req_id)

    def matched(self, request: Any, state: RequestState,
                num_computed: int) -> tuple[int | None, bool]:
        """``(tokens past num_computed a restore supplies, async)``; ``(None,
        False)``: ask again.  Replaces the request's pending offer.  A request
        that asks not to be cached (``"cache": false``) is offered nothing."""
        state.restore.offer = None
        state.facts.local = num_computed
        if not self.enabled or not state.params.cache:
            return 0, False
        bs = self.rules.bs
        tokens = request.all_token_ids
        want = self.rules.restorable(len(tokens))  # vLLM computes the rest itself
        limit = want // bs * bs  # whole blocks: what the index can match
        # Past vLLM's own hit, or only the block holding the prompt's end.
        tail = self.tail_block and want > limit
        if limit == 0 or limit < num_computed or (limit == num_computed and not tail):
            return 0, False  # (under a block: nothing the index can match)
        hashes = state.hashes(limit, bs)
        if self._waits_for_load(request.request_id, state, hashes, num_computed) or \
                self._waits_for_tier(state):
            return None, False  # ask again once that load landed (or the tier answered)
        found = self._find(state, tokens, limit, want, hashes)
        if found is None:
            return 0, False
        match, claim = found
        if self._writes and self._waits_for_write(state, tokens, want,
                                                   max(claim, num_computed)):
            return None, False  # another request's cache write brings more: ask again
        part = state.restore
        if self._ask_tier(request, state, limit, max(claim, num_computed), hashes):
            return None, False  # ask again once the tier answered
        self._count(state, "lookups")  # once per answer, however often it was asked
        if self.costs is not None and not self._chosen(state, match, num_computed, claim):
            return 0, False  # recomputing is faster (docs/connector.md, "Restore or recompute")
        part.remote = 0
        fetch = part.fetch
        if fetch is not None and fetch.future.done() and claim > part.before_fetch \
                and fetch.future.result().hit:
            part.remote = claim - part.before_fetch
        if match is None or claim <= num_computed:
            self._count(state, "misses")
            return 0, False
        load_async = self.load_async
        if load_async is None:
            # auto: alone in the engine, the restore feeds the step that prefills
            # it (read layer by layer under the forward); with others running it
            # lands while the request waits, so their steps never wait for it.
            load_async = len(self._live) > 1
        if load_async and claim - num_computed <= self.rules.bs and self.rules.groups.plain:
            # At most a block past vLLM's own hit (a breakpoint's partial block):
            # reading it takes less than the steps an asynchronous load waits.
            load_async = False
        part.offer = Offer(match, num_computed, load_async, claim)
        return claim - num_computed, load_async

    def _waits_for_load(self, req_id: str, state: RequestState, hashes: list[bytes],
                        num_computed: int) -> bool:
        """Whether another request's load in flight brings more of this prompt
        than its local hit (counted ``coalesced`` once per request)."""
        for other_id, loading in self._inflight.items():
            if other_id != req_id and \
                    _shared_blocks(hashes, loading) * self.rules.bs > num_computed:
                if not state.restore.waited:
                    state.restore.waited = True
                    self.counters.add("coalesced")
                return True
        return False

    def _waits_for_tier(self, state: RequestState) -> bool:
        """Whether the request's fetch from the tier is still running, in time."""
        part = state.restore
        if part.fetch is not None and not part.fetch_done:
            if not part.fetch.future.done():
                if not part.fetch.expired():
                    return True
                self.counters.add("remote_timeouts")  # go on with what is local
                if self.costs is not None:  # the tier is at most that fast
                    self.costs.fetch_expired(part.before_fetch, part.fetch.tokens)
                if self.fetcher is not None:
                    self.fetcher.failed()  # and do not make the next ones wait
            part.fetch_done = True
        return False

    def _count(self, state: RequestState, name: str, value: int = 1) -> None:
        """Count ``name``, and the same for the request's tenant when it has one."""
        self.counters.add(name, value)
        per_tenant = self.tenants.counter(state.scope, name)
        if per_tenant is not None:
            self.counters.add(per_tenant, value)

    def _find(self, state: RequestState, tokens: Any, limit: int, want: int,
              hashes: list[bytes]) -> tuple[Match | None, int] | None:
        """The index's match for the prompt's first ``limit`` tokens (whole blocks),
        grown past an alias and into the stored block where the prompt (its
        first ``want`` tokens) leaves the snapshot, where the groups allow it,
        and the tokens it offers;
        None when the lookup failed (a miss, logged and counted)."""
        groups = self.rules.groups
        started = time.perf_counter()
        try:
            match = self.store.lookup(self.rules.identity,
                                      np.asarray(tokens[:limit], np.uint32),
                                      scope=state.scope, hashes=hashes,
                                      ends_only=groups.ends_only)
            if match is None or match.n_tokens < limit:  # more in another TP size's?
                fetched = state.restore.fetch is not None and state.restore.fetch.future.done()
                other = sibling_match(self.store, self.rules.identity, self.total_kv_heads,
                                      np.asarray(tokens[:limit], np.uint32), state.scope,
                                      self.siblings(self.total_kv_heads, fresh=fetched))
                if other is not None and (match is None or other.n_tokens > match.n_tokens):
                    match = other
        except SparkCacheError as exc:
            logger.warning("sparkcache lookup failed (a miss): %s", exc)
            self.counters.add("lookup_errors")
            return None
        finally:
            self.counters.add("lookup_seconds", time.perf_counter() - started)
        grows = not groups.ends_only  # past an alias, into the tail block
        if match is not None and match.n_tokens < limit and grows:
            match = self._grow(match, tokens[:limit])
        claim = 0 if match is None else match.n_tokens
        if match is not None and self.tail_block and grows and match.n_tokens < want:
            # Into the stored block where the prompt leaves the snapshot.
            end = min(want, match.n_tokens + self.rules.bs - 1)
            match, claim = self._extend(match, tokens[:end])
        return match, claim

    def _ask_tier(self, request: Any, state: RequestState, limit: int, have: int,
                  hashes: list[bytes]) -> bool:
        """Start a fetch from the shared tier when it may hold more of the prompt
        than is local (at least a block more, of a prompt long enough to have
        been saved); True when one started (vLLM is told to ask again)."""
        part = state.restore
        if self.fetcher is None or part.fetch is not None or part.fetch_done:
            return False
        bs = self.rules.bs
        if limit < self.rules.floor or limit - have < bs:
            return False
        request_tokens = np.asarray(request.all_token_ids[:limit], np.uint32)
        breakpoints = state.params.breakpoints
        if self.rules.groups.ends_only:  # only a whole snapshot past what is local is of use
            breakpoints = tuple(b for b in breakpoints if b >= have + bs)
        if self.costs is not None and not self.costs.tier_pays(have, limit, len(request_tokens)):
            part.fetch_done = part.too_slow = True  # slower than recomputing: not asked
            if self.costs.probe_due():  # measured again in the background: nobody waits
                self.fetcher.start(request_tokens, state.scope, breakpoints, hashes)
            return False
        fetch = self.fetcher.start(request_tokens, state.scope, breakpoints, hashes)
        if fetch is None:
            part.fetch_done = True
            return False
        part.fetch, part.before_fetch = fetch, have
        return True

    def _chosen(self, state: RequestState, match: Match | None, local: int, claim: int) -> bool:
        """The cost model's choice for a match past vLLM's hit: whether to restore
        it; the reason goes to the request log and the ``cost_*`` counters."""
        assert self.costs is not None
        chosen = True  # (nothing past vLLM's hit: a miss, counted as one)
        if match is None or claim <= local:
            reason = "too_slow" if state.restore.too_slow else None
        elif not self.costs.choose(state.request.request_id, match.snapshot_id, local, claim,
                                   len(state.request.all_token_ids)):
            reason, chosen = "too_slow", False
        else:
            reason = "partial" if state.restore.too_slow else "restored"
        state.facts.restore_reason = reason
        if reason is not None:
            self._count(state, f"cost_{reason}")
        return chosen

    def wait_fetches(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a fetch from the tier to end."""
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
        """The match grown by its stored block holding the rest of ``tokens``
        (some of it at least), and the tokens it offers; (None, 0) when that
        snapshot turned out broken."""
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
        return (match, match.n_tokens) if longer is None else longer

    def after_alloc(self, state: RequestState | None, block_ids: Any,
                    num_external: int) -> None:
        """Use up the request's pending offer: plan the load of ``num_external``
        tokens of it, lease its snapshot, mark an asynchronous one in flight."""
        if state is None:  # (never asked about: no offer)
            return
        request, facts, offer = state.request, state.facts, state.restore.offer
        state.restore.offer = None
        if facts.admitted_at is None:
            facts.admitted_at = time.time()
        if offer is not None:  # (not the call after an asynchronous load landed)
            facts.restored = facts.remote_restored = 0
        if num_external == 0 or offer is None:
            return
        bs, groups = self.rules.bs, self.rules.groups
        start, end = offer.local // bs, offer.match.n_tokens // bs
        per_group = groups.per_group(block_ids)
        shortest = min(len(ids) for ids in per_group)
        if offer.local + num_external != offer.claim or offer.local % bs or shortest < end:
            logger.warning("sparkcache: unexpected external token count %d (offered %d from "
                           "%d, %d blocks); not loading", num_external,
                           offer.claim - offer.local, offer.local, shortest)
            return
        match = offer.match
        self._loads.append(LoadJob(
            req_id=request.request_id, snapshot_id=match.snapshot_id, n_tokens=match.n_tokens,
            token_ids=match.token_ids, start_block=start,
            blocks=groups.blocks(per_group, start, end), in_step=not offer.load_async,
            source=None if match.identity == self.rules.identity else match.identity,
            computes_from=offer.claim,
        ))
        if offer.load_async:
            self._inflight[request.request_id] = state.hashes(offer.claim, bs)
        self.leases.acquire(request.request_id, match.snapshot_id)
        self._count(state, "hits")
        self._count(state, "hit_tokens", num_external)
        facts.restored = num_external
        if state.restore.remote:  # the shared tier supplied the tokens past before_fetch
            facts.remote_restored = min(state.restore.remote, num_external)
            self.counters.add("remote_hits")
            self.counters.add("remote_hit_tokens", facts.remote_restored)

    def take_loads(self) -> list[LoadJob]:
        """The loads planned since the last call, each handed out once."""
        loads, self._loads = self._loads, []
        return loads

    def landed(self, req_ids: Iterable[str]) -> None:
        """These requests' loads landed: their leases go, followers may hit."""
        for req_id in req_ids:
            self._inflight.pop(req_id, None)
            self.leases.release(req_id)

    def finished(self, req_id: str) -> bool:
        """Forget the request; True when its asynchronous load is still in flight
        (its blocks are being written; its lease goes when the load lands)."""
        self._live.discard(req_id)
        if self._inflight.pop(req_id, None) is not None:
            return True
        self.leases.release(req_id)  # a sync load (never reported) or done
        return False
