"""What the connector hands vLLM besides KV: the metadata the scheduler sends
the workers every step, the counters both sides report, and their Prometheus
export (``vllm:sparkcache_<name>``, and the store's own gauges read from its
index at each scrape, ``vllm:sparkcache_store_*``).  Imports vLLM (its base classes)."""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sparkcache.connector.costs import LOAD_KEY
from sparkcache.connector.jobs import LoadJob, SaveJob
from sparkcache.connector.requests import TENANT_KEY
from sparkcache.connector.settings import ConnectorSettings
from sparkcache.errors import SparkCacheError
from sparkcache.store import SnapshotStore

__all__ = ["PROM_COUNTERS", "STORE_METRICS", "TENANT_PROM_COUNTERS", "SparkCacheMetadata",
           "SparkCachePromMetrics", "SparkCacheStats", "SparkCacheWorkerMeta", "StoreCollector",
           "computes_prompt", "register_store_collector"]

logger = logging.getLogger(__name__)

_base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
_metrics = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
KVConnectorMetadata: Any = _base.KVConnectorMetadata
KVConnectorWorkerMetadata: Any = _base.KVConnectorWorkerMetadata
KVConnectorStats: Any = _metrics.KVConnectorStats
KVConnectorPromMetrics: Any = _metrics.KVConnectorPromMetrics


# -- metadata (scheduler -> workers, pickled every step) ---------------------------------


@dataclass
class SparkCacheMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    #: Preempted requests whose breakpoint saves may still read their blocks.
    preempted: list[str] = field(default_factory=list)
    #: The step computes no token: workers may wait for a load to land.
    idle: bool = False
    #: The step computes prompt tokens: publishes wait (``publisher.Prefills``).
    prefill: bool = False
    #: Requests whose saves a request waits for: published at once (``Prefills.want``).
    hurry: list[str] = field(default_factory=list)


