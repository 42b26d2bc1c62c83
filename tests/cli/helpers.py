"""The store and the runner that every test of the ``sparkcache`` command uses."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apsw
import pytest

from sparkcache import SnapshotStore
from sparkcache.cli import main

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


# -- what a store holds, to compare before and after a command ------------------------------


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
