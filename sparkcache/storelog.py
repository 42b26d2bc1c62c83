"""The store's request log: the rows each request leaves, their summaries, and
the connector's measured costs.

:class:`StoreLog` is a base class of :class:`~sparkcache.store.SnapshotStore`
holding these verbs beside :class:`~sparkcache.upkeep.StoreUpkeep`: each calls
one function of :mod:`sparkcache.requestlog` (docs/index.md, "request_log") or
:mod:`sparkcache.measures` ("costs") on the store's core.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sparkcache import measures, requestlog, tenants
from sparkcache.core import Core
from sparkcache.measures import CostRow
from sparkcache.requestlog import KeySummary, LogSummary, RequestRow, Timeline, Ttfts
from sparkcache.tenants import TenantUsage

__all__ = ["StoreLog"]


class StoreLog:
    """The request log verbs of :class:`~sparkcache.store.SnapshotStore` (a base class)."""

    _core: Core

    def log_requests(self, rows: Sequence[Mapping[str, Any]], *, keep: int) -> None:
        """Record request log rows (docs/index.md, "request_log";
        :func:`sparkcache.requestlog.record`).

        Args:
            rows: by request id; a row already logged is filled in.
            keep: the newest rows kept.
        """
        requestlog.record(self._core, rows, keep=keep)

    def requests(self, *, model_id: int | None = None, limit: int = 50,
                 after_seq: int | None = None) -> list[RequestRow]:
        """The logged requests (:func:`sparkcache.requestlog.requests`).

        Args:
            model_id: only this model's.
            limit: at most this many.
            after_seq: those logged after this ``seq``, oldest first (else the
                newest, newest first).
        """
        return requestlog.requests(self._core, model_id=model_id, limit=limit,
                                   after_seq=after_seq)

    def request(self, request_id: str) -> RequestRow | None:
        """One logged request, or None.

        Args:
            request_id: vLLM's request id.
        """
        return requestlog.request(self._core, request_id)

    def request_by_answer(self, answer_id: str) -> RequestRow | None:
        """The logged request whose answer had this id (``msg_...``, ``resp_...``), or None.

        Args:
            answer_id: the id the client saw on the answer.
        """
        return requestlog.by_answer(self._core, answer_id)

    def request_summary(self, *, model_id: int | None = None) -> LogSummary:
        """Requests and token sums over the request log.

        Args:
            model_id: only this model's.
        """
        return requestlog.summary(self._core, model_id=model_id)

    def requests_by_key(self, *, model_id: int | None = None) -> list[KeySummary]:
        """The request log summed per ``prompt_cache_key``, most requests first.

        Args:
            model_id: only this model's.
        """
        return requestlog.by_cache_key(self._core, model_id=model_id)

    def request_timeline(self, model_id: int, *, buckets: int = 48) -> Timeline | None:
        """One model's counted requests summed per time bucket, for charts
        (:func:`sparkcache.requestlog.timeline`); None when it has none.

        Args:
            model_id: the model's id.
            buckets: at most this many buckets.
        """
        return requestlog.timeline(self._core, model_id, buckets=buckets)

    def request_ttfts(self, model_id: int) -> Ttfts:
        """One model's first-token times, of hits and of misses, sorted
        (:func:`sparkcache.requestlog.ttfts`).

        Args:
            model_id: the model's id.
        """
        return requestlog.ttfts(self._core, model_id)

    def tenants(self, *, model_id: int | None = None) -> list[TenantUsage]:
        """Every tenant's snapshots and logged requests, per model
        (:func:`sparkcache.tenants.tenant_usage`).

        Args:
            model_id: only this model's.
        """
        return tenants.tenant_usage(self._core, model_id=model_id)

    def costs(self, model: str | None = None) -> list[CostRow]:
        """The connector's measured rates (:mod:`sparkcache.measures`).

        Args:
            model: an identity digest: that engine's rates and the host's shared
                ones; None: every row.
        """
        if model is None:
            return measures.all_costs(self._core)
        return measures.costs(self._core, model)

    def record_costs(self, rows: Sequence[CostRow]) -> None:
        """Keep measured rates, each replacing the row of its key, in one transaction.

        Args:
            rows: at most :data:`sparkcache.measures.MAX_ROWS`.
        """
        measures.record_costs(self._core, rows)