@dataclass
class SparkCacheWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Workers -> scheduler, each step: the saves whose publish ended (published,
    skipped or failed) since the last step, each named by ``jobs.save_tag``,
    with how many ranks report it (vLLM sums the ranks' reports: :meth:`aggregate`).
    Sent whether or not vLLM logs stats: the scheduler's waits for a save end
    here (``Restores.ended``)."""

    ended: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: SparkCacheWorkerMeta) -> SparkCacheWorkerMeta:
        ended = dict(self.ended)
        for tag, ranks in getattr(other, "ended", {}).items():
            ended[tag] = ended.get(tag, 0) + ranks
        return SparkCacheWorkerMeta(ended=ended)


def computes_prompt(scheduler_output: Any) -> bool:
    """Whether a step computes prompt tokens (``SparkCacheMetadata.prefill``):
    more than one token for some request (a prompt or a chunk of one; a
    decode step computes one each)."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    return any(int(n) > 1 for n in scheduled.values())


# -- stats (workers and scheduler -> the logger process) ---------------------------------


@dataclass
class SparkCacheStats(KVConnectorStats):  # type: ignore[misc]
    """Counters summed over an interval: ``data`` maps name -> number.

    Scheduler: lookups, hits, misses, hit_tokens, coalesced, saves_planned,
    saves_known, breakpoint_saves_planned, lease_failures, lookup_seconds; with
    a shared tier: remote_hits and remote_hit_tokens (the part of hits and
    hit_tokens the tier supplied; the rest is local), remote_lookups,
    remote_misses, remote_refused, remote_errors, remote_timeouts,
    remote_dropped, remote_fetched_bytes, remote_seconds
    (:mod:`sparkcache.connector.fetcher`); with the cost model: cost_restored,
    cost_partial, cost_too_slow (:mod:`sparkcache.connector.costs`); with KV
    events: events_stored_blocks, events_removed_blocks, events_dropped,
    events_unannounced (:mod:`sparkcache.connector.events`).
    Workers: loads, loaded_tokens, loaded_bytes, load_seconds, loads_direct,
    loads_in_step, load_failures, loads_dropped, loads_unwaited, saves,
    saved_tokens, saved_bytes, save_seconds, save_copy_seconds, save_yield_seconds,
    saves_dropped, saves_skipped, save_failures, saves_lost_parent, saves_cancelled; each
    restore's own time for the cost model (``LOAD_KEY`` + request id, not logged).
    """

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: Any) -> SparkCacheStats:
        for key, value in (other.data or {}).items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The totals vLLM logs (the per-tenant ones are left to Prometheus)."""
        out = {key: round(value, 4) if isinstance(value, float) else value
               for key, value in sorted(self.data.items())
               if not key.startswith((TENANT_KEY, LOAD_KEY))}
        lookups = self.data.get("lookups", 0)
        if lookups:
            out["hit_rate"] = round(self.data.get("hits", 0) / lookups, 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


#: Counters exported to Prometheus as ``vllm:sparkcache_<name>`` (``_total``).
PROM_COUNTERS = {
    "lookups": "Prompts looked up in the sparkcache index.",
    "hits": "Requests that restored a prefix from sparkcache.",
    "misses": "Lookups that found nothing restorable beyond vLLM's own prefix hit.",
    "hit_tokens": "Tokens restored from sparkcache (offered and accepted).",
    "remote_hits": "Restores that the shared tier supplied (fetched from another host).",
    "remote_hit_tokens": "Restored tokens that the shared tier supplied.",
    "remote_lookups": "Prompts looked up in the shared tier.",
    "remote_misses": "Shared-tier lookups that found nothing more than the local store.",
    "remote_refused": "Snapshots in the shared tier refused by verification (recomputed).",
    "remote_errors": "Shared-tier lookups that failed: unreachable or refused (recomputed).",
    "remote_timeouts": "Requests that stopped waiting for the shared tier at the deadline.",
    "remote_fetched_bytes": "Bytes fetched from the shared tier.",
    "cost_restored": "Restores the cost model found faster than recomputing.",
    "cost_partial": "Restores of the local part only: the shared tier was slower than recomputing.",
    "cost_too_slow": "Matches recomputed: restoring them was expected to be slower.",
    "coalesced": "Requests that waited for another request's restore of their prefix.",
    "loaded_bytes": "KV bytes copied from sparkcache into the KV cache.",
    "warmed_bytes": "Bytes of stored snapshots read into the page cache at the engine's start.",
    "loads_in_step": "Restores read layer by layer under the forward of their prefill step.",
    "load_failures": "Restores that failed verification or were dropped (recomputed).",
    "load_seconds": "Seconds spent restoring (read, verify, copy).",
    "saved_tokens": "Tokens written to sparkcache (copy-on-write tails).",
    "saved_bytes": "Bytes written to sparkcache.",
    "saves_dropped": "Saves dropped because a queue or the memory bound was full.",
    "save_seconds": "Seconds spent publishing snapshots.",
    "save_yield_seconds": "Seconds publishes waited for a step without prompt tokens.",
    "events_stored_blocks": "Blocks announced as stored (KV events, medium STORAGE).",
    "events_removed_blocks": "Blocks announced as removed (KV events, medium STORAGE).",
    "events_dropped": "KV events dropped: more were waiting for a step than the bound.",
    "events_unannounced": "Snapshots not announced: no block hashes vLLM would match.",
}


#: Counters exported per tenant as ``vllm:sparkcache_tenant_<name>`` (``_total``),
#: with a ``tenant`` label (bounded: :class:`~sparkcache.connector.requests.TenantLabels`).
TENANT_PROM_COUNTERS = {
    "lookups": "Prompts of the tenant looked up in the sparkcache index.",
    "hits": "Requests of the tenant that restored a prefix from sparkcache.",
    "misses": "Lookups of the tenant that found nothing restorable beyond vLLM's own hit.",
    "hit_tokens": "Tokens of the tenant restored from sparkcache.",
}


#: The store's own series, read from its index at each scrape, by model
#: (``model``: its name, ``digest``: the first 12 hex digits of its identity).
STORE_METRICS = {
    "store_bytes": "Bytes of the model's snapshots in the store.",
    "store_snapshots": "Snapshots of the model in the store (any state).",
    "store_evictions": "Snapshots the store evicted, by reason (its evictions.<reason> counters).",
}


class StoreCollector(Collector):
    """``vllm:sparkcache_store_*`` (:data:`STORE_METRICS`) from the store at
    ``folder``, opened at the first scrape and kept; a scrape that cannot read
    it exports the families empty and logs why."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._store: SnapshotStore | None = None
        self._lock = threading.Lock()

    def use(self, folder: str) -> None:
        """Read the store at ``folder`` from the next scrape on."""
        with self._lock:
            if folder != self.folder:
                old, self._store, self.folder = self._store, None, folder
                if old is not None:
                    old.close()

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "digest"]
        size = GaugeMetricFamily("vllm:sparkcache_store_bytes", STORE_METRICS["store_bytes"],
                                 labels=labels)
        count = GaugeMetricFamily("vllm:sparkcache_store_snapshots",
                                  STORE_METRICS["store_snapshots"], labels=labels)
        evictions = CounterMetricFamily("vllm:sparkcache_store_evictions",
                                        STORE_METRICS["store_evictions"],
                                        labels=[*labels, "reason"])
        try:
            with self._lock:
                self._store = self._store or SnapshotStore(self.folder)
                models = self._store.catalog.models()
                counters = self._store.catalog.saved_counters()
        except SparkCacheError as exc:
            logger.warning("sparkcache: the store's metrics are not readable: %s", exc)
            models, counters = [], {}
        for row in models:
            if row.deleted_at is not None:
                continue
            key = [row.name, row.digest[:12]]
            size.add_metric(key, row.nbytes)
            count.add_metric(key, row.snapshots)
            for name, value in sorted(counters.get(row.id, {}).items()):
                if name.startswith("evictions."):
                    evictions.add_metric([*key, name.removeprefix("evictions.")], value)
        yield from (size, count, evictions)


