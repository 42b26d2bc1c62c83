"""The commands that check a store or delete from it: verify, check, pin, clear, rm,
sweep, their dry runs and confirmation (sparkcache.cli.maintenance)."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from sparkcache import SnapshotStore

from .helpers import Run, files_of, rows_of


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


# -- dry runs and confirmation ---------------------------------------------------------------


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


def test_pin_refuses_a_quarantined_snapshot(run: Run, folder: Path) -> None:
    assert run.json("pin", "2")["pinned"] is True
    with SnapshotStore(folder) as store:
        store.quarantine(1, "digest")  # and its child, 2
    run("pin", "1", code=2)
    assert "quarantined" in run.err
    assert run.json("show", "1")["snapshot"]["pinned"] is False
    assert run.json("unpin", "2")["pinned"] is False
