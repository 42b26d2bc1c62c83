"""The per-host SQLite index: schema, migrations and the connection.

``Database`` is the only way in: ``read()`` and ``write()`` transactions over an
apsw connection (WAL, ``BEGIN IMMEDIATE``, savepoints, ``on_commit``), with the
schema created or upgraded on open.  ``docs/index.md`` describes every table.
"""

from __future__ import annotations

from sparkcache.index.db import Database, SQLiteVersionWarning, wal_reset_bug
from sparkcache.index.migrate import current_revision, ensure_schema, head_revision, upgrade

__all__ = [
    "Database",
    "SQLiteVersionWarning",
    "current_revision",
    "ensure_schema",
    "head_revision",
    "upgrade",
    "wal_reset_bug",
]
