"""Local-disk specifics: durability, path safety, mmap, temp keys, the registry."""

from __future__ import annotations

import errno
import gc
import mmap
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from sparkcache import backends as registry
from sparkcache.backends import (
    FsspecBackend,
    LocalBackend,
    MmapBackend,
    is_temp_key,
    open_backend,
    register_backend,
    temp_key,
    validate_key,
)
from sparkcache.backends.keys import MAX_KEY_CHARS, temp_key_writer
from sparkcache.backends.local import MmapBlob
from sparkcache.errors import BackendError, InvalidArgument, NotFound, StoreFull, UnsafeName
from sparkcache.holders import start_time

# -- durability ------------------------------------------------------------------------


class SyncRecorder:
    """Replaces os.fsync/os.rename and records, in order, what was synced and renamed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str]] = []
        real_fsync, real_rename = os.fsync, os.rename

        def fsync(fd: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def rename(src: str, dst: str) -> None:
            self.events.append(("rename", str(dst)))
            real_rename(src, dst)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", rename)

    def synced(self) -> list[str]:
        return [path for kind, path in self.events if kind == "fsync"]


@pytest.fixture(params=[LocalBackend, MmapBackend])
def disk(request: pytest.FixtureRequest, tmp_path: Path) -> LocalBackend:
    cls: type[LocalBackend] = request.param
    return cls(tmp_path / "root")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name fds")
def test_put_fsyncs_file_then_renames_then_fsyncs_folders(
    disk: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = SyncRecorder(monkeypatch)
    disk.put("n1/n2/obj", [b"payload"])
    root = Path(disk.root)
    final = str(root / "n1" / "n2" / "obj")
    first = recorder.events[0]
    assert first[0] == "fsync" and is_temp_key(os.path.basename(first[1]))
    assert recorder.events[1] == ("rename", final)
    # The object's folder (holds the rename) and the parent of every new folder.
    assert sorted(recorder.synced()[1:]) == sorted(
        [str(root / "n1" / "n2"), str(root / "n1"), str(root)]
    )

    recorder.events.clear()
    disk.put("n1/n2/second", [b"x"])  # folders exist now: only the file and its folder
    assert [kind for kind, _ in recorder.events] == ["fsync", "rename", "fsync"]
    assert recorder.synced()[1] == str(root / "n1" / "n2")


def test_put_not_durable_skips_fsync(disk: LocalBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", calls.append)
    disk.put("a/b", [b"x"], durable=False)
    assert calls == []
    assert disk.exists("a/b")


def test_temp_file_is_in_the_object_folder_while_writing(disk: LocalBackend) -> None:
    seen: list[str] = []

    def chunks() -> Iterator[bytes]:
        yield b"part"
        seen.extend(disk.list("f"))
        yield b"rest"

    disk.put("f/obj", chunks())
    assert len(seen) == 1 and seen[0].startswith("f/obj.tmp.")
    assert temp_key_writer(seen[0]) == (os.getpid(), start_time(os.getpid()))
    assert list(disk.list()) == ["f/obj"]
    assert oct(os.stat(os.path.join(disk.root, "f", "obj")).st_mode & 0o777) == "0o644"


@pytest.mark.parametrize(("code", "error"), [(errno.EIO, BackendError), (errno.EDQUOT, StoreFull)])
def test_write_errors_are_translated_and_cleaned_up(
    disk: LocalBackend, monkeypatch: pytest.MonkeyPatch, code: int, error: type[Exception]
) -> None:
    def broken_write(fd: int, data: object) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "write", broken_write)
    with pytest.raises(error) as info:
        disk.put("w/obj", [b"data"])
    assert "w/obj" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.undo()
    assert list(disk.list()) == []


def test_root_is_created_and_url_names_it(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "new" / "deep")
    assert os.path.isdir(tmp_path / "new" / "deep")
    assert backend.url == f"local://{tmp_path}/new/deep"
    assert MmapBackend(tmp_path / "m").url == f"mmap://{tmp_path}/m"
    assert LocalBackend(f"local://localhost{tmp_path}/h").root == f"{tmp_path}/h"


def test_local_url_without_absolute_path_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="three"):
        LocalBackend("local://relative/path")


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(BackendError):
        LocalBackend(tmp_path / "file")


def test_disk_usage_is_statvfs(disk: LocalBackend) -> None:
    info = os.statvfs(disk.root)
    usage = disk.disk_usage()
    assert usage.total == info.f_blocks * info.f_frsize
    assert abs(usage.free - info.f_bavail * info.f_frsize) < 64 * 1024 * 1024


# -- path safety -----------------------------------------------------------------------


def test_symlinked_folder_escaping_root_is_refused(disk: LocalBackend, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"do not read")
    os.symlink(outside, os.path.join(disk.root, "evil"))

    for call in (
        lambda: disk.put("evil/x", [b"pwned"]),
        lambda: disk.open("evil/secret"),
        lambda: disk.size("evil/secret"),
        lambda: disk.exists("evil/secret"),
        lambda: disk.delete("evil/secret"),
        lambda: disk.list("evil"),
    ):
        with pytest.raises(UnsafeName, match="outside the store root"):
            call()
    assert sorted(os.listdir(outside)) == ["secret"]  # nothing written outside
    assert (outside / "secret").read_bytes() == b"do not read"
    assert list(disk.list()) == []  # list never follows the symlink


def test_symlinked_file_escaping_root_is_refused(disk: LocalBackend, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"outside")
    os.symlink(target, os.path.join(disk.root, "link"))
    with pytest.raises(UnsafeName):
        disk.open("link")
    with pytest.raises(UnsafeName):
        disk.put("link", [b"overwrite"])
    assert target.read_bytes() == b"outside"


def test_symlink_to_the_root_itself_is_refused(disk: LocalBackend) -> None:
    os.symlink(disk.root, os.path.join(disk.root, "self"))
    with pytest.raises(UnsafeName):
        disk.put("self", [b"x"])


def test_symlink_inside_root_is_allowed(disk: LocalBackend) -> None:
    disk.put("real/obj", [b"inside"])
    os.symlink(os.path.join(disk.root, "real"), os.path.join(disk.root, "alias"))
    with disk.open("alias/obj") as blob:
        assert bytes(blob.buffer) == b"inside"


def test_list_skips_names_that_are_not_keys(disk: LocalBackend) -> None:
    disk.put("d/good", [b"1"])
    Path(disk.root, "d", ".hidden").write_bytes(b"")
    Path(disk.root, "d", "sp ace").write_bytes(b"")
    assert list(disk.list()) == ["d/good"]


# -- mmap ------------------------------------------------------------------------------


def test_mmap_blob_is_zero_copy(tmp_path: Path) -> None:
    backend = MmapBackend(tmp_path)
    assert backend.zero_copy is True and LocalBackend.zero_copy is False
    backend.put("m", [b"mapped bytes"])
    with backend.open("m") as blob:
        assert isinstance(blob, MmapBlob)
        assert isinstance(blob.buffer.obj, mmap.mmap)
        assert bytes(blob.buffer) == b"mapped bytes"
    with LocalBackend(tmp_path).open("m") as copied:
        assert isinstance(copied.buffer.obj, bytearray)


def test_mmap_blob_survives_delete_and_overwrite(tmp_path: Path) -> None:
    backend = MmapBackend(tmp_path)
    backend.put("gone", [b"still readable" * 1000])
    blob = backend.open("gone")
    assert backend.delete("gone")
    assert not backend.exists("gone")
    backend.put("gone", [b"a new object"])
    assert bytes(blob.buffer) == b"still readable" * 1000
    blob.close()
    with pytest.raises(ValueError):
        _ = blob.buffer


def test_mmap_blob_read_at(tmp_path: Path) -> None:
    """Positional reads of the mapped file: exact bytes, short only at the end,
    from several threads at once, refused once closed."""
    backend = MmapBackend(tmp_path)
    data = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8)
    backend.put("obj", [data])
    blob = backend.open("obj")
    assert isinstance(blob, MmapBlob)
    out = np.zeros(1000, np.uint8)
    assert blob.read_at(12345, out) == 1000
    assert np.array_equal(out, data[12345:13345])
    assert blob.read_at(data.size - 10, out) == 10  # the file ends there
    assert np.array_equal(out[:10], data[-10:])
    assert blob.read_at(data.size + 5, out) == 0

    def read_part(k: int) -> bool:
        part = np.empty(1 << 20, np.uint8)
        return blob.read_at(k << 20, part) == part.size and np.array_equal(
            part, data[k << 20 : (k + 1) << 20])

    with ThreadPoolExecutor(3) as pool:
        assert all(pool.map(read_part, range(3)))
    blob.close()
    with pytest.raises(ValueError, match="closed"):
        blob.read_at(0, out)


@pytest.mark.parametrize("most", [None, 700], ids=["whole", "short-reads"])
def test_mmap_blob_read_at_fills_several_buffers(
    tmp_path: Path, most: int | None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A list of buffers is filled in order from one offset, as one read, also
    when the kernel returns fewer bytes than asked (``most`` per call): the
    rest is read again from where it stopped, across buffer boundaries; short
    only where the file ends."""
    backend = MmapBackend(tmp_path)
    data = np.random.default_rng(6).integers(0, 256, 5000, dtype=np.uint8)
    backend.put("obj", [data])
    calls: list[int] = []
    preadv = os.preadv

    def capped(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(len(buffers))
        if most is None:
            return preadv(fd, buffers, offset)
        room = memoryview(bytearray(min(most, sum(b.nbytes for b in buffers))))
        got = preadv(fd, [room], offset)
        left = got
        for buf in buffers:  # what a short vectored read fills: the first bytes
            n = min(left, buf.nbytes)
            buf[:n] = room[got - left : got - left + n]
            left -= n
        return got

    monkeypatch.setattr(os, "preadv", capped)
    with backend.open("obj") as blob:
        outs = [np.zeros(n, np.uint8) for n in (300, 1, 0, 1200, 499)]
        assert blob.read_at(1000, outs) == 2000
        assert np.array_equal(np.concatenate(outs), data[1000:3000])
        assert calls[0] == 5 and len(calls) == (1 if most is None else 3)
        tail = [np.zeros(900, np.uint8), np.zeros(900, np.uint8)]
        assert blob.read_at(4000, tail) == 1000  # the file ends there
        assert np.array_equal(np.concatenate(tail)[:1000], data[4000:])


def test_mmap_blob_read_at_sees_truncation(tmp_path: Path) -> None:
    """A file truncated while open: the mapping would fault (SIGBUS) past the new
    end, a positional read just returns fewer bytes."""
    backend = MmapBackend(tmp_path)
    backend.put("obj", [bytes(range(256)) * 64])
    with backend.open("obj") as blob:
        path = tmp_path / "obj"
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:
            f.truncate(1000)
        out = bytearray(4096)
        assert blob.read_at(0, out) == 1000
        assert out[:1000] == (bytes(range(256)) * 4)[:1000]


def test_mmap_empty_file(tmp_path: Path) -> None:
    backend = MmapBackend(tmp_path)
    backend.put("empty", [])
    with backend.open("empty") as blob:
        assert len(blob.buffer) == 0 and blob.buffer.readonly


def test_mmap_close_with_live_consumer_views(tmp_path: Path) -> None:
    backend = MmapBackend(tmp_path)
    data = np.arange(4096, dtype=np.int32)
    backend.put("arr", [data])
    blob = backend.open("arr")
    held = np.frombuffer(blob.buffer, dtype=np.int32)
    part = blob.buffer[:16]
    blob.close()  # refused unmap is left to GC, not raised
    assert np.array_equal(held, data)  # the mapping stays alive for the consumer
    assert part.tobytes() == data.tobytes()[:16]
    del held, part
    gc.collect()


def test_open_folder_is_not_found(disk: LocalBackend) -> None:
    os.mkdir(os.path.join(disk.root, "dir"))
    with pytest.raises(NotFound, match="folder"):
        disk.open("dir")


# -- keys ------------------------------------------------------------------------------


def test_validate_key_accepts_store_keys() -> None:
    key = "objects/m-0123abcd/ab/ab12cd34ef-9f3c.r0.safetensors"
    assert validate_key(key) == key
    assert validate_key("_x") == "_x"
    assert validate_key("/".join(["s"] * 16))
    assert validate_key("k" * MAX_KEY_CHARS)


@pytest.mark.parametrize(
    "bad",
    ["/".join(["s"] * 17), "k" * (MAX_KEY_CHARS + 1), "a b", "a\nb", "a\n", "tab\t", ".", "a/."],
    ids=repr,
)
def test_validate_key_rejects(bad: str) -> None:
    with pytest.raises(UnsafeName, match="letters, digits"):
        validate_key(bad)


def test_validate_key_rejects_non_str() -> None:
    with pytest.raises(UnsafeName, match="str"):
        validate_key(None)  # type: ignore[arg-type]


def test_temp_key_helpers() -> None:
    key = "objects/m-1/ab/ab12-9f3c.r0.safetensors"
    tmp = temp_key(key)
    assert re.fullmatch(re.escape(key) + r"\.tmp\.\d+-\d+\.[0-9a-f]{8}", tmp)
    assert tmp.rsplit("/", 1)[0] == key.rsplit("/", 1)[0]  # same folder
    assert validate_key(tmp) == tmp
    assert is_temp_key(tmp) and not is_temp_key(key)
    assert temp_key_writer(tmp) == (os.getpid(), start_time(os.getpid()))
    assert temp_key_writer(key) is None
    assert temp_key_writer("a/b.tmp.12.0123abcd") == (12, None)  # written before start times
    assert is_temp_key("a/b.tmp.12.0123abcd")
    assert temp_key_writer("a/b.tmp.12.zzzzzzzz") is None
    assert temp_key_writer("x.tmp.12.0123abcd/child") is None  # only the last segment counts
    assert temp_key(key) != tmp  # random part differs between calls
    with pytest.raises(UnsafeName, match="too long"):
        temp_key("k" * MAX_KEY_CHARS)
    with pytest.raises(UnsafeName):
        temp_key("../x")


# -- registry --------------------------------------------------------------------------


def test_open_backend_dispatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert type(open_backend(tmp_path)) is MmapBackend  # PathLike
    assert type(open_backend(str(tmp_path))) is MmapBackend  # plain path: the default
    relative = open_backend("relative-store")
    assert type(relative) is MmapBackend and relative.root == str(tmp_path / "relative-store")
    assert type(open_backend("odd::name")) is MmapBackend  # '::' without a URL: a path
    assert type(open_backend(f"local://{tmp_path}")) is LocalBackend
    assert type(open_backend(f"LOCAL://{tmp_path}")) is LocalBackend
    assert type(open_backend(f"mmap://{tmp_path}")) is MmapBackend
    memory = open_backend("memory://sparkcache-dispatch")
    assert type(memory) is FsspecBackend
    assert type(open_backend(f"file://{tmp_path}")) is FsspecBackend
    explicit = open_backend("fsspec::memory://sparkcache-explicit")
    assert type(explicit) is FsspecBackend and explicit.url == "memory://sparkcache-explicit"
    local = open_backend(f"local://{tmp_path}")
    assert isinstance(local, LocalBackend) and local.root == str(tmp_path)


def test_open_backend_unknown_scheme() -> None:
    with pytest.raises(BackendError) as info:
        open_backend("nosuchscheme://bucket/path")
    message = str(info.value)
    for word in ("nosuchscheme", "local", "mmap", "fsspec", "register_backend"):
        assert word in message


@pytest.mark.usefixtures("clean_registry")
def test_register_backend_lazy_string(tmp_path: Path) -> None:
    register_backend("mydisk", "sparkcache.backends.local:LocalBackend")
    assert "mydisk" in registry.known_schemes()
    backend = open_backend(f"mydisk://{tmp_path}")
    assert type(backend) is LocalBackend and backend.root == str(tmp_path)
    register_backend("mydisk", "sparkcache.backends.local:LocalBackend")  # same: fine


@pytest.mark.usefixtures("clean_registry")
def test_register_backend_is_lazy_and_reports_import_errors() -> None:
    register_backend("ghost", "sparkcache_no_such_module:Backend")  # not imported yet
    with pytest.raises(BackendError, match="sparkcache_no_such_module"):
        open_backend("ghost://x")


@pytest.mark.usefixtures("clean_registry")
def test_register_backend_callable_and_clobber(tmp_path: Path) -> None:
    register_backend("cb", lambda url: MmapBackend(tmp_path))
    assert type(open_backend("cb://anything")) is MmapBackend
    with pytest.raises(InvalidArgument, match="clobber"):
        register_backend("cb", "sparkcache.backends.local:LocalBackend")
    register_backend("cb", "sparkcache.backends.local:LocalBackend", clobber=True)
    with pytest.raises(InvalidArgument):
        LocalBackend("cb://anything")  # the URL has no absolute path
    register_backend("junk", lambda url: object(), clobber=True)  # type: ignore[arg-type,return-value]
    with pytest.raises(BackendError, match="does not implement"):
        open_backend("junk://x")


@pytest.mark.parametrize("name", ["", "1abc", "a b", "a:b"])
def test_register_backend_rejects_bad_names(name: str) -> None:
    with pytest.raises(InvalidArgument):
        register_backend(name, "sparkcache.backends.local:LocalBackend")


def test_register_backend_rejects_bad_targets() -> None:
    with pytest.raises(InvalidArgument, match="module:Class"):
        register_backend("badtarget", "no-colon-here")
    with pytest.raises(InvalidArgument):
        register_backend("badtarget", 42)  # type: ignore[arg-type]
