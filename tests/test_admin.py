"""The admin API: stats, pinning, sweeping, opening stores and the index's schema."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sparkcache import SnapshotStore, admin, retention
from sparkcache.backends import Backend
from sparkcache.errors import InvalidArgument, NotFound, SchemaMismatch
from sparkcache.index import migrate
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


def test_open_store_without_upgrading_leaves_an_old_index_alone(tmp_path: Path) -> None:
    folder = tmp_path / "old"
    folder.mkdir()
    shutil.copyfile(DATA / "golden_0001.sqlite", folder / "index.sqlite")
    before = (folder / "index.sqlite").read_bytes()
    with pytest.raises(SchemaMismatch, match="sparkcache db upgrade"):
        admin.open_store(folder, upgrade=False)
    with pytest.raises(SchemaMismatch, match="sparkcache db upgrade"):
        SnapshotStore(folder, upgrade=False)
    assert (folder / "index.sqlite").read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == ["index.sqlite"]
    with admin.open_store(folder) as store:  # a writing command upgrades, as before
        assert [s.n_tokens for s in store.snapshots()] == [512, 768]
    admin.open_store(folder, upgrade=False).close()


def test_db_downgrade_keeps_the_rows_that_stay(tmp_path: Path) -> None:
    folder = tmp_path / "old"
    folder.mkdir()
    shutil.copyfile(DATA / "golden_0001.sqlite", folder / "index.sqlite")
    admin.db_upgrade(folder)
    known = migrate.known_revisions()
    back = admin.db_downgrade(folder, "0001")
    assert back.current == "0001" and back.undone == list(reversed(known[1:]))
    assert admin.to_dict(back)["up_to_date"] is False
    assert admin.db_downgrade(folder, "0001").undone == []
    with pytest.raises(InvalidArgument, match="upgrade"):
        admin.db_downgrade(folder, known[-1])
    assert admin.db_upgrade(folder).applied == list(known[1:])
    with admin.open_store(folder, upgrade=False) as store:
        assert [(s.id, s.state) for s in store.snapshots()] == [(1, "ready"), (2, "quarantined")]


def test_pin_refuses_a_quarantined_snapshot(filled: Filled) -> None:
    store = filled.store
    admin.pin(store, filled.child)
    store.quarantine(filled.root, "digest")  # the child too
    with pytest.raises(InvalidArgument, match="quarantined"):
        admin.pin(store, filled.root)
    assert not store.snapshot(filled.root).pinned
    assert not admin.unpin(store, filled.child).pinned
    with pytest.raises(NotFound):
        admin.pin(store, 999)


def test_check_url_refuses_only_unknown_schemes() -> None:
    for fine in ("/var/cache/x", "relative/dir", "file:///tmp/x", "memory://b/x",
                 "local:///tmp/x", "fsspec::memory://b", "odd::name"):
        admin.check_url(fine)
    with pytest.raises(InvalidArgument, match="'nosuch'"):
        admin.check_url("nosuch://bucket/x")


# -- dry runs -------------------------------------------------------------------------------


def test_dry_run_keeps_the_counts_not_yet_saved(filled: Filled) -> None:
    store = filled.store
    before = admin.stats(store).hits
    store._core.count(0, "hits", 5)  # counted in memory, saved with the next write
    dry = admin.clear_model(store, "tiny-llama", dry_run=True)
    assert dry.report.deleted == [filled.root, filled.child] and len(dry.files) == 2
    assert len(store.snapshots()) == 3
    assert admin.stats(store).hits == before + 5


def test_dry_run_removes_no_folder(filled: Filled) -> None:
    store = filled.store
    dry = admin.delete_model(store, "other", dry_run=True)
    (folder,) = dry.folders
    assert dry.report.complete and (store.root / folder).is_dir()
    assert [m.name for m in admin.list_models(store)] == ["tiny-llama", "other"]
    as_json = admin.to_dict(dry)
    assert as_json["dry_run"] is True and as_json["folders"] == [folder]
    assert as_json["model"] == "other" and as_json["files"] == dry.files
    assert admin.delete_model(store, "other").complete
    assert not (store.root / folder).exists()


def test_dry_sweep_sees_the_disk_a_real_sweep_would(filled: Filled,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk margin is measured again after each chunk: in a dry run as if the
    files of the chunks before were gone."""
    store = filled.store
    monkeypatch.setattr(retention, "SWEEP_CHUNK", 1)
    sizes = sorted(s.nbytes for s in store.snapshots())
    used_now = sum(store.backend.size(k) for k in store.backend.list("objects"))
    margin = 1_000_000
    capacity = margin + used_now - sizes[0] - sizes[1] // 2  # two must go, not three

    def disk(backend: Backend) -> DiskUsage:
        used = sum(backend.size(k) for k in backend.list("objects"))
        return DiskUsage(capacity, capacity - used)

    settings = RetentionSettings(folder=store.root, max_age_hours=0, min_free_mb=1)
    policy = Retention(settings, disk_usage=disk)
    dry = admin.sweep(store, policy, dry_run=True)
    assert len(dry.report.evicted["disk"]) == 2
    assert len(store.snapshots()) == 3
    real = admin.sweep(store, policy)
    assert real.evicted == dry.report.evicted and len(store.snapshots()) == 1
