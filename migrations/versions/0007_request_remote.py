"""Record how much of each request's restore came from the shared tier.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03

``request_log.remote_tokens``: of ``restored_tokens``, the prompt tokens that
the shared tier supplied (fetched from another host for this request,
docs/shared.md); NULL where unknown (rows from before, requests not through
the connector).  The views are unchanged.  SQLite adds a nullable column in
place, and drops it again since no index or view names it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("request_log", sa.Column("remote_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("request_log", "remote_tokens")
