"""sparkcache.core: the narrow core's transactions, counters, after-commit deletions,
named rows and the one lease liveness rule."""

from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path

import pytest

from sparkcache import SnapshotStore
from sparkcache.core import lease_blocks, model_folder
from sparkcache.holders import this_holder
from sparkcache.index import queries as q

from .store.helpers import identity, pages_for, tokens


def test_counts_are_saved_by_the_next_write(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path / "s") as store, SnapshotStore(tmp_path / "s") as other:
        store.lookup(identity(), tokens(16))  # no model yet: nothing counted
        res = store.publish(identity(), 0, tokens(16), pages_for(identity(), tokens(16)))
        model_id = store.snapshot(res.snapshot_id).model_id
        store.core.count(model_id, "test.thing", 2)
        assert "test.thing" not in other.core.counter_totals()  # only in this process
        with store.core.write():
            pass
        assert other.core.counter_totals()["test.thing"] == 2
        assert other.core.counter_totals(model_id + 1) == {}


def test_files_are_deleted_after_commit_never_on_rollback(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path / "s") as store:
        core = store.core
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
        with store.core.read() as conn:
            info = store.core.snapshot(conn, res.snapshot_id)
            (segment,) = store.core.segments(conn, res.snapshot_id)
            (link,) = store.core.chain(conn, res.snapshot_id)
            assert info is not None
            model = store.core.model(conn, info.model_id)
            assert store.core.usage(conn, info.model_id) == (1, info.nbytes)
            assert store.core.usage(conn) == (1, info.nbytes)
            assert store.core.snapshot(conn, res.snapshot_id + 1) is None
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
        now = store.core.clock()
        with store.core.write() as conn:
            assert store.core.leased(conn, sid, now) == [this_holder()]
            assert store.core.leased(conn, sid, now, kind="export") == []
            assert store.core.leased(conn, sid, now + 120) == []  # expired by then
            conn.execute(q.DELETE_LEASE, (lease,))
            assert store.core.leases(conn, sid) == []
