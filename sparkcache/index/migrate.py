"""Schema migrations: alembic renders the SQL, apsw runs it in one transaction.

Python's own ``sqlite3`` module may link a SQLite inside the WAL-reset bug range,
so alembic never connects to the index.  Instead :func:`upgrade` asks alembic, in
offline mode, for the SQL that takes the database from its current revision to
the target, and executes that text through apsw inside a single
``BEGIN IMMEDIATE`` transaction.  SQLite DDL is transactional, so the tables, the
views and the ``alembic_version`` row change together or not at all, and the
write lock serializes processes that open a fresh store at the same moment: the
first one migrates, the others wait, re-read the revision and find nothing to do.

:func:`check_revision` tells, reading only, whether a database is one this
sparkcache can open (at head or behind) or not (a newer revision, not a
sparkcache index, not SQLite at all); :func:`downgrade` takes an index back to an
older revision with the revisions' own ``downgrade()`` and checks the result
against a fresh database at that revision.

The revisions ship inside the wheel as ``sparkcache._migrations`` (the top-level
``migrations/`` folder of the source tree) and are found with importlib.resources.
"""

from __future__ import annotations

import functools
import io
import logging
import os
from importlib import resources
from typing import TYPE_CHECKING, Final, cast

import apsw

from sparkcache.errors import InvalidArgument, SchemaMismatch
from sparkcache.index import schema

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = [
    "MIGRATIONS_PACKAGE",
    "alembic_config",
    "check_revision",
    "current_revision",
    "downgrade",
    "ensure_schema",
    "head_revision",
    "known_revisions",
    "render_downgrade_sql",
    "render_sql",
    "upgrade",
]

log = logging.getLogger(__name__)

MIGRATIONS_PACKAGE = "sparkcache._migrations"

# What a downgrade is checked against: every schema object but SQLite's own and
# alembic's, with the columns of tables and views.
SHAPE_OBJECTS: Final = (
    "SELECT type, name FROM sqlite_master "
    "WHERE name NOT LIKE 'sqlite_%' AND name != 'alembic_version'"
)
SHAPE_COLUMNS: Final = "SELECT name FROM pragma_table_info(?)"


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
        "newer sparkcache. Upgrade sparkcache (pip install -U . in a newer checkout of its "
        "source tree; the package named sparkcache on PyPI is another project) or point the "
        "store at another folder. The index was left untouched."
    )


def _not_an_index(path: str, objects: int) -> SchemaMismatch:
    return SchemaMismatch(
        f"{path} holds {objects} tables or indexes but no sparkcache schema revision: it is "
        "not a sparkcache index. Point the store at another (empty) folder. The file was "
        "left untouched."
    )


def _behind(found: str, path: str) -> SchemaMismatch:
    folder = os.path.dirname(path) or "."
    return SchemaMismatch(
        f"the index {path} has schema revision {found!r}, older than the {head_revision()!r} "
        "this sparkcache needs, and it was opened without upgrading (read-only commands "
        "never change a shared store). Upgrade it with `sparkcache db upgrade --folder "
        f"{folder}` once no older sparkcache uses the store. Nothing was changed."
    )


def check_revision(conn: apsw.Connection, *, empty_ok: bool = True,
                   behind_ok: bool = True) -> str | None:
    """The database's revision, once it is known to be one this sparkcache can use.

    Reads only.  Raises :class:`~sparkcache.errors.SchemaMismatch`, saying what
    the file is and what to do, when the file is not a SQLite database, when it
    holds tables but no ``alembic_version`` (not a sparkcache index), or when its
    revision is one this sparkcache does not know (a newer sparkcache wrote it);
    unless ``empty_ok``, when it holds no table at all (a fresh file: returns
    None otherwise); unless ``behind_ok``, when its revision is older than head
    (the message names ``sparkcache db upgrade``).  At head it costs the query
    of :func:`current_revision` and never imports alembic.
    """
    path = _path(conn)
    try:
        current = current_revision(conn)
        if current == schema.SCHEMA_REVISION:
            return current
        objects = _object_count(conn)
    except apsw.NotADBError as exc:
        raise SchemaMismatch(
            f"{path} is not a SQLite database ({exc}), so not a sparkcache index. Point the "
            "store (--folder) at the folder holding the store's index.sqlite. The file was "
            "left untouched."
        ) from exc
    if current is None:
        if objects:
            raise _not_an_index(path, objects)
        if not empty_ok:
            raise SchemaMismatch(
                f"{path} holds no tables: it is not a sparkcache index (a store's index is "
                "created by the first SnapshotStore that opens its folder, or by `sparkcache "
                "import`). Point the store (--folder) at the folder vLLM uses. The file was "
                "left untouched."
            )
        return None
    if current not in known_revisions():
        raise _mismatch(current, path)
    if not behind_ok:
        raise _behind(current, path)
    return current


