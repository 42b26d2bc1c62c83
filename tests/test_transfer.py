"""sparkcache.transfer: export and import, verified, through folders and fsspec URLs."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest

from sparkcache import SnapshotStore, admin, transfer
from sparkcache import segment as seg
from sparkcache.cli import main
from sparkcache.errors import InvalidArgument, NotFound, SparkCacheError
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.index import Database
from sparkcache.retention import GB, DiskUsage, Retention, RetentionSettings

from .filled import Filled, flip_byte, restored, segment_path
from .store.helpers import identity, pages_for, tokens

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
    assert keys[0] == transfer.MANIFEST
    assert all(re.fullmatch(r"segments/[0-9a-f]{32}\.r0\.safetensors", k) for k in keys[1:])
    manifest = json.loads((dest / transfer.MANIFEST).read_text())
    assert manifest["model"]["digest"] == filled.ident.digest()
    assert [s["parent"] for s in manifest["snapshots"]] == [None, filled.root]


@pytest.fixture
def bucket() -> Iterator[str]:
    """A fresh, existing bucket of fsspec's memory filesystem (its path, ``/name``)."""
    fs = fsspec.filesystem("memory")
    path = f"/sparkcache-test-{uuid.uuid4().hex}"
    fs.mkdir(path)
    yield path
    if fs.exists(path):
        fs.rm(path, recursive=True)


def test_export_import_roundtrip_through_memory_url(filled: Filled, tmp_path: Path,
                                                    bucket: str) -> None:
    _roundtrip(filled, f"memory:/{bucket}/export", tmp_path)


def test_export_into_the_root_of_a_memory_bucket(filled: Filled, bucket: str) -> None:
    report = admin.export_model(filled.store, "tiny-llama", f"memory:/{bucket}")
    assert report.snapshots == [filled.root, filled.child]
    assert fsspec.filesystem("memory").isfile(f"{bucket}/{transfer.MANIFEST}")


# -- where an export may go ---------------------------------------------------------------


def test_export_into_an_existing_export_is_refused(filled: Filled, tmp_path: Path) -> None:
    admin.export_model(filled.store, "other", str(tmp_path / "x"))
    with pytest.raises(InvalidArgument, match="already holds an export"):
        admin.export_model(filled.store, "tiny-llama", str(tmp_path / "x"))


def test_export_into_a_non_empty_folder_is_refused(filled: Filled, tmp_path: Path) -> None:
    dest = tmp_path / "x"
    (dest / "sub").mkdir(parents=True)
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgument, match="not empty"):
        admin.export_model(filled.store, "tiny-llama", str(dest))
    assert sorted(p.name for p in dest.rglob("*")) == ["notes.txt", "sub"]
    (dest / "notes.txt").unlink()
    with pytest.raises(InvalidArgument, match="not empty"):  # an empty sub-folder is not empty
        admin.export_model(filled.store, "tiny-llama", str(dest))
    (dest / "sub").rmdir()
    assert admin.export_model(filled.store, "tiny-llama", str(dest)).skipped == []


def test_export_onto_a_file_is_refused(filled: Filled, tmp_path: Path) -> None:
    (tmp_path / "x").write_text("mine")
    with pytest.raises(InvalidArgument, match="not a folder"):
        admin.export_model(filled.store, "tiny-llama", str(tmp_path / "x"))
    assert (tmp_path / "x").read_text() == "mine"


def test_export_into_a_non_empty_prefix_is_refused(filled: Filled, bucket: str) -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{bucket}/x/notes.txt", b"mine")
    with pytest.raises(InvalidArgument, match="not empty"):
        admin.export_model(filled.store, "tiny-llama", f"memory:/{bucket}/x")
    assert fs.find(bucket) == [f"{bucket}/x/notes.txt"]


