"""KV events for the store: vLLM's ``BlockStored`` and ``BlockRemoved`` with medium
``STORAGE`` for the blocks the engine can restore (docs/connector.md, "KV events").

Scheduler side only, so an engine announces once whatever its TP size.  The
index is the truth: a background thread reads this model's ready snapshots
(with those of its other shardings of the same KV, which it restores from:
:func:`~sparkcache.connector.resharded.restorable_siblings`) every
:data:`POLL_SECONDS` and turns what appeared into ``BlockStored`` and what went
(evicted, swept, cleared, quarantined, by any process) into ``BlockRemoved``;
vLLM takes them in :meth:`StorageEvents.take` at the end of each engine step
and publishes them with the pool's own events.  Block
hashes are vLLM's: a save's are its request's own ``block_hashes`` (LoRA,
multimodal inputs, cache salt and so the tenant included); a snapshot this
engine did not plan (fetched from the shared tier, another engine's, one in
the store at start) is hashed by vLLM's hasher from its verified token ids
and its cache salt, and not announced when its scope has LoRA or multimodal
inputs (their adapter path and positions are not stored).  A block shared by
several snapshots is announced once and removed with the last of them.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparkcache.connector.jobs import Counters, SaveJob
from sparkcache.connector.layout import total_kv_heads
from sparkcache.connector.resharded import restorable_siblings
from sparkcache.core import SnapshotInfo
from sparkcache.errors import SparkCacheError
from sparkcache.hashing import prefix_hashes, prefix_seed
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.periodic import Periodic
from sparkcache.store import SnapshotStore

__all__ = ["DIGEST_SNAPSHOTS", "MEDIUM", "Announcer", "Chain", "Events", "StorageEvents",
           "request_chain", "storage_events", "stored_chain"]

_kv_events = importlib.import_module("vllm.distributed.kv_events")
_kv_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
_hashing = importlib.import_module("vllm.utils.hashing")

logger = logging.getLogger("vllm.sparkcache")

#: The medium of every event the store announces (vLLM's ``MEDIUM_STORAGE``).
MEDIUM: str = _kv_events.MEDIUM_STORAGE
#: At start, the engine announces at most this many of the snapshots its store
#: holds for its model, most recently used first.
DIGEST_SNAPSHOTS = 64
#: Block hashes announced at once at most; a snapshot that would pass it is not
#: announced (counted ``events_unannounced``).
MAX_BLOCKS = 1 << 18
#: Events waiting for vLLM's next step at most; the oldest go first (counted).
MAX_EVENTS = 4096
#: Saves waiting for their snapshot to be ready at most, and for how long.
MAX_EXPECTED = 1024
EXPECT_SECONDS = 600.0
#: Live requests remembered for their block hashes at most.
MAX_LIVE = 4096
#: How often the thread reads the index.
POLL_SECONDS = 0.5


@dataclass(frozen=True)
class Chain:
    """The blocks one snapshot makes restorable, named as vLLM's pool names them."""

    hashes: tuple[Any, ...]  # vLLM's external block hashes, block 0 first
    token_ids: tuple[int, ...]  # of those whole blocks
    extra_keys: tuple[Any, ...]  # vLLM's event form of each block's extra keys
    lora_id: int | None = None
    lora_name: str | None = None


def request_chain(request: Any, n_tokens: int, block_size: int,
                  hash_block_size: int) -> Chain | None:
    """The first ``n_tokens // block_size`` blocks of a vLLM request: its own
    ``block_hashes`` seen at ``block_size`` and its extra keys, computed by
    vLLM's functions; None when the request has fewer hashes."""
    n = n_tokens // block_size
    hashes = _kv_utils.resolve_block_hashes(request.block_hashes, hash_block_size, block_size)
    if n <= 0 or len(hashes) < n:
        return None
    keys: list[Any] = []
    mm = 0
    for i in range(n):
        extra, mm = _kv_utils.generate_block_hash_extra_keys(
            request, i * block_size, (i + 1) * block_size, mm)
        keys.append(extra)
    lora = request.lora_request
    return Chain(tuple(_kv_utils.maybe_convert_block_hash(hashes[i]) for i in range(n)),
                 tuple(int(t) for t in request.all_token_ids[:n * block_size]),
                 tuple(_kv_utils.to_event_extra_keys(keys) or ()),
                 None if lora is None else lora.adapter_id,
                 None if lora is None else lora.name)


