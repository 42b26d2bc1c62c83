"""The reader trusts nothing it did not check, and a verified read is a hit.

Each test tampers with the index the way a bug or an attacker could (a parent
link to a shorter snapshot, an object key outside the root, a parent row gone)
or passes a Match the store did not make, and checks that the outcome is a
clean miss: damaged data quarantined, a caller's mistake an InvalidArgument
that leaves the stored snapshot alone, never zeros or uninitialised memory.
"""

from __future__ import annotations

import threading
from pathlib import Path

import apsw
import numpy as np
import pytest

from sparkcache import CorruptSnapshot, InvalidArgument, SnapshotStore
from sparkcache.core import Match
from sparkcache.errors import NotFound, StoreTimeout

from .helpers import LAYERS, forge_tokens, identity, pages_for, tokens


def _chain(store: SnapshotStore) -> tuple[np.ndarray, int, int, int]:
    """A root of 16 tokens, its child of 32 and a separate snapshot of the first 8."""
    ident, toks = identity(), tokens(32)
    root = store.publish(ident, 0, toks[:16], pages_for(ident, toks[:16])).snapshot_id
    child = store.publish(ident, 0, toks, pages_for(ident, toks, start=16),
                          parent=root).snapshot_id
    short = store.publish(ident, 0, toks[:8], pages_for(ident, toks[:8])).snapshot_id
    return toks, root, child, short


def _keys_of(store: SnapshotStore, *snapshot_ids: int) -> set[str]:
    with store._core.read() as conn:
        return {g.object_key for sid in snapshot_ids for g in store._core.segments(conn, sid)}


@pytest.mark.parametrize("into", [True, False], ids=["read_into", "read"])
def test_a_chain_with_a_gap_is_corrupt_not_zeros(store: SnapshotStore, into: bool) -> None:
    toks, _root, child, short = _chain(store)
    with store._core.write() as conn:  # the child now claims to continue the 8-token one
        conn.execute("UPDATE snapshots SET parent_id = ? WHERE id = ?", (short, child))
    match = store.lookup(identity(), toks)
    assert match is not None and match.snapshot_id == child
    out = [np.zeros((8, identity().page_nbytes), np.uint8) for _ in range(LAYERS)]
    with pytest.raises(CorruptSnapshot) as info:
        # Before the fix: tokens [8, 16) came back as zeros (read_into) or
        # uninitialised memory (read), without an error.
        store.read_into(match, 0, out) if into else store.read(match, 0)
    assert info.value.reason == "chain"
    assert not any(o.any() for o in out)  # nothing copied
    assert store.snapshot(child).state == "quarantined"
    assert store.snapshot(short).state == "ready"  # the data it points at is fine
    again = store.lookup(identity(), toks)
    assert again is None or again.snapshot_id != child  # never offered again
    with pytest.raises(NotFound):
        store.read(match, 0)


def test_a_key_outside_the_root_quarantines_and_check_repairs(store: SnapshotStore) -> None:
    _toks, root, _child, _short = _chain(store)
    with store._core.write() as conn:
        conn.execute("UPDATE segments SET object_key = '../../etc/passwd' WHERE snapshot_id = ?",
                     (root,))
    report = store.check()
    assert report.bad_keys == [root] and not report.clean
    fixed = store.check(fix=True)
    assert fixed.bad_keys == [root]
    assert store.snapshot(root).state == "quarantined"
    assert store.check().bad_keys == []  # quarantined: no longer a ready segment
    assert store.evict(count=None)  # evicting it never follows the bad key
    assert Path("/etc/passwd").exists()


def test_reading_a_bad_key_is_a_quarantining_miss(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path / "s", alias_stride=16) as store:
        ident, toks = identity(), tokens(16)
        sid = store.publish(ident, 0, toks, pages_for(ident, toks)).snapshot_id
        match = store.lookup(ident, toks)
        assert match is not None
        with store._core.write() as conn:
            conn.execute("UPDATE segments SET object_key = '/abs/path' WHERE snapshot_id = ?",
                         (sid,))
        with pytest.raises(CorruptSnapshot) as info:
            store.read(match, 0)
        assert info.value.reason == "key" and store.snapshot(sid).state == "quarantined"


