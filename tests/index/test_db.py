"""Database: transactions, savepoints, on_commit, fork, busy timeout, version checks."""

from __future__ import annotations

import logging
import os
import time
import traceback
from pathlib import Path

import pytest

from sparkcache.errors import StoreClosed, StoreTimeout
from sparkcache.index import Database, SQLiteVersionWarning, wal_reset_bug
from sparkcache.index.db import _version_tuple, warn_if_wal_reset_bug
from tests.locks import hold_write_lock, release

PUT = (
    "INSERT INTO settings (key, value, updated_at) VALUES (?, ?, 0) "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)
GET = "SELECT value FROM settings WHERE key = ?"


def get(db: Database, key: str) -> str | None:
    with db.read() as conn:
        rows = conn.execute(GET, (key,)).fetchall()
    return str(rows[0][0]) if rows else None


def test_write_commits_and_read_sees_it(db: Database) -> None:
    with db.write() as conn:
        conn.execute(PUT, ("a", "1"))
        assert conn.in_transaction
    assert not db.connection.in_transaction
    assert get(db, "a") == "1"


def test_exception_rolls_back_the_whole_write(db: Database) -> None:
    with pytest.raises(KeyError), db.write() as conn:
        conn.execute(PUT, ("a", "1"))
        raise KeyError("boom")
    assert get(db, "a") is None
    assert not db.connection.in_transaction


def test_nested_write_is_a_savepoint(db: Database) -> None:
    with db.write() as conn:
        conn.execute(PUT, ("outer", "1"))
        with pytest.raises(ValueError), db.write() as inner:
            inner.execute(PUT, ("inner", "1"))
            inner.execute(PUT, ("outer", "changed"))
            raise ValueError("undo the inner block only")
        with db.write() as inner:
            inner.execute(PUT, ("kept", "1"))
    assert get(db, "outer") == "1"
    assert get(db, "inner") is None
    assert get(db, "kept") == "1"


def test_on_commit_runs_only_after_commit(db: Database) -> None:
    calls: list[str] = []

    def seen_after_commit(name: str) -> None:
        # The callback sees the committed state, from a fresh read transaction.
        calls.append(f"{name}:{get(db, name)}")

    with db.write() as conn:
        conn.execute(PUT, ("a", "1"))
        db.on_commit(lambda: seen_after_commit("a"))
        with db.write() as inner:
            inner.execute(PUT, ("b", "2"))
            db.on_commit(lambda: seen_after_commit("b"))
        with pytest.raises(RuntimeError), db.write():
            db.on_commit(lambda: calls.append("rolled-back savepoint"))
            raise RuntimeError
        assert calls == []  # nothing before the outermost COMMIT
    assert calls == ["a:1", "b:2"]

    with pytest.raises(RuntimeError), db.write():
        db.on_commit(lambda: calls.append("rolled back"))
        raise RuntimeError
    assert calls == ["a:1", "b:2"]


def test_on_commit_outside_write_is_an_error(db: Database) -> None:
    with pytest.raises(RuntimeError, match="inside write"):
        db.on_commit(lambda: None)
    with pytest.raises(RuntimeError, match="inside write"), db.read():
        db.on_commit(lambda: None)


def test_failing_callback_is_logged_not_raised(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[int] = []
    with db.write():
        db.on_commit(lambda: 1 / 0)
        db.on_commit(lambda: ran.append(1))
    assert ran == [1]
    assert "on_commit callback failed" in caplog.text


def test_write_inside_read_is_refused(db: Database) -> None:
    with db.read() as conn:
        with pytest.raises(RuntimeError, match="inside read"), db.write():
            pass
        assert conn.in_transaction
        with db.read():  # a nested read joins the outer one
            pass
    assert not db.connection.in_transaction


def test_read_is_one_snapshot(db: Database, db_path: Path) -> None:
    with Database(db_path) as other:
        with db.read() as conn:
            assert conn.execute(GET, ("a",)).fetchall() == []
            with other.write() as w:  # WAL: a writer does not wait for readers
                w.execute(PUT, ("a", "1"))
            assert conn.execute(GET, ("a",)).fetchall() == []
        assert get(db, "a") == "1"


def test_close_is_idempotent(db_path: Path) -> None:
    db = Database(db_path)
    db.close()
    db.close()
    assert db.closed
    with pytest.raises(StoreClosed), db.read():
        pass


def test_forked_child_reopens_and_parent_keeps_working(db: Database) -> None:
    with db.write() as conn:
        conn.execute(PUT, ("parent", "before"))
    parent_conn = db.connection
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status, never return to pytest
        code = 1
        try:
            assert get(db, "parent") == "before"
            with db.write() as conn:
                conn.execute(PUT, ("child", str(os.getpid())))
            assert db.connection is not parent_conn
            db.close()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert db.connection is parent_conn
    assert get(db, "child") == str(pid)
    with db.write() as conn:
        conn.execute(PUT, ("parent", "after"))
    assert get(db, "parent") == "after"
    assert db.connection.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


def test_busy_write_raises_store_timeout(db: Database, db_path: Path) -> None:
    holder = hold_write_lock(db_path)
    try:
        with Database(db_path, busy_timeout_ms=200) as impatient:  # opening only reads
            start = time.monotonic()
            with pytest.raises(StoreTimeout) as info, impatient.write():
                pass
            assert time.monotonic() - start >= 0.15
            message = str(info.value)
            assert str(db_path) in message
            assert "200 ms" in message
            assert "busy_timeout_ms" in message
            assert get(impatient, "sqlite_version") == impatient.sqlite_version  # reads go on
    finally:
        release(holder)
    with db.write() as conn:
        conn.execute(PUT, ("a", "1"))


def test_busy_fresh_store_raises_store_timeout_on_open(db_path: Path) -> None:
    holder = hold_write_lock(db_path)
    try:
        with pytest.raises(StoreTimeout, match="locked"):
            Database(db_path, busy_timeout_ms=200)
    finally:
        release(holder)
    with Database(db_path) as db:
        assert db.migrated == [
        "0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009",
        "0010", "0011", "0012"]


@pytest.mark.parametrize(
    ("version", "buggy"),
    [
        ((3, 6, 23), False),
        ((3, 7, 0), True),
        ((3, 40, 1), True),
        ((3, 51, 2), True),
        ((3, 51, 3), False),
        ((3, 52, 0), False),
        ((3, 54, 1), False),
    ],
)
def test_wal_reset_bug_range(version: tuple[int, ...], buggy: bool) -> None:
    assert wal_reset_bug(version) is buggy


def test_version_tuple() -> None:
    assert _version_tuple("3.51.2") == (3, 51, 2)


def test_no_version_warning_with_a_fixed_sqlite(
    db_path: Path, recwarn: pytest.WarningsRecorder, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING), Database(db_path) as db:
        assert not wal_reset_bug(_version_tuple(db.sqlite_version))
    assert not [w for w in recwarn if issubclass(w.category, SQLiteVersionWarning)]
    assert "WAL-reset" not in caplog.text


def test_a_buggy_sqlite_warns_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.warns(SQLiteVersionWarning, match=r"3\.40\.1 .*pip install -U"):
        assert warn_if_wal_reset_bug("3.40.1", "/x/index.sqlite")
    assert "/x/index.sqlite" in caplog.text
    assert not warn_if_wal_reset_bug("3.54.1", "/x/index.sqlite")
