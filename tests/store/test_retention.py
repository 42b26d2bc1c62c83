"""Retention: Spark's settings and defaults, trim on save, the sweeper and its thread.

Every limit is driven by an injected clock and an injected disk-usage source.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sparkcache import InvalidArgument, SnapshotStore
from sparkcache.folder import resolve_folder
from sparkcache.retention import (
    GB,
    MB,
    DiskUsage,
    Retention,
    RetentionSettings,
    Sweeper,
)

from .helpers import Clock, identity, pages_for, tokens


class FakeDisk:
    def __init__(self, total: int = 100 * GB, free: int = 50 * GB) -> None:
        self.total, self.free = total, free

    def __call__(self, backend: object) -> DiskUsage:
        return DiskUsage(self.total, self.free)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def disk() -> FakeDisk:
    return FakeDisk()


def make_store(tmp_path: Path, clock: Clock, disk: FakeDisk, **settings: object) -> SnapshotStore:
    base = dict(folder=tmp_path, min_tokens=0, min_free_mb=0)
    base.update(settings)
    retention = Retention(RetentionSettings(**base), disk_usage=disk,  # type: ignore[arg-type]
                          ram_bytes=lambda: 64 * GB)
    return SnapshotStore(tmp_path / "store", clock=clock, retention=retention, alias_stride=16)


@pytest.fixture
def store(tmp_path: Path, clock: Clock, disk: FakeDisk) -> Iterator[SnapshotStore]:
    s = make_store(tmp_path, clock, disk)
    yield s
    s.close()


def publish(store: SnapshotStore, seed: int, n: int = 64, model: str = "tiny-llama") -> int:
    ident = identity(model=model)
    toks = tokens(n, seed=seed)
    res = store.publish(ident, 0, toks, pages_for(ident, toks))
    return res.snapshot_id


# -- settings ----------------------------------------------------------------------------


def test_defaults_are_sparks() -> None:
    s = RetentionSettings.from_env({})
    assert s.folder == resolve_folder(env={})
    assert (s.mb, s.entries, s.min_tokens, s.min_free_mb) == (None, 64, 64, None)
    assert (s.max_age_hours, s.total_mb, s.sweep_seconds) == (168, 0, 300)
    assert s.enabled


def test_folder_follows_spark_storage(tmp_path: Path) -> None:
    settings = RetentionSettings.from_env({"SPARK_STORAGE": str(tmp_path)})
    assert settings.folder == tmp_path / "kvcache"
    env = {"SPARK_STORAGE": "/x", "SPARK_KV_CACHE_FOLDER": str(tmp_path / "kv")}
    assert RetentionSettings.from_env(env).folder == tmp_path / "kv"


def test_env_values_are_read() -> None:
    env = {
        "SPARK_KV_CACHE_MB": "512", "SPARK_KV_CACHE_ENTRIES": "3",
        "SPARK_KV_CACHE_MIN_TOKENS": "10", "SPARK_KV_CACHE_MIN_FREE_MB": "2048",
        "SPARK_KV_CACHE_MAX_AGE_HOURS": "0.5", "SPARK_KV_CACHE_TOTAL_MB": "4096",
        "SPARK_KV_CACHE_SWEEP_SECONDS": "30",
    }
    s = RetentionSettings.from_env(env)
    assert (s.mb, s.entries, s.min_tokens, s.min_free_mb) == (512, 3, 10, 2048)
    assert (s.max_age_hours, s.total_mb, s.sweep_seconds) == (0.5, 4096, 30)
    assert RetentionSettings.from_env({"SPARK_KV_CACHE_MB": "auto"}).mb is None
    assert not RetentionSettings.from_env({"SPARK_KV_CACHE_MB": "-1"}).enabled
    assert RetentionSettings.from_env(env, entries=9).entries == 9


@pytest.mark.parametrize("var,value", [
    ("MB", "lots"), ("MB", "-2"), ("ENTRIES", "0"), ("ENTRIES", "1.5"), ("MIN_TOKENS", "-1"),
    ("MIN_FREE_MB", "x"), ("MAX_AGE_HOURS", "-1"), ("TOTAL_MB", "-5"), ("SWEEP_SECONDS", "0"),
])
def test_bad_values_name_the_variable(var: str, value: str) -> None:
    with pytest.raises(InvalidArgument, match=f"SPARK_KV_CACHE_{var}"):
        RetentionSettings.from_env({f"SPARK_KV_CACHE_{var}": value})


def test_auto_limits() -> None:
    r = Retention(RetentionSettings(), ram_bytes=lambda: 32 * GB)
    # MB auto: a quarter of RAM, at most half the free disk (plus what the model uses)
    assert r.model_budget_bytes(DiskUsage(1000 * GB, 500 * GB), 0) == 8 * GB
    assert r.model_budget_bytes(DiskUsage(1000 * GB, 6 * GB), 2 * GB) == 4 * GB
    # MIN_FREE_MB auto: 5% of the disk, clamped to 1-10 GB
    assert r.min_free_bytes(DiskUsage(100 * GB, 0)) == 5 * GB
    assert r.min_free_bytes(DiskUsage(4 * GB, 0)) == 1 * GB
    assert r.min_free_bytes(DiskUsage(4000 * GB, 0)) == 10 * GB
    fixed = r.with_settings(mb=100, min_free_mb=7)
    assert fixed.model_budget_bytes(DiskUsage(1, 1), 0) == 100 * MB
    assert fixed.min_free_bytes(DiskUsage(1, 1)) == 7 * MB


# -- trim on save ------------------------------------------------------------------------


def test_entry_count_trims_least_recently_used(tmp_path: Path, clock: Clock,
                                               disk: FakeDisk) -> None:
    with make_store(tmp_path, clock, disk, entries=3) as store:
        ids = []
        for i in range(3):
            clock.now += 10
            ids.append(publish(store, i))
        clock.now += 10
        m = store.lookup(identity(), tokens(64, seed=0))  # use the oldest: now most recent
        assert m is not None
        store.read(m, 0)
        clock.now += 10
        ids.append(publish(store, 3))
        assert {s.id for s in store.snapshots()} == {ids[0], ids[2], ids[3]}
        assert store.stats()["evictions.entries"] == 1


def test_budget_trims_own_model_only(tmp_path: Path, clock: Clock, disk: FakeDisk) -> None:
    with make_store(tmp_path, clock, disk, mb=1) as store:
        other = publish(store, 100, n=1024, model="other")  # 131 kB each at n=1024
        ours = []
        for i in range(20):
            clock.now += 1
            ours.append(publish(store, i, n=1024))
        left = {s.id for s in store.snapshots()}
        assert other in left
        assert ours[-1] in left and ours[0] not in left
        kept = [s for s in store.snapshots() if s.id != other]
        assert sum(s.nbytes for s in kept) <= 1 * MB
        assert store.stats()["evictions.budget"] >= 1


def test_short_contexts_are_not_stored(tmp_path: Path, clock: Clock, disk: FakeDisk) -> None:
    with make_store(tmp_path, clock, disk, min_tokens=64) as store:
        ident = identity()
        toks = tokens(60)
        res = store.publish(ident, 0, toks[:60], pages_for(ident, toks[:60]))
        assert res.state == "skipped" and "MIN_TOKENS=64" in (res.skipped or "")
        assert store.snapshots() == [] and list(store.backend.list("objects")) == []


def test_off_stores_nothing(tmp_path: Path, clock: Clock, disk: FakeDisk) -> None:
    with make_store(tmp_path, clock, disk, mb=-1) as store:
        ident = identity()
        toks = tokens(64)
        res = store.publish(ident, 0, toks, pages_for(ident, toks))
        assert res.state == "skipped" and "MB=-1" in (res.skipped or "")
        assert store.snapshots() == []


def test_below_disk_margin_nothing_new_is_saved(tmp_path: Path, clock: Clock,
                                                disk: FakeDisk) -> None:
    with make_store(tmp_path, clock, disk, min_free_mb=1000) as store:
        first = publish(store, 1)
        disk.free = 900 * MB
        ident = identity()
        toks = tokens(64, seed=2)
        res = store.publish(ident, 0, toks, pages_for(ident, toks))
        assert res.state == "skipped" and "margin" in (res.skipped or "")
        assert [s.id for s in store.snapshots()] == [first]
        assert store.stats()["skipped"] == 1


# -- the sweeper -------------------------------------------------------------------------


def test_age(tmp_path: Path, clock: Clock, disk: FakeDisk) -> None:
    with make_store(tmp_path, clock, disk, max_age_hours=1) as store:
        old = publish(store, 1)
        clock.now += 1800
        young = publish(store, 2)
        clock.now += 1900  # old: 3700 s unused, young: 1900 s
        report = store.sweep()
        assert report.evicted == {"age": [old]}
        assert [s.id for s in store.snapshots()] == [young]


def test_age_zero_keeps(tmp_path: Path, clock: Clock, disk: FakeDisk) -> None:
    with make_store(tmp_path, clock, disk, max_age_hours=0) as store:
        publish(store, 1)
        clock.now += 10 * 365 * 86400
        assert store.sweep().count == 0


def test_disk_margin_evicts_lru_of_every_model(tmp_path: Path, clock: Clock,
                                               disk: FakeDisk) -> None:
    with make_store(tmp_path, clock, disk, min_free_mb=1000) as store:
        a = publish(store, 1, model="a")
        clock.now += 1
        b = publish(store, 2, model="b")
        clock.now += 1
        c = publish(store, 3, model="a")
        size = store.snapshot(a).nbytes
        disk.free = 1000 * MB - size - 1  # one snapshot's worth short of the margin
        report = store.sweep()
        assert report.evicted == {"disk": [a, b]}  # bytes freed >= missing: 2 go (LRU order)
        assert [s.id for s in store.snapshots()] == [c]


def test_total_across_models(tmp_path: Path, clock: Clock, disk: FakeDisk) -> None:
    with make_store(tmp_path, clock, disk, total_mb=1) as store:
        ids = []
        for i in range(12):
            clock.now += 1
            ids.append(publish(store, i, n=1024, model=f"m{i % 3}"))
        report = store.sweep()
        gone = report.evicted["total"]
        assert gone == ids[: len(gone)]  # least recently used first, whatever the model
        assert sum(s.nbytes for s in store.snapshots()) <= 1 * MB


def test_leased_and_pinned_never_go_parent_after_child(tmp_path: Path, clock: Clock,
                                                       disk: FakeDisk) -> None:
    with make_store(tmp_path, clock, disk, max_age_hours=1) as store:
        ident = identity()
        pinned = publish(store, 1)
        store.pin(pinned)
        leased = publish(store, 2)
        store.acquire_lease(leased, ttl=10 * 3600)
        t1 = tokens(32, seed=3)
        parent = store.publish(ident, 0, t1, pages_for(ident, t1)).snapshot_id
        t2 = np.concatenate([t1, tokens(32, seed=4)])
        child = store.publish(ident, 0, t2, pages_for(ident, t2, start=32),
                              parent=parent).snapshot_id
        clock.now += 2 * 3600
        report = store.sweep()
        assert report.evicted["age"] == [child, parent]
        assert {s.id for s in store.snapshots()} == {pinned, leased}


def test_deleted_models_and_orphan_folders(tmp_path: Path, clock: Clock, disk: FakeDisk) -> None:
    from sparkcache.maintenance import delete_model

    with make_store(tmp_path, clock, disk) as store:
        keep = publish(store, 1, model="keep")
        gone = publish(store, 2, model="gone")
        leased = publish(store, 3, model="gone")
        lease = store.acquire_lease(leased, ttl=60)
        model_id = store.snapshot(gone).model_id
        assert delete_model(store._core, model_id) is False  # one snapshot is leased
        assert store.lookup(identity(model="gone"), tokens(64, seed=3)) is None
        store.release_lease(lease)
        orphan = store.root / "objects" / ("m-" + "0" * 32)
        (orphan / "ab").mkdir(parents=True)
        (orphan / "ab" / "x.r0.safetensors").write_bytes(b"junk")
        report = store.sweep()
        assert report.models_removed == ["gone"]
        assert "objects/m-" + "0" * 32 in report.folders_removed
        assert not orphan.exists()
        assert [s.id for s in store.snapshots()] == [keep]
        folders = {p.name for p in (store.root / "objects").iterdir()}
        assert folders == {f"m-{identity(model='keep').digest()}"}


def test_sweeper_thread_starts_and_stops(tmp_path: Path, clock: Clock, disk: FakeDisk) -> None:
    with make_store(tmp_path, clock, disk, max_age_hours=1, sweep_seconds=0.05) as store:
        old = publish(store, 1)
        clock.now += 7200
        sweeper = Sweeper(store._core, store.retention)  # type: ignore[arg-type]
        with sweeper:
            assert sweeper.running
            assert sweeper.wait(3, timeout=10)
        assert not sweeper.running
        assert sweeper.last_error is None
        assert all(s.id != old for s in store.snapshots())
        passes = sweeper.passes
        sweeper.stop()  # idempotent
        assert sweeper.passes == passes


def test_the_store_starts_its_sweeper_and_close_stops_it(tmp_path: Path, clock: Clock,
                                                        disk: FakeDisk) -> None:
    store = make_store(tmp_path, clock, disk, max_age_hours=1, sweep_seconds=0.05)
    old = publish(store, 1)
    clock.now += 7200
    sweeper = store.start_sweeper()
    assert store.start_sweeper() is sweeper  # once per store
    assert sweeper.running and sweeper.wait(2, timeout=10)
    assert all(s.id != old for s in store.snapshots())
    store.close()
    assert not sweeper.running
    assert sweeper.last_error is None
    with SnapshotStore(tmp_path / "plain") as plain, \
            pytest.raises(InvalidArgument, match="retention="):
        plain.start_sweeper()


def test_changing_the_folder_leaves_the_old_one_alone(tmp_path: Path, clock: Clock,
                                                      disk: FakeDisk) -> None:
    with make_store(tmp_path / "old", clock, disk) as old_store:
        publish(old_store, 1)
    before = sorted(p for p in (tmp_path / "old").rglob("*"))
    with make_store(tmp_path / "new", clock, disk, max_age_hours=1) as new_store:
        clock.now += 10 * 3600
        new_store.sweep()
    assert sorted(p for p in (tmp_path / "old").rglob("*")) == before


def test_the_entry_count_takes_every_tp_size_of_a_model_together(
        tmp_path: Path, clock: Clock, disk: FakeDisk) -> None:
    """A model stored by engines of two TP sizes has one entry budget
    (docs/retention.md): its least recently used snapshot goes, whatever its
    sharding, and a snapshot of another TP size is not a second free entry."""
    from tests.store.test_reshard import TOKENS, full_kv, ident
    from tests.store.test_reshard import publish as publish_sharded

    with make_store(tmp_path, clock, disk, entries=2) as store:
        kv = full_kv()
        prompts = [[t + 1000 * i for t in TOKENS] for i in range(3)]
        for tp, prompt in zip((1, 2, 1), prompts, strict=True):
            clock.now += 10
            publish_sharded(store, tp, kv, prompt)
        assert len(store.snapshots()) == 2
        assert store.lookup(ident(1), prompts[0]) is None  # the oldest, of TP=1, went
        assert store.lookup(ident(2), prompts[1]) is not None
        assert store.lookup(ident(1), prompts[2]) is not None
        assert store.stats()["evictions.entries"] == 1
        clock.now += 10
        publish_sharded(store, 2, kv, [t + 5000 for t in TOKENS])
        assert store.lookup(ident(2), prompts[1]) is None  # now the oldest of both
        assert len(store.snapshots()) == 2
