"""Fetching from a shared tier (moto's S3 server, and a file:// folder): a second
host restores the first one's prefixes, verified; every fault is a clean miss."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

import numpy as np
import pytest

from sparkcache import RequestScope, SnapshotStore
from sparkcache.errors import SparkCacheError
from sparkcache.shared import SharedTier, parse_manifest, pending_uploads
from sparkcache.shared.layout import alias_key, manifest_key, used_key

from ..s3server import S3Server, s3_calls, s3_server
from ..store.helpers import identity, pages_for, tokens
from .conftest import Tier
from .test_upload import publish_chain

HostFactory = Callable[..., SnapshotStore]
IDENT = identity()
MODEL = IDENT.digest()


def uploaded(host: HostFactory, tier: Tier, name: str = "a", **kwargs: object) -> SnapshotStore:
    """Host ``name`` with a chain (root of 32 tokens, child of 64) in the tier."""
    store = host(name, tier, **kwargs)
    publish_chain(store)
    report = store.upload()
    assert (len(report.uploaded), report.error) == (2, None)
    return store


def prompt(n_shared: int, total: int = 80) -> np.ndarray:
    """The chain's first ``n_shared`` tokens, then other ones."""
    out = np.concatenate([tokens(64, seed=1)[:n_shared], tokens(total, seed=99)[n_shared:]])
    return out.astype(np.uint32)


def pages_equal(a: SnapshotStore, b: SnapshotStore, toks: np.ndarray, n: int) -> bool:
    ma, mb = a.lookup(IDENT, toks[:n]), b.lookup(IDENT, toks[:n])
    assert ma is not None and mb is not None and ma.n_tokens == mb.n_tokens == n
    return all(np.array_equal(x, y) for x, y in zip(a.read(ma, 0), b.read(mb, 0), strict=True))


def test_a_second_host_restores_the_first_ones_prefix(tier: Tier, host: HostFactory) -> None:
    a = uploaded(host, tier)
    b = host("b", tier)
    toks = prompt(64)
    assert b.lookup(IDENT, toks) is None
    result = b.fetch(IDENT, toks)
    assert (result.outcome, result.n_tokens, len(result.fetched)) == ("fetched", 64, 2)
    assert result.nbytes == sum(a.snapshot(s).nbytes for s in (1, 2))
    match = b.lookup(IDENT, toks)
    assert match is not None and match.n_tokens == 64
    assert pages_equal(a, b, toks, 64)
    assert np.array_equal(b.read(match, 0)[0], np.concatenate(
        [pages_for(IDENT, toks[:64])[0]]))  # the very rows host a computed
    # fetched snapshots are local now, and known to be in the tier: nothing to upload
    assert pending_uploads(b._core) == 0
    assert b.stats()["fetches"] == 2
    # the fetch renewed the snapshot's age in the tier (the sweep's last use)
    assert b.shared is not None and b.shared.exists(used_key(MODEL, a.snapshot(2).snap_key))
    again = b.fetch(IDENT, toks)
    assert (again.outcome, again.fetched, again.nbytes) == ("local", [], 0)


def test_a_shorter_shared_prefix_fetches_only_its_chain(tier: Tier, host: HostFactory) -> None:
    uploaded(host, tier)
    b = host("b", tier)
    toks = prompt(40)  # shares the root (32) and 8 tokens of the child
    result = b.fetch(IDENT, toks)
    assert (result.outcome, result.n_tokens, len(result.fetched)) == ("fetched", 32, 1)
    match = b.lookup(IDENT, toks)
    assert match is not None and match.n_tokens == 32


