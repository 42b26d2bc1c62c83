"""The ``sparkcache`` command: in-process through main(argv), and as a real process."""

from __future__ import annotations

import argparse
import io
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import apsw
import pytest

from sparkcache import SnapshotStore, admin
from sparkcache.cli import EXIT_CODES, build_parser, commands, main
from sparkcache.index import migrate
from sparkcache.shared import SharedTier, SweepLease

from ..index.helpers import DATA
from ..store.helpers import identity, pages_for, tokens

REPO = Path(__file__).resolve().parents[2]


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
            assert "Traceback" not in err
            if "--json" in argv:  # one JSON object on stderr, nothing on stdout
                error = json.loads(err)
                assert error["exit_code"] == code and out == "" and err.count("\n") == 1, err
            else:
                assert err.startswith("sparkcache: error: ") and err.count("\n") == 1, err
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


def test_verify_requeue_gives_back_what_is_whole_again(run: Run, folder: Path) -> None:
    (seg,) = run.json("show", "1")["segments"]
    path = folder / seg["object_key"]
    original = path.read_bytes()
    data = bytearray(original)
    data[-100] ^= 1
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    run.json("verify", code=1)
    report = run.json("verify", "--requeue", code=1)  # still damaged: stays
    assert report["requeued"] == [] and {p["snapshot_id"] for p in
                                         report["still_quarantined"]} == {1, 2}
    path.write_bytes(original)  # repaired (restored from a backup, a disk remounted)
    assert run.json("verify", "--requeue")["requeued"] == [1, 2]
    assert {s["state"] for s in run.json("ls")} == {"ready"}
    assert "requeued 0 snapshots" in run("verify", "--requeue")


def test_a_mistyped_storage_is_refused_then_relocated(run: Run, folder: Path,
                                                      tmp_path: Path) -> None:
    typo = tmp_path / "typo"
    run("--storage", str(typo), "check", "--fix", code=3)
    assert "relocate" in run.err and not typo.exists()
    assert {s["state"] for s in run.json("ls")} == {"ready"}  # nothing quarantined
    shutil.copytree(folder / "objects", typo / "objects")
    assert run.json("--storage", str(typo), "--relocate", "check")["clean"] is True
    assert run.json("check")["clean"] is True  # the new storage was recorded


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
    cleared = run.json("clear", "tiny-llama", "--keep-pinned", "--yes")
    assert cleared["deleted"] == [] and cleared["kept_pinned"] == [1, 2]
    assert run.json("clear", "tiny-llama", "--yes")["deleted"] == [1, 2]
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


# -- the request log ---------------------------------------------------------------------------

T0 = 1767323045.0  # 2026-01-02 03:04:05 UTC


def log(folder: Path, *names: str, model: str = "tiny-llama", **fields: Any) -> None:
    """Log one request per name, of ``model`` (by its model row), one second apart."""
    with SnapshotStore(folder) as store:
        model_id = admin.resolve_model(store, model).id
        before = len(store.requests(limit=1000))
        store.log_requests([{"request_id": name, "model_id": model_id,
                             "created_at": T0 + before + n, **fields}
                            for n, name in enumerate(names)], keep=1000)


def json_lines(text: str) -> list[Any]:
    return [json.loads(line) for line in text.splitlines()]


def test_log_table_for_people(run: Run, folder: Path) -> None:
    assert run("log") == "no requests logged\n"
    log(folder, "a", api="chat", prompt_tokens=1200, live_tokens=512, restored_tokens=256,
        written_tokens=432, breakpoints=[512, 1024], cache_key="user-42", ttft_s=0.12345,
        total_s=2.5)
    log(folder, "b", model="other", prompt_tokens=16)
    lines = run("log").splitlines()
    assert lines[0].split() == ["TIME", "MODEL", "API", "PROMPT", "CACHED", "LIVE+RESTORED",
                                "WRITTEN", "BREAKPOINTS", "CACHE", "KEY", "TTFT", "TOTAL"]
    assert lines[1].split() == ["2026-01-02", "03:04:05", "tiny-llama", "chat", "1200", "768",
                                "512+256", "432", "512,1024", "user-42", "0.123", "2.5"]
    assert lines[2].split() == ["2026-01-02", "03:04:06", "other", "-", "16", "0", "0+0",
                                "-", "-", "-", "-", "-"]  # oldest first, newest last
    assert len(lines) == 3
    assert run("log", "--limit", "1").splitlines()[1:] == lines[2:]
    assert run("log", "--model", "tiny-llama").splitlines()[1:] == lines[1:2]


