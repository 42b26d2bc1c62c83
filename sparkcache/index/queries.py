"""The SQL the store runs, as named constants next to the schema.

Every statement touches indexed columns only, so its cost grows with the rows
it reads or writes, not with the size of the store (design invariant 6).
"""

from __future__ import annotations

# -- models -------------------------------------------------------------------
MODEL_BY_DIGEST = "SELECT id FROM models WHERE digest = ? AND deleted_at IS NULL"
INSERT_MODEL = (
    "INSERT INTO models (digest, name, folder, identity_json, created_at) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (digest) DO UPDATE SET deleted_at = NULL RETURNING id"
)
MODEL_COLUMNS = "id, digest, name, folder, identity_json, created_at, deleted_at"
MODEL_BY_ID = f"SELECT {MODEL_COLUMNS} FROM models WHERE id = ?"
MARK_MODEL_DELETED = "UPDATE models SET deleted_at = ? WHERE id = ? AND deleted_at IS NULL"
DELETE_MODEL = "DELETE FROM models WHERE id = ?"
DELETED_MODELS = f"SELECT {MODEL_COLUMNS} FROM models WHERE deleted_at IS NOT NULL"
MODEL_FOLDERS = "SELECT folder FROM models"
COUNT_MODEL_SNAPSHOTS = "SELECT count(*) FROM snapshots WHERE model_id = ?"
MODEL_SNAPSHOTS_DEEPEST_FIRST = (
    "SELECT id FROM snapshots WHERE model_id = ? ORDER BY depth DESC, id DESC"
)
# One tenant's snapshots of a model (its clear), through ix_snapshots_tenant_used.
TENANT_SNAPSHOTS_DEEPEST_FIRST = (
    "SELECT id FROM snapshots WHERE model_id = ? AND tenant = ? ORDER BY depth DESC, id DESC"
)

# -- tenants (revision 0009; docs/serve.md, "Tenants") -------------------------
#: (snapshots, bytes) of one tenant in a group of models (json list of ids).
TENANT_USAGE = (
    "SELECT count(*), coalesce(sum(nbytes), 0) FROM snapshots "
    "WHERE tenant = ? AND model_id IN (SELECT value FROM json_each(?))"
)
#: The tenants of a group of models with their (snapshots, bytes), most bytes first.
TENANTS_OF_MODELS = (
    "SELECT tenant, count(*), coalesce(sum(nbytes), 0) FROM snapshots "
    "WHERE tenant IS NOT NULL AND model_id IN (SELECT value FROM json_each(?)) "
    "GROUP BY tenant ORDER BY 3 DESC, tenant"
)
#: Every (model, tenant) with snapshots: (model_id, tenant, snapshots, bytes).
TENANT_SNAPSHOT_SUMS = (
    "SELECT model_id, tenant, count(*), coalesce(sum(nbytes), 0) FROM snapshots "
    "WHERE tenant IS NOT NULL GROUP BY model_id, tenant"
)
#: Every (model, tenant) in the request log: (model_id, tenant, requests, prompt
#: tokens, cached tokens); model_id NULL where the connector never saw the request.
TENANT_REQUEST_SUMS = (
    "SELECT model_id, tenant, count(*), coalesce(sum(prompt_tokens), 0), "
    "coalesce(sum(live_tokens), 0) + coalesce(sum(restored_tokens), 0) FROM request_log "
    "WHERE tenant IS NOT NULL GROUP BY model_id, tenant"
)

