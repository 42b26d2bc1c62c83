"""sparkcache: persistent, verified KV-cache snapshots for vLLM, indexed by SQLite."""

from __future__ import annotations

from sparkcache.errors import (
    CorruptSnapshot,
    InvalidArgument,
    SchemaMismatch,
    SparkCacheError,
    StoreFull,
    UnsafeName,
)
from sparkcache.hashing import prefix_hashes, prefix_seed
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.store import Match, PublishResult, SnapshotInfo, SnapshotStore

__version__ = "0.1.0"

__all__ = [
    "CorruptSnapshot",
    "InvalidArgument",
    "Match",
    "ModelIdentity",
    "PublishResult",
    "RequestScope",
    "SchemaMismatch",
    "SnapshotInfo",
    "SnapshotStore",
    "SparkCacheError",
    "StoreFull",
    "UnsafeName",
    "__version__",
    "prefix_hashes",
    "prefix_seed",
]
