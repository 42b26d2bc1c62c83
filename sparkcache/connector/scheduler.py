"""The scheduler side: vLLM's scheduler hooks over a table of requests.

Pure Python over duck-typed vLLM ``Request`` objects
(:mod:`~sparkcache.connector.requests`), so it is unit-tested without vLLM.
:class:`SchedulerSide` keeps vLLM's hook names and the per-request table, and
hands each request's state to the planners below it:
:class:`~sparkcache.connector.restores.Restores` (what to restore, who waits),
:class:`~sparkcache.connector.saves.Saves` (what to save, which blocks are held)
and :class:`~sparkcache.connector.facts.Reporter` (the request log and usage).
Block ids come as vLLM gives them: one list, or one list per KV cache group
(:meth:`~sparkcache.connector.groups.KVGroups.per_group`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sparkcache.connector.costs import CostKeeper, CostModel, CostPlanner, StepClock, tier_source
from sparkcache.connector.facts import Reporter
from sparkcache.connector.fetcher import Fetcher
from sparkcache.connector.groups import KVGroups
from sparkcache.connector.jobs import Counters, LoadJob, SaveJob
from sparkcache.connector.requests import (
    MAX_KEEP_SECONDS,
    RequestParams,
    RequestState,
    Rules,
    breakpoints_of,
    params_of,
    scope_of,
)
from sparkcache.connector.restores import Restores
from sparkcache.connector.saves import Saves
from sparkcache.connector.warming import Warmer
from sparkcache.errors import InvalidArgument
from sparkcache.identity import ModelIdentity
from sparkcache.store import SnapshotStore

__all__ = ["MAX_KEEP_SECONDS", "RequestParams", "SchedulerSide", "breakpoints_of", "params_of",
           "scope_of"]


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
        params_key: str = "sparkcache",
        costs: bool = False,
    ) -> None:
        self.store = store
        #: The key of the facts in the ``kv_transfer_params`` :meth:`finished` returns.
        self.params_key = params_key
        #: The engine's KV cache groups (default: a plain model's one group).
        self.groups = KVGroups() if groups is None else groups
        if self.groups.ends_only != identity.ends_only:
            raise InvalidArgument("the KV cache groups' windows disagree with the identity's")
        self.identity = identity
        self.counters = counters
        #: The settings both planners read.
        self.rules = rules = Rules(identity, self.groups, min_tokens,
                                   max(1, int(compute_tokens)))
        self.restores = Restores(store, rules, counters, enabled=restore,
                                 load_async=load_async, tail_block=tail_block, fetcher=fetcher)
        self.saves = Saves(store, rules, counters, enabled=publish)
        self.reporter = Reporter(on_facts)
        self._reqs: dict[str, RequestState] = {}
        #: The measured cost model (``costs``: it decides restores; else it is
        #: not kept), the clock of the steps that measure prefill, its keeper.
        self.costs = CostModel(identity.digest())
        self.clock = StepClock(self.costs)
        self.keeper: CostKeeper | None = None
        self._planned_step: tuple[int, int] | None = None  # (prefill tokens, longest)
        self.warmer: Warmer | None = None  # the start's read into the page cache
        if costs:
            self.keeper = CostKeeper(self.costs, store.root)
            self.restores.costs = CostPlanner(
                self.costs, store, ranks=identity.world_size,
                bytes_per_token=identity.num_layers * identity.page_nbytes / identity.block_size)

    @property
    def min_tokens(self) -> int:
        """The shortest prefix worth a snapshot (below a block: a block)."""
        return self.rules.min_tokens

    @property
    def fetcher(self) -> Fetcher | None:
        """Fetches from the shared tier when the local index holds less of a
        prompt than it may (None: no tier, or restoring from it is off)."""
        return self.restores.fetcher

    @fetcher.setter
    def fetcher(self, fetcher: Fetcher | None) -> None:
        self.restores.fetcher = fetcher

    def use_tier(self, fetcher: Fetcher, url: str, endpoint: str | None) -> None:
        """Fetch from the shared tier ``url`` (at ``endpoint``) with ``fetcher``,
        measured as one source of the cost model."""
        self.restores.fetcher = fetcher
        planner = self.restores.costs
        if planner is not None:
            planner.tier, planner.deadline = tier_source(url, endpoint), fetcher.deadline
            fetcher.on_result = lambda result: planner.fetched(result.nbytes, result.seconds)

    @property
    def on_facts(self) -> Callable[[dict[str, Any]], None] | None:
        """Called with a request's log row when its prompt has been scheduled
        (what usage reports) and again when it finished (timings, output)."""
        return self.reporter.on_facts

    @on_facts.setter
    def on_facts(self, on_facts: Callable[[dict[str, Any]], None] | None) -> None:
        self.reporter.on_facts = on_facts

    def _state(self, request: Any) -> RequestState:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = RequestState.of(request, self.identity)
            self.saves.start(state)
            self._reqs[request.request_id] = state
        return state

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
        self.restores.asked(request.request_id)
        if request.prompt_token_ids is None:
            return 0, False
        self._note_writes()  # (one planned at a finish in this very step too)
        return self.restores.matched(request, self._state(request), num_computed)

    def wait_fetches(self, timeout: float) -> None:
        """On a step that computes nothing: wait up to ``timeout`` for a fetch
        from the tier to end, instead of letting the engine spin."""
        self.restores.wait_fetches(timeout)

    def after_alloc(self, request: Any, block_ids: Any, num_external: int) -> None:
        """vLLM's ``update_state_after_alloc`` (``block_ids``: the request's blocks).

        Uses up the request's pending offer.  When ``num_external`` tokens of it
        are to be loaded: plans the load (:meth:`take_jobs`), marks an
        asynchronous one in flight (followers wait), leases the snapshot until
        the load landed or the request is gone, and counts ``hits`` and
        ``hit_tokens``.  A count other than the one offered plans nothing (logged).
        """
        self.restores.after_alloc(self._reqs.get(request.request_id), block_ids, num_external)

    # -- each step ---------------------------------------------------------------------

    def plan_breakpoints(
        self, scheduled: Mapping[str, int], block_ids_of: Callable[[str], Any]
    ) -> None:
        """Plan saves of the prefixes whose breakpoint this step computes past, and
        report the facts of requests whose prompt this step finishes (``on_facts``).

        ``scheduled``: tokens each request computes in this step (vLLM's
        ``num_scheduled_tokens``, seen before vLLM advances ``num_computed_tokens``);
        ``block_ids_of``: a request's KV blocks.  Workers copy the blocks out
        after the step's forward, so the planned tokens are computed by then.
        Notes the time a request's first output token is first seen.
        """
        now = time.time()
        prefill = longest = 0  # for the cost model's prefill rate
        self._planned_step = None
        for req_id, state in self._reqs.items():
            state.facts.saw_output(state.request, now)
            step = scheduled.get(req_id)
            if step is None:
                continue
            self._planned_step = (0, 0)  # the step computes something
            if step > 1:
                prefill += int(step)
                longest = max(longest, int(state.request.num_computed_tokens) + int(step))
            if state.save.marks:
                self.saves.plan_marks(state, int(step), block_ids_of)
            self.reporter.stepped(state.request, state.facts, int(step))
        if self._planned_step is not None:
            self._planned_step = (prefill, longest)

    def preempted(self, req_ids: Iterable[str]) -> list[str]:
        """Of vLLM's preempted requests, those whose breakpoint saves may still be
        copying: their workers wait for (or cancel) those copies before the
        freed blocks are written again (``handle_preemptions``).  Changes nothing."""
        return [r for r in req_ids
                if (state := self._reqs.get(r)) and self.saves.may_copy(state)]

    def take_jobs(self) -> tuple[list[LoadJob], list[SaveJob]]:
        """The loads and saves planned since the last call (``build_connector_meta``);
        they are forgotten here, each handed out once."""
        loads = self.restores.take_loads()
        step, self._planned_step = self._planned_step, None
        self.clock.planned(step, in_step_loads=any(job.in_step for job in loads))
        self._note_writes()
        return loads, self.saves.take_saves()

    def take_hurry(self) -> list[str]:
        """Requests whose saves another request waits for (``Restores.take_hurry``)."""
        return self.restores.take_hurry()

    def _note_writes(self) -> None:
        """Saves planned since the last look: a request reading more of one than
        is stored or live waits for it (the next request may read one at once)."""
        for job in self.saves.take_writes():
            self.restores.writing(job)

    def on_output(self, finished_recving: Iterable[str], finished_sending: Iterable[str],
                  stats: Any = None, ended: dict[str, int] | None = None) -> None:
        """``update_connector_output``: loads landed (their leases go, followers
        are answered again), saves copied (their blocks are no longer held),
        publishes ``ended`` (``SparkCacheWorkerMeta``: nobody waits for them);
        the step's time and the workers' ``stats`` measure the cost model."""
        self.clock.ended()
        if self.restores.costs is not None and stats is not None:
            self.restores.costs.loads_measured(getattr(stats, "data", None))
        if ended:
            self.restores.ended(ended)
        landed = list(finished_recving)
        self.restores.landed(landed)
        for req_id in landed:
            if (state := self._reqs.get(req_id)) is not None:
                state.facts.loaded_at = time.time()
        self.saves.copied(finished_sending)

    def start_warm(self, max_bytes: int, total_kv_heads: int = 0) -> None:
        """Read this model's most recently used snapshots (with
        ``total_kv_heads``, those of its other shardings too) into the page
        cache, up to ``max_bytes``, on a thread of its own
        (:mod:`~sparkcache.connector.warming`; nothing when restores are off);
        the cost model counts them warm."""
        if not self.restores.enabled or max_bytes <= 0:
            return
        planner = self.restores.costs
        self.warmer = Warmer(self.store.root, self.identity, max_bytes, self.counters,
                             None if planner is None else lambda got: planner.warmed(got.snapshots),
                             total_kv_heads=total_kv_heads)

    def close(self) -> None:
        """Stop reading into the page cache; keep what the cost model learned
        (when it is kept); release the leases of loads planned."""
        if self.warmer is not None:
            self.warmer.close()
        if self.keeper is not None:
            self.keeper.close()
        self.restores.leases.close()

    @property
    def pending_block_frees(self) -> bool:
        """Whether finished requests' blocks are held until the workers copied them."""
        return self.saves.holding

    # -- finish ------------------------------------------------------------------------

    def finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished`` (once per request): plan a save; True holds
        the blocks until the workers report them copied.

        Forgets the request: its offer, its state, its lease unless its
        asynchronous load is still in flight (that lease goes in
        :meth:`on_output`; the blocks are not saved then).  Returns ``(True,
        params)`` when a save is planned or a breakpoint save may still copy the
        blocks (a release job without blocks is then planned), else ``(False,
        params)``; ``params`` is ``{params_key: <the request's log row>}``
        (vLLM returns it with the request's output), None for a request never
        admitted.
        """
        req_id = request.request_id
        state = self._reqs.get(req_id)
        params: dict[str, Any] | None = None
        if state is not None:
            facts = self.reporter.finished(request, state.facts)
            params = {self.params_key: {k: v for k, v in facts.items() if k != "created_at"}}
        try:
            if self.restores.finished(req_id):
                # Aborted while its restore is in flight: the blocks are still being
                # written (vLLM holds them until the load reports); nothing to save.
                return False, params
            groups = self.groups.per_group(block_ids)
            return self.saves.finished(self._state(request), groups), params
        finally:
            self._reqs.pop(req_id, None)
