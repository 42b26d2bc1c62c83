"""s3fs's client called directly, for what fsspec's API does not say.

:class:`~sparkcache.backends.FsspecBackend` on an S3 (or S3-protocol) store
reaches botocore through ``fs.call_s3`` for every request, so that each has
one deadline: a ranged GET whose body is read piece by piece, a HEAD that is
one request, a listing one page per request, a DeleteObjects whose
per-object errors are checked, a PUT with a condition (If-None-Match ``*`` or
If-Match), and an upload (one PUT, or a multipart upload of
:data:`PART_BYTES` parts, aborted on failure).  Each function takes the
filesystem, fsspec paths and ``limit``, which gives the timeout of each
request as it is sent (retries included: botocore's and s3fs's own, which
the timeout cancels), and raises the filesystem's own ``OSError`` (a
timeout is a ``TimeoutError``); the backend turns those into sparkcache
errors, saying what failed where.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from typing import Any

from sparkcache.errors import BackendError

__all__ = [
    "DELETE_BATCH",
    "PART_BYTES",
    "REQUEST_SECONDS",
    "S3_CLIENT_DEFAULTS",
    "Limit",
    "condition_failed",
    "delete_objects",
    "find",
    "head_object",
    "is_s3",
    "list_objects",
    "put_object",
    "read_object",
    "stream",
    "upload",
]

#: Client settings for object stores reached through botocore (s3fs), unless the
#: caller passes its own: an unreachable endpoint is an error within seconds,
#: and a failing request is retried a bounded number of times.
S3_CLIENT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 5, "read_timeout": 60,
    "retries": {"max_attempts": 3, "mode": "standard"},
}
#: Keys deleted per request on an object store (S3's DeleteObjects takes at most 1000).
DELETE_BATCH = 1000
#: The most one request may take, its retries included, unless the backend is
#: given another bound (a silent endpoint costs this, not retries x timeouts).
REQUEST_SECONDS = 60.0
#: Bytes per part of a multipart upload (S3: at least 5 MiB but the last).
PART_BYTES = 8 << 20
#: The timeout of an abort after a failed upload (best effort).
_ABORT_SECONDS = 5.0
#: Gives the timeout of the next request in seconds (None: none), or raises
#: when the caller's deadline passed.
Limit = Callable[[], "float | None"]


def _call(fs: Any, limit: Limit, method: str, **kwargs: Any) -> Any:
    """One request through s3fs (``fs.call_s3``), cancelled at ``limit()``."""
    return fs.call_s3(method, timeout=limit(), **kwargs)


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is s3fs's (it has botocore's client behind ``call_s3``)."""
    return hasattr(fs, "call_s3")


async def _read_exactly(body: Any, size: int) -> bytearray:
    """Up to ``size`` bytes of an aiobotocore body: fewer only at its end."""
    out = bytearray(size)  # each chunk copied once into place, never regrown
    view = memoryview(out)
    at = 0
    while at < size:
        chunk = await body.read(size - at)
        if not chunk:
            del view
            del out[at:]
            break
        view[at:at + len(chunk)] = chunk
        at += len(chunk)
    return out


def stream(fs: Any, path: str, start: int, end: int, sizes: Iterator[int],
           limit: Limit) -> Iterator[bytearray]:
    """Bytes ``[start, end)`` of ``path`` from one GET, its body read in pieces
    of ``sizes`` in turn (fewer only at the object's end), each within ``limit``."""
    from fsspec.asyn import sync

    bucket, name, _version = fs.split_path(path)
    if end <= start:
        return
    out = _call(fs, limit, "get_object", Bucket=bucket, Key=name,
                Range=f"bytes={start}-{end - 1}")
    body = out["Body"]
    try:
        at = start
        while at < end:
            data = sync(fs.loop, _read_exactly, body, min(next(sizes), end - at),
                        timeout=limit())
            if not data:
                return
            at += len(data)
            yield data
    finally:
        body.close()


def read_object(fs: Any, path: str, limit: Limit) -> bytearray:
    """The whole object, from one GET read in pieces of :data:`PART_BYTES`, each
    within ``limit`` (a large object is not one request's worth of time);
    FileNotFoundError when there is none."""
    head = head_object(fs, path, limit)
    if head is None:
        raise FileNotFoundError(path)
    size = int(head["ContentLength"])
    out = bytearray(size)
    at = 0
    for piece in stream(fs, path, 0, size, iter(lambda: PART_BYTES, 0), limit):
        out[at:at + len(piece)] = piece
        at += len(piece)
    del out[at:]  # shorter: it changed meanwhile (a reader checks the size)
    return out


def head_object(fs: Any, path: str, limit: Limit) -> dict[str, Any] | None:
    """One HeadObject of ``path`` (its response), or None when there is none."""
    bucket, name, _version = fs.split_path(path)
    try:
        return dict(_call(fs, limit, "head_object", Bucket=bucket, Key=name))
    except FileNotFoundError:
        return None


