"""CPU placement of sparkcache's background threads.

vLLM's CPU backend pins each OpenMP thread of the forward to one core, the
worker's main thread included (``VLLM_CPU_OMP_THREADS_BIND``).  A thread
inherits the CPU mask of the thread that starts it, so sparkcache's loader,
saver and sweeper - started from that main thread - would all share its one
core: two read threads then run at the speed of one, and every save competes
with the forward on that core alone.  :func:`widen_affinity` lets the calling
thread run on every CPU that any thread of this process may use (the cores of
the forward, plus whatever the process had before it was pinned), which is
what a background thread of this process should get.

A restore's read threads are placed the other way round (:func:`pinned_to`):
while a worker step runs, vLLM's engine core busy-waits on one core, giving
way (``sched_yield``) only to threads queued on that same core.  Two unpinned
read threads may then share one core while the spinner keeps the other;
each pinned to its own core of the rank's set - as vLLM pins its forward's
threads - they get both (docs/connector-notes.md).  Cores the forward is not
bound to are taken first (:func:`read_cpus`).

Work that can wait - writing a save's pages to disk - runs on a thread of the
lowest scheduling priority (:func:`lower_priority`: nice 19, per thread on
Linux), so that the forward's threads, the next request's prefill among
them, take the cores first and the write fills the time they leave.

A verified read sizes its parts by the CPU (:func:`cache_bytes`, :func:`vendor`):
each part is hashed while it is still in the core's cache.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LOWEST_PRIORITY", "cache_bytes", "lower_priority", "pinned_to", "process_cpus",
           "read_cpus", "vendor", "widen_affinity"]

#: Where Linux describes CPU 0's caches, one ``index*`` folder per cache.
CACHE_FOLDER = "/sys/devices/system/cpu/cpu0/cache"
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

#: The nice value of a thread that should run only in the time the engine leaves.
LOWEST_PRIORITY = 19


def cache_bytes(level: int, folder: str = CACHE_FOLDER) -> int | None:
    """The size of one core's level-``level`` data (or unified) cache, from
    ``folder`` (Linux's sysfs); None where it does not say."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return None
    for name in names:
        if not name.startswith("index"):
            continue
        try:
            with open(os.path.join(folder, name, "level")) as f:
                if int(f.read()) != level:
                    continue
            with open(os.path.join(folder, name, "type")) as f:
                if f.read().strip() not in ("Data", "Unified"):
                    continue
            with open(os.path.join(folder, name, "size")) as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        unit = _SIZE_UNITS.get(size[-1:], 1)
        digits = size[:-1] if size[-1:] in _SIZE_UNITS else size
        if digits.isdigit() and int(digits) > 0:
            return int(digits) * unit
    return None


def vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's vendor as Linux names it (``GenuineIntel``, ``AuthenticAMD``);
    empty where unknown."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    return value.strip()
    except OSError:
        pass
    return ""


def _thread_masks() -> Iterator[set[int]]:
    """The CPU mask of each thread of this process (none where not Linux)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is None:  # not Linux: no per-thread masks
        return
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return
    for tid in tids:
        try:
            yield getaffinity(int(tid))
        except (OSError, ValueError):  # the thread ended meanwhile
            continue


def process_cpus() -> set[int]:
    """The union of the CPU masks of this process's threads (empty if unknown)."""
    cpus: set[int] = set()
    for mask in _thread_masks():
        cpus |= mask
    return cpus


def read_cpus() -> list[int]:
    """CPUs for a restore's read threads, in the order to hand them out: first
    those of :func:`process_cpus` that no thread is pinned to alone (vLLM binds
    each OpenMP thread of the forward to one core; cores left out of
    ``VLLM_CPU_OMP_THREADS_BIND`` come first), then the pinned ones."""
    cpus: set[int] = set()
    bound: set[int] = set()
    for mask in _thread_masks():
        cpus |= mask
        if len(mask) == 1:
            bound |= mask
    return sorted(cpus - bound) + sorted(cpus & bound)


def widen_affinity() -> set[int] | None:
    """Let the calling thread run on :func:`process_cpus`; its new mask, or None
    when nothing changed (already that wide, or the platform cannot tell)."""
    cpus = process_cpus()
    if not cpus:
        return None
    try:
        if cpus <= os.sched_getaffinity(0):
            return None
        os.sched_setaffinity(0, cpus)
        return os.sched_getaffinity(0)
    except OSError:  # a CPU went offline meanwhile, or a seccomp policy forbids it
        return None


@contextmanager
def pinned_to(cpu: int | None) -> Iterator[bool]:
    """Run the calling thread on ``cpu`` alone within the block, then give it
    back its previous mask.  Yields whether it is pinned: not for ``None``, nor
    where the platform or a policy refuses (the block then runs unpinned)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    before: set[int] | None = None
    if cpu is not None and getaffinity is not None:
        try:
            before = getaffinity(0)
            os.sched_setaffinity(0, {cpu})
        except OSError:  # the CPU went offline, or a seccomp policy forbids it
            before = None
    if before is None:
        yield False
        return
    try:
        yield True
    finally:
        try:
            os.sched_setaffinity(0, before)
        except OSError:  # a CPU of the old mask went offline: take what is left
            widen_affinity()


def lower_priority(nice: int = LOWEST_PRIORITY) -> bool:
    """Give the calling thread the scheduling priority ``nice`` (Linux: the
    thread alone; an unprivileged process may always lower its priority, never
    raise it back).  Whether it was set; False where the platform has no
    per-thread priority or refuses (the thread then keeps its priority)."""
    native = getattr(os, "setpriority", None)
    if native is None or not os.path.isdir("/proc/self/task"):  # not Linux
        return False
    try:
        native(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        return False
    return True
