"""Restoring from the shared tier: find a prompt's longest prefix there, fetch it.

The read side of docs/shared.md.  :func:`probe` asks the tier which prefix of
a prompt it holds, in a bounded number of small requests and never a listing:

1. a HEAD of the marker at the first stride boundary: a snapshot holding the
   prompt's first ``p`` tokens marked every stride boundary up to ``p``, so
   the matched ones are a prefix of them, and when the first is not marked
   the tier holds nothing of the prompt past it (one HEAD: the common miss);
2. a HEAD of the marker at the prompt's last whole block (a snapshot of this
   very prompt, answered before on another host, marked it: its save's
   breakpoint at the prompt's end);
3. otherwise a binary search over the other stride boundaries, one HEAD of a
   marker each, then a HEAD of the markers at the request's own breakpoints
   above the best stride (at most :data:`MAX_BREAKPOINT_PROBES`).

:func:`resolve` then GETs the best marker, the manifest it names and its
parents' manifests (root first), parsing each strictly; a marker whose
manifest is missing (an upload that died before its manifest, a snapshot the
tier's sweep deleted meanwhile) or that does not agree is skipped for the next
shorter stride (at most :data:`MAX_FALLBACKS`).

:func:`fetch_chain` pulls every link not already local into the local store
through the ordinary publish path, after verifying each rank's object as an
import does: its size against the manifest, then the header against the
manifest's digest, the identity, the rank, the snapshot key and token range,
every chunk, the ranks' token ids against each other and the key against the
hash of the token ids.  A fetched snapshot is as trusted as a local one, and
afterwards it *is* local (and counted as uploaded: its manifest is there).
Any failure of a link is a miss for it and what depends on it; links already
published stay, so the local lookup then restores the shorter prefix.

Every failure of the tier reaches the caller as a SparkCacheError; nothing
here retries (the caller's deadline is the bound: the connector turns a slow
tier into a miss).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sparkcache import segment as seg
from sparkcache.core import Core, Match, PublishPolicy, SnapshotInfo, fetch_one
from sparkcache.errors import CorruptSnapshot, InvalidArgument, NotFound, SparkCacheError
from sparkcache.hashing import prefix_hashes, prefix_seed
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.index import queries as q
from sparkcache.publish import publish
from sparkcache.reader import stored_tokens
from sparkcache.shared.layout import Manifest, alias_key, manifest_key, parse_alias, parse_manifest
from sparkcache.shared.sweep import mark_used
from sparkcache.shared.tier import SharedTier
from sparkcache.verification import verify_file

__all__ = [
    "MAX_BREAKPOINT_PROBES",
    "MAX_CHAIN_LINKS",
    "MAX_FALLBACKS",
    "FetchResult",
    "RemotePrefix",
    "fetch_chain",
    "fetch_prefix",
    "probe",
    "resolve",
]

logger = logging.getLogger(__name__)

#: Breakpoints of a request probed above its best stride, at most.
MAX_BREAKPOINT_PROBES = 4
#: Shorter strides tried when the best marker dangles or disagrees.
MAX_FALLBACKS = 2
#: Manifests followed from a snapshot to its root, at most (a tier's chains are
#: its hosts' chains, which compaction bounds far below this).
MAX_CHAIN_LINKS = 64
#: How long a fetch waits for another process of this host publishing the same
#: snapshot (its publish lease) before it gives up (a miss).
PENDING_WAIT_SECONDS = 10.0

# One fetch of a snapshot at a time in this process: a second request for the
# same prefix finds it local instead of downloading it again.
_STRIPES = [threading.Lock() for _ in range(64)]


@dataclass(frozen=True)
class RemotePrefix:
    """A marker found for the prompt: the tier holds its first ``n_tokens``
    tokens (prefix hash ``prefix``) in snapshot ``snap_key``'s chain."""

    n_tokens: int
    prefix: str
    snap_key: str = ""


