"""The backend contract: where the payload bytes of immutable objects live.

A backend stores *objects*: immutable byte strings (segment files of a few KB to a
few GB) under keys validated by :func:`~sparkcache.backends.keys.validate_key`.  The
index (SQLite) decides which objects exist and what they mean; a backend only
moves bytes.  Objects are written once and never modified in place, which is what
lets :class:`MmapBackend <sparkcache.backends.local.MmapBackend>` hand out mapped
views safely.

Every backend passes the shared conformance suite in
``tests/backends/test_conformance.py``; a new backend is added by implementing
:class:`Backend` and calling :func:`sparkcache.backends.register_backend`.
:class:`ObjectStore` is what the shared tier needs on top (docs/shared.md): a
small core, the rest derived from it unless a backend does better.
"""

from __future__ import annotations

import errno
import itertools
import threading
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Self, TypeAlias, runtime_checkable

from sparkcache.errors import BackendError, InvalidArgument, NotFound, SparkCacheError, StoreFull

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Buffer

__all__ = [
    "Backend",
    "Blob",
    "BufferBlob",
    "BufferLike",
    "DiskUsage",
    "ObjectStat",
    "ObjectStore",
    "deadline",
    "piece_sizes",
    "time_left",
    "translate_os_error",
]

BufferLike: TypeAlias = "Buffer | np.ndarray[Any, Any]"
"""What ``put`` accepts as a chunk: anything with the buffer protocol.

numpy arrays are named explicitly because numpy's stubs declare ``__buffer__`` only
for Python >= 3.12, so on 3.11 mypy would not see them as ``Buffer``.
"""

_DEADLINES = threading.local()


@contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Inside the block, every request this thread makes to a remote backend
    ends within ``seconds`` from now, all of them together (each request's own
    bound still applies); a nested block keeps the earlier end.  None adds no
    deadline.  A request past it raises BackendError without being sent."""
    before: float | None = getattr(_DEADLINES, "at", None)
    at = before if seconds is None else time.monotonic() + seconds
    if before is not None and at is not None:
        at = min(at, before)
    _DEADLINES.at = at
    try:
        yield
    finally:
        _DEADLINES.at = before


def time_left() -> float | None:
    """Seconds left of this thread's :func:`deadline` (None: no deadline)."""
    at: float | None = getattr(_DEADLINES, "at", None)
    return None if at is None else at - time.monotonic()


class ObjectStat(NamedTuple):
    """One object as a listing shows it: its key, size and last-modified time
    (seconds since the epoch, the storage's own clock)."""

    key: str
    size: int
    mtime: float


class DiskUsage(NamedTuple):
    """Size and free bytes (for this process) of the medium holding a backend's objects."""

    total: int
    free: int


FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""OS errors that mean "no room": reported as :class:`~sparkcache.errors.StoreFull`."""


@runtime_checkable
class Blob(Protocol):
    """One opened object: a read-only byte view plus the resource behind it.

    ``buffer`` is a read-only, one-dimensional ``memoryview`` of format ``'B'`` over
    the whole object.  It is valid until :meth:`close`; a consumer that made views
    of it (slices, ``numpy.frombuffer``, ...) must drop them before closing,
    otherwise a mapped file stays mapped until those views are garbage collected.
    Closing twice is harmless.  Blobs are context managers.

    A blob may also offer ``read_at(offset, out) -> int``, a positional read of
    the object into a writable buffer (fewer bytes only at its end), as
    :class:`~sparkcache.backends.local.MmapBlob` does; the verified reader then
    reads the bulk of a segment with it instead of through ``buffer``.
    """

    @property
    def buffer(self) -> memoryview:
        """Read-only ``'B'`` view of the whole object (raises ValueError once closed)."""
        ...

    def close(self) -> None:
        """Release the view and whatever backs it; idempotent."""
        ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """Storage of immutable objects under validated keys.

    Contract shared by every implementation (and checked by the conformance suite):

    * every method validates its key (or non-empty ``list`` prefix) with
      ``validate_key`` first and raises :class:`~sparkcache.errors.UnsafeName`
      before any I/O;
    * missing objects raise :class:`~sparkcache.errors.NotFound` from ``open`` and
      ``size``; ``delete`` and ``exists`` report them instead;
    * "no space" errors surface as :class:`~sparkcache.errors.StoreFull`, other
      storage failures as :class:`~sparkcache.errors.BackendError`;
    * a folder is not an object: ``exists`` is False for it and ``open`` raises
      ``NotFound``.
    """

    url: str
    """URL that :func:`~sparkcache.backends.open_backend` turns back into this backend."""

    zero_copy: bool
    """True when :meth:`open` maps the stored bytes instead of copying them."""

    def put(self, key: str, chunks: Iterable[BufferLike], *, durable: bool = True) -> int:
        """Store the concatenation of ``chunks`` under ``key``; return bytes written.

        Atomic: concurrent readers see the old object or the complete new one, never a
        partial one.  The bytes go to a temp object (:func:`temp_key`) first, which
        is published by a rename; an object store, whose uploads become visible only
        once complete, may write ``key`` directly and never makes a bucket.  On any
        failure -- including an exception raised by
        the ``chunks`` iterator -- the temp object is removed and the error re-raised
        (``StoreFull`` for a full disk or quota, ``BackendError`` for other OS
        errors).  ``durable=True`` means the object survives a power cut once
        ``put`` returns, where the medium can promise that.
        """
        ...

    def open(self, key: str) -> Blob:
        """Open the object for reading; ``NotFound`` if it does not exist."""
        ...

    def delete(self, key: str) -> bool:
        """Remove the object; True if it existed.  A missing object is not an error."""
        ...

    def exists(self, key: str) -> bool:
        """True if an object is stored under ``key``."""
        ...

    def list(self, prefix: str = "") -> Iterator[str]:
        """Every key under folder ``prefix`` ("" for all), temp keys included, any order.

        ``prefix`` names a folder: ``list("objects/m-1")`` finds
        ``objects/m-1/ab/x`` but not ``objects/m-12/x``.  The prefix is validated
        when ``list`` is called, not when the iterator is first advanced.
        """
        ...

    def size(self, key: str) -> int:
        """Size of the object in bytes; ``NotFound`` if it does not exist."""
        ...

    def folders(self, prefix: str) -> Iterator[str]:
        """Keys of the folders directly inside folder ``prefix`` (not recursive).

        ``folders("objects")`` yields ``objects/m-1``, ``objects/m-2``, ...; a
        missing ``prefix`` yields nothing.  Names that are not valid keys are skipped.
        """
        ...

    def remove_tree(self, prefix: str) -> int:
        """Delete every object under folder ``prefix``, then the folder itself where
        the medium has folders; return the number of objects deleted.

        For a folder nothing writes to any more (a deleted model's); a missing
        folder is not an error.
        """
        ...

    def disk_usage(self) -> DiskUsage | None:
        """Total and free bytes of the medium holding the objects, or None if unknown."""
        ...

    def close(self) -> None:
        """Release the backend's resources; idempotent.  Open blobs stay usable."""
        ...


@runtime_checkable
class ObjectStore(Backend, Protocol):
    """A :class:`Backend` with what the shared tier needs (docs/shared.md).

    The core a backend implements: :meth:`check_root`, :meth:`read_range` and
    :meth:`stat_list`.  The rest has defaults derived from the core and from
    :class:`Backend` (``rm`` loops ``rm_file`` in fsspec's way), which a
    backend overrides where its medium does better (one HEAD, one streamed
    GET, batched deletes, S3's conditional writes).  A backend that wants the
    defaults subclasses this protocol.  Errors as :class:`Backend`'s.
    """

    # -- the core ---------------------------------------------------------------------

    def check_root(self, name: str) -> None:
        """Check, creating nothing, that the place the keys live exists: the
        bucket on an object store, the root folder elsewhere.  ``name`` is how
        messages call the storage.  ``NotFound`` when it does not exist,
        ``InvalidArgument`` when the URL names no bucket (or not a bucket or
        folder), ``BackendError`` when the storage cannot be asked."""
        ...

    def read_range(self, key: str, start: int, end: int) -> bytes | bytearray:
        """Bytes ``[start, end)`` of the object, fewer where it is shorter;
        ``NotFound`` if it does not exist."""
        ...

    def stat_list(self, prefix: str = "") -> list[ObjectStat]:
        """Every object under folder ``prefix`` ("" for all) with its size and
        last-modified time, from one listing, never cached; as :meth:`list`."""
        ...

    # -- derived ----------------------------------------------------------------------

    def head(self, key: str) -> int | None:
        """The object's size, or None when there is none (one request where the
        medium allows)."""
        try:
            return self.size(key)
        except NotFound:
            return None

    def read_stream(self, key: str, start: int, end: int,
                    piece: int | Sequence[int]) -> Generator[bytes | bytearray, None, None]:
        """Bytes ``[start, end)`` of the object in pieces of ``piece`` bytes, or
        of the sizes ``piece`` lists in turn (its last again once they run out);
        every piece but the last whole, all shorter where the object is.
        Memory is a piece, not the range; errors as :meth:`read_range` raises
        them, when the piece that meets them is read.  By default one ranged
        read per piece."""
        sizes = piece_sizes(piece)
        at = start
        while at < end:
            data = self.read_range(key, at, min(at + next(sizes), end))
            if not data:
                return
            at += len(data)
            yield data

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The bytes of each of ``keys`` that exists; missing ones are left out."""
        out: dict[str, bytes] = {}
        for key in keys:
            with suppress(NotFound), self.open(key) as blob:
                out[key] = bytes(blob.buffer)
        return out

    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete every one of ``keys``; missing ones are no error."""
        for key in keys:
            self.delete(key)

    def local_path(self, key: str) -> str | None:
        """The path of ``key`` on this host's own filesystem, or None when the
        objects are not files here (the default)."""
        return None

    @property
    def conditional_writes(self) -> bool:
        """Whether :meth:`etag` and :meth:`put_conditional` work (default: no)."""
        return False

    def etag(self, key: str) -> str | None:
        """The object's ETag, or None when there is none; ``InvalidArgument``
        without :attr:`conditional_writes`."""
        raise InvalidArgument(f"{self.url} has no ETags: conditional writes need S3")

    def put_conditional(self, key: str, data: bytes, match: str | None) -> str | None:
        """Write a small object only if there is none (``match`` None) or only
        if its ETag is still ``match``: the new ETag, or None when the condition
        failed (another writer came first); ``InvalidArgument`` without
        :attr:`conditional_writes`."""
        raise InvalidArgument(f"{self.url} has no conditional writes: they need S3")


def piece_sizes(piece: int | Sequence[int]) -> Iterator[int]:
    """The sizes of a stream's pieces: ``piece``'s in turn, then its last forever."""
    sizes = [piece] if isinstance(piece, int) else list(piece)
    if not sizes or min(sizes) < 1:
        raise InvalidArgument(f"a stream's pieces must be at least a byte, not {sizes[:4]}")
    return itertools.chain(sizes, itertools.repeat(sizes[-1]))


class BufferBlob:
    """A :class:`Blob` over bytes already in memory (the copying backends' blob)."""

    __slots__ = ("_view",)

    def __init__(self, data: bytes | bytearray) -> None:
        self._view: memoryview | None = memoryview(data).toreadonly()

    @property
    def buffer(self) -> memoryview:
        if self._view is None:
            raise ValueError("blob is closed; open the object again to read it")
        return self._view

    def close(self) -> None:
        view, self._view = self._view, None
        if view is not None:
            # A consumer still holding an export keeps the bytes alive; that is fine,
            # the memory is ordinary heap, so ignore the refusal.
            with suppress(BufferError):
                view.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def translate_os_error(
    exc: OSError, action: str, key: str, where: str, *, missing_is_not_found: bool = True
) -> SparkCacheError:
    """Map an ``OSError`` to the sparkcache error a caller should see.

    ``action`` is a verb phrase ("writing", "reading"), ``where`` the backend URL;
    both go into the message so it says what failed and where.  The caller raises
    the result ``from exc`` so the original stays in the traceback.  Writers pass
    ``missing_is_not_found=False``: a vanished folder under a write is a storage
    failure, not a missing object.
    """
    if isinstance(exc, SparkCacheError):
        return exc
    if exc.errno in FULL_ERRNOS:
        what = "disk quota exceeded" if exc.errno == errno.EDQUOT else "disk is full"
        return StoreFull(
            f"{what} while {action} object {key!r} in {where}: free space on that "
            "filesystem (evict old snapshots or lower the store's size budget) or point "
            "the store at a larger disk, then retry"
        )
    if missing_is_not_found and isinstance(exc, FileNotFoundError):
        return NotFound(f"no object {key!r} in {where}")
    return BackendError(
        f"storage error while {action} object {key!r} in {where}: {exc}; check that the "
        "store's disk is mounted, writable and healthy"
    )
