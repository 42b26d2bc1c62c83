"""The exceptions sparkcache raises.

Every message says what went wrong and what to do about it.  Callers that only
want "did it work" catch :class:`SparkCacheError`.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "CorruptIndex",
    "CorruptSnapshot",
    "InvalidArgument",
    "LeaseError",
    "NotABuffer",
    "NotFound",
    "SchemaMismatch",
    "SparkCacheError",
    "StorageMismatch",
    "StoreClosed",
    "StoreFull",
    "StoreTimeout",
    "UnsafeName",
]


class SparkCacheError(Exception):
    """Base class of every error sparkcache raises on purpose."""


class InvalidArgument(SparkCacheError, ValueError):
    """A caller passed a value the store cannot accept (wrong shape, type, range)."""


class UnsafeName(InvalidArgument):
    """A name or key would escape the store root or is not representable on disk."""


class NotABuffer(InvalidArgument, TypeError):
    """A page, destination or chunk that has no buffer protocol (also a TypeError)."""


class NotFound(SparkCacheError, KeyError):
    """The snapshot, model or object does not exist (any more)."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the sentence.
        return str(self.args[0]) if self.args else "not found"


class CorruptSnapshot(SparkCacheError):
    """A stored payload failed verification; the snapshot was quarantined.

    Readers treat this as a miss and recompute.  ``reason`` is a short machine
    readable tag (``digest``, ``tokens``, ``identity``, ``shape``, ``missing``,
    ``truncated``, ``header``) that is also counted in the index.
    """

    def __init__(self, message: str, reason: str = "corrupt") -> None:
        super().__init__(message)
        self.reason = reason


class StoreFull(SparkCacheError):
    """No room to publish (disk full, below the free-space margin, or over budget)."""


class StorageMismatch(SparkCacheError):
    """The payload storage is not the one the store was created with, or looks wrong."""


class CorruptIndex(SparkCacheError):
    """The index file is damaged or holds rows that break its own rules."""


class SchemaMismatch(SparkCacheError):
    """The index database was written by another schema version."""


class StoreTimeout(SparkCacheError):
    """The index stayed locked by other processes longer than the busy timeout."""


class StoreClosed(SparkCacheError):
    """The store was used after :meth:`SnapshotStore.close`."""


class LeaseError(SparkCacheError):
    """A lease could not be taken or was already released."""


class BackendError(SparkCacheError, OSError):
    """The storage backend failed (I/O error, unknown URL scheme, ...)."""