def test_export_into_a_missing_bucket_is_refused_and_creates_nothing(filled: Filled) -> None:
    fs = fsspec.filesystem("memory")
    missing = f"sparkcache-missing-{uuid.uuid4().hex}"
    for dest in (f"memory://{missing}/backups/llama", f"memory://{missing}"):
        with pytest.raises(SparkCacheError, match="does not exist"):
            admin.export_model(filled.store, "tiny-llama", dest)
        assert not fs.exists(f"/{missing}")


@pytest.mark.parametrize("spell", [str, lambda p: p.as_uri(), lambda p: f"local://{p}"])
def test_export_under_a_missing_local_folder_is_refused_and_creates_nothing(
        filled: Filled, tmp_path: Path, spell: Callable[[Path], str]) -> None:
    with pytest.raises(SparkCacheError, match="does not exist"):
        admin.export_model(filled.store, "tiny-llama", spell(tmp_path / "missing" / "x"))
    assert not (tmp_path / "missing").exists()
    (tmp_path / "missing").mkdir()  # the parent exists: DEST itself is created
    report = admin.export_model(filled.store, "tiny-llama", spell(tmp_path / "missing" / "x"))
    assert report.skipped == [] and (tmp_path / "missing" / "x" / transfer.MANIFEST).is_file()


def test_export_leaves_out_corrupt_snapshots(filled: Filled, tmp_path: Path) -> None:
    store = filled.store
    flip_byte(segment_path(store, filled.root))
    report = admin.export_model(store, "tiny-llama", str(tmp_path / "x"))
    assert report.snapshots == []
    assert {(p.snapshot_id, p.reason) for p in report.skipped} == {
        (filled.root, "digest"), (filled.child, "parent")}
    assert store.snapshot(filled.root).state == "quarantined"


def test_export_leaves_out_a_scope_the_store_did_not_record(filled: Filled,
                                                           tmp_path: Path) -> None:
    """A snapshot published with a scope before revision 0004 has no recorded scope."""
    store = filled.store
    scoped = tokens(16, seed=3)
    salted = store.publish(filled.ident, 0, scoped, pages_for(filled.ident, scoped),
                           scope=RequestScope(cache_salt="s")).snapshot_id
    with Database(store.root / "index.sqlite") as db, db.write() as conn:
        conn.execute("UPDATE snapshots SET scope_json = NULL")  # as revision 0004 left them
    report = admin.export_model(store, "tiny-llama", str(tmp_path / "x"))
    assert report.snapshots == [filled.root, filled.child]
    assert [(p.snapshot_id, p.reason) for p in report.skipped] == [(salted, "scope")]
    assert "before" in report.skipped[0].message
    assert store.snapshot(salted).state == "ready"


def test_import_refuses_a_damaged_file_and_its_descendants(filled: Filled,
                                                           tmp_path: Path) -> None:
    dest = tmp_path / "export"
    admin.export_model(filled.store, "tiny-llama", str(dest))
    root_key = json.loads((dest / transfer.MANIFEST).read_text())["snapshots"][0]
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
    child = json.loads((dest / transfer.MANIFEST).read_text())["snapshots"][1]
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
    path = dst / transfer.MANIFEST
    doc = json.loads(path.read_text())
    if callable(edit):
        edit(doc)
        path.write_text(json.dumps(doc))
    else:
        path.write_text(str(edit))
    return str(dst)


