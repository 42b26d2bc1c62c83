"""A storage that looks wrong changes nothing, and a quarantine can be undone.

Seen by a tester: a store opened with a mistyped storage found every file
"missing", and `check --fix` quarantined every snapshot (boundary rows deleted,
no undo).  Now the bulk operations look for the expected objects first, and
``requeue`` gives back every quarantined snapshot whose files verify again.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from sparkcache import SnapshotStore
from sparkcache.errors import StorageMismatch
from sparkcache.identity import RequestScope
from sparkcache.verification import requeue, verify

from .helpers import identity, pages_for, tokens


def _filled(store: SnapshotStore) -> tuple[np.ndarray, int, int]:
    ident, toks = identity(), tokens(48)
    root = store.publish(ident, 0, toks[:32], pages_for(ident, toks[:32]),
                         breakpoints=[12]).snapshot_id
    child = store.publish(ident, 0, toks, pages_for(ident, toks, start=32),
                          parent=root).snapshot_id
    return toks, root, child


def test_a_storage_holding_none_of_the_objects_changes_nothing(store: SnapshotStore) -> None:
    _filled(store)
    objects = store.root / "objects"
    shutil.move(objects, store.root / "elsewhere")  # as an unmounted disk would look
    before = [(s.id, s.state) for s in store.snapshots()]
    for run in (lambda: store.check(fix=True), lambda: store.check(),
                lambda: verify(store._core)):
        with pytest.raises(StorageMismatch, match="storage looks wrong"):
            run()
    assert [(s.id, s.state) for s in store.snapshots()] == before
    shutil.move(store.root / "elsewhere", objects)
    assert store.check().clean


def test_requeue_gives_back_what_verifies_again(store: SnapshotStore, tmp_path: Path) -> None:
    toks, root, child = _filled(store)
    ident = identity()
    other = store.publish(ident, 0, tokens(16, seed=9), pages_for(ident, tokens(16, seed=9)))
    (root_key,) = [g.object_key for g in _segments(store, root)]
    shutil.move(store.root / root_key, tmp_path / "away")  # one file gone for a while
    report = store.check(fix=True)
    assert report.missing_files == [root]
    assert {s.id: s.state for s in store.snapshots()} == {
        root: "quarantined", child: "quarantined", other.snapshot_id: "ready"}
    assert store.lookup(ident, toks) is None

    assert requeue(store._core, store.alias_stride).requeued == []  # still gone: stays
    shutil.move(tmp_path / "away", store.root / root_key)
    done = requeue(store._core, store.alias_stride)
    assert done.requeued == [root, child] and done.still_quarantined == []
    assert all(s.state == "ready" and s.reason is None for s in store.snapshots())
    match = store.lookup(ident, toks)
    assert match is not None and match.snapshot_id == child and match.n_tokens == 48
    assert len(store.read(match, 0)) == 2
    near = np.concatenate([toks[:12], tokens(8, seed=5)])  # shares only the breakpoint prefix
    alias = store.lookup(ident, near)
    assert alias is not None and (alias.snapshot_id, alias.n_tokens) == (root, 12)
    assert store.stats()["requeued"] == 2
    assert store.check().clean


def test_requeue_keeps_what_is_still_damaged(store: SnapshotStore) -> None:
    _toks, root, child = _filled(store)
    (key,) = [g.object_key for g in _segments(store, child)]
    path = store.root / key
    data = bytearray(path.read_bytes())
    data[-300] ^= 0x01
    path.write_bytes(bytes(data))
    assert [p.snapshot_id for p in verify(store._core).corrupt] == [child]
    done = requeue(store._core, store.alias_stride)
    assert done.requeued == [] and [p.reason for p in done.still_quarantined] == ["digest"]
    assert store.snapshot(root).state == "ready"


def test_requeue_in_a_request_scope(store: SnapshotStore) -> None:
    ident, toks = identity(), tokens(16)
    scope = RequestScope(cache_salt="salt")
    sid = store.publish(ident, 0, toks, pages_for(ident, toks), scope=scope).snapshot_id
    store.quarantine(sid, "missing")
    assert requeue(store._core, store.alias_stride).requeued == [sid]
    assert store.lookup(ident, toks) is None  # another scope: a miss, as before
    match = store.lookup(ident, toks, scope=scope)
    assert match is not None and match.snapshot_id == sid


def _segments(store: SnapshotStore, snapshot_id: int) -> list:  # type: ignore[type-arg]
    with store._core.read() as conn:
        return store._core.segments(conn, snapshot_id)
