"""Record the tenant of every snapshot and of every logged request.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04

``snapshots.tenant``: the tenant whose request published the snapshot (its
``prompt_cache_key``, or the ``x-sparkcache-tenant`` header of an Anthropic
request: docs/serve.md), which the per-tenant limits, ``sparkcache tenants``
and ``sparkcache clear --tenant`` read; NULL: no tenant (and every row written
before).  ``ix_snapshots_tenant_used`` serves a tenant's least recently used
snapshots and holds only the rows that have one.  ``request_log.tenant``: the
request's tenant.  The views are unchanged.  SQLite adds nullable columns in
place; the downgrade drops the index first, then the columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("snapshots", sa.Column("tenant", sa.Text(), nullable=True))
    op.add_column("request_log", sa.Column("tenant", sa.Text(), nullable=True))
    op.create_index("ix_snapshots_tenant_used", "snapshots",
                    ["model_id", "tenant", "state", "last_used"],
                    sqlite_where=sa.text("tenant IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("ix_snapshots_tenant_used", table_name="snapshots")
    op.drop_column("request_log", "tenant")
    op.drop_column("snapshots", "tenant")
