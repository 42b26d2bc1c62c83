"""The views show what revisions 0007 to 0011 recorded, and the measured costs.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05

``v_snapshots`` gains ``tenant`` (0009).  ``v_request_log`` gains ``remote``
(``remote_tokens``, 0007), ``written_by_ttl`` (0008), ``tenant`` (0009),
``answer_id`` (0010) and ``restore_reason`` (0011); not ``fingerprint``
(0010): digests of the prompt's parts, which say nothing to a person and
would let a guess of a short part be confirmed.  New view ``v_costs`` shows
``costs`` (0011) in people's units (tokens/s, MB/s).  The columns are added
at the end, so a query by position still reads what it read.  The view text
is copied here on purpose (history must not change);
``tests/index/test_schema.py`` checks that head holds ``schema.VIEWS``.  The
downgrade restores the views of 0006 and 0005 before any older downgrade
drops a column they now name.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

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

V_SNAPSHOTS_0012 = """CREATE VIEW v_snapshots AS
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
       datetime(s.uploaded_at, 'unixepoch') AS uploaded,
       s.tenant AS tenant
FROM snapshots AS s JOIN models AS m ON m.id = s.model_id"""

V_REQUEST_LOG_0005 = """CREATE VIEW v_request_log AS
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

V_REQUEST_LOG_0012 = """CREATE VIEW v_request_log AS
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
       r.model_id AS model_id,
       r.remote_tokens AS remote,
       r.written_by_ttl AS written_by_ttl,
       r.tenant AS tenant,
       r.answer_id AS answer_id,
       r.restore_reason AS restore_reason
FROM request_log AS r LEFT JOIN models AS m ON m.id = r.model_id"""

V_COSTS = """CREATE VIEW v_costs AS
SELECT CASE WHEN c.model = '' THEN '(host)'
            ELSE coalesce(m.name, c.model) END AS model,
       c.source AS source,
       c.bucket AS bucket,
       CASE WHEN c.source = 'prefill' THEN 1 << c.bucket END AS prompt_max,
       CASE WHEN c.source = 'prefill' AND c.unit_s > 0
            THEN round(1.0 / c.unit_s) END AS tokens_per_s,
       CASE WHEN c.source <> 'prefill' AND c.unit_s > 0
            THEN round(1e-6 / c.unit_s, 1) END AS mb_per_s,
       round(c.latency_s, 4) AS latency_s,
       c.samples AS samples,
       datetime(c.updated_at, 'unixepoch') AS updated,
       c.model AS digest
FROM costs AS c LEFT JOIN models AS m ON m.digest = c.model"""


def upgrade() -> None:
    op.execute("DROP VIEW v_snapshots")
    op.execute(V_SNAPSHOTS_0012)
    op.execute("DROP VIEW v_request_log")
    op.execute(V_REQUEST_LOG_0012)
    op.execute(V_COSTS)


def downgrade() -> None:
    op.execute("DROP VIEW v_costs")
    op.execute("DROP VIEW v_request_log")
    op.execute(V_REQUEST_LOG_0005)
    op.execute("DROP VIEW v_snapshots")
    op.execute(V_SNAPSHOTS_0006)
