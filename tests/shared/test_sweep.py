"""The shared tier's sweep (moto's S3 server and file:// tiers): age and budget per
model, parents kept for their children, whole snapshots at every instant (a reader
between any two deletions, a real process killed mid-way), one sweeping host at a
time, and no sweep/upload loop between two hosts."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from sparkcache import SnapshotStore
from sparkcache import segment as seg
from sparkcache.errors import InvalidArgument, LeaseError, SparkCacheError
from sparkcache.shared import SharedTier, TierLimits, mark_used, sweep_tier
from sparkcache.shared.layout import manifest_key, parse_manifest, used_key
from sparkcache.shared.lease import SweepLease
from sparkcache.shared.sweep import SharedSweeper, read_catalogue

from ..s3server import S3Server
from ..store.helpers import identity, pages_for, tokens
from .conftest import Tier

HostFactory = Callable[..., SnapshotStore]
MODEL = identity().digest()
DAY = 86400.0


def publish_chains(store: SnapshotStore, seeds: list[int]) -> dict[int, tuple[str, str]]:
    """Per seed, a root of 32 tokens and its child of 64: {seed: (root key, child key)}."""
    ident = identity()
    out = {}
    for seed in seeds:
        toks = tokens(64, seed=seed)
        root = store.publish(ident, 0, toks[:32], pages_for(ident, toks[:32], 0))
        child = store.publish(ident, 0, toks, pages_for(ident, toks, 0, start=32),
                              parent=root.snapshot_id)
        assert root.state == child.state == "ready"
        out[seed] = (store.snapshot(root.snapshot_id).snap_key,
                     store.snapshot(child.snapshot_id).snap_key)
    return out


def state_of(tier: SharedTier, key: str) -> str:
    """What a reader finds for snapshot ``key`` using only the layout: ``whole``
    (its manifest and its parents', every segment there and verified against the
    digest its manifest names), ``absent`` (no manifest) or ``partial`` (a
    manifest is there but its chain or a segment is not: never allowed)."""
    raw = tier.get(manifest_key(MODEL, key))
    if raw is None:
        return "absent"
    while raw is not None:
        m = parse_manifest(raw, MODEL, key)
        for g in m.segments:
            size = tier.size(g.key)
            if size != g.nbytes:
                return "partial"
            with tier.backend.open(g.key) as blob:
                seg.parse_header(blob.buffer, g.digest)
        if m.parent is None:
            return "whole"
        key = m.parent
        raw = tier.get(manifest_key(MODEL, key))
    return "partial"


def manifests(tier: SharedTier) -> list[str]:
    return sorted(k.rsplit("/", 1)[-1].removesuffix(".json")
                  for k in tier.backend.list() if "/snap/" in k)


def assert_consistent(tier: SharedTier) -> None:
    """Every snapshot the tier shows is whole, its chain included."""
    for key in manifests(tier):
        assert state_of(tier, key) == "whole", key


def kinds(tier: SharedTier) -> dict[str, int]:
    out: dict[str, int] = {}
    for key in tier.backend.list():
        kind = key.split("/")[1] if key.startswith("m-") and "/" in key else key
        out[kind] = out.get(kind, 0) + 1
    return out


def later(seconds: float) -> Callable[[], float]:
    return lambda: time.time() + seconds


def test_age_goes_by_last_use_and_keeps_parents_of_kept_children(
        tier: Tier, host: HostFactory) -> None:
    store = host("a", tier)
    chains = publish_chains(store, [1, 2])
    store.upload()
    assert store.shared is not None
    time.sleep(3)  # S3's times are whole seconds
    mark_used(store.shared, MODEL, chains[1][1])  # chain 1's child is used now
    report = sweep_tier(store.shared, TierLimits(max_age_hours=2 / 3600))
    assert report.swept and report.skipped is None
    assert sorted(report.deleted["age"]) == sorted(f"{MODEL}/{k}" for k in chains[2])
    # chain 1's root is older than the limit, but its child, used now, needs it
    assert manifests(store.shared) == sorted(chains[1])
    assert all(state_of(store.shared, k) == "whole" for k in chains[1])
    found = kinds(store.shared)
    # chain 2's segments, aliases (at 16, 32, 48, 64 tokens) and manifests went
    assert (found["snap"], found["seg"], found["at"], found["used"]) == (2, 2, 4, 1)
    assert report.kept == 2 and report.bytes_freed > 0
    # nothing more goes while chain 1 is in use; everything once it is not
    assert sweep_tier(store.shared, TierLimits(max_age_hours=1)).count == 0
    report = sweep_tier(store.shared, TierLimits(max_age_hours=1), clock=later(2 * 3600))
    assert report.counts() == {"age": 2} and manifests(store.shared) == []
    assert set(kinds(store.shared)) <= {"tier.json", "sweep.json", "sweep.lock", "model.json"}


def test_budget_evicts_least_recently_used_leaves_first(
        tier: Tier, host: HostFactory) -> None:
    store = host("a", tier)
    chains = publish_chains(store, [1, 2, 3])
    store.upload()
    assert store.shared is not None
    cat = read_catalogue(store.shared)[MODEL]
    size = {k: m.nbytes for k, m in cat.manifests.items()}
    time.sleep(1.1)
    mark_used(store.shared, MODEL, chains[3][1])
    time.sleep(1.1)
    mark_used(store.shared, MODEL, chains[1][1])
    # room for chains 1 and 3 and chain 2's root: chain 2's child goes, nothing else
    keep = sum(size[k] for k in (*chains[1], *chains[3], chains[2][0]))
    report = sweep_tier(store.shared, TierLimits(mb=keep / 1e6, max_age_hours=0))
    assert report.deleted == {"budget": [f"{MODEL}/{chains[2][1]}"]}
    assert report.kept_bytes == keep
    # one byte less: chain 2's root, a leaf now and the least recently used
    report = sweep_tier(store.shared, TierLimits(mb=(keep - 1) / 1e6, max_age_hours=0))
    assert report.deleted == {"budget": [f"{MODEL}/{chains[2][0]}"]}
    # less than chain 1: chain 3's child, then chain 3's root... down to chain 1
    report = sweep_tier(store.shared, TierLimits(mb=size[chains[1][0]] / 1e6 + 1e-6,
                                                 max_age_hours=0))
    assert sorted(report.deleted["budget"]) == sorted(
        f"{MODEL}/{k}" for k in (chains[3][1], chains[3][0], chains[1][1]))
    assert manifests(store.shared) == [chains[1][0]]
    assert_consistent(store.shared)


def test_a_dry_run_reports_and_changes_nothing(s3_tier: Tier, host: HostFactory) -> None:
    store = host("a", s3_tier)
    publish_chains(store, [1, 2])
    store.upload()
    assert store.shared is not None
    before = {k: store.shared.get(k, 1 << 30) for k in store.shared.backend.list()}
    dry = sweep_tier(store.shared, TierLimits(max_age_hours=1), dry_run=True,
                     clock=later(DAY))
    assert dry.dry_run and dry.counts() == {"age": 4} and dry.objects_deleted == 4 + 4 + 8
    assert {k: store.shared.get(k, 1 << 30) for k in store.shared.backend.list()} == before
    real = sweep_tier(store.shared, TierLimits(max_age_hours=1), clock=later(DAY))
    assert (real.deleted, real.objects_deleted, real.bytes_freed) == (
        dry.deleted, dry.objects_deleted, dry.bytes_freed)


def test_what_is_not_whole_goes_and_young_garbage_stays(
        tier: Tier, host: HostFactory) -> None:
    """A manifest without its segment goes with its descendants; a segment no
    manifest names (an upload in flight) stays until it is older than the grace."""
    store = host("a", tier)
    chains = publish_chains(store, [1, 2])
    store.upload()
    shared = store.shared
    assert shared is not None
    root = parse_manifest(shared.get(manifest_key(MODEL, chains[1][0])) or b"", MODEL,
                          chains[1][0])
    shared.backend.delete(root.segments[0].key)  # chain 1's root loses its segment
    stray = root.segments[0].key.replace(root.segments[0].digest, "ab" * 16)
    shared.put(stray, [b"an upload that has not written its manifest yet"])
    bad = manifest_key(MODEL, "cd" * 16)
    shared.put(bad, [b"{not a manifest"])
    report = sweep_tier(shared, TierLimits(max_age_hours=0))
    assert report.deleted == {"broken": [f"{MODEL}/{chains[1][0]}"],
                              "orphan": [f"{MODEL}/{chains[1][1]}"], "invalid": [bad]}
    assert manifests(shared) == sorted(chains[2])
    assert shared.exists(stray)  # young: an upload may be writing it
    assert_consistent(shared)
    report = sweep_tier(shared, TierLimits(max_age_hours=0), clock=later(3 * 3600))
    assert report.count == 0 and report.objects_deleted == 1 and not shared.exists(stray)
    assert manifests(shared) == sorted(chains[2])


def test_an_alias_shared_with_a_kept_snapshot_is_renamed(
        tier: Tier, host: HostFactory) -> None:
    """Two roots sharing their first 16 tokens share that alias: when the one it
    names goes, the alias names the other (a reader finds it), never nothing."""
    store = host("a", tier)
    ident = identity()
    toks = tokens(64, seed=5)
    other = toks.copy()
    other[20:] = tokens(44, seed=6)
    first = store.publish(ident, 0, toks[:32], pages_for(ident, toks[:32], 0))
    second = store.publish(ident, 0, other[:48], pages_for(ident, other[:48], 0))
    store.upload()
    shared = store.shared
    assert shared is not None
    k1, k2 = store.snapshot(first.snapshot_id).snap_key, store.snapshot(second.snapshot_id).snap_key
    m1 = parse_manifest(shared.get(manifest_key(MODEL, k1)) or b"", MODEL, k1)
    m2 = parse_manifest(shared.get(manifest_key(MODEL, k2)) or b"", MODEL, k2)
    (common,) = set(m1.aliases) & set(m2.aliases)
    alias = f"m-{MODEL}/at/{common[1][:2]}/{common[1]}.json"
    assert json.loads(shared.get(alias) or b"")["snapshot"] == k1  # the first upload's
    time.sleep(1.1)
    mark_used(shared, MODEL, k2)
    report = sweep_tier(shared, TierLimits(mb=m2.nbytes / 1e6, max_age_hours=0))
    assert report.deleted == {"budget": [f"{MODEL}/{k1}"]} and report.aliases_rewritten == 1
    doc = json.loads(shared.get(alias) or b"")
    assert (doc["snapshot"], doc["snapshot_tokens"], doc["n_tokens"]) == (k2, 48, 16)
    assert not shared.exists(f"m-{MODEL}/at/{m1.aliases[1][1][:2]}/{m1.aliases[1][1]}.json")


def test_every_instant_of_a_sweep_shows_only_whole_snapshots(
        tier: Tier, host: HostFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader looking between any two deletions (one object at a time) sees each
    snapshot whole or absent: manifests go before segments, children before parents."""
    store = host("a", tier)
    chains = publish_chains(store, [1, 2, 3])
    store.upload()
    shared = store.shared
    assert shared is not None
    seen: list[str] = []
    real_delete = shared.backend.delete

    def one_by_one(keys: list[str]) -> None:
        for key in keys:
            real_delete(key)
            for root, child in chains.values():
                seen.extend((state_of(shared, root), state_of(shared, child)))

    monkeypatch.setattr(shared.backend, "delete_many", one_by_one)
    report = sweep_tier(shared, TierLimits(max_age_hours=1), clock=later(DAY))
    assert report.count == 6
    assert "partial" not in seen and seen.count("absent") > 0
    assert manifests(shared) == []


