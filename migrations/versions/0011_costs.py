"""Keep the connector's cost model: measured prefill and restore rates.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02

``costs``: one row per measured rate (an engine's prefill rate by prompt
length and its step overhead; the restore rate of each source: local disk
warm and cold, verification, each shared tier endpoint), so that a restarted
engine decides whether to restore or recompute with what the last one
learned (docs/connector.md, "Restore or recompute").
``request_log.restore_reason``: what that decision was for the request
(``restored``, ``partial``, ``too_slow``); NULL for rows from before and for
requests with nothing to restore.  The views are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "costs",
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("unit_s", sa.REAL(), nullable=False),
        sa.Column("latency_s", sa.REAL(), nullable=False, server_default=sa.text("0")),
        sa.Column("samples", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("updated_at", sa.REAL(), nullable=False),
        sa.PrimaryKeyConstraint("model", "source", "bucket", name="pk_costs"),
    )
    op.add_column("request_log", sa.Column("restore_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("request_log", "restore_reason")
    op.drop_table("costs")