@dataclass
class FetchResult:
    """What :func:`fetch` did for one prompt.

    ``outcome``: ``fetched`` (links were published here now), ``local`` (the
    tier's snapshot was here already), ``miss`` (the tier holds no prefix of
    the prompt, or only ones no longer whole), ``refused`` (what the tier held
    failed verification, or the store's retention refused it: ``reason``).
    ``n_tokens`` is the prefix of the prompt the tier's snapshot holds by its
    marker (0 on a miss): the local lookup then finds at least that much, and
    :meth:`~sparkcache.store.SnapshotStore.grow` up to the last whole block
    the prompt shares with the snapshot; ``snapshot_id`` is the snapshot's
    local id.  ``requests`` counts
    the tier requests (HEAD and GET) made.
    """

    outcome: str
    n_tokens: int = 0
    snapshot_id: int | None = None
    fetched: list[int] = field(default_factory=list)
    nbytes: int = 0
    requests: int = 0
    seconds: float = 0.0
    #: Of ``seconds``, the downloads and their verification (the rest is the
    #: probe, the manifests and the durable publish into the local store).
    download_seconds: float = 0.0
    reason: str | None = None

    @property
    def hit(self) -> bool:
        return self.outcome in ("fetched", "local")


# -- probe ---------------------------------------------------------------------------------


class _Counted:
    """The tier's HEAD and GET, counted."""

    def __init__(self, tier: SharedTier) -> None:
        self.tier = tier
        self.requests = 0
        self._lock = threading.Lock()

    def has(self, key: str) -> bool:
        with self._lock:
            self.requests += 1
        return self.tier.exists(key)

    def get(self, key: str) -> bytes | None:
        self.requests += 2  # a HEAD (its size) and the GET
        return self.tier.get(key)


