"""FsspecBackend on an object store (moto's S3 server): one upload per put, never a bucket.

s3fs's ``makedirs`` creates a missing bucket, and a copy-then-delete ``mv``
doubles every write; on an object store ``put`` writes the key itself, visible
only once committed, and a missing bucket is an error that says what to check.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from sparkcache.backends import FsspecBackend, is_temp_key
from sparkcache.errors import BackendError

from ..s3server import s3_calls
from .conftest import s3_server


def test_put_on_an_object_store_writes_the_key_itself() -> None:
    server = s3_server()
    backend = FsspecBackend(f"s3://{server.bucket()}/store", **server.options)
    assert backend.object_store
    calls: list[str] = []
    real_mv = backend.fs.mv
    backend.fs.mv = lambda *a, **k: calls.append("mv") or real_mv(*a, **k)
    with s3_calls(backend.fs) as sent:
        assert backend.put("a/b.bin", [b"x" * 10, np.arange(4, dtype=np.uint8)]) == 14
    assert calls == []
    assert sent == {"PutObject": 1}
    assert bytes(backend.open("a/b.bin").buffer) == b"x" * 10 + bytes(range(4))
    assert [k for k in backend.list() if is_temp_key(k)] == []


def test_a_failed_upload_is_never_committed() -> None:
    server = s3_server()
    backend = FsspecBackend(f"s3://{server.bucket()}/store", **server.options)

    def chunks():  # type: ignore[no-untyped-def]
        yield b"partial"
        raise RuntimeError("the caller's iterator failed")

    with pytest.raises(RuntimeError, match="caller's iterator"):
        backend.put("k", chunks())
    assert not backend.exists("k")
    assert list(backend.list()) == []


def test_put_into_a_missing_bucket_creates_no_bucket() -> None:
    server = s3_server()
    missing = f"sparkcache-missing-{uuid.uuid4().hex[:12]}"
    backend = FsspecBackend(f"s3://{missing}/store", **server.options)
    with pytest.raises(BackendError, match="bucket exists"):
        backend.put("a/b.bin", [b"x"])
    import s3fs

    buckets = s3fs.S3FileSystem(**server.options).ls("", refresh=True)
    assert missing not in buckets


def test_a_failed_multipart_upload_is_aborted_not_committed() -> None:
    """Past one part (8 MiB) a put is a multipart upload: a failure after parts
    were sent aborts it (no object, no upload left to pay for)."""
    server = s3_server()
    bucket = server.bucket()
    backend = FsspecBackend(f"s3://{bucket}/store", default_block_size=5 << 20,
                            **server.options)

    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(3):
            yield bytes(4 << 20)
        raise RuntimeError("the caller's iterator failed")

    with s3_calls(backend.fs) as sent, pytest.raises(RuntimeError, match="caller's iterator"):
        backend.put("big", chunks())
    assert sent["UploadPart"] >= 1 and sent["AbortMultipartUpload"] == 1
    assert "CompleteMultipartUpload" not in sent
    assert not backend.exists("big")
    uploads = backend.fs.call_s3("list_multipart_uploads", Bucket=bucket)
    assert uploads.get("Uploads", []) == []
    assert backend.put("big", [bytes(6 << 20), b"tail"]) == (6 << 20) + 4  # and one that works
    assert backend.size("big") == (6 << 20) + 4
    with s3_calls(backend.fs) as sent:  # past one part: completed after its last part
        assert backend.put("bigger", (bytes(3 << 20) for _ in range(6))) == 18 << 20
    assert (sent["UploadPart"], sent["CompleteMultipartUpload"]) == (2, 1)  # 9 MiB each
    with backend.open("bigger") as blob:
        assert blob.buffer.nbytes == 18 << 20


def test_head_is_one_request() -> None:
    """A missing object costs one HEAD (``size`` also lists the prefix), an
    existing one returns its size."""
    server = s3_server()
    backend = FsspecBackend(f"s3://{server.bucket()}/store", **server.options)
    backend.put("a/b.json", [b"{}"])
    with s3_calls(backend.fs) as sent:
        assert backend.head("a/b.json") == 2
        assert backend.head("a/missing.json") is None
    assert sent == {"HeadObject": 2}
    memory = FsspecBackend(f"memory://sparkcache-test-{uuid.uuid4().hex}")
    memory.put("x", [b"abc"])
    assert (memory.head("x"), memory.head("y")) == (3, None)


def test_many_objects_at_once_and_conditional_writes() -> None:
    """What the shared tier's sweep uses: one listing with sizes and times, many
    GETs, batched deletes, and S3's If-None-Match / If-Match writes."""
    server = s3_server()
    backend = FsspecBackend(f"s3://{server.bucket()}/store", **server.options)
    for i in range(5):
        backend.put(f"d/{i}.bin", [bytes([i]) * (i + 1)])
    stats = sorted(backend.stat_list("d"))
    assert [(s.key, s.size) for s in stats] == [(f"d/{i}.bin", i + 1) for i in range(5)]
    assert all(abs(s.mtime - time.time()) < 120 for s in stats)
    got = backend.get_many(["d/1.bin", "d/3.bin", "d/missing.bin"])
    assert got == {"d/1.bin": b"\x01" * 2, "d/3.bin": b"\x03" * 4}
    with s3_calls(backend.fs) as sent:
        backend.delete_many([f"d/{i}.bin" for i in range(4)] + ["d/missing.bin"])
    assert sent == {"DeleteObjects": 1}
    assert [s.key for s in backend.stat_list()] == ["d/4.bin"]
    assert backend.conditional_writes and backend.etag("lease") is None
    first = backend.put_conditional("lease", b"a", None)
    assert first is not None and backend.etag("lease") == first
    assert backend.put_conditional("lease", b"b", None) is None  # there already
    second = backend.put_conditional("lease", b"c", first)
    assert second is not None and bytes(backend.open("lease").buffer) == b"c"
    assert backend.put_conditional("lease", b"d", first) is None  # changed meanwhile
    assert bytes(backend.open("lease").buffer) == b"c"
