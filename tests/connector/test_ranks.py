"""Tensor parallelism: every rank publishes its own segment, the scheduler offers
only snapshots that every rank of the topology can restore, each rank restores
its own bytes.

Two WorkerIO instances stand in for two workers: on the 2-core CPU machine a
vLLM engine with TP 2 would need two CPU workers bound to one core each
besides the engine core and the test process, and TP on vLLM's CPU backend is
not part of this project's supported set yet.  The rank logic lives in the
store and in WorkerIO/SchedulerSide, which run here exactly as in vLLM's
processes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sparkcache import SnapshotStore
from sparkcache.connector import restores
from sparkcache.connector.jobs import Counters
from sparkcache.connector.scheduler import SchedulerSide
from sparkcache.connector.worker import WorkerIO

from .helpers import BS, LAYERS, PAGE_NBYTES, FakePages, Req, blocks_of, finished, identity, prompt


def test_two_ranks_publish_restore_and_availability(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ident = identity(tp_size=2)
    store = SnapshotStore(tmp_path / "s")
    sched = SchedulerSide(store, ident, Counters(), min_tokens=BS, load_async=True)
    kv = [FakePages(16, seed=rank) for rank in (0, 1)]
    workers = [WorkerIO(store, ident, rank, kv[rank], Counters()) for rank in (0, 1)]
    p = prompt(100, 1)
    try:
        held, _ = sched.finished(finished(Req("a", p)), blocks_of(Req("a", p, prompt(16, 999))))
        assert held  # blocks kept until every worker copied them out
        _loads, (save,) = sched.take_jobs()
        assert len(save.token_ids) == 112 and save.blocks == (tuple(range(7)),)
        workers[0].submit_save(save)
        assert workers[0].flush()
        assert workers[0].poll()[0] == {"a"}
        sched.on_output((), (), None, workers[0].take_ended())
        # Rank 1 has not published: the snapshot is not offered to anyone; a
        # request sharing it waits for the save in flight (and hurries it) ...
        assert sched.matched_tokens(Req("b", p), 0) == (None, False)
        assert sched.take_hurry() == ["a"]
        # ... for WRITE_WAIT_SECONDS at most, then computes.
        with monkeypatch.context() as patch:
            patch.setattr(restores, "WRITE_WAIT_SECONDS", 0.0)
            assert sched.matched_tokens(Req("b", p), 0) == (0, False)
        workers[1].submit_save(save)
        assert workers[1].flush()
        sched.on_output((), (), None, workers[1].take_ended())
        # Every rank ready: all but the prompt's last token are offered, async: the
        # prompt-end alias (96 tokens) and the stored block holding tokens 96..99.
        req = Req("c", p)
        assert sched.matched_tokens(req, 0) == (99, True)
        sched.after_alloc(req, [9, 10, 11, 12, 13, 14, 15], 99)
        (load,), _ = sched.take_jobs()
        fresh = [FakePages(16, seed=7 + rank) for rank in (0, 1)]
        for rank in (0, 1):
            io = WorkerIO(store, ident, rank, fresh[rank], Counters())
            io.submit_load(load)
            assert io.flush()
            assert io.poll()[1] == {"c"} and not io.take_failed_blocks()
            # Each rank restored its own bytes into the blocks vLLM allocated.
            np.testing.assert_array_equal(fresh[rank].arr[:, 9:16], kv[rank].arr[:, 0:7])
            io.close()
    finally:
        for w in workers:
            w.close()
        store.close()


def test_a_snapshot_missing_one_rank_is_not_offered_after_a_restart(tmp_path: Path) -> None:
    """Only rank 0 ever published (rank 1 crashed): a new scheduler offers nothing."""
    ident = identity(tp_size=2)
    p = prompt(64, 2)
    with SnapshotStore(tmp_path / "s") as store:
        store.publish(ident, 0, p, [np.zeros(4 * PAGE_NBYTES, np.uint8)] * LAYERS)
        sched = SchedulerSide(store, ident, Counters(), load_async=True)
        assert sched.matched_tokens(Req("x", [*p, 5]), 0) == (0, False)
        store.publish(ident, 1, p, [np.ones(4 * PAGE_NBYTES, np.uint8)] * LAYERS)
        assert sched.matched_tokens(Req("y", [*p, 5]), 0) == (64, True)
