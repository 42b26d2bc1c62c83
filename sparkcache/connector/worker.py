"""The worker side's disk I/O: bounded queues and background threads.

Pure Python over numpy (no vLLM import), so it is tested with simulated
workers.  One :class:`WorkerIO` per vLLM worker process (one per rank):

* **loads** (scheduler planned a restore): a verified ``read_into`` straight
  into the request's blocks (CPU; an asynchronous load's chunks land there
  and are verified in place, ``in_place``), or through the worker's reused staging
  slots, each chunk uploaded while the next is read (GPU:
  :mod:`sparkcache.cuda.staging`).  An asynchronous load runs on the loader
  thread while the request waits in WAITING_FOR_REMOTE_KVS; its id is
  reported in ``finished_recving`` once done, failed or not.  An in-step
  load feeds the forward of the step that prefills the request: the in-step
  thread reads it layer by layer while that forward runs, and each attention
  layer waits only for its own layer (``wait_layer``; on a GPU a layer
  counts as landed once its uploads are complete), so the read overlaps the
  compute.  vLLM writes a layer's new tokens into the cache before that
  layer waits, so a last block the restore shares with them (a prompt that
  leaves the snapshot inside a block) is read first, every layer, before the
  forward starts.
* **saves** (a request finished; vLLM holds its blocks): a saver thread copies
  the blocks out into host memory, reports the id in ``finished_sending`` (vLLM
  frees the blocks on the next step) and hands the copy to the publish thread
  (:mod:`sparkcache.connector.publisher`, in order); the copy-out and the
  publish's write run at the lowest scheduling priority, behind the forward's.  A
  breakpoint save of a running request reads blocks the request holds, except
  a sliding window's, which vLLM frees as the request moves on: those are
  copied in ``wait_for_save``, before the step ends (``copy_in_step``).

No disk I/O runs on the forward thread.  Both queues are bounded, and so are the host bytes held
by saves: over a bound the work is dropped and counted - a dropped load is reported failed (vLLM
recomputes its blocks), a dropped save sent at once (a future miss).  Serving never waits for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sparkcache.connector.costs import LOAD_KEY
from sparkcache.connector.faults import FAULT_ENV, scramble, slow_restore
from sparkcache.connector.groups import KVGroups
from sparkcache.connector.jobs import Counters, LoadJob, SaveJob, save_tag
from sparkcache.connector.kvlayers import LayerGroups, Pages
from sparkcache.connector.publisher import Prefills, Publisher
from sparkcache.connector.resharded import load_resharded
from sparkcache.cpus import lower_priority, read_cpus, widen_affinity
from sparkcache.errors import SparkCacheError
from sparkcache.identity import ModelIdentity
from sparkcache.store import Match, SnapshotStore

__all__ = ["FAULT_ENV", "PAGES_ENV", "WorkerIO"]

logger = logging.getLogger("vllm.sparkcache")

#: Test hook: ``torch`` makes a worker whose KV cache is in host memory move pages
#: as a GPU worker does (torch copies; restores staged through the pinned-slot
#: pipeline, layer by layer) instead of numpy views straight into the cache, so
#: the GPU path runs in a real vLLM engine on CPU.  Never set it in production.
PAGES_ENV = "SPARKCACHE_TEST_PAGES"

#: An in-step load's progress once it ended (landed or failed).
LOADED = sys.maxsize
#: An in-step load's progress while the last block it shares with the forward
#: (``LoadJob.split``) has not landed: the forward does not start.
HEAD = -1


class WorkerIO:
    """Loads and saves of one rank, off the forward path (see the module docstring)."""

    def __init__(
        self,
        store: SnapshotStore,
        identity: ModelIdentity,
        rank: int,
        pages: Pages | None,
        counters: Counters,
        *,
        max_queued_loads: int = 64,
        load_threads: int = 1,
        max_queued_saves: int = 64,
        max_pending_bytes: int = 1 << 30,
        groups: LayerGroups | None = None,
        kinds: KVGroups | None = None,
    ) -> None:
        self.store, self.identity, self.rank, self.counters = store, identity, rank, counters
        #: The KV layers by group (``pages`` alone: a plain model's one group),
        #: None when this worker is off; their kinds (default: full attention).
        self.groups = groups if groups is not None or pages is None else LayerGroups.one(pages)
        self.kinds = kinds or KVGroups((0,) * (1 if groups is None else len(groups.pages)))
        self.pages = pages
        #: The model's KV heads in all, set by the connector (0: unknown, no
        #: restores of snapshots stored by engines of another TP size).
        self.total_kv_heads = 0
        self._failed_reqs: set[str] = set()
        self.max_pending_bytes = max_pending_bytes
        self.load_threads = load_threads
        self.fault = os.environ.get(FAULT_ENV, "")
        self._lock = threading.RLock()
        self._sent: set[str] = set()
        self._recved: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._pending_bytes = 0
        self._ended: queue.SimpleQueue[str] = queue.SimpleQueue()  # publishes ended
        # Notified when a breakpoint copy finished or a load landed.
        self._progress = threading.Condition(self._lock)
        # Breakpoint saves of running requests: copies not done yet, per request;
        # requests whose release waits for them; cancellations at preemption.
        self._copying: dict[str, set[int]] = {}  # request -> sequence numbers
        self._release: set[str] = set()
        self._cancelled: set[int] = set()  # queued jobs to skip
        self._seq = 0  # save jobs submitted
        self._active: tuple[str, int] | None = None  # the job being copied out
        self._loads: queue.Queue[LoadJob | None] = queue.Queue(max_queued_loads)
        self._saves: queue.Queue[
            tuple[SaveJob, int, int, object, dict[int, list[np.ndarray]]] | None
        ] = queue.Queue(max_queued_saves)
        # In-step loads of the current step: request -> layers landed (LOADED when
        # done, failed or not).  Unbounded: the step cannot run without them.
        self._in_step: queue.Queue[LoadJob | None] = queue.Queue()
        self._step_layers: dict[str, int] = {}
        # Ended in-step loads awaiting finish_step_loads, with whether each landed.
        self._step_jobs: list[tuple[LoadJob, bool]] = []
        self._start()

    def _start(self) -> None:
        """The I/O threads: the loader, the saver, the in-step reader and the
        publisher (the publishes' ``prefills``)."""
        self._threads = [
            threading.Thread(target=self._load_loop, name="sparkcache-load", daemon=True),
            threading.Thread(target=self._save_loop, name="sparkcache-save", daemon=True),
            threading.Thread(target=self._in_step_loop, name="sparkcache-in-step", daemon=True),
        ]
        #: Whether the forward computes prompt tokens now: publishes wait for it.
        self.prefills = Prefills.of(self.fault)
        self._publisher = Publisher(self.store, self.identity, self.rank, self.counters,
                                    self._published, self.fault, self.prefills)
        for thread in self._threads:
            thread.start()

    @property
    def bs(self) -> int:
        return self.identity.block_size

    # -- loads -----------------------------------------------------------------------

    def load_now(self, job: LoadJob) -> bool:
        """Synchronous load (on the caller's thread); failures are recorded."""
        return self._run_load(job, report=False)

    def submit_load(self, job: LoadJob) -> None:
        """Queue an asynchronous load; when the queue is full it fails at once."""
        try:
            self._loads.put_nowait(job)
        except queue.Full:
            self.counters.add("loads_dropped")
            self._finish_load(job, ok=False, report=True)

    def _load_loop(self) -> None:
        widen_affinity()
        while (job := self._loads.get()) is not None:
            try:
                self._run_load(job, report=True)
            finally:
                self._loads.task_done()
        self._loads.task_done()

    # -- in-step loads: layer by layer, overlapping the forward ----------------------

    def start_step_loads(self, jobs: Sequence[LoadJob]) -> None:
        """Begin this step's in-step loads (``start_load_kv``, before the forward).

        The in-step thread reads them layer by layer; the forward calls
        :meth:`wait_layer` before each attention layer and :meth:`finish_step_loads`
        once it is done (on a GPU a layer has landed once its uploads are
        complete, so the kernels queued after ``wait_layer`` read its pages)."""
        with self._lock:
            for job in jobs:
                self._step_layers[job.req_id] = 0 if job.split(self.bs) is None else HEAD
        self.counters.add("loads_in_step", len(jobs))
        for job in jobs:
            self._in_step.put(job)
        # The forward writes its new tokens into a block before that layer waits
        # for its restore: a block both share lands before the forward starts.
        with self._lock:
            while any(done == HEAD for done in self._step_layers.values()):
                self._progress.wait()

    def wait_layer(self, layer: int | None) -> None:
        """Block until ``layer`` (None: every layer) of this step's loads landed."""
        least = LOADED if layer is None else layer + 1
        with self._lock:
            while any(done < least for done in self._step_layers.values()):
                self._progress.wait()

    def finish_step_loads(self, *, all_layers_waited: bool) -> None:
        """After the forward: wait for this step's loads to end.  If the forward
        did not wait for every layer (an attention path that skips vLLM's
        per-layer hook), it may have read pages before they landed: the loads
        are then reported failed and vLLM recomputes their blocks."""
        with self._lock:
            if not self._step_layers:
                return
            self.wait_layer(None)
            jobs, self._step_jobs = self._step_jobs, []
            self._step_layers.clear()
            if not all_layers_waited:
                # A load that failed was counted (and its blocks reported) then.
                self.counters.add("load_failures", sum(ok for _job, ok in jobs))
                self.counters.add("loads_unwaited", len(jobs))
                for job, _ok in jobs:
                    self._fail(job)
        if not all_layers_waited:
            logger.warning("sparkcache: vLLM's forward did not wait for every restored layer; "
                           "%d in-step restore(s) are recomputed (use load_async: true)",
                           len(jobs))

    def _in_step_loop(self) -> None:
        widen_affinity()
        while (job := self._in_step.get()) is not None:
            req_id = job.req_id

            def landed(layer: int, req_id: str = req_id) -> None:
                with self._lock:
                    self._step_layers[req_id] = layer + 1
                    self._progress.notify_all()

            ok = False
            try:
                ok = self._run_load(job, report=False, on_layer=landed)
            finally:
                with self._lock:
                    self._step_layers[req_id] = LOADED
                    self._step_jobs.append((job, ok))
                    self._progress.notify_all()
                self._in_step.task_done()
        self._in_step.task_done()

    def _run_load(self, job: LoadJob, *, report: bool,
                  on_layer: Callable[[int], None] | None = None) -> bool:
        started = time.perf_counter()
        try:
            self._load(job, on_layer)
        except (SparkCacheError, ValueError, OSError) as exc:
            logger.warning("sparkcache restore of snapshot %d for %s failed (recomputed): %s",
                           job.snapshot_id, job.req_id, exc)
            self._finish_load(job, ok=False, report=report)
            return False
        except Exception as exc:  # never kill the thread; vLLM recomputes
            logger.exception("sparkcache restore for %s crashed (recomputed): %s", job.req_id, exc)
            self._finish_load(job, ok=False, report=report)
            return False
        self.counters.add(LOAD_KEY + job.req_id, time.perf_counter() - started)  # cost model
        self.counters.add("loads")
        self.counters.add("loaded_tokens", job.n_tokens - job.start_block * self.bs)
        self.counters.add("loaded_bytes", self._nbytes(job))
        self.counters.add("load_seconds", time.perf_counter() - started)
        self._finish_load(job, ok=True, report=report)
        with contextlib.suppress(SparkCacheError):  # the hit (beside the lease's release)
            self.store.save_counts(wait=0.1)
        return True

    def _load(self, job: LoadJob, on_layer: Callable[[int], None] | None = None) -> None:
        """Verified read of the match into the blocks vLLM allocated for it (a
        snapshot of another TP size: ``load_resharded``, this rank's heads).
        Each layer gets its group's blocks (a window: only its window); the
        payload below ``start_block`` (vLLM's own hit) is not read.  On CPU
        straight into the KV cache, each read thread pinned to its own core
        (connector-notes.md, "CPU placement"); otherwise through each group's
        reused staging slots, each chunk uploaded while the next is read and
        verified.  ``on_layer(i)`` runs once layer ``i`` is in place; a last
        block the forward shares (``LoadJob.split``) is read first, for every
        layer, then ``on_layer(HEAD)`` runs."""
        groups = self._groups_of(job)
        if self.kinds.bad_load(job.blocks):
            raise SparkCacheError(f"no blocks to restore in a group: "
                                  f"{[list(ids)[:4] for ids in job.blocks]}")
        split = job.split(self.bs)
        if split is not None:  # the block the forward shares first, all layers
            self._load_part(split[0], groups, None, hit=split[1] is None)
            if on_layer is not None:
                on_layer(HEAD)  # (progress 0: the forward may start)
        rest = job if split is None else split[1]
        if rest is not None:
            self._load_part(rest, groups, on_layer)
        if self.fault == "flip-restored":
            for p, ids in zip(groups.pages, job.blocks, strict=True):
                p.scatter(ids, scramble(p.gather(ids)))

    def _load_part(self, job: LoadJob, groups: LayerGroups,
                   on_layer: Callable[[int], None] | None, *, hit: bool = True) -> None:
        """:meth:`_load` of ``job``'s blocks, whichever sharding stored them
        (``hit``: the store counts the read a hit, once a restore)."""
        slow_restore(self.fault)
        if job.source is not None:  # stored by an engine of another TP size
            load_resharded(self.store, self.identity, self.rank, self.total_kv_heads, job,
                           groups.pages[0], job.blocks[0], self.counters,
                           threads=self.load_threads, cpus=read_cpus(), hit=hit)
        else:
            self._load_own(job, groups, on_layer, hit)

    def _load_own(self, job: LoadJob, groups: LayerGroups,
                  on_layer: Callable[[int], None] | None, hit: bool = True) -> None:
        """:meth:`_load` of a snapshot stored under the engine's own identity."""
        match = Match(job.snapshot_id, job.n_tokens, self.identity, job.token_ids, from_lookup=True)
        end = job.n_tokens // self.bs
        starts = [(end - len(job.blocks[g])) * self.bs for g, _j in groups.where]
        # The fault hook rewrites every layer after the read: nothing is announced before.
        notify = None if self.fault == "flip-restored" else on_layer
        views = [p.block_views(ids) for p, ids in zip(groups.pages, job.blocks, strict=True)]
        if all(v is not None for v in views):
            # These blocks are the request's own; an asynchronous load's are read by no
            # forward before it reports (vLLM holds the request), so each chunk lands there
            # and is verified in place.  A failure leaves bytes in them (unverified ones,
            # in place): reported failed and recomputed, every block of the load.
            out: list[Any] = [views[g][j] for g, j in groups.where]  # type: ignore[index]
            self.store.read_into(match, self.rank, out, n_tokens=job.n_tokens,
                                 start_tokens=starts, on_layer=notify,
                                 threads=self.load_threads, cpus=read_cpus(), hit=hit,
                                 in_place=not job.in_step, record_later=True)
            self.counters.add("loads_direct")
        else:
            # Leaving the block waits for every queued upload of every group.
            with contextlib.ExitStack() as stack:
                staged = [stack.enter_context(p.staged(ids))
                          for p, ids in zip(groups.pages, job.blocks, strict=True)]

                def landed(layer: int) -> None:
                    g, j = groups.where[layer]
                    staged[g].landed(j)
                    if notify is not None:
                        notify(layer)

                self.store.read_into(match, self.rank,
                                     [staged[g].layers[j] for g, j in groups.where],
                                     n_tokens=job.n_tokens, start_tokens=starts, hit=hit,
                                     threads=self.load_threads, on_layer=landed, record_later=True)

    def _groups_of(self, job: LoadJob | SaveJob) -> LayerGroups:
        """This worker's KV cache groups, which the job's per-group blocks must match."""
        groups = self.groups
        if groups is None:
            raise SparkCacheError("this worker's KV cache is not registered with sparkcache")
        if len(job.blocks) != len(groups.pages):
            kind = "load" if isinstance(job, LoadJob) else "save"
            raise SparkCacheError(f"a {kind} planned for other KV cache groups than this "
                                  "worker's")
        return groups

    def _nbytes(self, job: LoadJob | SaveJob) -> int:
        """The KV bytes a job moves: each layer's own group's blocks (a window: fewer)."""
        where = self.groups.where if self.groups is not None else ()
        return sum(len(job.blocks[g]) for g, _j in where) * self.identity.page_nbytes

    def _finish_load(self, job: LoadJob, *, ok: bool, report: bool) -> None:
        with self._lock:
            if not ok:
                self.counters.add("load_failures")
                self._fail(job)
            if report:
                self._recved.add(job.req_id)
                self._progress.notify_all()

    def _fail(self, job: LoadJob) -> None:
        """Report a failed load to vLLM: its blocks, or (:attr:`KVGroups.fails_by_request`)
        the request, whose block ids are per group.  Under the lock."""
        if self.kinds.fails_by_request:
            self._failed_reqs.add(job.req_id)
        else:
            self._failed_blocks.update(b for ids in job.blocks for b in ids)

    # -- saves -----------------------------------------------------------------------

    def submit_save(self, job: SaveJob) -> None:
        """Queue a save; the blocks are reported sent once copied out (or dropped)."""
        if self.groups is None or not job.blocks:
            if job.blocks:  # nothing to write it with
                self._ended.put(save_tag(job))
            if job.report:
                self._mark_sent(job.req_id)
            return
        nbytes = self._nbytes(job)
        with self._lock:
            over = self._pending_bytes + nbytes > self.max_pending_bytes
            if not over:
                self._pending_bytes += nbytes
                self._seq += 1
                seq = self._seq
                if not job.report:
                    self._copying.setdefault(job.req_id, set()).add(seq)
        if not over:
            # On a GPU the copy waits for the forward that wrote the blocks.
            fence = self.groups.pages[0].fence()
            try:
                early = self._copy_in_step(job, fence)
            except Exception as exc:  # a failed copy is a lost save, never the step's error
                logger.exception("sparkcache copy-out for %s failed: %s", job.req_id, exc)
                self.counters.add("save_failures")
                self._unqueue(job, nbytes, seq)
                self._ended.put(save_tag(job))
                return
            try:
                self._saves.put_nowait((job, nbytes, seq, fence, early))
                return
            except queue.Full:
                self._unqueue(job, nbytes, seq)
        self.counters.add("saves_dropped")
        self._ended.put(save_tag(job))
        if job.report:
            self._mark_sent(job.req_id)

    def _unqueue(self, job: SaveJob, nbytes: int, seq: int) -> None:
        """Undo :meth:`submit_save`'s accounting of a save that is not queued."""
        with self._lock:
            self._pending_bytes -= nbytes
        if not job.report:
            self._copied(job.req_id, {seq})

    def _copy_in_step(self, job: SaveJob, fence: object) -> dict[int, list[np.ndarray]]:
        """Copies, by group index, of the job's ``copy_in_step`` groups, taken before
        the step ends (vLLM may hand those blocks to another request next step)."""
        if not job.copy_in_step:
            return {}
        groups = self._groups_of(job)
        started = time.perf_counter()
        early = {g: groups.pages[g].gather(job.blocks[g], after=fence)
                 for g in job.copy_in_step}
        self.counters.add("save_copy_seconds", time.perf_counter() - started)
        return early

    def _mark_sent(self, req_id: str) -> None:
        """The request's blocks may be freed - once its breakpoint saves are copied."""
        with self._lock:
            if self._copying.get(req_id):
                self._release.add(req_id)
            else:
                self._sent.add(req_id)

    def _copied(self, req_id: str, seqs: set[int]) -> None:
        """Breakpoint saves ``seqs`` of ``req_id`` no longer read its blocks."""
        with self._lock:
            left = self._copying.get(req_id, set()) - seqs
            if left:
                self._copying[req_id] = left
                return
            self._copying.pop(req_id, None)
            if req_id in self._release:
                self._release.discard(req_id)
                self._sent.add(req_id)
            self._progress.notify_all()

    def cancel_copies(self, req_ids: Sequence[str], timeout: float = 60.0) -> None:
        """vLLM preempted these requests and frees their blocks before the next
        forward writes them: breakpoint saves still queued are dropped, one being
        copied right now is waited for (``handle_preemptions``)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            for req_id in req_ids:
                queued = set(self._copying.get(req_id, ()))
                if self._active is not None:
                    queued.discard(self._active[1])
                if queued:
                    self._cancelled |= queued
                    self.counters.add("saves_cancelled", len(queued))
                    self._copied(req_id, queued)  # a re-entrant lock
            for req_id in req_ids:
                while self._copying.get(req_id):
                    if not self._progress.wait(max(0.0, deadline - time.monotonic())):
                        logger.error("sparkcache: a breakpoint save of preempted %s is still "
                                     "copying after %.0f s", req_id, timeout)
                        return

    def _save_loop(self) -> None:
        widen_affinity()
        lower_priority()  # below the forward's threads, as the publish thread
        while (item := self._saves.get()) is not None:
            job, nbytes, seq, fence, early = item
            pages: list[np.ndarray] | None = None
            with self._lock:
                cancelled = seq in self._cancelled
                self._cancelled.discard(seq)
                if not cancelled:
                    self._active = (job.req_id, seq)
            try:
                if not cancelled:
                    started = time.perf_counter()
                    pages = self._gather(job, fence, early)
                    self.counters.add("save_copy_seconds", time.perf_counter() - started)
            except Exception as exc:  # never kill the thread
                logger.exception("sparkcache copy-out for %s failed: %s", job.req_id, exc)
                self.counters.add("save_failures")
            # Copied out (or failed): vLLM may free the blocks.  Reported exactly
            # once: vLLM asserts on an id it no longer knows.
            with self._lock:
                self._active = None
                if job.report:
                    self._mark_sent(job.req_id)
                elif not cancelled:
                    self._copied(job.req_id, {seq})
            if pages is not None:  # written below the engine's priority (publisher)
                self._publisher.submit(job, pages, nbytes)
            else:
                self._published(job, nbytes)
            del pages
        self._saves.task_done()

    def _published(self, job: SaveJob, nbytes: int) -> None:
        """A save's publish ended (or it had nothing to publish): its host bytes are
        free, its queue entry done (``flush``), the scheduler told (:meth:`take_ended`)."""
        with self._lock:
            self._pending_bytes -= nbytes
            self._ended.put(save_tag(job))
            self._progress.notify_all()  # a request may wait for it (wait_for_loads)
        self._saves.task_done()

    def take_ended(self) -> dict[str, int]:
        """Saves (``jobs.save_tag``) whose publish here ended since the last call
        (published, skipped, failed, dropped), each with how often."""
        ended: dict[str, int] = {}
        while not self._ended.empty():
            tag = self._ended.get_nowait()
            ended[tag] = ended.get(tag, 0) + 1
        return ended

    def _gather(self, job: SaveJob, fence: object,
                early: dict[int, list[np.ndarray]]) -> list[np.ndarray]:
        """Copies of a save's blocks: one array per layer of the identity, each
        from its group's blocks (a window: fewer); ``early``: the groups copied
        in the step already."""
        groups = self._groups_of(job)
        copied = [early[g] if g in early else p.gather(ids, after=fence)
                  for g, (p, ids) in enumerate(zip(groups.pages, job.blocks, strict=True))]
        return [copied[g][j] for g, j in groups.where]

    # -- reporting -------------------------------------------------------------------

    def poll(self) -> tuple[set[str], set[str]]:
        """(ids whose blocks were copied out, ids whose async load finished)."""
        with self._lock:
            sent, self._sent = self._sent, set()
            recved, self._recved = self._recved, set()
        return sent, recved

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to ``timeout`` s while async loads are in flight and none has
        landed yet, or a save a request waits for is published and none ended
        yet.  On steps that compute nothing: instead of vLLM spinning through empty
        steps (holding the GIL and a core the I/O needs) the engine sleeps."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._recved and (self._loads.unfinished_tasks or (
                    self._ended.empty() and self.prefills.hurried())):
                left = deadline - time.monotonic()
                if left <= 0 or not self._progress.wait(left):
                    return

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed since the last call, where vLLM hears of
        failures per request (:attr:`KVGroups.fails_by_request`; it recomputes
        them: ``failed_recving``)."""
        with self._lock:
            failed, self._failed_reqs = self._failed_reqs, set()
        return failed

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued load and save is done; False on timeout."""
        deadline = time.monotonic() + timeout
        while (self._loads.unfinished_tasks or self._saves.unfinished_tasks
               or self._in_step.unfinished_tasks):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float = 60.0) -> None:
        self.prefills.close()  # what is queued is published at once
        if not self.flush(timeout):
            logger.warning("sparkcache: shutting down with loads or saves still queued")
        self._loads.put(None)
        self._saves.put(None)
        self._in_step.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
        self._publisher.close()

