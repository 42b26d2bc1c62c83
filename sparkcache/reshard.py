"""Snapshots of another sharding: find them, and read one rank's heads out of them.

A snapshot stored by an engine of one TP size serves an engine of another
when both hold the same KV (the same :meth:`ModelIdentity.kv_digest`): the
engine's rank reads the heads it needs from whichever stored ranks hold them
(:func:`sparkcache.sharding.plan_reads`), each stored rank's pages through the
one verified read (:func:`sparkcache.reader.read_pages`: header, identity,
token ids and every chunk checked, a failure quarantined), and copies their
bytes into pages of its own layout.  A snapshot of a sharding that cannot
serve the engine is refused with :class:`ShardingRefused` (a miss, saying why).
"""

from __future__ import annotations

import numpy as np

from sparkcache.core import Core, Match
from sparkcache.errors import InvalidArgument
from sparkcache.identity import ModelIdentity
from sparkcache.maintenance import live_identities
from sparkcache.reader import read_pages
from sparkcache.sharding import ShardingRefused, copy_heads, plan_reads

__all__ = ["read_resharded", "siblings"]

def siblings(core: Core, identity: ModelIdentity, total_kv_heads: int) -> list[ModelIdentity]:
    """The identities in the index that hold ``identity``'s KV sharded otherwise
    (the same kv digest, another digest), oldest first; none when the
    identity's pages cannot be re-sharded (``kv_digest`` is None)."""
    kv = identity.kv_digest(total_kv_heads)
    if kv is None:
        return []
    own = identity.digest()
    with core.read() as conn:
        rows = live_identities(conn)
    out: list[ModelIdentity] = []
    for _id, other in rows:
        if other.digest() == own:
            continue
        try:
            if other.kv_digest(total_kv_heads) == kv:
                out.append(other)
        except InvalidArgument:  # not a split of these heads
            continue
    return out


def read_resharded(
    core: Core, match: Match, engine: ModelIdentity, tp_rank: int, total_kv_heads: int, *,
    pp_rank: int = 0, n_tokens: int | None = None,
) -> list[np.ndarray]:
    """Engine rank ``tp_rank``'s pages of a snapshot stored under another
    sharding of the same KV (``match.identity``): one uint8 array ``[n_blocks,
    engine.page_nbytes]`` per layer, verified.  ShardingRefused when the pair
    is not supported (sliding windows included: their layers store only a
    window); CorruptSnapshot or NotFound as :func:`read_pages`: a miss."""
    stored = match.identity
    if stored.kv_digest(total_kv_heads) != engine.kv_digest(total_kv_heads) or \
            engine.kv_digest(total_kv_heads) is None:
        raise ShardingRefused("the snapshot holds other KV than this engine's")
    if stored.window_blocks or engine.window_blocks:
        raise ShardingRefused("sliding-window layers are restored only by an engine of "
                              "the same sharding")
    src, dst = stored.sharding(total_kv_heads), engine.sharding(total_kv_heads)
    reads = plan_reads(src, dst, tp_rank)
    head_nbytes = engine.page_nbytes // engine.num_kv_heads
    pages: dict[int, list[np.ndarray]] = {}
    out: list[np.ndarray] = []
    for read in reads:
        if read.src_rank not in pages:
            rank = (pp_rank * stored.tp_size + read.src_rank) * stored.dcp_size
            pages[read.src_rank] = read_pages(core, match, rank, n_tokens, touch=True)
        layers = pages[read.src_rank]
        if not out:
            out = [np.empty((layer.shape[0], engine.page_nbytes), np.uint8) for layer in layers]
        for have, want in zip(layers, out, strict=True):
            copy_heads(have, want, read, head_nbytes)
    return out