def test_log_json_lines(run: Run, folder: Path) -> None:
    assert run("log", "--json") == ""
    log(folder, "a", "b", "c", prompt_tokens=10, live_tokens=4, restored_tokens=2)
    log(folder, "d", model="other")
    rows = json_lines(run("log", "--json"))
    assert [r["request_id"] for r in rows] == ["a", "b", "c", "d"]
    assert [r["seq"] for r in rows] == [1, 2, 3, 4]
    assert (rows[0]["cached_tokens"], rows[0]["breakpoints"], rows[3]["prompt_tokens"]) == (
        6, [], None)
    with admin.open_store(folder) as store:
        expected = admin.to_dict(admin.request_log(store, model="tiny-llama", limit=2))
    assert json_lines(run("--json", "log", "--model", "tiny-llama", "--limit", "2")) == \
        json.loads(json.dumps(expected[::-1]))
    assert [r["request_id"] for r in expected] == ["c", "b"]


def test_log_usage_errors(run: Run, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--folder", str(folder), "log", "--limit", "0"]) == 2
    assert "--limit: '0' is not a number of requests" in capsys.readouterr().err
    run("log", "--model", "llama-9", code=2)
    assert "sparkcache models" in run.err


class Ticks:
    """time.sleep for ``log --follow``: each call runs the next step; then Ctrl-C."""

    def __init__(self, *steps: Any) -> None:
        self.steps = list(steps)
        self.slept: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)
        if not self.steps:
            raise KeyboardInterrupt
        self.steps.pop(0)()


def test_log_follow_prints_new_requests_until_ctrl_c(run: Run, folder: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    log(folder, "a", "b")
    ticks = Ticks(lambda: log(folder, "c", "d"), lambda: None,
                  lambda: log(folder, "e", model="other"), lambda: log(folder, "f"))
    monkeypatch.setattr(commands.time, "sleep", ticks)
    lines = run("log", "--follow", "--limit", "1").splitlines()  # exits 0 on Ctrl-C
    assert ticks.slept == [0.5] * 5
    assert lines[0].startswith("TIME") and sum(line.startswith("TIME") for line in lines) == 1
    assert [line.split()[3] for line in lines[1:]] == ["-"] * 5  # no api: offline requests
    assert len(lines) == 1 + 5  # b, then c and d, e, f
    assert " other " in lines[4]
    ticks = Ticks(lambda: log(folder, "g"))
    monkeypatch.setattr(commands.time, "sleep", ticks)
    rows = json_lines(run("log", "--follow", "--json", "--model", "tiny-llama", "--limit", "2"))
    assert [r["request_id"] for r in rows] == ["d", "f", "g"]


def test_log_follow_reads_every_row_of_a_burst(run: Run, folder: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commands, "FOLLOW_BATCH", 2)
    ticks = Ticks(lambda: log(folder, *"abcde"))
    monkeypatch.setattr(commands.time, "sleep", ticks)
    rows = json_lines(run("log", "--follow", "--json"))
    assert [r["request_id"] for r in rows] == list("abcde")
    assert len(ticks.slept) == 2  # all five in one look


def _sigint(disposition: Any) -> Callable[[], None]:
    """A ``preexec_fn`` starting the child with SIGINT at ``disposition``."""
    return lambda: signal.signal(signal.SIGINT, disposition) and None


@pytest.mark.parametrize(("sigint", "stop"), [
    (signal.SIG_DFL, signal.SIGINT),  # a terminal's Ctrl-C
    # A background job of a non-interactive shell starts with SIGINT ignored
    # and keeps ignoring it (as every program does): SIGTERM ends it.
    (signal.SIG_IGN, signal.SIGTERM),
], ids=["sigint", "sigterm-with-sigint-ignored"])
def test_log_follow_as_a_real_process(folder: Path, sigint: Any, stop: int) -> None:
    """``sparkcache log --follow`` in its own process sees what another process
    logs, and a SIGINT (Ctrl-C) or a SIGTERM ends it with exit status 0."""
    log(folder, "a")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparkcache", "--folder", str(folder), "log", "--follow",
         "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=_sigint(sigint))
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                              daemon=True)
    reader.start()
    try:
        assert json.loads(lines.get(timeout=60))["request_id"] == "a"
        log(folder, "b", prompt_tokens=7)
        row = json.loads(lines.get(timeout=30))
        assert (row["request_id"], row["prompt_tokens"]) == ("b", 7)
        proc.send_signal(stop)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    assert proc.stderr is not None and proc.stderr.read() == ""
    assert lines.empty()


