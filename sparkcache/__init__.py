"""sparkcache: persistent, verified KV-cache snapshots for vLLM, indexed by SQLite."""

from __future__ import annotations

# Must come before anything imports sqlalchemy (the index schema does).  Python
# runs exit hooks last-registered-first.  sqlalchemy creates a weakref.finalize
# at import, which registers weakref's exit hook; multiprocessing.util registers
# one that joins non-daemon child processes.  Were the latter registered second,
# it would run first and wait forever for vLLM's engine process, whose shutdown
# is itself a weakref.finalize: a script that imports sparkcache and then starts
# vllm.LLM would hang at exit (tests/test_exit.py).
import multiprocessing.util  # noqa: F401

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
from sparkcache.version import VERSION as __version__

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
