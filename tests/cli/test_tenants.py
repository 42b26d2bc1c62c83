"""``sparkcache tenants`` and ``sparkcache clear --tenant``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkcache import SnapshotStore
from sparkcache.identity import RequestScope

from ..store.helpers import identity, pages_for, tokens
from .helpers import Run

EVIL = "a\x1b[31m\nb\u202e"  # an escape sequence, a newline, a bidirectional override


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[Path]:
    """Model tiny-llama: tenant ``alice`` 2 snapshots, EVIL 1, none 1; requests
    of alice (half cached) and EVIL; model other: alice 1 snapshot."""
    root = tmp_path / "store"
    with SnapshotStore(root, alias_stride=16) as store:
        ident = identity()
        for seed, tenant in ((1, "alice"), (2, "alice"), (3, EVIL), (4, None)):
            toks = tokens(32, seed=seed)
            scope = None if tenant is None else RequestScope(cache_salt="x", tenant=tenant)
            store.publish(ident, 0, toks, pages_for(ident, toks), scope=scope)
        other = identity(model="other")
        toks = tokens(16, seed=9)
        store.publish(other, 0, toks, pages_for(other, toks),
                      scope=RequestScope(tenant="alice"))
        model_id = store.snapshot(1).model_id
        store.log_requests([
            {"request_id": "r1", "model_id": model_id, "tenant": "alice", "prompt_tokens": 64,
             "live_tokens": 32},
            {"request_id": "r2", "model_id": model_id, "tenant": EVIL, "prompt_tokens": 10},
        ], keep=100)
    yield root


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str], tenants: Path) -> Run:
    return Run(capsys, tenants)


def _size(folder: Path, *ids: int) -> int:
    with SnapshotStore(folder) as store:
        return sum(store.snapshot(i).nbytes for i in ids)


def test_tenants_lists_each_tenant_of_each_model(run: Run, tenants: Path) -> None:
    rows = run.json("tenants")
    got = [(r["model"], r["tenant"], r["snapshots"], r["nbytes"], r["requests"], r["hit_rate"])
           for r in rows]
    assert got == [
        ("tiny-llama", "alice", 2, _size(tenants, 1, 2), 1, 0.5),
        ("tiny-llama", EVIL, 1, _size(tenants, 3), 1, 0.0),
        ("other", "alice", 1, _size(tenants, 5), 0, 0.0),
    ]
    assert [r["tenant"] for r in run.json("tenants", "other")] == ["alice"]
    text = run("tenants")
    lines = text.splitlines()
    assert lines[0].split() == ["MODEL", "TENANT", "SNAPSHOTS", "MB", "REQUESTS", "HIT", "RATE"]
    assert len(lines) == 4  # the header and one line per tenant: nothing forged a line
    assert "\x1b" not in text and "\u202e" not in text
    assert "a\\x1b[31m\\nb\\u202e" in lines[2]
    assert lines[1].split()[-1] == "50.0%" and lines[3].split()[-1] == "-"


def test_clear_of_one_tenant_leaves_the_others(run: Run, tenants: Path) -> None:
    size = _size(tenants, 1, 2)
    dry = run.json("clear", "tiny-llama", "--tenant", "alice", "--dry-run")
    assert (dry["deleted"], dry["tenant"], dry["nbytes"], dry["dry_run"]) == (
        [1, 2], "alice", size, True)
    assert len(dry["files"]) == 2
    assert len(run.json("ls")) == 5
    text = run("clear", "tiny-llama", "--tenant", "alice", "--yes")
    assert text.startswith(f"deleted 2 snapshots of tenant alice of tiny-llama (id 1), "
                           f"{round(size / 1e6, 1)} MB")
    assert sorted(s["id"] for s in run.json("ls")) == [3, 4, 5]  # other tenants, no tenant
    # Another model's snapshots of the same tenant stay too.
    assert [(r["model"], r["snapshots"]) for r in run.json("tenants")
            if r["tenant"] == "alice"] == [("tiny-llama", 0), ("other", 1)]
    evil = run.json("clear", "tiny-llama", "--tenant", EVIL, "--yes")
    assert evil["deleted"] == [3]
    assert run.json("clear", "tiny-llama", "--tenant", "nobody", "--yes")["deleted"] == []
    assert sorted(s["id"] for s in run.json("ls")) == [4, 5]


def test_clear_of_a_tenant_prints_its_name_escaped(run: Run) -> None:
    text = run("clear", "tiny-llama", "--tenant", EVIL, "--yes")
    assert text.splitlines() == [
        "deleted 1 snapshot of tenant a\\x1b[31m\\nb\\u202e of tiny-llama (id 1), 0.0 MB"]


def test_ls_and_show_name_each_snapshots_tenant(run: Run) -> None:
    rows = run.json("ls")
    assert [r["tenant"] for r in rows] == ["alice", "alice", EVIL, None, "alice"]
    lines = run("ls").splitlines()
    assert "TENANT" in lines[0].split()
    assert "alice" in lines[1] and "a\\x1b[31m\\nb\\u202e" in lines[3]
    assert len(lines) == 6  # the header and one line per snapshot: nothing forged a line
    assert run.json("show", "3")["snapshot"]["tenant"] == EVIL
    shown = run("show", "3")
    assert "\x1b" not in shown and "\u202e" not in shown
    assert "tenant" in shown and "a\\x1b[31m\\nb\\u202e" in shown
    assert any(line.split() == ["tenant:", "none"] for line in run("show", "4").splitlines())
