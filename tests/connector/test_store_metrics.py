"""The store's Prometheus series (``vllm:sparkcache_store_*``) and the Grafana dashboard over
every sparkcache series; a real server exports them in tests/vllm/test_serve_tenants.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sparkcache.store import SnapshotStore
from tests import grafana
from tests.filled import fill

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM (bash scripts/install-vllm.sh)")


def scrape(folder: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from sparkcache.connector.stats import StoreCollector

    registry = CollectorRegistry()
    registry.register(StoreCollector(str(folder)))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(generate_latest(registry).decode())
            for s in f.samples if not s.name.endswith("_created")}


def test_the_store_series_are_its_models_bytes_snapshots_and_evictions(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    with SnapshotStore(folder) as store:
        filled = fill(store)
        store.evict(model=filled.ident, count=1, reason="budget")
        models = {m.name: m for m in store.catalog.models()}
    got = scrape(folder)
    for name, row in models.items():
        labels = (("digest", row.digest[:12]), ("model", name))
        assert got[("vllm:sparkcache_store_bytes", labels)] == row.nbytes > 0
        assert got[("vllm:sparkcache_store_snapshots", labels)] == row.snapshots
    tiny = models[filled.ident.model]
    assert tiny.snapshots == 1  # the child went
    evictions = {k: v for k, v in got.items() if k[0] == "vllm:sparkcache_store_evictions_total"}
    assert evictions == {("vllm:sparkcache_store_evictions_total",
                          (("digest", tiny.digest[:12]), ("model", tiny.name),
                           ("reason", "budget"))): 1.0}


def test_an_unreadable_store_exports_nothing_and_raises_nothing(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    assert scrape(tmp_path / "file") == {}


def test_the_dashboard_queries_only_series_sparkcache_exports() -> None:
    from sparkcache.connector.stats import PROM_COUNTERS, STORE_METRICS

    known = {f"vllm:sparkcache_{n}_total" for n in PROM_COUNTERS} | {
        "vllm:sparkcache_store_bytes", "vllm:sparkcache_store_snapshots",
        "vllm:sparkcache_store_evictions_total"}
    assert {n.removeprefix("store_") for n in STORE_METRICS} == {"bytes", "snapshots", "evictions"}
    names = grafana.metric_names(grafana.load())
    assert names and names <= known, sorted(names - known)
    dashboard = grafana.load()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t.get("expr") for p in dashboard["panels"] for t in p["targets"])


def test_one_collector_per_process_reads_the_store_of_the_engine_built_last(
        tmp_path: Path) -> None:
    """Engines built one after another in one process (offline scripts) share the
    collector: a second one would export the same series (prometheus refuses it)."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from sparkcache.connector.stats import register_store_collector

    def config(folder: Path) -> SimpleNamespace:
        extra = {"folder": str(folder)}
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))

    first = register_store_collector(config(tmp_path / "a"))
    second = register_store_collector(config(tmp_path / "b"))
    assert first is second and first is not None and first.folder == str(tmp_path / "b")
    assert register_store_collector(config(tmp_path / "b")) is first
    names = {m.name for m in REGISTRY.collect()}
    assert "vllm:sparkcache_store_bytes" in names
    bad = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config={"no_such_key": 1}))
    assert register_store_collector(bad) is None
