"""sparkcache.core: the narrow core's transactions, counters, after-commit deletions,
named rows and the one lease liveness rule."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from pathlib import Path
from typing import Any

import apsw
import pytest

from sparkcache import SnapshotStore
from sparkcache.core import lease_blocks, model_folder
from sparkcache.holders import this_holder
from sparkcache.index import queries as q

from .helpers import identity, pages_for, tokens


def test_counts_are_saved_by_the_next_write(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path / "s") as store, SnapshotStore(tmp_path / "s") as other:
        store.lookup(identity(), tokens(16))  # no model yet: nothing counted
        res = store.publish(identity(), 0, tokens(16), pages_for(identity(), tokens(16)))
        model_id = store.snapshot(res.snapshot_id).model_id
        store._core.count(model_id, "test.thing", 2)
        assert "test.thing" not in other._core.counter_totals()  # only in this process
        with store._core.write():
            pass
        assert other._core.counter_totals()["test.thing"] == 2
        assert other._core.counter_totals(model_id + 1) == {}


def _hold_the_write_lock(folder: str, held: Any, release: Any) -> None:
    with SnapshotStore(folder) as holder, holder._core.write():
        held.set()
        release.wait(30)


def test_a_hit_counted_while_another_process_writes_is_saved_soon(tmp_path: Path) -> None:
    """A verified read's counts are saved at once if the write lock is free, else
    retried on a timer: a process that writes nothing else (a worker that only
    restores) does not keep its hits until it closes."""
    folder = tmp_path / "s"

    def saved() -> dict[str, int]:  # what the index holds, read without writing
        conn = apsw.Connection(str(folder / "index.sqlite"), flags=apsw.SQLITE_OPEN_READONLY)
        try:
            return {str(name): int(value) for _m, name, value in conn.execute(q.COUNTERS)}
        finally:
            conn.close()

    with SnapshotStore(folder) as store:
        res = store.publish(identity(), 0, tokens(16), pages_for(identity(), tokens(16)))
        model_id = store.snapshot(res.snapshot_id).model_id
        ctx = mp.get_context("spawn")
        held, release = ctx.Event(), ctx.Event()
        holder = ctx.Process(target=_hold_the_write_lock, args=(str(folder), held, release))
        holder.start()
        try:
            assert held.wait(60)
            store._core.record_use([res.snapshot_id], model_id, {"test.hits": 1})
            time.sleep(1.0)  # the first retry, still locked out
            assert "test.hits" not in saved()
        finally:
            release.set()
            holder.join(30)
        deadline = time.monotonic() + 10
        while "test.hits" not in saved() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert saved()["test.hits"] == 1  # with no write of the store's own
        assert store.snapshot(res.snapshot_id).use_count == 1


def test_files_are_deleted_after_commit_never_on_rollback(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path / "s") as store:
        core = store._core
        for key in ("objects/a", "objects/b"):
            core.backend.put(key, [b"x"])
        with pytest.raises(RuntimeError), core.write():
            core.delete_after_commit(["objects/a"])
            raise RuntimeError("rolled back")
        assert core.backend.exists("objects/a")
        with core.write():
            core.delete_after_commit(["objects/a"])
            assert core.backend.exists("objects/a")  # not before the commit
        assert not core.backend.exists("objects/a") and core.backend.exists("objects/b")
        with pytest.raises(RuntimeError, match="inside write"):
            core.delete_after_commit(["objects/b"])


def test_rows_come_as_named_types(tmp_path: Path) -> None:
    ident, toks = identity(), tokens(16)
    with SnapshotStore(tmp_path / "s") as store:
        res = store.publish(ident, 0, toks, pages_for(ident, toks))
        store.pin(res.snapshot_id)
        with store._core.read() as conn:
            info = store._core.snapshot(conn, res.snapshot_id)
            (segment,) = store._core.segments(conn, res.snapshot_id)
            (link,) = store._core.chain(conn, res.snapshot_id)
            assert info is not None
            model = store._core.model(conn, info.model_id)
            assert store._core.usage(conn, info.model_id) == (1, info.nbytes)
            assert store._core.usage(conn) == (1, info.nbytes)
            assert store._core.snapshot(conn, res.snapshot_id + 1) is None
        assert info.pinned is True and info.state == "ready" and info.n_tokens == 16
        assert segment.rank == 0 and segment.object_key.startswith(model_folder(ident) + "/")
        assert (link.id, link.start, link.end, link.state) == (res.snapshot_id, 0, 16, "ready")
        assert model is not None and model.identity() == ident and model.name == ident.model


def _exit() -> None:
    return None


def test_a_lease_blocks_while_unexpired_and_its_holder_lives() -> None:
    now = 1000.0
    me = this_holder()
    assert lease_blocks(me, now + 1, now)
    assert not lease_blocks(me, now, now)  # expired
    child = mp.get_context("fork").Process(target=_exit)
    child.start()
    child.join()
    dead = f"{socket.gethostname()}/{child.pid}/1"
    assert not lease_blocks(dead, now + 60, now)  # a dead process on this host
    assert lease_blocks(f"elsewhere/{child.pid}/1", now + 60, now)  # unknown: it may live


def test_leased_reads_the_lease_rows(tmp_path: Path) -> None:
    ident, toks = identity(), tokens(16)
    with SnapshotStore(tmp_path / "s") as store:
        sid = store.publish(ident, 0, toks, pages_for(ident, toks)).snapshot_id
        lease = store.acquire_lease(sid, kind="read", ttl=60)
        now = store._core.clock()
        with store._core.write() as conn:
            assert store._core.leased(conn, sid, now) == [this_holder()]
            assert store._core.leased(conn, sid, now, kind="export") == []
            assert store._core.leased(conn, sid, now + 120) == []  # expired by then
            conn.execute(q.DELETE_LEASE, (lease,))
            assert store._core.leases(conn, sid) == []
