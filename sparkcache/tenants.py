"""Tenants: each tenant's snapshots and requests per model, and its limits.

A tenant is the name a request's scope carries (docs/serve.md, "Tenants"):
the store records it on every snapshot the request publishes
(``snapshots.tenant``, revision 0009) and the server on the request's log row.
:func:`tenant_usage` sums both per (model, tenant) for ``sparkcache tenants``
and the page; :func:`trim_tenant` evicts one tenant's least recently used
snapshots of a budget group beyond ``SPARK_KV_CACHE_TENANT_ENTRIES`` and
``SPARK_KV_CACHE_TENANT_MB`` (leased and pinned ones stay, as for the
per-model limits); :func:`tenants_of` lists a group's tenants for the
sweeper.  Every function takes the narrow :class:`~sparkcache.core.Core`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sparkcache.core import Conn, Core
from sparkcache.index import queries as q
from sparkcache.maintenance import evict_lru

__all__ = ["TenantLimits", "TenantUsage", "tenant_usage", "tenants_of", "trim_tenant"]


@dataclass(frozen=True)
class TenantUsage:
    """One tenant of one model: its snapshots and its requests in the log."""

    model_id: int
    tenant: str
    snapshots: int = 0
    nbytes: int = 0
    requests: int = 0  # in the request log (which keeps the newest rows only)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # live + restored

    @property
    def hit_rate(self) -> float:
        """The share of its prompt tokens not computed; 0.0 without requests."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class TenantLimits:
    """Per-tenant limits within a model's: 0 means none."""

    entries: int = 0
    nbytes: int = 0

    @property
    def any(self) -> bool:
        return bool(self.entries or self.nbytes)


def tenant_usage(core: Core, *, model_id: int | None = None) -> list[TenantUsage]:
    """Every tenant of every model (of one, when given) with snapshots or logged
    requests, by model, then most requests, most bytes, name."""
    found: dict[tuple[int, str], dict[str, int]] = {}
    with core.read() as conn:
        for mid, tenant, count, nbytes in conn.execute(q.TENANT_SNAPSHOT_SUMS):
            found.setdefault((int(mid), str(tenant)), {}).update(
                snapshots=int(count), nbytes=int(nbytes))
        for mid, tenant, requests, prompt, cached in conn.execute(q.TENANT_REQUEST_SUMS):
            if mid is None:  # never reached the engine: no model to count it under
                continue
            found.setdefault((int(mid), str(tenant)), {}).update(
                requests=int(requests), prompt_tokens=int(prompt), cached_tokens=int(cached))
    rows = [TenantUsage(mid, tenant, **sums) for (mid, tenant), sums in found.items()
            if model_id is None or mid == model_id]
    return sorted(rows, key=lambda r: (r.model_id, -r.requests, -r.nbytes, r.tenant))


def tenants_of(conn: Conn, model_ids: Sequence[int]) -> list[tuple[str, int, int]]:
    """The tenants with snapshots in these models: (tenant, snapshots, bytes),
    most bytes first."""
    return [(str(t), int(c), int(n)) for t, c, n in
            conn.execute(q.TENANTS_OF_MODELS, (json.dumps([int(i) for i in model_ids]),))]


def _usage(core: Core, model_ids: Sequence[int], tenant: str) -> tuple[int, int]:
    with core.read() as conn:
        row = conn.execute(q.TENANT_USAGE, (tenant, json.dumps([int(i) for i in model_ids]))
                           ).fetchone()
    return (0, 0) if row is None else (int(row[0]), int(row[1]))


def trim_tenant(core: Core, model_ids: Sequence[int], tenant: str, limits: TenantLimits, *,
                keep: Iterable[int] = ()) -> dict[str, list[int]]:
    """Evict ``tenant``'s least recently used snapshots of these models (a budget
    group) beyond ``limits``: ``tenant_entries`` first, then ``tenant_budget``;
    never the ids in ``keep``, nor leased or pinned ones.  Returns the evicted
    ids by reason."""
    out: dict[str, list[int]] = {}
    if not limits.any:
        return out
    keep = tuple(keep)
    count, nbytes = _usage(core, model_ids, tenant)
    if limits.entries and count > limits.entries:
        out["tenant_entries"] = evict_lru(core, model_ids=model_ids, tenant=tenant,
                                          count=count - limits.entries, keep=keep,
                                          reason="tenant_entries")
        count, nbytes = _usage(core, model_ids, tenant)
    if limits.nbytes and nbytes > limits.nbytes:
        out["tenant_budget"] = evict_lru(core, model_ids=model_ids, tenant=tenant,
                                         free_bytes=nbytes - limits.nbytes, keep=keep,
                                         reason="tenant_budget")
    return {k: v for k, v in out.items() if v}
