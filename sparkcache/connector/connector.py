"""SparkCacheConnector: vLLM's ``KVConnectorBase_V1`` over a :class:`SnapshotStore`.

Loaded by vLLM by name (:mod:`sparkcache.connector.plugin`) or from
``kv_connector_module_path="sparkcache.connector"``; see
docs/connector.md for users and docs/connector-notes.md for the vLLM API.
This module is the glue: the decisions live in
:mod:`sparkcache.connector.scheduler`, the disk I/O in
:mod:`sparkcache.connector.worker`, the jobs between them in
:mod:`sparkcache.connector.jobs`, all testable without vLLM.

Scheduler side (one per engine, in the engine-core process): looks prompts up,
offers the restorable tokens as an asynchronous load or one within the prefill
step, coalesces concurrent requests for one base, plans saves and holds their
blocks until every worker copied them out; runs the retention sweeper and,
with a shared tier, the uploader, the fetches and the tier's sweeper
(:mod:`sparkcache.connector.tier`, docs/shared.md); announces the store's blocks as KV
events (:mod:`sparkcache.connector.events`).

Worker side (one per rank): loads and saves on background threads with
bounded queues; finished loads and saves reported through ``get_finished``,
failed loads through ``get_block_ids_with_load_errors`` (vLLM recomputes,
``kv_load_failure_policy=recompute``, which this connector sets, also on a
``MultiConnector`` around it: :mod:`sparkcache.connector.engine`).

Stats (hits, misses, restored / written tokens and bytes, load and save time,
dropped work) go through vLLM's ``KVConnectorStats``; log lines through the
``vllm.sparkcache`` logger (vLLM's handler and format).

vLLM and torch are imported through ``importlib`` (types are ``Any``): mypy then
never follows into them, and this package imports without them.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterable
from typing import Any

from sparkcache.connector.engine import (
    Unsent,
    params_key,
    parent_multi_connector,
    recompute_policy,
    register_by_name,
)
from sparkcache.connector.events import Events, storage_events
from sparkcache.connector.faults import slow_save_step
from sparkcache.connector.groups import KVGroups
from sparkcache.connector.jobs import Counters
from sparkcache.connector.kvlayers import LayerGroups
from sparkcache.connector.layout import (
    check_isa,
    kv_groups,
    lone_token_differs,
    model_identity,
    rank_of,
    total_kv_heads,
)
from sparkcache.connector.logwriter import LogWriter
from sparkcache.connector.registration import attention_layers, layer_groups
from sparkcache.connector.scheduler import SchedulerSide
from sparkcache.connector.settings import ConnectorSettings
from sparkcache.connector.signals import outlive_first_signal_in_worker
from sparkcache.connector.stats import (
    SparkCacheMetadata,
    SparkCachePromMetrics,
    SparkCacheStats,
    SparkCacheWorkerMeta,
    computes_prompt,
)
from sparkcache.connector.tier import TierServices
from sparkcache.connector.worker import PAGES_ENV, WorkerIO
from sparkcache.cuda import KVPages
from sparkcache.errors import SparkCacheError
from sparkcache.identity import ModelIdentity
from sparkcache.requestlog import log_rows_setting
from sparkcache.retention import Retention, RetentionSettings
from sparkcache.store import SnapshotStore

__all__ = ["SparkCacheConnector", "SparkCacheMetadata", "SparkCachePromMetrics", "SparkCacheStats"]

_base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
_hit_source = importlib.import_module("vllm.v1.metrics.cache_hit_source")
KVConnectorBase_V1: Any = _base.KVConnectorBase_V1
SupportsHMA: Any = _base.SupportsHMA
KVConnectorTransferResults: Any = _base.KVConnectorTransferResults
KVConnectorRole: Any = _base.KVConnectorRole
CacheHitSource: Any = _hit_source.CacheHitSource
register_by_name("SparkCacheConnector", __name__)  # for a MultiConnector's stats

# A child of vLLM's logger: our lines get vLLM's handler and format.
logger = logging.getLogger("vllm.sparkcache")

#: On a step that computes nothing while a restore is in flight, the worker
#: waits this long for it to land instead of letting the engine spin.
IDLE_WAIT_SECONDS = 0.02


class SparkCacheConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Persistent, verified prefix snapshots for vLLM (see the module docstring).

    Supports vLLM's hybrid KV cache manager (``SupportsHMA``): block ids come
    one list per KV cache group, and each group is saved and restored in its
    own blocks (a sliding-window group: only its window).
    """

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parent = parent_multi_connector()  # vLLM's MultiConnector around this one, or None
        #: The kv_transfer_params key of this connector's facts.
        self.params_key = params_key(parent, lambda c: isinstance(c, SparkCacheConnector))
        self._unsent_key = (str(self._kv_transfer_config.engine_id), self.params_key)
        self.settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self.identity: ModelIdentity = model_identity(
            vllm_config, kv_cache_config, revision=self.settings.revision
        )
        self.block_size = self.identity.block_size
        self.kv_groups = kv_groups(kv_cache_config)
        self.groups = KVGroups(tuple(g.window_blocks for g in self.kv_groups))
        self.counters = Counters()
        self.active = self.settings.mode != "off"
        self.retention = Retention(RetentionSettings.from_env(folder=self.settings.folder))
        self.store: SnapshotStore | None = (
            SnapshotStore(self.settings.folder, retention=self.retention) if self.active else None
        )
        self.is_scheduler = role == KVConnectorRole.SCHEDULER
        self.events = Events()  # KV events: none, unless the scheduler's config asks
        if self.is_scheduler:
            self._init_scheduler(getattr(parent, "_kv_transfer_config", None))
        else:
            self._init_worker()
        logger.info("sparkcache %s connector, mode %s, on %s (model %s, identity %s)",
                    "scheduler" if self.is_scheduler else "worker", self.settings.mode,
                    self.settings.folder, self.identity.model, self.identity.digest())

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future miss, never an error.
        return False

    # ==============================================================================
    # Scheduler side
    # ==============================================================================

    def _init_scheduler(self, parent_config: Any) -> None:
        self.sweep_store: SnapshotStore | None = None
        self.tier: TierServices | None = None
        self.log_writer: LogWriter | None = None
        self.sched: SchedulerSide | None = None
        # Invariant: a failed restore is a miss.  The scheduler reads the policy of
        # the engine's config (a MultiConnector's, not its child's) right after
        # constructing the connector, so setting it here takes effect.
        replaced = recompute_policy([self._kv_transfer_config, parent_config])
        if replaced:
            logger.warning("sparkcache sets kv_load_failure_policy=recompute (was %s): a "
                           "snapshot that fails verification is recomputed, not an error",
                           ", ".join(sorted(set(replaced))))
        if self.store is None:
            return
        min_tokens = self.settings.min_tokens
        log_rows = log_rows_setting() if self.settings.log_rows is None else self.settings.log_rows
        if log_rows > 0:
            self.log_writer = LogWriter(self.settings.folder, self.identity, self.counters,
                                        keep=log_rows)
        self.sched = SchedulerSide(
            self.store, self.identity, self.counters,
            restore=self.settings.restore, publish=self.settings.publish,
            load_async=self.settings.load_async, tail_block=self.settings.tail_block,
            compute_tokens=self.settings.compute_tokens or (2 if lone_token_differs() else 1),
            min_tokens=self.retention.settings.min_tokens if min_tokens is None else min_tokens,
            on_facts=None if self.log_writer is None else self.log_writer.put,
            groups=self.groups, params_key=self.params_key, costs=self.settings.cost_model,
        )
        Unsent.register(self._unsent_key, self.sched.saves.take_saves)
        heads = self.sched.restores.total_kv_heads = self.sched.saves.total_kv_heads = \
            total_kv_heads(self._vllm_config)
        self.sched.start_warm(self.settings.warm_mb << 20, heads)
        self.events = storage_events(self._vllm_config, self._kv_cache_config,
                                     self.settings.folder, self.identity, self.counters)
        if self.settings.sweep:
            # Its own store (own index connection): a long sweep never holds the
            # lock that the scheduler's lookups take.
            self.sweep_store = SnapshotStore(self.settings.folder, retention=self.retention)
            self.sweep_store.start_sweeper()
        if self.settings.shared is not None:
            self.tier = TierServices(self.settings, self.settings.shared, self.identity,
                                     self.counters, self.retention, self.sched)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """How many tokens past vLLM's own prefix hit a restore can supply.

        vLLM calls it when it admits a waiting request that has computed nothing
        (new, or preempted), after its own prefix-cache lookup:
        ``num_computed_tokens`` is that local hit, whole blocks.  It may call it
        again for the same request on later steps (the blocks did not fit, or the
        answer was None) before :meth:`update_state_after_alloc`.

        Returns ``(tokens, load_async)``: ``(0, False)`` nothing to restore;
        ``(None, False)`` ask again on a later step (another request's restore
        of this prefix is in flight, or a fetch from the shared tier, up to
        ``shared_deadline_seconds``); else the tokens offered (never the
        prompt's last: vLLM computes one to sample) and whether they land while
        the request waits (True) or within its prefill step (False).

        Changes nothing of vLLM's; what it changes here (the request's pending
        offer, counters, a quarantine) is listed in
        :meth:`SchedulerSide.matched_tokens`.  Modes ``off`` and ``store-only``
        always answer ``(0, False)``."""
        if self.sched is None:
            return 0, False
        self.events.admitted(request)
        return self.sched.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        """vLLM allocated the request's blocks; ``num_external_tokens`` of the
        offer are to be loaded (0: none, e.g. vLLM skipped the offer).

        Called in the step that admits the request, after
        :meth:`get_num_new_matched_tokens`; for an asynchronous load possibly
        again (with 0) once it landed.  With tokens to load it plans the load
        (sent in this step's :meth:`build_connector_meta`), leases the
        snapshot until the load landed or the request is gone, and counts the
        hit; either way the request's pending offer is used up
        (:meth:`SchedulerSide.after_alloc`).
        """
        if self.sched is None:
            return
        block_ids = blocks.get_block_ids() if num_external_tokens else ()
        self.sched.after_alloc(request, block_ids, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        """Every restored token comes from the disk tier (vLLM's metrics); no state."""
        return {CacheHitSource.DISK: num_external_tokens} if num_external_tokens else {}

    def build_connector_meta(self, scheduler_output: Any) -> SparkCacheMetadata:
        """This step's work for every worker: loads, saves, preempted requests.

        Called once per step at the end of vLLM's ``schedule()``, after every
        allocation; the result is pickled to each worker.  Plans the saves of
        breakpoints that this step computes past, then hands over (and forgets)
        every load and save planned since the last call.  Reads
        ``scheduler_output``, never changes it.
        """
        if self.sched is None:
            return SparkCacheMetadata()
        self.sched.plan_breakpoints(scheduler_output.num_scheduled_tokens, self._block_ids_of)
        preempted = self.sched.preempted(getattr(scheduler_output, "preempted_req_ids", None)
                                         or ())
        idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        if idle:  # requests waiting for the shared tier: let it answer, do not spin
            self.sched.wait_fetches(IDLE_WAIT_SECONDS)
        loads, saves = self.sched.take_jobs()
        self.events.planned(saves)
        return SparkCacheMetadata(loads=loads, saves=saves, preempted=preempted, idle=idle,
                                  prefill=computes_prompt(scheduler_output),
                                  hurry=self.sched.take_hurry())

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Once, at scheduler start: breakpoint saves read running requests' blocks from it."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self._kv_manager = kv_cache_manager

    def _block_ids_of(self, req_id: str) -> Any:
        """A running request's blocks per KV cache group, for its breakpoint saves."""
        manager = getattr(self, "_kv_manager", None)
        if manager is None:
            raise KeyError("vLLM did not bind its KV cache manager")
        return manager.get_block_ids(req_id)

    def update_connector_output(self, connector_output: Any) -> None:
        """After each step, what the workers reported: asynchronous loads ended
        (``finished_recving``: leases go, requests waiting are answered again),
        blocks copied out (``finished_sending``), publishes ended (nobody waits
        for them: :meth:`build_connector_worker_meta`); the stats measure costs."""
        if self.sched is not None:
            self.sched.on_output(connector_output.finished_recving or (),
                                 connector_output.finished_sending or (),
                                 connector_output.kv_connector_stats,
                                 getattr(connector_output.kv_connector_worker_meta, "ended", None))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Plan a save of the request's computed whole blocks; hold them until copied.

        vLLM calls it exactly once per request, when it finishes or is aborted
        (also while waiting), before it frees the blocks; ``block_ids`` are its
        computed blocks.  The request is forgotten here (its offer, its
        breakpoints, the lease of a load that is not in flight), and a save of
        its whole computed blocks is planned for the next
        :meth:`build_connector_meta` unless they are too few or already stored.

        Returns ``(hold, params)``: ``hold`` is True when the blocks must stay
        allocated until every worker reports the id in ``finished_sending`` (a
        save is planned, or a breakpoint copy may still read them), False also
        for a request aborted while its restore is in flight (vLLM holds those
        blocks until the load reports).  ``params`` is
        ``{"sparkcache": {...}}`` (the key is :attr:`params_key`), the
        request's row of the request log (tokens from vLLM's own cache,
        restored, written at breakpoints, timings); vLLM returns it with the
        request's output as its ``kv_transfer_params`` (``sparkcache serve``
        turns it into usage).
        """
        return self._finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` with one block-id list per KV cache group
        (vLLM's hybrid allocator, ``SupportsHMA``; vLLM calls it instead).

        A sliding-window group's list holds vLLM's null block (id 0) where the
        window has moved past; the save takes each group's own blocks (the
        window's only) and holds all of them until copied.
        """
        return self._finished(request, block_ids)

    def _finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        if self.sched is None:
            return False, None
        self.events.finished(request)
        return self.sched.finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        """True while blocks that :meth:`request_finished` held are not copied out
        yet: vLLM may wait for them instead of preempting."""
        return self.sched is not None and self.sched.pending_block_frees

    def reset_cache(self) -> bool | None:
        """``reset_prefix_cache(reset_connector=True)``: changes nothing, returns True:
        the store is persistent and shared with other engines, a reset of vLLM's
        prefix cache must not delete snapshots (``sparkcache clear`` does that)."""
        return True

    # ==============================================================================
    # Worker side
    # ==============================================================================

    def _init_worker(self) -> None:
        self.io: WorkerIO | None = None
        self._layer_index: dict[str, int] = {}  # vLLM layer name -> the identity's layer
        self._waited: set[int] = set()  # layers whose in-step loads the forward awaited
        self._step_loading = False

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Once per worker, after vLLM allocated the KV cache (layer name -> tensor).

        Checks the tensors against the identity and starts this rank's I/O
        threads.  A cache that does not fit turns this worker off (logged):
        its loads fail (vLLM recomputes) and its saves are skipped, never an error.
        """
        if self.store is None:
            return
        parallel = importlib.import_module("vllm.distributed.parallel_state")
        groups: LayerGroups | None = None
        pages: list[KVPages] = []
        rank = 0
        try:
            pages, groups, self._layer_index = layer_groups(
                kv_caches, self.kv_groups, self.identity, staging_mb=self.settings.staging_mb,
                use_numpy=os.environ.get(PAGES_ENV) != "torch")
            check_isa(self.identity, attention_layers(self._vllm_config, kv_caches))
            rank = rank_of(self.identity, parallel.get_tensor_model_parallel_rank(),
                           parallel.get_pipeline_model_parallel_rank())
        except SparkCacheError as exc:
            # Loads fail (and are recomputed), saves are skipped: misses only.
            logger.error("sparkcache is off on this worker: %s", exc)
            groups, self._layer_index = None, {}
        self.io = WorkerIO(
            self.store, self.identity, rank, None, self.counters,
            max_queued_loads=self.settings.max_queued_loads,
            load_threads=self.settings.load_threads,
            max_queued_saves=self.settings.max_queued_saves,
            max_pending_bytes=self.settings.max_pending_mb << 20,
            groups=groups, kinds=self.groups,
        )
        self.io.total_kv_heads = total_kv_heads(self._vllm_config)
        outlive_first_signal_in_worker(self._vllm_config)  # the engine's drain reaches it
        if groups is not None:
            first = pages[0]
            logger.info("sparkcache worker rank %d: %d layers of %d blocks in %d KV cache "
                        "group(s) (%s), %d-byte pages %s on %s", rank, len(groups.where),
                        first.num_blocks, len(self.kv_groups),
                        ", ".join(f"{g.kind} x{len(g.layers)}" for g in self.kv_groups),
                        first.page_nbytes, self.identity.page_shape, first.where)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Each step, before its forward: the step's metadata.  The publishes wait
        while the step computes prompt tokens, unless a request waits for one
        (``publisher.Prefills``; the step's end is :meth:`get_finished`)."""
        super().bind_connector_metadata(connector_metadata)
        if self.io is not None:
            self.io.prefills.started(bool(getattr(connector_metadata, "prefill", False)),
                                     getattr(connector_metadata, "hurry", ()))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Each step, with the step's metadata bound: before the forward when the
        step has an in-step (synchronous) load, else after vLLM launched it.

        Queues the asynchronous loads on the loader thread (reported later in
        :meth:`get_finished`) and starts the in-step ones: the in-step thread
        reads them layer by layer while the forward runs
        (:meth:`wait_for_layer_load`; on a GPU a layer's uploads are complete
        before the forward's kernels for that layer are queued).  A failed or
        dropped load is never raised: its blocks are reported by
        :meth:`get_block_ids_with_load_errors`.
        """
        meta = self._get_connector_metadata()
        if self.io is None:
            return
        in_step = [job for job in meta.loads if job.in_step]
        for job in meta.loads:
            if not job.in_step:
                self.io.submit_load(job)
        if in_step:
            # Read layer by layer while the forward runs (wait_for_layer_load).
            self._waited.clear()
            self._step_loading = True
            self.io.start_step_loads(in_step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this step's in-step loads have ``layer_name``'s pages in place.

        vLLM calls it inside each attention layer, before the layer reads the
        KV cache.  A layer name not registered waits for every layer; a step
        without in-step loads returns at once.  Only notes which layers were
        waited for (see :meth:`wait_for_save`).
        """
        if self.io is None or not self._step_loading:
            return
        layer = self._layer_index.get(layer_name)
        self.io.wait_layer(layer)  # an unknown layer waits for every layer
        if layer is None:
            self._waited.update(self._layer_index.values())
        else:
            self._waited.add(layer)

    def _finish_step_loads(self) -> None:
        if self.io is None or not self._step_loading:
            return
        self._step_loading = False
        waited_all = len(self._waited) >= len(set(self._layer_index.values()))
        self.io.finish_step_loads(all_layers_waited=waited_all)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Called inside each attention layer after it wrote the KV cache: does
        nothing.  Saves copy whole blocks after the step (:meth:`wait_for_save`)."""
        return

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before the forward that may overwrite preempted requests' freed blocks.

        vLLM calls it with the step's metadata before :meth:`start_load_kv`.
        Breakpoint copies of the preempted requests that are still queued are
        dropped (counted as ``saves_cancelled``); one being copied right now is
        waited for (at most 60 s), so no copy reads a block after vLLM reused it.
        """
        if self.io is not None and kv_connector_metadata.preempted:
            self.io.cancel_copies(kv_connector_metadata.preempted)

    def wait_for_save(self) -> None:
        """Hand this step's saves to the saver thread; nothing waits for the disk.

        vLLM calls it once per step after the forward (also on empty steps),
        with the metadata still bound.  First it ends this step's in-step loads
        (waits for them; if the forward skipped :meth:`wait_for_layer_load` for
        some layer, they are reported failed), then queues the saves.  vLLM
        keeps a save's blocks until :meth:`get_finished` reports its id (once
        copied into host memory; a dropped save at once: a future miss).  A
        breakpoint save's sliding-window blocks are copied here: vLLM frees
        them on the next step while the request runs on.
        """
        meta = self._get_connector_metadata()
        if self.io is None:
            return
        self._finish_step_loads()  # a save may copy blocks this step restored
        slow_save_step(self.io.fault, len(meta.saves))
        for job in meta.saves:
            self.io.submit_save(job)

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """After each step: ``(finished_sending, finished_recving)``, None for empty.

        ``finished_sending``: requests whose held blocks were copied out (or
        their save dropped) since the last call - each exactly once, never
        before the step whose metadata carried the save.  ``finished_recving``:
        requests whose asynchronous load ended since the last call, landed or
        failed (failures in :meth:`get_block_ids_with_load_errors`).  Ends this
        step's in-step loads if :meth:`wait_for_save` did not; on a step that
        computes nothing it first waits up to ``IDLE_WAIT_SECONDS`` for a load
        to land, instead of letting the engine spin.  ``finished_req_ids`` is
        not needed: the ids come from this worker's own jobs.
        """
        if self.io is None:  # mode off: nothing is ever planned
            return None, None
        self.io.prefills.ended()
        self._finish_step_loads()  # before wait_for_save when vLLM defers it
        if self._connector_metadata is not None and self._connector_metadata.idle:
            self.io.wait_for_loads(IDLE_WAIT_SECONDS)
        sent, recved = self.io.poll()
        return (sent or None), (recved or None)

    def build_connector_worker_meta(self) -> SparkCacheWorkerMeta | None:
        """After each step: saves whose publish ended here (vLLM sends it without stats too)."""
        ended = self.io.take_ended() if self.io is not None else {}
        return SparkCacheWorkerMeta(ended=ended) if ended else None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """:meth:`get_finished`, plus (with several KV cache groups) the requests
        whose restore failed in ``failed_recving``: vLLM's block ids are per
        group there, so a failed load is reported as a failed request and vLLM
        recomputes it whole.  Failures are taken after the finished ids, so a
        failed request is never reported finished before it is reported failed."""
        sent, recved = self.get_finished(finished_req_ids)
        failed = self.io.take_failed_requests() if self.io is not None else set()
        return KVConnectorTransferResults(finished_sending=set(sent or ()),
                                          finished_recving=set(recved or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of loads that failed since the last call (verification, a full
        queue, a forward that skipped a layer's wait); vLLM recomputes them.

        An asynchronous load's blocks are reported no later than the step whose
        :meth:`get_finished` reports its id; an in-step load's in its own step.
        """
        return set() if self.io is None else self.io.take_failed_blocks()

    # ==============================================================================
    # Both sides
    # ==============================================================================

    def get_kv_connector_stats(self) -> SparkCacheStats | None:
        """The counters since the last call (they restart at zero); None: nothing counted."""
        data = self.counters.take()
        return SparkCacheStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> SparkCacheStats:
        return SparkCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return SparkCachePromMetrics(vllm_config, metric_types, labelnames,
                                     per_engine_labelvalues)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued load and save of this worker is done; False on timeout."""
        return True if self.io is None else self.io.flush(timeout)

    def shutdown(self) -> None:
        """Scheduler: stop the sweepers, then the uploader after up to
        ``upload_wait_seconds`` for its queue (a snapshot published just before
        a clean exit reaches the shared tier).  Worker: run the saves that its
        scheduler side, in this process, planned and no step carried here (an
        in-process engine shut down right after its last request), finish
        queued loads and saves (up to 60 s), stop the threads.  Both close the
        store.  vLLM shuts the workers down before the scheduler."""
        if self.is_scheduler:
            Unsent.unregister(self._unsent_key)
            if self.sweep_store is not None:
                self.sweep_store.close()  # stops its sweeper
            if self.log_writer is not None:
                self.log_writer.close()
            if self.sched is not None:
                self.sched.close()  # keeps what the cost model learned
            if self.tier is not None:
                self.tier.close()
            self.events.close()
        elif self.io is not None:
            if unsent := Unsent.take(self._unsent_key):
                logger.info("sparkcache: %d save(s) planned after the last step, run at "
                            "shutdown", len(unsent))
            for job in unsent:
                self.io.submit_save(job)
            self.io.close()
        if self.store is not None:
            self.store.close()

    def take_events(self) -> Iterable[Any]:
        """After each step, scheduler side: the store's KV events since the last call
        (none without ``kv_events_config``): docs/connector.md, "KV events"."""
        return self.events.take()