KILLED = """
import json, os, sys, time
from sparkcache.backends.fsspec_backend import FsspecBackend
from sparkcache.shared import SharedTier, TierLimits, sweep_tier
args = json.loads(sys.argv[1])
left = [args["after"]]
def delete_many(self, keys):
    for key in keys:
        if left[0] == 0:
            os._exit(9)  # killed between two deletions
        self.delete(key)
        left[0] -= 1
FsspecBackend.delete_many = delete_many
tier = SharedTier(args["url"], args["options"], alias_stride=16)
sweep_tier(tier, TierLimits(max_age_hours=1), clock=lambda: time.time() + 86400)
"""


@pytest.mark.parametrize("after", [1, 5, 9])
def test_a_sweep_killed_mid_way_leaves_only_whole_snapshots(
        tier: Tier, host: HostFactory, after: int) -> None:
    """A real process dies after ``after`` deletions (the manifests go first: 6 of
    them, children first; then segments, aliases): the tier shows every snapshot
    whole or not at all, and the next sweep, past the dead one's lease, finishes."""
    store = host("a", tier)
    chains = publish_chains(store, [1, 2, 3])
    store.upload()
    shared = store.shared
    assert shared is not None
    args = {"url": tier.url, "options": tier.options, "after": after}
    done = subprocess.run([sys.executable, "-c", KILLED, json.dumps(args)], timeout=120,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 9, done.stderr
    left = manifests(shared)
    assert 0 < 6 - len(left) <= after
    for root, child in chains.values():
        states = (state_of(shared, root), state_of(shared, child))
        assert states in {("whole", "whole"), ("whole", "absent"), ("absent", "absent")}
    # a live lease (S3) or none (file://: the kernel dropped the dead process's lock)
    busy = sweep_tier(shared, TierLimits(max_age_hours=1), clock=later(DAY))
    assert busy.swept == (tier.server is None)
    report = sweep_tier(shared, TierLimits(max_age_hours=1), clock=later(DAY + 3600))
    assert report.swept and manifests(shared) == []
    assert set(kinds(shared)) <= {"tier.json", "sweep.json", "sweep.lock", "model.json"}


def test_one_host_holds_the_sweep(tier: Tier, host: HostFactory) -> None:
    a, b = host("a", tier), host("b", tier)
    assert a.shared is not None and b.shared is not None
    lease, why = SweepLease.take(a.shared, seconds=60, clock=time.time)
    assert lease is not None and why is None
    report = sweep_tier(b.shared, TierLimits())
    assert not report.swept and report.skipped is not None and "sweeping" in report.skipped
    assert lease.holder.split("/")[0] in report.skipped  # who holds it
    lease.renew()
    lease.release(finished=True)
    assert sweep_tier(b.shared, TierLimits()).swept
    # a fleet's periodic sweepers: one sweep per period
    skipped = sweep_tier(a.shared, TierLimits(), min_interval=3600)
    assert not skipped.swept and "swept" in (skipped.skipped or "")


def test_an_expired_lease_is_taken_over_once(s3_tier: Tier, host: HostFactory) -> None:
    """S3: a host whose lease expired (it died, or stalled) loses it to exactly one
    other host; its next renewal fails and it stops."""
    a, b, c = (host(n, s3_tier) for n in "abc")
    assert a.shared and b.shared and c.shared
    stalled, _ = SweepLease.take(a.shared, seconds=60, clock=time.time)
    assert stalled is not None
    results = []
    barrier = threading.Barrier(2)

    def take(tier: SharedTier) -> None:
        barrier.wait()
        results.append(SweepLease.take(tier, seconds=60, clock=later(120)))

    threads = [threading.Thread(target=take, args=(t,)) for t in (b.shared, c.shared)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [lease for lease, _why in results if lease is not None]
    assert len(winners) == 1
    with pytest.raises(LeaseError, match="taken over"):
        stalled.renew()
    winners[0].renew()
    winners[0].release(finished=False)


def test_a_tier_without_atomic_writes_is_refused() -> None:
    import fsspec

    fsspec.filesystem("memory").mkdir("/sweep-refused")
    tier = SharedTier("memory://sweep-refused", alias_stride=16)
    with pytest.raises(InvalidArgument, match="conditional writes"):
        sweep_tier(tier, TierLimits())


def test_two_hosts_sweeping_and_uploading_settle(tier: Tier, host: HostFactory) -> None:
    """Two hosts with the same snapshots sweep at once, then upload: one consistent
    state, nothing uploaded again (the sweep's decisions hold), and a second round
    changes nothing."""
    a, b = host("a", tier), host("b", tier)
    chains = publish_chains(a, [1, 2, 3])
    assert publish_chains(b, [1, 2, 3]) == chains
    assert len(a.upload().uploaded) == 6 and len(b.upload().present) == 6
    assert a.shared is not None and b.shared is not None
    cat = read_catalogue(a.shared)[MODEL]
    limits = TierLimits(mb=sum(cat.manifests[k].nbytes for k in chains[1]) / 1e6,
                        max_age_hours=0)
    reports = []
    barrier = threading.Barrier(2)

    def sweep(shared: SharedTier) -> None:
        barrier.wait()
        reports.append(sweep_tier(shared, limits))

    threads = [threading.Thread(target=sweep, args=(s,)) for s in (a.shared, b.shared)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(r.count for r in reports) == 4 and any(r.swept for r in reports)
    left = manifests(a.shared)
    assert len(left) == 2
    assert_consistent(a.shared)
    before = {k: a.shared.get(k, 1 << 30) for k in a.shared.backend.list()
              if "sweep." not in k}
    for store in (a, b):
        report = store.upload()
        assert (report.uploaded, report.present, report.pending) == ([], [], 0)
    for shared in (a.shared, b.shared):
        assert sweep_tier(shared, limits).count == 0
    assert {k: a.shared.get(k, 1 << 30) for k in a.shared.backend.list()
            if "sweep." not in k} == before


def test_the_periodic_sweeper(file_tier: Tier, host: HostFactory) -> None:
    store = host("a", file_tier)
    publish_chains(store, [1])
    store.upload()
    assert store.shared is not None
    sweeper = SharedSweeper(store.shared, TierLimits(max_age_hours=1e-9, sweep_seconds=0.05,
                                                     grace_seconds=0))
    sweeper.start()
    try:
        assert sweeper.wait(3, timeout=30)
    finally:
        sweeper.stop()
    assert manifests(store.shared) == [] and sweeper.failures == 0
    assert not sweeper.running


def test_limits_from_the_environment() -> None:
    limits = TierLimits.from_env({"SPARK_KV_CACHE_SHARED_MB": "2500",
                                  "SPARK_KV_CACHE_MAX_AGE_HOURS": "24"})
    assert (limits.mb, limits.max_age_hours, limits.sweep_seconds) == (2500, 24, 3600)
    limits = TierLimits.from_env({"SPARK_KV_CACHE_SHARED_MAX_AGE_HOURS": "0",
                                  "SPARK_KV_CACHE_MAX_AGE_HOURS": "24",
                                  "SPARK_KV_CACHE_SHARED_SWEEP_SECONDS": "60"})
    assert (limits.mb, limits.max_age_hours, limits.sweep_seconds) == (0, 0, 60)
    assert TierLimits.from_env({}, mb=5).mb == 5
    with pytest.raises(InvalidArgument, match="SPARK_KV_CACHE_SHARED_MB"):
        TierLimits.from_env({"SPARK_KV_CACHE_SHARED_MB": "lots"})


def test_a_use_record_names_its_snapshot() -> None:
    assert used_key(MODEL, "ab" * 16) == f"m-{MODEL}/used/ab/{'ab' * 16}.json"


def test_a_new_child_of_a_swept_parent_sends_the_parent_again(
        tier: Tier, host: HostFactory) -> None:
    """The sweep deleted a chain; a new turn of that conversation (a new child of
    the root, still held locally) is uploaded with its root, so it is whole in the
    tier, not an orphan; the old child stays deleted."""
    store = host("a", tier)
    (root_key, child_key), = publish_chains(store, [1]).values()
    store.upload()
    assert store.shared is not None
    assert sweep_tier(store.shared, TierLimits(max_age_hours=1), clock=later(DAY)).count == 2
    ident = identity()
    toks = tokens(64, seed=1)
    toks[40:] = tokens(24, seed=9)  # another continuation of the same root
    root_id = next(s.id for s in store.snapshots() if s.snap_key == root_key)
    turn = store.publish(ident, 0, toks, pages_for(ident, toks, 0, start=32), parent=root_id)
    report = store.upload()
    assert report.uploaded == [root_id, turn.snapshot_id] and report.pending == 0
    new_key = store.snapshot(turn.snapshot_id).snap_key
    assert manifests(store.shared) == sorted([root_key, new_key])
    assert state_of(store.shared, new_key) == "whole"
    assert state_of(store.shared, child_key) == "absent"
    assert store.upload().uploaded == []  # settled


def test_a_tier_that_fails_is_a_clear_error_and_the_sweeper_goes_on(s3: S3Server) -> None:
    """The tier stops answering: one sweep raises a SparkCacheError saying what to
    check; the periodic sweeper counts the failure and keeps running.  (``s3``, the
    session's server, put the credentials in the environment.)"""
    server = S3Server(set_env=False)
    try:
        tier = SharedTier(f"s3://{server.bucket()}/kv", {"endpoint_url": server.endpoint},
                          alias_stride=16)
    finally:
        server.stop()
    with pytest.raises(SparkCacheError, match="check the endpoint"):
        sweep_tier(tier, TierLimits())
    sweeper = SharedSweeper(tier, TierLimits(sweep_seconds=0.05)).start()
    try:
        assert sweeper.wait(2, timeout=60)
        assert sweeper.failures >= 2 and sweeper.running
        assert isinstance(sweeper.last_error, SparkCacheError)
    finally:
        sweeper.stop()


TWO = """
import json, sys, time
from sparkcache.shared import SharedTier, TierLimits, sweep_tier
args = json.loads(sys.argv[1])
tier = SharedTier(args["url"], args["options"], alias_stride=16)
while time.time() < args["start"]:
    time.sleep(0.001)
report = sweep_tier(tier, TierLimits(mb=args["mb"], max_age_hours=0))
print(json.dumps({"swept": report.swept, "count": report.count}))
"""


def test_two_processes_sweeping_at_once(tier: Tier, host: HostFactory) -> None:
    """Two real processes start a sweep at the same instant: together they delete
    what one would, and the tier ends in one consistent state."""
    store = host("a", tier)
    chains = publish_chains(store, [1, 2, 3, 4])
    store.upload()
    assert store.shared is not None
    cat = read_catalogue(store.shared)[MODEL]
    mb = sum(cat.manifests[k].nbytes for k in chains[4]) / 1e6
    args = json.dumps({"url": tier.url, "options": tier.options, "mb": mb,
                       "start": time.time() + 3})
    procs = [subprocess.Popen([sys.executable, "-c", TWO, args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    results = [json.loads(out) for out, _err in outs]
    assert sum(r["count"] for r in results) == 6 and any(r["swept"] for r in results)
    assert len(manifests(store.shared)) == 2
    assert_consistent(store.shared)
    assert sweep_tier(store.shared, TierLimits(mb=mb, max_age_hours=0)).count == 0
