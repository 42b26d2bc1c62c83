"""Stuck publishes are reclaimed: a rank that never publishes its half of a
copy-on-write child does not pin it, or its parent, for ever; a writer is known
by its pid *and* its start time, so a reused pid keeps nothing alive."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkcache import InvalidArgument, SnapshotStore
from sparkcache.holders import start_time
from sparkcache.maintenance import PENDING_GRACE_SECONDS
from sparkcache.retention import Retention, RetentionSettings

from .helpers import Clock, identity, pages_for, tokens


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[SnapshotStore]:
    settings = RetentionSettings(folder=tmp_path, min_tokens=0, min_free_mb=0, max_age_hours=0)
    retention = Retention(settings, disk_usage=lambda backend: None, ram_bytes=lambda: 2**36)
    with SnapshotStore(tmp_path / "s", alias_stride=16, clock=clock,
                       retention=retention) as s:
        yield s


def _half_published_child(store: SnapshotStore) -> tuple[int, int]:
    """tp=2: both ranks publish a root; only rank 0 publishes the child."""
    ident, toks = identity(world=2), tokens(32)
    for rank in (0, 1):
        root = store.publish(ident, rank, toks[:16], pages_for(ident, toks[:16], rank)).snapshot_id
    child = store.publish(ident, 0, toks, pages_for(ident, toks, 0, start=16), parent=root)
    assert child.state == "pending"
    return root, child.snapshot_id


def test_the_sweep_reclaims_a_child_one_rank_never_finished(store: SnapshotStore,
                                                            clock: Clock) -> None:
    root, child = _half_published_child(store)
    assert store.sweep().count == 0  # the other rank may still come
    assert store.evict(count=None) == []  # the pending child pins its parent
    clock.now += PENDING_GRACE_SECONDS + 1
    report = store.sweep()
    assert report.evicted.get("abandoned") == [child]
    assert [s.id for s in store.snapshots()] == [root]
    assert store.evict(count=None) == [root]  # a leaf again
    assert list(store.backend.list("objects")) == []  # the child's file went too
    assert store.check().clean


def test_a_republish_with_another_parent_replaces_an_abandoned_child(
        store: SnapshotStore, clock: Clock) -> None:
    _root, child = _half_published_child(store)
    ident, toks = identity(world=2), tokens(32)
    again = store.publish(ident, 0, toks, pages_for(ident, toks, 0))  # without a parent
    assert again.deduplicated and again.snapshot_id == child  # rank 0's bytes are there
    with pytest.raises(InvalidArgument, match="same parent"):  # rank 1 of it may still come
        store.publish(ident, 1, toks, pages_for(ident, toks, 1))
    clock.now += PENDING_GRACE_SECONDS + 1  # it did not: the publish was abandoned
    fresh = [store.publish(ident, rank, toks, pages_for(ident, toks, rank)) for rank in (0, 1)]
    assert fresh[0].snapshot_id == fresh[1].snapshot_id != child
    assert fresh[1].state == "ready" and store.snapshot(fresh[0].snapshot_id).parent_id is None
    match = store.lookup(ident, toks)
    assert match is not None and match.n_tokens == 32
    assert all(len(store.read(match, rank)) == 2 for rank in (0, 1))
    assert store.check().clean


def test_a_temp_file_whose_pid_was_reused_is_debris(store: SnapshotStore) -> None:
    ident, toks = identity(), tokens(16)
    store.publish(ident, 0, toks, pages_for(ident, toks))
    (key,) = store.backend.list("objects")
    pid = os.getpid()  # alive, as a reused pid is
    stale = f"{key}.tmp.{pid}-{int(start_time(pid)) + 12345}.0123abcd"
    live = f"{key}.tmp.{pid}-{start_time(pid)}.89abcdef"
    store.backend.put(stale, [b"debris"])
    store.backend.put(live, [b"being written"])
    report = store.check(fix=True)
    assert report.orphan_files == [stale]  # one pass: its writer is another process
    assert store.backend.exists(live) and not store.backend.exists(stale)
