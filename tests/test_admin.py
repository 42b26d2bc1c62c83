"""The admin API: stats, pinning, sweeping, opening stores and the index's schema."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sparkcache import SnapshotStore, admin
from sparkcache.errors import NotFound
from sparkcache.retention import GB, DiskUsage, Retention, RetentionSettings

from .filled import Filled, fill, restored
from .index.helpers import DATA
from .store.helpers import identity, tokens


def test_stats_counts_hits_misses_evictions_and_quarantines(filled: Filled) -> None:
    store = filled.store
    restored(store, filled.ident, filled.toks)
    assert store.lookup(filled.ident, tokens(64, seed=9)) is None
    store.evict(model=identity(model="other"), count=1)
    store.quarantine(filled.child, "digest")
    st = admin.stats(store)
    assert (st.hits, st.misses, st.hit_rate) == (1, 1, 0.5)
    assert st.restored_tokens == 64 and st.written_tokens == 32 + 32 + 16
    assert st.evictions == {"lru": 1}
    assert st.quarantined_counts == {"digest": 1}
    assert [(q.id, q.reason) for q in st.quarantined] == [(filled.child, "digest")]
    mine = admin.stats(store, "tiny-llama")
    assert mine.model == "tiny-llama" and mine.evictions == {} and mine.hits == 1
    assert admin.stats(store, "other").quarantined == []
    json.dumps(admin.to_dict(st))


def test_pin_and_unpin(filled: Filled) -> None:
    assert admin.pin(filled.store, filled.child).pinned
    assert filled.store.snapshot(filled.child).pinned
    assert not admin.unpin(filled.store, filled.child).pinned
    with pytest.raises(NotFound):
        admin.pin(filled.store, 999)


def test_sweep_evicts_by_age(tmp_path: Path) -> None:
    now = [1_000_000.0]
    with SnapshotStore(tmp_path / "store", alias_stride=16, clock=lambda: now[0]) as store:
        f = fill(store)
        now[0] += 200 * 3600
        settings = RetentionSettings(folder=tmp_path, max_age_hours=168, min_free_mb=0)
        retention = Retention(settings, disk_usage=lambda p: DiskUsage(100 * GB, 50 * GB))
        report = admin.sweep(store, retention)
        assert report.counts() == {"age": 3}
        assert sorted(report.evicted["age"]) == sorted([f.root, f.child, f.other])
        assert admin.to_dict(report)["counts"] == {"age": 3}


# -- the schema ----------------------------------------------------------------------------


def test_db_current_and_upgrade_from_an_old_index(tmp_path: Path) -> None:
    folder = tmp_path / "old"
    folder.mkdir()
    shutil.copyfile(DATA / "golden_0001.sqlite", folder / "index.sqlite")
    before = admin.db_current(folder)
    assert before.current == "0001" and not before.up_to_date
    after = admin.db_upgrade(folder)
    assert after.applied[0] == "0002" and after.current == after.head and after.up_to_date
    assert admin.db_upgrade(folder).applied == []
    assert admin.to_dict(admin.db_current(folder))["up_to_date"] is True
    with pytest.raises(NotFound, match="no sparkcache index"):
        admin.db_current(tmp_path / "nothing")


def test_open_store_refuses_a_missing_store(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="SPARK_KV_CACHE_FOLDER"):
        admin.open_store(tmp_path / "nope")
    assert not (tmp_path / "nope").exists()
    admin.open_store(tmp_path / "new", create=True).close()
    assert (tmp_path / "new" / "index.sqlite").is_file()
