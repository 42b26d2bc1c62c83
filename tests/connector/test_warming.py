"""The engine's start reads its most recently used snapshots into the page
cache (``warm_mb``): bounded by the memory available, counted, stopped at
shutdown, and the snapshots it read count as warm for the cost model.

The residency of the files themselves is tested in tests/store/test_warm.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sparkcache import SnapshotStore
from sparkcache.backends import MmapBackend
from sparkcache.connector.costs import PREFILL, bucket_of
from sparkcache.connector.jobs import Counters
from sparkcache.connector.scheduler import SchedulerSide
from sparkcache.connector.settings import ConnectorSettings
from sparkcache.connector.warming import Warmer, available_bytes, warm_budget
from sparkcache.connector.worker import WorkerIO
from sparkcache.errors import InvalidArgument

from .helpers import BS, FakePages, Req, identity, prompt, save

P = prompt(100, 31)
GIB = 1 << 30


def test_the_budget_is_at_most_a_quarter_of_the_memory_available() -> None:
    assert warm_budget(GIB, 8 * GIB) == GIB
    assert warm_budget(GIB, 2 * GIB) == GIB // 2
    assert warm_budget(GIB, None) == 0  # unknown: nothing is read
    assert warm_budget(0, 8 * GIB) == 0


def test_the_memory_available_is_the_lower_of_meminfo_and_the_cgroup(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  1000 kB\nMemAvailable:  4096 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("100\n")
    assert available_bytes(str(meminfo), str(cgroup)) == 4096 * 1024  # no cgroup limit
    (cgroup / "memory.max").write_text(f"{1 << 20}\n")
    assert available_bytes(str(meminfo), str(cgroup)) == (1 << 20) - 100
    assert available_bytes(str(tmp_path / "none"), str(cgroup)) == (1 << 20) - 100
    assert available_bytes(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_warm_mb_is_a_setting() -> None:
    assert ConnectorSettings.from_extra_config({"folder": "/x"}).warm_mb == 1024
    assert ConnectorSettings.from_extra_config({"folder": "/x", "warm_mb": 0}).warm_mb == 0
    with pytest.raises(InvalidArgument, match="warm_mb"):
        ConnectorSettings.from_extra_config({"folder": "/x", "warm_mb": -1})


@pytest.fixture
def engine(tmp_path: Path) -> Any:
    """A store holding P's snapshot, and a fresh scheduler side on it (the
    cost model on), started an hour after the snapshot was last used."""
    made: list[Any] = []

    def make(**kwargs: Any) -> tuple[SchedulerSide, Counters]:
        store = SnapshotStore(tmp_path / "s")
        if not made:
            writer = SchedulerSide(store, identity(), Counters(), min_tokens=BS)
            io = WorkerIO(store, identity(), 0, FakePages(64, seed=3), Counters())
            save(writer, io, Req("a", P))
            io.close()
        counters = Counters()
        sched = SchedulerSide(store, identity(), counters, min_tokens=BS, costs=True, **kwargs)
        made.append((sched, store))
        now = time.time()
        sched.costs.clock = lambda: now + 3600  # the snapshot's file is cold by its age
        sched.costs.set(PREFILL, 1e-4, bucket=bucket_of(len(P)))
        sched.costs.set("local_cold", 1e-5)  # a slow disk: a cold restore does not pay
        return sched, counters

    yield make
    for sched, store in made:
        sched.close()
        store.close()


def test_a_start_reads_the_snapshots_and_the_cost_model_counts_them_warm(engine: Any) -> None:
    sched, counters = engine()
    assert sched.matched_tokens(Req("cold", P), 0) == (0, False)  # too slow from disk
    sched.start_warm(GIB)
    assert sched.warmer is not None and sched.warmer.join(30)
    result = sched.warmer.result
    assert result is not None and len(result.snapshots) == 1
    (snapshot,) = result.snapshots
    nbytes = sum(s.nbytes for s in sched.store.catalog.segments(snapshot))
    assert nbytes > 0 and result.nbytes == nbytes
    assert counters.take()["warmed_bytes"] == nbytes
    # Read into the page cache just now: warm, a source never measured, so tried.
    assert sched.matched_tokens(Req("warm", P), 0) == (99, True)


def test_nothing_is_read_when_restores_are_off_or_the_budget_is_zero(engine: Any) -> None:
    sched, _counters = engine(restore=False)
    sched.start_warm(GIB)
    assert sched.warmer is None
    sched, _counters = engine()
    sched.start_warm(0)
    assert sched.warmer is None


def test_close_stops_the_read(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    sched, counters = engine()
    reading = threading.Event()

    def slow_warm(self: MmapBackend, key: str, buffer: Any, stop: Any = None) -> int:
        reading.set()
        deadline = time.monotonic() + 30
        while not stop() and time.monotonic() < deadline:
            time.sleep(0.01)
        return 0

    monkeypatch.setattr(MmapBackend, "warm", slow_warm)
    warmer = Warmer(sched.store.root, identity(), GIB, counters)
    assert reading.wait(10)
    started = time.monotonic()
    warmer.close()
    assert warmer.join(0) and time.monotonic() - started < 5
    assert warmer.result is not None and warmer.result.nbytes == 0


def test_a_store_that_cannot_be_read_is_logged_and_nothing_else(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "index.sqlite").write_bytes(b"not a database" * 100)
    counters = Counters()
    warmer = Warmer(folder, identity(), GIB, counters)
    assert warmer.join(30)
    assert warmer.result is None and "warmed_bytes" not in counters.take()
    assert "could not read its snapshots into the page cache" in caplog.text
