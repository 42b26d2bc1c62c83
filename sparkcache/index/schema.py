"""The index schema at head, defined once in SQLAlchemy Core, plus the SQL text next to it.

``METADATA`` describes the newest revision (``SCHEMA_REVISION``).  The alembic
revisions under ``migrations/versions`` are frozen history: each spells out its own
``op.create_table`` calls so that editing this module never rewrites the past.
``tests/index/test_schema.py`` checks that a database migrated to head is exactly
what this module describes (tables, indexes, views), so the two cannot drift.

Conventions: timestamps are REAL unix seconds (``time.time()``); digests and keys
are lower-case hex text; prefix hashes are 16-byte BLOBs.  See ``docs/index.md``
for what every column means and who writes it.
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import (
    REAL,
    CheckConstraint,
    Column,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    text,
)

__all__ = [
    "BEGIN_DEFERRED",
    "BEGIN_IMMEDIATE",
    "BOUNDARIES",
    "BOUNDARY_KINDS",
    "COMMIT",
    "COSTS",
    "COUNTERS",
    "DEFAULT_BUSY_TIMEOUT_MS",
    "JOURNAL_MODE",
    "LEASES",
    "METADATA",
    "MODELS",
    "MODEL_USAGE",
    "PRAGMAS",
    "RELEASE_SAVEPOINT",
    "REQUEST_APIS",
    "REQUEST_LOG",
    "ROLLBACK",
    "ROLLBACK_TO_SAVEPOINT",
    "SAVEPOINT",
    "SCHEMA_REVISION",
    "SEGMENTS",
    "SEGMENT_STATES",
    "SELECT_ALEMBIC_VERSION",
    "SETTINGS",
    "SETTING_SQLITE_VERSION",
    "SNAPSHOTS",
    "SNAPSHOT_STATES",
    "TABLE_EXISTS",
    "TRIGGERS",
    "USER_OBJECT_COUNT",
    "VIEWS",
    "V_COSTS",
    "V_COUNTERS",
    "V_LEASES",
    "V_MODELS",
    "V_REQUEST_LOG",
    "V_SEGMENTS",
    "V_SNAPSHOTS",
]

# The alembic revision this metadata describes.  ``migrate.ensure_schema`` compares
# it with the database's ``alembic_version`` so that an up-to-date open never has to
# import alembic; a test checks it equals the newest revision file.
SCHEMA_REVISION: Final = "0012"

# -- connection settings --------------------------------------------------------------------
# WAL: readers never block the writer; one writer at a time (BEGIN IMMEDIATE).
JOURNAL_MODE: Final = "wal"
# Applied on every connection, in order.  FULL syncs the WAL on every commit: a
# committed row survives power loss, which the "files deleted after the commit that
# forgets them" rule relies on.  Foreign keys are off by default in SQLite.
PRAGMAS: Final[tuple[tuple[str, str], ...]] = (
    ("synchronous", "FULL"),
    ("foreign_keys", "ON"),
)
DEFAULT_BUSY_TIMEOUT_MS: Final = 10_000

# -- SQL the connection layer runs --------------------------------------------------------
BEGIN_DEFERRED: Final = "BEGIN"
BEGIN_IMMEDIATE: Final = "BEGIN IMMEDIATE"
COMMIT: Final = "COMMIT"
ROLLBACK: Final = "ROLLBACK"
SAVEPOINT: Final = "SAVEPOINT {name}"
RELEASE_SAVEPOINT: Final = "RELEASE SAVEPOINT {name}"
ROLLBACK_TO_SAVEPOINT: Final = "ROLLBACK TO SAVEPOINT {name}"
TABLE_EXISTS: Final = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
USER_OBJECT_COUNT: Final = "SELECT count(*) FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"
SELECT_ALEMBIC_VERSION: Final = "SELECT version_num FROM alembic_version"
# settings key holding the SQLite library version of the last process that opened
# the store (the statements live in ``queries``).
SETTING_SQLITE_VERSION: Final = "sqlite_version"

# -- enumerations (CHECK constraints) -----------------------------------------------------
SNAPSHOT_STATES: Final = ("pending", "ready", "quarantined")
SEGMENT_STATES: Final = ("writing", "ready")
BOUNDARY_KINDS: Final = ("end", "stride", "breakpoint")
# The server API a logged request came through (NULL: not through the server).
REQUEST_APIS: Final = ("messages", "chat", "completions", "responses")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


METADATA: Final = MetaData()

SETTINGS: Final = Table(
    "settings",
    METADATA,
    Column("key", Text, primary_key=True),
    Column("value", Text, nullable=False),
    Column("updated_at", REAL, nullable=False),
)

MODELS: Final = Table(
    "models",
    METADATA,
    Column("id", Integer, primary_key=True),
    Column("digest", Text, nullable=False, unique=True),
    Column("name", Text, nullable=False),
    Column("folder", Text, nullable=False, unique=True),
    Column("identity_json", Text, nullable=False),
    Column("created_at", REAL, nullable=False),
    Column("deleted_at", REAL, nullable=True),
)

SNAPSHOTS: Final = Table(
    "snapshots",
    METADATA,
    Column("id", Integer, primary_key=True),
    Column("model_id", Integer, ForeignKey("models.id", ondelete="CASCADE"), nullable=False),
    Column("snap_key", Text, nullable=False),
    Column("n_tokens", Integer, nullable=False),
    Column("start_token", Integer, nullable=False, server_default=text("0")),
    # No cascade: a parent that still has children cannot be deleted.
    Column("parent_id", Integer, ForeignKey("snapshots.id"), nullable=True),
    Column("depth", Integer, nullable=False, server_default=text("0")),
    Column("world_size", Integer, nullable=False),
    Column("nbytes", Integer, nullable=False, server_default=text("0")),
    Column("state", Text, nullable=False),
    Column("reason", Text, nullable=True),
    Column("pinned", Integer, nullable=False, server_default=text("0")),
    Column("created_at", REAL, nullable=False),
    Column("last_used", REAL, nullable=False),
    Column("use_count", Integer, nullable=False, server_default=text("0")),
    # Revision 0004: the canonical JSON of the request scope (cache salt, LoRA,
    # multimodal hashes) that seeded the snapshot's prefix hashes.  NULL only for
    # snapshots published before 0004, whose scope was not recorded.
    Column("scope_json", Text, nullable=True),
    # Revision 0006: when the snapshot's manifest reached the shared tier
    # (docs/shared.md); NULL: not uploaded, or no shared tier.
    Column("uploaded_at", REAL, nullable=True),
    # Revision 0009: the tenant whose request published it (docs/serve.md,
    # "Tenants"); NULL: none.
    Column("tenant", Text, nullable=True),
    CheckConstraint(_one_of("state", SNAPSHOT_STATES), name="ck_snapshots_state"),
    Index("ix_snapshots_model_state_used", "model_id", "state", "last_used"),
    Index("ix_snapshots_state_used", "state", "last_used"),
    Index("ix_snapshots_parent", "parent_id"),
    # Revision 0006: the uploader's queue, parents first; holds only the ready
    # snapshots not uploaded yet.
    Index("ix_snapshots_upload", "depth", "id",
          sqlite_where=text("state = 'ready' AND uploaded_at IS NULL")),
    # Revision 0009: one tenant's snapshots, least recently used first (its
    # limits, its listing and its clear); holds only the rows with a tenant.
    Index("ix_snapshots_tenant_used", "model_id", "tenant", "state", "last_used",
          sqlite_where=text("tenant IS NOT NULL")),
    # One live snapshot per key and model; quarantined rows may pile up beside it.
    Index(
        "ux_snapshots_model_key_live",
        "model_id",
        "snap_key",
        unique=True,
        sqlite_where=text("state IN ('pending', 'ready')"),
    ),
    # Ids are never reused, so a stale id held by a reader can never name a new row.
    sqlite_autoincrement=True,
)

SEGMENTS: Final = Table(
    "segments",
    METADATA,
    Column(
        "snapshot_id",
        Integer,
        ForeignKey("snapshots.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("rank", Integer, nullable=False),
    Column("object_key", Text, nullable=False, unique=True),
    Column("token_start", Integer, nullable=False),
    Column("token_end", Integer, nullable=False),
    Column("nbytes", Integer, nullable=False, server_default=text("0")),
    Column("digest", Text, nullable=True),
    Column("state", Text, nullable=False),
    Column("created_at", REAL, nullable=False),
    PrimaryKeyConstraint("snapshot_id", "rank", name="pk_segments"),
    CheckConstraint(_one_of("state", SEGMENT_STATES), name="ck_segments_state"),
)

BOUNDARIES: Final = Table(
    "boundaries",
    METADATA,
    Column("prefix_hash", LargeBinary, nullable=False),
    Column(
        "snapshot_id",
        Integer,
        ForeignKey("snapshots.id", ondelete="CASCADE"),
        nullable=False,
    ),
    # Copied from the snapshot so a lookup filters by model without a join.
    Column("model_id", Integer, nullable=False),
    Column("n_tokens", Integer, nullable=False),
    Column("kind", Text, nullable=False),
    PrimaryKeyConstraint("prefix_hash", "snapshot_id", name="pk_boundaries"),
    CheckConstraint(_one_of("kind", BOUNDARY_KINDS), name="ck_boundaries_kind"),
    Index("ix_boundaries_snapshot", "snapshot_id"),
    # The rows are the primary-key b-tree itself: one probe per hash, no rowid detour.
    sqlite_with_rowid=False,
)

LEASES: Final = Table(
    "leases",
    METADATA,
    Column("id", Integer, primary_key=True),
    Column(
        "snapshot_id",
        Integer,
        ForeignKey("snapshots.id", ondelete="CASCADE"),
        nullable=True,
    ),
    Column("holder", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("created_at", REAL, nullable=False),
    Column("expires_at", REAL, nullable=False),
    Index("ix_leases_snapshot_expires", "snapshot_id", "expires_at"),
    Index("ix_leases_expires", "expires_at"),
    sqlite_autoincrement=True,
)

# Revision 0002.  model_id 0 means "the whole store"; no foreign key so that a
# counter outlives the model it counted.
COUNTERS: Final = Table(
    "counters",
    METADATA,
    Column("model_id", Integer, nullable=False, server_default=text("0")),
    Column("name", Text, nullable=False),
    Column("value", Integer, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("model_id", "name", name="pk_counters"),
)

# Revision 0003.  Kept exact by the triggers below, in the same transaction as
# every change to ``snapshots``: retention reads one row instead of summing.
MODEL_USAGE: Final = Table(
    "model_usage",
    METADATA,
    Column("model_id", Integer, ForeignKey("models.id", ondelete="CASCADE"), nullable=False),
    Column("snapshots", Integer, nullable=False, server_default=text("0")),
    Column("nbytes", Integer, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("model_id", name="pk_model_usage"),
)

# Revision 0005.  One row per request, in the order first recorded: ``seq`` is
# AUTOINCREMENT (never reused), so a reader following the log by seq misses no
# row, and trimming to the newest N rows is one range delete on the primary key.
# No foreign key on model_id: the log outlives a deleted model.
REQUEST_LOG: Final = Table(
    "request_log",
    METADATA,
    Column("seq", Integer, primary_key=True),
    Column("request_id", Text, nullable=False, unique=True),
    Column("created_at", REAL, nullable=False),
    Column("model_id", Integer, nullable=True),
    Column("model", Text, nullable=True),
    Column("api", Text, nullable=True),
    Column("cache_key", Text, nullable=True),
    Column("prompt_tokens", Integer, nullable=True),
    Column("live_tokens", Integer, nullable=True),
    Column("restored_tokens", Integer, nullable=True),
    Column("written_tokens", Integer, nullable=True),
    Column("output_tokens", Integer, nullable=True),
    Column("breakpoints", Text, nullable=True),
    Column("queue_s", REAL, nullable=True),
    Column("restore_s", REAL, nullable=True),
    Column("ttft_s", REAL, nullable=True),
    Column("total_s", REAL, nullable=True),
    Column("status", Integer, nullable=True),
    # Revision 0007: of restored_tokens, those the shared tier supplied.
    Column("remote_tokens", Integer, nullable=True),
    # Revision 0008: written_tokens by the keep time of their breakpoints (JSON).
    Column("written_by_ttl", Text, nullable=True),
    # Revision 0009: the request's tenant (docs/serve.md, "Tenants").
    Column("tenant", Text, nullable=True),
    # Revision 0010: the answer's id as the client saw it, and the prompt's
    # fingerprint (digests only) that cache-miss diagnostics compare.
    Column("answer_id", Text, nullable=True),
    Column("fingerprint", Text, nullable=True),
    # Revision 0011: why the connector restored what it did, or recomputed
    # (docs/connector.md, "Restore or recompute"); NULL: nothing to restore.
    Column("restore_reason", Text, nullable=True),
    CheckConstraint(_one_of("api", REQUEST_APIS), name="ck_request_log_api"),
    # One model's requests, newest first (the log's listing and --follow).
    Index("ix_request_log_model_seq", "model_id", "seq"),
    # The requests of one prompt_cache_key; most requests have none.
    Index("ix_request_log_cache_key", "cache_key", sqlite_where=text("cache_key IS NOT NULL")),
    # A request by its answer's id (diagnostics); most requests have none.
    Index("ix_request_log_answer_id", "answer_id", sqlite_where=text("answer_id IS NOT NULL")),
    sqlite_autoincrement=True,
)

# Revision 0011.  The connector's cost model (docs/connector.md, "Restore or
# recompute"): one row per measured rate, kept across restarts.  ``model``: the
# identity digest for an engine's own rates (prefill, step), '' for a source
# every engine on the host shares (local disk, verification, a shared tier);
# ``bucket``: the prompt-length bucket of a prefill rate (0 otherwise);
# ``unit_s``: seconds per unit (a token for prefill, a byte for a restore);
# ``latency_s``: the fixed seconds of one use (a step's overhead, a tier's
# first byte); both are averages in which recent measurements weigh more.
COSTS: Final = Table(
    "costs",
    METADATA,
    Column("model", Text, nullable=False),
    Column("source", Text, nullable=False),
    Column("bucket", Integer, nullable=False, server_default=text("0")),
    Column("unit_s", REAL, nullable=False),
    Column("latency_s", REAL, nullable=False, server_default=text("0")),
    Column("samples", Integer, nullable=False, server_default=text("0")),
    Column("updated_at", REAL, nullable=False),
    PrimaryKeyConstraint("model", "source", "bucket", name="pk_costs"),
)

TR_USAGE_INSERT: Final = """CREATE TRIGGER tr_usage_insert AFTER INSERT ON snapshots
BEGIN
    INSERT INTO model_usage (model_id, snapshots, nbytes) VALUES (NEW.model_id, 1, NEW.nbytes)
    ON CONFLICT (model_id) DO UPDATE SET snapshots = snapshots + 1, nbytes = nbytes + NEW.nbytes;
