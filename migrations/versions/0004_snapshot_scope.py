"""Record the request scope of every snapshot.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

``snapshots.scope_json`` holds the canonical JSON of the request scope (cache
salt, LoRA, multimodal hashes) that seeded a snapshot's prefix hashes, so that
an export can carry it and an import can rebuild the snapshot's keys.  Rows
written before this revision keep NULL: their scope was never recorded.
SQLite adds a nullable column in place, without copying the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("snapshots", sa.Column("scope_json", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("snapshots", "scope_json")
