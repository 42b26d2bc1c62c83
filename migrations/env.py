"""The alembic environment of sparkcache's index: offline (SQL rendering) only.

sparkcache never lets alembic connect to a database.  Python's own ``sqlite3``
module may link a SQLite inside the WAL-reset bug range (3.7.0-3.51.2), so
``sparkcache.index.migrate.upgrade`` runs alembic in offline mode to *render* the
SQL of the pending revisions and executes it through apsw, inside one
``BEGIN IMMEDIATE`` transaction together with the ``alembic_version`` update.

To upgrade a store, open it (``sparkcache.index.Database``) or call
``sparkcache.index.migrate.upgrade``; see ``docs/index.md``.
"""

from __future__ import annotations

from alembic import context

from sparkcache.index.schema import METADATA


def run_migrations_offline() -> None:
    """Render the SQL of the requested revisions into the config's output buffer."""
    context.configure(
        dialect_name="sqlite",
        target_metadata=METADATA,
        literal_binds=True,
        # The caller already holds BEGIN IMMEDIATE around the whole script.
        transactional_ddl=False,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    raise RuntimeError(
        "sparkcache runs its migrations through apsw, never through an alembic connection: "
        "open the store (sparkcache.index.Database) or call "
        "sparkcache.index.migrate.upgrade(conn); to see the SQL, pass --sql to alembic"
    )
