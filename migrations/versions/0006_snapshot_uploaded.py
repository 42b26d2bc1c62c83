"""Record when each snapshot reached the shared tier.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02

``snapshots.uploaded_at`` is set once the snapshot's manifest is in the shared
tier (docs/shared.md); NULL means not uploaded (or the store has no shared
tier).  The partial index ``ix_snapshots_upload`` holds exactly the ready
snapshots not uploaded yet, parents first (``depth, id``): the uploader's queue
is one range scan of what is left, whatever the size of the store.
``v_snapshots`` gains the column ``uploaded``.  The view text is copied here on
purpose (history must not change); ``tests/index/test_schema.py`` checks that
head holds ``schema.VIEWS``.  SQLite adds a nullable column in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

V_SNAPSHOTS_0002 = """CREATE VIEW v_snapshots AS
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
FROM snapshots AS s JOIN models AS m ON m.id = s.model_id"""

V_SNAPSHOTS_0006 = """CREATE VIEW v_snapshots AS
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
       s.snap_key AS snap_key,
       datetime(s.uploaded_at, 'unixepoch') AS uploaded
FROM snapshots AS s JOIN models AS m ON m.id = s.model_id"""

UPLOAD_QUEUE_WHERE = "state = 'ready' AND uploaded_at IS NULL"


def upgrade() -> None:
    op.add_column("snapshots", sa.Column("uploaded_at", sa.REAL(), nullable=True))
    op.create_index("ix_snapshots_upload", "snapshots", ["depth", "id"],
                    sqlite_where=sa.text(UPLOAD_QUEUE_WHERE))
    op.execute("DROP VIEW v_snapshots")
    op.execute(V_SNAPSHOTS_0006)


def downgrade() -> None:
    # SQLite drops a column only when no index or view names it.
    op.execute("DROP VIEW v_snapshots")
    op.drop_index("ix_snapshots_upload", table_name="snapshots")
    op.drop_column("snapshots", "uploaded_at")
    op.execute(V_SNAPSHOTS_0002)