_collector: list[StoreCollector] = []  # the process's one, once registered
_collector_lock = threading.Lock()


def register_store_collector(vllm_config: Any) -> StoreCollector | None:
    """The process's :class:`StoreCollector` in Prometheus's default registry,
    reading the store of the engine built last (one collector per process: two
    would export the same series), or None when the config names no readable
    store settings."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    try:
        folder = ConnectorSettings.from_extra_config(
            getattr(transfer, "kv_connector_extra_config", None)).folder
    except SparkCacheError as exc:
        logger.warning("sparkcache: no store metrics: %s", exc)
        return None
    with _collector_lock:
        if _collector:
            _collector[0].use(folder)
        else:
            collector = StoreCollector(folder)
            REGISTRY.register(collector)
            _collector.append(collector)
        return _collector[0]


class SparkCachePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Per-engine Prometheus counters of :data:`PROM_COUNTERS`, and of
    :data:`TENANT_PROM_COUNTERS` per tenant label; the store's gauges
    (:class:`StoreCollector`) beside them."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per_engine = importlib.import_module("vllm.v1.metrics.utils").create_metric_per_engine
        self.counters = {
            name: per_engine(self._counter_cls(name=f"vllm:sparkcache_{name}",
                                               documentation=doc, labelnames=labelnames),
                             per_engine_labelvalues)
            for name, doc in PROM_COUNTERS.items()
        }
        self.tenant_counters = {
            name: self._counter_cls(name=f"vllm:sparkcache_tenant_{name}", documentation=doc,
                                    labelnames=[*labelnames, "tenant"])
            for name, doc in TENANT_PROM_COUNTERS.items()
        }
        self.store_collector = register_store_collector(vllm_config)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in (transfer_stats_data or {}).items():
            if value <= 0:
                continue
            if name in self.counters:
                self.counters[name][engine_idx].inc(value)
            elif name.startswith(TENANT_KEY):
                label, _, counter = name[len(TENANT_KEY):].rpartition("\x00")
                if counter in self.tenant_counters:
                    engine = self.per_engine_labelvalues.get(engine_idx, [])
                    self.tenant_counters[counter].labels(*engine, label).inc(value)
