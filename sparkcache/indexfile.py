"""A store's index file: where it is, its schema revision, and moving it between revisions.

What ``sparkcache db`` does (:mod:`sparkcache.admin` re-exports it).  Each
function opens its own connection to the file and never a store, so it works
on an index that a store would refuse to open (behind this sparkcache, or
before a downgrade).  The revisions themselves are :mod:`sparkcache.index.migrate`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import apsw

from sparkcache.core import INDEX_FILE
from sparkcache.errors import NotFound
from sparkcache.index import migrate

__all__ = ["DbRevision", "db_current", "db_downgrade", "db_upgrade", "index_path",
           "read_revision"]


@dataclass(frozen=True)
class DbRevision:
    path: str
    current: str | None
    head: str
    applied: list[str]  # revisions upgraded to, oldest first
    undone: list[str] = field(default_factory=list)  # revisions downgraded from, newest first

    @property
    def up_to_date(self) -> bool:
        return self.current == self.head


def index_path(root: str | os.PathLike[str]) -> Path:
    """The index file of the store in ``root``; NotFound when there is none."""
    path = Path(root).expanduser() / INDEX_FILE
    if not path.is_file():
        raise NotFound(f"no sparkcache index at {path}; pass the store's folder (--folder)")
    return path


def read_revision(path: Path, *, behind_ok: bool = True) -> str | None:
    """The revision of the index at ``path``, read through a read-only connection;
    SchemaMismatch when it is not one this sparkcache can use (or, unless
    ``behind_ok``, is behind): see :func:`sparkcache.index.migrate.check_revision`."""
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return migrate.check_revision(conn, empty_ok=False, behind_ok=behind_ok)
    finally:
        conn.close()


def db_current(root: str | os.PathLike[str]) -> DbRevision:
    """The index's schema revision and the newest this sparkcache knows (read-only).

    Raises SchemaMismatch, saying which, for an index written by a newer
    sparkcache and for a file that is not a sparkcache index at all.
    """
    path = index_path(root)
    return DbRevision(str(path), read_revision(path), migrate.head_revision(), [])


def db_upgrade(root: str | os.PathLike[str], *, busy_timeout_ms: int = 10_000) -> DbRevision:
    """Upgrade the index to the newest revision (a no-op at head).

    Raises SchemaMismatch for an index written by a newer sparkcache or a file
    that is not a sparkcache index (both left untouched).
    """
    path = index_path(root)
    conn = apsw.Connection(str(path))
    try:
        conn.set_busy_timeout(busy_timeout_ms)
        migrate.check_revision(conn, empty_ok=False)
        applied = migrate.upgrade(conn, "head")
        current = migrate.current_revision(conn)
    finally:
        conn.close()
    return DbRevision(str(path), current, migrate.head_revision(), applied)


def db_downgrade(root: str | os.PathLike[str], revision: str, *,
                 busy_timeout_ms: int = 10_000) -> DbRevision:
    """Take the index back to an older ``revision`` (see
    :func:`sparkcache.index.migrate.downgrade`): for going back to an older
    sparkcache.  Stop every process using the store first.

    Refuses (InvalidArgument) an unknown revision, one newer than the index and
    a revision that cannot be undone; nothing is changed then.
    """
    path = index_path(root)
    conn = apsw.Connection(str(path))
    try:
        conn.set_busy_timeout(busy_timeout_ms)
        undone = migrate.downgrade(conn, revision)
        current = migrate.current_revision(conn)
    finally:
        conn.close()
    return DbRevision(str(path), current, migrate.head_revision(), [], undone)
