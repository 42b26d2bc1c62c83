"""README's main-job command works end to end (publish, restart, restore, damage)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_runs_and_restores(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sparkcache.demo", "--root", str(tmp_path / "store")],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    assert "bytes equal to the original KV: True" in out
    assert "restore refused (digest)" in out
    assert "next lookup falls back to snapshot 1" in out
    assert "longest stored prefix 3072 tokens" in out
