"""A publish that does not fit on a really full disk: StoreFull, and nothing left behind.

The payloads live on a 4 MiB tmpfs mounted for the test (the index stays on the
normal disk).  Where mounting is not allowed (not root, no ``mount``) the same
test runs on a simulated disk: ``os.write`` fails with ENOSPC once 4 MiB have
been written, as the kernel would.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparkcache import ModelIdentity, SnapshotStore, StoreFull

from .helpers import pages_for, tokens

DISK_BYTES = 4 << 20
BIG = ModelIdentity(
    model="big-pages", revision="r1", num_layers=2, num_kv_heads=2, head_size=1024,
    dtype="float16", kv_cache_dtype="float16", block_size=4, page_shape=(2, 8, 1024),
)  # 32 KiB per page and layer


@dataclass
class SmallDisk:
    path: Path
    real: bool  # a real tmpfs; False: simulated with os.write


def _mount(path: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES // 1024}k", "tmpfs", str(path)],
        capture_output=True, check=False,
    )
    return done.returncode == 0


def _umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def _simulate(monkeypatch: pytest.MonkeyPatch, used: int) -> None:
    budget = [DISK_BYTES - used]
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        size = len(memoryview(data))
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        allowed = min(size, budget[0])
        budget[0] -= allowed
        return real_write(fd, memoryview(data)[:allowed])

    monkeypatch.setattr(os, "write", write)


@pytest.fixture
def small_disk(tmp_path: Path, request: pytest.FixtureRequest) -> SmallDisk:
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    real = _mount(mount_point)
    if real:
        request.addfinalizer(lambda: _umount(mount_point))
    return SmallDisk(mount_point, real)


def _files(folder: Path) -> set[str]:
    return {
        Path(d, n).relative_to(folder).as_posix()
        for d, _dirs, names in os.walk(folder) for n in names
    }


def _same(got: list[np.ndarray], want: list[np.ndarray]) -> bool:
    return all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def test_publish_bigger_than_the_disk_raises_store_full(
    small_disk: SmallDisk, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payloads = small_disk.path / "payloads"
    if small_disk.real:
        info = os.statvfs(small_disk.path)
        assert info.f_blocks * info.f_frsize <= DISK_BYTES  # really the tiny tmpfs
    store = SnapshotStore(tmp_path / "index", storage=str(payloads), alias_stride=16)
    try:
        small = [tokens(16, seed=s) for s in range(3)]  # 4 blocks: 256 KiB each
        ids = [store.publish(BIG, 0, t, pages_for(BIG, t)).snapshot_id for t in small]
        head = small[0]
        if not small_disk.real:
            _simulate(monkeypatch, sum(os.path.getsize(payloads / k)
                                       for k in store.backend.list("objects")))
        before_files = _files(payloads)

        # 64 blocks x 2 layers x 32 KiB = 4 MiB: more than the whole disk.
        huge = np.concatenate([head, tokens(256 - 16, seed=9)])
        rng = np.random.default_rng(1)
        for parent, start in ((None, 0), (ids[0], 16)):  # fresh, then as an extend
            n_blocks = (len(huge) - start) // BIG.block_size
            pages = [rng.integers(0, 256, (n_blocks, BIG.page_nbytes), dtype=np.uint8)
                     for _ in range(2)]
            with pytest.raises(StoreFull) as full:
                store.publish(BIG, 0, huge, pages, parent=parent)
            assert "free space" in str(full.value)  # says what to do
            # Nothing of it is visible or left behind.
            m = store.lookup(BIG, huge)
            assert m is not None and m.n_tokens == 16 and m.snapshot_id == ids[0]
            assert sorted(s.id for s in store.snapshots()) == ids
            assert all(s.state == "ready" for s in store.snapshots())
            assert _files(payloads) == before_files  # no temp file, no partial object
            assert store.check().clean

        for sid, t in zip(ids, small, strict=True):
            m = store.lookup(BIG, t)
            assert m is not None and m.snapshot_id == sid
            assert _same(store.read(m, 0), pages_for(BIG, t))

        if small_disk.real:
            # The failed writes gave their blocks back: a small publish fits again.
            assert os.statvfs(payloads).f_bavail * os.statvfs(payloads).f_frsize > DISK_BYTES // 4
            t = tokens(16, seed=42)
            assert store.publish(BIG, 0, t, pages_for(BIG, t)).state == "ready"
            assert store.check().clean
    finally:
        monkeypatch.undo()
        store.close()