END"""
TR_USAGE_DELETE: Final = """CREATE TRIGGER tr_usage_delete AFTER DELETE ON snapshots
BEGIN
    UPDATE model_usage SET snapshots = snapshots - 1, nbytes = nbytes - OLD.nbytes
    WHERE model_id = OLD.model_id;
END"""
TR_USAGE_RESIZE: Final = """CREATE TRIGGER tr_usage_resize AFTER UPDATE OF nbytes ON snapshots
BEGIN
    UPDATE model_usage SET nbytes = nbytes + NEW.nbytes - OLD.nbytes
    WHERE model_id = NEW.model_id;
END"""

# name -> CREATE TRIGGER statement (revision 0003).
TRIGGERS: Final[dict[str, str]] = {
    "tr_usage_insert": TR_USAGE_INSERT,
    "tr_usage_delete": TR_USAGE_DELETE,
    "tr_usage_resize": TR_USAGE_RESIZE,
}

# -- views for people at the sqlite3 shell (revisions 0002, 0005, 0006 and 0012) ----------------
# Times are UTC 'YYYY-MM-DD HH:MM:SS' text, which sorts like the number it shows;
# sizes are decimal megabytes (10**6 bytes).  Nothing in sparkcache reads the views.
# v_leases computes "now" in unix seconds as (julianday('now') - 2440587.5) * 86400.0,
# which works on every SQLite (unixepoch('subsec') needs 3.42).

V_MODELS: Final = """CREATE VIEW v_models AS
SELECT m.id AS id,
       m.name AS name,
       m.digest AS digest,
       (SELECT count(*) FROM snapshots AS s WHERE s.model_id = m.id) AS snapshots,
       (SELECT count(*) FROM snapshots AS s
         WHERE s.model_id = m.id AND s.state = 'ready') AS ready,
       round((SELECT coalesce(sum(s.nbytes), 0) FROM snapshots AS s
               WHERE s.model_id = m.id) / 1e6, 1) AS mb,
       datetime(m.created_at, 'unixepoch') AS created,
       datetime(m.deleted_at, 'unixepoch') AS deleted
