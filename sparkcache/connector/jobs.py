"""What the scheduler side hands the workers, and the counters both sides keep.

The scheduler side's planners (:mod:`sparkcache.connector.restores`,
:mod:`sparkcache.connector.saves`) plan :class:`LoadJob` and :class:`SaveJob`
objects; vLLM pickles them into each
step's connector metadata; every worker (:mod:`sparkcache.connector.worker`)
runs them on its own rank.  Both sides import this module and neither imports
the other.  Plain data over numpy: no vLLM, no store.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import numpy as np

from sparkcache.identity import ModelIdentity, RequestScope

__all__ = ["Blocks", "Counters", "LoadJob", "SaveJob"]


#: One tuple of block ids per KV cache group (a plain model: one), each group's
#: blocks ending at the job's end (a sliding-window group: only its window),
#: so group ``g`` starts at block ``end - len(blocks[g])``.
Blocks = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class LoadJob:
    """Restore tokens ``[start_block * block_size, n_tokens)`` of a snapshot into ``blocks``."""

    req_id: str
    snapshot_id: int
    n_tokens: int  # the match: tokens [0, n_tokens) are read and verified
    token_ids: np.ndarray  # uint32, the prompt's first n_tokens
    start_block: int  # blocks below it are vLLM's own prefix hit
    blocks: Blocks
    #: Feeds this step's forward (vLLM's synchronous load) instead of landing
    #: while the request waits.
    in_step: bool = False
    #: The identity the snapshot was stored under when it is another sharding
    #: of the engine's KV (another TP size); None: the engine's own.
    source: ModelIdentity | None = None
    #: The token the request's forward computes from once this load landed
    #: (vLLM's hit and the restore; None: ``n_tokens``).  Inside the last block,
    #: the step an in-step load feeds writes that block's later slots before
    #: each layer waits for its restore, so that block lands first (:meth:`split`).
    computes_from: int | None = None

    def split(self, block_size: int) -> tuple[LoadJob, LoadJob | None] | None:
        """``(the last block, the blocks before it or None)`` when this load
        shares its last block with the forward it feeds (see
        :attr:`computes_from`), each a load of its own (the whole load first
        where the blocks before it would leave a group with none); None when
        the forward writes into none of its blocks."""
        end = self.n_tokens // block_size
        if not self.in_step or self.computes_from is None or \
                self.computes_from >= self.n_tokens or not self.blocks or not all(self.blocks):
            return None
        last = replace(self, blocks=tuple(ids[-1:] for ids in self.blocks),
                       start_block=end - 1)
        if all(len(ids) == 1 for ids in self.blocks):
            return last, None
        if any(len(ids) == 1 for ids in self.blocks):
            return self, None  # (a window group holding only the last block: all first)
        n = (end - 1) * block_size
        return last, replace(self, n_tokens=n, token_ids=self.token_ids[:n],
                             blocks=tuple(ids[:-1] for ids in self.blocks))


@dataclass(frozen=True)
class SaveJob:
    """Publish tokens ``[0, len(token_ids))`` from ``blocks``, which hold
    ``[start_block * block_size, len(token_ids))`` (below: the parent's)."""

    req_id: str
    token_ids: np.ndarray  # uint32, whole blocks
    blocks: Blocks  # () for a release (below)
    parent: int | None
    scope: RequestScope | None
    breakpoints: tuple[int, ...]  # alias boundaries (the prompt's end, API breakpoints)
    #: False for a breakpoint save of a running request: not reported in
    #: finished_sending (vLLM knows nothing of it); the request's release at its
    #: finish waits until it was copied out.  A job without blocks is such a release.
    report: bool = True
    #: Seconds to keep the published snapshot at least (a breakpoint's ``ttl``):
    #: rank 0 takes a keep lease on it once published.
    keep: float | None = None
    start_block: int = 0  # the parent's end (copy-on-write), 0 without a parent
    #: Groups (indices into ``blocks``) copied out before the step ends, in
    #: ``wait_for_save`` (:meth:`KVGroups.copy_in_step`).
    copy_in_step: tuple[int, ...] = ()
    #: It stores a breakpoint the request asked for that was not stored (an
    #: explicit cache write, which the next request may read at once; at the
    #: finish, one in the prompt's last block): its publish does not wait for a
    #: moment without a prefill (``publisher.Prefills``).
    explicit: bool = False


def save_tag(job: SaveJob) -> str:
    """A save's name in the workers' reports that its publish ended
    (``SparkCacheWorkerMeta``): its request and its length, so a request's
    breakpoint save and its finish save are told apart."""
    return f"{job.req_id}\x00{job.token_ids.size}"


class Counters:
    """Thread-safe named counters, taken (and reset) by the stats report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._data[name] = self._data.get(name, 0) + value

    def take(self) -> dict[str, float]:
        """The counts since the last take (name -> value); the counters restart at zero."""
        with self._lock:
            data, self._data = self._data, {}
        return data
