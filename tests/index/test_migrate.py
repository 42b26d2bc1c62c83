"""Upgrades: a golden old index, a newer index, several processes opening at once."""

from __future__ import annotations

import io
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import apsw
import pytest
from alembic import command

from sparkcache.core import SnapshotInfo, select_all
from sparkcache.errors import SchemaMismatch
from sparkcache.index import Database, current_revision, head_revision, queries, upgrade
from sparkcache.index.migrate import alembic_config, known_revisions, render_sql

from .helpers import DATA, check_later_columns, raw, schema_objects


def test_render_sql_is_plain_sqlite() -> None:
    sql = render_sql(None, "0001")
    assert "CREATE TABLE snapshots" in sql
    assert "INSERT INTO alembic_version" in sql
    assert "BEGIN" not in sql.upper().split("CREATE")[0]  # the caller owns the transaction
    assert "UPDATE alembic_version SET version_num='0002'" in render_sql("0001", "0002")


def test_upgrade_step_by_step(db_path: Path) -> None:
    conn = raw(db_path)
    assert current_revision(conn) is None
    assert upgrade(conn, "0001") == ["0001"]
    assert current_revision(conn) == "0001"
    assert upgrade(conn, "0001") == []
    assert upgrade(conn) == ["0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009",
        "0010", "0011", "0012"]
    assert upgrade(conn, "0001") == []  # never a downgrade
    assert current_revision(conn) == head_revision()
    assert not conn.in_transaction


def test_golden_0001_upgrades_and_keeps_its_rows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "index.sqlite"
    shutil.copyfile(DATA / "golden_0001.sqlite", path)
    assert current_revision(raw(path)) == "0001"
    with caplog.at_level(logging.INFO, logger="sparkcache.index"), Database(path) as db:
        assert db.migrated == ["0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009",
        "0010", "0011", "0012"]
        assert "upgraded the schema" in caplog.text
        with db.read() as conn:
            assert current_revision(conn) == head_revision()
            assert conn.execute("SELECT count(*) FROM boundaries").fetchall() == [(2,)]
            assert conn.execute("SELECT count(*) FROM segments").fetchall() == [(2,)]
            assert conn.execute(
                "SELECT value FROM settings WHERE key = 'alias_stride'"
            ).fetchall() == [("256",)]
            snapshots = conn.execute(
                "SELECT id, model, tokens, mb, state, reason, pinned, parent, depth, uses, "
                "created, last_used FROM v_snapshots ORDER BY id"
            ).fetchall()
            assert snapshots == [
                (1, "meta-llama/Llama-3.1-8B", 512, 3.1, "ready", None, 1, None, 0, 3,
                 "2026-01-02 03:04:05", "2026-01-02 03:05:05"),
                (2, "meta-llama/Llama-3.1-8B", 768, 1.6, "quarantined", "digest", 0, 1, 1, 0,
                 "2026-01-02 03:04:15", "2026-01-02 03:04:15"),
            ]  # fmt: skip
            assert conn.execute("SELECT snapshots, mb FROM v_models").fetchall() == [(2, 4.7)]
            # 0003 backfilled the usage totals from the existing rows.
            assert conn.execute("SELECT snapshots, nbytes FROM model_usage").fetchall() == [
                conn.execute("SELECT count(*), sum(nbytes) FROM snapshots").fetchone()
            ]
            assert conn.execute("SELECT kind, expired FROM v_leases").fetchall() == [("read", 1)]
            assert conn.execute("SELECT count(*) FROM v_segments").fetchall() == [(2,)]
            # 0004: the scope of a snapshot written before it was never recorded.
            assert conn.execute("SELECT scope_json FROM snapshots").fetchall() == [(None,), (None,)]
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        # The upgraded database is the schema a fresh one gets.
        fresh = Database(tmp_path / "fresh.sqlite")
        assert schema_objects(db.connection) == schema_objects(fresh.connection)
        fresh.close()
        with db.write() as conn:  # new ids keep counting up
            conn.execute("INSERT INTO counters (name, value) VALUES ('hits', 1)")


