"""Record how a request's written tokens split by their breakpoints' keep times.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04

``request_log.written_by_ttl``: ``written_tokens`` split by the keep time of
the breakpoint each token belongs to, as JSON text mapping whole seconds (as
text: ``"300"``, ``"3600"``; ``"0"`` for a breakpoint without one) to tokens
(``{"3600": 704, "300": 96}``); NULL where unknown (rows from before, requests
not through the connector).  The views are unchanged.  SQLite adds a nullable
column in place, and drops it again since no index or view names it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("request_log", sa.Column("written_by_ttl", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("request_log", "written_by_ttl")
