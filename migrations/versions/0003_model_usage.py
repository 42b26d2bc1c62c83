"""Per-model usage totals kept by triggers, so retention never scans snapshots.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29

``model_usage`` holds, for every model, how many snapshots it has and how many
payload bytes they take.  Triggers on ``snapshots`` keep it exact inside the
same transaction as every insert, delete and size change, so the budget, entry
and total checks of the retention rules cost one row read, whatever the size
of the store.  The trigger text is copied here on purpose (history must not
change); ``tests/index/test_schema.py`` checks that head holds ``schema.TRIGGERS``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TRIGGERS: dict[str, str] = {
    "tr_usage_insert": """CREATE TRIGGER tr_usage_insert AFTER INSERT ON snapshots
BEGIN
    INSERT INTO model_usage (model_id, snapshots, nbytes) VALUES (NEW.model_id, 1, NEW.nbytes)
    ON CONFLICT (model_id) DO UPDATE SET snapshots = snapshots + 1, nbytes = nbytes + NEW.nbytes;
END""",
    "tr_usage_delete": """CREATE TRIGGER tr_usage_delete AFTER DELETE ON snapshots
BEGIN
    UPDATE model_usage SET snapshots = snapshots - 1, nbytes = nbytes - OLD.nbytes
    WHERE model_id = OLD.model_id;
END""",
    "tr_usage_resize": """CREATE TRIGGER tr_usage_resize AFTER UPDATE OF nbytes ON snapshots
BEGIN
    UPDATE model_usage SET nbytes = nbytes + NEW.nbytes - OLD.nbytes
    WHERE model_id = NEW.model_id;
END""",
}

BACKFILL = """INSERT INTO model_usage (model_id, snapshots, nbytes)
SELECT model_id, count(*), coalesce(sum(nbytes), 0) FROM snapshots GROUP BY model_id"""


def upgrade() -> None:
    op.create_table(
        "model_usage",
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("snapshots", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("nbytes", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("model_id", name="pk_model_usage"),
    )
    op.execute(BACKFILL)
    for create_trigger in TRIGGERS.values():
        op.execute(create_trigger)


def downgrade() -> None:
    for name in reversed(TRIGGERS):
        op.execute(f"DROP TRIGGER IF EXISTS {name}")
    op.drop_table("model_usage")
