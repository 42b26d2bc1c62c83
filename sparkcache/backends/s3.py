"""s3fs's client called directly, for what fsspec's API does not say.

:class:`~sparkcache.backends.FsspecBackend` on an S3 (or S3-protocol) store
reaches botocore through ``fs.call_s3`` for four things: a ranged GET whose
body is read piece by piece, a HEAD that is one request, a DeleteObjects whose
per-object errors are checked, and a PUT with a condition (If-None-Match
``*`` or If-Match).  Each function takes the filesystem and fsspec paths and
raises the filesystem's own ``OSError``; the backend turns those into
sparkcache errors, saying what failed where.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import suppress
from typing import Any

from sparkcache.errors import BackendError

__all__ = ["DELETE_BATCH", "S3_CLIENT_DEFAULTS", "condition_failed", "delete_objects",
           "head_object", "is_s3", "put_object", "stream"]

#: Client settings for object stores reached through botocore (s3fs), unless the
#: caller passes its own: an unreachable endpoint is an error within seconds,
#: and a failing request is retried a bounded number of times.
S3_CLIENT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 5, "read_timeout": 60,
    "retries": {"max_attempts": 3, "mode": "standard"},
}
#: Keys deleted per request on an object store (S3's DeleteObjects takes at most 1000).
DELETE_BATCH = 1000


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


def stream(fs: Any, path: str, start: int, end: int, sizes: Iterator[int]) -> Iterator[bytearray]:
    """Bytes ``[start, end)`` of ``path`` from one GET, its body read in pieces
    of ``sizes`` in turn (fewer only at the object's end)."""
    from fsspec.asyn import sync

    bucket, name, _version = fs.split_path(path)
    if end <= start:
        return
    out = fs.call_s3("get_object", Bucket=bucket, Key=name, Range=f"bytes={start}-{end - 1}")
    body = out["Body"]
    try:
        at = start
        while at < end:
            data = sync(fs.loop, _read_exactly, body, min(next(sizes), end - at))
            if not data:
                return
            at += len(data)
            yield data
    finally:
        body.close()


def head_object(fs: Any, path: str) -> dict[str, Any] | None:
    """One HeadObject of ``path`` (its response), or None when there is none."""
    bucket, name, _version = fs.split_path(path)
    try:
        return dict(fs.call_s3("head_object", Bucket=bucket, Key=name))
    except FileNotFoundError:
        return None


def delete_objects(fs: Any, paths: list[str], url: str) -> None:
    """One DeleteObjects of ``paths`` (one bucket); an object it could not
    delete is an error (s3fs's ``rm`` would pass over it, and a sweep must not
    go on to a manifest's segments while the manifest stays)."""
    bucket = fs.split_path(paths[0])[0]
    names = [fs.split_path(p)[1] for p in paths]
    out = fs.call_s3("delete_objects", Bucket=bucket,
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


def put_object(fs: Any, path: str, data: bytes, match: str | None) -> str | None:
    """One PUT of ``path`` only if there is none (``match`` None: If-None-Match
    ``*``) or only if its ETag is still ``match`` (If-Match): the new ETag, or
    None when the condition failed."""
    bucket, name, _version = fs.split_path(path)
    condition = {"IfNoneMatch": "*"} if match is None else {"IfMatch": match}
    try:
        out = fs.call_s3("put_object", Bucket=bucket, Key=name, Body=data, **condition)
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