def test_probes_are_bounded_and_never_list(s3_tier: Tier, host: HostFactory) -> None:
    uploaded(host, s3_tier)
    b = host("b", s3_tier)
    assert b.shared is not None
    long = tokens(4000, seed=7).astype(np.uint32)  # 1000 blocks, 250 strides: a miss
    with s3_calls(b.shared.backend.fs) as calls:
        result = b.fetch(IDENT, long)
    assert result.outcome == "miss"
    # the first stride is not marked: nothing is, not even the end
    assert calls == {"HeadObject": 1} and result.requests == 1
    assert b.fetch(IDENT, long[:3998]).requests == 1
    assert b.fetch(IDENT, long[:12]).requests == 1  # no stride: the end only
    # a breakpoint below the first stride is probed too, none above it
    assert b.fetch(IDENT, long, breakpoints=[8, 12, 400]).requests == 1 + 2
    partial = prompt(64, total=4000)  # the chain's 64 tokens, then 3936 others
    with s3_calls(b.shared.backend.fs) as calls:
        hit = b.fetch(IDENT, partial)
    assert (hit.outcome, hit.n_tokens) == ("fetched", 64)
    # never a listing; one PUT: the use record the tier's sweep reads
    assert set(calls) == {"HeadObject", "GetObject", "PutObject"} and calls["PutObject"] == 1
    # GETs: the alias and two manifests, each after our HEAD (its size) and
    # s3fs's own; two segments streamed, each after our HEAD, in three GETs (its
    # header, its token ids, its layers); the probe: the first stride, a binary
    # search over the other 249 (the end is on a stride)
    segment_gets = 3
    assert calls["GetObject"] == 3 + 2 * segment_gets
    assert calls["HeadObject"] - 2 * 3 - 2 <= 1 + 8
    again = host("c", s3_tier).fetch(IDENT, prompt(64, total=66))  # the stored tokens
    # the first stride, then a bisection of the other three (the end is the 4th)
    # (and the use record's PUT)
    assert again.n_tokens == 64 and again.requests == 3 + 2 * 3 + 2 * (1 + segment_gets) + 1


def test_another_scope_is_a_miss(tier: Tier, host: HostFactory) -> None:
    uploaded(host, tier)
    b = host("b", tier)
    result = b.fetch(IDENT, prompt(64), scope=RequestScope(cache_salt="other"))
    assert result.outcome == "miss" and b.lookup(IDENT, prompt(64)) is None


def _child_manifest(store: SnapshotStore) -> tuple[SharedTier, object]:
    assert store.shared is not None
    key = store.snapshot(2).snap_key
    raw = store.shared.get(manifest_key(MODEL, key))
    assert raw is not None
    return store.shared, parse_manifest(raw, MODEL, key)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_segment_is_a_verified_miss(tier: Tier, host: HostFactory,
                                              damage: str) -> None:
    """A segment object flipped, cut short or gone: the link is refused (its
    parent, intact, is still fetched), never wrong KV."""
    a = uploaded(host, tier)
    shared, manifest = _child_manifest(a)
    key = manifest.segments[0].key  # type: ignore[attr-defined]
    with shared.backend.open(key) as blob:
        data = bytearray(blob.buffer)
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF  # in a layer's rows: only the chunk digest can tell
        shared.put(key, [bytes(data)])
    elif damage == "truncate":
        shared.put(key, [bytes(data[:-64])])
    else:
        shared.backend.delete(key)
    b = host("b", tier)
    result = b.fetch(IDENT, prompt(64))
    assert result.outcome == "refused" and result.n_tokens == 64, result
    assert len(result.fetched) == 1  # the root
    match = b.lookup(IDENT, prompt(64))
    assert match is not None and match.n_tokens == 32
    assert pages_equal(a, b, prompt(64), 32)
    assert b.stats()["fetch_refused"] == 1


