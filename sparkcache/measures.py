"""The cost model's measurements kept in the index (``costs``, revision 0011).

What restoring and recomputing cost on this host, as the connector measured it
(docs/connector.md, "Restore or recompute"): one :class:`CostRow` per rate.
The connector reads them when it starts and writes what it learned every few
seconds; ``sparkcache stats`` lists them.  Every function takes the narrow
:class:`~sparkcache.core.Core`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sparkcache.core import Core, select_all
from sparkcache.errors import InvalidArgument
from sparkcache.index import queries as q

__all__ = ["MAX_ROWS", "CostRow", "all_costs", "costs", "record_costs"]

#: Rows one record may write at most (a model's buckets and the host's sources).
MAX_ROWS = 256
_MAX_NAME = 512


@dataclass(frozen=True)
class CostRow:
    """One measured rate (``queries.COST_COLUMNS``; docs/index.md, "costs")."""

    model: str  # the identity digest ('' for a source the host's engines share)
    source: str  # 'prefill', 'step', 'local_warm', 'local_cold', 'verify', 'tier ...'
    bucket: int  # prefill: ceil(log2(prompt tokens)); else 0
    unit_s: float  # seconds per token (prefill) or per byte (a restore)
    latency_s: float  # the fixed seconds of one use
    samples: int
    updated_at: float


def _check(row: CostRow) -> tuple[object, ...]:
    numbers = (row.unit_s, row.latency_s, row.updated_at)
    if not (isinstance(row.model, str) and isinstance(row.source, str) and row.source
            and len(row.model) <= _MAX_NAME and len(row.source) <= _MAX_NAME
            and all(isinstance(n, (int, float)) and math.isfinite(n) and n >= 0
                    for n in numbers)
            and isinstance(row.bucket, int) and 0 <= row.bucket < 64
            and isinstance(row.samples, int) and row.samples >= 0):
        raise InvalidArgument(f"not a cost row: {row!r}")
    return (row.model, row.source, row.bucket, float(row.unit_s), float(row.latency_s),
            row.samples, float(row.updated_at))


def record_costs(core: Core, rows: Sequence[CostRow]) -> None:
    """Write ``rows`` in one transaction (each replaces the row of its key)."""
    if len(rows) > MAX_ROWS:
        raise InvalidArgument(f"at most {MAX_ROWS} cost rows at once, got {len(rows)}")
    params = [_check(row) for row in rows]
    if not params:
        return
    with core.write() as conn:
        for values in params:
            conn.execute(q.UPSERT_COST, values)


def costs(core: Core, model: str) -> list[CostRow]:
    """The rates of the engine whose identity digest is ``model`` and the host's."""
    with core.read() as conn:
        return select_all(conn, q.COSTS_OF_MODEL, (model,), into=CostRow)


def all_costs(core: Core) -> list[CostRow]:
    """Every rate the index holds, by model, source and bucket."""
    with core.read() as conn:
        return select_all(conn, q.ALL_COSTS, into=CostRow)
