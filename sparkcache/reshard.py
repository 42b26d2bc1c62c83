"""Snapshots of another sharding: find them, and read one rank's heads out of them.

A snapshot stored by an engine of one TP size serves an engine of another
when both hold the same KV (the same :meth:`ModelIdentity.kv_digest`): the
engine's rank reads the heads it needs from whichever stored ranks hold them
(:func:`sparkcache.sharding.plan_reads`), each stored rank's pages through the
one verified read (:func:`sparkcache.reader.read_into`: header, identity,
token ids and every chunk checked, a failure quarantined), and each verified
chunk's heads go straight into the engine's pages (:class:`HeadSink`).  A
snapshot of a sharding that cannot serve the engine is refused with
:class:`ShardingRefused` (a miss, saying why).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from sparkcache.buffers import as_byte_view
from sparkcache.core import Core, Match
from sparkcache.errors import InvalidArgument
from sparkcache.identity import ModelIdentity
from sparkcache.maintenance import live_identities
from sparkcache.reader import read_into
from sparkcache.sharding import HeadRead, ShardingRefused, plan_reads

__all__ = ["HeadSink", "read_resharded", "same_kv", "siblings"]

def same_kv(identity: ModelIdentity, total_kv_heads: int,
            candidates: Callable[[], Iterable[ModelIdentity]]) -> list[ModelIdentity]:
    """Those of ``candidates()`` that hold ``identity``'s KV sharded otherwise
    (the same kv digest, another digest), in their order; none, and
    ``candidates`` not called, when the identity's pages cannot be re-sharded
    (``kv_digest`` is None).  The index's (:func:`siblings`) and a shared
    tier's (:func:`sparkcache.shared.siblings.tier_siblings`)."""
    kv = identity.kv_digest(total_kv_heads)
    if kv is None:
        return []
    own = identity.digest()
    out: list[ModelIdentity] = []
    for other in candidates():
        if other.digest() == own:
            continue
        try:
            if other.kv_digest(total_kv_heads) == kv:
                out.append(other)
        except InvalidArgument:  # not a split of these heads
            continue
    return out


def siblings(core: Core, identity: ModelIdentity, total_kv_heads: int) -> list[ModelIdentity]:
    """The identities in the index that hold ``identity``'s KV sharded otherwise
    (:func:`same_kv`), oldest first."""
    def rows() -> list[ModelIdentity]:
        with core.read() as conn:
            return [other for _id, other in live_identities(conn)]
    return same_kv(identity, total_kv_heads, rows)


