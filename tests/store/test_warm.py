"""``SnapshotStore.warm``: a model's most recently used snapshots read into the
page cache, newest use first, up to a budget (an engine's start).

Residency is checked with ``mincore(2)`` on the real files after
``posix_fadvise(DONTNEED)`` dropped them: a warm that reads the wrong files,
or none, leaves them out of the page cache.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from sparkcache import SnapshotStore
from sparkcache import reader as reader_mod
from sparkcache.backends import MmapBackend

from .helpers import Clock, identity, pages_for, tokens

#: Tokens per snapshot: 1024 blocks of 4, two layers of 256-byte pages (~0.5 MB).
N = 4096


def _file(store: SnapshotStore, snapshot_id: int) -> Path:
    (segment,) = store.catalog.segments(snapshot_id)
    return Path(store.backend.root) / segment.object_key  # type: ignore[attr-defined]


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _resident(path: Path) -> float:
    """The share of the file's pages in the page cache (``mincore``)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        address = np.frombuffer(mapped, np.uint8).ctypes.data
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) != 0:
            pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
        resident = sum(v & 1 for v in vec)
    return resident / pages


@pytest.fixture
def three(tmp_path: Path) -> tuple[SnapshotStore, list[int], Clock]:
    """Snapshots a, b, c published in that order, then a restored: by last use
    c and a are the newest (a newest), b the oldest."""
    clock = Clock()
    store = SnapshotStore(tmp_path / "store", clock=clock)
    ident = identity()
    ids = []
    for seed in range(3):
        toks = tokens(N, seed=seed)
        ids.append(store.publish(ident, 0, toks, pages_for(ident, toks)).snapshot_id)
        clock.now += 10
    match = store.lookup(ident, tokens(N, seed=0))
    assert match is not None and match.snapshot_id == ids[0]
    store.read(match, 0)  # a restore: a is used last
    store.ensure_model(ident)  # a write: the use is saved
    return store, ids, clock


def _dropped_all(store: SnapshotStore, ids: list[int]) -> list[Path]:
    paths = [_file(store, sid) for sid in ids]
    for path in paths:
        _drop(path)
    if max(_resident(p) for p in paths) > 0.5:
        pytest.skip("this filesystem keeps dropped pages in memory (tmpfs)")
    return paths


def test_the_most_recently_used_are_read_first_up_to_the_budget(three) -> None:
    store, (a, b, c), _clock = three
    paths = dict(zip((a, b, c), _dropped_all(store, [a, b, c]), strict=True))
    size = {sid: path.stat().st_size for sid, path in paths.items()}
    warmed = store.warm(identity(), size[a] + size[c] + size[b] // 2)
    assert warmed.snapshots == {a, c}
    assert warmed.files == 2 and warmed.nbytes == size[a] + size[c]
    assert _resident(paths[a]) == 1.0 and _resident(paths[c]) == 1.0
    assert _resident(paths[b]) < 0.5  # did not fit what was left: not read
    # A budget for all three reads all three.
    assert store.warm(identity(), sum(size.values())).snapshots == {a, b, c}
    assert _resident(paths[b]) == 1.0
    store.close()


def test_a_stop_ends_the_read_between_chunks(three, monkeypatch: pytest.MonkeyPatch) -> None:
    store, _ids, _clock = three
    monkeypatch.setattr(reader_mod, "WARM_CHUNK_BYTES", 4096)
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 20

    warmed = store.warm(identity(), 1 << 30, stop)
    assert warmed.snapshots == frozenset()  # none was read whole
    assert 0 < warmed.nbytes <= 20 * 4096
    store.close()


def test_a_missing_file_is_skipped_and_nothing_is_quarantined(three) -> None:
    store, (a, b, c), _clock = three
    _file(store, c).unlink()
    warmed = store.warm(identity(), 1 << 30)
    assert warmed.snapshots == {a, b} and warmed.files == 2
    assert {s.id: s.state for s in store.snapshots()} == {a: "ready", b: "ready", c: "ready"}
    store.close()


def test_nothing_is_read_for_another_model_a_zero_budget_or_without_local_files(
        three, tmp_path: Path) -> None:
    store, _ids, _clock = three
    assert store.warm(identity(model="other"), 1 << 30).nbytes == 0
    assert store.warm(identity(), 0).files == 0
    store.close()

    class NoPageCache(MmapBackend):  # objects that are not files here
        warm = None

    with SnapshotStore(tmp_path / "other", storage=NoPageCache(tmp_path / "payloads")) as remote:
        ident = identity()
        remote.publish(ident, 0, tokens(N), pages_for(ident, tokens(N)))
        assert remote.warm(identity(), 1 << 30).files == 0


def test_the_other_shardings_of_the_same_kv_are_read_too_newest_use_first(
        tmp_path: Path) -> None:
    """An engine restores from snapshots stored by engines of another TP size
    (sparkcache.reshard): given those shardings, its start reads theirs too,
    in one order of last use across them all."""
    from .test_reshard import HEADS, TOKENS, full_kv, ident, publish

    clock = Clock()
    store = SnapshotStore(tmp_path / "store", clock=clock)
    publish(store, 1, full_kv(0), TOKENS)  # the engine's own sharding, older
    clock.now += 10
    publish(store, 2, full_kv(1), TOKENS)  # two ranks' files, used last
    (own,) = [s.id for s in store.snapshots() if s.model_id == store.ensure_model(ident(1))]
    (other,) = [s.id for s in store.snapshots() if s.id != own]
    files = {sid: [Path(store.backend.root) / g.object_key  # type: ignore[attr-defined]
                   for g in store.catalog.segments(sid)] for sid in (own, other)}
    assert len(files[other]) == 2
    paths = [p for sid in (own, other) for p in files[sid]]
    for path in paths:
        _drop(path)
    if max(_resident(p) for p in paths) > 0.5:
        pytest.skip("this filesystem keeps dropped pages in memory (tmpfs)")
    size = {sid: sum(p.stat().st_size for p in files[sid]) for sid in (own, other)}

    others = store.siblings(ident(1), HEADS)
    assert others == [ident(2)]
    # Without them: its own sharding's snapshot alone.
    assert store.warm(ident(1), 1 << 30).snapshots == {own}
    for path in files[own]:
        _drop(path)
    # With them, room for one snapshot: the other sharding's, used last.
    warmed = store.warm(ident(1), size[other], others=others)
    assert warmed.snapshots == {other} and warmed.files == 2
    assert all(_resident(p) == 1.0 for p in files[other])
    assert all(_resident(p) < 0.5 for p in files[own])
    # Room for both: both.
    assert store.warm(ident(1), sum(size.values()), others=others).snapshots == {own, other}
    # A model of other KV has no such snapshots.
    assert store.siblings(ident(1, model="other"), HEADS) == []
    store.close()
