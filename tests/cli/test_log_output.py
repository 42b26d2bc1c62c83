"""``sparkcache log``'s table prints a client's text escaped: a model name or a
``prompt_cache_key`` with escape sequences or newlines cannot forge a line."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkcache import SnapshotStore
from sparkcache.cli import main

FORGED = "k\x1b[2K\r2026-01-01 00:00:00  forged\nnext\u202eline"


def test_the_log_table_escapes_control_characters(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "store"
    with SnapshotStore(folder) as store:
        store.log_requests([{"request_id": "a", "api": "chat", "model": "m\x07\x1b]0;t\x07",
                             "cache_key": FORGED, "prompt_tokens": 10}], keep=10)
    capsys.readouterr()
    assert main(["--folder", str(folder), "log"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 2, out  # the header and one row
    assert "\x1b" not in out and "\r" not in out and "\x07" not in out
    assert "\u202e" not in out
    assert "k\\x1b[2K\\r2026-01-01 00:00:00  forged\\nnext\\u202eline" in lines[1]
    assert "m\\x07\\x1b]0;t\\x07" in lines[1]