# -- issue 12: schema versions --------------------------------------------------------------


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def rows_of(folder: Path) -> dict[str, list[Any]]:
    """Every row of every table of the index, read without sparkcache."""
    conn = apsw.Connection(str(folder / "index.sqlite"), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        tables = [str(n) for (n,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
        return {t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall(), key=repr)
                for t in tables}
    finally:
        conn.close()


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


# -- issue 12: safety rails -----------------------------------------------------------------


class Tty(io.StringIO):
    """A stdin that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("argv", [["check", "--fix"], ["clear", "tiny-llama", "--yes"],
                                  ["rm", "other"], ["sweep", "--max-age-hours", "1e-9"]],
                         ids=lambda argv: argv[0])
def test_dry_runs_report_what_the_real_run_deletes(
        argv: list[str], run: Run, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_KV_CACHE_MIN_FREE_MB", "0")
    monkeypatch.setattr(sys, "stdin", Tty("y\n"))  # a dry run never asks
    stray = folder / "objects" / "m-stray" / "ab" / "x.r0.safetensors"  # no model names it
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"x")
    orphan = folder / "objects" / "m-0" / "orphan.r0.safetensors"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"x")
    code = 1 if argv[0] == "check" else 0
    files, rows = files_of(folder), rows_of(folder)
    dry = run.json(*argv, "--dry-run", code=code)
    assert (files_of(folder), rows_of(folder)) == (files, rows)  # nothing changed
    assert dry.pop("dry_run") is True
    dry_files, dry_folders = set(dry.pop("files")), set(dry.pop("folders"))
    assert dry_files and all((folder / f).is_dir() for f in dry_folders)
    real = run.json(*argv, code=code)
    assert dry.pop("fixed", False) is False and real.pop("fixed", True) is True
    assert dry == real
    assert set(files) - set(files_of(folder)) == dry_files
    assert not any((folder / f).exists() for f in dry_folders)
    # Folders are removed directly, not after a commit: the dry run must not.
    assert ("objects/m-stray" in dry_folders) == (argv[0] == "sweep")
    assert bool(dry_folders) == (argv[0] in ("sweep", "rm"))


def test_dry_run_text_says_nothing_changed(run: Run) -> None:
    out = run("clear", "tiny-llama", "--dry-run")
    assert "would delete 2 snapshots" in out and "dry run" in out
    assert "would" in run("rm", "other", "--dry-run")
    assert "would" in run("check", "--fix", "--dry-run")
    assert len(run.json("ls")) == 3


def test_clear_asks_on_a_terminal(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", Tty("n\n"))
    run("clear", "tiny-llama", code=1)
    assert "delete 2 snapshots of tiny-llama" in run.err and "nothing" in run.err
    assert len(run.json("ls")) == 3
    monkeypatch.setattr(sys, "stdin", Tty("y\n"))
    assert run.json("clear", "tiny-llama")["deleted"] == [1, 2]


def test_clear_without_a_terminal_needs_yes(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # a pipe, not a terminal
    run("clear", "tiny-llama", code=2)
    assert "--yes" in run.err
    assert len(run.json("ls")) == 3
    assert run.json("clear", "tiny-llama", "--yes")["deleted"] == [1, 2]


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


def test_shell_json_prints_one_document(run: Run) -> None:
    rows = run.json("shell", "SELECT id FROM v_snapshots ORDER BY id",
                    "SELECT name FROM v_models ORDER BY id; SELECT 1 AS one WHERE 0")
    assert rows == [{"id": 1}, {"id": 2}, {"id": 3}, {"name": "tiny-llama"}, {"name": "other"}]
    assert run.json("shell", "SELECT 1 WHERE 0") == []
    assert run.json("shell", "SELECT x'0102' AS b, 1.5 AS f") == [{"b": "AQI=", "f": 1.5}]
    run("shell", ".tables", "--json", code=2)
    assert "dot-command" in json.loads(run.err)["message"]


def test_pin_refuses_a_quarantined_snapshot(run: Run, folder: Path) -> None:
    assert run.json("pin", "2")["pinned"] is True
    with SnapshotStore(folder) as store:
        store.quarantine(1, "digest")  # and its child, 2
    run("pin", "1", code=2)
    assert "quarantined" in run.err
    assert run.json("show", "1")["snapshot"]["pinned"] is False
    assert run.json("unpin", "2")["pinned"] is False


def test_unknown_url_schemes_are_usage_errors(run: Run, tmp_path: Path) -> None:
    run("--storage", "nosuch://x", "ls", code=2)
    assert "'nosuch'" in run.err
    run("export", "tiny-llama", "nosuch://x/y", code=2)
    assert "'nosuch'" in run.err
    run("import", "nosuch://x/y", code=2)
    assert "'nosuch'" in run.err


# -- the shared tier: --shared, upload, the UPLOADED column ---------------------------------


@pytest.fixture
def tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A file:// shared tier (tests/shared runs the S3 ones); no tier in the environment."""
    monkeypatch.delenv("SPARK_KV_CACHE_SHARED", raising=False)
    (tmp_path / "tier").mkdir()
    return f"file://{tmp_path / 'tier'}"


def test_upload_and_the_uploaded_column(run: Run, tier: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert run("ls").splitlines()[0].split()[-2:] == ["UPLOADED", "REASON"]
    assert {s["uploaded_at"] for s in run.json("ls")} == {None}
    assert re.search(r"uploaded:\s+no", run("show", "2"))
    run("upload", code=2)
    assert "SPARK_KV_CACHE_SHARED" in run.err
    report = run.json("--shared", tier, "upload", "--limit", "2")
    # parents first: the two roots, then the child
    assert (report["uploaded"], report["pending"], report["error"]) == ([1, 3], 1, None)
    monkeypatch.setenv("SPARK_KV_CACHE_SHARED", tier)
    assert run("upload").startswith("uploaded 1 snapshot (")
    assert "uploaded 0 snapshots" in run("upload")
    assert all(s["uploaded_at"] for s in run.json("ls"))
    assert re.search(r"uploaded:\s+20", run("show", "3"))
    assert re.search(r"uploaded:\s+3 snapshots, 0.0 MB; 0 found in the tier; 0 failures",
                     run("stats"))
    assert run.json("stats")["counters"]["uploads"] == 3


def test_a_tier_in_the_environment_is_not_contacted_by_other_commands(
        run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_KV_CACHE_SHARED", f"file://{tmp_path / 'not-mounted'}")
    assert len(run.json("ls")) == 3 and run.json("stats")["hits"] == 1
    run("upload", code=2)  # but upload checks it: the folder is missing
    assert "create it first" in run.err
    assert not (tmp_path / "not-mounted").exists()


def test_another_tier_is_refused_unless_relocated(run: Run, tier: str,
                                                  tmp_path: Path) -> None:
    run("--shared", tier, "upload")
    (tmp_path / "tier2").mkdir()
    other = f"file://{tmp_path / 'tier2'}"
    run("--shared", other, "upload", code=3)
    assert "--relocate" in run.err and tier in run.err
    run("--shared", other, "ls", code=3)  # an explicit --shared is checked by any command
    assert run.json("--shared", other, "--relocate", "upload")["uploaded"] == [1, 3, 2]
    run("--shared", "nosuch://x", "upload", code=2)


def test_a_dry_shared_sweep_writes_nothing_into_a_new_tier(run: Run, tmp_path: Path) -> None:
    """A tier without ``tier.json``: a dry run leaves the folder empty (opening the
    tier writes ``tier.json`` otherwise), a real sweep may write it."""
    folder = tmp_path / "new-tier"
    folder.mkdir()
    url = f"file://{folder}"
    dry = run.json("--shared", url, "shared-sweep", "--dry-run")
    assert dry["dry_run"] and dry["swept"]
    assert list(folder.rglob("*")) == []
    run("--shared", url, "shared-sweep")
    assert (folder / "tier.json").is_file()


def test_shared_sweep(run: Run, tier: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sparkcache shared-sweep``: a dry run lists what would go and changes nothing;
    the real run deletes it; a host holding the sweep makes it a skip (exit 1)."""
    run("shared-sweep", code=2)
    assert "SPARK_KV_CACHE_SHARED" in run.err
    run("--shared", tier, "upload")
    folder = Path(tier.removeprefix("file://"))
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    assert run("--shared", tier, "shared-sweep").startswith("nothing to sweep in ")
    dry = run.json("--shared", tier, "shared-sweep", "--dry-run", "--mb", "0.000001",
                   "--max-age-hours", "0")
    assert dry["dry_run"] and dry["swept"] and len(dry["deleted"]["budget"]) == 3
    text = run("--shared", tier, "shared-sweep", "--dry-run", "--mb", "0.000001")
    assert "would delete 3 (budget)" in text and "nothing was changed" in text
    assert sorted(p.relative_to(folder) for p in folder.rglob("*") if "sweep." not in p.name) \
        == [p for p in before if "sweep." not in p.name]
    monkeypatch.setenv("SPARK_KV_CACHE_SHARED", tier)
    monkeypatch.setenv("SPARK_KV_CACHE_SHARED_MB", "0.000001")
    assert "deleted 3 (budget)" in run("shared-sweep")
    assert not list(folder.rglob("*/snap/*/*.json"))
    held, _ = SweepLease.take(SharedTier(tier, alias_stride=16), seconds=60, clock=time.time)
    assert held is not None
    text = run("shared-sweep", code=1)
    assert text.startswith("skipped: ") and "sweeping" in text
    held.release(finished=False)
