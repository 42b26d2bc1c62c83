"""Write tests/index/data/golden_<revision>.sqlite: a small index frozen at a revision.

Each was written once, when its revision was the newest, and committed; never
regenerate one (a golden database is a witness of what real old stores look like),
so an existing file is refused::

    .venv/bin/python tests/index/make_golden.py 0001   # golden_0001.sqlite
    .venv/bin/python tests/index/make_golden.py 0003   # golden_0003.sqlite
    .venv/bin/python tests/index/make_golden.py 0004   # golden_0004.sqlite
    .venv/bin/python tests/index/make_golden.py 0005   # golden_0005.sqlite
    .venv/bin/python tests/index/make_golden.py 0011   # golden_0011.sqlite
"""

from __future__ import annotations

import sys
from pathlib import Path

import apsw

from sparkcache.index.migrate import current_revision, upgrade

DATA = Path(__file__).parent / "data"

# 2026-01-02 03:04:05 UTC and a few seconds later.
T0 = 1767323045.0
DIGEST = "0123456789abcdef0123456789abcdef"
SNAP_KEY = "fedcba9876543210fedcba9876543210"
CHILD_KEY = "00112233445566778899aabbccddeeff"

ROWS = [
    ("INSERT INTO settings (key, value, updated_at) VALUES (?, ?, ?)", ("alias_stride", "256", T0)),
    (
        "INSERT INTO models (id, digest, name, folder, identity_json, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (1, DIGEST, "meta-llama/Llama-3.1-8B", f"objects/m-{DIGEST}", '{"dtype":"bfloat16"}', T0),
    ),
    (
        "INSERT INTO snapshots (id, model_id, snap_key, n_tokens, start_token, parent_id, depth, "
        "world_size, nbytes, state, pinned, created_at, last_used, use_count) "
        "VALUES (1, 1, ?, 512, 0, NULL, 0, 1, 3145728, 'ready', 1, ?, ?, 3)",
        (SNAP_KEY, T0, T0 + 60),
    ),
    (
        "INSERT INTO snapshots (id, model_id, snap_key, n_tokens, start_token, parent_id, depth, "
        "world_size, nbytes, state, reason, created_at, last_used) "
        "VALUES (2, 1, ?, 768, 512, 1, 1, 1, 1572864, 'quarantined', 'digest', ?, ?)",
        (CHILD_KEY, T0 + 10, T0 + 10),
    ),
    (
        "INSERT INTO segments (snapshot_id, rank, object_key, token_start, token_end, nbytes, "
        "digest, state, created_at) VALUES (1, 0, ?, 0, 512, 3145728, ?, 'ready', ?)",
        (f"objects/m-{DIGEST}/fe/{SNAP_KEY}-a1b2c3.r0.safetensors", "ab" * 16, T0),
    ),
    (
        "INSERT INTO segments (snapshot_id, rank, object_key, token_start, token_end, nbytes, "
        "digest, state, created_at) VALUES (2, 0, ?, 512, 768, 1572864, ?, 'ready', ?)",
        (f"objects/m-{DIGEST}/00/{CHILD_KEY}-d4e5f6.r0.safetensors", "cd" * 16, T0 + 10),
    ),
    (
        "INSERT INTO boundaries (prefix_hash, snapshot_id, model_id, n_tokens, kind) "
        "VALUES (?, 1, 1, 512, 'end')",
        (bytes.fromhex(SNAP_KEY),),
    ),
    (
        "INSERT INTO boundaries (prefix_hash, snapshot_id, model_id, n_tokens, kind) "
        "VALUES (?, 1, 1, 256, 'stride')",
        (bytes(range(16)),),
    ),
    (
        "INSERT INTO leases (snapshot_id, holder, kind, created_at, expires_at) "
        "VALUES (1, 'host-a:1234', 'read', ?, ?)",
        (T0, T0 + 30),
    ),
]