# -- snapshots ----------------------------------------------------------------
SNAPSHOT_COLUMNS = (
    "id, model_id, snap_key, n_tokens, start_token, parent_id, depth, world_size, nbytes, "
    "state, reason, pinned, created_at, last_used, use_count, scope_json, uploaded_at, tenant"
)
SNAPSHOT_BY_ID = f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE id = ?"
LIVE_SNAPSHOT_BY_KEY = (
    f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots "
    "WHERE model_id = ? AND snap_key = ? AND state IN ('pending', 'ready')"
)
SNAPSHOT_STATES_BY_KEY = "SELECT state FROM snapshots WHERE model_id = ? AND snap_key = ?"
INSERT_SNAPSHOT = (
    "INSERT INTO snapshots (model_id, snap_key, n_tokens, start_token, parent_id, depth, "
    "world_size, nbytes, state, pinned, created_at, last_used, use_count, scope_json, tenant) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, 0, 'pending', 0, ?, ?, 0, ?, ?) RETURNING id"
)
ADD_SNAPSHOT_BYTES = "UPDATE snapshots SET nbytes = nbytes + ? WHERE id = ?"
MARK_READY = (
    "UPDATE snapshots SET state = 'ready', created_at = ?, last_used = ? "
    "WHERE id = ? AND state = 'pending'"
)
# Root first: every link of the chain that holds rows below ``n_tokens``.
CHAIN = """
WITH RECURSIVE chain(id, parent_id, start_token, n_tokens, snap_key, state, lvl) AS (
    SELECT id, parent_id, start_token, n_tokens, snap_key, state, 0 FROM snapshots WHERE id = ?
    UNION ALL
    SELECT s.id, s.parent_id, s.start_token, s.n_tokens, s.snap_key, s.state, c.lvl + 1
    FROM snapshots AS s JOIN chain AS c ON s.id = c.parent_id
)
SELECT id, start_token, n_tokens, snap_key, state FROM chain ORDER BY lvl DESC
"""
# The snapshot and all its descendants, deepest first (safe deletion order).
MODEL_USAGE = "SELECT snapshots, nbytes FROM model_usage WHERE model_id = ?"
TOTAL_USAGE = "SELECT coalesce(sum(snapshots), 0), coalesce(sum(nbytes), 0) FROM model_usage"
SUBTREE = """
WITH RECURSIVE sub(id, lvl) AS (
    SELECT id, 0 FROM snapshots WHERE id = ?
    UNION ALL
    SELECT s.id, sub.lvl + 1 FROM snapshots AS s JOIN sub ON s.parent_id = sub.id
)
SELECT id FROM sub ORDER BY lvl DESC
"""
QUARANTINE = (
    "UPDATE snapshots SET state = 'quarantined', reason = ? "
    "WHERE id = ? AND state != 'quarantined'"
)
# A quarantined snapshot whose files verified whole again (verify --requeue).
REQUEUE = (
    "UPDATE snapshots SET state = 'ready', reason = NULL WHERE id = ? AND state = 'quarantined'"
)
QUARANTINED_PARENTS_FIRST = (
    f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE state = 'quarantined' ORDER BY depth, id"
)
# A sample of the payload objects the index expects (check() and verify() look
# for them before quarantining anything: none found means the storage is wrong).
SAMPLE_READY_KEYS = (
    "SELECT object_key FROM segments WHERE state = 'ready' ORDER BY random() LIMIT ?"
)
# What an engine's start reads into the page cache (reader.warm): one model's
# ready segment files, the most recently used snapshots first; a range scan of
# ix_snapshots_model_state_used, stopped by LIMIT (the models of several
# shardings are merged by last_used in Python).
WARM_SEGMENTS = (
    "SELECT s.last_used, s.id, g.object_key, g.nbytes FROM snapshots s "
    "JOIN segments g ON g.snapshot_id = s.id "
    "WHERE s.model_id = ? AND s.state = 'ready' AND g.state = 'ready' "
    "ORDER BY s.last_used DESC, s.id DESC, g.rank LIMIT ?"
)
# A restore's use, saved later than it happened (Core.record_use): never moves
# last_used back, and adds the uses counted meanwhile.
RECORD_USE = (
    "UPDATE snapshots SET last_used = max(last_used, ?), use_count = use_count + ? WHERE id = ?"
)
SET_PINNED = "UPDATE snapshots SET pinned = ? WHERE id = ?"
# -- the shared tier (sparkcache.shared) ----------------------------------------
# The uploader's queue: ready snapshots not uploaded yet, parents first (a
# parent's depth is below its children's); one range scan of ix_snapshots_upload
# (named: without statistics the planner would take the state index and sort).
UPLOAD_QUEUE = (
    "SELECT id FROM snapshots INDEXED BY ix_snapshots_upload "
    "WHERE state = 'ready' AND uploaded_at IS NULL "
    "ORDER BY depth, id LIMIT ?"
)
UPLOAD_QUEUE_COUNT = (
    "SELECT count(*) FROM snapshots INDEXED BY ix_snapshots_upload "
    "WHERE state = 'ready' AND uploaded_at IS NULL"
)
MARK_UPLOADED = "UPDATE snapshots SET uploaded_at = ? WHERE id = ? AND uploaded_at IS NULL"
# A store that records another shared tier uploads everything again.
FORGET_UPLOADS = "UPDATE snapshots SET uploaded_at = NULL WHERE uploaded_at IS NOT NULL"
# A parent the tier's sweep deleted goes again before a new child of it.
FORGET_UPLOAD = "UPDATE snapshots SET uploaded_at = NULL WHERE id = ?"
DELETE_SNAPSHOT = "DELETE FROM snapshots WHERE id = ?"
LIST_SNAPSHOTS = f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots"
# Snapshots whose parent row is gone (only a tampered index or one written with
# foreign keys off has them): check() finds them.
ORPHAN_SNAPSHOTS = (
    "SELECT s.id FROM snapshots AS s WHERE s.parent_id IS NOT NULL "
    "AND NOT EXISTS (SELECT 1 FROM snapshots AS p WHERE p.id = s.parent_id)"
)
PENDING_SNAPSHOTS = f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE state = 'pending'"
# Eviction candidates of one state, least recently used first: leaves only (a
# parent still needed by a child goes after it), never pinned.  Leases are
# checked per row (a dead holder's lease blocks nothing).  ``{filters}`` is
# built from the constants below only.  Served by ix (state, last_used) or
# (model_id, state, last_used): the scan stops after LIMIT rows.
#: Every model row not deleted (one per model and sharding: a small table).
LIVE_MODELS = ("SELECT id, digest, name, folder, identity_json, created_at, deleted_at "
               "FROM models WHERE deleted_at IS NULL ORDER BY id")