def test_a_match_of_another_model_or_length_is_the_callers_mistake(
        store: SnapshotStore) -> None:
    toks, root, _child, _short = _chain(store)
    other = identity(model="another")
    before = store.stats()
    for bad in (Match(root, 16, other, toks[:16]),  # another model's identity
                Match(root, 32, identity(), toks[:32])):  # longer than the snapshot
        with pytest.raises(InvalidArgument, match="pass the Match"):
            store.read(bad, 0)
    assert store.snapshot(root).state == "ready" and store.stats() == before
    assert len(store.read(Match(root, 16, identity(), toks[:16]), 0)) == LAYERS


def test_stored_ids_unlike_the_index_quarantine_what_lookup_offers(store: SnapshotStore) -> None:
    """A segment consistent in itself whose token ids are not those its index
    rows were made from is damage when the Match came from the store's own
    lookup (quarantined: offered no more); a Match the caller made with the
    same fields stays the caller's mistake."""
    ident, toks = identity(), tokens(32)
    sid = store.publish(ident, 0, toks, pages_for(ident, toks)).snapshot_id
    forge_tokens(store, sid, tokens(32, seed=9))
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="pass the Match"):
            store.read(Match(sid, 32, ident, toks), 0)
    assert store.snapshot(sid).state == "ready"
    found = store.lookup(ident, toks)
    assert found is not None and found.snapshot_id == sid and found.from_lookup
    with pytest.raises(CorruptSnapshot) as info:
        store.read(found, 0)
    assert info.value.reason == "tokens" and store.snapshot(sid).state == "quarantined"
    assert store.lookup(ident, toks) is None
    assert store.stats()["quarantined.tokens"] == 1


def test_publish_checks_the_layer_count(store: SnapshotStore) -> None:
    ident, toks = identity(), tokens(8)
    with pytest.raises(InvalidArgument, match="num_layers"):
        store.publish(ident, 0, toks, pages_for(ident, toks)[:1])
    assert store.snapshots() == []


def test_check_finds_a_child_whose_parent_row_is_gone(store: SnapshotStore) -> None:
    _toks, root, child, _short = _chain(store)
    (root_file,) = _keys_of(store, root)
    raw = apsw.Connection(str(store.root / "index.sqlite"))  # foreign keys off, as a tamperer
    raw.execute("DELETE FROM segments WHERE snapshot_id = ?", (root,))
    raw.execute("DELETE FROM snapshots WHERE id = ?", (root,))
    raw.close()
    report = store.check()
    assert report.orphan_snapshots == [child]
    fixed = store.check(fix=True)
    assert fixed.orphan_snapshots == [child]
    assert root_file in fixed.orphan_files  # no row names it any more
    assert child not in {s.id for s in store.snapshots()}
    assert store.check().clean  # one pass was enough


def test_a_verified_read_is_a_hit_while_another_process_holds_the_lock(
        tmp_path: Path) -> None:
    root = tmp_path / "s"
    ident, toks = identity(), tokens(16)
    with SnapshotStore(root, busy_timeout_ms=300) as store, SnapshotStore(root) as other:
        sid = store.publish(ident, 0, toks, pages_for(ident, toks)).snapshot_id
        match = store.lookup(ident, toks)
        assert match is not None
        used = store.snapshot(sid).use_count
        locked, release = threading.Event(), threading.Event()

        def hold() -> None:
            with other._core.write():
                locked.set()
                release.wait(30)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert locked.wait(30)
            pages = store.read(match, 0)  # would need the lock to record the hit
            assert len(pages) == LAYERS
            with pytest.raises(StoreTimeout):  # the lock really is held
                store.pin(sid)
        finally:
            release.set()
            holder.join()
        assert store.stats()["hits"] == 1  # saved with the next write
        assert store.snapshot(sid).use_count == used + 1