def _pending(conn: apsw.Connection, current: str | None, target: str) -> list[str]:
    """The revisions to apply, oldest first.  Never a downgrade: [] when at or past target."""
    known = known_revisions()
    target = head_revision() if target == "head" else target
    if target not in known:
        raise InvalidArgument(f"unknown target revision {target!r}; known: {', '.join(known)}")
    if current is None:
        objects = _object_count(conn)
        if objects:
            raise _not_an_index(_path(conn), objects)
        return list(known[: known.index(target) + 1])
    if current not in known:
        raise _mismatch(current, _path(conn))
    return list(known[known.index(current) + 1 : known.index(target) + 1])


def _path(conn: apsw.Connection) -> str:
    return conn.filename or ":memory:"


def _object_count(conn: apsw.Connection) -> int:
    return int(cast("int", conn.execute(schema.USER_OBJECT_COUNT).fetchall()[0][0]))


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
    raises (:func:`check_revision`).  Returns the revisions applied.
    """
    # Checked before taking the write lock: a newer store in use by newer
    # processes answers at once, and is left untouched.
    if check_revision(conn) == schema.SCHEMA_REVISION:
        return []
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


# -- going back ---------------------------------------------------------------------------


def render_downgrade_sql(current: str, target: str) -> str:
    """The SQL (alembic offline mode) of the ``downgrade()`` of every revision after
    ``target`` up to ``current``, newest first, with the ``alembic_version`` updates.

    A revision that cannot go back raises NotImplementedError in its ``downgrade()``.
    """
    from alembic import command

    buffer = io.StringIO()
    command.downgrade(alembic_config(buffer), f"{current}:{target}", sql=True)
    return buffer.getvalue()


Shape = frozenset[tuple[str, str, tuple[str, ...]]]


def _shape(conn: apsw.Connection) -> Shape:
    """(type, name, columns) of every table, index, view and trigger but alembic's."""
    return frozenset(
        (str(kind), str(name), tuple(str(c) for (c,) in conn.execute(SHAPE_COLUMNS, (name,))))
        for kind, name in conn.execute(SHAPE_OBJECTS).fetchall()
    )


def _fresh_shape(target: str) -> Shape:
    """The shape of a new, empty database created at revision ``target``."""
    conn = apsw.Connection(":memory:")
    try:
        conn.execute(render_sql(None, target)).fetchall()
        return _shape(conn)
    finally:
        conn.close()


def downgrade(conn: apsw.Connection, target: str) -> list[str]:
    """Take the database back to revision ``target``; returns the revisions undone,
    newest first ([] when it is at ``target`` already).

    The undone revisions' ``downgrade()`` run in one ``BEGIN IMMEDIATE``
    transaction, which commits only when the result holds exactly the tables,
    columns, indexes, views and triggers of a fresh database at ``target``: a
    revision whose downgrade is missing (``NotImplementedError``) or incomplete
    changes nothing.  Whatever the undone revisions added is dropped with its
    rows (below 0002, the counters).  Raises
    :class:`~sparkcache.errors.InvalidArgument` for an unknown ``target`` (the
    oldest revision is the floor: below it every table would go), for one newer
    than the database (an upgrade) and for a revision that cannot go back;
    :class:`~sparkcache.errors.SchemaMismatch` for a database this sparkcache
    does not know or a downgrade that does not restore ``target``.
    """
    known = known_revisions()
    if target not in known:
        raise InvalidArgument(
            f"unknown revision {target!r}: an index can go back to {', '.join(known)} (the "
            f"oldest, {known[0]}, is as far as it goes: below it every table would be "
            "dropped; use another folder for a new store)"
        )
    if conn.in_transaction:
        raise RuntimeError("downgrade() needs a connection outside any transaction")
    path = _path(conn)
    conn.execute(schema.BEGIN_IMMEDIATE)
    try:
        # Never None: without empty_ok an empty database raises.
        current = cast("str", check_revision(conn, empty_ok=False))
        if known.index(target) > known.index(current):
            raise InvalidArgument(
                f"the index {path} is at revision {current!r}, older than {target!r}: going "
                "there is an upgrade; run `sparkcache db upgrade` (it goes to the newest)"
            )
        undone = list(reversed(known[known.index(target) + 1 : known.index(current) + 1]))
        if undone:
            try:
                sql = render_downgrade_sql(current, target)
            except NotImplementedError as exc:
                raise InvalidArgument(
                    f"the index {path} cannot go back from {current!r} to {target!r}: a "
                    f"revision on the way has no downgrade ({exc}). Nothing was changed."
                ) from exc
            conn.execute(sql).fetchall()
            if current_revision(conn) != target or _shape(conn) != _fresh_shape(target):
                raise SchemaMismatch(
                    f"the downgrade of the index {path} from {current!r} to {target!r} does "
                    f"not leave the schema of revision {target!r} (a revision's downgrade() is "
                    "incomplete); it was rolled back and nothing was changed. Report it."
                )
        conn.execute(schema.COMMIT)
    except BaseException:
        if conn.in_transaction:
            conn.execute(schema.ROLLBACK)
        raise
    if undone:
        log.info("downgraded the index %s to revision %s (undid %s)", path, target,
                 ", ".join(undone))
    return undone
