"""A damaged payload is a miss, never wrong data; the snapshot is quarantined."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from sparkcache import CorruptSnapshot, SnapshotStore
from sparkcache.errors import NotFound

from .helpers import identity, pages_for, tokens


def _one(store: SnapshotStore, n: int = 64) -> tuple[np.ndarray, Path]:
    ident = identity()
    toks = tokens(n)
    store.publish(ident, 0, toks, pages_for(ident, toks))
    (key,) = list(store.backend.list("objects"))
    return toks, store.root / key


def _assert_miss_and_quarantined(store: SnapshotStore, toks: np.ndarray, reason: str) -> None:
    ident = identity()
    m = store.lookup(ident, toks)
    assert m is not None
    with pytest.raises(CorruptSnapshot) as exc:
        store.read(m, 0)
    assert exc.value.reason == reason
    assert store.lookup(ident, toks) is None  # never offered again
    (info,) = store.snapshots()
    assert info.state == "quarantined" and info.reason == reason
    assert store.stats()[f"quarantined.{reason}"] == 1


@pytest.mark.parametrize("where", ["payload_start", "payload_end", "tokens", "header"])
def test_bit_flip(store: SnapshotStore, where: str) -> None:
    toks, path = _one(store)
    data = bytearray(path.read_bytes())
    hlen = int.from_bytes(data[:8], "little")
    pos = {"payload_start": 8 + hlen, "payload_end": len(data) - 4 * 64 - 1,
           "tokens": len(data) - 3, "header": 20}[where]
    data[pos] ^= 0x10
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    _assert_miss_and_quarantined(store, toks, "digest")


def test_truncation(store: SnapshotStore) -> None:
    toks, path = _one(store)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    _assert_miss_and_quarantined(store, toks, "truncated")


def test_deletion(store: SnapshotStore) -> None:
    toks, path = _one(store)
    path.unlink()
    _assert_miss_and_quarantined(store, toks, "missing")


def test_prefix_read_verifies_only_what_it_copies_but_whole_read_fails(
        tmp_path: Path) -> None:
    # 2 MiB per layer: several verification chunks; damage the last chunk only.
    ident = identity()
    big = identity().page_nbytes
    n_blocks = (2 << 20) // big + 4
    toks = tokens(n_blocks * ident.block_size)
    with SnapshotStore(tmp_path / "s", alias_stride=4096) as store:
        store.publish(ident, 0, toks, pages_for(ident, toks))
        (key,) = list(store.backend.list("objects"))
        path = store.root / key
        data = bytearray(path.read_bytes())
        hlen = int.from_bytes(data[:8], "little")
        layer0_end = 8 + hlen + n_blocks * big
        data[layer0_end - 10] ^= 1
        path.write_bytes(bytes(data))
        m = store.lookup(ident, toks)
        assert m is not None
        first = store.read(m, 0, n_tokens=ident.block_size * 8)  # first chunk only: fine
        assert np.array_equal(first[0], pages_for(ident, toks[: ident.block_size * 8])[0])
        with pytest.raises(CorruptSnapshot):
            store.read(m, 0)


def test_swapped_files_are_caught_by_identity(store: SnapshotStore) -> None:
    ident = identity()
    a, b = tokens(16, seed=1), tokens(16, seed=2)
    store.publish(ident, 0, a, pages_for(ident, a))
    store.publish(ident, 0, b, pages_for(ident, b))
    keys = sorted(store.backend.list("objects"))
    pa, pb = (store.root / k for k in keys)
    da, db = pa.read_bytes(), pb.read_bytes()
    pa.write_bytes(db)
    pb.write_bytes(da)
    for toks in (a, b):
        m = store.lookup(ident, toks)
        assert m is not None
        with pytest.raises(CorruptSnapshot):
            store.read(m, 0)


def test_evicted_between_lookup_and_read_is_a_miss(store: SnapshotStore) -> None:
    ident = identity()
    toks, _ = _one(store)
    m = store.lookup(ident, toks)
    assert m is not None
    store.evict(count=1)
    with pytest.raises(NotFound):
        store.read(m, 0)


def test_quarantined_parent_hides_children(store: SnapshotStore) -> None:
    ident = identity()
    t1 = tokens(16)
    a = store.publish(ident, 0, t1, pages_for(ident, t1)).snapshot_id
    t2 = np.concatenate([t1, tokens(16, seed=4)])
    store.publish(ident, 0, t2, pages_for(ident, t2, start=16), parent=a)
    store.quarantine(a, "digest")
    assert store.lookup(ident, t2) is None
    assert {s.reason for s in store.snapshots()} == {"digest", "parent"}


def test_truncated_while_reading_is_a_miss_not_a_crash(store: SnapshotStore) -> None:
    """The segment shrinks after it was opened and checked, between two layers:
    the rest is read positionally, so the reader sees a short read (a
    ``truncated`` miss, quarantined) where a mapped read would die of SIGBUS."""
    toks, path = _one(store, n=256)
    ident = identity()
    m = store.lookup(ident, toks)
    assert m is not None
    out = [np.zeros(m.n_tokens // ident.block_size * ident.page_nbytes, np.uint8)
           for _ in range(ident.num_layers)]

    def shrink(layer: int) -> None:
        if layer == 0:
            os.chmod(path, 0o644)
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 2)

    with pytest.raises(CorruptSnapshot) as exc:
        store.read_into(m, 0, out, on_layer=shrink)
    assert exc.value.reason == "truncated"
    assert out[0].any() and not out[1].any()  # layer 0 landed verified, layer 1 not at all
    assert store.lookup(ident, toks) is None
