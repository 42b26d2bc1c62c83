"""A full disk: a real 1 MiB tmpfs where the machine allows mounting, else a simulated one.

Both paths run, and run the same assertions: the failing put raises ``StoreFull`` with a
message saying the disk is full, leaves no temp file, and earlier objects stay
readable.  The simulated path (not root, or no ``mount``) makes writes fail with
ENOSPC once 1 MiB has been written, the same way the kernel does.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkcache.backends import Backend, FsspecBackend, LocalBackend, MmapBackend
from sparkcache.errors import StoreFull

DISK_BYTES = 1 << 20
CHUNK = b"\xab" * (64 * 1024)
BIG_CHUNKS = 64  # 4 MiB: four times the disk
SMALL = b"small object that fits" * 100


class SmallDisk:
    """A folder on a 1 MiB filesystem; ``real`` says whether it is a real tmpfs."""

    def __init__(self, path: Path, real: bool) -> None:
        self.path = path
        self.real = real


def _try_mount(path: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES // 1024}k", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return result.returncode == 0


def _umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@pytest.fixture(params=["tmpfs", "simulated"])
def small_disk(tmp_path: Path, request: pytest.FixtureRequest) -> SmallDisk:
    """A 1 MiB disk: "tmpfs" mounts one (falling back to simulation), "simulated" never does.

    The simulated kind always runs so the fallback path stays tested on machines where
    mounting works.
    """
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    real = request.param == "tmpfs" and _try_mount(mount_point)
    if real:
        request.addfinalizer(lambda: _umount(mount_point))
    return SmallDisk(mount_point, real)


class _FullFile:
    """Wraps an fsspec file handle: writes fail with ENOSPC past the disk size."""

    def __init__(self, inner: Any, budget: list[int]) -> None:
        self._inner, self._budget = inner, budget

    def write(self, data: Any) -> int:
        self._budget[0] -= len(memoryview(data))
        if self._budget[0] < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return int(self._inner.write(data))

    def close(self) -> None:
        self._inner.close()


def _simulate_full_disk(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make writes fail with ENOSPC once the disk's size has been written."""
    budget = [DISK_BYTES - len(SMALL)]
    if isinstance(backend, FsspecBackend):
        real_open = backend.fs.open

        def fs_open(path: str, mode: str = "rb", **kwargs: Any) -> Any:
            handle = real_open(path, mode, **kwargs)
            return _FullFile(handle, budget) if "w" in mode else handle

        monkeypatch.setattr(backend.fs, "open", fs_open)
        return
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        size = len(memoryview(data))
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        allowed = min(size, budget[0])  # the kernel writes what fits, then refuses
        budget[0] -= allowed
        return real_write(fd, memoryview(data)[:allowed])

    monkeypatch.setattr(os, "write", write)


def _make(kind: str, folder: Path) -> Backend:
    if kind == "local":
        return LocalBackend(folder)
    if kind == "mmap":
        return MmapBackend(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return FsspecBackend(f"file://{folder}")


def _big() -> Iterator[bytes]:
    for _ in range(BIG_CHUNKS):
        yield CHUNK


@pytest.mark.parametrize("kind", ["local", "mmap", "fsspec-file"])
def test_put_on_full_disk_raises_store_full(
    small_disk: SmallDisk, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if small_disk.real:
        info = os.statvfs(small_disk.path)
        assert info.f_blocks * info.f_frsize <= DISK_BYTES  # really the tiny tmpfs
    backend = _make(kind, small_disk.path / "store")
    backend.put("objects/small", [SMALL])
    if not small_disk.real:
        _simulate_full_disk(backend, monkeypatch)

    with pytest.raises(StoreFull) as full:
        backend.put("objects/big", _big())
    message = str(full.value)
    assert "disk is full" in message and "objects/big" in message
    assert "free space" in message  # says what to do
    assert isinstance(full.value.__cause__, OSError)
    assert full.value.__cause__.errno == errno.ENOSPC

    assert not backend.exists("objects/big")
    assert list(backend.list()) == ["objects/small"]  # no temp file left behind
    assert sorted(os.listdir(small_disk.path / "store" / "objects")) == ["small"]
    with backend.open("objects/small") as blob:
        assert bytes(blob.buffer) == SMALL

    if small_disk.real:
        # The temp file's blocks were given back: the disk takes a small object again.
        usage = backend.disk_usage()
        assert usage is None or usage.free > DISK_BYTES // 2
        backend.put("objects/after", [SMALL])
        assert backend.size("objects/after") == len(SMALL)
