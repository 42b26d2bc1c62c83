"""Uploads to a shared tier (moto's S3 server, and a file:// folder): parents first,
every rank, idempotent, the manifest last, two hosts at once, corrupt files kept home."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from sparkcache import ModelIdentity, RequestScope, SnapshotStore
from sparkcache import segment as seg
from sparkcache.errors import BackendError
from sparkcache.hashing import prefix_hashes, prefix_seed
from sparkcache.shared import SharedTier, parse_manifest, pending_uploads, upload_snapshot
from sparkcache.shared.layout import (
    alias_key,
    manifest_key,
    model_key,
    parse_alias,
    segment_key,
)

from ..s3server import s3_calls
from ..store.helpers import identity, pages_for, tokens
from .conftest import Tier

HostFactory = Callable[..., SnapshotStore]
WRITES = ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload",
          "CopyObject")


def objects(tier: SharedTier) -> dict[str, bytes]:
    """Every object of the tier, with its bytes."""
    out = {}
    for key in sorted(tier.backend.list()):
        with tier.backend.open(key) as blob:
            out[key] = bytes(blob.buffer)
    return out


def publish_chain(store: SnapshotStore, *, world: int = 1, seed: int = 1,
                  scope: RequestScope | None = None, rank_salt: int = 0) -> list[int]:
    """A root of 32 tokens and its child of 64 (copy-on-write), every rank."""
    ident = identity(world=world)
    toks = tokens(64, seed=seed)
    ids = []
    parent = None
    for n, start in ((32, 0), (64, 32)):
        for rank in range(world):
            result = store.publish(ident, rank, toks[:n],
                                   pages_for(ident, toks[:n], rank + rank_salt, start=start),
                                   parent=parent, scope=scope)
        assert result.state == "ready"
        parent = result.snapshot_id
        ids.append(result.snapshot_id)
    return ids


def test_a_chain_goes_parent_first_with_every_rank(tier: Tier, host: HostFactory) -> None:
    store = host("a", tier)
    root, child = publish_chain(store, world=2, scope=RequestScope(cache_salt="salt"))
    assert store.shared is not None
    assert pending_uploads(store._core) == 2
    assert upload_snapshot(store._core, store.shared, child).outcome == "waiting"
    report = store.upload()
    assert (report.uploaded, report.error, report.pending) == ([root, child], None, 0)
    assert all(store.snapshot(s).uploaded_at is not None for s in (root, child))
    ident = identity(world=2)
    model = ident.digest()
    found = objects(store.shared)
    snap = {s: store.snapshot(s) for s in (root, child)}
    m_root = parse_manifest(found[manifest_key(model, snap[root].snap_key)], model,
                            snap[root].snap_key)
    m_child = parse_manifest(found[manifest_key(model, snap[child].snap_key)], model,
                             snap[child].snap_key)
    assert (m_root.parent, m_root.start_token, m_root.n_tokens) == (None, 0, 32)
    assert (m_child.parent, m_child.start_token, m_child.n_tokens) == (
        snap[root].snap_key, 32, 64)  # the chain, by the parent's end prefix hash
    assert m_child.scope == RequestScope(cache_salt="salt")
    assert found[model_key(model)] == ident.canonical().encode()
    for m, sid in ((m_root, root), (m_child, child)):
        with store._core.read() as conn:
            local = store._core.segments(conn, sid)
        assert [(g.rank, g.nbytes, g.digest) for g in m.segments] == [
            (g.rank, g.nbytes, g.digest) for g in local]
        for g, entry in zip(local, m.segments, strict=True):
            with store.backend.open(g.object_key) as blob:
                assert found[entry.key] == bytes(blob.buffer)  # the same bytes
    # aliases every 16 tokens (4 blocks), each naming the first snapshot that holds it
    hashes = prefix_hashes(prefix_seed(ident, RequestScope(cache_salt="salt")),
                           tokens(64, seed=1), ident.block_size)
    for n in (16, 32, 48, 64):
        alias = parse_alias(found[alias_key(model, hashes[n // 4 - 1].hex())],
                            hashes[n // 4 - 1].hex())
        assert (alias.n_tokens, alias.snapshot) == (
            n, snap[root if n <= 32 else child].snap_key)
    assert sorted(m_child.aliases) == [(48, hashes[11].hex()), (64, hashes[15].hex())]
    assert store.stats()["uploads"] == 2
    assert not [k for k in found if ".tmp." in k]


def test_a_second_upload_sends_nothing(s3_tier: Tier, host: HostFactory) -> None:
    """Idempotent: a snapshot whose manifest is there is not sent again, by this
    host (uploaded_at forgotten) or another one holding the same prefix; only
    its use record is rewritten."""
    a = host("a", s3_tier)
    publish_chain(a)
    assert a.shared is not None
    assert len(a.upload().uploaded) == 2
    before = objects(a.shared)
    with a._core.write() as conn:
        conn.execute("UPDATE snapshots SET uploaded_at = NULL")
    b = host("b", s3_tier)
    publish_chain(b)  # the same prefix on another host: the same bytes
    with s3_calls(a.shared.backend.fs) as calls:
        for store in (a, b):
            report = store.upload()
            assert (report.uploaded, len(report.present), report.objects_put) == ([], 2, 0)
    # One manifest HEAD per snapshot, and the only writes are the use records
    # (the snapshot is in use again: its age in the tier restarts).
    assert calls["HeadObject"] == 4 and calls["PutObject"] == 4
    assert not (set(WRITES) - {"PutObject"}) & set(calls)
    after = objects(a.shared)
    assert {k: v for k, v in after.items() if "/used/" not in k} == before
    assert len([k for k in after if "/used/" in k]) == 2
    assert b.stats()["uploads.present"] == 2


def test_a_retry_sends_only_what_is_missing(tier: Tier, host: HostFactory,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure between the segments and the manifest leaves the snapshot
    invisible (no manifest, nothing local changed); the retry sends the rest."""
    store = host("a", tier)
    root, _child = publish_chain(store)
    assert store.shared is not None
    real_put = store.shared.put

    def failing_put(key: str, chunks):  # type: ignore[no-untyped-def]
        if "/snap/" in key:
            raise BackendError(f"writing {key} failed: the connection dropped")
        return real_put(key, chunks)

    monkeypatch.setattr(store.shared, "put", failing_put)
    report = store.upload()
    assert report.error is not None and "connection dropped" in report.error
    assert report.pending == 2 and report.uploaded == []
    assert store.snapshot(root).uploaded_at is None
    left = objects(store.shared)
    assert not [k for k in left if "/snap/" in k]  # nothing visible
    assert [k for k in left if "/seg/" in k]  # but the segments went
    assert store.stats()["upload_failures"] == 1
    with store._core.read() as conn:  # the upload lease went with the failure
        assert [x for x in store._core.leases(conn, root) if x.kind == "upload"] == []
    monkeypatch.undo()
    before = store.shared.counts["puts"]
    report = store.upload()
    assert len(report.uploaded) == 2 and report.error is None
    # root: its manifest only; child: segment, 2 aliases, manifest
    assert store.shared.counts["puts"] - before == 1 + 4