@pytest.mark.parametrize("damage", [None, "layer", "tokens"])
def test_a_link_that_compacts_here_is_read_whole_and_verified(tier: Tier, host: HostFactory,
                                                              damage: str | None) -> None:
    """A host whose chains hold one link compacts the fetched child with its
    parent's rows, so the child's segment is downloaded whole (not streamed)
    and verified before any of it is published: a flipped byte of its rows or
    of its token ids refuses it."""
    a = uploaded(host, tier)
    shared, manifest = _child_manifest(a)
    key = manifest.segments[0].key  # type: ignore[attr-defined]
    if damage is not None:
        with shared.backend.open(key) as blob:
            data = bytearray(blob.buffer)
        data[{"layer": len(data) // 2, "tokens": len(data) - 5}[damage]] ^= 0x04
        shared.put(key, [bytes(data)])
    b = host("b", tier, max_chain=1)
    result = b.fetch(IDENT, prompt(64))
    if damage is not None:
        assert (result.outcome, len(result.fetched)) == ("refused", 1), result
        assert "digest mismatch" in str(result.reason)
        match = b.lookup(IDENT, prompt(64))
        assert match is not None and match.n_tokens == 32
        return
    assert (result.outcome, len(result.fetched)) == ("fetched", 2), result
    child = b.snapshot(result.fetched[-1])
    assert (child.parent_id, child.start_token, child.n_tokens) == (None, 0, 64)  # compacted
    assert pages_equal(a, b, prompt(64), 64)


def test_segments_without_a_manifest_are_invisible(tier: Tier, host: HostFactory) -> None:
    """An upload that died before its manifest (or a manifest swept away): its
    aliases dangle, the next shorter stride is used; without any manifest, a miss."""
    a = uploaded(host, tier)
    assert a.shared is not None
    a.shared.backend.delete(manifest_key(MODEL, a.snapshot(2).snap_key))
    b = host("b", tier)
    result = b.fetch(IDENT, prompt(64))
    assert (result.outcome, result.n_tokens) == ("fetched", 32)
    a.shared.backend.delete(manifest_key(MODEL, a.snapshot(1).snap_key))
    c = host("c", tier)
    assert c.fetch(IDENT, prompt(64)).outcome == "miss"
    assert c.lookup(IDENT, prompt(64)) is None


def test_an_alias_that_lies_is_refused(tier: Tier, host: HostFactory) -> None:
    """An alias copied under another prefix's key: parsed strictly, refused; the
    next shorter stride's alias names the same (intact) root, which is fetched."""
    from sparkcache.hashing import prefix_hashes, prefix_seed

    a = uploaded(host, tier)
    assert a.shared is not None
    hashes = prefix_hashes(prefix_seed(IDENT, None), tokens(64, seed=1), IDENT.block_size)
    raw = a.shared.get(alias_key(MODEL, hashes[15].hex()))
    assert raw is not None
    a.shared.put(alias_key(MODEL, hashes[7].hex()), [raw])  # the 32-token alias, replaced
    b = host("b", tier)
    result = b.fetch(IDENT, prompt(40))
    assert (result.outcome, result.n_tokens, len(result.fetched)) == ("fetched", 16, 1)
    assert b.stats()["fetch_refused"] == 1
    match = b.lookup(IDENT, prompt(40))
    assert match is not None and match.n_tokens == 32  # the root's tokens, verified
    assert pages_equal(a, b, prompt(40), 32)


def test_hosts_fetching_the_same_prefix_at_once_agree(tier: Tier, host: HostFactory) -> None:
    a = uploaded(host, tier)
    b, c = host("b", tier), host("c", tier)
    toks = prompt(64)
    barrier = threading.Barrier(4)
    results = []

    def run(store: SnapshotStore) -> None:
        barrier.wait()
        results.append((store, store.fetch(IDENT, toks)))

    threads = [threading.Thread(target=run, args=(s,)) for s in (b, b, c, c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r.hit and r.n_tokens == 64 for _, r in results)
    for store in (b, c):
        # each link downloaded and published once per host
        fetched = [i for s, r in results if s is store for i in r.fetched]
        assert sorted(fetched) == [1, 2]
        assert [s.id for s in store.snapshots() if s.state == "ready"] == [1, 2]
        assert pages_equal(a, store, toks, 64)


def test_an_upload_racing_a_fetch_is_whole_or_absent(tier: Tier, host: HostFactory) -> None:
    """While host a uploads, host b fetches again and again: each fetch sees
    nothing, the root, or the whole chain, and what it restores is a's."""
    a = host("a", tier)
    publish_chain(a)
    b = host("b", tier)
    seen = set()
    done = threading.Event()

    def upload() -> None:
        a.upload()
        done.set()

    t = threading.Thread(target=upload)
    t.start()
    while not done.is_set() or len(seen) == 0:
        result = b.fetch(IDENT, prompt(64))
        seen.add((result.outcome, result.n_tokens))
        if result.outcome == "fetched" and result.n_tokens == 64:
            break
    t.join(60)
    assert all(outcome in ("miss", "fetched", "local") for outcome, _ in seen)
    final = b.fetch(IDENT, prompt(64))
    assert final.hit and final.n_tokens == 64
    assert pages_equal(a, b, prompt(64), 64)


def test_a_tier_that_is_down_is_a_clear_error(host: HostFactory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    s3_server()  # the session's: its environment (credentials, endpoint) stays
    server = S3Server(set_env=False)
    tier = Tier(f"s3://{server.bucket()}/kv", {"endpoint_url": server.endpoint}, server)
    try:
        uploaded(host, tier)
        b = host("b", tier)
    finally:
        server.stop()
    with pytest.raises(SparkCacheError, match="check the endpoint"):
        b.fetch(IDENT, prompt(64))
    assert b.lookup(IDENT, prompt(64)) is None


def test_stats_sum_the_fetches(file_tier: Tier, host: HostFactory,
                               capsys: pytest.CaptureFixture[str]) -> None:
    from sparkcache.cli import main

    uploaded(host, file_tier)
    b = host("b", file_tier)
    b.fetch(IDENT, prompt(64))
    b.fetch(IDENT, tokens(80, seed=5))  # nothing of it in the tier
    b.close()
    assert main(["--folder", str(b.root), "stats"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"fetched:\s+2 snapshots, 0.0 MB from the tier; 1 misses; 0 refused", out)


def test_a_repeated_prompt_is_found_at_its_end(tier: Tier, host: HostFactory) -> None:
    """A snapshot saved with a breakpoint at its prompt's end (as the connector
    saves every answer) is found by the alias there: two HEADs, no bisection."""
    a = host("a", tier)
    toks = tokens(64, seed=3)
    a.publish(IDENT, 0, toks, pages_for(IDENT, toks), breakpoints=[38])  # the prompt: 38
    assert a.upload().error is None
    b = host("b", tier)
    result = b.fetch(IDENT, toks[:38])  # 9 whole blocks: the end, 36, is no stride
    assert (result.outcome, result.n_tokens) == ("fetched", 36)
    # then the alias and the manifest (a HEAD and a GET each), the segment (a
    # HEAD, its header, its token ids, its layers); the use record's PUT
    assert result.requests == 2 + 2 * 2 + 4 + 1
    match = b.lookup(IDENT, toks[:36])
    assert match is not None and match.n_tokens == 36


def test_a_childs_breakpoint_below_its_start_is_found(tier: Tier, host: HostFactory) -> None:
    """A child published with a breakpoint inside its parent's range (a request
    marked its system prompt only once the conversation had grown): the local
    index restores that prefix from the child, and so must the tier, for a prompt
    sharing only it (the breakpoint, 24, is no stride; the stride below is 16)."""
    a = host("a", tier)
    toks = tokens(64, seed=1)
    root = a.publish(IDENT, 0, toks[:32], pages_for(IDENT, toks[:32], 0))
    a.publish(IDENT, 0, toks, pages_for(IDENT, toks, 0, start=32), parent=root.snapshot_id,
              breakpoints=[24])
    assert a.upload().error is None
    shared_24 = prompt(24)
    local = a.lookup(IDENT, shared_24)
    assert local is not None and local.n_tokens == 24
    b = host("b", tier)
    result = b.fetch(IDENT, shared_24, breakpoints=[24])
    assert (result.outcome, result.n_tokens) == ("fetched", 24), result
    assert pages_equal(a, b, shared_24, 24)
