"""SnapshotStore.extend: the stored block where a prompt leaves a snapshot.

A prompt's partial last block has no boundary hash, so ``lookup`` stops at the
prompt's last whole block, and a prompt that leaves a snapshot inside a block
matches only the whole blocks before it; ``extend`` grows the match by the
snapshot's next block when its stored token ids begin with the rest of the
prompt or part of it (read and verified like a restore's), and says how many
of the prompt's tokens it supplies."""

from __future__ import annotations

import numpy as np
import pytest

from sparkcache import CorruptSnapshot, InvalidArgument, SnapshotStore
from sparkcache.errors import NotFound

from .helpers import BLOCK, LAYERS, identity, pages_for
from .test_ranged_read import _flip, _publish_chain


def test_extend_grows_the_match_by_the_stored_block(store: SnapshotStore) -> None:
    c = _publish_chain(store, (8, 20))  # the block 16..20 lies in the second link
    m = store.lookup(c.ident, c.toks[:18])
    assert m is not None and m.n_tokens == 16
    found = store.extend(m, c.toks[:18])
    assert found is not None
    grown, supplied = found
    assert supplied == 18 and grown.snapshot_id == m.snapshot_id
    assert grown.n_tokens == 20 and grown.scope == m.scope
    np.testing.assert_array_equal(grown.token_ids, c.toks[:20])  # prompt, then stored
    out = [np.zeros((1, c.ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
    assert store.read_into(grown, 0, out, start_tokens=16) == 1
    for got, want in zip(out, pages_for(c.ident, c.toks[:20], start=16), strict=True):
        np.testing.assert_array_equal(got, want)


def test_extend_supplies_the_tokens_the_stored_block_shares(store: SnapshotStore) -> None:
    c = _publish_chain(store, (8, 20))
    m = store.lookup(c.ident, c.toks[:19])
    assert m is not None and m.n_tokens == 16
    other = c.toks[:19].copy()
    other[18] += 1  # the prompt leaves the snapshot inside the block, at token 18
    found = store.extend(m, other)
    assert found is not None
    grown, supplied = found
    assert supplied == 18 and grown.n_tokens == 20
    np.testing.assert_array_equal(grown.token_ids, c.toks[:20])  # the stored block's
    other[17] += 1
    found = store.extend(m, other)
    assert found is not None and found[1] == 17


def test_extend_needs_the_stored_tokens_to_go_on(store: SnapshotStore) -> None:
    c = _publish_chain(store, (8, 20))
    m = store.lookup(c.ident, c.toks[:18])
    assert m is not None
    other = c.toks[:18].copy()
    other[16] += 1
    assert store.extend(m, other) is None  # the stored block's first token differs
    end = store.lookup(c.ident, c.toks[:20])
    assert end is not None and end.n_tokens == 20
    longer = np.concatenate([c.toks[:20], c.toks[:2]])
    assert store.extend(end, longer) is None  # nothing stored past the snapshot
    assert {s.state for s in store.snapshots()} == {"ready"}


def test_extend_rejects_what_is_not_a_partial_block(store: SnapshotStore) -> None:
    c = _publish_chain(store, (8, 20))
    m = store.lookup(c.ident, c.toks[:18])
    assert m is not None
    for bad in (c.toks[:16], c.toks[:16 + BLOCK]):
        with pytest.raises(InvalidArgument, match="extend the match"):
            store.extend(m, bad)
    other = c.toks[:18].copy()
    other[0] += 1
    with pytest.raises(InvalidArgument, match="begin with"):
        store.extend(m, other)


def test_a_corrupted_tail_is_quarantined(store: SnapshotStore) -> None:
    c = _publish_chain(store, (8, 20))
    m = store.lookup(c.ident, c.toks[:18])
    assert m is not None
    _flip(c.files[1], "tokens", 4 * 9)  # token 17, in the second link
    with pytest.raises(CorruptSnapshot, match="digest"):
        store.extend(m, c.toks[:18])
    root, child = sorted(store.snapshots(), key=lambda s: s.depth)
    assert (child.state, child.reason) == ("quarantined", "digest")
    assert root.state == "ready"
    assert store.stats()["quarantined.digest"] == 1


def test_extend_reads_the_given_rank(tmp_path: object) -> None:
    ident = identity(world=2)
    toks = np.arange(1, 21, dtype=np.uint32)
    with SnapshotStore(f"{tmp_path}/s", alias_stride=16) as store:
        for rank in (0, 1):
            store.publish(ident, rank, toks, pages_for(ident, toks, rank=rank))
        m = store.lookup(ident, toks[:18])
        assert m is not None and m.n_tokens == 16
        found = store.extend(m, toks[:18], ranks=[1])
        assert found is not None and found[0].n_tokens == 20
        with pytest.raises(InvalidArgument):
            store.extend(m, toks[:18], ranks=[2])  # no such rank
        with store._core.read() as conn:
            (key,) = conn.execute("SELECT object_key FROM segments WHERE rank = 0").fetchone()
        store.backend.delete(key)  # rank 0's segment is gone
        assert store.extend(m, toks[:18], ranks=[1]) is not None  # rank 1 reads its own
        with pytest.raises(CorruptSnapshot, match="missing"):
            store.extend(m, toks[:18])  # all ranks: read from rank 0's file
        (snap,) = store.snapshots()
        assert (snap.state, snap.reason) == ("quarantined", "missing")


def test_a_vanished_snapshot_is_not_found(store: SnapshotStore) -> None:
    c = _publish_chain(store, (8, 20))
    m = store.lookup(c.ident, c.toks[:18])
    assert m is not None
    store.delete(m.snapshot_id)
    with pytest.raises(NotFound):
        store.extend(m, c.toks[:18])
