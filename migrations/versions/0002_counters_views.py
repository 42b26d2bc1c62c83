"""Counters, and read-only views for people at the sqlite3 shell.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

The view text is copied here on purpose, not imported from
``sparkcache.index.schema``: a revision is history and must render the same SQL
after later revisions change a view.  ``tests/index/test_schema.py`` checks that
a database at head holds exactly ``schema.VIEWS``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

VIEWS: dict[str, str] = {
    "v_models": """CREATE VIEW v_models AS
SELECT m.id AS id,
       m.name AS name,
       m.digest AS digest,
       (SELECT count(*) FROM snapshots AS s WHERE s.model_id = m.id) AS snapshots,
       (SELECT count(*) FROM snapshots AS s
         WHERE s.model_id = m.id AND s.state = 'ready') AS ready,
       round((SELECT coalesce(sum(s.nbytes), 0) FROM snapshots AS s
               WHERE s.model_id = m.id) / 1e6, 1) AS mb,
       datetime(m.created_at, 'unixepoch') AS created,
       datetime(m.deleted_at, 'unixepoch') AS deleted
FROM models AS m""",
    "v_snapshots": """CREATE VIEW v_snapshots AS
SELECT s.id AS id,
       m.name AS model,
       s.n_tokens AS tokens,
       s.start_token AS start_token,
       round(s.nbytes / 1e6, 1) AS mb,
       s.state AS state,
       s.reason AS reason,
       s.pinned AS pinned,
       s.parent_id AS parent,
       s.depth AS depth,
       s.world_size AS world_size,
       s.use_count AS uses,
       datetime(s.created_at, 'unixepoch') AS created,
       datetime(s.last_used, 'unixepoch') AS last_used,
       s.snap_key AS snap_key
FROM snapshots AS s JOIN models AS m ON m.id = s.model_id""",
    "v_segments": """CREATE VIEW v_segments AS
SELECT g.snapshot_id AS snapshot_id,
       g.rank AS rank,
       g.state AS state,
       g.token_start AS token_start,
       g.token_end AS token_end,
       round(g.nbytes / 1e6, 1) AS mb,
       g.digest AS digest,
       datetime(g.created_at, 'unixepoch') AS created,
       g.object_key AS object_key
FROM segments AS g""",
    "v_leases": """CREATE VIEW v_leases AS
SELECT l.id AS id,
       l.snapshot_id AS snapshot_id,
       l.kind AS kind,
       l.holder AS holder,
       datetime(l.created_at, 'unixepoch') AS created,
       datetime(l.expires_at, 'unixepoch') AS expires,
       round(l.expires_at - (julianday('now') - 2440587.5) * 86400.0, 1) AS seconds_left,
       l.expires_at <= (julianday('now') - 2440587.5) * 86400.0 AS expired
FROM leases AS l""",
    "v_counters": """CREATE VIEW v_counters AS
SELECT CASE WHEN c.model_id = 0 THEN '(all)'
            ELSE coalesce(m.name, '#' || c.model_id) END AS model,
       c.name AS name,
       c.value AS value,
       c.model_id AS model_id
FROM counters AS c LEFT JOIN models AS m ON m.id = c.model_id""",
}


def upgrade() -> None:
    op.create_table(
        "counters",
        sa.Column("model_id", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("value", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.PrimaryKeyConstraint("model_id", "name", name="pk_counters"),
    )
    for create_view in VIEWS.values():
        op.execute(create_view)


def downgrade() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
    op.drop_table("counters")
