"""What :class:`~sparkcache.backends.FsspecBackend` needs besides its class.

How a filesystem's failures reach sparkcache's callers (as SparkCacheError),
the time in a listing's entry, and which filesystems are object stores.
:func:`guarded_by` wraps a backend method so that a filesystem's own errors
(botocore's, a cloud SDK's) become ``BackendError`` naming the object, the
URL and what to check, while an error of the caller's own chunk iterator
(marked by :func:`callers_chunks`) passes through as it was raised.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from sparkcache.errors import BackendError, SparkCacheError

if TYPE_CHECKING:
    from sparkcache.backends.base import BufferLike

__all__ = ["OBJECT_STORES", "CallersError", "backend_error", "callers_chunks", "guarded_by",
           "is_object_store", "mtime_of", "protocols"]

#: fsspec protocols of object stores: the first part of a path is a bucket (or
#: container), there are no folders, and an upload is visible only once complete.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})


class CallersError(Exception):
    """Carries an exception the caller's chunk iterator raised through ``put``."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


def callers_chunks(chunks: Iterable[BufferLike]) -> Iterator[BufferLike]:
    """``chunks``, with what iterating them raises marked as the caller's."""
    it = iter(chunks)
    while True:
        try:
            chunk = next(it)
        except StopIteration:
            return
        except Exception as exc:
            raise CallersError(exc) from exc
        yield chunk


P_ = ParamSpec("P_")
R_ = TypeVar("R_")


def guarded_by(action: str) -> Callable[[Callable[P_, R_]], Callable[P_, R_]]:
    """Every failure of the wrapped method is a SparkCacheError: a filesystem's
    own errors (botocore's, a cloud SDK's) become BackendError naming the
    object, the URL and what to check."""
    def wrap(method: Callable[P_, R_]) -> Callable[P_, R_]:
        @functools.wraps(method)
        def guarded(*args: P_.args, **kwargs: P_.kwargs) -> R_:
            try:
                return method(*args, **kwargs)
            except SparkCacheError:
                raise
            except CallersError as wrapped:  # raised by the caller's own code: as it was
                raise wrapped.error from None
            except Exception as exc:
                self, key = args[0], (args[1] if len(args) > 1 else "")
                raise backend_error(action, key, getattr(self, "url", "?"), exc) from exc
        return guarded
    return wrap


def backend_error(action: str, key: object, url: str, exc: Exception) -> BackendError:
    return BackendError(
        f"{action} {key!r} in {url} failed: {type(exc).__name__}: {exc}; check the "
        "endpoint, the credentials and the network (and that the bucket exists)")


def mtime_of(info: dict[str, Any]) -> float:
    """An fsspec listing entry's last-modified time in epoch seconds (0 if none):
    ``LastModified`` (s3fs), ``mtime`` (local), ``updated`` (gcsfs)."""
    for name in ("LastModified", "mtime", "updated", "last_modified", "created"):
        value = info.get(name)
        if isinstance(value, datetime.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=datetime.UTC)
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            with suppress(ValueError):
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return 0.0


def is_object_store(fs: Any) -> bool:
    """Whether an fsspec filesystem is an object store (:data:`OBJECT_STORES`)."""
    return any(p in OBJECT_STORES for p in protocols(fs))


def protocols(fs: Any) -> tuple[str, ...]:
    """An fsspec filesystem's protocol names."""
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
