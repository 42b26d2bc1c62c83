"""The connection to one store's index: apsw, WAL, one writer, fork-safe.

Every access goes through :meth:`Database.read` (a deferred transaction: one
consistent view for several queries) or :meth:`Database.write` (``BEGIN
IMMEDIATE``: the write lock is taken up front, so a transaction never fails
half-way for a lock; nested calls are savepoints).  Files that a transaction made
obsolete are deleted by :meth:`Database.on_commit` callbacks, which run only after
the outermost COMMIT is durable, never after a rollback.

The connection is apsw's, not Python's ``sqlite3``: apsw bundles a current SQLite,
while ``sqlite3`` may link one inside the WAL-reset bug range (see
:func:`wal_reset_bug`).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

import apsw

from sparkcache.errors import (
    BackendError,
    CorruptIndex,
    InvalidArgument,
    SparkCacheError,
    StoreClosed,
    StoreFull,
    StoreTimeout,
)
from sparkcache.index import queries, schema
from sparkcache.index.migrate import check_revision, ensure_schema

__all__ = [
    "WAL_RESET_BUG_FIRST",
    "WAL_RESET_BUG_LAST",
    "Database",
    "SQLiteVersionWarning",
    "wal_reset_bug",
    "warn_if_wal_reset_bug",
]

log = logging.getLogger(__name__)

# SQLite releases whose WAL can be corrupted when a checkpoint races a writer
# resetting the log (fixed in 3.51.3 / 3.52.0).
WAL_RESET_BUG_FIRST: Final = (3, 7, 0)
WAL_RESET_BUG_LAST: Final = (3, 51, 2)

_READ: Final = "read"
_WRITE: Final = "write"

# Connections inherited through fork().  Closing one in the child could checkpoint
# or unlink the WAL under the parent, whose locks the child does not own; they are
# kept referenced here so that they are never closed, and never used again.
_INHERITED: list[apsw.Connection] = []

# What SQLite raises when the busy timeout ran out.
_LOCKED: Final = (apsw.BusyError, apsw.LockedError)


class SQLiteVersionWarning(UserWarning):
    """The SQLite library in use has a known bug that can corrupt the index."""


def wal_reset_bug(version: tuple[int, ...]) -> bool:
    """Whether SQLite ``version`` (e.g. ``(3, 45, 1)``) lies in the WAL-reset bug range."""
    return WAL_RESET_BUG_FIRST <= tuple(version[:3]) <= WAL_RESET_BUG_LAST


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def warn_if_wal_reset_bug(sqlite_version: str, path: str, *, stacklevel: int = 1) -> bool:
    """Warn (SQLiteVersionWarning, and log) when ``sqlite_version`` has the WAL-reset bug.

    ``stacklevel`` counts as in ``warnings.warn``, from the caller of this function.
    """
    if not wal_reset_bug(_version_tuple(sqlite_version)):
        return False
    first, last = (".".join(map(str, v)) for v in (WAL_RESET_BUG_FIRST, WAL_RESET_BUG_LAST))
    message = (
        f"SQLite {sqlite_version} lies in the WAL-reset bug range ({first}-{last}): "
        f"concurrent writers can corrupt the index {path}. Install an apsw that bundles a "
        "fixed SQLite: pip install -U 'apsw>=3.52'"
    )
    log.warning("%s", message)
    warnings.warn(message, SQLiteVersionWarning, stacklevel=stacklevel + 1)
    return True


class Database:
    """One process's connection to the index file at ``path``.

    Opening applies the pragmas in :mod:`sparkcache.index.schema`, creates or
    upgrades the schema (:func:`~sparkcache.index.migrate.ensure_schema`) and
    records the SQLite version in ``settings``.  With ``upgrade=False`` the schema
    is never changed: a file that is empty or behind head raises
    :class:`~sparkcache.errors.SchemaMismatch` naming ``sparkcache db upgrade``,
    before anything is written to it (read-only tools on a shared store).  A file
    this sparkcache cannot use (newer, not a sparkcache index, not SQLite) raises
    either way, untouched.  Thread-safe: one thread at a time
    holds a transaction.  Fork-safe: used from a forked child it opens its own
    connection and leaves the inherited one alone.  Do not fork *inside* a
    transaction.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout_ms: int = schema.DEFAULT_BUSY_TIMEOUT_MS,
        upgrade: bool = True,
    ) -> None:
        self._path = os.fspath(path)
        self._busy_timeout_ms = int(busy_timeout_ms)
        self._upgrade = bool(upgrade)
        self._closed = False
        self._migrated: list[str] = []
        self._reset_state()
        self._sqlite_version = apsw.sqlite_lib_version()
        warn_if_wal_reset_bug(self._sqlite_version, self._path, stacklevel=2)
        self._conn = self._open()

    # -- properties -----------------------------------------------------------------------
    @property
    def path(self) -> str:
        """The index file."""
        return self._path

    @property
    def sqlite_version(self) -> str:
        """The version of the SQLite library apsw runs, e.g. ``"3.54.1"``."""
        return self._sqlite_version

    @property
    def migrated(self) -> list[str]:
        """The revisions opening this database applied, oldest first ([] when at head)."""
        return list(self._migrated)

    @property
    def busy_timeout_ms(self) -> int:
        """How long a statement waits for another process's lock before StoreTimeout."""
        return self._busy_timeout_ms

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connection(self) -> apsw.Connection:
        """This process's apsw connection, outside any transaction helper.

        Only for statements that cannot run inside a transaction (``VACUUM``,
        ``PRAGMA wal_checkpoint``); everything else goes through read() / write().
        """
        return self._connection()

    # -- transactions ---------------------------------------------------------------------
    @contextmanager
    def read(self) -> Iterator[apsw.Connection]:
        """A read transaction (deferred ``BEGIN`` ... ``COMMIT``); yields the connection.

        Every query inside sees the same committed state.  Inside write() or another
        read() it simply joins the enclosing transaction.
        """
        conn = self._connection()
        with self._lock:
            if self._levels:
                yield conn
                return
            with self._outermost(conn, schema.BEGIN_DEFERRED, _READ):
                yield conn

    @contextmanager
    def write(self, after: list[Callable[[], object]] | None = None, *,
              wait: bool | float = True) -> Iterator[apsw.Connection]:
        """A write transaction; yields the connection.

        The outermost call runs ``BEGIN IMMEDIATE`` (waiting up to the busy timeout
        for another writer, then raising StoreTimeout) and COMMITs on success, then
        runs the on_commit callbacks.  A nested call is a SAVEPOINT: its exception
        rolls back only its own changes and callbacks, then propagates.  Calling
        write() inside read() raises RuntimeError (a read snapshot cannot be
        upgraded safely under WAL).  With ``after``, the outermost call appends the
        on_commit callbacks to that list instead of running them, for a caller that
        holds a lock of its own around write() and runs them once it let go.  With
        ``wait=False`` the outermost call does not wait for another process's write
        lock: it raises StoreTimeout at once (for work that may be done later);
        a number of seconds waits at most that long (below the busy timeout).
        """
        conn = self._connection()
        self._lock.acquire()
        callbacks: list[Callable[[], object]] = []
        try:
            if self._levels and self._levels[0] == _READ:
                raise RuntimeError("write() inside read(): start with write() instead")
            if self._levels:
                with self._savepoint(conn):
                    yield conn
                return
            with self._outermost(conn, schema.BEGIN_IMMEDIATE, _WRITE, wait=wait):
                yield conn
                callbacks = self._callbacks[0]  # taken before COMMIT clears them
        finally:
            self._lock.release()
        # Outside the lock: other threads may use the index while files are deleted.
        if after is not None:
            after.extend(callbacks)
        else:
            self.run_callbacks(callbacks)

    def on_commit(self, callback: Callable[[], object]) -> None:
        """Run ``callback()`` after the enclosing write() commits; never on rollback.

        For work that must not happen unless the transaction is durable, typically
        deleting files the transaction stopped referencing.  Callbacks run in
        registration order, outside the lock.  A callback's exception is logged and
        not raised: the transaction has committed and cannot be undone, and a file
        left behind is garbage that ``check(fix=True)`` removes.
        """
        in_write = bool(self._levels) and self._levels[0] == _WRITE
        if not in_write or self._owner != threading.get_ident():
            raise RuntimeError("on_commit() must be called inside write()")
        self._callbacks[-1].append(callback)

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Close the connection; idempotent.  Later use raises StoreClosed."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            _INHERITED.append(self._conn)
            return
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Database({self._path!r}, {state})"

    # -- internals ------------------------------------------------------------------------
    def _reset_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._owner: int | None = None  # thread holding the transaction
        self._levels: list[str] = []  # transaction kind per nesting level
        self._callbacks: list[list[Callable[[], object]]] = []

    def _open(self) -> apsw.Connection:
        try:
            conn = apsw.Connection(self._path)
        except apsw.CantOpenError as exc:
            raise BackendError(
                f"cannot open the index {self._path}: {exc}. Check that the folder exists "
                "and that this process may write to it."
            ) from exc
        try:
            conn.set_busy_timeout(self._busy_timeout_ms)
            # Before anything else: switching to WAL rewrites the file's header,
            # and a file this code must not change is left as it was.
            current = check_revision(conn, empty_ok=self._upgrade, behind_ok=self._upgrade)
            for name, value in schema.PRAGMAS:
                conn.pragma(name, value)
            mode = self._switch_to_wal(conn)
            if mode != schema.JOURNAL_MODE:
                raise BackendError(
                    f"the index {self._path} could not switch to WAL (journal_mode is "
                    f"{mode!r}); put the store on a local filesystem that supports shared "
                    "memory (not NFS or SMB)."
                )
            if current != schema.SCHEMA_REVISION:  # only with upgrade: else it raised
                self._migrated = ensure_schema(conn)
            self._record_sqlite_version(conn)
        except _LOCKED as exc:
            conn.close()
            raise self._timeout(exc) from exc
        except apsw.Error as exc:
            conn.close()
            raise self._translate(exc) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def _switch_to_wal(self, conn: apsw.Connection) -> str:
        """Set journal_mode=WAL, retrying while other processes hold the database.

        Switching a fresh database to WAL needs an exclusive lock.  When several
        processes open it at once each holds a shared lock and wants to upgrade;
        SQLite then answers SQLITE_BUSY at once, without calling the busy handler
        (waiting could deadlock), so the retry up to the busy timeout is ours.
        """
        deadline = time.monotonic() + self._busy_timeout_ms / 1000
        delay = 0.001
        while True:
            try:
                return str(conn.pragma("journal_mode", schema.JOURNAL_MODE)).lower()
            except _LOCKED:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(delay * (0.5 + random.random()))  # noqa: S311 (jitter, not a secret)
                delay = min(delay * 2, 0.05)

    def _record_sqlite_version(self, conn: apsw.Connection) -> None:
        key = schema.SETTING_SQLITE_VERSION
        rows = conn.execute(queries.GET_SETTING, (key,)).fetchall()
        if rows and rows[0][0] == self._sqlite_version:
            return  # the common case: no write lock on open
        conn.execute(schema.BEGIN_IMMEDIATE)
        try:
            conn.execute(queries.PUT_SETTING, (key, self._sqlite_version, time.time()))
        except BaseException:
            conn.execute(schema.ROLLBACK)
            raise
        conn.execute(schema.COMMIT)

    def _connection(self) -> apsw.Connection:
        if self._closed:
            raise StoreClosed(f"the index {self._path} was closed; open a new Database")
        if os.getpid() != self._pid:
            # A forked child: leave the parent's connection alone, open our own.  The
            # parent's transaction state and lock (perhaps held by a thread that does
            # not exist here) are dropped with it.
            log.debug("pid changed (fork): reopening the index %s", self._path)
            conn = self._open()
            _INHERITED.append(self._conn)
            self._reset_state()
            self._conn = conn
        return self._conn

    def _execute(self, conn: apsw.Connection, sql: str) -> None:
        try:
            conn.execute(sql)
        except _LOCKED as exc:
            raise self._timeout(exc) from exc
        except apsw.Error as exc:
            raise self._translate(exc) from exc

    def _begin(self, conn: apsw.Connection, sql: str, kind: str) -> None:
        self._execute(conn, sql)
        self._owner = threading.get_ident()
        self._levels.append(kind)
        self._callbacks.append([])

    def _end(self) -> None:
        self._owner = None
        self._levels.clear()
        self._callbacks.clear()

    @contextmanager
    def _outermost(self, conn: apsw.Connection, begin: str, kind: str, *,
                   wait: bool | float = True) -> Iterator[None]:
        """BEGIN; COMMIT when the body succeeds, ROLLBACK (and re-raise) when not.

        A busy timeout inside the body becomes StoreTimeout.
        """
        if wait is True:
            self._begin(conn, begin, kind)
        else:
            conn.set_busy_timeout(min(int(wait * 1000), self._busy_timeout_ms))
            try:
                self._begin(conn, begin, kind)
            finally:
                conn.set_busy_timeout(self._busy_timeout_ms)
        try:
            yield
        except _LOCKED as exc:
            self._rollback(conn)
            raise self._timeout(exc) from exc
        except apsw.Error as exc:
            self._rollback(conn)
            raise self._translate(exc) from exc
        except OverflowError as exc:  # binding an int SQLite cannot store
            self._rollback(conn)
            raise InvalidArgument(
                f"a number is out of the index's range ({exc}): ids, token counts and sizes "
                "are 64-bit integers; check the value passed") from exc
        except BaseException:
            self._rollback(conn)
            raise
        self._commit(conn)

    def _commit(self, conn: apsw.Connection) -> None:
        """COMMIT the outermost transaction; on failure roll back and raise."""
        try:
            self._execute(conn, schema.COMMIT)
        except BaseException:
            self._rollback(conn)
            raise
        self._end()

    def _rollback(self, conn: apsw.Connection) -> None:
        self._end()
        # SQLite may already have rolled back by itself (disk full, I/O error).
        if conn.in_transaction:
            conn.execute(schema.ROLLBACK)

    @contextmanager
    def _savepoint(self, conn: apsw.Connection) -> Iterator[None]:
        name = f"sparkcache_{len(self._levels)}"
        self._execute(conn, schema.SAVEPOINT.format(name=name))
        self._levels.append(_WRITE)
        self._callbacks.append([])
        try:
            yield
        except BaseException:
            # Only this level's changes and callbacks go; the exception propagates
            # to the caller, who may catch it and carry on with the outer transaction.
            if conn.in_transaction:
                conn.execute(schema.ROLLBACK_TO_SAVEPOINT.format(name=name))
                conn.execute(schema.RELEASE_SAVEPOINT.format(name=name))
            self._callbacks.pop()
            raise
        else:
            self._execute(conn, schema.RELEASE_SAVEPOINT.format(name=name))
            done = self._callbacks.pop()
            self._callbacks[-1].extend(done)
        finally:
            self._levels.pop()

    def run_callbacks(self, callbacks: list[Callable[[], object]]) -> None:
        """Run callbacks that write(after=...) handed back, logging (not raising) failures."""
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("an on_commit callback failed after committing to %s", self._path)

    def _translate(self, exc: apsw.Error) -> SparkCacheError:
        """SQLite's error as the sparkcache error a caller can act on."""
        if isinstance(exc, apsw.FullError):
            return StoreFull(
                f"the disk holding the index {self._path} is full ({exc}): free space on it "
                "(`sparkcache evict` and the sweeper can, from a reserve the store keeps "
                "for this) or move the store to a larger disk"
            )
        if isinstance(exc, (apsw.ConstraintError, apsw.CorruptError, apsw.NotADBError)):
            return CorruptIndex(
                f"the index {self._path} broke its own rules or is damaged ({exc}); run "
                "`sparkcache check --fix`, and if it persists move the index aside: the "
                "store starts empty and `sparkcache check --fix` reclaims the old files"
            )
        return BackendError(
            f"the index {self._path} failed: {type(exc).__name__}: {exc}; check that its "
            "disk is mounted, writable and healthy"
        )

    def _timeout(self, exc: BaseException) -> StoreTimeout:
        return StoreTimeout(
            f"the index {self._path} stayed locked by another process for more than "
            f"{self._busy_timeout_ms} ms ({exc}). Another sparkcache process is holding a "
            f"long write or is stuck: find it with `fuser {self._path}`, retry later, or "
            "open the store with a larger busy_timeout_ms."
        )
