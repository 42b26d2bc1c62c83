"""``sparkcache export`` and ``import`` (sparkcache.cli.maintenance)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sparkcache.cli import main

from .helpers import Run


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
