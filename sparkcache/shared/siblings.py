"""Fetches of snapshots that engines of another TP size put in the shared tier.

A snapshot lives in the tier under its engine's model digest, which names the
sharding too (``m-<digest>``), so an engine of TP size 2 finds nothing under
its own digest that an engine of TP size 1 uploaded.  When its own model
holds no prefix of a prompt, :func:`fetch_any_sharding` asks the tier's other
shardings of the same KV (:func:`tier_siblings`: the tier's ``model.json``
identities with this identity's kv digest, a sharding this version can
re-shard from) one after the other, and fetches the first that holds one,
under that sharding's own identity, every stored rank of it: the local
lookup then offers it as any snapshot of another TP size
(:func:`sparkcache.reshard.siblings`, docs/connector.md, "Tensor
parallelism").  The tier's models are listed once per
:data:`SIBLINGS_SECONDS` per tier (one LIST and a GET per model folder, at
most :data:`MAX_MODELS`); every identity read is checked against the digest
that names its folder.  Everything else is :func:`~sparkcache.shared.fetch.fetch_prefix`'s.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from sparkcache.core import Core
from sparkcache.errors import InvalidArgument, SparkCacheError
from sparkcache.identity import ModelIdentity
from sparkcache.reshard import same_kv
from sparkcache.sharding import plan_reads
from sparkcache.shared.fetch import FetchResult, fetch_prefix
from sparkcache.shared.layout import model_key, model_prefix
from sparkcache.shared.tier import SharedTier

__all__ = ["MAX_MODELS", "SIBLINGS_SECONDS", "fetch_any_sharding", "tier_siblings"]

logger = logging.getLogger(__name__)

#: How long a listing of the tier's models is used before it is made again.
SIBLINGS_SECONDS = 300.0
#: Model folders read at most per listing (the tier's others are not asked).
MAX_MODELS = 64
_PREFIX = "m-"


def _identity_at(tier: SharedTier, folder: str) -> ModelIdentity | None:
    """The identity in ``folder``'s ``model.json``, when it is one and its
    digest names the folder (None: absent, unparsable or another's)."""
    digest = folder[len(_PREFIX):]
    try:
        raw = tier.get(model_key(digest))
        if raw is None:
            return None
        identity = ModelIdentity.from_dict(json.loads(raw))
    except (InvalidArgument, ValueError, TypeError):
        return None
    return identity if model_prefix(identity.digest()) == folder else None


def _list_models(tier: SharedTier) -> list[ModelIdentity]:
    found: list[ModelIdentity] = []
    folders = sorted(f for f in tier.backend.folders("") if f.startswith(_PREFIX))
    for folder in folders[:MAX_MODELS]:
        identity = _identity_at(tier, folder)
        if identity is not None:
            found.append(identity)
    return found


def tier_siblings(tier: SharedTier, identity: ModelIdentity,
                  total_kv_heads: int) -> list[ModelIdentity]:
    """The tier's identities that hold ``identity``'s KV sharded otherwise and
    that this version re-shards into ``identity``'s sharding (none when its
    pages cannot be re-sharded, or the KV heads in all are unknown, 0).  The
    tier's listing is kept :data:`SIBLINGS_SECONDS`; raises SparkCacheError
    when the tier fails."""
    if total_kv_heads <= 0 or identity.window_blocks:
        return []
    try:
        kin = same_kv(identity, total_kv_heads,
                      lambda: tier.cached("models", SIBLINGS_SECONDS, lambda: _list_models(tier)))
    except InvalidArgument:  # this engine's heads are no split of total_kv_heads
        return []
    out = []
    for other in kin:
        try:  # (ShardingRefused is an InvalidArgument)
            plan_reads(other.sharding(total_kv_heads), identity.sharding(total_kv_heads), 0)
        except InvalidArgument:
            continue
        out.append(other)
    return out


def fetch_any_sharding(core: Core, tier: SharedTier, identity: ModelIdentity,
                       token_ids: Sequence[int] | np.ndarray, *, total_kv_heads: int,
                       hashes: Sequence[bytes] | None = None, **options: Any) -> FetchResult:
    """:func:`fetch_prefix` for ``identity``; on a miss, for each of
    :func:`tier_siblings` in turn (their own prefix hashes), until one holds a
    prefix.  ``options`` are :func:`fetch_prefix`'s; the result's ``requests``
    and ``seconds`` count every sharding asked.  A miss is counted once."""
    started = time.perf_counter()
    first = fetch_prefix(core, tier, identity, token_ids, hashes=hashes, count_miss=False,
                         **options)
    if first.outcome != "miss":
        return first
    requests, result = first.requests, first
    try:
        others = tier_siblings(tier, identity, total_kv_heads)
    except SparkCacheError as exc:  # the tier's models unlisted: this request's miss
        logger.warning("sparkcache: the shared tier's other shardings were not listed: %s", exc)
        others = []
    for other in others:
        result = fetch_prefix(core, tier, other, token_ids, count_miss=False, **options)
        requests += result.requests
        if result.outcome != "miss":
            break
    if result.outcome == "miss":
        core.count(0, "fetch_misses")
    result.requests = requests
    result.seconds = time.perf_counter() - started
    return result