@pytest.mark.parametrize("edit", [
    "{not json",
    lambda d: d.update(version=3),
    lambda d: d.update(version=True),
    lambda d: d.update(version="2"),
    lambda d: d.update(format="pickle"),
    lambda d: d["model"]["identity"].update(num_layers=3),
    lambda d: d["snapshots"].reverse(),  # child before its parent
    lambda d: d["snapshots"][0].update(extra=1),
    lambda d: d["snapshots"][0]["segments"][0].update(key="../../etc/passwd"),
    lambda d: d["snapshots"][0]["segments"][0].update(nbytes="12"),
    lambda d: d["snapshots"][1].update(start_token=4),
    lambda d: d["snapshots"][0].pop("breakpoints"),
    lambda d: d["snapshots"][0].update(breakpoints=[6]),  # not on a block boundary
    lambda d: d["snapshots"][0].update(breakpoints=[32]),  # the end is no breakpoint
    lambda d: d["snapshots"][0].update(breakpoints=[8, 4]),
    lambda d: d["snapshots"][0].update(breakpoints=[0]),
    lambda d: d["snapshots"][0].update(breakpoints=[4.0]),
    lambda d: d["snapshots"][0].update(breakpoints=None),
    lambda d: d.update(version=1),  # a version 1 entry has no breakpoints nor scope
    lambda d: d["snapshots"][0].pop("scope"),
    lambda d: d["snapshots"][0].update(scope=None),
    lambda d: d["snapshots"][0].update(scope={"cache_salt": "s"}),
    lambda d: d["snapshots"][0]["scope"].update(extra=1),
    lambda d: d["snapshots"][0]["scope"].update(lora=7),
    lambda d: d["snapshots"][0]["scope"].update(mm="ab"),
    lambda d: d["snapshots"][0]["scope"].update(mm=[1]),
    lambda d: d["snapshots"][1]["scope"].update(cache_salt="s"),  # not its parent's scope
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


def test_import_from_a_missing_folder_does_not_create_it(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path / "target") as target:
        for src in (str(tmp_path / "nope"), (tmp_path / "nope").as_uri()):
            with pytest.raises(NotFound, match="not a sparkcache export"):
                admin.import_model(target, src)
    assert not (tmp_path / "nope").exists()


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


def _with_tokens(data: bytes, digest: str, toks: np.ndarray) -> tuple[bytes, str]:
    """A segment file whose header is whole and consistent (every chunk digest
    right) but holds other token ids: what only the ranks' agreement can tell."""
    header = seg.parse_header(memoryview(data), digest)
    made_by_build = {"format", "n_layers", "chunk_bytes", "chunks", "dtype", "page_shape"}
    meta = {k: v for k, v in header.meta.items() if k not in made_by_build}
    layers = [np.frombuffer(data, np.uint8, count=n, offset=o)
              for o, n in (header.tensors[f"layer.{i}"] for i in range(header.n_layers))]
    head, new_digest = seg.build_header(meta, layers, toks, header.meta["page_shape"],
                                        header.meta["dtype"])
    return head + b"".join(x.tobytes() for x in layers) + toks.tobytes(), new_digest


def test_import_refuses_ranks_that_disagree_on_the_token_ids(tmp_path: Path) -> None:
    ident, toks = identity(world=2), tokens(32)
    with SnapshotStore(tmp_path / "a", alias_stride=16) as a, \
            SnapshotStore(tmp_path / "b", alias_stride=16) as b:
        for rank in (0, 1):
            sid = a.publish(ident, rank, toks, pages_for(ident, toks, rank=rank)).snapshot_id
        admin.export_model(a, ident.digest()[:8], str(tmp_path / "x"))
        other = toks.copy()
        other[-1] += 1

        def rank1_other_tokens(doc: dict) -> None:  # type: ignore[type-arg]
            g = doc["snapshots"][0]["segments"][1]
            path = tmp_path / "y" / g["key"]
            data, g["digest"] = _with_tokens(path.read_bytes(), g["digest"], other)
            path.unlink()
            path.write_bytes(data)
            g["nbytes"] = len(data)

        report = admin.import_model(b, _manifest_variant(tmp_path / "x", tmp_path / "y",
                                                         rank1_other_tokens))
        assert report.imported == []
        assert [(p.snapshot_id, p.rank, p.reason) for p in report.refused] == [(sid, 1, "tokens")]
        assert "disagree on the token ids" in report.refused[0].message
        assert b.snapshots() == []


def test_import_into_a_store_whose_retention_refuses(filled: Filled, tmp_path: Path) -> None:
    admin.export_model(filled.store, "tiny-llama", str(tmp_path / "x"))
    settings = RetentionSettings(folder=tmp_path, min_tokens=1000, min_free_mb=0)
    retention = Retention(settings, disk_usage=lambda p: DiskUsage(100 * GB, 50 * GB))
    with SnapshotStore(tmp_path / "target", retention=retention) as target:
        report = admin.import_model(target, str(tmp_path / "x"))
        assert [(p.snapshot_id, p.reason) for p in report.refused] == [
            (filled.root, "retention"), (filled.child, "parent")]
        assert "MIN_TOKENS" in report.refused[0].message


# -- what a snapshot carries besides its bytes ----------------------------------------------


def _prompt(toks: np.ndarray, shared: int, n: int = 56) -> np.ndarray:
    """A prompt of ``n`` tokens sharing its first ``shared`` with ``toks``, then elsewhere."""
    return np.concatenate([toks[:shared], tokens(n - shared, seed=99) + 60_000]).astype(np.uint32)


def test_breakpoints_survive_export_and_import(tmp_path: Path) -> None:
    ident, toks = identity(), tokens(64)
    # No stride aliases below 256 tokens: only the breakpoints let a shorter prefix hit.
    with SnapshotStore(tmp_path / "a") as a, SnapshotStore(tmp_path / "b") as b:
        root = a.publish(ident, 0, toks[:32], pages_for(ident, toks[:32]),
                         breakpoints=[12]).snapshot_id
        a.publish(ident, 0, toks, pages_for(ident, toks, start=32), parent=root,
                  breakpoints=[8, 44, 45])
        admin.export_model(a, "tiny-llama", str(tmp_path / "x"))
        manifest = json.loads((tmp_path / "x" / transfer.MANIFEST).read_text())
        assert [s["breakpoints"] for s in manifest["snapshots"]] == [[12], [8, 44]]
        admin.import_model(b, str(tmp_path / "x"))
        for shared in (8, 12, 44):
            prompt = _prompt(toks, shared)
            want, got = a.lookup(ident, prompt), b.lookup(ident, prompt)
            assert want is not None and want.n_tokens == shared
            assert got is not None and got.n_tokens == shared, shared
            assert all(np.array_equal(x, y) for x, y in zip(a.read(want, 0), b.read(got, 0),
                                                             strict=True))


def test_a_version_1_export_still_imports(tmp_path: Path) -> None:
    ident, toks = identity(), tokens(64)
    with SnapshotStore(tmp_path / "a") as a, SnapshotStore(tmp_path / "b") as b:
        root = a.publish(ident, 0, toks[:32], pages_for(ident, toks[:32]),
                         breakpoints=[12]).snapshot_id
        a.publish(ident, 0, toks, pages_for(ident, toks, start=32), parent=root)
        admin.export_model(a, "tiny-llama", str(tmp_path / "x"))

        def as_version_1(doc: dict) -> None:
            doc["version"] = 1
            for snap in doc["snapshots"]:
                del snap["breakpoints"], snap["scope"]

        old = _manifest_variant(tmp_path / "x", tmp_path / "v1", as_version_1)
        report = admin.import_model(b, old)
        assert len(report.imported) == 2 and report.refused == []
        for want, got in zip(restored(a, ident, toks), restored(b, ident, toks), strict=True):
            assert np.array_equal(want, got)
        assert b.lookup(ident, _prompt(toks, 12)) is None  # version 1 knew no breakpoints


# -- a failed import leaves no store behind -------------------------------------------------


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_failed_import_creates_no_store(filled: Filled, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFound, match="export"):
        transfer.import_into(tmp_path / "new" / "store", str(tmp_path / "empty"))
    assert not (tmp_path / "new").exists()
    admin.export_model(filled.store, "tiny-llama", str(tmp_path / "x"))
    bad = _manifest_variant(tmp_path / "x", tmp_path / "bad", lambda d: d.update(version=9))
    with pytest.raises(InvalidArgument, match="manifest"):
        transfer.import_into(tmp_path / "new", bad)
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()  # a folder that exists stays, without a store in it
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgument, match="manifest"):
        transfer.import_into(tmp_path / "mine", bad)
    assert _files(tmp_path / "mine") == ["notes.txt"]


def test_an_import_that_imports_nothing_creates_no_store(filled: Filled,
                                                         tmp_path: Path) -> None:
    admin.export_model(filled.store, "tiny-llama", str(tmp_path / "x"))
    root_key = json.loads((tmp_path / "x" / transfer.MANIFEST).read_text())["snapshots"][0]
    flip_byte(tmp_path / "x" / root_key["segments"][0]["key"])
    report = transfer.import_into(tmp_path / "new", str(tmp_path / "x"))
    assert report.imported == [] and len(report.refused) == 2
    assert not (tmp_path / "new").exists()


def test_a_failed_import_keeps_an_existing_store(filled: Filled, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFound):
        transfer.import_into(filled.store.root, str(tmp_path / "empty"))
    assert len(filled.store.snapshots()) == 3
    with SnapshotStore(tmp_path / "kept") as kept:
        assert kept.snapshots() == []
    with pytest.raises(NotFound):
        transfer.import_into(tmp_path / "kept", str(tmp_path / "empty"))
    assert (tmp_path / "kept" / "index.sqlite").is_file()


def test_import_into_a_new_folder(filled: Filled, tmp_path: Path) -> None:
    admin.export_model(filled.store, "tiny-llama", str(tmp_path / "x"))
    report = transfer.import_into(tmp_path / "new" / "store", str(tmp_path / "x"))
    assert [i.source_id for i in report.imported] == [filled.root, filled.child]
    with SnapshotStore(tmp_path / "new" / "store") as store:
        for want, got in zip(restored(filled.store, filled.ident, filled.toks),
                             restored(store, filled.ident, filled.toks), strict=True):
            assert np.array_equal(want, got)


def test_the_import_command_leaves_no_store_when_it_fails(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    (tmp_path / "broken").mkdir()
    assert main(["--folder", str(tmp_path / "new"), "import", str(tmp_path / "broken")]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


# -- request scopes ---------------------------------------------------------------------------

SCOPE = RequestScope(cache_salt="salt", lora="adapter-1", mm_hashes=("ab12", "cd34"))


def test_publish_records_the_scope(tmp_path: Path) -> None:
    ident, toks = identity(), tokens(32)
    with SnapshotStore(tmp_path / "a") as a:
        scoped = a.publish(ident, 0, toks, pages_for(ident, toks), scope=SCOPE).snapshot_id
        plain = a.publish(ident, 0, toks, pages_for(ident, toks)).snapshot_id
        assert a.snapshot(scoped).scope_json == SCOPE.canonical()
        assert a.snapshot(plain).scope_json == RequestScope().canonical()


def test_a_child_must_have_its_parents_scope(tmp_path: Path) -> None:
    ident, toks = identity(), tokens(64)
    with SnapshotStore(tmp_path / "a") as a:
        root = a.publish(ident, 0, toks[:32], pages_for(ident, toks[:32]),
                         scope=SCOPE).snapshot_id
        for scope in (None, RequestScope(cache_salt="salt")):
            with pytest.raises(InvalidArgument, match="scope"):
                a.publish(ident, 0, toks, pages_for(ident, toks, start=32), parent=root,
                          scope=scope)
        child = a.publish(ident, 0, toks, pages_for(ident, toks, start=32), parent=root,
                          scope=SCOPE).snapshot_id
        assert a.snapshot(child).scope_json == SCOPE.canonical()


def _scoped_store(a: SnapshotStore, ident: ModelIdentity, toks: np.ndarray) -> list[int]:
    root = a.publish(ident, 0, toks[:32], pages_for(ident, toks[:32]), scope=SCOPE,
                     breakpoints=[12]).snapshot_id
    plain = a.publish(ident, 0, toks[:16], pages_for(ident, toks[:16])).snapshot_id
    child = a.publish(ident, 0, toks, pages_for(ident, toks, start=32), parent=root,
                      scope=SCOPE).snapshot_id
    return [root, plain, child]


def test_scoped_snapshots_export_and_import_with_their_scope(tmp_path: Path) -> None:
    ident, toks = identity(), tokens(64)
    with SnapshotStore(tmp_path / "a") as a, SnapshotStore(tmp_path / "b") as b:
        ids = _scoped_store(a, ident, toks)
        report = admin.export_model(a, "tiny-llama", str(tmp_path / "x"))
        assert report.snapshots == ids and report.skipped == []
        manifest = json.loads((tmp_path / "x" / transfer.MANIFEST).read_text())
        scopes = [s["scope"] for s in manifest["snapshots"]]
        assert scopes == [json.loads(SCOPE.canonical()), json.loads(RequestScope().canonical()),
                          json.loads(SCOPE.canonical())]
        imported = admin.import_model(b, str(tmp_path / "x"))
        assert [i.source_id for i in imported.imported] == ids and imported.refused == []
        assert [b.snapshot(i.id).scope_json for i in imported.imported] == [
            SCOPE.canonical(), RequestScope().canonical(), SCOPE.canonical()]
        for scope, shared, n in ((SCOPE, 64, 64), (SCOPE, 12, 12), (None, 64, 16)):
            prompt = toks if shared == 64 else _prompt(toks, shared)
            want = a.lookup(ident, prompt, scope=scope)
            got = b.lookup(ident, prompt, scope=scope)
            assert want is not None and got is not None and want.n_tokens == got.n_tokens == n
            assert all(np.array_equal(x, y) for x, y in zip(a.read(want, 0), b.read(got, 0),
                                                             strict=True))
        assert b.lookup(ident, toks, scope=RequestScope(cache_salt="salt")) is None


def test_import_checks_the_key_against_the_scope(tmp_path: Path) -> None:
    ident, toks = identity(), tokens(64)
    with SnapshotStore(tmp_path / "a") as a, SnapshotStore(tmp_path / "b") as b:
        root, plain, child = _scoped_store(a, ident, toks)
        admin.export_model(a, "tiny-llama", str(tmp_path / "x"))

        def other_salt(doc: dict) -> None:  # a consistent edit: parent and child alike
            for snap in doc["snapshots"]:
                if snap["scope"]["cache_salt"] == "salt":
                    snap["scope"]["cache_salt"] = "pepper"

        edited = _manifest_variant(tmp_path / "x", tmp_path / "edited", other_salt)
        report = admin.import_model(b, edited)
        assert [i.source_id for i in report.imported] == [plain]
        assert [(p.snapshot_id, p.reason) for p in report.refused] == [
            (root, "scope"), (child, "parent")]


# -- S3 (moto's server on 127.0.0.1, when moto and s3fs are installed) ------------------------


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """An S3 filesystem talking to moto's server, which a bare ``s3://`` URL reaches too."""
    server_module = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec caches instances, not the environment
    try:
        yield fsspec.filesystem("s3")
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def test_export_to_s3_needs_an_existing_bucket(filled: Filled, tmp_path: Path, s3: Any) -> None:
    with pytest.raises(NotFound, match="bucket 'missing' does not exist"):
        admin.export_model(filled.store, "tiny-llama", "s3://missing/backups/llama")
    assert not s3.exists("missing")
    s3.mkdir("backups")
    s3.pipe("backups/taken/notes.txt", b"mine")
    with pytest.raises(InvalidArgument, match="not empty"):
        admin.export_model(filled.store, "tiny-llama", "s3://backups/taken")
    _roundtrip(filled, "s3://backups/llama", tmp_path)
    assert s3.isfile(f"backups/llama/{transfer.MANIFEST}")


def test_a_deeply_nested_manifest_is_invalid_not_a_recursion_error(tmp_path: Path) -> None:
    src = tmp_path / "deep"
    src.mkdir()
    (src / transfer.MANIFEST).write_text("[" * 200_000 + "]" * 200_000)
    with SnapshotStore(tmp_path / "target") as target, \
            pytest.raises(InvalidArgument, match="nested too deeply"):
        admin.import_model(target, str(src))
