"""Schema migrations: alembic renders the SQL, apsw runs it in one transaction.

Python's own ``sqlite3`` module may link a SQLite inside the WAL-reset bug range,
so alembic never connects to the index.  Instead :func:`upgrade` asks alembic, in
offline mode, for the SQL that takes the database from its current revision to
the target, and executes that text through apsw inside a single
``BEGIN IMMEDIATE`` transaction.  SQLite DDL is transactional, so the tables, the
views and the ``alembic_version`` row change together or not at all, and the
write lock serializes processes that open a fresh store at the same moment: the
first one migrates, the others wait, re-read the revision and find nothing to do.

The revisions ship inside the wheel as ``sparkcache._migrations`` (the top-level
``migrations/`` folder of the source tree) and are found with importlib.resources.
"""

from __future__ import annotations

import functools
import io
import logging
from importlib import resources
from typing import TYPE_CHECKING

import apsw

from sparkcache.errors import InvalidArgument, SchemaMismatch
from sparkcache.index import schema

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = [
    "MIGRATIONS_PACKAGE",
    "alembic_config",
    "current_revision",
    "ensure_schema",
    "head_revision",
    "known_revisions",
    "render_sql",
    "upgrade",
]

log = logging.getLogger(__name__)

MIGRATIONS_PACKAGE = "sparkcache._migrations"


def alembic_config(output_buffer: io.StringIO | None = None) -> Config:
    """An alembic ``Config`` whose ``script_location`` is the installed revisions.

    Also the way to add a revision during development::

        from alembic import command
        command.revision(alembic_config(), "what changes", rev_id="0003")
    """
    from alembic.config import Config

    config = Config(output_buffer=output_buffer)
    location = str(resources.files(MIGRATIONS_PACKAGE))
    # Config values go through ConfigParser interpolation: escape '%'.
    config.set_main_option("script_location", location.replace("%", "%%"))
    return config


@functools.cache
def known_revisions() -> tuple[str, ...]:
    """Every revision this version of sparkcache ships, oldest first."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config())
    heads = script.get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"sparkcache migrations must form one line; found heads {heads}")
    newest_first = [rev.revision for rev in script.walk_revisions("base", heads[0])]
    return tuple(reversed(newest_first))


def head_revision() -> str:
    """The newest revision this version of sparkcache knows."""
    return known_revisions()[-1]


def current_revision(conn: apsw.Connection) -> str | None:
    """The database's revision, or None for a database alembic never touched."""
    if not conn.execute(schema.TABLE_EXISTS, ("alembic_version",)).fetchall():
        return None
    rows = conn.execute(schema.SELECT_ALEMBIC_VERSION).fetchall()
    if len(rows) > 1:
        found = ", ".join(sorted(str(row[0]) for row in rows))
        raise SchemaMismatch(
            f"the index has several alembic revisions ({found}); sparkcache keeps one line "
            "of revisions. Point the store at another folder, or restore the index from a copy."
        )
    return str(rows[0][0]) if rows else None


def render_sql(current: str | None, target: str) -> str:
    """The SQL (alembic offline mode, SQLite dialect) from ``current`` to ``target``.

    Includes creating and updating ``alembic_version``; no BEGIN/COMMIT.
    """
    from alembic import command

    buffer = io.StringIO()
    span = target if current is None else f"{current}:{target}"
    command.upgrade(alembic_config(buffer), span, sql=True)
    return buffer.getvalue()


def _mismatch(found: str, path: str) -> SchemaMismatch:
    return SchemaMismatch(
        f"the index {path} has schema revision {found!r}, which this version of sparkcache "
        f"does not know (the newest it knows is {head_revision()!r}): it was written by a "
        "newer sparkcache. Upgrade sparkcache (pip install -U sparkcache) or point the "
        "store at another folder. The index was left untouched."
    )


def _pending(conn: apsw.Connection, current: str | None, target: str) -> list[str]:
    """The revisions to apply, oldest first.  Never a downgrade: [] when at or past target."""
    known = known_revisions()
    target = head_revision() if target == "head" else target
    if target not in known:
        raise InvalidArgument(f"unknown target revision {target!r}; known: {', '.join(known)}")
    if current is None:
        objects = conn.execute(schema.USER_OBJECT_COUNT).fetchall()[0][0]
        if objects:
            raise SchemaMismatch(
                f"{_path(conn)} holds {objects} tables or indexes but no sparkcache schema "
                "revision: it is not a sparkcache index. Point the store at another (empty) "
                "folder."
            )
        return list(known[: known.index(target) + 1])
    if current not in known:
        raise _mismatch(current, _path(conn))
    return list(known[known.index(current) + 1 : known.index(target) + 1])


def _path(conn: apsw.Connection) -> str:
    return conn.filename or ":memory:"


def upgrade(conn: apsw.Connection, target: str = "head") -> list[str]:
    """Bring the database up to ``target``; returns the revisions applied, oldest first.

    Runs in one ``BEGIN IMMEDIATE`` transaction, so ``conn`` must not be inside a
    transaction already.  The revision is read again under the write lock: when
    another process migrated first this returns ``[]``.  Never downgrades: a
    ``target`` older than the database is a no-op.  Raises
    :class:`~sparkcache.errors.SchemaMismatch` for a revision newer than this
    version of sparkcache, leaving the database untouched.
    """
    if conn.in_transaction:
        raise RuntimeError("upgrade() needs a connection outside any transaction")
    conn.execute(schema.BEGIN_IMMEDIATE)
    try:
        current = current_revision(conn)
        pending = _pending(conn, current, target)
        if pending:
            conn.execute(render_sql(current, pending[-1])).fetchall()
            reached = current_revision(conn)
            if reached != pending[-1]:
                raise RuntimeError(
                    f"migrating {_path(conn)} ended at revision {reached!r} instead of "
                    f"{pending[-1]!r}; nothing was changed"
                )
        conn.execute(schema.COMMIT)
    except BaseException:
        if conn.in_transaction:
            conn.execute(schema.ROLLBACK)
        raise
    return pending


def ensure_schema(conn: apsw.Connection) -> list[str]:
    """Called on every open: make the database's schema the one this code expects.

    A database already at head costs one query and never imports alembic.  A fresh
    (empty) database is migrated to head; an older one is upgraded automatically
    (logged); a newer one raises :class:`~sparkcache.errors.SchemaMismatch`.
    A database with tables but no ``alembic_version`` is not sparkcache's and also
    raises.  Returns the revisions applied.
    """
    current = current_revision(conn)
    if current == schema.SCHEMA_REVISION:
        return []
    if current is not None and current not in known_revisions():
        # Checked before taking the write lock: a newer store in use by newer
        # processes answers at once, and is left untouched.
        raise _mismatch(current, _path(conn))
    applied = upgrade(conn, "head")
    if applied and applied[0] != known_revisions()[0]:
        log.info(
            "upgraded the schema of the index %s to revision %s (applied %s)",
            _path(conn),
            applied[-1],
            ", ".join(applied),
        )
    elif applied:
        log.debug("created the index %s at schema revision %s", _path(conn), applied[-1])
    return applied
