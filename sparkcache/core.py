"""The narrow core that every store helper takes: index, backend, clock, counters.

:class:`Core` is what the verified reader, maintenance, retention, publishing
and lookups need of a store, and nothing more: the index (:meth:`Core.read`,
:meth:`Core.write`, whose committed transaction may delete files afterwards),
the payload backend, the clock and the counters not yet saved.  It also holds
the rows those helpers share, read through named types, and the resolution of
a model identity to its row.  :class:`~sparkcache.store.SnapshotStore` is a
facade over these pieces; none of them ever receives the facade.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar, cast

import apsw
import numpy as np

from sparkcache.backends import Backend
from sparkcache.errors import SparkCacheError, StoreClosed, StoreFull, StoreTimeout
from sparkcache.holders import holder_alive
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.index import queries as q
from sparkcache.index.db import Database

__all__ = [
    "DEFAULT_INDEX_RESERVE",
    "INDEX_FILE",
    "KEEP_HOLDER",
    "KEEP_LEASE",
    "OBJECTS",
    "RESERVE_FILE",
    "ChainLink",
    "Conn",
    "Core",
    "LeaseInfo",
    "Match",
    "ModelInfo",
    "PublishPolicy",
    "SegmentInfo",
    "SnapshotInfo",
    "ids",
    "lease_blocks",
    "model_folder",
    "scalar",
    "select_all",
    "select_one",
]

INDEX_FILE = "index.sqlite"
OBJECTS = "objects"
#: A file beside the index holding disk space back for the index's own writes:
#: when that disk is full, eviction deletes it to run (and frees payloads).
RESERVE_FILE = "index.reserve"
DEFAULT_INDEX_RESERVE = 4 << 20

Conn = apsw.Connection
"""An open index connection inside :meth:`Core.read` or :meth:`Core.write`."""

RowT = TypeVar("RowT")


def select_all(conn: Conn, sql: str, params: Sequence[Any] = (), *,
               into: Callable[..., RowT]) -> list[RowT]:
    """Every row of a query as a named type: ``into`` takes the columns in order
    (a row dataclass whose fields follow the statement's column list)."""
    return [into(*row) for row in cast("Iterable[tuple[Any, ...]]", conn.execute(sql, params))]


def select_one(conn: Conn, sql: str, params: Sequence[Any] = (), *,
               into: Callable[..., RowT]) -> RowT | None:
    """The first row of a query as a named type, or None."""
    row = cast("tuple[Any, ...] | None", conn.execute(sql, params).fetchone())
    return None if row is None else into(*row)


def scalar(conn: Conn, sql: str, params: Sequence[Any] = ()) -> int:
    """The integer a one-row, one-column query returns (``count(*)``, ``RETURNING id``)."""
    row = conn.execute(sql, params).fetchone()
    if row is None:  # pragma: no cover - aggregates and RETURNING always yield a row
        raise SparkCacheError(f"the index returned no row for {sql.split()[0]}")
    return int(cast("int", row[0]))


def ids(conn: Conn, sql: str, params: Sequence[Any] = ()) -> list[int]:
    """The first column of every row, as integers (snapshot ids)."""
    return [int(cast("int", row[0])) for row in conn.execute(sql, params)]


def model_folder(identity: ModelIdentity) -> str:
    """The backend folder holding one model's segments (a digest, never a name)."""
    return f"{OBJECTS}/m-{identity.digest()}"


#: The lease kind of a kept snapshot (an API breakpoint's ``ttl``): retention
#: respects it like any lease, an explicit clear or delete does not.
KEEP_LEASE: Final = "keep"
#: Its holder: no process, so it lasts its whole ttl, across restarts.
KEEP_HOLDER: Final = "cache_control"


def lease_blocks(holder: str, expires_at: float, now: float) -> bool:
    """Whether a lease still protects its snapshot: unexpired, and its holder is
    not a dead process on this host (a SIGKILLed worker blocks nothing)."""
    return expires_at > now and holder_alive(holder) is not False


# -- rows ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotInfo:
    """One ``snapshots`` row (``queries.SNAPSHOT_COLUMNS``)."""

    id: int
    model_id: int
    snap_key: str
    n_tokens: int
    start_token: int
    parent_id: int | None
    depth: int
    world_size: int
    nbytes: int
    state: str
    reason: str | None
    pinned: bool
    created_at: float
    last_used: float
    use_count: int
    # The RequestScope's canonical JSON that seeded its prefix hashes; None for a
    # snapshot published before the index recorded scopes (revision 0004).
    scope_json: str | None
    # When its manifest reached the shared tier (revision 0006); None: not uploaded.
    uploaded_at: float | None = None
    # The tenant whose request published it (revision 0009); None: none.
    tenant: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pinned", bool(self.pinned))  # SQLite stores 0 or 1


@dataclass(frozen=True)
class ModelInfo:
    """One ``models`` row (``queries.MODEL_COLUMNS``)."""

    id: int
    digest: str
    name: str
    folder: str
    identity_json: str
    created_at: float
    deleted_at: float | None

    def identity(self) -> ModelIdentity:
        return ModelIdentity.from_dict(json.loads(self.identity_json))


@dataclass(frozen=True)
class LeaseInfo:
    """One ``leases`` row (``queries.LEASE_COLUMNS``)."""

    id: int
    snapshot_id: int
    holder: str
    kind: str
    created_at: float
    expires_at: float

    def blocks(self, now: float) -> bool:
        """Whether this lease protects its snapshot at ``now`` (:func:`lease_blocks`)."""
        return lease_blocks(self.holder, self.expires_at, now)


@dataclass(frozen=True)
class SegmentInfo:
    """One ``segments`` row (``queries.SEGMENT_COLUMNS``): one rank's file of a snapshot."""

    snapshot_id: int
    rank: int
    object_key: str
    token_start: int
    token_end: int
    nbytes: int
    digest: str | None
    state: str
    created_at: float


@dataclass(frozen=True)
class ChainLink:
    """One link of a copy-on-write chain (``queries.CHAIN``): its own token range."""

    id: int
    start: int
    end: int
    snap_key: str
    state: str


@dataclass(frozen=True)
class Match:
    """A lookup hit: ``n_tokens`` of the prompt can be restored from ``snapshot_id``."""

    snapshot_id: int
    n_tokens: int
    identity: ModelIdentity
    token_ids: np.ndarray  # the prompt's first n_tokens, uint32
    scope: RequestScope | None = None
    #: Made by the store's own lookup (or grown from one; a worker rebuilding
    #: its scheduler's match says so too): stored token ids that differ from
    #: ``token_ids`` are then damage (quarantined), not the caller's mistake.
    from_lookup: bool = False

    @property
    def n_blocks(self) -> int:
        return self.n_tokens // self.identity.block_size


class PublishPolicy(Protocol):
    """What a publish asks of a retention policy (:class:`~sparkcache.retention.Retention`)."""

    def refuse(self, core: Core, n_tokens: int, nbytes: int) -> str | None:
        """Why a snapshot of ``n_tokens`` (``nbytes`` on this rank) must not be
        saved, as a sentence, or None to save it."""
        ...

    def after_publish(self, core: Core, model_id: int, snapshot_id: int) -> object:
        """Trim the model after ``snapshot_id`` was saved, never evicting that one."""
        ...


# -- the core -----------------------------------------------------------------------


#: When a verified read's counts could not be saved at once (another process
#: held the write lock), the first retry is this many seconds later.
RETRY_SAVE_SECONDS = 0.5
MAX_RETRY_SAVE_SECONDS = 30.0


class Core:
    """One open store's index, backend, clock and unsaved counters.

    Thread-safe.  :meth:`write` saves what was counted since the last write
    (:meth:`count`, :meth:`record_use`: outside any transaction) and runs the
    deletions scheduled with :meth:`delete_after_commit` once it committed,
    after both locks are free.  Never use it after :meth:`close`.
    """

    def __init__(self, root: Path, db: Database, backend: Backend,
                 clock: Callable[[], float], *,
                 index_reserve: int = DEFAULT_INDEX_RESERVE) -> None:
        self.root = root
        self.backend = backend
        self.clock = clock
        self.index_reserve = index_reserve
        self._db: Database | None = db
        self._lock = threading.RLock()
        self._unsaved: Counter[tuple[int, str]] = Counter()
        self._uses: dict[int, tuple[float, int]] = {}  # snapshot -> (last use, uses)
        self._retry: threading.Timer | None = None  # saves what record_use could not

    @property
    def db(self) -> Database:
        if self._db is None:
            raise StoreClosed("this SnapshotStore was closed; open a new one")
        return self._db

    # -- transactions --------------------------------------------------------------------

    @contextmanager
    def write(self, *, wait: bool | float = True) -> Iterator[Conn]:
        """A write transaction (``BEGIN IMMEDIATE``; nested: a savepoint).

        ``wait=False`` raises StoreTimeout at once when another process holds
        the write lock, instead of waiting up to the busy timeout; a number
        of seconds waits at most that long."""
        after: list[Callable[[], object]] = []
        with self._lock, self.db.write(after, wait=wait) as conn:
            if self._unsaved:
                conn.executemany(q.BUMP_COUNTER, [(model_id, name, value) for
                                                  (model_id, name), value in self._unsaved.items()])
                self._unsaved.clear()
            if self._uses:
                conn.executemany(q.RECORD_USE, [(when, uses, sid) for
                                                sid, (when, uses) in self._uses.items()])
                self._uses.clear()
            yield conn
        # Files the transaction stopped naming go once both locks are free:
        # lookups in other threads need not wait for the unlinks.
        self.db.run_callbacks(after)

    @contextmanager
    def read(self) -> Iterator[Conn]:
        """A read transaction: one consistent view for several queries."""
        with self._lock, self.db.read() as conn:
            yield conn

    def delete_after_commit(self, keys: Iterable[str]) -> None:
        """Delete these objects once the enclosing :meth:`write` committed (never
        on rollback).  A crash in between leaves orphans that ``check`` reclaims."""
        for key in keys:
            self.db.on_commit(functools.partial(self.delete_object, key))

    def delete_object(self, key: str) -> None:
        """Delete one object now; a failure leaves an orphan for ``check(fix=True)``."""
        with contextlib.suppress(OSError, SparkCacheError):
            self.backend.delete(key)

    # -- counters ------------------------------------------------------------------------

    def count(self, model_id: int, name: str, value: int = 1) -> None:
        """Count outside a transaction; saved with the next write."""
        with self._lock:
            self._unsaved[(model_id, name)] += value

    def record_use(self, snapshot_ids: Iterable[int], model_id: int,
                   counts: dict[str, int], *, later: bool = False) -> None:
        """A restore that succeeded: the snapshots it read were used now (their
        ``last_used`` and ``use_count``), and ``counts`` are added to the model's
        counters.  Saved now if the write lock is free at once, else with the
        next write: a verified read is a hit even while another process holds
        the lock, and it never waits for it.  ``later``: only kept, for the
        caller's :meth:`save_counts` (or the next write), once nobody waits
        for the restore."""
        now = self.clock()
        with self._lock:
            for sid in snapshot_ids:
                _when, uses = self._uses.get(sid, (now, 0))
                self._uses[sid] = (now, uses + 1)
            for name, value in counts.items():
                self._unsaved[(model_id, name)] += value
        if not later:
            self.save_counts()

    def save_counts(self, *, wait: float = 0.0) -> None:
        """Save what was counted now if the locks are free within ``wait``
        seconds (0: at once), else :data:`RETRY_SAVE_SECONDS` later on a timer
        thread (or with the next write)."""
        if not self.try_save(wait=wait):
            self._save_later(RETRY_SAVE_SECONDS)

    def _save_later(self, delay: float) -> None:
        """Try again in ``delay`` seconds (doubling, up to :data:`MAX_RETRY_SAVE_SECONDS`),
        on a timer thread: a reader that does no writes of its own (a worker that
        only restores) would otherwise keep its counts until it closes."""
        with self._lock:
            if self._retry is not None or self._db is None:
                return
            self._retry = threading.Timer(delay, self._retry_save, (delay,))
            self._retry.daemon = True
            self._retry.start()

    def _retry_save(self, delay: float) -> None:
        with self._lock:
            self._retry = None
            if self._db is None or not (self._unsaved or self._uses):
                return
        try:
            saved = self.try_save()
        except SparkCacheError:  # closed meanwhile: close saved what it could
            return
        if not saved:
            self._save_later(min(2 * delay, MAX_RETRY_SAVE_SECONDS))

    def try_save(self, *, wait: float = 0.0) -> bool:
        """Save what was counted, if the locks are free within ``wait`` seconds
        (0: at once); False if not (the next write saves it)."""
        if not self._lock.acquire(timeout=wait):  # (0: does not block)
            return False
        try:
            with self.write(wait=wait):  # (0.0: the busy timeout is 0 as well)
                pass
        except (StoreTimeout, StoreFull, StoreClosed):  # (closed: close saved what it could)
            return False
        finally:
            self._lock.release()
        return True

    def counter_totals(self, model_id: int | None = None) -> dict[str, int]:
        """Every counter, summed over models (or of ``model_id``), this process's
        unsaved counts included (a write saves them first)."""
        totals: Counter[str] = Counter()
        with self.write() as conn:
            for mid, name, value in conn.execute(q.COUNTERS):
                if model_id is None or mid == model_id:
                    totals[name] += int(value)
        return dict(totals)

    # -- models and rows -----------------------------------------------------------------

    @staticmethod
    def model_id(conn: Conn, identity: ModelIdentity) -> int | None:
        """The live model row of ``identity``, or None."""
        found = ids(conn, q.MODEL_BY_DIGEST, (identity.digest(),))
        return found[0] if found else None

    def ensure_model(self, conn: Conn, identity: ModelIdentity) -> int:
        """The model row of ``identity``, created (or undeleted) inside a write."""
        return scalar(conn, q.INSERT_MODEL,
                      (identity.digest(), identity.model, model_folder(identity),
                       identity.canonical(), self.clock()))

    @staticmethod
    def usage(conn: Conn, model_id: int | None = None) -> tuple[int, int]:
        """(snapshots, bytes) of one model, or of every model together."""
        row = (conn.execute(q.TOTAL_USAGE) if model_id is None
               else conn.execute(q.MODEL_USAGE, (model_id,))).fetchone()
        return (0, 0) if row is None else (int(cast("int", row[0])), int(cast("int", row[1])))

    @staticmethod
    def model(conn: Conn, model_id: int) -> ModelInfo | None:
        return select_one(conn, q.MODEL_BY_ID, (model_id,), into=ModelInfo)

    @staticmethod
    def snapshot(conn: Conn, snapshot_id: int) -> SnapshotInfo | None:
        return select_one(conn, q.SNAPSHOT_BY_ID, (snapshot_id,), into=SnapshotInfo)

    @staticmethod
    def segment(conn: Conn, snapshot_id: int, rank: int) -> SegmentInfo | None:
        return select_one(conn, q.SEGMENT, (snapshot_id, rank), into=SegmentInfo)

    @staticmethod
    def segments(conn: Conn, snapshot_id: int) -> list[SegmentInfo]:
        """Every rank's segment row of a snapshot, by rank."""
        return select_all(conn, q.SEGMENTS_OF, (snapshot_id,), into=SegmentInfo)

    @staticmethod
    def chain(conn: Conn, snapshot_id: int) -> list[ChainLink]:
        """The snapshot's copy-on-write chain, root first ([] when it is gone)."""
        return select_all(conn, q.CHAIN, (snapshot_id,), into=ChainLink)

    @staticmethod
    def leases(conn: Conn, snapshot_id: int) -> list[LeaseInfo]:
        """Every lease row of a snapshot, oldest first, expired or not."""
        return select_all(conn, q.LEASES_OF, (snapshot_id,), into=LeaseInfo)

    @classmethod
    def leased(cls, conn: Conn, snapshot_id: int, now: float,
               kind: str | None = None, *, explicit: bool = False) -> list[str]:
        """Holders of the leases (of ``kind``, if given) that protect a snapshot now;
        ``explicit``: against a user's own clear or delete, which keep leases
        (:data:`KEEP_LEASE`) do not stop."""
        return [lease.holder for lease in cls.leases(conn, snapshot_id)
                if (kind is None or lease.kind == kind) and lease.blocks(now)
                and not (explicit and lease.kind == KEEP_LEASE)]

    # -- the index's reserve ---------------------------------------------------------------

    def keep_reserve(self) -> bool:
        """Hold ``index_reserve`` bytes of the index's disk back in RESERVE_FILE
        (made once; best effort: False when the disk has no room for it)."""
        path = self.root / RESERVE_FILE
        if self.index_reserve <= 0:
            return False
        with contextlib.suppress(OSError):
            if path.stat().st_size >= self.index_reserve:
                return True
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.index_reserve)
            finally:
                os.close(fd)
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink()
            return False
        return True

    def release_reserve(self) -> bool:
        """Give the reserve back to the disk (the index is full); False if there was none."""
        try:
            (self.root / RESERVE_FILE).unlink()
        except FileNotFoundError:
            return False
        return True

    def freeing(self, work: Callable[[], RowT]) -> RowT:
        """Run ``work`` (a write that frees space: eviction, deletion); when the
        index's disk is too full for it, release the reserve, run it again, and
        take the reserve back once it freed space."""
        try:
            return work()
        except StoreFull:
            if not self.release_reserve():
                raise
        done = work()
        self.keep_reserve()
        return done

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Save pending counters, close the index and the backend.  Idempotent."""
        if self._db is None:
            return
        with self._lock:
            if self._retry is not None:
                self._retry.cancel()
                self._retry = None
        try:
            if self._unsaved or self._uses:
                with self.write():
                    pass
        finally:
            self._db.close()
            self._db = None
            self.backend.close()