class HeadSink:
    """A read's destination in the stored pages' bytes that keeps only some
    heads of each page, written straight into the engine's pages.

    ``pieces`` are the engine's destination pages (flat buffers, each a whole
    number of ``dst_page`` bytes: runs of KV blocks, in the order of the pages
    they receive); a write of stored bytes ``[at, at + n)`` (stored page ``p``
    is bytes ``[p * src_page, (p + 1) * src_page)``) copies each of ``runs``'
    byte ranges ``(src offset, dst offset, length)`` of the pages it covers
    into the same page of ``pieces``; the other bytes are dropped.  Writes
    may cut pages anywhere (a verified chunk is not a whole number of pages).
    """

    __slots__ = ("_firsts", "_pieces", "_runs", "dst_page", "size", "src_page")

    def __init__(self, pieces: Sequence[Any], runs: Sequence[tuple[int, int, int]],
                 src_page: int, dst_page: int) -> None:
        self._pieces: list[np.ndarray] = []
        self._firsts: list[int] = []
        n_pages = 0
        for piece in pieces:
            flat = as_byte_view(piece, writable=True)
            if flat.size % dst_page:
                raise InvalidArgument(f"a destination of {flat.size} bytes is not a whole "
                                      f"number of {dst_page}-byte pages")
            self._firsts.append(n_pages)
            self._pieces.append(flat.reshape(-1, dst_page))
            n_pages += flat.size // dst_page
        for at_src, at_dst, length in runs:
            if at_src + length > src_page or at_dst + length > dst_page or length <= 0:
                raise InvalidArgument(f"heads at {at_src}+{length} bytes exceed pages of "
                                      f"{src_page} and {dst_page} bytes")
        self._runs = list(runs)
        self.src_page, self.dst_page = src_page, dst_page
        self.size = n_pages * src_page

    def put(self, at: int, data: np.ndarray) -> None:
        """Keep the heads of stored bytes ``[at, at + data.size)``."""
        if at < 0 or at + data.size > self.size:
            raise InvalidArgument(f"{data.size} bytes at {at} exceed {self.size} bytes")
        page = self.src_page
        end = at + data.size
        first, last = -(-at // page), end // page  # the whole pages covered
        if first > last:  # inside one page
            self._part(at, data)
            return
        lead = first * page - at
        if lead:
            self._part(at, data[:lead])
        if last > first:
            rows = data[lead:lead + (last - first) * page].reshape(-1, page)
            self._rows(first, rows)
        if end > last * page:
            self._part(last * page, data[(last - first) * page + lead:])

    def _rows(self, first: int, rows: np.ndarray) -> None:
        """Whole stored pages ``first, first + 1, ...`` (one per row)."""
        done = 0
        i = bisect.bisect_right(self._firsts, first) - 1
        while done < rows.shape[0]:
            piece = self._pieces[i]
            offset = first + done - self._firsts[i]
            count = min(rows.shape[0] - done, piece.shape[0] - offset)
            for at_src, at_dst, length in self._runs:
                piece[offset:offset + count, at_dst:at_dst + length] = \
                    rows[done:done + count, at_src:at_src + length]
            done += count
            i += 1

    def _part(self, at: int, data: np.ndarray) -> None:
        """Bytes inside one stored page."""
        p, begin = divmod(at, self.src_page)
        stop = begin + data.size
        i = bisect.bisect_right(self._firsts, p) - 1
        row = self._pieces[i][p - self._firsts[i]]
        for at_src, at_dst, length in self._runs:
            lo, hi = max(begin, at_src), min(stop, at_src + length)
            if lo < hi:
                row[at_dst + lo - at_src:at_dst + hi - at_src] = data[lo - begin:hi - begin]


def _checked_pair(match: Match, engine: ModelIdentity, tp_rank: int,
                  total_kv_heads: int) -> list[HeadRead]:
    """The reads of engine rank ``tp_rank`` (ShardingRefused: the pair is not supported)."""
    stored = match.identity
    if stored.kv_digest(total_kv_heads) != engine.kv_digest(total_kv_heads) or \
            engine.kv_digest(total_kv_heads) is None:
        raise ShardingRefused("the snapshot holds other KV than this engine's")
    if stored.window_blocks or engine.window_blocks:
        raise ShardingRefused("sliding-window layers are restored only by an engine of "
                              "the same sharding")
    return plan_reads(stored.sharding(total_kv_heads), engine.sharding(total_kv_heads),
                      tp_rank)


def read_resharded(
    core: Core, match: Match, engine: ModelIdentity, tp_rank: int, total_kv_heads: int,
    out: Sequence[Sequence[Any]], *, pp_rank: int = 0, n_tokens: int | None = None,
    start_tokens: int = 0, threads: int = 1, cpus: Sequence[int] = (),
    on_layer: Callable[[int], None] | None = None, hit: bool = True,
) -> None:
    """Engine rank ``tp_rank``'s heads of tokens ``[start_tokens, n_tokens)`` of a
    snapshot stored under another sharding of the same KV, verified and
    written straight into ``out`` (per layer, the engine's destination pages:
    flat buffers, runs of blocks in order; page 0 receives block
    ``start_tokens // block_size``).  Each stored rank that holds some of the
    heads is read once (:func:`sparkcache.reader.read_into`: every chunk
    verified before its heads are copied); ``on_layer(i)`` runs once layer
    ``i`` holds every stored rank's heads.  The restore is one hit, counted
    by the last stored rank's read (``hit`` False: none, as :func:`read_into`);
    each stored rank's read counts its restored amounts.  ShardingRefused when
    the pair is not supported (sliding windows included: their layers store
    only a window); CorruptSnapshot or NotFound as :func:`read_into`: a miss,
    which may leave ``out`` partly written with verified bytes."""
    stored = match.identity
    reads = _checked_pair(match, engine, tp_rank, total_kv_heads)
    head_nbytes = engine.page_nbytes // engine.num_kv_heads
    by_rank: dict[int, list[tuple[int, int, int]]] = {}
    for read in reads:
        by_rank.setdefault(read.src_rank, []).append(read.byte_range(head_nbytes))
    for k, (src_rank, runs) in enumerate(sorted(by_rank.items())):
        rank = (pp_rank * stored.tp_size + src_rank) * stored.dcp_size
        sinks = [HeadSink(layer, runs, stored.page_nbytes, engine.page_nbytes)
                 for layer in out]
        last = k == len(by_rank) - 1
        read_into(core, match, rank, sinks, n_tokens=n_tokens, start_tokens=start_tokens,
                  threads=threads, cpus=cpus, on_layer=on_layer if last else None,
                  hit=hit and last)
