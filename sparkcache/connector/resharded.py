"""Restores of snapshots stored by engines of another TP size, both sides.

The scheduler looks for a snapshot of the engine's own sharding first; when
none holds the whole prompt, :func:`sibling_match` looks under the index's
other shardings of the same KV that the engine restores from
(:func:`restorable_siblings`, kept a few seconds by :class:`Siblings`), the
longer match is restored, and the load job names its sharding
(``LoadJob.source``).  Each worker then reads the
heads it needs from whichever stored ranks hold them, verified
(:func:`sparkcache.reshard.read_resharded`), and writes them into the
request's blocks: straight into a KV cache in host memory, else assembled and
scattered (:func:`load_resharded`).  docs/connector.md, "Tensor
parallelism".
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sparkcache.connector.jobs import Counters, LoadJob
from sparkcache.errors import SparkCacheError
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.sharding import ShardingRefused, plan_reads
from sparkcache.store import Match, SnapshotStore

__all__ = ["SIBLINGS_SECONDS", "Siblings", "load_resharded", "restorable_siblings",
           "sibling_match"]

logger = logging.getLogger("vllm.sparkcache")

#: How long an engine keeps its list of the other shardings it restores from
#: before it reads the index's models again.
SIBLINGS_SECONDS = 5.0


def restorable_siblings(store: SnapshotStore, identity: ModelIdentity, total_kv_heads: int,
                        *, warn: bool = True) -> list[ModelIdentity]:
    """The store's other shardings of ``identity``'s KV that this engine
    restores from (:func:`sibling_match` looks among them; the engine's start
    reads theirs into the page cache and announces them as KV events): none
    when the model's KV heads in all are unknown (``total_kv_heads`` 0) or it
    has a sliding window; a sharding this version does not re-split into the
    engine's is left out, with a warning when ``warn``."""
    if total_kv_heads <= 0 or identity.window_blocks:
        return []
    found = []
    for other in store.siblings(identity, total_kv_heads):
        try:
            plan_reads(other.sharding(total_kv_heads), identity.sharding(total_kv_heads), 0)
        except SparkCacheError as exc:
            if warn:
                logger.warning("sparkcache: snapshots of %s not looked up: %s",
                               other.digest(), exc)
            continue
        found.append(other)
    return found


class Siblings:
    """One engine's :func:`restorable_siblings`, read from the index at most
    every ``seconds`` (a request whose prompt its own sharding does not hold
    whole looks among them: the models' rows are not read for each one).  A
    sharding that is refused is warned about at the first read only."""

    def __init__(self, store: SnapshotStore, identity: ModelIdentity, *,
                 seconds: float = SIBLINGS_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.identity, self.seconds, self.clock = store, identity, seconds, clock
        self._read = (-math.inf, 0)  # when, for which total_kv_heads
        self._found: list[ModelIdentity] = []

    def __call__(self, total_kv_heads: int, fresh: bool = False) -> list[ModelIdentity]:
        """The other shardings (none while ``total_kv_heads`` is 0: unknown);
        ``fresh``: read now (a fetch from the shared tier may have brought one)."""
        now = self.clock()
        at, heads = self._read
        if fresh or heads != total_kv_heads or now - at >= self.seconds:
            self._found = restorable_siblings(self.store, self.identity, total_kv_heads,
                                              warn=at == -math.inf)
            self._read = (now, total_kv_heads)
        return self._found


def sibling_match(store: SnapshotStore, identity: ModelIdentity, total_kv_heads: int,
                  tokens: np.ndarray, scope: RequestScope | None,
                  others: Sequence[ModelIdentity] | None = None) -> Match | None:
    """The longest match of ``tokens`` among snapshots of other shardings of
    ``identity``'s KV that this engine can restore (None: none, or the model's
    KV heads in all are unknown, ``total_kv_heads`` 0); ``others``: those
    shardings, already known (:class:`Siblings`)."""
    best: Match | None = None
    if others is None:
        others = restorable_siblings(store, identity, total_kv_heads)
    for other in others:
        try:
            match = store.lookup(other, tokens, scope=scope)
        except SparkCacheError as exc:
            logger.warning("sparkcache: snapshots of %s not looked up: %s",
                           other.digest(), exc)
            continue
        if match is not None and (best is None or match.n_tokens > best.n_tokens):
            best = match
    return best


def load_resharded(store: SnapshotStore, identity: ModelIdentity, rank: int,
                   total_kv_heads: int, job: LoadJob, pages: Any,
                   block_ids: Sequence[int], counters: Counters, *, threads: int = 1,
                   cpus: Sequence[int] = (), hit: bool = True) -> None:
    """Restore ``job`` (a snapshot of ``job.source``'s sharding) into this
    worker's ``block_ids`` of ``pages`` (one KV cache group): this rank's heads,
    read verified from the stored ranks holding them.  Where the pages are the
    host's own memory (``block_views``) each stored chunk's heads go straight
    into the KV cache (counted in ``loads_direct``); else whole pages are
    read, re-sharded and scattered.  ``hit`` False: the store counts the
    restored amounts but no hit (a restore's first part).  Raises a
    SparkCacheError (a miss, vLLM recomputes) when it cannot."""
    if job.source is None or total_kv_heads <= 0:
        raise ShardingRefused("the model's KV heads in all are unknown")
    tp_rank = rank // identity.dcp_size % identity.tp_size
    pp_rank = rank // (identity.dcp_size * identity.tp_size)
    match = Match(job.snapshot_id, job.n_tokens, job.source, job.token_ids)
    start = (job.n_tokens // identity.block_size - len(block_ids)) * identity.block_size
    views = pages.block_views(block_ids)
    if views is not None:
        store.read_resharded(match, identity, tp_rank, total_kv_heads, views, pp_rank=pp_rank,
                             n_tokens=job.n_tokens, start_tokens=start, threads=threads,
                             cpus=cpus, hit=hit)
        counters.add("loads_direct")
        return
    layers = [np.empty((len(block_ids), identity.page_nbytes), np.uint8)
              for _ in range(identity.num_layers)]
    store.read_resharded(match, identity, tp_rank, total_kv_heads,
                         [[layer.reshape(-1)] for layer in layers], pp_rank=pp_rank,
                         n_tokens=job.n_tokens, start_tokens=start, threads=threads, cpus=cpus,
                         hit=hit)
    pages.scatter(block_ids, layers)
