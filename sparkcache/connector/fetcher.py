"""The scheduler's fetches from the shared tier, on background threads.

vLLM's scheduler thread must never wait for the network.  When the local
index holds less of a prompt than the tier may, :class:`Fetcher` runs
:meth:`SnapshotStore.fetch` on one of its threads while the scheduler answers
vLLM "ask again" (``get_num_new_matched_tokens`` returning ``(None, False)``;
the request stays waiting, every other request keeps running).  Once the
fetch is done the snapshot is local and the ordinary lookup offers it; past
the deadline the request goes on with what is local (a miss for the tier,
counted) and the fetch, if it ever finishes, still leaves its snapshot for the
next request.

A tier that fails or misses the deadline is not asked again for a while
(:data:`BACKOFF_SECONDS`, doubling while it keeps failing): requests are then
answered from the local store at once instead of each waiting out the
deadline (counted ``remote_skipped``).  The first fetch after the pause
probes it again; one that works ends the pause.

Counters (through the connector's :class:`~sparkcache.connector.jobs.Counters`):
``remote_lookups`` (fetches started), ``remote_misses`` (the tier held nothing
more), ``remote_refused`` (what it held failed verification), ``remote_errors``
(the tier failed: unreachable, refused), ``remote_timeouts`` (past the
deadline), ``remote_dropped`` (too many fetches in flight: not asked), ``remote_skipped``
(not asked while the tier is paused after a failure),
``remote_fetched_bytes`` and ``remote_seconds``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from sparkcache.connector.jobs import Counters
from sparkcache.errors import SparkCacheError
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.shared import FetchResult
from sparkcache.store import SnapshotStore

__all__ = ["DEFAULT_DEADLINE_SECONDS", "Fetch", "Fetcher"]

logger = logging.getLogger("vllm.sparkcache")

#: How long a request waits for the shared tier before it goes on without it.
DEFAULT_DEADLINE_SECONDS = 2.0
#: Fetches in flight at most; past it a request is not looked up in the tier.
MAX_IN_FLIGHT = 64
#: After a failure or a missed deadline the tier is not asked for this long,
#: doubling with each further one up to the maximum.
BACKOFF_SECONDS = (1.0, 60.0)


@dataclass
class Fetch:
    """One request's fetch: its future and when it started (monotonic)."""

    future: Future[FetchResult]
    started: float
    deadline: float
    tokens: int = 0  # the prompt's tokens asked for

    def expired(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.started + self.deadline


class Fetcher:
    """Runs fetches from ``store``'s shared tier on ``threads`` threads."""

    def __init__(self, store: SnapshotStore, identity: ModelIdentity, counters: Counters, *,
                 deadline: float = DEFAULT_DEADLINE_SECONDS, threads: int = 2,
                 min_tokens: int = 1, total_kv_heads: int = 0) -> None:
        if store.shared is None:
            raise ValueError("the fetcher's store needs a shared tier")
        self.store = store
        self.identity = identity
        self.counters = counters
        self.deadline = deadline
        self.min_tokens = min_tokens
        #: The model's KV heads in all: a miss asks the tier's other TP sizes too.
        self.total_kv_heads = total_kv_heads
        self._pool = ThreadPoolExecutor(max_workers=threads,
                                        thread_name_prefix="sparkcache-fetch")
        self._running: set[Future[FetchResult]] = set()
        self._lock = threading.Lock()
        #: Called with every fetch's result that the tier answered (the cost model).
        self.on_result: Callable[[FetchResult], None] | None = None
        self._burst = 0  # failures of the tier since it last answered
        self._paused_until = 0.0  # monotonic: not asked before (after failures)

    def start(self, tokens: np.ndarray, scope: RequestScope | None,
              breakpoints: Sequence[int], hashes: Sequence[bytes]) -> Fetch | None:
        """Start a fetch of the longest prefix of ``tokens`` (whole blocks, with
        their ``hashes``); None when too many are in flight (counted)."""
        with self._lock:
            if time.monotonic() < self._paused_until:
                self.counters.add("remote_skipped")
                return None
            if len(self._running) >= MAX_IN_FLIGHT:
                self.counters.add("remote_dropped")
                return None
            future = self._pool.submit(self._run, np.array(tokens, np.uint32), scope,
                                       tuple(breakpoints), list(hashes))
            self._running.add(future)
        future.add_done_callback(self._done)
        self.counters.add("remote_lookups")
        return Fetch(future, time.monotonic(), self.deadline, len(tokens))

    def _done(self, future: Future[FetchResult]) -> None:
        with self._lock:
            self._running.discard(future)

    def _run(self, tokens: np.ndarray, scope: RequestScope | None,
             breakpoints: tuple[int, ...], hashes: list[bytes]) -> FetchResult:
        started = time.perf_counter()
        try:
            result = self.store.fetch(self.identity, tokens, scope=scope,
                                      breakpoints=breakpoints, hashes=hashes,
                                      min_tokens=self.min_tokens,
                                      total_kv_heads=self.total_kv_heads)
        except Exception as exc:  # a miss, whatever failed: never the request's error
            self.counters.add("remote_errors")
            self.failed()
            if not isinstance(exc, SparkCacheError):
                logger.exception("sparkcache: a fetch from the shared tier failed (a miss)")
            elif self._burst == 1:
                logger.warning("sparkcache: the shared tier failed (a miss, recomputed; not "
                               "logged again until it answers): %s", exc)
            return FetchResult("error", reason=str(exc),
                               seconds=time.perf_counter() - started)
        finally:
            self.counters.add("remote_seconds", time.perf_counter() - started)
        if self._burst:
            logger.info("sparkcache: the shared tier answers again after %d failures",
                        self._burst)
            with self._lock:
                self._burst, self._paused_until = 0, 0.0
        if result.outcome == "miss":
            self.counters.add("remote_misses")
        elif result.outcome == "refused":
            self.counters.add("remote_refused")
            logger.warning("sparkcache: a snapshot in the shared tier was refused (a miss): "
                           "%s", result.reason)
        self.counters.add("remote_fetched_bytes", result.nbytes)
        if self.on_result is not None:
            self.on_result(result)
        return result

    def failed(self) -> None:
        """The tier failed or missed a request's deadline: pause asking it."""
        with self._lock:
            self._burst += 1
            pause = min(BACKOFF_SECONDS[1], BACKOFF_SECONDS[0] * 2 ** (self._burst - 1))
            self._paused_until = time.monotonic() + pause

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._running)

    def wait_any(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a fetch in flight to end (an idle step)."""
        with self._lock:
            running = list(self._running)
        if running:
            wait(running, timeout=timeout, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        """Stop: fetches in flight finish on their own; none start."""
        self._pool.shutdown(wait=False, cancel_futures=True)
