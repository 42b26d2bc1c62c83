"""An engine's start reads its most recently used snapshots into the page cache.

The first restores of a restarted engine are the ones a restart exists for.
When their snapshots' pages have left the OS page cache meanwhile (a reboot,
memory pressure, a kernel's proactive reclaim of idle pages), each such
restore reads the disk while its request waits: 2.4-3.7x a warm restore
here (docs/benchmarks.md).  So when the scheduler side starts, a thread of the
lowest priority reads the files of this model's most recently used
snapshots (its own sharding's and those of engines of another TP size that
it restores from), newest use first, up to ``warm_mb`` and never more than a quarter
of the memory the system reports available (:func:`warm_budget`), while the
engine finishes its start and waits for requests.  It reads; it never
verifies or keeps a byte (every restore still verifies what it copies), and
a file it cannot read is skipped.  The snapshots it read whole count as warm
for the cost model (:meth:`~sparkcache.connector.costs.CostPlanner.warmed`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from sparkcache.connector.jobs import Counters
from sparkcache.connector.resharded import restorable_siblings
from sparkcache.cpus import lower_priority
from sparkcache.errors import SparkCacheError
from sparkcache.identity import ModelIdentity
from sparkcache.reader import Warmed
from sparkcache.store import SnapshotStore

__all__ = ["MEMORY_SHARE", "Warmer", "available_bytes", "warm_budget"]

logger = logging.getLogger("vllm.sparkcache")

#: At most this share of the memory available is read into the page cache.
MEMORY_SHARE = 0.25


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available(root: str = "/sys/fs/cgroup") -> int | None:
    """What the process's cgroup (v2) may still use, or None without a limit."""
    try:
        limit = Path(root, "memory.max").read_text(encoding="ascii").strip()
        if limit == "max":
            return None
        used = Path(root, "memory.current").read_text(encoding="ascii").strip()
        return max(0, int(limit) - int(used))
    except (OSError, ValueError):
        return None


def available_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """The memory the system reports available to this process (the lower of
    ``MemAvailable`` and its cgroup's room), or None where neither is known."""
    known = [n for n in (_meminfo_available(meminfo), _cgroup_available(cgroup)) if n is not None]
    return min(known) if known else None


def warm_budget(max_bytes: int, available: int | None) -> int:
    """The bytes to read: ``max_bytes``, at most :data:`MEMORY_SHARE` of
    ``available`` (None: unknown, nothing is read)."""
    return 0 if available is None else min(max_bytes, int(available * MEMORY_SHARE))


class Warmer:
    """One engine start's read of its snapshots into the page cache, on a
    thread of its own (its own index connection: the scheduler's lookups never
    wait for it).  :meth:`close` stops it between chunks."""

    def __init__(self, folder: str | Path, identity: ModelIdentity, max_bytes: int,
                 counters: Counters, on_done: Callable[[Warmed], None] | None = None, *,
                 total_kv_heads: int = 0) -> None:
        self.folder, self.identity, self.max_bytes = folder, identity, max_bytes
        #: Given (> 0): the other shardings' snapshots of the same KV that this
        #: engine restores from are read too.
        self.total_kv_heads = total_kv_heads
        self.counters, self.on_done = counters, on_done
        #: What was read, once the thread ended (None before, or if it failed).
        self.result: Warmed | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkcache-warm", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lower_priority()
        budget = warm_budget(self.max_bytes, available_bytes())
        if budget <= 0:
            return
        try:
            with SnapshotStore(self.folder) as store:
                others = restorable_siblings(store, self.identity, self.total_kv_heads,
                                             warn=False)
                result = store.warm(self.identity, budget, self._stop.is_set, others=others)
        except (SparkCacheError, OSError) as exc:
            logger.warning("sparkcache could not read its snapshots into the page cache "
                           "(restores read them from disk): %s", exc)
            return
        except Exception:  # never crash the engine's start over a read-ahead
            logger.exception("sparkcache's read into the page cache failed (restores read "
                             "from disk)")
            return
        self.result = result
        self.counters.add("warmed_bytes", result.nbytes)
        if result.files:
            logger.info("sparkcache read %d MB of %d snapshots into the page cache in %.2f s",
                        result.nbytes >> 20, len(result.snapshots), result.seconds)
        if self.on_done is not None:
            self.on_done(result)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the read to end; whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the read (between chunks) and wait for the thread."""
        self._stop.set()
        self._thread.join(timeout)