class _Stored:
    """What vLLM's block hasher reads of a request, for a stored snapshot:
    its token ids and cache salt (no LoRA, no multimodal inputs, no embeddings)."""

    def __init__(self, token_ids: list[int], cache_salt: str | None) -> None:
        self.all_token_ids = token_ids
        self.num_tokens = len(token_ids)
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        self.mm_features: list[Any] = []
        self.lora_request = None
        self.prompt_embeds = None


def stored_chain(token_ids: Sequence[int] | np.ndarray, scope: RequestScope | None,
                 block_size: int, hash_block_size: int,
                 hash_fn: Callable[[Any], bytes]) -> Chain | None:
    """vLLM's chain of a stored snapshot's whole blocks (``hash_fn``: the engine's
    ``prefix_caching_hash_algo``); None for a scope with LoRA or multimodal inputs."""
    if scope is not None and (scope.lora is not None or scope.mm_hashes):
        return None
    n = len(token_ids) // block_size * block_size
    req = _Stored([int(t) for t in token_ids[:n]], None if scope is None else scope.cache_salt)
    req.block_hashes = _kv_utils.get_request_block_hasher(hash_block_size, hash_fn)(req)
    return request_chain(req, n, block_size, hash_block_size)


class Announcer:
    """Which blocks are announced, counted per snapshot holding them: a block is
    stored with the first snapshot that holds it and removed with the last.

    A chain's hash names its whole prefix, so the blocks a snapshot adds are a
    suffix of its chain, and so are those its removal takes: one event each.
    """

    def __init__(self, block_size: int, max_blocks: int = MAX_BLOCKS) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._chains: dict[int, Chain] = {}
        self._refs: dict[Any, int] = {}

    @property
    def held(self) -> set[int]:
        """The snapshots announced and not removed."""
        return set(self._chains)

    def add(self, snapshot_id: int, chain: Chain) -> list[Any]:
        """Announce a snapshot: a ``BlockStored`` of the blocks no other holds;
        nothing when it is announced already, or (not announced) past the bound."""
        if snapshot_id in self._chains or len(self._refs) + len(chain.hashes) > self.max_blocks:
            return []
        self._chains[snapshot_id] = chain
        first = next((i for i, h in enumerate(chain.hashes) if h not in self._refs),
                     len(chain.hashes))
        for h in chain.hashes:
            self._refs[h] = self._refs.get(h, 0) + 1
        if first == len(chain.hashes):
            return []
        bs = self.block_size
        return [_kv_events.BlockStored(
            block_hashes=list(chain.hashes[first:]),
            parent_block_hash=chain.hashes[first - 1] if first else None,
            token_ids=list(chain.token_ids[first * bs:]), block_size=bs,
            lora_id=chain.lora_id, medium=MEDIUM, lora_name=chain.lora_name,
            extra_keys=list(chain.extra_keys[first:]) or None)]

    def remove(self, snapshot_id: int) -> list[Any]:
        """Forget a snapshot: a ``BlockRemoved`` of the blocks no other holds."""
        chain = self._chains.pop(snapshot_id, None)
        if chain is None:
            return []
        gone = []
        for h in chain.hashes:
            left = self._refs[h] - 1
            if left:
                self._refs[h] = left
            else:
                del self._refs[h]
                gone.append(h)
        return [_kv_events.BlockRemoved(block_hashes=gone, medium=MEDIUM)] if gone else []


