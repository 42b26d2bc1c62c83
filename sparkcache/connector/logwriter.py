"""The scheduler's request log writer: rows go to the index off vLLM's thread.

The scheduler side reports each request's facts (:meth:`SchedulerSide.on_facts`)
twice: when its prompt has been scheduled (what ``sparkcache serve`` reports as
usage, and waits for on a streamed answer) and when it finished.  Writing a row
is a write transaction (an fsync), which vLLM's scheduler thread must not wait
for: :class:`LogWriter` queues the rows and one thread commits whatever has
queued, in one transaction, as soon as it can, on its own index connection.

A full queue drops rows (counted as ``log_dropped``); a failed write is logged
and counted (``log_failures``); neither ever reaches a request.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import Any

from sparkcache.connector.jobs import Counters
from sparkcache.cpus import widen_affinity
from sparkcache.errors import SparkCacheError
from sparkcache.identity import ModelIdentity
from sparkcache.store import SnapshotStore

__all__ = ["LogWriter"]

logger = logging.getLogger("vllm.sparkcache")

#: Rows waiting for the writer at most; more are dropped (counted).
MAX_QUEUED_ROWS = 10_000


class LogWriter:
    """Commits request log rows of one engine on a thread of its own."""

    def __init__(self, folder: str, identity: ModelIdentity, counters: Counters, *,
                 keep: int) -> None:
        self.keep = keep
        self.counters = counters
        self.store = SnapshotStore(folder)  # its own index connection
        self.model_id = self.store.ensure_model(identity)
        self._rows: queue.Queue[dict[str, Any] | None] = queue.Queue(MAX_QUEUED_ROWS)
        self._thread = threading.Thread(target=self._run, name="sparkcache-log", daemon=True)
        self._thread.start()

    def put(self, row: dict[str, Any]) -> None:
        """Queue a row (``requestlog.LOG_FIELDS``); never blocks."""
        try:
            self._rows.put_nowait({**row, "model_id": self.model_id})
        except queue.Full:
            self.counters.add("log_dropped")

    def _run(self) -> None:
        widen_affinity()  # not the one core of the thread that started it
        done = False
        while not done:
            batch = [self._rows.get()]
            while True:  # whatever else queued meanwhile goes in the same commit
                try:
                    batch.append(self._rows.get_nowait())
                except queue.Empty:
                    break
            done = None in batch
            rows = [row for row in batch if row is not None]
            if rows:
                self._write(rows)

    def _write(self, rows: list[dict[str, Any]]) -> None:
        try:
            self.store.log_requests(rows, keep=self.keep)
        except SparkCacheError as exc:
            logger.warning("sparkcache: request log: %d rows not written: %s", len(rows), exc)
            self.counters.add("log_failures")

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to ``timeout`` seconds), stop, close the store."""
        with contextlib.suppress(queue.Full):
            self._rows.put(None, timeout=timeout)
        self._thread.join(timeout)
        self.store.close()
