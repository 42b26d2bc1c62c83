"""The admin API (sparkcache.admin) on real stores in tmp_path."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np
import pytest

from sparkcache import SnapshotStore, admin
from sparkcache.errors import InvalidArgument, NotFound
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.retention import GB, DiskUsage, Retention, RetentionSettings

from .index.helpers import DATA
from .store.helpers import identity, pages_for, tokens


@dataclass
class Filled:
    """A store holding a root (32 tokens) and its child (64), plus a second model."""

    store: SnapshotStore
    ident: ModelIdentity
    toks: np.ndarray
    root: int
    child: int
    other: int


def fill(store: SnapshotStore) -> Filled:
    ident, toks = identity(), tokens(64)
    root = store.publish(ident, 0, toks[:32], pages_for(ident, toks[:32])).snapshot_id
    child = store.publish(ident, 0, toks, pages_for(ident, toks, start=32),
                          parent=root).snapshot_id
    other_ident, other_toks = identity(model="other"), tokens(16, seed=1)
    other = store.publish(other_ident, 0, other_toks,
                          pages_for(other_ident, other_toks)).snapshot_id
    return Filled(store, ident, toks, root, child, other)


@pytest.fixture
def filled(tmp_path: Path) -> Iterator[Filled]:
    with SnapshotStore(tmp_path / "store", alias_stride=16) as store:
        yield fill(store)


def segment_path(store: SnapshotStore, snapshot_id: int, rank: int = 0) -> Path:
    (seg,) = [g for g in admin.show(store, snapshot_id).segments if g.rank == rank]
    return store.root / seg.object_key


def flip_byte(path: Path, from_end: int = 300) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - from_end] ^= 0x40
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def restored(store: SnapshotStore, ident: ModelIdentity, toks: np.ndarray,
             rank: int = 0) -> list[np.ndarray]:
    match = store.lookup(ident, toks)
    assert match is not None and match.n_tokens == toks.size
    return store.read(match, rank)


# -- listing ---------------------------------------------------------------------------


def test_list_models_counts_from_model_usage(filled: Filled) -> None:
    rows = admin.list_models(filled.store)
    assert [(r.name, r.snapshots, r.deleted_at) for r in rows] == [
        ("tiny-llama", 2, None), ("other", 1, None)]
    sizes = {s.model_id: 0 for s in filled.store.snapshots()}
    for s in filled.store.snapshots():
        sizes[s.model_id] += s.nbytes
    assert {r.id: r.nbytes for r in rows} == sizes
    assert rows[0].folder == f"objects/m-{filled.ident.digest()}"
    json.dumps(admin.to_dict(rows))


def test_resolve_model_by_name_id_and_digest_prefix(filled: Filled) -> None:
    store = filled.store
    (row,) = [r for r in admin.list_models(store) if r.name == "tiny-llama"]
    for spec in ("tiny-llama", row.id, str(row.id), row.digest[:6], row.digest.upper()):
        assert admin.resolve_model(store, spec).id == row.id
    with pytest.raises(NotFound, match="known: 1:tiny-llama, 2:other"):
        admin.resolve_model(store, "llama-9")
    assert admin.resolve_model(store, "LLAMA").id == row.id  # a unique part of a name
    with pytest.raises(InvalidArgument, match="ambiguous"):
        admin.resolve_model(store, "t")  # part of both names
    with pytest.raises(NotFound):
        admin.resolve_model(store, row.digest[:3])  # too short to be a digest prefix


def test_a_name_shared_by_two_identities_is_ambiguous(filled: Filled) -> None:
    twin = identity(dtype="bfloat16")  # same name, another identity
    filled.store.publish(twin, 0, filled.toks[:16], pages_for(twin, filled.toks[:16]))
    with pytest.raises(InvalidArgument, match=r"ambiguous.*id 1 tiny-llama.*id 3 tiny-llama"):
        admin.resolve_model(filled.store, "tiny-llama")
    assert admin.resolve_model(filled.store, twin.digest()[:8]).name == "tiny-llama"


def test_list_snapshots_and_show(filled: Filled) -> None:
    store = filled.store
    restored(store, filled.ident, filled.toks)
    store.pin(filled.root)
    rows = admin.list_snapshots(store, "tiny-llama")
    assert [(r.id, r.tokens, r.parent, r.pinned, r.state) for r in rows] == [
        (filled.root, 32, None, True, "ready"), (filled.child, 64, filled.root, False, "ready")]
    assert all(r.hits == 1 for r in rows)  # a restore touches the whole chain
    assert len(admin.list_snapshots(store)) == 3

    lease = store.acquire_lease(filled.child, kind="read", ttl=60)
    detail = admin.show(store, filled.child)
    assert [(c.id, c.start_token, c.n_tokens) for c in detail.chain] == [
        (filled.root, 0, 32), (filled.child, 32, 64)]
    (seg,) = detail.segments
    assert (seg.rank, seg.token_start, seg.token_end, seg.state) == (0, 32, 64, "ready")
    assert [x.id for x in detail.leases] == [lease]
    assert admin.show(store, filled.root).children == [filled.child]
    assert detail.model_digest == filled.ident.digest()
    json.dumps(admin.to_dict(detail))
    with pytest.raises(NotFound):
        admin.show(store, 999)


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


# -- verify and check ----------------------------------------------------------------------


def test_verify_clean_store_reports_progress(filled: Filled) -> None:
    calls: list[tuple[int, int]] = []
    report = admin.verify(filled.store, progress=lambda d, t: calls.append((d, t)))
    assert report.clean and report.segments == 3
    total = sum(s.nbytes for s in filled.store.snapshots())
    assert report.nbytes == total and calls[-1] == (total, total)
    assert [d for d, _t in calls] == sorted(d for d, _t in calls)


def test_verify_catches_a_flipped_byte_and_quarantines(filled: Filled) -> None:
    store = filled.store
    flip_byte(segment_path(store, filled.root))
    flip_byte(segment_path(store, filled.child))  # lost with its parent: not reported again
    report = admin.verify(store)
    assert not report.clean
    assert [(p.snapshot_id, p.reason) for p in report.corrupt] == [(filled.root, "digest")]
    states = {s.id: (s.state, s.reason) for s in store.snapshots()}
    assert states[filled.root] == ("quarantined", "digest")
    assert states[filled.child] == ("quarantined", "parent")  # cannot be restored without it
    assert states[filled.other] == ("ready", None)
    assert admin.stats(store).quarantined_counts == {"digest": 1}
    assert store.lookup(filled.ident, filled.toks) is None
    assert admin.verify(store).clean  # quarantined snapshots are not verified again


def test_verify_reports_a_missing_file(filled: Filled) -> None:
    segment_path(filled.store, filled.other).unlink()
    (problem,) = admin.verify(filled.store).corrupt
    assert (problem.snapshot_id, problem.reason) == (filled.other, "missing")


def test_check_finds_and_fixes_an_orphan(filled: Filled) -> None:
    assert admin.check(filled.store).clean
    filled.store.backend.put("objects/m-0/zz/orphan.r0.safetensors", [b"x"])
    report = admin.check(filled.store)
    assert report.orphan_files == ["objects/m-0/zz/orphan.r0.safetensors"]
    assert not admin.check(filled.store, fix=True).clean
    assert admin.check(filled.store).clean
    assert admin.to_dict(report)["clean"] is False


# -- deleting and pinning ------------------------------------------------------------------


def test_clear_model_keeps_leased_snapshots_and_their_ancestors(filled: Filled) -> None:
    store = filled.store
    extra = tokens(32, seed=5)
    lone = store.publish(filled.ident, 0, extra, pages_for(filled.ident, extra)).snapshot_id
    store.acquire_lease(filled.child, ttl=60)
    report = admin.clear_model(store, "tiny-llama")
    assert report.deleted == [lone]
    assert report.kept_leased == [filled.root, filled.child] and report.kept_pinned == []
    assert {s.id for s in store.snapshots()} == {filled.root, filled.child, filled.other}
    assert store.stats()["evictions.cleared"] == 1


def test_clear_model_deletes_everything_and_can_keep_pinned(filled: Filled) -> None:
    store = filled.store
    extra = tokens(32, seed=5)
    lone = store.publish(filled.ident, 0, extra, pages_for(filled.ident, extra)).snapshot_id
    store.pin(filled.child)
    store.acquire_lease(lone, ttl=60)
    kept = admin.clear_model(store, "tiny-llama", keep_pinned=True)
    assert kept.deleted == [] and kept.kept_leased == [lone]
    assert kept.kept_pinned == [filled.root, filled.child]  # the chain of a pinned one
    store.pin(filled.child, False)
    kept = admin.clear_model(store, "tiny-llama", keep_pinned=True)
    assert kept.deleted == [filled.root, filled.child]
    store.pin(lone)
    for lease in admin.show(store, lone).leases:
        store.release_lease(lease.id)
    kept = admin.clear_model(store, "tiny-llama", keep_pinned=True)
    assert kept.deleted == [] and kept.kept_pinned == [lone]
    assert admin.clear_model(store, "tiny-llama").deleted == [lone]  # pinned, yet cleared
    assert [s.id for s in store.snapshots()] == [filled.other]
    assert [m.snapshots for m in admin.list_models(store)] == [0, 1]  # the row stays


def test_delete_model_removes_its_folder(filled: Filled) -> None:
    store = filled.store
    folder = store.root / f"objects/m-{filled.ident.digest()}"
    assert folder.is_dir()
    report = admin.delete_model(store, "tiny-llama")
    assert report.complete and report.remaining == []
    assert not folder.exists()
    assert [m.name for m in admin.list_models(store)] == ["other"]


def test_delete_model_waits_for_leases(filled: Filled) -> None:
    filled.store.acquire_lease(filled.other, ttl=60)
    report = admin.delete_model(filled.store, "other")
    assert not report.complete and report.remaining == [filled.other]
    (row,) = [m for m in admin.list_models(filled.store) if m.name == "other"]
    assert row.deleted_at is not None


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


# -- export and import ---------------------------------------------------------------------


def _roundtrip(filled: Filled, dest: str, tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    exported = admin.export_model(filled.store, "tiny-llama", dest,
                                  progress=lambda d, t: calls.append((d, t)))
    assert exported.snapshots == [filled.root, filled.child] and exported.skipped == []
    assert calls[-1][0] == calls[-1][1] == exported.nbytes > 0
    with SnapshotStore(tmp_path / "target", alias_stride=16) as target:
        report = admin.import_model(target, dest)
        assert report.refused == [] and report.nbytes == exported.nbytes
        assert [(i.source_id, i.deduplicated) for i in report.imported] == [
            (filled.root, False), (filled.child, False)]
        new = {s.id: s for s in target.snapshots()}
        child = new[report.imported[1].id]
        assert child.parent_id == report.imported[0].id and child.start_token == 32
        for want, got in zip(restored(filled.store, filled.ident, filled.toks),
                             restored(target, filled.ident, filled.toks), strict=True):
            assert np.array_equal(want, got)
        again = admin.import_model(target, dest)
        assert all(i.deduplicated for i in again.imported)
        assert len(target.snapshots()) == 2


def test_export_import_roundtrip_to_a_folder(filled: Filled, tmp_path: Path) -> None:
    dest = tmp_path / "export"
    _roundtrip(filled, str(dest), tmp_path)
    keys = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert keys[0] == admin.MANIFEST
    assert all(re.fullmatch(r"segments/[0-9a-f]{32}\.r0\.safetensors", k) for k in keys[1:])
    manifest = json.loads((dest / admin.MANIFEST).read_text())
    assert manifest["model"]["digest"] == filled.ident.digest()
    assert [s["parent"] for s in manifest["snapshots"]] == [None, filled.root]


def test_export_import_roundtrip_through_memory_url(filled: Filled, tmp_path: Path) -> None:
    root = f"sparkcache-test-{uuid.uuid4().hex}"
    try:
        _roundtrip(filled, f"memory://{root}", tmp_path)
    finally:
        fsspec.filesystem("memory").rm(f"/{root}", recursive=True)


def test_export_into_an_existing_export_is_refused(filled: Filled, tmp_path: Path) -> None:
    admin.export_model(filled.store, "other", str(tmp_path / "x"))
    with pytest.raises(InvalidArgument, match="already holds an export"):
        admin.export_model(filled.store, "tiny-llama", str(tmp_path / "x"))


def test_export_leaves_out_corrupt_and_scoped_snapshots(filled: Filled, tmp_path: Path) -> None:
    store = filled.store
    scoped = tokens(16, seed=3)
    salted = store.publish(filled.ident, 0, scoped, pages_for(filled.ident, scoped),
                           scope=RequestScope(cache_salt="s")).snapshot_id
    flip_byte(segment_path(store, filled.root))
    report = admin.export_model(store, "tiny-llama", str(tmp_path / "x"))
    assert report.snapshots == []
    assert {(p.snapshot_id, p.reason) for p in report.skipped} == {
        (filled.root, "digest"), (filled.child, "parent"), (salted, "scope")}
    assert store.snapshot(filled.root).state == "quarantined"
    assert store.snapshot(salted).state == "ready"


def test_import_refuses_a_damaged_file_and_its_descendants(filled: Filled,
                                                           tmp_path: Path) -> None:
    dest = tmp_path / "export"
    admin.export_model(filled.store, "tiny-llama", str(dest))
    root_key = json.loads((dest / admin.MANIFEST).read_text())["snapshots"][0]
    flip_byte(dest / root_key["segments"][0]["key"])
    with SnapshotStore(tmp_path / "target") as target:
        report = admin.import_model(target, str(dest))
        assert report.imported == []
        assert [(p.snapshot_id, p.reason) for p in report.refused] == [
            (filled.root, "digest"), (filled.child, "parent")]
        assert target.snapshots() == []


def test_import_of_a_damaged_child_keeps_the_root(filled: Filled, tmp_path: Path) -> None:
    dest = tmp_path / "export"
    admin.export_model(filled.store, "tiny-llama", str(dest))
    child = json.loads((dest / admin.MANIFEST).read_text())["snapshots"][1]
    path = dest / child["segments"][0]["key"]
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 8)
    with SnapshotStore(tmp_path / "target") as target:
        report = admin.import_model(target, str(dest))
        assert [i.source_id for i in report.imported] == [filled.root]
        assert [(p.snapshot_id, p.reason) for p in report.refused] == [
            (filled.child, "truncated")]


def _manifest_variant(src: Path, dst: Path, edit: object) -> str:
    shutil.copytree(src, dst)
    path = dst / admin.MANIFEST
    doc = json.loads(path.read_text())
    if callable(edit):
        edit(doc)
        path.write_text(json.dumps(doc))
    else:
        path.write_text(str(edit))
    return str(dst)


@pytest.mark.parametrize("edit", [
    "{not json",
    lambda d: d.update(version=2),
    lambda d: d.update(format="pickle"),
    lambda d: d["model"]["identity"].update(num_layers=3),
    lambda d: d["snapshots"].reverse(),  # child before its parent
    lambda d: d["snapshots"][0].update(extra=1),
    lambda d: d["snapshots"][0]["segments"][0].update(key="../../etc/passwd"),
    lambda d: d["snapshots"][0]["segments"][0].update(nbytes="12"),
    lambda d: d["snapshots"][1].update(start_token=4),
])
def test_import_validates_the_manifest_strictly(filled: Filled, tmp_path: Path,
                                                edit: object) -> None:
    dest = tmp_path / "export"
    admin.export_model(filled.store, "tiny-llama", str(dest))
    src = _manifest_variant(dest, tmp_path / "bad", edit)
    with SnapshotStore(tmp_path / "target") as target:
        with pytest.raises(InvalidArgument, match=r"manifest|JSON"):
            admin.import_model(target, src)
        assert target.snapshots() == []


def test_import_without_a_manifest_is_not_found(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with SnapshotStore(tmp_path / "target") as target, pytest.raises(NotFound, match="export"):
        admin.import_model(target, str(tmp_path / "empty"))


def test_two_rank_export_import(tmp_path: Path) -> None:
    ident, toks = identity(world=2), tokens(32)
    with SnapshotStore(tmp_path / "a", alias_stride=16) as a, \
            SnapshotStore(tmp_path / "b", alias_stride=16) as b:
        for rank in (0, 1):
            a.publish(ident, rank, toks, pages_for(ident, toks, rank=rank))
        admin.export_model(a, ident.digest()[:8], str(tmp_path / "x"))
        report = admin.import_model(b, str(tmp_path / "x"))
        assert len(report.imported) == 1 and report.refused == []
        for rank in (0, 1):
            for want, got in zip(restored(a, ident, toks, rank), restored(b, ident, toks, rank),
                                 strict=True):
                assert np.array_equal(want, got)


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


def test_import_into_a_store_whose_retention_refuses(filled: Filled, tmp_path: Path) -> None:
    admin.export_model(filled.store, "tiny-llama", str(tmp_path / "x"))
    settings = RetentionSettings(folder=tmp_path, min_tokens=1000, min_free_mb=0)
    retention = Retention(settings, disk_usage=lambda p: DiskUsage(100 * GB, 50 * GB))
    with SnapshotStore(tmp_path / "target", retention=retention) as target:
        report = admin.import_model(target, str(tmp_path / "x"))
        assert [(p.snapshot_id, p.reason) for p in report.refused] == [
            (filled.root, "retention"), (filled.child, "parent")]
        assert "MIN_TOKENS" in report.refused[0].message
