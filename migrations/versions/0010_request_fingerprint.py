"""Record what cache-miss diagnostics compare: the answer's id and the prompt's fingerprint.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02

``request_log.answer_id``: the id the client saw on the answer (Anthropic
``msg_...``, OpenAI Responses ``resp_...``), which a later request names to be
compared with this one; ``request_log.fingerprint``: the digests of the parts
of the prompt (model, tools, system, each message, ...), JSON text holding
hashes only, never the prompt's text (docs/serve.md, "Cache-miss
diagnostics").  Both NULL for rows from before and for requests that asked for
no diagnostics.  A partial index finds a row by its answer's id.  The views are
unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("request_log", sa.Column("answer_id", sa.Text(), nullable=True))
    op.add_column("request_log", sa.Column("fingerprint", sa.Text(), nullable=True))
    op.create_index("ix_request_log_answer_id", "request_log", ["answer_id"],
                    sqlite_where=sa.text("answer_id IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("ix_request_log_answer_id", table_name="request_log")
    op.drop_column("request_log", "fingerprint")
    op.drop_column("request_log", "answer_id")