def test_golden_0003_upgrades_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    shutil.copyfile(DATA / "golden_0003.sqlite", path)
    assert current_revision(raw(path)) == "0003"
    with Database(path) as db:
        assert db.migrated == ["0004", "0005", "0006", "0007", "0008", "0009",
        "0010", "0011", "0012"]
        with db.read() as conn:
            assert current_revision(conn) == head_revision()
            rows = select_all(conn, queries.LIST_SNAPSHOTS + " ORDER BY id", into=SnapshotInfo)
            assert [(s.id, s.n_tokens, s.state, s.pinned, s.use_count, s.scope_json)
                    for s in rows] == [(1, 512, "ready", True, 3, None),
                                       (2, 768, "quarantined", False, 0, None)]
            assert conn.execute("SELECT snapshots, nbytes FROM model_usage").fetchall() == [
                (2, 3145728 + 1572864)]
            assert conn.execute(
                "SELECT model_id, name, value FROM counters ORDER BY model_id, name"
            ).fetchall() == [(0, "hits", 3), (1, "hits", 3), (1, "publishes", 2)]
            assert conn.execute("SELECT count(*) FROM boundaries").fetchall() == [(2,)]
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        fresh = Database(tmp_path / "fresh.sqlite")
        assert schema_objects(db.connection) == schema_objects(fresh.connection)
        fresh.close()
        with db.write() as conn:  # the usage triggers still follow every change
            conn.execute("DELETE FROM snapshots WHERE id = 2")
            assert conn.execute("SELECT snapshots, nbytes FROM model_usage").fetchall() == [
                (1, 3145728)]


def test_golden_0004_upgrades_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    shutil.copyfile(DATA / "golden_0004.sqlite", path)
    assert current_revision(raw(path)) == "0004"
    with Database(path) as db:
        assert db.migrated == ["0005", "0006", "0007", "0008", "0009",
        "0010", "0011", "0012"]
        with db.read() as conn:
            assert current_revision(conn) == head_revision()
            rows = select_all(conn, queries.LIST_SNAPSHOTS + " ORDER BY id", into=SnapshotInfo)
            assert [(s.id, s.n_tokens, s.state, s.scope_json) for s in rows] == [
                (1, 512, "ready", '{"cache_salt":null,"lora":null,"mm":[]}'),
                (2, 768, "quarantined", None)]
            assert conn.execute("SELECT snapshots, nbytes FROM model_usage").fetchall() == [
                (2, 3145728 + 1572864)]
            assert conn.execute("SELECT count(*) FROM counters").fetchall() == [(3,)]
            # 0005: the request log starts empty.
            assert conn.execute("SELECT count(*) FROM request_log").fetchall() == [(0,)]
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        fresh = Database(tmp_path / "fresh.sqlite")
        assert schema_objects(db.connection) == schema_objects(fresh.connection)
        fresh.close()
        with db.write() as conn:  # the new table and its view work on the old rows
            conn.execute("INSERT INTO request_log (request_id, created_at, model_id) "
                         "VALUES ('r1', 1767323045.0, 1)")
            assert conn.execute("SELECT seq, created, model FROM v_request_log").fetchall() == [
                (1, "2026-01-02 03:04:05", "meta-llama/Llama-3.1-8B")]


def test_golden_0005_upgrades_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    shutil.copyfile(DATA / "golden_0005.sqlite", path)
    assert current_revision(raw(path)) == "0005"
    with Database(path) as db:
        assert db.migrated == ["0006", "0007", "0008", "0009",
        "0010", "0011", "0012"]
        with db.read() as conn:
            assert current_revision(conn) == head_revision()
            rows = select_all(conn, queries.LIST_SNAPSHOTS + " ORDER BY id", into=SnapshotInfo)
            # 0006: nothing was uploaded before the store had a shared tier.
            assert [(s.id, s.state, s.uploaded_at) for s in rows] == [
                (1, "ready", None), (2, "quarantined", None)]
            assert conn.execute("SELECT request_id, prompt_tokens FROM request_log"
                                ).fetchall() == [("r1", 600)]
            assert conn.execute("SELECT snapshots, nbytes FROM model_usage").fetchall() == [
                (2, 3145728 + 1572864)]
            # The upload queue holds the ready snapshot only, through its index.
            plan = " ".join(str(r[-1]) for r in conn.execute(
                "EXPLAIN QUERY PLAN " + queries.UPLOAD_QUEUE, (10,)))
            assert "ix_snapshots_upload" in plan and "TEMP B-TREE" not in plan
            assert [r[0] for r in conn.execute(queries.UPLOAD_QUEUE, (10,))] == [1]
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        fresh = Database(tmp_path / "fresh.sqlite")
        assert schema_objects(db.connection) == schema_objects(fresh.connection)
        fresh.close()
        with db.write() as conn:
            conn.execute("UPDATE snapshots SET uploaded_at = 1767323045.0 WHERE id = 1")
            assert conn.execute("SELECT id, uploaded FROM v_snapshots ORDER BY id").fetchall() \
                == [(1, "2026-01-02 03:04:05"), (2, None)]
            assert list(conn.execute(queries.UPLOAD_QUEUE, (10,))) == []


