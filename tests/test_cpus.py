"""Background threads are not stuck on the one core of the thread that starts them.

vLLM's CPU worker pins its main thread to one core; a thread inherits its
creator's mask, so without :func:`sparkcache.cpus.widen_affinity` the loader,
its read helpers, the saver and the sweeper would all share that core (and
steal it from the forward's first OpenMP thread).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkcache import SnapshotStore
from sparkcache.connector.worker import Counters, WorkerIO
from sparkcache.cpus import process_cpus, widen_affinity
from sparkcache.retention import Retention, RetentionSettings, Sweeper

from .store.helpers import identity

ALL: set[int] = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
pytestmark = pytest.mark.skipif(len(ALL) < 2, reason="needs Linux and two CPUs to pin one")


@pytest.fixture
def pinned() -> Iterator[int]:
    """This thread pinned to one CPU, as vLLM pins its worker's main thread;
    a thread started before that keeps the process's full mask."""
    stop = threading.Event()
    keeper = threading.Thread(target=stop.wait, daemon=True)
    keeper.start()
    first = min(ALL)
    os.sched_setaffinity(0, {first})
    try:
        yield first
    finally:
        os.sched_setaffinity(0, ALL)
        stop.set()
        keeper.join()


def _wait_for_mask(thread: threading.Thread, want: set[int]) -> set[int]:
    assert thread.native_id is not None
    deadline = time.monotonic() + 5
    while (mask := os.sched_getaffinity(thread.native_id)) != want:
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return mask


def test_a_thread_started_from_a_pinned_thread_is_widened(pinned: int) -> None:
    seen: dict[str, object] = {}

    def body() -> None:
        seen["inherited"] = os.sched_getaffinity(0)
        seen["widened"] = widen_affinity()
        seen["again"] = widen_affinity()

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen["inherited"] == {pinned}  # what every sparkcache thread got before
    assert seen["widened"] == ALL == process_cpus()
    assert seen["again"] is None  # already as wide as the process
    assert os.sched_getaffinity(0) == {pinned}  # the pinned thread itself is left alone


def test_worker_and_sweeper_threads_run_on_every_cpu(pinned: int, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store",
                          retention=Retention(RetentionSettings(sweep_seconds=3600)))
    io = WorkerIO(store, identity(), 0, None, Counters())
    assert store.retention is not None
    sweeper = Sweeper(store, store.retention).start()
    try:
        threads = [*io._threads, sweeper._thread]
        masks = {t.name: _wait_for_mask(t, ALL) for t in threads if t is not None}
        assert len(masks) == 4
        assert all(mask == ALL for mask in masks.values()), masks
    finally:
        sweeper.stop()
        io.close()
        store.close()
