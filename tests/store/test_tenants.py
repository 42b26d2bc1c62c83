"""Tenants in the store: the scope's tenant recorded, per-tenant limits, clear, listing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkcache import InvalidArgument, SnapshotStore
from sparkcache.identity import RequestScope
from sparkcache.retention import GB, MB, Retention, RetentionSettings

from .helpers import Clock, identity, pages_for, tokens


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make_store(tmp_path: Path, clock: Clock, **settings: object) -> SnapshotStore:
    base: dict[str, object] = dict(folder=tmp_path, min_tokens=0, min_free_mb=0)
    base.update(settings)
    retention = Retention(RetentionSettings(**base),  # type: ignore[arg-type]
                          disk_usage=lambda backend: None, ram_bytes=lambda: 64 * GB)
    return SnapshotStore(tmp_path / "store", clock=clock, retention=retention, alias_stride=16)


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[SnapshotStore]:
    s = make_store(tmp_path, clock)
    yield s
    s.close()


def publish(store: SnapshotStore, clock: Clock, seed: int, tenant: str | None,
            n: int = 64) -> int:
    """A snapshot of ``n`` tokens in the tenant's scope, one second after the last."""
    clock.now += 1
    ident = identity()
    toks = tokens(n, seed=seed)
    scope = None if tenant is None else RequestScope(cache_salt=f"s-{tenant}", tenant=tenant)
    return store.publish(ident, 0, toks, pages_for(ident, toks), scope=scope).snapshot_id


def alive(store: SnapshotStore) -> dict[int, str | None]:
    return {s.id: s.tenant for s in store.snapshots()}


def test_the_scope_s_tenant_is_recorded_and_changes_the_hashes(store: SnapshotStore,
                                                               clock: Clock) -> None:
    a = publish(store, clock, 1, "alice")
    b = publish(store, clock, 2, None)
    assert alive(store) == {a: "alice", b: None}
    ident, toks = identity(), tokens(64, seed=1)
    # Only the scope it was published in finds it: the tenant is part of the seed.
    assert store.lookup(ident, toks, scope=RequestScope(cache_salt="s-alice",
                                                        tenant="alice")) is not None
    assert store.lookup(ident, toks, scope=RequestScope(cache_salt="s-alice")) is None
    assert store.lookup(ident, toks, scope=RequestScope(cache_salt="s-alice",
                                                        tenant="bob")) is None


def test_a_scope_without_tenant_hashes_as_before() -> None:
    assert RequestScope(cache_salt="x").canonical() == '{"cache_salt":"x","lora":null,"mm":[]}'
    scope = RequestScope(cache_salt="x", tenant="t\n1")
    assert RequestScope.from_canonical(scope.canonical()) == scope
    assert RequestScope.from_canonical(RequestScope().canonical()) == RequestScope()
    with pytest.raises(InvalidArgument):
        RequestScope.from_dict({"cache_salt": None, "lora": None, "mm": [], "tenant": None})
    with pytest.raises(InvalidArgument):
        RequestScope.from_dict({"cache_salt": None, "lora": None, "mm": [], "tenant": 3})


def test_tenant_entries_evict_only_that_tenant_s_oldest(tmp_path: Path, clock: Clock) -> None:
    with make_store(tmp_path, clock, tenant_entries=2) as store:
        a1, b1, a2, n1, a3 = (publish(store, clock, 1, "a"), publish(store, clock, 2, "b"),
                              publish(store, clock, 3, "a"), publish(store, clock, 4, None),
                              publish(store, clock, 5, "a"))
        # a's third snapshot pushed out a's oldest; b's and the untenanted stay.
        assert alive(store) == {b1: "b", a2: "a", n1: None, a3: "a"}
        assert a1 not in alive(store)
        assert store.stats().get("evictions.tenant_entries") == 1


