"""FsspecBackend on an object store (moto's S3 server): one upload per put, never a bucket.

s3fs's ``makedirs`` creates a missing bucket, and a copy-then-delete ``mv``
doubles every write; on an object store ``put`` writes the key itself, visible
only once committed, and a missing bucket is an error that says what to check.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from sparkcache.backends import FsspecBackend, is_temp_key
from sparkcache.errors import BackendError

from .conftest import s3_server


def test_put_on_an_object_store_writes_the_key_itself() -> None:
    server = s3_server()
    backend = FsspecBackend(f"s3://{server.bucket()}/store", **server.options)
    assert backend.object_store
    calls: list[str] = []
    real_mv = backend.fs.mv
    backend.fs.mv = lambda *a, **k: calls.append("mv") or real_mv(*a, **k)
    assert backend.put("a/b.bin", [b"x" * 10, np.arange(4, dtype=np.uint8)]) == 14
    assert calls == []
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
