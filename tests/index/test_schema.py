"""A fresh index reaches head, and head is exactly what schema.py describes."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import apsw
import pytest
from sqlalchemy.dialects import sqlite
from sqlalchemy.schema import CreateIndex, CreateTable

from sparkcache.errors import CorruptIndex, SchemaMismatch
from sparkcache.index import Database, current_revision, head_revision, schema
from sparkcache.index.migrate import MIGRATIONS_PACKAGE, known_revisions

from .helpers import check_later_columns, raw, schema_objects
from .make_golden import GOLDEN_ROWS

TABLES = {
    "settings", "models", "snapshots", "segments", "boundaries", "leases", "counters",
    "model_usage", "request_log",
}
TRIGGERS = {"tr_usage_insert", "tr_usage_delete", "tr_usage_resize"}
VIEWS = {"v_models", "v_snapshots", "v_segments", "v_leases", "v_counters", "v_request_log",
         "v_costs"}


def test_revisions_form_one_line_ending_at_schema_revision() -> None:
    assert known_revisions() == (
        "0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009",
        "0010", "0011", "0012")
    assert head_revision() == schema.SCHEMA_REVISION


def test_revisions_ship_inside_the_package() -> None:
    root = resources.files(MIGRATIONS_PACKAGE)
    assert root.joinpath("env.py").is_file()
    assert root.joinpath("script.py.mako").is_file()
    names = {entry.name for entry in root.joinpath("versions").iterdir()}
    assert {"0001_initial.py", "0002_counters_views.py", "0003_model_usage.py",
            "0004_snapshot_scope.py", "0005_request_log.py",
            "0006_snapshot_uploaded.py"} <= names


def test_fresh_database_reaches_head(db: Database, db_path: Path) -> None:
    assert db.migrated == [
        "0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009",
        "0010", "0011", "0012"]
    conn = db.connection
    assert current_revision(conn) == head_revision()
    names = {
        (kind, name)
        for kind, name in conn.execute("SELECT type, name FROM sqlite_master").fetchall()
    }
    assert {("table", t) for t in TABLES} <= names
    assert {("view", v) for v in VIEWS} <= names
    assert {("trigger", t) for t in TRIGGERS} <= names
    assert conn.pragma("journal_mode") == "wal"
    assert conn.pragma("foreign_keys") == 1
    assert conn.pragma("synchronous") == 2  # FULL
    assert Path(f"{db_path}-wal").exists()


def test_reopening_at_head_migrates_nothing(db: Database, db_path: Path) -> None:
    with Database(db_path) as again:
        assert again.migrated == []


def test_sqlite_version_recorded_in_settings(db: Database) -> None:
    with db.read() as conn:
        rows = conn.execute("SELECT value FROM settings WHERE key = 'sqlite_version'").fetchall()
    assert rows == [(db.sqlite_version,)]
    assert db.sqlite_version == apsw.sqlite_lib_version()


def test_head_matches_the_metadata(db: Database, tmp_path: Path) -> None:
    """The frozen revisions and schema.py describe the same tables, indexes and views."""
    reference = raw(tmp_path / "reference.sqlite")
    dialect = sqlite.dialect()
    for table in schema.METADATA.sorted_tables:
        reference.execute(str(CreateTable(table).compile(dialect=dialect)))
        for index in table.indexes:
            reference.execute(str(CreateIndex(index).compile(dialect=dialect)))
    for create_view in schema.VIEWS.values():
        reference.execute(create_view)
    for create_trigger in schema.TRIGGERS.values():
        reference.execute(create_trigger)
    assert schema_objects(db.connection) == schema_objects(reference)


def test_constraints_hold(db: Database) -> None:
    now = 1.0e9
    with db.write() as conn:
        conn.execute(
            "INSERT INTO models (id, digest, name, folder, identity_json, created_at) "
            "VALUES (1, 'd', 'm', 'objects/m-d', '{}', ?)",
            (now,),
        )
        insert = (
            "INSERT INTO snapshots (model_id, snap_key, n_tokens, parent_id, world_size, state, "
            "created_at, last_used) VALUES (1, ?, 16, ?, 1, ?, ?, ?)"
        )
        conn.execute(insert, ("k1", None, "ready", now, now))
        conn.execute(insert, ("k2", 1, "ready", now, now))
    for bad in [("k1", None, "ready"), ("k3", None, "gone"), ("k4", 99, "ready")]:
        with pytest.raises(CorruptIndex) as info, db.write() as conn:
            conn.execute(insert, (*bad, now, now))
        assert isinstance(info.value.__cause__, apsw.ConstraintError)  # SQLite refused it
    # A quarantined row may share its key with the live one.
    with db.write() as conn:
        conn.execute(insert, ("k1", None, "quarantined", now, now))
    with pytest.raises(CorruptIndex), db.write() as conn:
        conn.execute("DELETE FROM snapshots WHERE id = 1")  # it has a child
    with db.write() as conn:
        conn.execute("DELETE FROM models WHERE id = 1")  # cascades to every snapshot
        assert conn.execute("SELECT count(*) FROM snapshots").fetchall() == [(0,)]
        # AUTOINCREMENT: ids are never reused.
        conn.execute(
            "INSERT INTO models (id, digest, name, folder, identity_json, created_at) "
            "VALUES (1, 'd', 'm', 'objects/m-d', '{}', ?)",
            (now,),
        )
        new_id = conn.execute(insert + " RETURNING id", ("k1", None, "ready", now, now))
        assert new_id.fetchall() == [(4,)]


def test_views_read_the_tables(db: Database) -> None:
    t = 1767323045.0  # 2026-01-02 03:04:05 UTC
    with db.write() as conn:
        conn.execute(
            "INSERT INTO models (id, digest, name, folder, identity_json, created_at) "
            "VALUES (7, 'd', 'llama', 'objects/m-d', '{}', ?)",
            (t,),
        )
        conn.execute(
            "INSERT INTO snapshots (id, model_id, snap_key, n_tokens, world_size, nbytes, state, "
            "created_at, last_used) VALUES (3, 7, 'k', 64, 2, 2500000, 'ready', ?, ?)",
            (t, t + 1),
        )
        conn.execute(
            "INSERT INTO leases (snapshot_id, holder, kind, created_at, expires_at) "
            "VALUES (3, 'h', 'read', ?, ?), (NULL, 'h', 'publish', ?, 9e9)",
            (t, t + 5, t),
        )
        conn.execute("INSERT INTO counters (model_id, name, value) VALUES (0, 'hits', 5)")
        conn.execute("INSERT INTO counters (model_id, name, value) VALUES (7, 'hits', 2)")
    with db.read() as conn:
        models = conn.execute("SELECT name, snapshots, ready, mb, deleted FROM v_models")
        assert models.fetchall() == [("llama", 1, 1, 2.5, None)]
        assert conn.execute(
            "SELECT model, tokens, mb, state, created, last_used FROM v_snapshots"
        ).fetchall() == [("llama", 64, 2.5, "ready", "2026-01-02 03:04:05", "2026-01-02 03:04:06")]
        leases = conn.execute("SELECT kind, expired, seconds_left > 0 FROM v_leases ORDER BY id")
        assert leases.fetchall() == [("read", 1, 0), ("publish", 0, 1)]
        counters = conn.execute("SELECT model, name, value FROM v_counters ORDER BY model")
        assert counters.fetchall() == [("(all)", "hits", 5), ("llama", "hits", 2)]


def test_request_log_rules_and_view(db: Database) -> None:
    t = 1767323045.0  # 2026-01-02 03:04:05 UTC
    insert = ("INSERT INTO request_log (request_id, created_at, model_id, model, api, "
              "prompt_tokens, live_tokens, restored_tokens, ttft_s) "
              "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")
    with db.write() as conn:
        conn.execute(
            "INSERT INTO models (id, digest, name, folder, identity_json, created_at) "
            "VALUES (7, 'd', 'llama', 'objects/m-d', '{}', ?)",
            (t,),
        )
        conn.execute(insert, ("a", t, 7, None, "chat", 100, 64, 16, 0.12345))
        conn.execute(insert, ("b", t + 1, 7, "llama-served", None, 10, None, None, None))
        conn.execute(insert, ("c", t + 2, 99, None, None, None, None, None, None))
        conn.execute("DELETE FROM models WHERE id = 7")  # no foreign key: the log stays
    for bad in [("a", t, None, None, None, 1, 0, 0, 0.0),  # request_id is unique
                ("d", t, None, None, "embeddings", 1, 0, 0, 0.0),  # not a known api
                ("e", None, None, None, None, 1, 0, 0, 0.0)]:  # created_at is required
        with pytest.raises(CorruptIndex) as info, db.write() as conn:
            conn.execute(insert, bad)
        assert isinstance(info.value.__cause__, apsw.ConstraintError)
    with db.write() as conn:
        conn.execute("DELETE FROM request_log WHERE request_id = 'c'")
        # AUTOINCREMENT: a seq is never reused, so a reader following the log misses nothing.
        conn.execute(insert, ("f", t, None, None, None, None, None, None, None))
    with db.read() as conn:
        assert conn.execute(
            "SELECT seq, created, model, api, prompt, cached, ttft_s FROM v_request_log "
            "ORDER BY seq").fetchall() == [
            (1, "2026-01-02 03:04:05", "#7", "chat", 100, 80, 0.123),
            (2, "2026-01-02 03:04:06", "llama-served", None, 10, 0, None),
            (4, "2026-01-02 03:04:05", None, None, None, 0, None)]


def test_views_show_the_later_columns(db: Database) -> None:
    """A fresh index's views show what 0006 to 0011 added (revision 0012), as an
    index migrated from 0011 does (tests/index/test_migrate.py)."""
    with db.write() as conn:
        for sql, params in GOLDEN_ROWS["0011"]:
            conn.execute(sql, params)
    with db.read() as conn:
        check_later_columns(conn)
    with db.write() as conn:  # an engine's rates before its model's first publish
        conn.execute("INSERT INTO costs (model, source, unit_s, updated_at) "
                     "VALUES ('ff', 'prefill', 0, 0)")
        assert conn.execute("SELECT model, tokens_per_s, prompt_max FROM v_costs "
                            "WHERE digest = 'ff'").fetchall() == [("ff", None, 1)]


def test_foreign_database_is_refused(db_path: Path) -> None:
    conn = raw(db_path)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.close()
    with pytest.raises(SchemaMismatch, match="not a sparkcache index"):
        Database(db_path)


def test_model_usage_follows_every_change(db: Database) -> None:
    now = 1.0e9
    with db.write() as conn:
        conn.execute(
            "INSERT INTO models (id, digest, name, folder, identity_json, created_at) "
            "VALUES (1, 'd', 'm', 'objects/m-d', '{}', ?)",
            (now,),
        )
        insert = (
            "INSERT INTO snapshots (model_id, snap_key, n_tokens, world_size, nbytes, state, "
            "created_at, last_used) VALUES (1, ?, 16, 1, ?, 'ready', ?, ?)"
        )
        conn.execute(insert, ("a", 100, now, now))
        conn.execute(insert, ("b", 50, now, now))
        conn.execute("UPDATE snapshots SET nbytes = nbytes + 7 WHERE snap_key = 'b'")
    usage = "SELECT snapshots, nbytes FROM model_usage WHERE model_id = 1"
    with db.read() as conn:
        assert conn.execute(usage).fetchall() == [(2, 157)]
    with db.write() as conn:
        conn.execute("DELETE FROM snapshots WHERE snap_key = 'a'")
        assert conn.execute(usage).fetchall() == [(1, 57)]
        conn.execute("DELETE FROM models WHERE id = 1")
        assert conn.execute(usage).fetchall() == []