EVICTABLE = """
SELECT s.id, s.nbytes FROM snapshots AS s
WHERE s.state = ? {filters}
  AND s.pinned = 0
  AND NOT EXISTS (SELECT 1 FROM snapshots AS c WHERE c.parent_id = s.id)
  AND s.id NOT IN (SELECT value FROM json_each(?))
ORDER BY s.last_used LIMIT ?
"""
EVICT_FILTER_MODEL = "AND s.model_id = ?"
EVICT_FILTER_MODELS = "AND s.model_id IN (SELECT value FROM json_each(?))"
EVICT_FILTER_OLDER = "AND s.last_used < ?"
EVICT_FILTER_TENANT = "AND s.tenant = ?"

# -- segments -----------------------------------------------------------------
SEGMENT_COLUMNS = (
    "snapshot_id, rank, object_key, token_start, token_end, nbytes, digest, state, created_at"
)
SEGMENT = f"SELECT {SEGMENT_COLUMNS} FROM segments WHERE snapshot_id = ? AND rank = ?"
SEGMENTS_OF = f"SELECT {SEGMENT_COLUMNS} FROM segments WHERE snapshot_id = ? ORDER BY rank"
INSERT_SEGMENT = (
    "INSERT INTO segments (snapshot_id, rank, object_key, token_start, token_end, nbytes, "
    "digest, state, created_at) VALUES (?, ?, ?, ?, ?, 0, NULL, 'writing', ?)"
)
FINISH_SEGMENT = (
    "UPDATE segments SET state = 'ready', nbytes = ?, digest = ? "
    "WHERE snapshot_id = ? AND rank = ? AND state = 'writing'"
)
DELETE_SEGMENT = "DELETE FROM segments WHERE snapshot_id = ? AND rank = ?"
COUNT_SEGMENTS = "SELECT count(*) FROM segments WHERE snapshot_id = ?"
COUNT_READY_SEGMENTS = "SELECT count(*) FROM segments WHERE snapshot_id = ? AND state = 'ready'"
ALL_SEGMENT_KEYS = "SELECT object_key FROM segments"
# Ready segments of snapshots not quarantined (check() looks for their files).
READY_SEGMENTS = (
    "SELECT " + ", ".join(f"g.{c.strip()}" for c in SEGMENT_COLUMNS.split(",")) + " "
    "FROM segments AS g JOIN snapshots AS s ON s.id = g.snapshot_id "
    "WHERE g.state = 'ready' AND s.state != 'quarantined'"
)
WRITING_SEGMENTS = f"SELECT {SEGMENT_COLUMNS} FROM segments WHERE state = 'writing'"
# Restorable: every expected rank has a ready segment of this link.
READY_RANKS = (
    "SELECT count(*) FROM segments WHERE snapshot_id = ? AND state = 'ready' "
    "AND rank IN (SELECT value FROM json_each(?))"
)