def test_golden_0011_upgrades_and_its_views_show_the_later_columns(tmp_path: Path) -> None:
    """0012: the views of an index made at 0011 show the columns 0006 to 0011 added,
    and v_costs its measured rates, as on a fresh index (tests/index/test_schema.py)."""
    path = tmp_path / "index.sqlite"
    shutil.copyfile(DATA / "golden_0011.sqlite", path)
    assert current_revision(raw(path)) == "0011"
    with Database(path) as db:
        assert db.migrated == ["0012"]
        with db.read() as conn:
            assert current_revision(conn) == head_revision()
            check_later_columns(conn)
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        fresh = Database(tmp_path / "fresh.sqlite")
        assert schema_objects(db.connection) == schema_objects(fresh.connection)
        fresh.close()


def _golden_downgraded(tmp_path: Path, rev: str, back: str, fill: str) -> apsw.Connection:
    """golden_0005 upgraded to ``rev``, ``fill`` (SQL) run, then downgraded to
    ``back``; checked to hold exactly the schema of a new index at ``back``."""
    fresh = raw(tmp_path / f"{back}.sqlite")
    upgrade(fresh, back)
    path = tmp_path / f"{rev}.sqlite"
    shutil.copyfile(DATA / "golden_0005.sqlite", path)
    conn = raw(path)
    upgrade(conn, rev)
    conn.execute(fill)
    buffer = io.StringIO()
    command.downgrade(alembic_config(buffer), f"{rev}:{back}", sql=True)
    with conn:
        conn.execute(buffer.getvalue())
    assert schema_objects(conn) == schema_objects(fresh)
    assert current_revision(conn) == back
    return conn


def test_0006_downgrades_to_the_schema_of_0005(tmp_path: Path) -> None:
    """0006's downgrade (the view, the index, then the column) leaves exactly 0005's
    schema, and the snapshots' other columns."""
    conn = _golden_downgraded(tmp_path, "0006", "0005", "UPDATE snapshots SET uploaded_at = 1.0")
    assert conn.execute("SELECT id, state FROM v_snapshots ORDER BY id").fetchall() == [
        (1, "ready"), (2, "quarantined")]


def test_0007_downgrades_to_the_schema_of_0006(tmp_path: Path) -> None:
    """0007's downgrade (the column) leaves exactly 0006's schema and the log's rows."""
    conn = _golden_downgraded(tmp_path, "0007", "0006",
                              "UPDATE request_log SET remote_tokens = 500")
    assert conn.execute("SELECT request_id, prompt_tokens FROM request_log").fetchall() == [
        ("r1", 600)]


def test_0008_downgrades_to_the_schema_of_0007(tmp_path: Path) -> None:
    """0008's downgrade (the column) leaves exactly 0007's schema and the log's rows."""
    conn = _golden_downgraded(tmp_path, "0008", "0007",
                              """UPDATE request_log SET written_by_ttl = '{"300":64}'""")
    assert conn.execute("SELECT request_id, prompt_tokens FROM request_log").fetchall() == [
        ("r1", 600)]


def test_0010_downgrades_to_the_schema_of_0009(tmp_path: Path) -> None:
    """0010's downgrade (the index, then the two columns) leaves exactly 0009's
    schema and the log's rows."""
    conn = _golden_downgraded(
        tmp_path, "0010", "0009",
        "UPDATE request_log SET answer_id = 'msg_1', fingerprint = '{\"v\":1}'")
    assert conn.execute("SELECT request_id, prompt_tokens FROM request_log").fetchall() == [
        ("r1", 600)]


def test_0005_downgrades_to_the_schema_of_0004(tmp_path: Path) -> None:
    """0005's downgrade (drop the view and the table) leaves exactly the 0004 schema."""
    at_0004 = raw(tmp_path / "0004.sqlite")
    upgrade(at_0004, "0004")
    at_0005 = raw(tmp_path / "0005.sqlite")
    upgrade(at_0005, "0005")
    at_0005.execute("INSERT INTO request_log (request_id, created_at) VALUES ('r1', 1.0)")
    buffer = io.StringIO()
    command.downgrade(alembic_config(buffer), "0005:0004", sql=True)
    with at_0005:
        at_0005.execute(buffer.getvalue())
    assert schema_objects(at_0005) == schema_objects(at_0004)
    assert current_revision(at_0005) == "0004"


