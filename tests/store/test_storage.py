"""The store remembers its storage, and its index's disk running full is survivable.

A store created with ``storage=`` records it (never credentials): opening it
again without one finds the payloads, and opening it with another one is an
error naming both, not a store whose every file looks "missing".
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkcache import SnapshotStore, StoreFull
from sparkcache.backends import canonical_url
from sparkcache.core import RESERVE_FILE
from sparkcache.errors import StorageMismatch
from sparkcache.index import queries as q

from .helpers import identity, pages_for, tokens
from .test_enospc import BIG


def _publish(store: SnapshotStore, seed: int = 0, n: int = 16) -> int:
    ident, toks = identity(), tokens(n, seed=seed)
    return store.publish(ident, 0, toks, pages_for(ident, toks)).snapshot_id


def test_the_storage_is_recorded_and_found_again(tmp_path: Path) -> None:
    root, payloads = tmp_path / "s", tmp_path / "payloads"
    with SnapshotStore(root, storage=payloads) as store:
        _publish(store)
        with store._core.read() as conn:
            (recorded,) = conn.execute(q.GET_SETTING, ("storage",)).fetchone()
        assert recorded == str(payloads)
    with SnapshotStore(root) as store:  # no storage given: the recorded one
        assert store.check().clean and store.lookup(identity(), tokens(16)) is not None
    with SnapshotStore(root, storage=str(payloads) + "/") as store:  # the same, spelled so
        assert store.check().clean


def test_another_storage_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    root, payloads, typo = tmp_path / "s", tmp_path / "payloads", tmp_path / "paylods"
    with SnapshotStore(root, storage=payloads) as store:
        _publish(store)
    with pytest.raises(StorageMismatch) as info:
        SnapshotStore(root, storage=typo)
    assert str(payloads) in str(info.value) and str(typo) in str(info.value)
    assert "relocate" in str(info.value)
    assert not typo.exists()  # the mistyped folder is not made
    with pytest.raises(StorageMismatch):
        SnapshotStore(root, storage=root)  # the root itself is another storage too
    with SnapshotStore(root) as store:
        assert [s.state for s in store.snapshots()] == ["ready"]  # nothing quarantined


def test_relocate_records_the_new_storage(tmp_path: Path) -> None:
    root, old, new = tmp_path / "s", tmp_path / "old", tmp_path / "new"
    with SnapshotStore(root, storage=old) as store:
        _publish(store)
    shutil.move(old, new)
    with SnapshotStore(root, storage=new, relocate=True) as store:
        assert store.check().clean
    with SnapshotStore(root) as store:
        assert store.lookup(identity(), tokens(16)) is not None


def test_a_store_in_its_own_folder_moves_with_it(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path / "a") as store:
        _publish(store)
    shutil.move(tmp_path / "a", tmp_path / "b")
    with SnapshotStore(tmp_path / "b") as store:
        assert store.check().clean


def test_credentials_are_never_recorded() -> None:
    assert canonical_url("s3://AKIA:secret@bucket/kv") == "s3://bucket/kv"
    assert canonical_url("fsspec::s3://u:p@bucket/kv") == "fsspec::s3://bucket/kv"
    assert canonical_url("relative/dir") == os.path.abspath("relative/dir")


# -- the index's own disk full -----------------------------------------------------------


DISK = 4 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs holding the whole store, index included (root only)."""
    path = tmp_path / "disk"
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DISK // 1024}k", "tmpfs", str(path)],
            capture_output=True, check=False).returncode:
        pytest.skip("needs root and mount for a real tmpfs (the index's own disk full)")
    yield path
    if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def test_eviction_frees_space_when_the_index_disk_is_full(small_disk: Path) -> None:
    store = SnapshotStore(small_disk / "s", index_reserve=256 << 10)
    try:
        assert (small_disk / "s" / RESERVE_FILE).stat().st_size == 256 << 10
        published = []
        with pytest.raises(StoreFull):
            for seed in range(1000):
                toks = tokens(8, seed=seed)
                published.append(store.publish(BIG, 0, toks, pages_for(BIG, toks)).snapshot_id)
        fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)  # whatever room is left
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        with pytest.raises(StoreFull, match="index"):
            # Index writes on a full disk: the first few may still fit in room
            # the WAL file already has; they fail as soon as it needs more.
            for _ in range(1000):
                store.acquire_lease(published[0])
        match = store.lookup(BIG, tokens(8, seed=0))
        assert match is not None and len(store.read(match, 0)) == 2  # reads still hit
        assert len(store.evict(count=4)) == 4  # from the reserve
        store.acquire_lease(published[-1])  # writes work again
        assert (small_disk / "s" / RESERVE_FILE).exists()  # taken back
    finally:
        store.close()
