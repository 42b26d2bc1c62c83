"""sparkcache.maintenance through the admin API: verify, check, clear and delete models."""

from __future__ import annotations

from sparkcache import admin

from ..filled import Filled, flip_byte, segment_path
from .helpers import pages_for, tokens

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
