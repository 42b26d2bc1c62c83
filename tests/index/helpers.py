"""Helpers shared by the index tests."""

from __future__ import annotations

from pathlib import Path

import apsw

DATA = Path(__file__).parent / "data"


def raw(path: Path) -> apsw.Connection:
    """A plain apsw connection that bypasses Database (no pragmas, no migration)."""
    return apsw.Connection(str(path))


def schema_objects(conn: apsw.Connection) -> dict[tuple[str, str], str]:
    """(type, name) -> whitespace-normalised SQL of every schema object but alembic's."""
    rows = conn.execute(
        "SELECT type, name, coalesce(sql, '') FROM sqlite_master "
        "WHERE name NOT LIKE '%alembic_version%'"
    ).fetchall()
    return {(str(kind), str(name)): " ".join(str(sql).split()) for kind, name, sql in rows}