FROM models AS m"""

V_SNAPSHOTS: Final = """CREATE VIEW v_snapshots AS
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

V_SEGMENTS: Final = """CREATE VIEW v_segments AS
SELECT g.snapshot_id AS snapshot_id,
       g.rank AS rank,
       g.state AS state,
       g.token_start AS token_start,
       g.token_end AS token_end,
       round(g.nbytes / 1e6, 1) AS mb,
       g.digest AS digest,
       datetime(g.created_at, 'unixepoch') AS created,
       g.object_key AS object_key
FROM segments AS g"""

V_LEASES: Final = """CREATE VIEW v_leases AS
SELECT l.id AS id,
       l.snapshot_id AS snapshot_id,
       l.kind AS kind,
       l.holder AS holder,
       datetime(l.created_at, 'unixepoch') AS created,
       datetime(l.expires_at, 'unixepoch') AS expires,
       round(l.expires_at - (julianday('now') - 2440587.5) * 86400.0, 1) AS seconds_left,
       l.expires_at <= (julianday('now') - 2440587.5) * 86400.0 AS expired
FROM leases AS l"""

V_COUNTERS: Final = """CREATE VIEW v_counters AS
SELECT CASE WHEN c.model_id = 0 THEN '(all)'
            ELSE coalesce(m.name, '#' || c.model_id) END AS model,
       c.name AS name,
       c.value AS value,
       c.model_id AS model_id
FROM counters AS c LEFT JOIN models AS m ON m.id = c.model_id"""

# Revisions 0005 and 0012.  ``model``: as the request named it, else the engine's
# model name; ``cached``: tokens the request did not compute (live + restored).
# ``fingerprint`` is left out: digests of the prompt's parts say nothing to a
# person, and would let a guess of a short part be confirmed.
V_REQUEST_LOG: Final = """CREATE VIEW v_request_log AS
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

# Revision 0012.  ``model``: the engine's model name for its own rates, ``(host)``
# for a source every engine of the host shares (as ``sparkcache stats`` writes
# it); the rates in people's units: tokens/s for prefill, MB/s for a restore.
V_COSTS: Final = """CREATE VIEW v_costs AS
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

# name -> CREATE VIEW statement, in creation order.
VIEWS: Final[dict[str, str]] = {
    "v_models": V_MODELS,
    "v_snapshots": V_SNAPSHOTS,
    "v_segments": V_SEGMENTS,
    "v_leases": V_LEASES,
    "v_counters": V_COUNTERS,
    "v_request_log": V_REQUEST_LOG,
    "v_costs": V_COSTS,
}