def test_0004_downgrades_to_the_schema_of_0003(tmp_path: Path) -> None:
    """0004's downgrade (drop the column) leaves exactly the 0003 schema."""
    at_0003 = raw(tmp_path / "0003.sqlite")
    upgrade(at_0003, "0003")
    at_0004 = raw(tmp_path / "0004.sqlite")
    upgrade(at_0004, "0004")
    buffer = io.StringIO()
    command.downgrade(alembic_config(buffer), "0004:0003", sql=True)
    with at_0004:
        at_0004.execute(buffer.getvalue())
    assert schema_objects(at_0004) == schema_objects(at_0003)
    assert current_revision(at_0004) == "0003"


def _dump(path: Path) -> list[object]:
    conn = raw(path)
    try:
        return [
            conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall(),
            conn.execute("SELECT * FROM alembic_version").fetchall(),
            conn.execute("SELECT * FROM settings ORDER BY key").fetchall(),
        ]
    finally:
        conn.close()


def test_newer_schema_is_refused_and_left_alone(db_path: Path) -> None:
    with Database(db_path) as db, db.write() as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'ffff_future'")
    before = _dump(db_path)
    with pytest.raises(SchemaMismatch) as info:
        Database(db_path)
    message = str(info.value)
    assert "'ffff_future'" in message
    assert repr(head_revision()) in message
    assert "pip install -U . in a newer checkout" in message
    assert "another folder" in message
    assert str(db_path) in message
    with pytest.raises(SchemaMismatch, match="ffff_future"):
        upgrade(raw(db_path))
    assert _dump(db_path) == before


OPENER = """
import json, sys
from sparkcache.index import Database, current_revision
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()
db = Database(sys.argv[1])
print(json.dumps({"applied": db.migrated, "revision": current_revision(db.connection)}))
"""


@pytest.mark.slow
def test_processes_opening_a_fresh_store_at_once(db_path: Path) -> None:
    # Eight openers made the WAL switch fail ~1 run in 13 before it was retried
    # (SQLite answers BUSY there without calling the busy handler).
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, str(db_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    for proc in procs:  # every process has imported everything: start together
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    assert all(r["revision"] == head_revision() for r in results)
    applied = [rev for r in results for rev in r["applied"]]
    assert sorted(applied) == list(known_revisions())  # each revision applied exactly once


def test_0009_downgrades_to_the_schema_of_0008(tmp_path: Path) -> None:
    """0009's downgrade (the index, then the columns) leaves exactly 0008's schema
    and the rows' other columns."""
    conn = _golden_downgraded(tmp_path, "0009", "0008",
                              "UPDATE snapshots SET tenant = 'a'; "
                              "UPDATE request_log SET tenant = 'a'")
    assert conn.execute("SELECT id, state FROM v_snapshots ORDER BY id").fetchall() == [
        (1, "ready"), (2, "quarantined")]
    assert conn.execute("SELECT request_id, prompt_tokens FROM request_log").fetchall() == [
        ("r1", 600)]


def test_0011_downgrades_to_the_schema_of_0010(tmp_path: Path) -> None:
    """0011's downgrade (the column, then the table) leaves exactly 0010's schema
    and the log's rows."""
    conn = _golden_downgraded(
        tmp_path, "0011", "0010",
        "UPDATE request_log SET restore_reason = 'too_slow'; "
        "INSERT INTO costs (model, source, unit_s, updated_at) VALUES ('', 'local_warm', 1e-9, 1)")
    assert conn.execute("SELECT request_id, prompt_tokens FROM request_log").fetchall() == [
        ("r1", 600)]


def test_0012_downgrades_to_the_schema_of_0011(tmp_path: Path) -> None:
    """0012's downgrade (v_costs, then the two views as 0006 and 0005 wrote them)
    leaves exactly 0011's schema; 0011's own downgrade can then drop its column."""
    conn = _golden_downgraded(
        tmp_path, "0012", "0011",
        "UPDATE request_log SET restore_reason = 'too_slow'; "
        "UPDATE snapshots SET tenant = 'a'")
    assert conn.execute("SELECT request_id, prompt, restored FROM v_request_log").fetchall() == [
        ("r1", 600, 512)]
    assert conn.execute("SELECT id, state FROM v_snapshots ORDER BY id").fetchall() == [
        (1, "ready"), (2, "quarantined")]