# Revision 0002 added the counters; 0003's triggers fill model_usage from the rows above.
COUNTER_ROWS = [
    ("INSERT INTO counters (model_id, name, value) VALUES (?, ?, ?)", (0, "hits", 3)),
    ("INSERT INTO counters (model_id, name, value) VALUES (?, ?, ?)", (1, "hits", 3)),
    ("INSERT INTO counters (model_id, name, value) VALUES (?, ?, ?)", (1, "publishes", 2)),
]

# Revision 0004 records the request scope of a snapshot (the default scope here);
# the quarantined child keeps NULL, as a snapshot published before 0004 does.
SCOPE_JSON = '{"cache_salt":null,"lora":null,"mm":[]}'
SCOPE_ROWS = [
    ("UPDATE snapshots SET scope_json = ? WHERE id = ?", (SCOPE_JSON, 1)),
]

# Revision 0005 logs the requests served.
REQUEST_LOG_ROWS = [
    ("INSERT INTO request_log (request_id, created_at, model_id, api, prompt_tokens, "
     "restored_tokens) VALUES (?, ?, ?, ?, ?, ?)", ("r1", T0 + 20, 1, "chat", 600, 512)),
]

# Revisions 0006 to 0011: the upload time, the tenants, the log's later columns
# and the cost model's rates (an engine's prefill and step, the host's local disk).
LATER_ROWS = [
    ("UPDATE snapshots SET uploaded_at = ?, tenant = ? WHERE id = 1", (T0 + 30, "team-a")),
    ("UPDATE request_log SET written_tokens = ?, remote_tokens = ?, written_by_ttl = ?, "
     "tenant = ?, answer_id = ?, fingerprint = ?, restore_reason = ? WHERE request_id = 'r1'",
     (88, 256, '{"300":64,"3600":24}', "team-a", "msg_01", '{"model":"ab12"}', "partial")),
    ("INSERT INTO costs (model, source, bucket, unit_s, latency_s, samples, updated_at) "
     "VALUES (?, ?, ?, ?, ?, ?, ?)", (DIGEST, "prefill", 10, 1e-4, 0.0, 5, T0 + 40)),
    ("INSERT INTO costs (model, source, bucket, unit_s, latency_s, samples, updated_at) "
     "VALUES (?, ?, ?, ?, ?, ?, ?)", (DIGEST, "step", 0, 0.0, 0.0125, 9, T0 + 40)),
    ("INSERT INTO costs (model, source, bucket, unit_s, latency_s, samples, updated_at) "
     "VALUES (?, ?, ?, ?, ?, ?, ?)", ("", "local_warm", 0, 5e-10, 0.00123456, 3, T0 + 40)),
]

#: The rows of each golden database, by revision.
GOLDEN_ROWS = {"0001": ROWS, "0003": ROWS + COUNTER_ROWS,
               "0004": ROWS + COUNTER_ROWS + SCOPE_ROWS,
               "0005": ROWS + COUNTER_ROWS + SCOPE_ROWS + REQUEST_LOG_ROWS,
               "0011": ROWS + COUNTER_ROWS + SCOPE_ROWS + REQUEST_LOG_ROWS + LATER_ROWS}


def main(revision: str) -> Path:
    path = DATA / f"golden_{revision}.sqlite"
    if path.exists():
        raise SystemExit(f"{path} exists: a golden database is never regenerated")
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = apsw.Connection(str(path))
    conn.pragma("foreign_keys", "ON")
    assert upgrade(conn, revision)[-1] == revision
    with conn:  # one transaction
        for sql, params in GOLDEN_ROWS[revision]:
            conn.execute(sql, params)
    assert current_revision(conn) == revision
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    # A single self-contained file: rollback journal, no -wal beside it.
    conn.pragma("journal_mode", "delete")
    conn.execute("VACUUM")
    conn.close()
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return path


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else sorted(GOLDEN_ROWS)[-1])