def probe(tier: SharedTier | _Counted, model: str, hashes: Sequence[bytes], block_size: int,
          breakpoints: Sequence[int] = ()) -> list[RemotePrefix]:
    """The markers the tier has for the prompt whose block hashes are ``hashes``,
    best (longest) first, then up to :data:`MAX_FALLBACKS` shorter strides to
    try when the best does not resolve; empty when it holds no prefix.
    ``breakpoints`` are the request's (token counts).  Requests: one HEAD
    when the tier holds nothing of the prompt, two for a prompt it holds
    whole, at most ``2 + log2(len(hashes) * block_size / stride)``, and at
    most :data:`MAX_BREAKPOINT_PROBES` more."""
    heads = tier if isinstance(tier, _Counted) else _Counted(tier)
    n_blocks = len(hashes)
    if n_blocks == 0:
        return []

    def marked(i: int) -> bool:
        return heads.has(alias_key(model, hashes[i].hex()))

    def at(i: int) -> RemotePrefix:
        return RemotePrefix((i + 1) * block_size, hashes[i].hex())

    stride = max(1, heads.tier.alias_stride // block_size)
    strides = list(range(stride - 1, n_blocks, stride))
    last = n_blocks - 1
    # Matched strides are a prefix of them: when the first is not marked, none
    # is, and neither is the prompt's end (a snapshot holding it holds the first
    # stride): a prompt the tier holds nothing of costs one HEAD.
    first = bool(strides) and marked(strides[0])
    best: RemotePrefix | None
    if (first or not strides) and (last + 1) % stride and marked(last):
        best, matched = at(last), len(strides)  # the whole prompt: strides are fallbacks
    else:
        lo, hi = (1, len(strides)) if first else (0, 0)
        while lo < hi:  # bisect the rest
            mid = (lo + hi) // 2
            if marked(strides[mid]):
                lo = mid + 1
            else:
                hi = mid
        matched = lo
        top = strides[matched - 1] if matched else -1
        # (none above an unmarked first stride can be marked)
        end = n_blocks if first or not strides else strides[0]
        marks = sorted({b // block_size - 1 for b in breakpoints
                        if top < b // block_size - 1 < end}, reverse=True)
        best = next((at(i) for i in marks[:MAX_BREAKPOINT_PROBES] if marked(i)), None)
        if best is None and matched:
            best, matched = at(top), matched - 1
    if best is None:
        return []
    # Fallbacks: the strides below the best, unprobed (a dangling marker is rare).
    below = [at(strides[k]) for k in range(matched - 1, -1, -1)
             if (strides[k] + 1) * block_size < best.n_tokens]
    return [best, *below[:MAX_FALLBACKS]]


def resolve(tier: SharedTier | _Counted, model: str, found: RemotePrefix,
            ) -> tuple[RemotePrefix, list[Manifest]] | None:
    """The marker ``found`` and its snapshot's chain of manifests, root first,
    each parsed strictly and consistent with the next; None when the marker or
    a manifest is missing (a dangling marker: an upload that died before its
    manifest, or a deletion).  Raises InvalidArgument when an object is there
    but is not what it claims to be."""
    gets = tier if isinstance(tier, _Counted) else _Counted(tier)
    raw = gets.get(alias_key(model, found.prefix))
    if raw is None:
        return None
    alias = parse_alias(raw, found.prefix)
    if alias.n_tokens != found.n_tokens:
        raise InvalidArgument(f"marker {found.prefix} says {alias.n_tokens} tokens where the "
                              f"prompt has that hash at {found.n_tokens}")
    chain: list[Manifest] = []
    key: str | None = alias.snapshot
    while key is not None:
        if len(chain) >= MAX_CHAIN_LINKS:
            raise InvalidArgument(f"snapshot {alias.snapshot}'s chain in the tier is longer "
                                  f"than {MAX_CHAIN_LINKS} links")
        raw = gets.get(manifest_key(model, key))
        if raw is None:
            return None
        m = parse_manifest(raw, model, key)
        if chain:
            child = chain[-1]
            if (m.n_tokens != child.start_token or m.scope != child.scope
                    or m.world_size != child.world_size):
                raise InvalidArgument(f"manifest {key} is not the parent manifest "
                                      f"{child.snap_key} names")
        elif m.n_tokens != alias.snapshot_tokens or m.n_tokens < alias.n_tokens:
            raise InvalidArgument(f"marker {found.prefix} names {alias.snapshot_tokens} "
                                  f"tokens of snapshot {key}, whose manifest has {m.n_tokens}")
        chain.append(m)
        key = m.parent
    chain.reverse()
    return RemotePrefix(alias.n_tokens, alias.prefix, alias.snapshot), chain


# -- fetch ---------------------------------------------------------------------------------


def _local(core: Core, identity: ModelIdentity, snap_key: str) -> SnapshotInfo | None:
    with core.read() as conn:
        model_id = core.model_id(conn, identity)
        if model_id is None:
            return None
        return fetch_one(conn, q.LIVE_SNAPSHOT_BY_KEY, (model_id, snap_key), into=SnapshotInfo)


def _wait_ready(core: Core, snapshot_id: int) -> SnapshotInfo | None:
    """A snapshot another publisher of this host is finishing: ready, or None."""
    deadline = time.monotonic() + PENDING_WAIT_SECONDS
    while True:
        with core.read() as conn:
            info = core.snapshot(conn, snapshot_id)
        if info is None or info.state == "ready":
            return info
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def _download(tier: SharedTier, identity: ModelIdentity, m: Manifest,
              seed: bytes) -> tuple[np.ndarray, list[list[np.ndarray]], int]:
    """Every rank's segment of link ``m``, verified: (its token ids, each rank's
    layer pages, bytes fetched).  CorruptSnapshot (reason as a read gives, or
    ``missing`` / ``truncated``) when an object is not exactly what the
    manifest names."""
    tokens: np.ndarray | None = None
    pages: list[list[np.ndarray]] = []
    nbytes = 0
    for g in m.segments:
        size = tier.size(g.key)
        if size is None:
            raise CorruptSnapshot(f"{g.key} is missing from the tier", "missing")
        if size != g.nbytes:
            raise CorruptSnapshot(f"{g.key} is {size} bytes, its manifest says {g.nbytes}",
                                  "truncated")
        try:
            blob = tier.backend.open(g.key)  # in memory: the views below keep it alive
        except NotFound:
            raise CorruptSnapshot(f"{g.key} vanished from the tier", "missing") from None
        buf = blob.buffer
        if buf.nbytes != g.nbytes:
            raise CorruptSnapshot(f"{g.key} read {buf.nbytes} bytes, not {g.nbytes}",
                                  "truncated")
        nbytes += buf.nbytes
        header = verify_file(buf, g.digest, identity, g.rank, m.snap_key, g.token_start,
                             g.token_end)
        these = seg.verified_view(buf, header, "tokens", header.tensors["tokens"][1]).view("<u4")
        if tokens is None:
            tokens = these
        elif not np.array_equal(tokens, these):
            raise CorruptSnapshot(f"the ranks of {m.snap_key} disagree on the token ids",
                                  "tokens")
        pages.append([seg.verified_view(buf, header, f"layer.{i}", header.tensors[f"layer.{i}"][1])
                      for i in range(header.n_layers)])
    assert tokens is not None
    hashes = prefix_hashes(seed, tokens, identity.block_size)
    if not hashes or hashes[-1].hex() != m.snap_key:
        raise CorruptSnapshot(f"{m.snap_key}'s token ids do not hash to its key in its scope",
                              "tokens")
    return tokens.astype(np.uint32), pages, nbytes


def fetch_chain(core: Core, tier: SharedTier, identity: ModelIdentity, chain: list[Manifest], *,
                alias_stride: int, max_chain: int, policy: PublishPolicy | None,
                result: FetchResult) -> None:
    """Publish every link of ``chain`` (root first) not already local; fills in
    ``result`` (``snapshot_id`` of the last link, ``fetched``, ``nbytes``,
    ``outcome``).  A link that fails verification stops the fetch (``refused``,
    counted ``fetch_refused``); the links before it stay published."""
    full = np.empty(0, np.uint32)
    parent: SnapshotInfo | None = None
    for m in chain:
        if m.world_size != identity.world_size:
            raise InvalidArgument(f"manifest {m.snap_key} has world size {m.world_size}, the "
                                  f"model {identity.world_size}")
        with _STRIPES[int(m.snap_key[:4], 16) % len(_STRIPES)]:
            info = _local(core, identity, m.snap_key)
            if info is not None and info.state == "pending":
                info = _wait_ready(core, info.id)
            if info is not None and info.n_tokens == m.n_tokens:
                parent = info
                result.snapshot_id = info.id
                continue
            seed = (prefix_seed(identity, m.scope) if parent is None
                    else bytes.fromhex(parent.snap_key))
            result.requests += 2 * len(m.segments)
            started = time.perf_counter()
            try:
                tokens, pages, nbytes = _download(tier, identity, m, seed)
            except CorruptSnapshot as exc:
                core.count(0, "fetch_refused")
                result.outcome, result.reason = "refused", str(exc)
                return
            finally:
                result.download_seconds += time.perf_counter() - started
            if parent is not None and full.size < parent.n_tokens:
                full = _tokens_of(core, identity, parent, full)
            full = np.concatenate([full, tokens])
            published = None
            for rank, layer_pages in enumerate(pages):
                published = publish(core, identity, rank, full, layer_pages,
                                    parent=None if parent is None else parent.id,
                                    scope=m.scope, breakpoints=m.breakpoints,
                                    alias_stride=alias_stride, max_chain=max_chain,
                                    policy=policy)
                if published.state == "skipped":
                    result.outcome, result.reason = "refused", published.skipped
                    return
            assert published is not None
            info = _wait_ready(core, published.snapshot_id)
            if info is None or info.snap_key != m.snap_key:
                raise SparkCacheError(f"snapshot {m.snap_key} fetched from the tier did not "
                                      "become ready here; run `sparkcache check --fix`")
            with core.write() as conn:  # its manifest is in the tier: nothing to upload
                conn.execute(q.MARK_UPLOADED, (core.clock(), info.id))
            core.count(info.model_id, "fetches")
            core.count(info.model_id, "fetch_bytes", nbytes)
            result.fetched.append(info.id)
            result.nbytes += nbytes
            parent = info
            result.snapshot_id = info.id
    result.outcome = "fetched" if result.fetched else "local"


def _tokens_of(core: Core, identity: ModelIdentity, info: SnapshotInfo,
               known: np.ndarray) -> np.ndarray:
    """A local snapshot's token ids (the prefix ``known`` of them already read)."""
    if known.size >= info.n_tokens:
        return known[:info.n_tokens]
    match = Match(info.id, int(known.size), identity, known)
    return np.concatenate([known, stored_tokens(core, match, 0, info.n_tokens)])


def _mark_used(tier: SharedTier, model: str, snap_key: str, result: FetchResult) -> None:
    """Tell the tier's sweep that ``snap_key`` was used (its age restarts).  The
    fetch is done and local whatever happens here: a failure is logged, not raised."""
    result.requests += 1
    try:
        mark_used(tier, model, snap_key)
    except SparkCacheError as exc:
        logger.warning("sparkcache could not mark snapshot %s used in the shared tier "
                       "(its age in the tier was not renewed): %s", snap_key, exc)


def fetch_prefix(core: Core, tier: SharedTier, identity: ModelIdentity,
          token_ids: Sequence[int] | np.ndarray, *, scope: RequestScope | None,
          breakpoints: Sequence[int] = (), hashes: Sequence[bytes] | None = None,
          alias_stride: int, max_chain: int, policy: PublishPolicy | None,
          min_tokens: int = 1) -> FetchResult:
    """Find the longest prefix of ``token_ids`` the tier holds and make it local
    (see the module doc); then :func:`sparkcache.lookup.lookup` finds it.

    ``min_tokens``: a marker for fewer tokens is not worth a fetch (a miss).
    Raises SparkCacheError when the tier or the index fails.
    """
    started = time.perf_counter()
    tokens = np.asarray(token_ids, np.uint32)
    bs = identity.block_size
    if hashes is None:
        hashes = prefix_hashes(prefix_seed(identity, scope), tokens[:tokens.size // bs * bs], bs)
    counted = _Counted(tier)
    model = identity.digest()
    result = FetchResult("miss")
    try:
        for found in probe(counted, model, hashes, bs, breakpoints):
            if found.n_tokens < min_tokens:
                break
            try:
                resolved = resolve(counted, model, found)
            except InvalidArgument as exc:
                core.count(0, "fetch_refused")
                result.reason = str(exc)
                continue
            if resolved is None:  # dangling: try a shorter stride
                result.reason = f"the marker at {found.n_tokens} tokens names no manifest"
                continue
            remote, chain = resolved
            result.n_tokens = remote.n_tokens
            fetch_chain(core, tier, identity, chain, alias_stride=alias_stride,
                        max_chain=max_chain, policy=policy, result=result)
            if result.hit:
                result.reason = None
            if result.outcome == "fetched":
                _mark_used(tier, model, remote.snap_key, result)
            return result
        if result.outcome == "miss":
            core.count(0, "fetch_misses")
        return result
    finally:
        result.requests += counted.requests
        result.seconds = time.perf_counter() - started
        if result.outcome != "miss":  # the counters now, if the index is free; a
            core.try_save()  # miss writes nothing: its counts go with the next write
