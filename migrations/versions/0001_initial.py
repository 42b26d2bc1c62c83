"""The initial index: settings, models, snapshots, segments, boundaries, leases.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "settings",
        sa.Column("key", sa.Text(), primary_key=True),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.REAL(), nullable=False),
    )
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("digest", sa.Text(), nullable=False, unique=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("folder", sa.Text(), nullable=False, unique=True),
        sa.Column("identity_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.REAL(), nullable=False),
        sa.Column("deleted_at", sa.REAL(), nullable=True),
    )
    op.create_table(
        "snapshots",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "model_id",
            sa.Integer(),
            sa.ForeignKey("models.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("snap_key", sa.Text(), nullable=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("start_token", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("parent_id", sa.Integer(), sa.ForeignKey("snapshots.id"), nullable=True),
        sa.Column("depth", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("nbytes", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("pinned", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("created_at", sa.REAL(), nullable=False),
        sa.Column("last_used", sa.REAL(), nullable=False),
        sa.Column("use_count", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.CheckConstraint(
            "state IN ('pending', 'ready', 'quarantined')", name="ck_snapshots_state"
        ),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "ix_snapshots_model_state_used", "snapshots", ["model_id", "state", "last_used"]
    )
    op.create_index("ix_snapshots_parent", "snapshots", ["parent_id"])
    op.create_index("ix_snapshots_state_used", "snapshots", ["state", "last_used"])
    op.create_index(
        "ux_snapshots_model_key_live",
        "snapshots",
        ["model_id", "snap_key"],
        unique=True,
        sqlite_where=sa.text("state IN ('pending', 'ready')"),
    )
    op.create_table(
        "boundaries",
        sa.Column("prefix_hash", sa.LargeBinary(), nullable=False),
        sa.Column(
            "snapshot_id",
            sa.Integer(),
            sa.ForeignKey("snapshots.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("prefix_hash", "snapshot_id", name="pk_boundaries"),
        sa.CheckConstraint("kind IN ('end', 'stride', 'breakpoint')", name="ck_boundaries_kind"),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_boundaries_snapshot", "boundaries", ["snapshot_id"])
    op.create_table(
        "leases",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "snapshot_id",
            sa.Integer(),
            sa.ForeignKey("snapshots.id", ondelete="CASCADE"),
            nullable=True,
        ),
        sa.Column("holder", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("created_at", sa.REAL(), nullable=False),
        sa.Column("expires_at", sa.REAL(), nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_leases_expires", "leases", ["expires_at"])
    op.create_index("ix_leases_snapshot_expires", "leases", ["snapshot_id", "expires_at"])
    op.create_table(
        "segments",
        sa.Column(
            "snapshot_id",
            sa.Integer(),
            sa.ForeignKey("snapshots.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("object_key", sa.Text(), nullable=False, unique=True),
        sa.Column("token_start", sa.Integer(), nullable=False),
        sa.Column("token_end", sa.Integer(), nullable=False),
        sa.Column("nbytes", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("digest", sa.Text(), nullable=True),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("created_at", sa.REAL(), nullable=False),
        sa.PrimaryKeyConstraint("snapshot_id", "rank", name="pk_segments"),
        sa.CheckConstraint("state IN ('writing', 'ready')", name="ck_segments_state"),
    )


def downgrade() -> None:
    for table in ("segments", "leases", "boundaries", "snapshots", "models", "settings"):
        op.drop_table(table)
