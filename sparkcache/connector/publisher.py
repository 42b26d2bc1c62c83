"""A worker's publishes: a save's copied-out pages written to the store, the
heavy part on a thread of the lowest scheduling priority.

A save's blocks are copied out of the KV cache by the worker's saver thread
(vLLM frees them only then), at the lowest priority
(:func:`sparkcache.cpus.lower_priority`).  Writing the copy is
:class:`Publisher`'s, on a thread of its own so the next copy-out need not
wait: the write step (hashing, the payload file, its fsync) runs on a helper
thread at the lowest priority too, while the publish's two short index
transactions stay on the publish thread at the engine's priority - a thread
of the lowest priority holding the index's write lock could keep a
request-log write waiting for as long as the forward keeps the cores.  The
engine's threads run first, the next request's prefill among them, and the
save takes the time they leave (when vLLM needs the blocks back, its forward
waits and leaves that time).  Measured on a 2-core CPU, a chat's turns sent
back to back (13 turns sharing a 1526-token system prompt, one engine each,
medians): 1.06x plain vLLM's time with only the write lowered, 0.91-1.15x
(three runs) with the copy-out lowered too, against 1.06-1.6x with neither.

A publish also waits for a moment the forward computes no prompt
(:class:`Prefills`): it starts ``SETTLE_S`` after its save was queued (time for
the next request, sent as soon as the previous answer ended, to reach its
prefill) and then while a step that computes prompt tokens runs, at most
``MAX_WAIT_S`` after its save was queued, so the write lands in the next
request's decode steps instead of its prefill.  Under load it waits no longer
than that: a queue of saves is not held back.  A save that stores a breakpoint
the request asked for (``SaveJob.explicit``: an API's cache write, which the
client may read with its very next request) does not wait, and while one is
queued the publishes before it do not either; their writes run on the
publish thread itself, at the engine's priority, so that it is readable as
soon as it can be.  Measured with
``bench/serve_bench.py`` on the same 2-core CPU: the requests before its
restart took 1.04x plain vLLM's TTFT at p50 with the wait, 1.75x without.

Publishes run one at a time in the order they were submitted (a snapshot's
parent is published before it).  A publish that fails is logged and counted,
never raised; ``done`` is called after each, failed or not.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from sparkcache.connector.faults import HOLD_PUBLISHES_S, die_at_publish, holds_publishes
from sparkcache.connector.jobs import Counters, SaveJob
from sparkcache.core import KEEP_HOLDER, KEEP_LEASE
from sparkcache.cpus import lower_priority, widen_affinity
from sparkcache.errors import NotFound, SparkCacheError
from sparkcache.identity import ModelIdentity

__all__ = ["Prefills", "Publisher"]

logger = logging.getLogger("vllm.sparkcache")

#: A publish starts no sooner than this many seconds after its save was queued.
SETTLE_S = 0.03
#: ... and no later than this (waiting while prompt tokens are computed).
MAX_WAIT_S = 1.0
#: How long publishes hurry for a save a request waits for, at most (as
#: long as it waits, ``restores.WRITE_WAIT_SECONDS``, and then some).
WANT_S = 2.0


class Prefills:
    """Whether the worker's forward is computing prompt tokens now.

    The connector marks each step's start (:meth:`started`, with whether the
    step schedules prompt tokens) and its end (:meth:`ended`); a publish waits
    for a quiet moment (:meth:`wait_quiet`).

    Args:
        settle_s: a publish starts no sooner than this after its save was queued.
        max_wait_s: nor later than this.
        want_s: how long a save another request waits for hurries the publishes (:meth:`want`).
        busy: wait as if every step computed prompt tokens (the ``hold-publishes``
            test fault, ``faults.holds_publishes``).
    """

    def __init__(self, settle_s: float = SETTLE_S, max_wait_s: float = MAX_WAIT_S,
                 want_s: float = WANT_S, *, busy: bool = False) -> None:
        self.settle_s, self.max_wait_s, self.want_s = settle_s, max_wait_s, want_s
        self.busy = busy
        self._cond = threading.Condition()
        self._running = False
        self._closed = False
        self._urgent = 0  # explicit saves queued: the publishes before them wait no more
        self._wanted: dict[str, float] = {}  # request -> since when a request waits for its save

    @classmethod
    def of(cls, fault: str) -> Prefills:
        """A worker's (the ``hold-publishes`` test fault holds every publish)."""
        held = holds_publishes(fault)
        return cls(max_wait_s=HOLD_PUBLISHES_S if held else MAX_WAIT_S, busy=held)

    def started(self, prefill: bool, hurry: Iterable[str] = ()) -> None:
        """A step begins; ``prefill``: it computes prompt tokens; ``hurry``:
        requests whose saves a request waits for (:meth:`want`)."""
        with self._cond:
            self._running = prefill
        self.want(hurry)

    def ended(self) -> None:
        """The step's forward is over."""
        with self._cond:
            self._running = False
            self._cond.notify_all()

    def urgent(self, delta: int) -> None:
        """An explicit save was queued (+1) or published (-1): while one is
        queued, the publishes before it (in order) do not wait."""
        with self._cond:
            self._urgent += delta
            self._cond.notify_all()

    def want(self, req_ids: Iterable[str]) -> None:
        """Another request waits for these requests' saves (``SparkCacheMetadata.hurry``):
        until they are published (:meth:`published`), at most ``want_s``, no
        publish waits (what is queued before them hurries too)."""
        if not req_ids:
            return
        with self._cond:
            now = time.monotonic()
            for req_id in req_ids:
                self._wanted.setdefault(req_id, now)
            self._cond.notify_all()

    def wanted(self, req_id: str) -> bool:
        """Whether a request waits for ``req_id``'s save."""
        with self._cond:
            return req_id in self._wanted

    def published(self, req_id: str) -> None:
        """``req_id``'s save was published (or failed): nobody waits for it now."""
        with self._cond:
            self._wanted.pop(req_id, None)

    def _hurrying(self) -> bool:
        """(Under the lock.)  Whether an explicit or a wanted save is queued; a
        want whose save never came (dropped, skipped) lapses after ``want_s``."""
        if self._wanted:
            lapsed = time.monotonic() - self.want_s
            self._wanted = {r: t for r, t in self._wanted.items() if t > lapsed}
        return self._urgent > 0 or bool(self._wanted)

    def hurried(self) -> bool:
        """Whether an explicit or a wanted save is queued (what is before it hurries too)."""
        with self._cond:
            return self._hurrying()

    def close(self) -> None:
        """Wait no more (the worker is closing)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_quiet(self, since: float) -> float:
        """Block until ``settle_s`` after ``since`` (``time.monotonic()`` when the
        save was queued), then while a prefill step runs, until ``max_wait_s``
        after ``since`` at most.  Returns the seconds waited."""
        start = time.monotonic()
        deadline = since + self.max_wait_s
        with self._cond:
            settle = min(since + self.settle_s, deadline)
            while not (self._closed or self._hurrying()) and time.monotonic() < settle:
                self._cond.wait(settle - time.monotonic())
            while (self._running or self.busy) and not (self._closed or self._hurrying()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        return time.monotonic() - start


class Publisher:
    """The publish thread of one worker (one rank).

    Args:
        store: the worker's :class:`~sparkcache.store.SnapshotStore`.
        identity: the rank's model identity.
        rank: the rank whose segments it publishes.
        counters: the worker's counters (``saves``, ``saved_tokens``, ...).
        done: called with a publish's job and ``tag`` after it ended, failed or not.
        fault: the test fault (``SPARKCACHE_TEST_FAULT``), if any.
        prefills: what a publish waits for (None: nothing, it starts at once).
    """

    def __init__(self, store: Any, identity: ModelIdentity, rank: int, counters: Counters,
                 done: Callable[[SaveJob, Any], None], fault: str = "",
                 prefills: Prefills | None = None) -> None:
        self.store, self.identity, self.rank = store, identity, rank
        self.counters, self.fault, self._done = counters, fault, done
        self.prefills = prefills
        # Unbounded: the worker bounds what it submits (its pending bytes).
        self._queue: queue.Queue[tuple[SaveJob, list[np.ndarray], Any, float] | None] = \
            queue.Queue()
        self.lowered = False  # whether the write thread runs at the lowest priority
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sparkcache-write",
                                          initializer=self._lower)
        self._writer.submit(lambda: None)  # started now, lowered before any write
        self._thread = threading.Thread(target=self._run, name="sparkcache-publish",
                                        daemon=True)
        self._thread.start()

    def _lower(self) -> None:
        widen_affinity()
        self.lowered = lower_priority()

    def _offload(self, write: Callable[[], Any]) -> Any:
        """A publish's write step, run on the write thread (the caller waits)."""
        return self._writer.submit(write).result()

    def submit(self, job: SaveJob, pages: list[np.ndarray], tag: Any) -> None:
        """Publish ``pages`` (one array per layer) for ``job``, then ``done(tag)``."""
        if job.explicit and self.prefills is not None:
            self.prefills.urgent(+1)
        self._queue.put((job, pages, tag, time.monotonic()))

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread once what was submitted is published (without waiting
        for quiet moments)."""
        if self.prefills is not None:
            self.prefills.close()
        self._queue.put(None)
        self._thread.join(timeout=timeout)
        self._writer.shutdown(wait=not self._thread.is_alive())

    def _hurry(self, job: SaveJob) -> bool:
        """An explicit or a wanted save, or one before it in the queue: written
        at the engine's priority (on this thread), not below it."""
        return job.explicit or (self.prefills is not None and self.prefills.hurried())

    def _run(self) -> None:
        widen_affinity()
        while (item := self._queue.get()) is not None:
            job, pages, tag, queued = item
            try:
                if self.prefills is not None and not job.explicit:
                    self.counters.add("save_yield_seconds", self.prefills.wait_quiet(queued))
                self.publish(job, pages)
            except Exception as exc:  # never kill the thread
                logger.exception("sparkcache save for %s crashed: %s", job.req_id, exc)
                self.counters.add("save_failures")
            finally:
                if self.prefills is not None:
                    if job.explicit:
                        self.prefills.urgent(-1)
                    self.prefills.published(job.req_id)
                del item, pages
                self._done(job, tag)

    def publish(self, job: SaveJob, pages: list[np.ndarray]) -> None:
        """Write one save to the store; failures are logged and counted."""
        die_at_publish(self.fault, self.rank)
        started = time.perf_counter()
        try:
            result = self.store.publish(self.identity, self.rank, job.token_ids, pages,
                                        parent=job.parent, scope=job.scope,
                                        breakpoints=job.breakpoints,
                                        offload=None if self._hurry(job) else self._offload)
        except NotFound:
            # The parent was evicted meanwhile: these pages alone cannot stand.
            self.counters.add("saves_lost_parent")
            return
        except (SparkCacheError, OSError) as exc:
            logger.warning("sparkcache publish for %s failed: %s", job.req_id, exc)
            self.counters.add("save_failures")
            return
        finally:
            self.counters.add("save_seconds", time.perf_counter() - started)
        if result.state == "skipped":
            logger.info("sparkcache did not save %s: %s", job.req_id, result.skipped)
            self.counters.add("saves_skipped")
            return
        self.counters.add("saves")
        self.counters.add("saved_tokens", len(job.token_ids) - job.start_block * self.bs)
        self.counters.add("saved_bytes", result.bytes_written)
        if job.keep and self.rank == 0:
            try:
                self.store.acquire_lease(result.snapshot_id, kind=KEEP_LEASE, ttl=job.keep,
                                         holder=KEEP_HOLDER)
            except SparkCacheError as exc:  # gone already: nothing to keep
                logger.warning("sparkcache: could not keep snapshot %d: %s",
                               result.snapshot_id, exc)

    @property
    def bs(self) -> int:
        return self.identity.block_size
