"""SnapshotStore behaviour: publish, lookup, read, copy-on-write, aliases, ranks, leases."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from sparkcache import InvalidArgument, RequestScope, SnapshotStore
from sparkcache.errors import LeaseError, NotFound, StoreClosed
from tests.locks import hold_write_lock, release

from .helpers import LAYERS, identity, pages_for, tokens


def _expect(store: SnapshotStore, ident, toks, n, rank=0, scope=None):  # type: ignore[no-untyped-def]
    m = store.lookup(ident, toks, scope=scope)
    assert m is not None and m.n_tokens == n
    got = store.read(m, rank)
    want = pages_for(ident, toks[:n], rank)
    assert len(got) == LAYERS
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)
    return m


def test_publish_then_lookup_and_read(store: SnapshotStore) -> None:
    ident = identity()
    toks = tokens(40)
    res = store.publish(ident, 0, toks, pages_for(ident, toks))
    assert res.state == "ready" and res.n_tokens == 40 and res.bytes_written > 0
    _expect(store, ident, toks, 40)
    # a longer prompt restores the stored prefix; a partial last block is ignored
    longer = np.concatenate([toks, tokens(10, seed=9)])
    _expect(store, ident, longer, 40)
    assert store.lookup(ident, tokens(40, seed=5)) is None
    stats = store.stats()
    assert stats["hits"] == 2 and stats["misses"] == 1 and stats["written_tokens"] == 40


def test_publish_twice_is_deduplicated(store: SnapshotStore) -> None:
    ident = identity()
    toks = tokens(16)
    first = store.publish(ident, 0, toks, pages_for(ident, toks))
    second = store.publish(ident, 0, toks, pages_for(ident, toks))
    assert second.deduplicated and second.snapshot_id == first.snapshot_id
    assert second.bytes_written == 0


def test_aliases_restore_a_prefix_of_a_longer_entry(store: SnapshotStore) -> None:
    ident = identity()  # block 4, stride 16 tokens
    toks = tokens(64)
    store.publish(ident, 0, toks, pages_for(ident, toks), breakpoints=[24])
    other = np.concatenate([toks[:40], tokens(24, seed=3)])
    # 40 shared tokens: best is the stride alias at 32 (no payload copied)
    _expect(store, ident, other, 32)
    other2 = np.concatenate([toks[:26], tokens(24, seed=4)])
    _expect(store, ident, other2, 24)  # the explicit breakpoint
    assert len(store.snapshots()) == 1


def test_copy_on_write_stores_only_the_tail(store: SnapshotStore) -> None:
    ident = identity()
    t1 = tokens(32)
    a = store.publish(ident, 0, t1, pages_for(ident, t1))
    t2 = np.concatenate([t1, tokens(16, seed=2)])
    b = store.publish(ident, 0, t2, pages_for(ident, t2, start=32), parent=a.snapshot_id)
    assert b.bytes_written < a.bytes_written
    info = store.snapshot(b.snapshot_id)
    assert info.parent_id == a.snapshot_id and info.start_token == 32 and info.depth == 1
    _expect(store, ident, t2, 48)
    _expect(store, ident, t1, 32)


def test_parent_must_be_a_prefix(store: SnapshotStore) -> None:
    ident = identity()
    t1 = tokens(16)
    a = store.publish(ident, 0, t1, pages_for(ident, t1))
    t2 = tokens(32, seed=8)
    with pytest.raises(InvalidArgument, match="not a prefix"):
        store.publish(ident, 0, t2, pages_for(ident, t2, start=16), parent=a.snapshot_id)
    with pytest.raises(NotFound):
        store.publish(ident, 0, t2, pages_for(ident, t2, start=16), parent=999)
    assert len(store.snapshots()) == 1


def test_long_chains_are_compacted(tmp_path: Path) -> None:
    ident = identity()
    with SnapshotStore(tmp_path / "s", max_chain=3, alias_stride=16) as store:
        toks = tokens(8)
        parent = store.publish(ident, 0, toks, pages_for(ident, toks)).snapshot_id
        depths = []
        for i in range(5):
            nxt = np.concatenate([toks, tokens(8, seed=100 + i)])
            res = store.publish(ident, 0, nxt, pages_for(ident, nxt, start=len(toks)),
                                parent=parent)
            depths.append(store.snapshot(res.snapshot_id).depth)
            toks, parent = nxt, res.snapshot_id
        assert max(depths) < 3 and 0 in depths
        _expect(store, ident, toks, len(toks))


def test_snapshot_needs_every_rank(store: SnapshotStore) -> None:
    ident = identity(world=2)
    toks = tokens(16)
    r0 = store.publish(ident, 0, toks, pages_for(ident, toks, rank=0))
    assert r0.state == "pending"
    assert store.lookup(ident, toks) is None
    assert store.lookup(ident, toks, ranks=[0]) is None  # not ready: never offered
    r1 = store.publish(ident, 1, toks, pages_for(ident, toks, rank=1))
    assert r1.state == "ready" and r1.snapshot_id == r0.snapshot_id
    _expect(store, ident, toks, 16, rank=0)
    _expect(store, ident, toks, 16, rank=1)
    with pytest.raises(InvalidArgument, match="rank"):
        store.publish(ident, 2, toks, pages_for(ident, toks))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_any_dtype_is_stored_as_raw_bytes(store: SnapshotStore, dtype: str) -> None:
    ident = identity(dtype=dtype)
    toks = tokens(8)
    store.publish(ident, 0, toks, pages_for(ident, toks))
    _expect(store, ident, toks, 8)


def test_other_identity_or_scope_never_restores(store: SnapshotStore) -> None:
    ident = identity()
    toks = tokens(16)
    store.publish(ident, 0, toks, pages_for(ident, toks), scope=RequestScope(cache_salt="a"))
    assert store.lookup(ident, toks) is None
    assert store.lookup(ident, toks, scope=RequestScope(cache_salt="b")) is None
    salted = RequestScope(cache_salt="a")
    assert store.lookup(identity(dtype="bfloat16"), toks, scope=salted) is None
    assert store.lookup(identity(block_size=8), toks, scope=salted) is None
    _expect(store, ident, toks, 16, scope=RequestScope(cache_salt="a"))


def test_read_into_preallocated_buffers(store: SnapshotStore) -> None:
    ident = identity()
    toks = tokens(32)
    store.publish(ident, 0, toks, pages_for(ident, toks))
    m = store.lookup(ident, toks)
    assert m is not None
    out = [np.zeros((8, ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
    assert store.read_into(m, 0, out, n_tokens=16) == 4
    want = pages_for(ident, toks[:16])
    assert all(np.array_equal(o[:4], w) for o, w in zip(out, want, strict=True))
    assert not out[0][4:].any()
    with pytest.raises(InvalidArgument):
        store.read_into(m, 0, out[:1])
    with pytest.raises(InvalidArgument):
        store.read_into(m, 0, out, n_tokens=3)


def test_bad_publish_input_leaves_nothing(store: SnapshotStore) -> None:
    ident = identity()
    toks = tokens(16)
    good = pages_for(ident, toks)
    with pytest.raises(InvalidArgument, match="whole blocks"):
        store.publish(ident, 0, toks[:15], good)
    with pytest.raises(InvalidArgument, match="bytes"):
        store.publish(ident, 0, toks, [g[:-1] for g in good])
    with pytest.raises(InvalidArgument):
        store.publish(ident, 0, toks, [])
    with pytest.raises(InvalidArgument):
        store.publish(ident, 0, [-3] * 16, good)
    assert store.snapshots() == []
    assert list(store.backend.list("objects")) == []


def test_leases_and_pins_block_eviction(store: SnapshotStore) -> None:
    ident = identity()
    ids = []
    for i in range(4):
        toks = tokens(8, seed=i)
        ids.append(store.publish(ident, 0, toks, pages_for(ident, toks)).snapshot_id)
    store.pin(ids[0])
    lease = store.acquire_lease(ids[1], ttl=60)
    assert store.evict(count=10) == [ids[2], ids[3]]
    with pytest.raises(LeaseError):
        store.delete(ids[1])
    assert store.release_lease(lease)
    assert not store.release_lease(lease)
    assert store.evict(count=10) == [ids[1]]
    store.pin(ids[0], False)
    assert store.evict(count=10) == [ids[0]]
    assert store.stats()["evictions.lru"] == 4
    assert list(store.backend.list("objects")) == []


def test_expired_leases_block_nothing(tmp_path: Path) -> None:
    now = [1000.0]
    with SnapshotStore(tmp_path / "s", clock=lambda: now[0]) as store:
        ident = identity()
        toks = tokens(8)
        sid = store.publish(ident, 0, toks, pages_for(ident, toks)).snapshot_id
        store.acquire_lease(sid, ttl=5)
        assert store.evict(count=1) == []
        now[0] += 6
        assert store.evict(count=1) == [sid]


def test_parent_evicted_after_child(store: SnapshotStore) -> None:
    ident = identity()
    t1 = tokens(8)
    a = store.publish(ident, 0, t1, pages_for(ident, t1)).snapshot_id
    t2 = np.concatenate([t1, tokens(8, seed=1)])
    b = store.publish(ident, 0, t2, pages_for(ident, t2, start=8), parent=a).snapshot_id
    store.lookup(ident, t1) and store.read(store.lookup(ident, t1), 0)  # type: ignore[arg-type]
    # a is now more recently used than b, but a is b's parent: b goes first
    assert store.evict(count=1) == [b]
    assert store.evict(count=1) == [a]


def test_delete_takes_descendants(store: SnapshotStore) -> None:
    ident = identity()
    t1 = tokens(8)
    a = store.publish(ident, 0, t1, pages_for(ident, t1)).snapshot_id
    t2 = np.concatenate([t1, tokens(8, seed=1)])
    b = store.publish(ident, 0, t2, pages_for(ident, t2, start=8), parent=a).snapshot_id
    assert sorted(store.delete(a)) == sorted([a, b])
    assert store.lookup(ident, t2) is None
    with pytest.raises(NotFound):
        store.delete(a)


def test_closed_store_refuses(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s")
    store.close()
    store.close()
    with pytest.raises(StoreClosed):
        store.lookup(identity(), tokens(8))


def test_settings_are_fixed_at_creation(tmp_path: Path) -> None:
    SnapshotStore(tmp_path / "s", alias_stride=64).close()
    with SnapshotStore(tmp_path / "s") as s:
        assert s.alias_stride == 64
    with pytest.raises(InvalidArgument, match="alias_stride=64"):
        SnapshotStore(tmp_path / "s", alias_stride=32)


def test_opening_a_store_waits_for_no_writer(tmp_path: Path) -> None:
    """A store whose settings are recorded opens while another process writes:
    opening reads them and writes nothing (a busy index is no StoreTimeout)."""
    SnapshotStore(tmp_path / "s", alias_stride=64).close()
    holder = hold_write_lock(tmp_path / "s" / "index.sqlite")
    try:
        start = time.monotonic()
        with SnapshotStore(tmp_path / "s", busy_timeout_ms=2000) as s:
            assert s.alias_stride == 64
            assert s.lookup(identity(), tokens(8)) is None
        assert time.monotonic() - start < 1.5  # it did not wait for the lock
        with pytest.raises(InvalidArgument, match="alias_stride=64"):
            SnapshotStore(tmp_path / "s", alias_stride=32, busy_timeout_ms=100)
    finally:
        release(holder)


def test_reopen_keeps_everything(tmp_path: Path) -> None:
    ident = identity()
    toks = tokens(24)
    with SnapshotStore(tmp_path / "s") as s:
        s.publish(ident, 0, toks, pages_for(ident, toks))
    with SnapshotStore(tmp_path / "s") as s:
        _expect(s, ident, toks, 24)
        assert s.stats()["hits"] == 1

