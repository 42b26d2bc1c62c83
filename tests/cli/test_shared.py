"""The shared tier from the command line: --shared, upload, the UPLOADED column,
shared-sweep (sparkcache.cli.maintenance)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from sparkcache.shared import SharedTier, SweepLease

from .helpers import Run


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