def test_two_hosts_uploading_the_same_prefix_at_once_agree(
        tier: Tier, host: HostFactory) -> None:
    stores = [host(name, tier) for name in ("a", "b", "c")]
    for store in stores:
        publish_chain(store)
    barrier = threading.Barrier(len(stores))
    reports = []

    def run(store: SnapshotStore) -> None:
        barrier.wait()
        reports.append(store.upload())

    threads = [threading.Thread(target=run, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.error for r in reports] == [None] * 3
    assert all(s.snapshot(i).uploaded_at is not None for s in stores for i in (1, 2))
    alone = host("alone", Tier(*_new_like(tier)))  # the same prefix uploaded by one host
    publish_chain(alone)
    alone.upload()
    assert stores[0].shared is not None and alone.shared is not None
    # the same objects, but for the use records of the hosts that found a snapshot there
    assert {k: v for k, v in objects(stores[0].shared).items() if "/used/" not in k} \
        == objects(alone.shared)


def _new_like(tier: Tier) -> tuple[str, dict[str, object]]:
    """A new, empty tier of the same kind."""
    if tier.server is not None:
        return f"s3://{tier.server.bucket()}/kv", tier.options
    folder = Path(tier.url.removeprefix("file://") + "-alone")
    folder.mkdir()
    return f"file://{folder}", {}


def test_other_bytes_for_the_same_prefix_never_mix(tier: Tier, host: HostFactory) -> None:
    """Two hosts whose KV bytes differ for one prefix write different segment keys;
    each manifest names one host's segments, whole, whichever wins."""
    a, b = host("a", tier), host("b", tier)
    publish_chain(a)
    publish_chain(b, rank_salt=7)  # the same tokens, other bytes
    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=lambda s=s: (barrier.wait(), s.upload()))
               for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert a.shared is not None
    found = objects(a.shared)
    model = identity().digest()
    # Two versions of each snapshot's segment, or of the child's only: a host that
    # finds the root's manifest there sends no root of its own.
    assert len([k for k in found if "/seg/" in k]) in (3, 4)
    for snap in (a.snapshot(1), a.snapshot(2)):
        m = parse_manifest(found[manifest_key(model, snap.snap_key)], model, snap.snap_key)
        (entry,) = m.segments
        raw = found[entry.key]
        header = seg.parse_header(memoryview(raw), entry.digest)  # whole and as named
        assert header.token_end == snap.n_tokens and len(raw) == entry.nbytes