# -- boundaries (prefix ends, sparse aliases, breakpoints) ---------------------
INSERT_BOUNDARY = (
    "INSERT OR IGNORE INTO boundaries (prefix_hash, snapshot_id, model_id, n_tokens, kind) "
    "VALUES (?, ?, ?, ?, ?)"
)
# Hashes arrive as one JSON array of hex strings: a single prepared statement
# whatever the prompt length.
FIND_BOUNDARIES = (
    "SELECT b.prefix_hash, b.snapshot_id, b.n_tokens FROM boundaries AS b "
    "WHERE b.prefix_hash IN (SELECT unhex(value) FROM json_each(?)) AND b.model_id = ?"
)
# The same, snapshot ends only (a sliding-window snapshot restores only there).
FIND_ENDS = FIND_BOUNDARIES + " AND b.kind = 'end'"
# The lengths (up to a bound) of the snapshots with a row for this hash at this
# position: those sharing a prompt's first stride, where their ends may lie.
LENGTHS_SHARING = (
    "SELECT DISTINCT s.n_tokens FROM boundaries AS b JOIN snapshots AS s "
    "ON s.id = b.snapshot_id "
    "WHERE b.prefix_hash = ? AND b.model_id = ? AND b.n_tokens = ? AND s.n_tokens <= ?"
)
# Is there a row for this hash at this prompt position?  One primary-key probe.
HAS_BOUNDARY = (
    "SELECT 1 FROM boundaries WHERE prefix_hash = ? AND model_id = ? AND n_tokens = ? LIMIT 1"
)
# Quarantine keeps a snapshot's breakpoint rows (never at a stride position, so
# the lookup's binary search never probes them, and every candidate is checked
# for restorability): a requeue needs them, and no token ids can rebuild them.
DELETE_LOOKUP_BOUNDARIES = "DELETE FROM boundaries WHERE snapshot_id = ? AND kind != 'breakpoint'"
# A snapshot's explicit breakpoints, in tokens (an export carries them along).
BREAKPOINTS_OF = (
    "SELECT n_tokens FROM boundaries WHERE snapshot_id = ? AND kind = 'breakpoint' "
    "ORDER BY n_tokens"
)
# A child's breakpoints inside its parent's range, with their prefix hashes (the
# uploader's aliases for them: the link's own tokens cannot hash them).
BREAKPOINTS_BELOW = (
    "SELECT n_tokens, prefix_hash FROM boundaries WHERE snapshot_id = ? "
    "AND kind = 'breakpoint' AND n_tokens <= ? ORDER BY n_tokens"
)

# -- leases -------------------------------------------------------------------
INSERT_LEASE = (
    "INSERT INTO leases (snapshot_id, holder, kind, created_at, expires_at) "
    "VALUES (?, ?, ?, ?, ?) RETURNING id"
)
DELETE_LEASE = "DELETE FROM leases WHERE id = ?"
LEASE_COLUMNS = "id, snapshot_id, holder, kind, created_at, expires_at"
LEASES_OF = f"SELECT {LEASE_COLUMNS} FROM leases WHERE snapshot_id = ? ORDER BY id"
ALL_LEASES = f"SELECT {LEASE_COLUMNS} FROM leases"

# -- counters and settings ----------------------------------------------------
BUMP_COUNTER = (
    "INSERT INTO counters (model_id, name, value) VALUES (?, ?, ?) "
    "ON CONFLICT (model_id, name) DO UPDATE SET value = value + excluded.value"
)
COUNTERS = "SELECT model_id, name, value FROM counters"
GET_SETTING = "SELECT value FROM settings WHERE key = ?"
PUT_SETTING = (
    "INSERT INTO settings (key, value, updated_at) VALUES (?, ?, ?) "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at"
)