def list_objects(fs: Any, path: str, limit: Limit) -> Iterator[dict[str, Any]]:
    """Every object under folder ``path`` (ListObjectsV2's ``Contents`` entries:
    ``Key``, ``Size``, ``LastModified``), one request per page of 1000."""
    bucket, prefix, _version = fs.split_path(path)
    prefix = f"{prefix.rstrip('/')}/" if prefix else ""
    token: str | None = None
    while True:
        more = {} if token is None else {"ContinuationToken": token}
        out = _call(fs, limit, "list_objects_v2", Bucket=bucket, Prefix=prefix, **more)
        yield from out.get("Contents") or ()
        token = out.get("NextContinuationToken")
        if not out.get("IsTruncated") or not token:
            return


def find(fs: Any, path: str, limit: Limit) -> dict[str, dict[str, Any]]:
    """Every object under folder ``path`` as ``fs.find(detail=True)`` gives it
    (by path: its ``size`` and ``LastModified``), one request per page."""
    bucket = fs.split_path(path)[0]
    try:
        return {f"{bucket}/{o['Key']}": {"type": "file", "size": o.get("Size"),
                                        "LastModified": o.get("LastModified")}
                for o in list_objects(fs, path, limit)}
    except FileNotFoundError:  # no such bucket: nothing under it
        return {}


def upload(fs: Any, path: str, chunks: Iterable[memoryview], limit: Limit) -> int:
    """Write ``path`` from ``chunks``: one PUT up to :data:`PART_BYTES`, else a
    multipart upload, visible only once completed after its last part and
    aborted on any failure (the caller's iterator's included).  Its size."""
    bucket, name, _version = fs.split_path(path)
    part, upload_id, total = bytearray(), None, 0
    parts: list[dict[str, Any]] = []
    try:
        for chunk in chunks:
            part += chunk
            total += chunk.nbytes
            if len(part) >= PART_BYTES:
                if upload_id is None:
                    upload_id = _call(fs, limit, "create_multipart_upload", Bucket=bucket,
                                      Key=name)["UploadId"]
                out = _call(fs, limit, "upload_part", Bucket=bucket, Key=name, Body=part,
                            UploadId=upload_id, PartNumber=len(parts) + 1)
                parts.append({"PartNumber": len(parts) + 1, "ETag": out["ETag"]})
                part = bytearray()
        if upload_id is None:
            _call(fs, limit, "put_object", Bucket=bucket, Key=name, Body=part)
            return total
        if part:
            out = _call(fs, limit, "upload_part", Bucket=bucket, Key=name, Body=part,
                        UploadId=upload_id, PartNumber=len(parts) + 1)
            parts.append({"PartNumber": len(parts) + 1, "ETag": out["ETag"]})
        _call(fs, limit, "complete_multipart_upload", Bucket=bucket, Key=name,
              UploadId=upload_id, MultipartUpload={"Parts": parts})
        upload_id = None
    finally:
        if upload_id is not None:  # failed: never completed, its parts dropped
            with suppress(Exception):
                _call(fs, lambda: _ABORT_SECONDS, "abort_multipart_upload", Bucket=bucket,
                      Key=name, UploadId=upload_id)
        with suppress(Exception):
            fs.invalidate_cache(path)
    return total


def delete_objects(fs: Any, paths: list[str], url: str, limit: Limit) -> None:
    """One DeleteObjects of ``paths`` (one bucket); an object it could not
    delete is an error (s3fs's ``rm`` would pass over it, and a sweep must not
    go on to a manifest's segments while the manifest stays)."""
    bucket = fs.split_path(paths[0])[0]
    names = [fs.split_path(p)[1] for p in paths]
    out = _call(fs, limit, "delete_objects", Bucket=bucket,
                Delete={"Objects": [{"Key": n} for n in names], "Quiet": True})
    for path in paths:
        with suppress(Exception):
            fs.invalidate_cache(path)
    errors = out.get("Errors") or []
    if errors:
        first = errors[0]
        raise BackendError(
            f"deleting {len(errors)} of {len(paths)} objects in {url} failed, "
            f"{first.get('Key')!r} first: {first.get('Code')}: {first.get('Message')}; "
            "check that the credentials may delete objects (s3:DeleteObject)")


def put_object(fs: Any, path: str, data: bytes, match: str | None,
               limit: Limit) -> str | None:
    """One PUT of ``path`` only if there is none (``match`` None: If-None-Match
    ``*``) or only if its ETag is still ``match`` (If-Match): the new ETag, or
    None when the condition failed."""
    bucket, name, _version = fs.split_path(path)
    condition = {"IfNoneMatch": "*"} if match is None else {"IfMatch": match}
    try:
        out = _call(fs, limit, "put_object", Bucket=bucket, Key=name, Body=data, **condition)
    except OSError as exc:
        if condition_failed(exc):
            return None
        raise
    finally:
        with suppress(Exception):
            fs.invalidate_cache(path)
    return str(out["ETag"])


def condition_failed(exc: BaseException) -> bool:
    """Whether a conditional write failed on its condition (HTTP 412, or 409 when
    a concurrent conditional write to the key is in flight), not for another reason."""
    if isinstance(exc, FileExistsError):
        return True
    cause = exc.__cause__ or exc.__context__
    response = getattr(cause, "response", None)
    if not isinstance(response, dict):
        return False
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)
