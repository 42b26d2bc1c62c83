"""``sparkcache db`` and the schema rules of every command: read-only commands never
upgrade an index, files that are not an index are named so (sparkcache.cli.commands)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import apsw
import pytest

from sparkcache import admin
from sparkcache.cli import main
from sparkcache.index import migrate

from ..index.helpers import DATA
from .helpers import Run, files_of


def test_db_current_and_upgrade(run: Run) -> None:
    current = run.json("db", "current")
    assert current["up_to_date"] is True and current["current"] == current["head"]
    assert run.json("db", "upgrade")["applied"] == []


def old_store(tmp_path: Path) -> Path:
    folder = tmp_path / "old"
    folder.mkdir()
    shutil.copyfile(DATA / "golden_0001.sqlite", folder / "index.sqlite")
    return folder


READ_ONLY = [["ls"], ["models"], ["stats"], ["log"], ["show", "1"], ["check"],
             ["check", "--fix", "--dry-run"], ["clear", "1", "--dry-run"],
             ["rm", "1", "--dry-run"], ["sweep", "--dry-run"]]


@pytest.mark.parametrize("argv", READ_ONLY, ids=" ".join)
def test_read_only_commands_never_upgrade_an_old_index(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = old_store(tmp_path)
    before = files_of(folder)
    assert main(["--folder", str(folder), *argv]) == 3
    err = capsys.readouterr().err
    assert "sparkcache db upgrade" in err and "'0001'" in err, err
    assert files_of(folder) == before  # the same bytes, and no file added
    assert admin.db_current(folder).current == "0001"


def test_an_old_index_opens_once_upgraded(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    folder = old_store(tmp_path)
    assert main(["--folder", str(folder), "db", "current"]) == 1
    assert "behind: run `sparkcache db upgrade`" in capsys.readouterr().out
    assert main(["--folder", str(folder), "db", "upgrade"]) == 0
    capsys.readouterr()
    assert main(["--folder", str(folder), "ls", "--json"]) == 0
    assert [s["tokens"] for s in json.loads(capsys.readouterr().out)] == [512, 768]


def test_db_current_on_an_index_from_a_newer_sparkcache(run: Run, folder: Path) -> None:
    conn = apsw.Connection(str(folder / "index.sqlite"))
    conn.execute("UPDATE alembic_version SET version_num = '9999'")
    conn.close()
    before = files_of(folder)
    out = run("db", "current", code=3)
    assert out == "" and "behind" not in run.err
    assert "'9999'" in run.err and "newer sparkcache" in run.err
    run("db", "current", "--json", code=3)
    error = json.loads(run.err)
    assert (error["error"], error["exit_code"]) == ("SchemaMismatch", 3)
    run("db", "upgrade", code=3)
    run("db", "downgrade", "0002", code=3)
    assert files_of(folder) == before


def _not_an_index(path: Path, kind: str) -> None:
    if kind == "text":
        path.write_text("hello, I am a text file\n")
    elif kind == "zero bytes":
        path.write_bytes(b"")
    else:
        conn = apsw.Connection(str(path))
        conn.execute("PRAGMA user_version = 7")  # a valid SQLite file without tables
        if kind == "other tables":
            conn.execute("CREATE TABLE people (name TEXT)")
        conn.close()


@pytest.mark.parametrize("kind", ["text", "zero bytes", "empty sqlite", "other tables"])
def test_files_that_are_not_an_index_are_named_so(
        kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "store"
    folder.mkdir()
    _not_an_index(folder / "index.sqlite", kind)
    before = files_of(folder)
    for argv in (["db", "current"], ["db", "upgrade"], ["ls"], ["pin", "1"]):
        assert main(["--folder", str(folder), *argv]) == 3, argv
        err = capsys.readouterr().err
        assert "not a sparkcache index" in err and "behind" not in err, (argv, err)
    assert files_of(folder) == before


def test_db_downgrade(run: Run, folder: Path) -> None:
    known = migrate.known_revisions()
    head = known[-1]
    undone = run.json("db", "downgrade", "0002")
    assert (undone["current"], undone["head"]) == ("0002", head)
    assert undone["undone"] == list(reversed(known[known.index("0002") + 1:]))
    assert "0002" in run("db", "current", code=1)
    run("ls", code=3)  # read-only: behind, so refused
    assert "downgrade" in run("db", "downgrade", "0001")
    run("db", "downgrade", "0002", code=2)  # newer than the index: that is an upgrade
    assert "db upgrade" in run.err
    assert run.json("db", "upgrade")["applied"] == list(known[1:])
    assert len(run.json("ls")) == 3
    assert run.json("db", "downgrade", head)["undone"] == []
    for bad in ("base", "9999", "0000"):
        run("db", "downgrade", bad, code=2)
        assert "0001" in run.err
    assert run.json("db", "current")["up_to_date"] is True
