"""The connector reads a request's tenant from kv_transfer_params into its scope."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sparkcache.connector.requests import TENANT_KEY, TenantLabels, scope_of
from sparkcache.identity import RequestScope


def request(tenant: Any = None, salt: str | None = "t:abc") -> SimpleNamespace:
    params = None if tenant is None else {"sparkcache": {"id": "r", "tenant": tenant}}
    return SimpleNamespace(request_id="r", cache_salt=salt, lora_request=None, mm_features=[],
                           kv_transfer_params=params)


def test_the_tenant_joins_the_scope() -> None:
    assert scope_of(request("alice")) == RequestScope(cache_salt="t:abc", tenant="alice")
    assert scope_of(request(None, None)) is None
    assert scope_of(request("alice", None)) == RequestScope(tenant="alice")


def test_a_malformed_tenant_is_ignored() -> None:
    for bad in ("", "x" * 1025, 5, ["a"], "a\ud800"):
        assert scope_of(request(bad)) == RequestScope(cache_salt="t:abc")


def test_tenant_labels_are_bounded_and_escaped() -> None:
    labels = TenantLabels(limit=2)
    scope = RequestScope(tenant="a\x1b\n" + "x" * 100)
    first = labels.counter(scope, "hits")
    assert first == TENANT_KEY + ("a\\x1b\\n" + "x" * 100)[:64] + "\x00hits"
    assert labels.counter(RequestScope(tenant="b"), "hits") == TENANT_KEY + "b\x00hits"
    assert labels.counter(RequestScope(tenant="c"), "lookups") == TENANT_KEY + "other\x00lookups"
    assert labels.counter(scope, "lookups") == TENANT_KEY + first[len(TENANT_KEY):-4] + "lookups"
    assert labels.counter(RequestScope(cache_salt="s"), "hits") is None
    assert labels.counter(None, "hits") is None


def test_per_tenant_counters_reach_prometheus_with_a_tenant_label() -> None:
    prometheus = pytest.importorskip("prometheus_client")
    pytest.importorskip("vllm")
    from sparkcache.connector.stats import SparkCachePromMetrics, SparkCacheStats

    registry = prometheus.CollectorRegistry()

    def counter(**kwargs: Any) -> Any:
        return prometheus.Counter(registry=registry, **kwargs)

    config = SimpleNamespace(kv_transfer_config=None)
    metrics = SparkCachePromMetrics(
        config, {prometheus.Gauge: None, prometheus.Counter: counter,
                 prometheus.Histogram: None}, ["engine"], {0: ["0"]})
    labels = TenantLabels()
    stats = SparkCacheStats({"hits": 2, "events_stored_blocks": 9,
                             labels.counter(RequestScope(tenant="t1"), "hits"): 2,
                             labels.counter(RequestScope(tenant="t1"), "hit_tokens"): 96})
    assert stats.reduce() == {"hits": 2, "events_stored_blocks": 9}  # the totals only
    metrics.observe(stats.data, 0)
    value = registry.get_sample_value
    assert value("vllm:sparkcache_hits_total", {"engine": "0"}) == 2
    assert value("vllm:sparkcache_events_stored_blocks_total", {"engine": "0"}) == 9
    assert value("vllm:sparkcache_tenant_hits_total", {"engine": "0", "tenant": "t1"}) == 2
    assert value("vllm:sparkcache_tenant_hit_tokens_total",
                 {"engine": "0", "tenant": "t1"}) == 96
