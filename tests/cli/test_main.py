"""The ``sparkcache`` command's entry point: its parser and help, the global options,
errors and exit statuses, and the command as a real process (sparkcache.cli)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import apsw
import pytest

from sparkcache.cli import EXIT_CODES, build_parser, main

from .helpers import REPO, Run, _subparsers


def test_every_command_and_option_has_help() -> None:
    commands = list(_subparsers(build_parser()))
    names = {name for name, _p, _h in commands}
    assert {"models", "ls", "show", "stats", "log", "verify", "check", "clear", "rm", "pin",
            "unpin", "sweep", "export", "import", "shell", "db current", "db upgrade"} <= names
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


def test_a_mistyped_storage_is_refused_then_relocated(run: Run, folder: Path,
                                                      tmp_path: Path) -> None:
    typo = tmp_path / "typo"
    run("--storage", str(typo), "check", "--fix", code=3)
    assert "relocate" in run.err and not typo.exists()
    assert {s["state"] for s in run.json("ls")} == {"ready"}  # nothing quarantined
    shutil.copytree(folder / "objects", typo / "objects")
    assert run.json("--storage", str(typo), "--relocate", "check")["clean"] is True
    assert run.json("check")["clean"] is True  # the new storage was recorded


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
    assert "newer sparkcache" in run.err and "pip install -U . in a newer checkout" in run.err
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


def test_docs_cover_every_command_and_exit_code() -> None:
    doc = (REPO / "docs" / "cli.md").read_text()
    headings = "\n".join(line for line in doc.splitlines() if line.startswith("### "))
    for name, _sub, _help in _subparsers(build_parser()):
        if name != "db":
            assert f"`{name}" in headings, f"docs/cli.md has no section for `{name}`"
    for code in EXIT_CODES:
        assert f"| {code} |" in doc


def test_errors_are_json_under_json(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("show", "999", "--json", code=2) == ""
    error = json.loads(run.err)
    assert error["error"] == "NotFound" and error["exit_code"] == 2
    assert "no snapshot 999" in error["message"]
    for argv in (["--json", "show", "abc"], ["ls", "--json", "--bogus"], ["--json"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and json.loads(err)["exit_code"] == 2, argv
    assert main(["--json", "--folder", "/nonexistent/store", "ls"]) == 2
    assert json.loads(capsys.readouterr().err)["error"] == "NotFound"


def test_unknown_url_schemes_are_usage_errors(run: Run, tmp_path: Path) -> None:
    run("--storage", "nosuch://x", "ls", code=2)
    assert "'nosuch'" in run.err
    run("export", "tiny-llama", "nosuch://x/y", code=2)
    assert "'nosuch'" in run.err
    run("import", "nosuch://x/y", code=2)
    assert "'nosuch'" in run.err
