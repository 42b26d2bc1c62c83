"""A log of the requests served: what each prompt found cached and what it cost.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

``request_log`` holds one row per request (``request_id`` is unique; a second
record of the same request fills in what the first did not know), in the order
they were first recorded (``seq``, AUTOINCREMENT: never reused, so a reader
following the log by ``seq`` never misses a row).  The writer keeps the newest
rows only.  ``model_id`` names ``models.id`` without a foreign key: the log
outlives a deleted model.  The view text is copied here on purpose (history
must not change); ``tests/index/test_schema.py`` checks that head holds
``schema.VIEWS``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

V_REQUEST_LOG = """CREATE VIEW v_request_log AS
SELECT r.seq AS seq,
       datetime(r.created_at, 'unixepoch') AS created,
       coalesce(r.model, m.name, '#' || r.model_id) AS model,
       r.api AS api,
       r.prompt_tokens AS prompt,
       coalesce(r.live_tokens, 0) + coalesce(r.restored_tokens, 0) AS cached,
       r.live_tokens AS live,
       r.restored_tokens AS restored,
       r.written_tokens AS written,
       r.output_tokens AS output,
       r.breakpoints AS breakpoints,
       r.cache_key AS cache_key,
       round(r.queue_s, 3) AS queue_s,
       round(r.restore_s, 3) AS restore_s,
       round(r.ttft_s, 3) AS ttft_s,
       round(r.total_s, 3) AS total_s,
       r.status AS status,
       r.request_id AS request_id,
       r.model_id AS model_id
FROM request_log AS r LEFT JOIN models AS m ON m.id = r.model_id"""


def upgrade() -> None:
    op.create_table(
        "request_log",
        sa.Column("seq", sa.Integer(), primary_key=True),
        sa.Column("request_id", sa.Text(), nullable=False, unique=True),
        sa.Column("created_at", sa.REAL(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=True),
        sa.Column("model", sa.Text(), nullable=True),
        sa.Column("api", sa.Text(), nullable=True),
        sa.Column("cache_key", sa.Text(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("live_tokens", sa.Integer(), nullable=True),
        sa.Column("restored_tokens", sa.Integer(), nullable=True),
        sa.Column("written_tokens", sa.Integer(), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=True),
        sa.Column("breakpoints", sa.Text(), nullable=True),
        sa.Column("queue_s", sa.REAL(), nullable=True),
        sa.Column("restore_s", sa.REAL(), nullable=True),
        sa.Column("ttft_s", sa.REAL(), nullable=True),
        sa.Column("total_s", sa.REAL(), nullable=True),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.CheckConstraint(
            "api IN ('messages', 'chat', 'completions', 'responses')", name="ck_request_log_api"
        ),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_request_log_model_seq", "request_log", ["model_id", "seq"])
    op.create_index(
        "ix_request_log_cache_key",
        "request_log",
        ["cache_key"],
        sqlite_where=sa.text("cache_key IS NOT NULL"),
    )
    op.execute(V_REQUEST_LOG)


def downgrade() -> None:
    op.execute("DROP VIEW v_request_log")
    op.drop_table("request_log")