# -- the request log (sparkcache.requestlog) --------------------------------------
# The columns a record may write (all but seq), in table order.
REQUEST_FIELDS = (
    "request_id, created_at, model_id, model, api, cache_key, prompt_tokens, live_tokens, "
    "restored_tokens, written_tokens, output_tokens, breakpoints, queue_s, restore_s, ttft_s, "
    "total_s, status, remote_tokens, written_by_ttl, tenant, answer_id, fingerprint, "
    "restore_reason"
)
REQUEST_COLUMNS = f"seq, {REQUEST_FIELDS}"
# A record fills in the row of its request: a column it leaves NULL keeps its
# value.  An update, then an insert where nothing was updated, rather than one
# INSERT ... ON CONFLICT DO UPDATE: an upsert that updates still takes the next
# AUTOINCREMENT value, and the gaps it leaves (a request is recorded twice, when
# scheduled and when finished) would make TRIM_REQUEST_LOG keep too few rows.
# Bound by name (``:request_id``, ``:created_at``, ...); ``:now`` is the
# created_at of a first record that gives none.
UPDATE_REQUEST = (
    "UPDATE request_log SET "
    + ", ".join(f"{c} = coalesce(:{c}, {c})" for c in REQUEST_FIELDS.split(", ")[1:])
    + " WHERE request_id = :request_id"
)
INSERT_REQUEST = (
    f"INSERT INTO request_log ({REQUEST_FIELDS}) VALUES ("
    + ", ".join("coalesce(:created_at, :now)" if c == "created_at" else f":{c}"
                for c in REQUEST_FIELDS.split(", "))
    + ")"
)
# Keep the newest ``?`` rows: seq has no gaps but the trimmed ones, so this is
# one range delete on the primary key (max(seq) is one probe).
TRIM_REQUEST_LOG = "DELETE FROM request_log WHERE seq <= (SELECT max(seq) FROM request_log) - ?"
REQUEST_BY_ID = f"SELECT {REQUEST_COLUMNS} FROM request_log WHERE request_id = ?"
# The newest row of an answer's id (ix_request_log_answer_id).
REQUEST_BY_ANSWER = (
    f"SELECT {REQUEST_COLUMNS} FROM request_log WHERE answer_id = ? ORDER BY seq DESC LIMIT 1"
)
# Newest first (ix (model_id, seq) for one model), and the rows after a seq
# oldest first (following the log).
REQUESTS_NEWEST = f"SELECT {REQUEST_COLUMNS} FROM request_log ORDER BY seq DESC LIMIT ?"
REQUESTS_NEWEST_OF_MODEL = (
    f"SELECT {REQUEST_COLUMNS} FROM request_log WHERE model_id = ? ORDER BY seq DESC LIMIT ?"
)
REQUESTS_AFTER = f"SELECT {REQUEST_COLUMNS} FROM request_log WHERE seq > ? ORDER BY seq LIMIT ?"
REQUESTS_AFTER_OF_MODEL = (
    f"SELECT {REQUEST_COLUMNS} FROM request_log WHERE model_id = ? AND seq > ? "
    "ORDER BY seq LIMIT ?"
)
# Sums over the log (at most the rows it keeps), of every model or of one.
REQUEST_SUMMARY = (
    "SELECT count(*), coalesce(sum(prompt_tokens), 0), coalesce(sum(live_tokens), 0), "
    "coalesce(sum(restored_tokens), 0), coalesce(sum(written_tokens), 0) FROM request_log"
)
REQUEST_SUMMARY_OF_MODEL = f"{REQUEST_SUMMARY} WHERE model_id = ?"
# The page's charts (one model's rows the connector counted; ix (model_id, seq)
# finds them): the span of their times, their sums per time bucket (bucket =
# whole widths since :start), and their first-token times, hits' or misses'.
REQUEST_SPAN_OF_MODEL = (
    "SELECT min(created_at), max(created_at) FROM request_log "
    "WHERE model_id = ? AND prompt_tokens IS NOT NULL"
)
REQUEST_BUCKETS_OF_MODEL = (
    "SELECT CAST((created_at - :start) / :width AS INTEGER) AS bucket, count(*), "
    "coalesce(sum(prompt_tokens), 0), coalesce(sum(live_tokens), 0), "
    "coalesce(sum(restored_tokens), 0), coalesce(sum(remote_tokens), 0) FROM request_log "
    "WHERE model_id = :model AND prompt_tokens IS NOT NULL AND created_at >= :start "
    "GROUP BY bucket ORDER BY bucket"
)
REQUEST_TTFTS_OF_MODEL = (
    "SELECT ttft_s FROM request_log WHERE model_id = ? AND ttft_s IS NOT NULL "
    "AND (coalesce(live_tokens, 0) + coalesce(restored_tokens, 0) > 0) = ? ORDER BY ttft_s"
)
# Per prompt_cache_key (requests without one left out), most requests first.
REQUEST_KEY_SUMS = (
    "SELECT cache_key, count(*), coalesce(sum(prompt_tokens), 0), "
    "coalesce(sum(live_tokens), 0) + coalesce(sum(restored_tokens), 0) FROM request_log"
)
REQUESTS_BY_KEY = (
    f"{REQUEST_KEY_SUMS} WHERE cache_key IS NOT NULL "
    "GROUP BY cache_key ORDER BY count(*) DESC, cache_key"
)
REQUESTS_BY_KEY_OF_MODEL = (
    f"{REQUEST_KEY_SUMS} WHERE cache_key IS NOT NULL AND model_id = ? "
    "GROUP BY cache_key ORDER BY count(*) DESC, cache_key"
)

