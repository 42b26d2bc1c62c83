"""The one conformance suite every backend passes (the ``backend`` fixture's kinds)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sparkcache.backends import (
    Backend,
    Blob,
    DiskUsage,
    FsspecBackend,
    ObjectStat,
    ObjectStore,
    is_temp_key,
    open_backend,
    temp_key,
)
from sparkcache.errors import BackendError, InvalidArgument, NotFound, UnsafeName

from .conftest import s3_server

KEY = "objects/m-0123abcd/ab/ab12cd34-9f3c.r0.safetensors"
MB = 1 << 20

_ARRAY = np.arange(1000, dtype=np.float32)
_MATRIX = np.arange(24, dtype=np.int64).reshape(4, 6)
_BIG = np.random.default_rng(7).integers(0, 256, size=20 * MB, dtype=np.uint8)

CHUNK_CASES: dict[str, list[Any]] = {
    "bytes": [b"hello ", b"world"],
    "bytearray": [bytearray(b"abc"), bytearray(range(256))],
    "memoryview": [memoryview(b"0123456789")[2:8], memoryview(bytearray(b"xyz"))],
    "numpy": [_ARRAY, _MATRIX, _MATRIX[:, ::2], np.float16(1.5)],
    "mixed": [b"a", bytearray(b"b"), memoryview(b"c"), np.array([1, 2], dtype=np.uint16)],
    "many-chunks": [bytes([i % 256]) * (i % 7) for i in range(2000)],
    "empty-no-chunks": [],
    "empty-chunks": [b"", bytearray(), memoryview(b"")],
    "20MB": [_BIG[: 7 * MB], _BIG[7 * MB :]],
}

UNSAFE_KEYS = [
    "..",
    "/abs",
    "a/../b",
    "a\x00b",
    "a\\b",
    ".hidden",
    "x" * 10_000,
    "",
    "a//b",
    "a/",
    "./a",
    "-dash",
    "é",
]


def expected_bytes(chunks: list[Any]) -> bytes:
    return b"".join(np.asarray(c).tobytes() if not isinstance(c, bytes) else c for c in chunks)


def read(backend: Backend, key: str) -> bytes:
    with backend.open(key) as blob:
        return bytes(blob.buffer)


# -- roundtrips ------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CHUNK_CASES))
def test_put_open_roundtrip(backend: Backend, case: str) -> None:
    chunks = CHUNK_CASES[case]
    want = expected_bytes(chunks)
    assert backend.put(KEY, iter(chunks)) == len(want)
    assert backend.exists(KEY)
    assert backend.size(KEY) == len(want)
    with backend.open(KEY) as blob:
        assert isinstance(blob, Blob)
        view = blob.buffer
        assert view.format == "B" and view.ndim == 1 and view.readonly
        assert len(view) == len(want)
        assert view == want


def test_put_not_durable_roundtrips(backend: Backend) -> None:
    assert backend.put("k", [b"scratch"], durable=False) == 7
    assert read(backend, "k") == b"scratch"


def test_backend_satisfies_protocol(backend: Backend) -> None:
    assert isinstance(backend, Backend)
    assert isinstance(backend.url, str) and "://" in backend.url
    assert isinstance(backend.zero_copy, bool)


def test_url_reopens_the_same_store(backend: Backend) -> None:
    backend.put("a/b", [b"shared"])
    again = open_backend(backend.url)
    assert type(again) is type(backend)
    assert read(again, "a/b") == b"shared"
    again.close()


# -- overwrite -------------------------------------------------------------------------


def test_put_overwrites_atomically(backend: Backend) -> None:
    old, new = b"old" * 1000, b"NEW" * 2000
    backend.put(KEY, [old])
    held = backend.open(KEY)  # a reader that opened before the overwrite

    def chunks() -> Iterator[bytes]:
        yield new[:100]
        # Mid-write, readers still see the complete old object, never a partial one.
        assert read(backend, KEY) == old
        assert backend.size(KEY) == len(old)
        yield new[100:]

    assert backend.put(KEY, chunks()) == len(new)
    assert read(backend, KEY) == new
    assert backend.size(KEY) == len(new)
    assert bytes(held.buffer) == old  # the earlier reader keeps its snapshot
    held.close()
    assert [k for k in backend.list() if is_temp_key(k)] == []


# -- missing objects, delete, exists, size ----------------------------------------------


def test_open_missing_raises_not_found(backend: Backend) -> None:
    with pytest.raises(NotFound) as info:
        backend.open("no/such/object")
    assert "no/such/object" in str(info.value)
    assert isinstance(info.value, KeyError)  # NotFound is also a KeyError


def test_size_missing_raises_not_found(backend: Backend) -> None:
    with pytest.raises(NotFound):
        backend.size("missing")


def test_delete_reports_whether_it_existed(backend: Backend) -> None:
    backend.put("d/x", [b"1"])
    assert backend.delete("d/x") is True
    assert backend.delete("d/x") is False
    assert backend.delete("never/there") is False
    assert not backend.exists("d/x")
    with pytest.raises(NotFound):
        backend.open("d/x")


def test_exists(backend: Backend) -> None:
    assert backend.exists("e") is False
    backend.put("e", [b""])
    assert backend.exists("e") is True


def test_folders_are_not_objects(backend: Backend) -> None:
    backend.put("folder/inner/obj", [b"x"])
    assert backend.exists("folder") is False
    assert backend.exists("folder/inner") is False
    with pytest.raises(NotFound):
        backend.open("folder/inner")
    with pytest.raises(NotFound):
        backend.size("folder")
    assert backend.delete("folder/inner") is False
    assert read(backend, "folder/inner/obj") == b"x"


def test_path_through_an_object_is_missing(backend: Backend) -> None:
    backend.put("file", [b"x"])
    assert backend.exists("file/below") is False
    with pytest.raises(NotFound):
        backend.open("file/below")
    assert backend.delete("file/below") is False


# -- list ------------------------------------------------------------------------------


def test_list_with_prefix(backend: Backend) -> None:
    keys = ["a/x", "a/b/y", "a/b/c/z", "ab/z", "c"]
    for key in keys:
        backend.put(key, [key.encode()])
    assert sorted(backend.list()) == sorted(keys)
    assert sorted(backend.list("")) == sorted(keys)
    assert sorted(backend.list("a")) == ["a/b/c/z", "a/b/y", "a/x"]
    assert sorted(backend.list("a/")) == ["a/b/c/z", "a/b/y", "a/x"]
    assert sorted(backend.list("a/b")) == ["a/b/c/z", "a/b/y"]
    assert list(backend.list("nope")) == []
    assert list(backend.list("c")) == []  # an object is not a folder


def test_list_includes_temp_keys(backend: Backend) -> None:
    backend.put("f/obj", [b"1"])
    leftover = temp_key("f/obj")  # what a crashed writer leaves behind
    backend.put(leftover, [b"partial"])
    listed = sorted(backend.list("f"))
    assert listed == sorted(["f/obj", leftover])
    assert [k for k in listed if is_temp_key(k)] == [leftover]


def test_list_empty_store(backend: Backend) -> None:
    assert list(backend.list()) == []


# -- disk usage, folders, removing a tree ------------------------------------------------


def test_disk_usage_type(backend: Backend) -> None:
    usage = backend.disk_usage()
    assert usage is None or (isinstance(usage, DiskUsage) and usage.total >= usage.free > 0)


def test_folders_lists_direct_subfolders_only(backend: Backend) -> None:
    assert list(backend.folders("objects")) == []  # no such folder yet: nothing
    for key in ("objects/m-1/ab/x", "objects/m-1/cd/y", "objects/m-2/ef/z", "objects/top"):
        backend.put(key, [b"x"])
    assert sorted(backend.folders("objects")) == ["objects/m-1", "objects/m-2"]
    assert sorted(backend.folders("objects/m-1")) == ["objects/m-1/ab", "objects/m-1/cd"]
    with pytest.raises(UnsafeName):
        backend.folders("../up")


def test_remove_tree_removes_only_that_folder(backend: Backend) -> None:
    for key in ("objects/m-1/ab/x", "objects/m-1/cd/y", "objects/m-12/ab/z"):
        backend.put(key, [b"x"])
    assert backend.remove_tree("objects/m-1") == 2
    assert list(backend.list()) == ["objects/m-12/ab/z"]  # a sibling sharing the prefix stays
    assert list(backend.folders("objects")) == ["objects/m-12"]
    assert backend.remove_tree("objects/m-1") == 0  # gone already: not an error
    with pytest.raises(UnsafeName):
        backend.remove_tree("../up")


# -- failures --------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


def failing_chunks() -> Iterator[bytes]:
    yield b"first part " * 1000
    yield b"second part " * 1000
    raise Boom("producer died")


def test_failed_put_leaves_nothing(backend: Backend) -> None:
    with pytest.raises(Boom):
        backend.put("fail/obj", failing_chunks())
    assert not backend.exists("fail/obj")
    assert list(backend.list()) == []


def test_failed_overwrite_keeps_old_object(backend: Backend) -> None:
    backend.put("fail/obj", [b"keep me"])
    with pytest.raises(Boom):
        backend.put("fail/obj", failing_chunks())
    assert read(backend, "fail/obj") == b"keep me"
    assert list(backend.list()) == ["fail/obj"]


def test_non_buffer_chunk_is_type_error(backend: Backend) -> None:
    with pytest.raises(TypeError) as info:
        backend.put("t", [b"ok", "text is not bytes"])  # type: ignore[list-item]
    assert isinstance(info.value, InvalidArgument)  # and a SparkCacheError
    assert list(backend.list()) == []


@pytest.mark.parametrize("bad", UNSAFE_KEYS, ids=repr)
def test_unsafe_keys_rejected_by_every_method(backend: Backend, bad: str) -> None:
    with pytest.raises(UnsafeName) as info:
        backend.put(bad, [b"x"])
    assert "key" in str(info.value)
    with pytest.raises(UnsafeName):
        backend.open(bad)
    with pytest.raises(UnsafeName):
        backend.delete(bad)
    with pytest.raises(UnsafeName):
        backend.exists(bad)
    with pytest.raises(UnsafeName):
        backend.size(bad)
    if bad not in ("", "a/"):  # "" lists everything; "a/" is the folder "a"
        with pytest.raises(UnsafeName):
            backend.list(bad)  # raised at the call, before iterating
    assert list(backend.list()) == []


def test_unsafe_name_is_invalid_argument(backend: Backend) -> None:
    with pytest.raises(InvalidArgument):
        backend.open("../etc/passwd")
    with pytest.raises(ValueError):
        backend.open("../etc/passwd")


def test_non_str_key_rejected(backend: Backend) -> None:
    with pytest.raises(UnsafeName):
        backend.exists(b"bytes-key")  # type: ignore[arg-type]


# -- blobs -----------------------------------------------------------------------------


def test_blob_buffer_is_read_only(backend: Backend) -> None:
    backend.put("ro", [b"immutable"])
    with backend.open("ro") as blob:
        with pytest.raises(TypeError):
            blob.buffer[0] = 0
        with pytest.raises(TypeError):
            blob.buffer[1:3] = b"zz"
        assert bytes(blob.buffer) == b"immutable"
    assert read(backend, "ro") == b"immutable"


def test_blob_close_twice_and_closed_buffer(backend: Backend) -> None:
    backend.put("c", [b"data"])
    blob = backend.open("c")
    blob.close()
    blob.close()
    with pytest.raises(ValueError):
        _ = blob.buffer


def test_blob_of_empty_object(backend: Backend) -> None:
    backend.put("empty", [])
    with backend.open("empty") as blob:
        assert len(blob.buffer) == 0
        assert blob.buffer.readonly


def test_numpy_view_of_blob(backend: Backend) -> None:
    backend.put("arr", [_ARRAY])
    with backend.open("arr") as blob:
        restored = np.frombuffer(blob.buffer, dtype=np.float32)
        assert np.array_equal(restored, _ARRAY)
        assert not restored.flags.writeable
        del restored  # consumers release their views before closing


def test_backend_errors_are_os_errors() -> None:
    # Callers that already handle OSError keep working.
    assert issubclass(BackendError, OSError)


# -- ObjectStore: what the shared tier needs (the ``object_store`` fixture's kinds) -------


def test_object_store_satisfies_protocol(object_store: ObjectStore) -> None:
    assert isinstance(object_store, ObjectStore) and isinstance(object_store, Backend)


def test_check_root_accepts_an_existing_root(object_store: ObjectStore) -> None:
    object_store.put("x", [b"1"])  # a memory root exists once something is in it
    object_store.check_root("the test store")


def test_check_root_refuses_a_missing_root(object_store: ObjectStore) -> None:
    assert isinstance(object_store, FsspecBackend)
    if object_store.object_store:
        server = s3_server()
        missing = FsspecBackend("s3://no-such-bucket-sparkcache/store", **server.options)
        with pytest.raises(NotFound, match="bucket 'no-such-bucket-sparkcache' of the test"):
            missing.check_root("the test store")
        with pytest.raises(InvalidArgument, match="names no bucket"):
            FsspecBackend("s3://", **server.options).check_root("the test store")
        return
    missing = FsspecBackend(f"{object_store.url}/no-such-folder")
    with pytest.raises(NotFound, match="the folder of the test store does not exist"):
        missing.check_root("the test store")


def test_read_range(object_store: ObjectStore) -> None:
    object_store.put(KEY, [b"0123456789"])
    assert bytes(object_store.read_range(KEY, 2, 5)) == b"234"
    assert bytes(object_store.read_range(KEY, 8, 20)) == b"89"  # fewer at the end
    assert bytes(object_store.read_range(KEY, 0, 10)) == b"0123456789"
    with pytest.raises(NotFound):
        object_store.read_range("missing", 0, 1)


def test_head(object_store: ObjectStore) -> None:
    object_store.put(KEY, [b"abc"])
    object_store.put("empty", [])
    assert (object_store.head(KEY), object_store.head("empty")) == (3, 0)
    assert object_store.head("missing") is None


@pytest.mark.parametrize(("piece", "sizes"), [(3, [3, 3, 3, 1]), ([2, 5], [2, 5, 3]),
                                              (100, [10])])
def test_read_stream_pieces(object_store: ObjectStore, piece: int | list[int],
                            sizes: list[int]) -> None:
    object_store.put(KEY, [b"0123456789"])
    got = list(object_store.read_stream(KEY, 0, 10, piece))
    assert [len(p) for p in got] == sizes and b"".join(got) == b"0123456789"
    assert b"".join(object_store.read_stream(KEY, 4, 30, 4)) == b"456789"  # shorter object
    assert list(object_store.read_stream(KEY, 5, 5, 4)) == []


def test_read_stream_errors_when_read(object_store: ObjectStore) -> None:
    stream = object_store.read_stream("missing", 0, 10, 4)  # nothing asked yet
    with pytest.raises(NotFound):
        next(stream)
    object_store.put(KEY, [b"0123456789"])
    with pytest.raises(InvalidArgument, match="at least a byte"):
        next(object_store.read_stream(KEY, 0, 10, 0))


def test_stat_list(object_store: ObjectStore) -> None:
    assert object_store.stat_list() == []
    object_store.put("objects/m-1/a", [b"1"])
    object_store.put("objects/m-1/b/c", [b"22"])
    object_store.put("objects/m-12/x", [b"333"])
    stats = object_store.stat_list("objects/m-1")
    assert all(isinstance(s, ObjectStat) and s.mtime >= 0 for s in stats)
    assert sorted((s.key, s.size) for s in stats) == [("objects/m-1/a", 1),
                                                      ("objects/m-1/b/c", 2)]
    assert {s.key for s in object_store.stat_list()} == set(object_store.list())
    object_store.put("objects/m-1/a", [b"4444"])  # never a cached listing
    assert {s.key: s.size for s in object_store.stat_list("objects")}["objects/m-1/a"] == 4


def test_get_many_and_delete_many(object_store: ObjectStore) -> None:
    for i in range(3):
        object_store.put(f"d/{i}", [bytes([i]) * (i + 1)])
    assert object_store.get_many([]) == {}
    assert object_store.get_many(["d/0", "d/2", "d/missing"]) == {"d/0": b"\x00",
                                                                   "d/2": b"\x02" * 3}
    object_store.delete_many(["d/0", "d/1", "d/missing"])
    assert sorted(object_store.list("d")) == ["d/2"]
    object_store.delete_many([])


def test_local_path(object_store: ObjectStore) -> None:
    object_store.put(KEY, [b"here"])
    path = object_store.local_path(KEY)
    if isinstance(object_store, FsspecBackend) and object_store.url.startswith("file://"):
        assert path is not None
        with open(path, "rb") as f:
            assert f.read() == b"here"
    else:
        assert path is None


def test_conditional_writes(object_store: ObjectStore) -> None:
    if not object_store.conditional_writes:
        with pytest.raises(InvalidArgument, match="need S3"):
            object_store.etag("lease")
        with pytest.raises(InvalidArgument, match="need S3"):
            object_store.put_conditional("lease", b"a", None)
        return
    assert object_store.etag("lease") is None
    first = object_store.put_conditional("lease", b"a", None)
    assert first is not None and object_store.etag("lease") == first
    assert object_store.put_conditional("lease", b"b", None) is None  # there already
    second = object_store.put_conditional("lease", b"c", first)
    assert second is not None and object_store.get_many(["lease"]) == {"lease": b"c"}
    assert object_store.put_conditional("lease", b"d", first) is None  # changed meanwhile


@pytest.mark.parametrize("bad", [k for k in UNSAFE_KEYS if k], ids=repr)
def test_unsafe_keys_rejected_by_object_store_methods(object_store: ObjectStore,
                                                      bad: str) -> None:
    with pytest.raises(UnsafeName):
        object_store.head(bad)
    with pytest.raises(UnsafeName):
        object_store.read_range(bad, 0, 1)
    with pytest.raises(UnsafeName):
        next(object_store.read_stream(bad, 0, 1, 1))
    if bad != "a/":  # a prefix names a folder: "a/" is "a", as in ``list``
        with pytest.raises(UnsafeName):
            object_store.stat_list(bad)
    with pytest.raises(UnsafeName):
        object_store.get_many([bad])
    with pytest.raises(UnsafeName):
        object_store.delete_many([bad])
