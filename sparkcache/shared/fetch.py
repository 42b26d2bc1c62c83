"""Restoring from the shared tier: find a prompt's longest prefix there, fetch it.

The fetch half of docs/shared.md's read side.  :mod:`sparkcache.shared.probe`
finds the prompt's best alias (or, for a model whose layers keep a window,
the snapshot ending inside the prompt) and its chain of manifests;
:func:`fetch_prefix` runs it and fetches what it found.

:func:`fetch_chain` pulls every link not already local into the local store
through the ordinary publish path, verifying each rank's object as an import
does: its size against the manifest, then the header against the manifest's
digest, the identity, the rank, the snapshot key and token range, every chunk,
the ranks' token ids against each other and the key against the hash of the
token ids.  A link is streamed: its header and token ids come first (two
ranged GETs) and are checked, then its layers in one GET read in pieces of
:data:`STREAM_BYTES` (at most :data:`STREAM_AHEAD` read ahead), each verified
and written into the local segment's temp file as it arrives
(:class:`~sparkcache.publish.Encoded`), so memory stays a few pieces and the
download overlaps the local write; any failure, at any byte, removes the temp
file and leaves nothing visible.  (A link whose publish compacts the local
chain is downloaded whole first, as it must be rewritten.)  A fetched
snapshot is as trusted as a local one, and afterwards it *is* local (and
counted as uploaded: its manifest is there).
Any failure of a link is a miss for it and what depends on it; links already
published stay, so the local lookup then restores the shorter prefix.

Every failure of the tier reaches the caller as a SparkCacheError; nothing
here retries (the caller's deadline is the bound: the connector turns a slow
tier into a miss).
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field

import numpy as np

from sparkcache import segment as seg
from sparkcache.core import Core, Match, PublishPolicy, SnapshotInfo, select_one
from sparkcache.errors import CorruptSnapshot, InvalidArgument, NotFound, SparkCacheError
from sparkcache.hashing import prefix_hashes, prefix_seed
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.index import queries as q
from sparkcache.maintenance import drop_snapshot
from sparkcache.publish import Encoded, publish
from sparkcache.reader import stored_tokens
from sparkcache.shared.layout import Manifest
from sparkcache.shared.probe import (
    MAX_BREAKPOINT_PROBES,
    MAX_CHAIN_LINKS,
    MAX_FALLBACKS,
    CountedTier,
    RemotePrefix,
    marked_end,
    probe,
    probe_ends,
    resolve,
    resolve_end,
)
from sparkcache.shared.sweep import mark_used
from sparkcache.shared.tier import SharedTier
from sparkcache.verification import check_key, read_segment, same_tokens

__all__ = [
    "MAX_BREAKPOINT_PROBES",
    "MAX_CHAIN_LINKS",
    "MAX_FALLBACKS",
    "STREAM_AHEAD",
    "STREAM_BYTES",
    "FetchResult",
    "RemotePrefix",
    "fetch_chain",
    "fetch_prefix",
    "marked_end",
    "probe",
    "probe_ends",
    "resolve",
    "resolve_end",
]
# (The probe's names are re-exported: :mod:`sparkcache.shared.probe` holds them.)

logger = logging.getLogger(__name__)

#: How long a fetch waits for another process of this host publishing the same
#: snapshot (its publish lease) before it gives up (a miss).
PENDING_WAIT_SECONDS = 10.0
#: A streamed link's layers are read (one GET), verified and written in pieces
#: of this size: whole verification chunks.
STREAM_BYTES = 8 * seg.CHUNK_BYTES
#: Pieces read ahead of the local write, at most: a link's memory is a few pieces.
STREAM_AHEAD = 4
#: The first GET of a segment: its header, whole for any model sparkcache knows
#: (a longer one costs one GET more).
_HEAD_GUESS = 256 << 10

# One fetch of a snapshot at a time in this process: a second request for the
# same prefix finds it local instead of downloading it again.
_STRIPES = [threading.Lock() for _ in range(64)]


@dataclass
class FetchResult:
    """What :func:`fetch` did for one prompt.

    ``outcome``: ``fetched`` (links were published here now), ``local`` (the
    tier's snapshot was here already), ``miss`` (the tier holds no prefix of
    the prompt, or only ones no longer whole), ``refused`` (what the tier held
    failed verification, or the store's retention refused it: ``reason``).
    ``n_tokens`` is the prefix of the prompt the tier's snapshot holds by its
    alias (0 on a miss): the local lookup then finds at least that much, and
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
    #: Of ``seconds``, the time spent on segment bytes: reading the headers and
    #: token ids, waiting for each piece of layers and verifying it (the
    #: download overlaps the local write, so this is not the download's time).
    download_seconds: float = 0.0
    reason: str | None = None

    @property
    def hit(self) -> bool:
        return self.outcome in ("fetched", "local")



def _local(core: Core, identity: ModelIdentity, snap_key: str) -> SnapshotInfo | None:
    with core.read() as conn:
        model_id = core.model_id(conn, identity)
        if model_id is None:
            return None
        return select_one(conn, q.LIVE_SNAPSHOT_BY_KEY, (model_id, snap_key), into=SnapshotInfo)


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


def _download(tier: SharedTier, identity: ModelIdentity, m: Manifest, timer: list[float],
              ) -> tuple[np.ndarray, list[list[np.ndarray]], int]:
    """Every rank's segment of link ``m`` whole in memory, verified: (its token
    ids, each rank's layer pages, bytes fetched).  CorruptSnapshot (reason as a
    read gives, or ``missing`` / ``truncated``) when an object is not exactly
    what the manifest names."""
    started = time.perf_counter()
    tokens: np.ndarray | None = None
    pages: list[list[np.ndarray]] = []
    nbytes = 0
    try:
        for g in m.segments:
            _check_size(tier, g.key, g.nbytes)
            try:
                blob = tier.backend.open(g.key)  # in memory: the views below keep it alive
            except NotFound:
                raise CorruptSnapshot(f"{g.key} vanished from the tier", "missing") from None
            buf = blob.buffer
            nbytes += buf.nbytes
            read = read_segment(buf, g.digest, identity, g.rank, m.snap_key, g.token_start,
                                g.token_end, nbytes=g.nbytes)
            same_tokens(tokens, read.tokens, m.snap_key)
            tokens = tokens if tokens is not None else read.tokens
            pages.append(list(read.layers))
    finally:
        timer[0] += time.perf_counter() - started
    assert tokens is not None
    return tokens, pages, nbytes


def _check_size(tier: SharedTier, key: str, nbytes: int) -> None:
    size = tier.size(key)
    if size is None:
        raise CorruptSnapshot(f"{key} is missing from the tier", "missing")
    if size != nbytes:
        raise CorruptSnapshot(f"{key} is {size} bytes, its manifest says {nbytes}", "truncated")


@dataclass
class _Remote:
    """One rank's segment in the tier: its header and token ids, checked."""

    key: str
    header_bytes: bytes
    header: seg.SegmentHeader
    tokens: np.ndarray
    nbytes: int
    requests: int  # made so far (HEAD, header, tokens), and the layers' one GET

    def encoded(self, tier: SharedTier, pool: ThreadPoolExecutor,
                timer: list[float]) -> Encoded:
        """The segment as :func:`~sparkcache.publish.publish` writes it, its layers
        streamed (:func:`_layers`) once the publish iterates them."""
        layers_at = self.header.data_start
        return Encoded(self.header_bytes, self.header.digest,
                       _layers(tier, self, pool, timer),
                       self.header.tensors["tokens"][0] - layers_at)


def _range(tier: SharedTier, key: str, start: int, end: int) -> memoryview:
    """Bytes ``[start, end)`` of a segment object, all of them (else CorruptSnapshot)."""
    try:
        data = tier.backend.read_range(key, start, end)
    except NotFound:
        raise CorruptSnapshot(f"{key} vanished from the tier", "missing") from None
    if len(data) != end - start:
        raise CorruptSnapshot(f"{key}: read {len(data)} bytes at {start}, not {end - start} "
                              "(the object changed)", "truncated")
    return memoryview(data)


def _pieces(header: seg.SegmentHeader) -> list[tuple[str, int, int, int]]:
    """The pieces of a segment's layers, in file order: (tensor, its byte, file
    range), each whole verification chunks of one tensor."""
    return [(name, at, offset + at, offset + min(at + STREAM_BYTES, total))
            for name in (f"layer.{i}" for i in range(header.n_layers))
            for offset, total in [header.tensors[name]]
            for at in range(0, total, STREAM_BYTES)]


def _open_remote(tier: SharedTier, identity: ModelIdentity, m: Manifest,
                 timer: list[float]) -> list[_Remote]:
    """Every rank's segment header and token ids of link ``m``, verified (the
    ranks agree on the tokens), in two ranged GETs each (three for a header
    over :data:`_HEAD_GUESS`).  CorruptSnapshot as :func:`_download`."""
    out: list[_Remote] = []
    started = time.perf_counter()
    try:
        for g in m.segments:
            _check_size(tier, g.key, g.nbytes)
            head = _range(tier, g.key, 0, min(_HEAD_GUESS, g.nbytes))
            requests = 3
            if head.nbytes >= 8:
                (hlen,) = struct.unpack_from("<Q", head, 0)
                if head.nbytes < 8 + hlen <= min(g.nbytes, seg.MAX_HEADER_BYTES):
                    head = memoryview(bytes(head) + _range(tier, g.key, head.nbytes, 8 + hlen))
                    requests += 1
            header = seg.check_header(head, g.digest, identity, g.rank, m.snap_key,
                                      g.token_start, g.token_end, size=g.nbytes)
            offset, total = header.tensors["tokens"]
            raw = np.frombuffer(_range(tier, g.key, offset, offset + total), np.uint8)
            seg.check_piece(header, "tokens", 0, raw)
            these = raw.view("<u4")
            same_tokens(out[0].tokens if out else None, these, m.snap_key)
            out.append(_Remote(g.key, bytes(head[:header.data_start]), header,
                               these.astype(np.uint32), g.nbytes, requests + 1))
    finally:
        timer[0] += time.perf_counter() - started
    return out


def _layers(tier: SharedTier, remote: _Remote, pool: ThreadPoolExecutor,
            timer: list[float]) -> Iterator[np.ndarray]:
    """A segment's layer bytes in file order, from one request read by a thread
    of ``pool`` in its pieces (:func:`_pieces`: whole chunks of one tensor, at
    most :data:`STREAM_BYTES`; at most :data:`STREAM_AHEAD` waiting), each
    verified before it is yielded as the block it arrived in (no copy)."""
    pieces = _pieces(remote.header)
    blocks: queue.Queue[bytes | bytearray | BaseException | None] = queue.Queue(STREAM_AHEAD)
    stop = threading.Event()

    def put(item: bytes | bytearray | BaseException | None) -> bool:
        while not stop.is_set():
            try:
                blocks.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            with closing(tier.backend.read_stream(remote.key, pieces[0][2], pieces[-1][3],
                                                  [hi - lo for _, _, lo, hi in pieces],
                                                  )) as stream:
                for block in stream:
                    if not put(block):
                        return
            put(None)
        except BaseException as exc:
            put(exc)

    def block(at: int) -> memoryview:
        item = blocks.get()
        if isinstance(item, NotFound):
            raise CorruptSnapshot(f"{remote.key} vanished from the tier", "missing") from None
        if isinstance(item, BaseException):
            raise item
        if item is None:
            raise CorruptSnapshot(f"{remote.key} ended at byte {at}, its header says "
                                  f"{pieces[-1][3]}", "truncated")
        return memoryview(item)

    pool.submit(produce)
    pending = memoryview(b"")
    try:
        for name, at, lo, hi in pieces:
            started = time.perf_counter()
            out, pending = _cut(pending, lo, hi, block)
            seg.check_piece(remote.header, name, at, out)
            timer[0] += time.perf_counter() - started
            yield out
    finally:
        stop.set()


def _cut(pending: memoryview, lo: int, hi: int, block: Callable[[int], memoryview],
         ) -> tuple[np.ndarray, memoryview]:
    """The piece at file bytes ``[lo, hi)`` and what is left of the blocks:
    ``pending`` (the rest of the last block) is followed by ``block(at)``."""
    if not pending.nbytes:
        pending = block(lo)
    if pending.nbytes >= hi - lo:  # the piece in one block (the stream's pieces
        # are these): a view of it, not a copy
        return np.frombuffer(pending[:hi - lo], np.uint8), pending[hi - lo:]
    out = np.empty(hi - lo, np.uint8)  # a shorter block: joined
    filled = 0
    while True:
        n = min(pending.nbytes, out.size - filled)
        out[filled:filled + n] = np.frombuffer(pending[:n], np.uint8)
        pending, filled = pending[n:], filled + n
        if filled == out.size:
            return out, pending
        pending = block(lo + filled)


def _publish_ranks(core: Core, identity: ModelIdentity, m: Manifest, full: np.ndarray,
                   payloads: Sequence[Sequence[np.ndarray] | Encoded],
                   parent: SnapshotInfo | None, *, alias_stride: int, max_chain: int,
                   policy: PublishPolicy | None) -> int | str:
    """Publish link ``m``, every rank's payload in turn: the snapshot id, or why
    retention refused it.  On any failure (a streamed piece that fails its
    check included) or a refusal after a first rank, the snapshot this
    started, pending and never offered, is removed with its files."""
    snapshot_id: int | None = None
    whole = False
    try:
        for rank, payload in enumerate(payloads):
            published = publish(core, identity, rank, full, payload,
                                parent=None if parent is None else parent.id,
                                scope=m.scope, breakpoints=m.breakpoints,
                                alias_stride=alias_stride, max_chain=max_chain,
                                policy=policy)
            if published.state == "skipped":
                return published.skipped or "skipped"
            snapshot_id = published.snapshot_id
        whole = True
    finally:
        if not whole and snapshot_id is not None:
            with core.write() as conn:
                info = core.snapshot(conn, snapshot_id)
                if info is not None and info.state == "pending":
                    drop_snapshot(core, conn, snapshot_id, "fetch")
    assert snapshot_id is not None
    return snapshot_id


def _pull(core: Core, tier: SharedTier, identity: ModelIdentity, m: Manifest, full: np.ndarray,
          parent: SnapshotInfo | None, *, alias_stride: int, max_chain: int,
          policy: PublishPolicy | None, result: FetchResult) -> tuple[int | str, np.ndarray, int]:
    """Download link ``m`` (the prompt's token ids before it ``full``) and publish
    it: (the snapshot id or why retention refused it, ``full`` with its token
    ids, bytes fetched).  Streamed, unless its publish compacts the local chain.
    CorruptSnapshot when it fails verification."""
    timer = [0.0]
    payloads: Sequence[Sequence[np.ndarray] | Encoded]
    try:
        with ThreadPoolExecutor(1, "sparkcache-fetch") as pool:
            if parent is not None and parent.depth + 1 >= max_chain:
                # compacted here: rewritten with the parent's rows, not streamed
                tokens, payloads, nbytes = _download(tier, identity, m, timer)
                result.requests += 2 * len(m.segments)
            else:
                remotes = _open_remote(tier, identity, m, timer)
                tokens, nbytes = remotes[0].tokens, sum(r.nbytes for r in remotes)
                payloads = [r.encoded(tier, pool, timer) for r in remotes]
                result.requests += sum(r.requests for r in remotes)
            check_key(identity, tokens, m.snap_key, scope=m.scope,
                      parent_key=None if parent is None else parent.snap_key, reason="tokens",
                      message=f"{m.snap_key}'s token ids do not hash to its key in its scope")
            full = np.concatenate([full, tokens])
            done = _publish_ranks(core, identity, m, full, payloads, parent,
                                  alias_stride=alias_stride, max_chain=max_chain, policy=policy)
    finally:
        result.download_seconds += timer[0]
    return done, full, nbytes


def fetch_chain(core: Core, tier: SharedTier, identity: ModelIdentity, chain: list[Manifest], *,
                alias_stride: int, max_chain: int, policy: PublishPolicy | None,
                result: FetchResult) -> None:
    """Publish every link of ``chain`` (root first) not already local; fills in
    ``result`` (``snapshot_id`` of the last link, ``fetched``, ``nbytes``,
    ``outcome``).  A link that fails verification stops the fetch (``refused``,
    counted ``fetch_refused``); the links before it stay published."""
    full = np.empty(0, np.uint32)
    parent: SnapshotInfo | None = None
    why = _unusable(identity, None, chain)
    if why is not None:
        core.count(0, "fetch_refused")
        result.outcome, result.reason = "refused", why
        return
    for m in chain:
        with _STRIPES[int(m.snap_key[:4], 16) % len(_STRIPES)]:
            info = _local(core, identity, m.snap_key)
            if info is not None and info.state == "pending":
                info = _wait_ready(core, info.id)
            if info is not None and info.n_tokens == m.n_tokens:
                parent = info
                result.snapshot_id = info.id
                continue
            if parent is not None and full.size < parent.n_tokens:
                full = _tokens_of(core, identity, parent, full)
            try:
                done, full, nbytes = _pull(core, tier, identity, m, full, parent,
                                           alias_stride=alias_stride, max_chain=max_chain,
                                           policy=policy, result=result)
            except CorruptSnapshot as exc:
                core.count(0, "fetch_refused")
                result.outcome, result.reason = "refused", str(exc)
                return
            if isinstance(done, str):
                result.outcome, result.reason = "refused", done
                return
            info = _wait_ready(core, done)
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


def _unusable(identity: ModelIdentity, found: RemotePrefix | None,
              chain: Sequence[Manifest]) -> str | None:
    """Why ``chain`` (root first) cannot serve this engine's prompt, before any
    download; None when it can.  A snapshot of another world size (sharded
    otherwise), or one that does not hold the prefix the alias ``found``
    names: no link ends there under that key, and no link lists that alias."""
    for m in chain:
        if m.world_size != identity.world_size:
            return (f"snapshot {m.snap_key} in the tier has world size {m.world_size}, "
                    f"this engine {identity.world_size}")
    if found is None or any((m.n_tokens, m.snap_key) == (found.n_tokens, found.prefix)
                            or (found.n_tokens, found.prefix) in m.aliases for m in chain):
        return None
    return (f"the alias at {found.n_tokens} tokens names snapshot {found.snap_key}, whose "
            "chain does not hold that prefix")


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


def _ends(core: Core, counted: CountedTier, model: str, hashes: Sequence[bytes],
          block_size: int, breakpoints: Sequence[int], result: FetchResult,
          ) -> Iterator[RemotePrefix]:
    """For a windowed identity: the prompt's last whole block, then the stride
    alias's snapshot end and the breakpoints, longest first (each asked only
    if needed); an alias that is not what it claims is counted, not raised."""
    last, *marks = probe_ends(hashes, block_size, breakpoints)
    yield last
    try:
        marked = marked_end(counted, model, hashes, block_size)
    except InvalidArgument as exc:
        core.count(0, "fetch_refused")
        result.reason = str(exc)
        marked = None
    if marked is not None and marked.n_tokens < last.n_tokens:
        marks = sorted({m.n_tokens: m for m in [*marks, marked]}.values(),
                       key=lambda m: -m.n_tokens)
    yield from marks


def _resolved(core: Core, counted: CountedTier, identity: ModelIdentity, found: RemotePrefix,
              result: FetchResult) -> tuple[RemotePrefix, list[Manifest]] | None:
    """The chain of manifests ``found`` leads to, when it can serve the prompt;
    None when it dangles (or no snapshot ends there), or when it is refused
    before any download (counted ``fetch_refused``, ``result.reason``)."""
    windowed, model = identity.ends_only, identity.digest()
    try:
        resolved = (resolve_end if windowed else resolve)(counted, model, found)
    except InvalidArgument as exc:
        core.count(0, "fetch_refused")
        result.reason = str(exc)
        return None
    if resolved is None:
        if not windowed:
            result.reason = f"the alias at {found.n_tokens} tokens names no manifest"
        return None
    why = _unusable(identity, *resolved)
    if why is not None:
        core.count(0, "fetch_refused")
        result.reason = why
        return None
    return resolved


def fetch_prefix(core: Core, tier: SharedTier, identity: ModelIdentity,
          token_ids: Sequence[int] | np.ndarray, *, scope: RequestScope | None,
          breakpoints: Sequence[int] = (), hashes: Sequence[bytes] | None = None,
          alias_stride: int, max_chain: int, policy: PublishPolicy | None,
          min_tokens: int = 1, count_miss: bool = True) -> FetchResult:
    """Find the longest prefix of ``token_ids`` the tier holds and make it local
    (see the module doc); then :func:`sparkcache.lookup.lookup` finds it.

    ``min_tokens``: an alias for fewer tokens is not worth a fetch (a miss);
    ``count_miss`` False: a miss is not counted (the caller asks elsewhere).
    For a windowed identity only a snapshot ending inside the prompt is
    fetched: at its last whole block, at the end its best stride alias names,
    or at one of ``breakpoints`` (:func:`probe_ends`, :func:`marked_end`).
    Raises SparkCacheError when the tier or the index fails.
    """
    started = time.perf_counter()
    tokens = np.asarray(token_ids, np.uint32)
    bs = identity.block_size
    if hashes is None:
        hashes = prefix_hashes(prefix_seed(identity, scope), tokens[:tokens.size // bs * bs], bs)
    counted = CountedTier(tier)
    model = identity.digest()
    result = FetchResult("miss")
    # A windowed snapshot restores only at its end: ask for the manifests that
    # end where the prompt could use one, not for aliases inside snapshots.
    windowed = identity.ends_only
    try:
        for found in (_ends(core, counted, model, hashes, bs, breakpoints, result)
                      if windowed and hashes
                      else probe(counted, model, hashes, bs, breakpoints)):
            if found.n_tokens < min_tokens:
                break
            resolved = _resolved(core, counted, identity, found, result)
            if resolved is None:  # try a shorter one
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
        if result.outcome == "miss" and count_miss:
            core.count(0, "fetch_misses")
        return result
    finally:
        result.requests += counted.requests
        result.seconds = time.perf_counter() - started
        if result.outcome != "miss":  # the counters now, if the index is free; a
            core.try_save()  # miss writes nothing: its counts go with the next write