class Events:
    """No KV events (``kv_events_config`` off, and every worker): each hook does nothing."""

    def admitted(self, request: Any) -> None:
        """A request vLLM asks about: its block hashes name what its saves store."""

    def finished(self, request: Any) -> None:
        """A request ended: remembered until the saves planned at its finish are."""

    def planned(self, saves: Iterable[SaveJob]) -> None:
        """The step's saves: each one's chain is expected in the index."""

    def take(self) -> list[Any]:
        """The events since the last call, oldest first (vLLM's ``take_events``)."""
        return []

    def close(self) -> None:
        """Stop what runs in the background."""


class StorageEvents(Events):
    """One engine's KV events for its store (scheduler side; see the module docstring).

    vLLM's scheduler thread calls :meth:`admitted`, :meth:`finished`,
    :meth:`planned` and :meth:`take`; the index is read on a thread of its own
    (started by the first :meth:`take`, when vLLM's hash seed is set), through a
    store of its own, so no step waits for it.  Memory is bounded: events
    waiting for a step (:data:`MAX_EVENTS`), saves waiting to be ready
    (:data:`MAX_EXPECTED`), live requests (:data:`MAX_LIVE`), announced blocks
    (:data:`MAX_BLOCKS`).
    """

    def __init__(self, folder: str | Path, identity: ModelIdentity, counters: Counters, *,
                 hash_fn: Callable[[Any], bytes], hash_block_size: int | None = None,
                 digest: int = DIGEST_SNAPSHOTS, poll_seconds: float = POLL_SECONDS,
                 total_kv_heads: int = 0) -> None:
        self.folder = folder
        self.identity = identity
        #: Given (> 0): the snapshots of other shardings it restores are announced too.
        self.total_kv_heads = total_kv_heads
        self.counters = counters
        self.block_size = identity.block_size
        self.hash_block_size = hash_block_size or identity.block_size
        self.hash_fn = hash_fn
        self.digest = digest
        self.announcer = Announcer(self.block_size)
        self._live: OrderedDict[str, Any] = OrderedDict()  # req_id -> vLLM request
        self._done: list[str] = []  # finished since the last planned()
        self._inbox: deque[tuple[np.ndarray, RequestScope | None, Chain]] = deque()
        self._expected: OrderedDict[str, tuple[float, Chain]] = OrderedDict()  # by snap key
        self._out: deque[Any] = deque()
        self._lock = threading.Lock()
        self._old: set[int] | None = None  # ready at start, not in the digest
        self._skipped: set[int] = set()  # ready, seen, not announced
        self._store: SnapshotStore | None = None
        self._thread = Periodic(self._poll, poll_seconds, name="sparkcache-events")

    # -- vLLM's scheduler thread ---------------------------------------------------------

    def admitted(self, request: Any) -> None:
        """A request vLLM asks about: its block hashes name what its saves store."""
        self._live[request.request_id] = request
        self._live.move_to_end(request.request_id)
        while len(self._live) > MAX_LIVE:
            self._live.popitem(last=False)

    def finished(self, request: Any) -> None:
        """A request ended: remembered until the saves planned at its finish are."""
        self.admitted(request)
        self._done.append(request.request_id)

    def planned(self, saves: Iterable[SaveJob]) -> None:
        """The step's saves: each one's chain is expected in the index."""
        for job in saves:
            request = self._live.get(job.req_id)
            if not job.blocks or request is None:
                continue
            chain = request_chain(request, len(job.token_ids), self.block_size,
                                  self.hash_block_size)
            if chain is not None:
                with self._lock:
                    if len(self._inbox) >= MAX_EXPECTED:
                        self._inbox.popleft()
                    self._inbox.append((job.token_ids, job.scope, chain))
        for req_id in self._done:
            self._live.pop(req_id, None)
        self._done.clear()

    def take(self) -> list[Any]:
        """The events since the last call, oldest first (vLLM's ``take_events``)."""
        if not self._thread.started:
            self._thread.start()
        if not self._out:
            return []
        with self._lock:
            events = list(self._out)
            self._out.clear()
        return events

    def close(self) -> None:
        """Stop the thread and close its store."""
        self._thread.stop(timeout=10)
        if self._store is not None:
            self._store.close()

    # -- the thread ----------------------------------------------------------------------

    def _poll(self) -> None:
        if self._store is None:
            self._store = SnapshotStore(self.folder)
        now = time.time()
        self._take_inbox(now)
        rows = self._store.snapshots(self.identity)
        for other in restorable_siblings(self._store, self.identity, self.total_kv_heads,
                                         warn=False):
            rows += self._store.snapshots(other)
        ready = {s.id: s for s in rows if s.state == "ready"}
        events: list[Any] = []
        for gone in sorted(self.announcer.held - set(ready)):
            events += self.announcer.remove(gone)
        self._skipped &= set(ready)
        if self._old is None:  # the start: a digest, most recently used first
            newest = sorted(ready.values(), key=lambda s: (s.last_used, s.id), reverse=True)
            self._old = {s.id for s in newest[self.digest:]}
            for info in newest[:self.digest]:
                events += self._announce(info)
        else:
            self._old &= set(ready)
            known = self._old | self._skipped | self.announcer.held
            for info in sorted(ready.values(), key=lambda s: s.id):
                if info.id not in known:
                    events += self._announce(info)
        self._emit(events)

    def _take_inbox(self, now: float) -> None:
        with self._lock:
            arrived = list(self._inbox)
            self._inbox.clear()
        bs = self.block_size
        for tokens, scope, chain in arrived:
            key = prefix_hashes(prefix_seed(self.identity, scope), tokens, bs)[-1].hex()
            self._expected[key] = (now, chain)
            self._expected.move_to_end(key)
        while self._expected and (len(self._expected) > MAX_EXPECTED
                                  or next(iter(self._expected.values()))[0]
                                  < now - EXPECT_SECONDS):
            self._expected.popitem(last=False)

    def _announce(self, info: SnapshotInfo) -> list[Any]:
        """A ready snapshot's events: the chain its save expected, else one hashed
        from its stored tokens; [] (and skipped from now on) when it has none."""
        expected = self._expected.pop(info.snap_key, None)
        chain = None if expected is None else expected[1]
        if chain is None:
            chain = self._stored(info)
        events = [] if chain is None else self.announcer.add(info.id, chain)
        if info.id not in self.announcer.held:
            self._skipped.add(info.id)
            self.counters.add("events_unannounced")
        return events

    def _stored(self, info: SnapshotInfo) -> Chain | None:
        assert self._store is not None
        scope = None if info.scope_json is None else RequestScope.from_canonical(info.scope_json)
        if scope is not None and (scope.lora is not None or scope.mm_hashes):
            return None
        try:
            tokens = self._store.catalog.tokens(info.id)
        except SparkCacheError as exc:  # gone or damaged since the listing
            logger.debug("sparkcache: snapshot %d not announced: %s", info.id, exc)
            return None
        return stored_chain(tokens, scope, self.block_size, self.hash_block_size, self.hash_fn)

    def _emit(self, events: list[Any]) -> None:
        if not events:
            return
        for event in events:
            name = "stored" if isinstance(event, _kv_events.BlockStored) else "removed"
            self.counters.add(f"events_{name}_blocks", len(event.block_hashes))
        with self._lock:
            self._out.extend(events)
            dropped = len(self._out) - MAX_EVENTS
            for _ in range(max(0, dropped)):
                self._out.popleft()
        if dropped > 0:
            self.counters.add("events_dropped", dropped)


def storage_events(vllm_config: Any, kv_cache_config: Any, folder: str | Path,
                   identity: ModelIdentity, counters: Counters) -> Events:
    """The engine's :class:`StorageEvents` when its ``kv_events_config`` enables
    KV cache events, else :class:`Events` (none); hashes as vLLM's config says."""
    config = getattr(vllm_config, "kv_events_config", None)
    if config is None or not config.enable_kv_cache_events:
        return Events()
    _, hash_block_size = _kv_utils.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    hash_fn = _hashing.get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    logger.info("sparkcache announces its snapshots as KV events (medium %s)", MEDIUM)
    return StorageEvents(folder, identity, counters, hash_fn=hash_fn,
                         hash_block_size=hash_block_size,
                         total_kv_heads=total_kv_heads(vllm_config))