def test_tenant_mb_evicts_only_that_tenant_and_respects_leases(tmp_path: Path,
                                                               clock: Clock) -> None:
    with make_store(tmp_path, clock) as store:
        probe = publish(store, clock, 0, None)
        ident = identity()  # the KV bytes of a token (a snapshot adds its header's)
        per_token = ident.page_nbytes * ident.num_layers / ident.block_size
        # Snapshots of about 0.45 MB: two fit in TENANT_MB=1, three do not.
        n = int(0.45 * MB / per_token) // 16 * 16
        a1, a2, b1, b2, b3, a3, a4 = (publish(store, clock, seed, tenant, n) for seed, tenant in
                                      ((1, "a"), (2, "a"), (3, "b"), (4, "b"), (5, "b"),
                                       (6, "a"), (7, "a")))
        size = store.snapshot(a1).nbytes
        assert 2 * size <= MB < 3 * size
        store.acquire_lease(a1, ttl=3600)
    with make_store(tmp_path, clock, tenant_mb=1) as store:
        report = store.sweep()
        # a: the leased a1 stays, then the oldest go until 1 MB holds the rest;
        # b went from its own oldest; the untenanted probe stays.
        assert sorted(report.evicted["tenant_budget"]) == sorted([a2, a3, b1])
        assert alive(store) == {probe: None, a1: "a", b2: "b", b3: "b", a4: "a"}


def test_tenant_limits_are_validated_like_the_others() -> None:
    assert RetentionSettings.from_env({}).tenant_limits.any is False
    s = RetentionSettings.from_env({"SPARK_KV_CACHE_TENANT_MB": "5",
                                    "SPARK_KV_CACHE_TENANT_ENTRIES": "3"})
    assert (s.tenant_mb, s.tenant_entries) == (5, 3)
    assert (s.tenant_limits.entries, s.tenant_limits.nbytes) == (3, 5 * MB)
    for var, raw in (("TENANT_MB", "-1"), ("TENANT_MB", "lots"), ("TENANT_ENTRIES", "1.5"),
                     ("TENANT_ENTRIES", "-2")):
        with pytest.raises(InvalidArgument, match=f"SPARK_KV_CACHE_{var}"):
            RetentionSettings.from_env({f"SPARK_KV_CACHE_{var}": raw})
    with pytest.raises(InvalidArgument, match="TENANT_ENTRIES"):
        RetentionSettings(tenant_entries=-1)


def test_clear_of_a_tenant_leaves_the_others(store: SnapshotStore, clock: Clock) -> None:
    a1, b1, a2, n1 = (publish(store, clock, 1, "a"), publish(store, clock, 2, "b"),
                      publish(store, clock, 3, "a"), publish(store, clock, 4, None))
    model_id = store.snapshot(a1).model_id
    rehearsed = store.clear_model(model_id, tenant="a", dry_run=True)
    assert rehearsed.report[0] == [a1, a2] and len(alive(store)) == 4
    assert store.clear_model(model_id, tenant="a") == ([a1, a2], [], [])
    assert alive(store) == {b1: "b", n1: None}
    assert store.clear_model(model_id, tenant="nobody") == ([], [], [])


def test_tenant_usage_sums_snapshots_and_requests(store: SnapshotStore, clock: Clock) -> None:
    a1 = publish(store, clock, 1, "a")
    publish(store, clock, 2, "a")
    publish(store, clock, 3, "b")
    model_id = store.snapshot(a1).model_id
    size = store.snapshot(a1).nbytes
    store.log_requests([
        {"request_id": "r1", "model_id": model_id, "tenant": "a", "prompt_tokens": 100,
         "live_tokens": 10, "restored_tokens": 40},
        {"request_id": "r2", "model_id": model_id, "tenant": "a", "prompt_tokens": 100},
        {"request_id": "r3", "model_id": model_id, "tenant": "c", "prompt_tokens": 50,
         "live_tokens": 50},
        {"request_id": "r4", "tenant": "a", "status": 400},  # never reached the engine
        {"request_id": "r5", "model_id": model_id, "prompt_tokens": 10},
    ], keep=100)
    rows = {u.tenant: u for u in store.tenants()}
    assert set(rows) == {"a", "b", "c"}
    a, b, c = rows["a"], rows["b"], rows["c"]
    assert (a.snapshots, a.nbytes, a.requests, a.prompt_tokens, a.cached_tokens) == (
        2, 2 * size, 2, 200, 50)
    assert a.hit_rate == 0.25
    assert (b.snapshots, b.requests, b.hit_rate) == (1, 0, 0.0)
    assert (c.snapshots, c.requests, c.hit_rate) == (0, 1, 1.0)
    assert store.tenants(model_id=model_id + 1) == []