# -- the connector's cost model (revision 0011) --------------------------------
COST_COLUMNS = "model, source, bucket, unit_s, latency_s, samples, updated_at"
# One engine's rates and the host's shared ones (model ''), by the primary key.
COSTS_OF_MODEL = (f"SELECT {COST_COLUMNS} FROM costs WHERE model IN ('', ?) "
                  "ORDER BY model, source, bucket")
ALL_COSTS = f"SELECT {COST_COLUMNS} FROM costs ORDER BY model, source, bucket"
UPSERT_COST = (
    f"INSERT INTO costs ({COST_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (model, source, bucket) DO UPDATE SET unit_s = excluded.unit_s, "
    "latency_s = excluded.latency_s, samples = excluded.samples, "
    "updated_at = excluded.updated_at"
)

# -- admin API and CLI (sparkcache.admin) ---------------------------------------
# Read by people-facing commands only; never on the serving path.
ADMIN_MODELS = (
    "SELECT m.id, m.name, m.digest, m.folder, m.identity_json, m.created_at, m.deleted_at, "
    "coalesce(u.snapshots, 0), coalesce(u.nbytes, 0) "
    "FROM models AS m LEFT JOIN model_usage AS u ON u.model_id = m.id ORDER BY m.id"
)
ADMIN_SNAPSHOTS = f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots ORDER BY id"
ADMIN_MODEL_SNAPSHOTS = f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE model_id = ? ORDER BY id"
ADMIN_CHILDREN = "SELECT id FROM snapshots WHERE parent_id = ? ORDER BY id"
# Every written segment of every snapshot not already quarantined, with what its
# header must say (the model's identity and the snapshot key).
ADMIN_VERIFY_SEGMENTS = (
    "SELECT " + ", ".join(f"g.{c.strip()}" for c in SEGMENT_COLUMNS.split(",")) + ", "
    "s.snap_key, m.identity_json FROM segments AS g "
    "JOIN snapshots AS s ON s.id = g.snapshot_id JOIN models AS m ON m.id = s.model_id "
    "WHERE g.state = 'ready' AND s.state != 'quarantined' ORDER BY g.snapshot_id, g.rank"
)

# -- bulk rows with explicit ids (bench/: stores of a million rows) -------------
# For the benchmark, which fills big stores in bulk instead of one publish per
# snapshot; the store never runs these.  Every column is named and
# bound by name (``:id``, ``:state``, ...), so a column added to SNAPSHOT_COLUMNS
# fails the insert for want of a value instead of shifting the others.  Boundary
# rows go in through INSERT_BOUNDARY, as publish writes them.
BULK_INSERT_SNAPSHOT = (
    f"INSERT INTO snapshots ({SNAPSHOT_COLUMNS}) "
    f"VALUES ({', '.join(':' + column.strip() for column in SNAPSHOT_COLUMNS.split(','))})"
)
BULK_INSERT_SEGMENT = (
    f"INSERT INTO segments ({SEGMENT_COLUMNS}) "
    f"VALUES ({', '.join(':' + column.strip() for column in SEGMENT_COLUMNS.split(','))})"
)
# The id the next snapshot gets: ids are AUTOINCREMENT, never reused after a delete.
BULK_NEXT_SNAPSHOT_ID = (
    "SELECT coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'snapshots'), 0) + 1"
)
__all__ = [name for name in dir() if name.isupper()]
