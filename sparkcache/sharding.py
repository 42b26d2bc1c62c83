"""How a model's KV heads are sharded over tensor-parallel ranks, and which
bytes of which stored rank's pages another sharding needs.

vLLM splits the KV heads of every layer over the TP ranks in contiguous
slices: rank ``r`` of ``tp`` holds heads ``[r * H / tp, (r + 1) * H / tp)`` of
``H``, and when ``tp > H`` each head is replicated on ``tp / H`` ranks (rank
``r`` holds head ``r // (tp / H)``).  A stored page is one block of one layer
in the logical ``[heads, tokens, content]`` order of vLLM 0.32's KV view
(what :class:`sparkcache.cuda.KVPages` gathers, whatever the physical layout;
on CPU the registered tensor is ``[blocks, heads, block_size, 2 * head_size]``
with K and V inside each head's slot), so the heads ``[a, b)`` of a page are
the bytes ``[a * head_nbytes, b * head_nbytes)``.

:func:`plan_reads` turns a stored sharding and an engine's into, for one
engine rank, the stored ranks to read and the byte range of each of their
pages that lands where in the engine's page.  An unsupported pair is refused
with :class:`ShardingRefused`, whose message says why (a clean miss).

Pure arithmetic: no store, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparkcache.errors import InvalidArgument

__all__ = ["HeadRead", "Sharding", "ShardingRefused", "copy_heads", "plan_reads"]


class ShardingRefused(InvalidArgument):
    """A snapshot of this sharding cannot serve that engine: a miss, for the
    reason the message gives (not damage, nothing is quarantined)."""


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Sharding:
    """How one engine's ranks share a model's KV: ``kv_heads`` in all (before
    any split), over ``tp`` tensor-parallel ranks (``pp`` pipeline stages,
    ``dcp`` decode-context ranks); ``mla``: the KV is one latent per token,
    not heads."""

    kv_heads: int
    tp: int = 1
    pp: int = 1
    dcp: int = 1
    mla: bool = False

    def __post_init__(self) -> None:
        for name in ("kv_heads", "tp", "pp", "dcp"):
            _positive(name, getattr(self, name))

    @property
    def splits(self) -> bool:
        """Whether the heads divide over the ranks (or the ranks over the heads)."""
        return self.kv_heads % self.tp == 0 or self.tp % self.kv_heads == 0

    @property
    def local_heads(self) -> int:
        """The KV heads each rank holds (1 when heads are replicated)."""
        return max(1, self.kv_heads // self.tp)

    def heads_of(self, tp_rank: int) -> tuple[int, int]:
        """The heads ``[start, stop)`` tensor-parallel rank ``tp_rank`` holds."""
        if not isinstance(tp_rank, int) or not 0 <= tp_rank < self.tp:
            raise InvalidArgument(f"tp_rank must be in [0, {self.tp}), got {tp_rank!r}")
        if not self.splits:
            raise ShardingRefused(f"{self.kv_heads} KV heads do not divide over "
                                  f"{self.tp} tensor-parallel ranks")
        if self.tp <= self.kv_heads:
            start = tp_rank * self.local_heads
            return start, start + self.local_heads
        head = tp_rank // (self.tp // self.kv_heads)
        return head, head + 1

    def describe(self) -> str:
        """``tp=2 (heads 2/rank)``, for people."""
        parts = [f"tp={self.tp}"]
        parts += [f"{k}={v}" for k, v in (("pp", self.pp), ("dcp", self.dcp)) if v != 1]
        if self.mla:
            parts.append("mla")
        return " ".join(parts) + f" ({self.local_heads} of {self.kv_heads} KV heads/rank)"


@dataclass(frozen=True)
class HeadRead:
    """Heads ``[src_head, src_head + n_heads)`` of stored tensor-parallel rank
    ``src_rank``'s pages land at head ``dst_head`` of the engine rank's pages."""

    src_rank: int
    src_head: int
    dst_head: int
    n_heads: int

    def byte_range(self, head_nbytes: int) -> tuple[int, int, int]:
        """(offset in the stored page, offset in the engine's page, length), in bytes."""
        return (self.src_head * head_nbytes, self.dst_head * head_nbytes,
                self.n_heads * head_nbytes)


def _refusal(stored: Sharding, engine: Sharding) -> str | None:
    """Why a snapshot of ``stored`` cannot serve ``engine`` (None: it can)."""
    if stored.kv_heads != engine.kv_heads:
        return (f"the snapshot has {stored.kv_heads} KV heads, the engine "
                f"{engine.kv_heads}: another model")
    if stored == engine:
        return None
    if stored.mla or engine.mla:
        return ("an MLA cache (one latent per token, on every rank) is restored only by "
                "an engine of the same sharding")
    if stored.dcp != 1 or engine.dcp != 1:
        return ("decode context parallelism splits tokens over ranks: a snapshot is "
                "restored only by an engine of the same sharding")
    if stored.pp != engine.pp:
        return (f"pipeline parallel sizes differ (stored pp={stored.pp}, engine "
                f"pp={engine.pp}): layer ranges are not re-split")
    for side, sharding in (("stored", stored), ("engine", engine)):
        if not sharding.splits:
            return (f"{sharding.kv_heads} KV heads do not divide over the {side} "
                    f"tp={sharding.tp} ranks")
    return None


def plan_reads(stored: Sharding, engine: Sharding, tp_rank: int) -> list[HeadRead]:
    """What engine tensor-parallel rank ``tp_rank`` reads of a snapshot stored
    under ``stored``: runs of heads, in the engine page's head order, each
    from the lowest stored rank holding them.  Raises ShardingRefused (a
    miss, saying why) for a pair this version does not re-shard; the same
    sharding is one read of the same rank, whole pages."""
    why = _refusal(stored, engine)
    if why is not None:
        raise ShardingRefused(f"cannot restore a snapshot stored with {stored.describe()} "
                              f"in an engine with {engine.describe()}: {why}")
    if stored == engine:
        return [HeadRead(tp_rank, 0, 0, engine.local_heads)]
    want_start, want_stop = engine.heads_of(tp_rank)
    owners = [stored.heads_of(r) for r in range(stored.tp)]
    reads: list[HeadRead] = []
    for head in range(want_start, want_stop):
        src = next(r for r, (lo, hi) in enumerate(owners) if lo <= head < hi)
        src_head, dst_head = head - owners[src][0], head - want_start
        last = reads[-1] if reads else None
        if (last is not None and last.src_rank == src
                and last.src_head + last.n_heads == src_head):
            reads[-1] = HeadRead(src, last.src_head, last.dst_head, last.n_heads + 1)
        else:
            reads.append(HeadRead(src, src_head, dst_head, 1))
    return reads


def copy_heads(src: np.ndarray, dst: np.ndarray, read: HeadRead, head_nbytes: int) -> None:
    """Copy ``read``'s heads of every page of ``src`` (stored pages, ``[n,
    src_page_nbytes]`` bytes) into the pages of ``dst`` (``[n, dst_page_nbytes]``)."""
    if src.ndim != 2 or dst.ndim != 2 or src.shape[0] != dst.shape[0]:
        raise InvalidArgument(f"pages of shapes {src.shape} and {dst.shape}: expected "
                              "[n, page bytes] each, the same n")
    at_src, at_dst, length = read.byte_range(head_nbytes)
    if at_src + length > src.shape[1] or at_dst + length > dst.shape[1]:
        raise InvalidArgument(f"heads {read} of {head_nbytes} bytes exceed pages of "
                              f"{src.shape[1]} and {dst.shape[1]} bytes")
    dst[:, at_dst:at_dst + length] = src[:, at_src:at_src + length]
