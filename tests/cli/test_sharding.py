"""``sparkcache ls`` and ``show`` say how each snapshot is sharded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sparkcache import ModelIdentity, SnapshotStore, admin
from sparkcache.cli import main


def ident(tp: int) -> ModelIdentity:
    return ModelIdentity(model="m", revision="r", num_layers=1, num_kv_heads=2 // tp,
                         head_size=4, dtype="float32", kv_cache_dtype="float32", block_size=16,
                         page_shape=(2 // tp, 16, 8), tp_size=tp)


def test_ls_and_show_name_each_snapshots_sharding(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "s"
    with SnapshotStore(folder) as store:
        for tp, seed in ((2, 1), (1, 2)):
            tokens = list(range(seed * 1000, seed * 1000 + 32))
            for rank in range(tp):
                pages = [np.zeros((2, ident(tp).page_nbytes), np.uint8)]
                store.publish(ident(tp), rank, tokens, pages)
        rows = admin.list_snapshots(store)
    assert [(r.world_size, r.sharding) for r in rows] == [(2, "tp=2"), (1, "tp=1")]
    assert main(["--folder", str(folder), "ls"]) == 0
    out = capsys.readouterr().out
    assert "SHARDING" in out and "tp=2" in out and "tp=1" in out
    assert main(["--folder", str(folder), "show", str(rows[0].id)]) == 0
    assert "2 (tp=2)" in capsys.readouterr().out
    assert main(["--folder", str(folder), "ls", "--json"]) == 0
    assert [r["sharding"] for r in json.loads(capsys.readouterr().out)] == ["tp=2", "tp=1"]
