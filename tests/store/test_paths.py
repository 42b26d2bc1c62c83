"""Hostile names never reach a path: every file the store makes stays under its root.

Model names, revisions and cache salts are hashed into digests; only digests,
integers and nonces are ever joined into a path.  These tests feed names that
would escape a naive join (``..``, ``/``, absolute paths, NUL, 10,000 characters,
unicode) and walk the whole temporary folder before and after: nothing new may
appear outside the store root.  Also: a relative root, and payloads behind
``memory://`` and ``file://`` storage URLs.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sparkcache import InvalidArgument, RequestScope, SnapshotStore
from sparkcache.backends import FsspecBackend
from sparkcache.identity import ModelIdentity

from .helpers import identity, pages_for, tokens

HOSTILE = [
    "..",
    "../..",
    "../../etc",
    "../../../../../../../../tmp/sparkcache-escape",
    "a/../../b",
    "/",
    "//",
    "/etc/passwd",
    "C:\\Windows\\..\\..",
    "./.",
    "~root",
    "$HOME/x",
    "%2e%2e%2f%2e%2e",
    "line\nbreak\r\ttab",
    "ünïcødé 模型 🚀 \u202e",
    "x" * 4096,  # the longest model name an identity accepts
]
ABSOLUTE = "@abs"  # replaced by an absolute path inside tmp_path


def _tree(top: Path) -> set[Path]:
    out: set[Path] = set()
    for folder, dirs, files in os.walk(top):
        out.update(Path(folder, name) for name in (*dirs, *files))
    return out


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Path]]:
    """A root deep inside tmp_path (so '../..' escapes would still land where we look),
    and the working directory set to a sibling folder (relative escapes land there)."""
    root = tmp_path / "l1" / "l2" / "l3" / "l4" / "l5" / "store"
    root.parent.mkdir(parents=True)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield {"tmp": tmp_path, "root": root, "cwd": cwd}


def _roundtrip(store: SnapshotStore, ident: ModelIdentity, scope: RequestScope | None) -> None:
    toks = tokens(40)
    first = store.publish(ident, 0, toks[:24], pages_for(ident, toks[:24]), scope=scope)
    res = store.publish(ident, 0, toks, pages_for(ident, toks, start=24), scope=scope,
                        parent=first.snapshot_id)
    assert res.state == "ready"
    m = store.lookup(ident, toks, scope=scope)
    assert m is not None and m.n_tokens == 40
    got = store.read(m, 0)
    assert all(np.array_equal(g, w) for g, w in zip(got, pages_for(ident, toks), strict=True))
    # another scope (or none) never sees it
    assert store.lookup(ident, toks, scope=RequestScope(cache_salt="other")) is None
    if scope is not None:
        assert store.lookup(ident, toks) is None


def _check_contained(layout: dict[str, Path], before: set[Path], also_absent: Path) -> None:
    root = layout["root"]
    new = _tree(layout["tmp"]) - before
    outside = sorted(p for p in new if not p.is_relative_to(root))
    assert not outside, f"created outside the store root: {outside}"
    assert not also_absent.exists()
    assert not Path("/tmp/sparkcache-escape").exists()
    # every file in the store is the index or a digest-named object
    for path in _tree(root):
        rel = path.relative_to(root).as_posix()
        assert rel.startswith(("index.sqlite", "index.reserve", "objects")), rel
        assert rel.isascii() and ".." not in rel.split("/"), rel


@pytest.mark.parametrize("name", [*HOSTILE, ABSOLUTE], ids=lambda n: repr(n[:40]))
def test_hostile_model_name_stays_inside_root(layout: dict[str, Path], name: str) -> None:
    target = layout["tmp"] / "absolute-target"
    name = str(target) if name == ABSOLUTE else name
    before = _tree(layout["tmp"])
    with SnapshotStore(layout["root"], alias_stride=16) as store:
        ident = identity(model=name)
        _roundtrip(store, ident, None)
        assert {i.model_id for i in store.snapshots(ident)} == {1}
        assert store.check().clean
    _check_contained(layout, before, target)


@pytest.mark.parametrize("name", [*HOSTILE, ABSOLUTE, "x" * 10_000, "salt\x00with NUL"],
                         ids=lambda n: repr(n[:40]))
def test_hostile_cache_salt_stays_inside_root(layout: dict[str, Path], name: str) -> None:
    target = layout["tmp"] / "absolute-target"
    name = str(target) if name == ABSOLUTE else name
    before = _tree(layout["tmp"])
    with SnapshotStore(layout["root"], alias_stride=16) as store:
        ident = identity()
        try:
            scope = RequestScope(cache_salt=name, lora=name)
        except InvalidArgument:
            assert "\x00" in name  # only NUL may be refused
            return
        _roundtrip(store, ident, scope)
        if "\x00" in name:  # the salt is not cut at the NUL
            cut = RequestScope(cache_salt=name.split("\x00")[0], lora=name)
            assert store.lookup(ident, tokens(40), scope=cut) is None
        assert store.check().clean
    _check_contained(layout, before, target)


@pytest.mark.parametrize("name", ["a\x00b", "\x00", "../\x00/etc"], ids=repr)
def test_nul_in_model_name_is_refused(name: str) -> None:
    with pytest.raises(InvalidArgument, match="NUL"):
        identity(model=name)


def test_ten_thousand_character_model_name_is_refused_with_the_limit() -> None:
    with pytest.raises(InvalidArgument, match="4096"):
        identity(model="m" * 10_000)


def test_relative_root(layout: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    ident = identity()
    toks = tokens(32)
    elsewhere = layout["tmp"] / "elsewhere"
    elsewhere.mkdir()
    before = _tree(layout["tmp"])
    rel = os.path.relpath(layout["root"], layout["cwd"])
    assert not os.path.isabs(rel)
    store = SnapshotStore(rel, alias_stride=16)
    try:
        store.publish(ident, 0, toks, pages_for(ident, toks))
        # Moving the working directory must not move the store.
        monkeypatch.chdir(elsewhere)
        more = tokens(16, seed=3)
        store.publish(ident, 0, more, pages_for(ident, more))
        for t in (toks, more):
            m = store.lookup(ident, t)
            assert m is not None and m.n_tokens == len(t)
            assert np.array_equal(store.read(m, 0)[1], pages_for(ident, t)[1])
        assert store.check().clean
    finally:
        store.close()
    assert list(elsewhere.iterdir()) == []
    monkeypatch.chdir(layout["cwd"])
    with SnapshotStore(rel) as again:
        assert again.alias_stride == 16 and len(again.snapshots()) == 2
        m = again.lookup(ident, toks)
        assert m is not None and m.n_tokens == 32
    _check_contained(layout, before, layout["tmp"] / "absent")


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_storage_url_roundtrip(tmp_path: Path, scheme: str) -> None:
    if scheme == "memory":
        url = f"memory://sparkcache-test-{uuid.uuid4().hex}"
    else:
        payloads = tmp_path / "payloads"
        payloads.mkdir()
        url = f"file://{payloads}"
    index_root = tmp_path / "index"
    ident = identity()
    toks = tokens(48)
    store = SnapshotStore(index_root, storage=url, alias_stride=16)
    try:
        assert isinstance(store.backend, FsspecBackend)
        _roundtrip(store, ident, RequestScope(cache_salt="../s"))
        plain = store.publish(ident, 0, toks, pages_for(ident, toks))
        keys = sorted(store.backend.list("objects"))
        assert len(keys) == 3
        if scheme == "file":
            on_disk = {p.relative_to(payloads).as_posix() for p in _tree(payloads) if p.is_file()}
            assert on_disk == set(keys)
        assert not (index_root / "objects").exists()  # payloads went to the URL only
        assert store.check().clean
        store.close()
        # Reopened on the same URL: everything is still there.
        store = SnapshotStore(index_root, storage=url)
        m = store.lookup(ident, toks)
        assert m is not None and m.n_tokens == 48
        assert all(np.array_equal(g, w)
                   for g, w in zip(store.read(m, 0), pages_for(ident, toks), strict=True))
        store.delete(plain.snapshot_id)
        assert len(list(store.backend.list("objects"))) == 2
        assert store.evict(count=10) and list(store.backend.list("objects")) == []
        assert store.check().clean
    finally:
        backend = store.backend
        store.close()
        if scheme == "memory":
            assert isinstance(backend, FsspecBackend)
            backend.fs.rm(url, recursive=True)
