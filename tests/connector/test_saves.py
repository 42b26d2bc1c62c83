"""Saves without vLLM: a finished request's blocks are copied out by the
worker's saver thread, reported sent, and published from host memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sparkcache import SnapshotStore
from sparkcache.connector.jobs import Counters, SaveJob
from sparkcache.connector.worker import WorkerIO

from .helpers import BS, FakePages, Req, identity, prompt, save


def test_a_grown_context_publishes_only_its_tail(one_rank: Any) -> None:
    store, sched, io, _counters = one_rank
    p = prompt(95, 6)
    first = save(sched, io, Req("a", p))
    assert len(first.token_ids) == 96  # 95 + 15 computed tokens, whole blocks
    (snap,) = store.snapshots()
    turn2 = Req("b", list(first.token_ids) + prompt(40, 7))
    second = save(sched, io, turn2)
    assert second.parent == snap.id
    assert second.blocks[0][0] == snap.n_tokens // BS  # only the tail's blocks
    tail = store.snapshot(max(s.id for s in store.snapshots()))
    assert tail.parent_id == snap.id and tail.start_token == snap.n_tokens


def test_a_save_over_the_memory_bound_is_dropped_and_reported_sent(tmp_path: Path) -> None:
    """Serving never waits for the disk: the blocks are freed at once, a future miss."""
    with SnapshotStore(tmp_path / "s") as store:
        counters = Counters()
        io = WorkerIO(store, identity(), 0, FakePages(8, 1), counters, max_pending_bytes=0)
        io.submit_save(SaveJob("s", np.zeros(BS, np.uint32), ((0,),), None, None, ()))
        assert io.poll()[0] == {"s"}
        assert counters.take()["saves_dropped"] == 1
        assert io.flush() and store.snapshots() == []
        io.close()