def test_a_corrupt_segment_is_quarantined_not_uploaded(tier: Tier, host: HostFactory) -> None:
    store = host("a", tier)
    root, child = publish_chain(store)
    with store._core.read() as conn:
        (g,) = store._core.segments(conn, child)
    path = store.root / g.object_key
    data = bytearray(path.read_bytes())
    data[-300] ^= 0xFF  # a payload byte
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    report = store.upload()
    assert report.uploaded == [root] and [r.snapshot_id for r in report.refused] == [child]
    assert store.snapshot(child).state == "quarantined"
    assert store.shared is not None
    model = identity().digest()
    child_key = store.snapshot(child).snap_key
    assert not store.shared.exists(manifest_key(model, child_key))
    assert not store.shared.exists(segment_key(model, child_key, 0, str(g.digest)))
    assert pending_uploads(store._core) == 0


def test_a_snapshot_evicted_meanwhile_is_gone(tier: Tier, host: HostFactory) -> None:
    store = host("a", tier)
    root, child = publish_chain(store)
    store.delete(child)
    assert store.shared is not None
    assert upload_snapshot(store._core, store.shared, child).outcome == "gone"
    assert store.upload().uploaded == [root]


def test_a_large_segment_goes_in_parts(s3_tier: Tier, host: HostFactory) -> None:
    """Past the block size an upload is multipart, from the mapped file in slices."""
    store = host("a", Tier(s3_tier.url, {**s3_tier.options, "default_block_size": 5 << 20}))
    ident = ModelIdentity(model="big", revision="r1", num_layers=2, num_kv_heads=2,
                          head_size=8, dtype="float16", kv_cache_dtype="float16",
                          block_size=16, page_shape=(2, 16, 1024))
    blocks = (12 << 20) // (ident.page_nbytes * 2)  # 12 MiB over two layers
    toks = tokens(blocks * 16, seed=9)
    rng = np.random.default_rng(9)
    store.publish(ident, 0, toks, [rng.integers(0, 256, (blocks, ident.page_nbytes),
                                                dtype=np.uint8) for _ in range(2)])
    assert store.shared is not None
    with s3_calls(store.shared.backend.fs) as calls:
        assert store.upload().uploaded == [1]
    assert calls["UploadPart"] >= 2 and calls["CompleteMultipartUpload"] == 1
    with store._core.read() as conn:
        (g,) = store._core.segments(conn, 1)
    key = segment_key(ident.digest(), store.snapshot(1).snap_key, 0, str(g.digest))
    assert g.nbytes > 12 << 20
    with store.backend.open(g.object_key) as local, store.shared.backend.open(key) as remote:
        assert np.array_equal(np.frombuffer(local.buffer, np.uint8),
                              np.frombuffer(remote.buffer, np.uint8))


CRASH = """
import json, os, sys
from sparkcache import SnapshotStore
from sparkcache.shared import tier as tier_module
args = json.loads(sys.argv[1])
real_put = tier_module.SharedTier.put
def put(self, key, chunks):
    if "/snap/" in key:
        os._exit(9)  # killed between the segments and the manifest
    return real_put(self, key, chunks)
tier_module.SharedTier.put = put
store = SnapshotStore(args["folder"], shared=args["url"], shared_options=args["options"])
store.upload()
"""


def test_a_process_killed_before_the_manifest_leaves_nothing_visible(
        tier: Tier, host: HostFactory, tmp_path: Path) -> None:
    """A real process dies between the segments and the manifest: the snapshot is
    not in the tier, nothing local says it is, and the next upload completes it."""
    store = host("a", tier)
    root, child = publish_chain(store)
    store.close()
    args = {"folder": str(tmp_path / "a"), "url": tier.url, "options": tier.options}
    done = subprocess.run([sys.executable, "-c", CRASH, json.dumps(args)], timeout=120,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 9, done.stderr
    again = host("a2", tier)  # a look at the tier from elsewhere
    assert again.shared is not None
    found = objects(again.shared)
    assert [k for k in found if "/seg/" in k] and not [k for k in found if "/snap/" in k]
    with SnapshotStore(tmp_path / "a", shared=tier.url, shared_options=tier.options) as store:
        assert store.snapshot(root).uploaded_at is None
        report = store.upload()  # the dead process's upload lease blocks nothing
        assert report.uploaded == [root, child] and report.error is None
        assert store.snapshot(child).uploaded_at is not None
