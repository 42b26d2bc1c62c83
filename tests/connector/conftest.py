from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkcache import SnapshotStore
from sparkcache.connector.jobs import Counters
from sparkcache.connector.scheduler import SchedulerSide
from sparkcache.connector.worker import WorkerIO

from .helpers import BS, FakePages, identity

OneRank = tuple[SnapshotStore, SchedulerSide, WorkerIO, Counters]


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[OneRank]:
    """A store, a scheduler side, one worker over 64 blocks; both sides share the counters."""
    ident = identity()
    store = SnapshotStore(tmp_path / "s")
    counters = Counters()
    sched = SchedulerSide(store, ident, counters, min_tokens=BS, load_async=True)
    io = WorkerIO(store, ident, 0, FakePages(64, seed=3), counters)
    yield store, sched, io, counters
    io.close()
    store.close()
