"""The ``sparkcache`` command: in-process through main(argv), and as a real process."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apsw
import pytest

from sparkcache import SnapshotStore, admin
from sparkcache.cli import EXIT_CODES, build_parser, main

from .store.helpers import identity, pages_for, tokens

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    """A store with a root (32 tokens), its child (64) and a second model."""
    root = tmp_path / "store"
    with SnapshotStore(root, alias_stride=16) as store:
        ident, toks = identity(), tokens(64)
        first = store.publish(ident, 0, toks[:32], pages_for(ident, toks[:32])).snapshot_id
        store.publish(ident, 0, toks, pages_for(ident, toks, start=32), parent=first)
        other, other_toks = identity(model="other"), tokens(16, seed=1)
        store.publish(other, 0, other_toks, pages_for(other, other_toks))
        match = store.lookup(ident, toks)
        assert match is not None
        store.read(match, 0)
    yield root


class Run:
    def __init__(self, capsys: pytest.CaptureFixture[str], folder: Path) -> None:
        self.capsys, self.folder = capsys, folder

    def __call__(self, *argv: str, code: int = 0) -> str:
        got = main(["--folder", str(self.folder), *argv])
        out, err = self.capsys.readouterr()
        self.err = err
        assert got == code, f"exit {got}, stderr: {err}"
        if code in (2, 3) and argv and argv[0] not in ("-h", "--help"):
            assert err.startswith("sparkcache: error: ") and err.count("\n") == 1, err
            assert "Traceback" not in err
        return out

    def json(self, *argv: str, code: int = 0) -> Any:
        return json.loads(self(*argv, "--json", code=code))


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str], folder: Path) -> Run:
    return Run(capsys, folder)


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser,
                                                                   str | None]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, sub, helps.get(name)
                for inner, subsub, text in _subparsers(sub):
                    yield f"{name} {inner}", subsub, text


def test_every_command_and_option_has_help() -> None:
    commands = list(_subparsers(build_parser()))
    names = {name for name, _p, _h in commands}
    assert {"models", "ls", "show", "stats", "verify", "check", "clear", "rm", "pin", "unpin",
            "sweep", "export", "import", "shell", "db current", "db upgrade"} <= names
    for name, sub, text in commands:
        assert text, f"`sparkcache {name}` has no help text"
        assert sub.description, f"`sparkcache {name}` has no description"
        for action in sub._actions:
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"`sparkcache {name}` option {action.dest} has no help"


def test_help_documents_exit_codes(run: Run) -> None:
    text = run("--help")
    for code in EXIT_CODES:
        assert f"  {code} " in text
    for name, _sub, _help in _subparsers(build_parser()):
        assert "exit codes:" in run(*name.split(), "--help")


def test_models_ls_show_stats_json(run: Run) -> None:
    models = run.json("models")
    assert [(m["name"], m["snapshots"]) for m in models] == [("tiny-llama", 2), ("other", 1)]
    snaps = run.json("ls", "tiny-llama")
    assert [(s["id"], s["tokens"], s["parent"], s["hits"]) for s in snaps] == [
        (1, 32, None, 1), (2, 64, 1, 1)]
    assert len(run.json("ls")) == 3
    shown = run.json("show", "2")
    assert [c["id"] for c in shown["chain"]] == [1, 2]
    assert shown["segments"][0]["token_start"] == 32
    stats = run.json("stats", "tiny-llama")
    assert (stats["hits"], stats["restored_tokens"]) == (1, 64)


def test_tables_for_people(run: Run) -> None:
    lines = run("ls").splitlines()
    assert lines[0].split()[:4] == ["ID", "MODEL", "TOKENS", "MB"]
    assert len(lines) == 4 and len({len(line) for line in lines[1:]}) <= 2
    assert "tiny-llama" in run("models")
    assert "chain:" in run("show", "2") and "hit rate:" in run("stats")


def test_global_options_go_before_or_after_the_command(run: Run, folder: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    assert main(["ls", "--json", "--folder", str(folder)]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3
    assert main(["--json", "--folder", str(folder), "models"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2


def test_default_folder_comes_from_the_environment(folder: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SPARK_KV_CACHE_FOLDER", str(folder))
    assert main(["models", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2


def test_verify_exit_codes(run: Run, folder: Path) -> None:
    assert run.json("verify")["clean"] is True
    (seg,) = run.json("show", "1")["segments"]
    path = folder / seg["object_key"]
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    report = run.json("verify", code=1)
    assert [(p["snapshot_id"], p["reason"]) for p in report["corrupt"]] == [(1, "digest")]
    assert "all intact" in run("verify")  # quarantined snapshots are not verified again
    states = {s["id"]: s["state"] for s in run.json("ls")}
    assert states == {1: "quarantined", 2: "quarantined", 3: "ready"}


def test_check_and_fix(run: Run, folder: Path) -> None:
    assert run.json("check")["clean"] is True
    orphan = folder / "objects" / "m-0" / "orphan.r0.safetensors"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"x")
    assert "check --fix" in run("check", code=1)
    fixed = run.json("check", "--fix", code=1)
    assert fixed["orphan_files"] == ["objects/m-0/orphan.r0.safetensors"] and fixed["fixed"]
    assert not orphan.exists()
    assert "nothing to fix" in run("check")


def test_pin_unpin_clear_rm(run: Run) -> None:
    assert run.json("pin", "1")["pinned"] is True
    assert run.json("unpin", "1")["pinned"] is False
    assert run("pin", "2") == "snapshot 2 pinned\n"
    cleared = run.json("clear", "tiny-llama", "--keep-pinned")
    assert cleared["deleted"] == [] and cleared["kept_pinned"] == [1, 2]
    assert run.json("clear", "tiny-llama")["deleted"] == [1, 2]
    assert run.json("rm", "other")["complete"] is True
    assert [m["name"] for m in run.json("models")] == ["tiny-llama"]


def test_sweep(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_KV_CACHE_MIN_FREE_MB", "0")
    assert run.json("sweep")["count"] == 0
    assert run.json("sweep", "--total-mb", "0", "--progress")["count"] == 0
    assert "sweep ..." in run.err  # the spinner, forced on
    assert "nothing to sweep" in run("sweep")
    monkeypatch.setenv("SPARK_KV_CACHE_ENTRIES", "zero")
    assert "SPARK_KV_CACHE_ENTRIES" in run("sweep", code=2) + run.err


def test_export_import_with_progress(run: Run, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "export"
    exported = run.json("export", "tiny-llama", str(dest), "--progress")
    assert exported["snapshots"] == [1, 2] and "export [" in run.err and "100%" in run.err
    target = tmp_path / "target"
    assert main(["--folder", str(target), "import", str(dest), "--json"]) == 0
    imported = json.loads(capsys.readouterr().out)
    assert [i["source_id"] for i in imported["imported"]] == [1, 2]
    run("export", "other", str(dest), code=2)
    assert "already holds an export" in run.err


def test_import_of_a_damaged_export_exits_1(run: Run, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "export"
    run("export", "tiny-llama", str(dest))
    for seg in (dest / "segments").iterdir():
        os.chmod(seg, 0o644)
        data = bytearray(seg.read_bytes())
        data[-1] ^= 1
        seg.write_bytes(bytes(data))
    assert main(["--folder", str(tmp_path / "t"), "import", str(dest)]) == 1
    assert "refused 2" in capsys.readouterr().out


def test_shell_runs_sql_read_only(run: Run) -> None:
    rows = run.json("shell", "SELECT id, state FROM v_snapshots ORDER BY id")
    assert [r["id"] for r in rows] == [1, 2, 3]
    assert "id|name" in run("shell", "SELECT id, name FROM v_models")
    run("shell", "DELETE FROM snapshots", code=2)
    assert "readonly" in run.err
    run("shell", "SELECT nope", code=2)


def test_db_current_and_upgrade(run: Run) -> None:
    current = run.json("db", "current")
    assert current["up_to_date"] is True and current["current"] == current["head"]
    assert run.json("db", "upgrade")["applied"] == []


def test_usage_errors_exit_2(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                             ) -> None:
    run("show", "999", code=2)
    assert "no snapshot 999" in run.err
    run("ls", "llama-9", code=2)
    assert "sparkcache models" in run.err
    assert main(["--folder", str(tmp_path / "none"), "models"]) == 2
    assert "no sparkcache store" in capsys.readouterr().err
    assert main(["show", "abc"]) == 2
    assert main(["bogus"]) == 2
    assert main([]) == 2
    capsys.readouterr()


def test_store_errors_exit_3(run: Run, folder: Path) -> None:
    conn = apsw.Connection(str(folder / "index.sqlite"))
    conn.execute("UPDATE alembic_version SET version_num = '9999'")
    conn.close()
    run("models", code=3)
    assert "newer sparkcache" in run.err and "pip install -U sparkcache" in run.err
    run("db", "upgrade", code=3)


def test_as_a_real_process(folder: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "sparkcache", "ls", "--json", "--folder", str(folder)],
        capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert [s["tokens"] for s in json.loads(done.stdout)] == [32, 64, 16]
    failed = subprocess.run(
        [sys.executable, "-m", "sparkcache", "--folder", str(folder), "show", "999"],
        capture_output=True, text=True, env=env, timeout=60, check=False)
    assert failed.returncode == 2
    shell = subprocess.run(
        [sys.executable, "-m", "sparkcache", "--folder", str(folder), "shell"],
        input="SELECT count(*) AS n FROM snapshots;\n.quit\n",
        capture_output=True, text=True, env=env, timeout=60, check=False)
    assert (shell.returncode, shell.stdout.split()) == (0, ["n", "3"]), shell.stderr
    assert failed.stderr.startswith("sparkcache: error: no snapshot 999 in ")
    assert failed.stderr.endswith("`sparkcache ls` lists them\n")


def test_admin_results_match_cli_json(run: Run, folder: Path) -> None:
    with admin.open_store(folder) as store:
        expected = admin.to_dict(admin.list_snapshots(store))
    assert run.json("ls") == expected


def test_docs_cover_every_command_and_exit_code() -> None:
    doc = (REPO / "docs" / "cli.md").read_text()
    headings = "\n".join(line for line in doc.splitlines() if line.startswith("### "))
    for name, _sub, _help in _subparsers(build_parser()):
        if name != "db":
            assert f"`{name}" in headings, f"docs/cli.md has no section for `{name}`"
    for code in EXIT_CODES:
        assert f"| {code} |" in doc
