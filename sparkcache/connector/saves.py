"""Save planning: what a request publishes, and which blocks wait for the copy.

* **finish**: a finished request's whole computed blocks (prompt and output)
  are published, with alias boundaries at the prompt's end and at its
  breakpoints; when a stored snapshot is a whole prefix, only the tail is
  written (copy-on-write).
* **marks**: once a step computes past a breakpoint (or a windowed model's
  own save point, the prompt's end), the prefix up to it is published while
  the request still runs; its blocks are then held at its finish until the
  workers copied every such save out.
* **keep**: a breakpoint's ``ttl`` renews a keep lease on its snapshot.

What a KV cache group's kind changes is decided by
:class:`~sparkcache.connector.groups.KVGroups`; the mechanism: docs/connector.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from sparkcache.connector.facts import NewPrefix
from sparkcache.connector.jobs import Counters, SaveJob
from sparkcache.connector.requests import RequestState, Rules, breakpoints_of
from sparkcache.connector.resharded import Siblings, sibling_match
from sparkcache.core import KEEP_HOLDER, KEEP_LEASE
from sparkcache.errors import SparkCacheError
from sparkcache.store import Match, SnapshotStore

__all__ = ["Saves"]

logger = logging.getLogger("vllm.sparkcache")


class Saves:
    """Planned saves, the requests whose blocks they hold, and keep leases.

    The per-request part is :class:`~sparkcache.connector.requests.SavePart`.
    """

    def __init__(self, store: SnapshotStore, rules: Rules, counters: Counters, *,
                 enabled: bool) -> None:
        self.store, self.rules, self.counters = store, rules, counters
        self.enabled = enabled
        self._saves: list[SaveJob] = []
        self._writes: list[SaveJob] = []  # those with blocks, until take_writes
        self._saving: set[str] = set()  # blocks held until the workers copied them
        self._kept: dict[int, float] = {}  # snapshot -> when our keep lease on it ends
        #: The model's KV heads in all, set by the connector (0: unknown, no
        #: lookups of snapshots stored by engines of another TP size).
        self.total_kv_heads = 0
        self.siblings = Siblings(store, rules.identity)  # those other TP sizes

    def start(self, state: RequestState) -> None:
        """Note a new request's marks: its breakpoints and the prompt's own save point
        (none for a request that asks not to be cached)."""
        if not self.enabled or not state.params.cache:
            return
        request, bs = state.request, self.rules.bs
        marks = set(state.params.breakpoints)
        if request.prompt_token_ids is not None:
            state.save.prompt_end = self.rules.groups.prompt_end(
                self.rules.restorable(int(request.num_prompt_tokens)), bs)
            if state.save.prompt_end is not None:
                marks.add(state.save.prompt_end)
        state.save.marks = sorted(m for m in marks if m // bs * bs >= self.rules.floor)

    def plan_marks(self, state: RequestState, step: int,
                   block_ids_of: Callable[[str], Any]) -> None:
        """Plan saves of the prefixes whose mark this step computes past."""
        request, groups = state.request, self.rules.groups
        req_id = request.request_id
        # Only tokens already in the sequence: speculative drafts may be rejected.
        done = min(int(request.num_computed_tokens) + step, len(request.all_token_ids))
        end_of = self._mark_ends(state)
        reached = [m for m in state.save.marks if max(m, end_of[m]) <= done]
        if not reached:
            return
        state.save.marks = [m for m in state.save.marks if m not in reached]
        # The snapshots the reached marks make; the prompt's own save point
        # (``prompt_end``) is a mark that no request asked for.
        asked = set(state.params.breakpoints)
        for n in groups.save_ends(end_of[m] for m in reached):
            marks = tuple(m for m in reached if end_of[m] <= n and m in asked)
            here = [m for m in marks if end_of[m] == n] if groups.ends_only else marks
            keep = max((state.params.keep.get(m, 0.0) for m in here), default=0.0) or None
            try:
                blocks = groups.per_group(block_ids_of(req_id))
                job, known = self._save_job(state, n, blocks, marks, mid_request=True,
                                            keep=keep, exact=max(here, default=None))
            except (SparkCacheError, KeyError, IndexError) as exc:
                logger.warning("sparkcache: no breakpoint save for %s: %s", req_id, exc)
                continue
            if job is not None:
                self._add(job)
                state.save.mid_saves += 1
                if not here:  # the prompt's end alone: no breakpoint wrote it
                    self.counters.add("prompt_saves_planned")
                    continue
                pieces = self._pieces(state, here, n)
                state.facts.new_prefixes.append(NewPrefix(
                    pieces[-1][0], 0 if known is None else min(known.n_tokens, pieces[-1][0]),
                    pieces))
                self.counters.add("breakpoint_saves_planned")
            elif known is not None and known.n_tokens == n and here:
                last = min(max(here), n)
                state.facts.new_prefixes.append(NewPrefix(last, last))
                if keep is not None:
                    self._keep(known.snapshot_id, keep)

    def _mark_ends(self, state: RequestState) -> dict[int, int]:
        """Each mark's snapshot end (:meth:`KVGroups.mark_end`)."""
        bs, prompt = self.rules.bs, int(state.request.num_prompt_tokens)
        return {m: self.rules.groups.mark_end(m, bs, prompt) for m in state.save.marks}

    def _pieces(self, state: RequestState, marks: Iterable[int],
                n: int) -> tuple[tuple[int, float | None], ...]:
        """The breakpoints ``marks`` that a snapshot of ``n`` tokens saves, as a
        :class:`NewPrefix` names them: (the end it restores to: the mark itself
        when the snapshot holds its block, else the whole blocks below; keep
        seconds), ascending; of marks with one end, the longest keep."""
        ends: dict[int, float | None] = {}
        for m in marks:
            end, keep = min(m, n), state.params.keep.get(m)
            ends[end] = keep if end not in ends else max(ends[end] or 0.0, keep or 0.0) or None
        return tuple(sorted(ends.items()))

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

    def may_copy(self, state: RequestState) -> bool:
        """Whether breakpoint saves of the request may still be copying its blocks."""
        return bool(state.save.mid_saves)

    def finished(self, state: RequestState, groups: list[list[int]]) -> bool:
        """Plan the finished request's save; True holds its blocks until the
        workers report them copied (a release job without blocks holds them for
        breakpoint saves that may still copy)."""
        hold = self._plan_save(state, groups)
        if not hold and state.save.mid_saves:
            self._saves.append(SaveJob(
                req_id=state.request.request_id, token_ids=np.empty(0, np.uint32),
                blocks=(), parent=None, scope=None, breakpoints=(),
            ))
            self._saving.add(state.request.request_id)
            hold = True
        return hold

    def _plan_save(self, state: RequestState, groups: list[list[int]]) -> bool:
        request, bs = state.request, self.rules.bs
        if not self.enabled or request.prompt_token_ids is None or not state.params.cache:
            return False
        tokens = request.all_token_ids
        held = max(len(ids) for ids in groups)
        n = min(request.num_computed_tokens, len(tokens), held * bs)
        marks = (self.rules.restorable(int(request.num_prompt_tokens)),
                 *breakpoints_of(request))
        job, _known = self._save_job(state, n // bs * bs, groups, marks)
        if job is None:
            return False
        self._add(job)
        self._saving.add(request.request_id)
        self.counters.add("saves_planned")
        return True

    def _save_job(self, state: RequestState, n: int, groups: list[list[int]],
                  marks: tuple[int, ...], *, mid_request: bool = False,
                  keep: float | None = None,
                  exact: int | None = None) -> tuple[SaveJob | None, Match | None]:
        """A save of the request's tokens ``[0, n)`` (whole blocks), or None when
        too short or already stored (up to ``exact`` inside the last block, when
        given: a breakpoint there); when a stored snapshot is a whole prefix,
        only the tail is written (copy-on-write).  Also returns the longest
        stored prefix found (None when none, or not looked up)."""
        request, bs, kinds = state.request, self.rules.bs, self.rules.groups
        if n < self.rules.floor:
            return None, None
        for ids in groups:
            if len(ids) * bs < n:
                raise SparkCacheError(f"{len(ids)} blocks cannot hold {n} tokens")
        token_ids = np.asarray(request.all_token_ids[:n], dtype=np.uint32)
        hashes = state.hashes(n, bs)
        parent_id, parent_tokens = None, 0
        known: Match | None = None
        try:
            known = self.store.lookup(self.rules.identity, token_ids, scope=state.scope,
                                      hashes=hashes, whole_first=True,
                                      ends_only=kinds.ends_only)
            if known is not None and exact is not None and \
                    known.n_tokens == exact // bs * bs < exact < n:
                known = self._stored_to(known, token_ids[:exact])
            if known is not None:
                if known.n_tokens == n:
                    self.counters.add("saves_known")
                    return None, known  # already stored (perhaps restored from it)
                if self.store.snapshot(known.snapshot_id).n_tokens == known.n_tokens \
                        and kinds.copy_on_write:
                    # A whole stored snapshot is our prefix: write only the tail.
                    parent_id, parent_tokens = known.snapshot_id, known.n_tokens
            if self._stored_otherwise(state, token_ids):  # (whatever its own holds)
                self.counters.add("saves_known")
                return None, known
        except SparkCacheError as exc:
            logger.warning("sparkcache lookup before save failed; saving in full: %s", exc)
        start, end = parent_tokens // bs, n // bs
        blocks = kinds.blocks(groups, start, end)
        if kinds.window_gone(blocks, start, end):
            self.counters.add("saves_windowless")
            logger.info("sparkcache: not saving %s: blocks of its window below token %d "
                        "are gone", request.request_id, n)
            return None, known
        return SaveJob(
            req_id=request.request_id, token_ids=token_ids, blocks=blocks, parent=parent_id,
            scope=state.scope, breakpoints=marks, report=not mid_request, keep=keep,
            start_block=start, copy_in_step=kinds.copy_in_step(mid_request=mid_request),
            explicit=self._explicit(state, token_ids, marks, known, mid_request),
        ), known

    def _explicit(self, state: RequestState, token_ids: np.ndarray, marks: tuple[int, ...],
                  known: Match | None, mid_request: bool) -> bool:
        """Whether a save stores an asked breakpoint not stored yet (an explicit
        cache write, published without waiting): beyond the longest stored
        prefix and, at the finish, inside the saved tokens and not stored
        elsewhere (a lookup of the prompt to that breakpoint)."""
        stored = known.n_tokens if known is not None else 0
        for m in marks:
            if m not in state.params.breakpoints or m <= stored:
                continue
            if mid_request:
                return True
            if m > len(token_ids):
                continue
            try:
                found = self.store.lookup(self.rules.identity, token_ids[:m], scope=state.scope,
                                          ends_only=self.rules.groups.ends_only)
                if found is not None and found.n_tokens < m:
                    found = self._stored_to(found, token_ids[:m])  # inside a stored block
            except SparkCacheError:
                return True
            if found is None or found.n_tokens < m:
                return True
        return False

    def _stored_to(self, known: Match, token_ids: np.ndarray) -> Match:
        """``known`` grown by its stored block when that block holds the rest
        of ``token_ids`` (a breakpoint inside it, stored already), else itself."""
        found = self.store.extend(known, token_ids)
        return found[0] if found is not None and found[1] == token_ids.size else known

    def _stored_otherwise(self, state: RequestState, token_ids: np.ndarray) -> bool:
        """Whether an engine of another TP size stored the request's whole prompt
        (its restorable whole blocks), which this engine restores (the longer
        match, whatever part of it its own sharding holds): its save would be a
        second copy of that prefix (a copy-on-write tail cannot have a parent of
        another sharding), so there is none."""
        bs = self.rules.bs
        prompt = self.rules.restorable(int(state.request.num_prompt_tokens)) // bs * bs
        found = sibling_match(self.store, self.rules.identity, self.total_kv_heads,
                              token_ids, state.scope, self.siblings(self.total_kv_heads))
        return found is not None and found.n_tokens >= prompt > 0

    def _add(self, job: SaveJob) -> None:
        self._saves.append(job)
        if job.blocks:
            self._writes.append(job)

    def take_writes(self) -> list[SaveJob]:
        """The saves that write (not a release) planned since the last call, each
        handed out once (the restores wait for them: ``Restores.writing``)."""
        writes, self._writes = self._writes, []
        return writes

    def take_saves(self) -> list[SaveJob]:
        """The saves planned since the last call, each handed out once."""
        saves, self._saves = self._saves, []
        return saves

    def copied(self, req_ids: Iterable[str]) -> None:
        """The workers copied these requests' saves: their blocks are free."""
        self._saving.difference_update(req_ids)

    @property
    def holding(self) -> bool:
        """Whether finished requests' blocks are held until the workers copied them."""
        return bool(self._saving)
