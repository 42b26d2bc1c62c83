"""The verified read path: walk a snapshot's chain, check, copy out.

For each link of the chain (root first) the segment is opened (mmap where the
backend allows), its header checked against the index digest and the expected
identity, its token ids compared with the prompt's, and every chunk verified
*before* it is copied into the destination (read positionally into a per-thread
chunk buffer where the blob offers ``read_at`` - or into a staging slot's own
room, :class:`~sparkcache.segment.Landing` - else hashed where it lies).  A
ranged read (``start_tokens``) still checks every link's header, identity and
token ids, but never reads the payload below its start.  Any failure
quarantines the link (and so its descendants) and raises
:class:`CorruptSnapshot`; a snapshot that vanished raises :class:`NotFound`.
Both are misses for the caller.  A positional read of a file that shrank is a
short read (``truncated``), where a mapping would have raised SIGBUS.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkcache import segment as seg
from sparkcache.buffers import aligned_empty, as_byte_view
from sparkcache.core import Core, Match
from sparkcache.cpus import pinned_to
from sparkcache.errors import CorruptSnapshot, InvalidArgument, NotFound, SparkCacheError
from sparkcache.identity import ModelIdentity
from sparkcache.index import queries as q
from sparkcache.maintenance import quarantine

__all__ = ["WARM_MAX_FILES", "Warmed", "read_into", "read_pages", "stored_tokens", "warm"]


@dataclass(frozen=True)
class _Link:
    id: int
    start: int
    end: int
    snap_key: str
    object_key: str
    digest: str


def read_pages(
    core: Core, match: Match, rank: int, n_tokens: int | None, *, touch: bool
) -> list[np.ndarray]:
    """Verified pages of the first ``n_tokens`` (default all matched) for ``rank``:
    one fresh uint8 array ``[n_blocks, page_nbytes]`` per layer.  ``touch``
    records the use (a hit); a compaction's internal read does not."""
    out: list[np.ndarray] = []

    def alloc(n_layers: int, n_blocks: int) -> list[np.ndarray]:
        out.extend(np.empty((n_blocks, match.identity.page_nbytes), np.uint8)
                   for _ in range(n_layers))
        return [a.reshape(-1) for a in out]

    _read_chain(core, match, rank, n_tokens, alloc, touch=touch)
    return out


def read_into(
    core: Core, match: Match, rank: int, out: Sequence[Any], *,
    n_tokens: int | None = None, start_tokens: int | Sequence[int] = 0,
    on_layer: Callable[[int], None] | None = None, threads: int = 1,
    cpus: Sequence[int] = (), hit: bool = True, in_place: bool = False,
    record_later: bool = False,
) -> int:
    """Verify and copy tokens ``[start_tokens, n_tokens)`` into ``out``.

    ``out`` holds one writable destination per layer: a buffer, a list of
    buffers written as one (:class:`~sparkcache.segment.Pieces`: runs of KV
    blocks), or a :class:`~sparkcache.segment.Sink` (written in order), at
    least ``(n_tokens - start_tokens) // block_size * page_nbytes`` bytes;
    its page 0 receives block ``start_tokens // block_size``.  Layers are
    copied in order, each from every link of the chain; ``on_layer(i)`` runs
    once layer ``i`` is complete (a consumer may use it while later layers
    are read).  ``start_tokens`` may also be one start per layer (a
    sliding-window layer needs only its window): each layer's destination
    then receives its own start's block first.  Returns the number of blocks
    copied (from the lowest start).  ``hit`` False: the restored amounts are
    counted but not a hit (one restore read in two parts).  A failure may
    leave ``out`` partly written with *verified* bytes only; treat it as a miss.
    ``in_place`` (buffers and lists of buffers only, memory nothing reads until
    this returns): where the store reads positionally, each chunk copied whole
    is read straight into ``out`` and verified there (:class:`~sparkcache.
    segment.InPlace`), so a failure may leave unverified bytes in ``out``: it
    must then be treated as never written.  ``record_later``: the hit is
    kept, not written, for the caller's ``Core.save_counts`` once the restore
    is in use (or the next write)."""
    dests: list[np.ndarray | seg.Sink] = [
        seg.Pieces(o) if isinstance(o, (list, tuple))
        else o if not isinstance(o, np.ndarray) and isinstance(o, seg.Sink)
        else as_byte_view(o, writable=True)
        for o in out
    ]
    if in_place:
        if not all(isinstance(d, (np.ndarray, seg.Pieces)) for d in dests):
            raise InvalidArgument("in_place needs buffers or lists of buffers, not sinks")
        dests = [seg.InPlace(d) for d in dests]
    page = match.identity.page_nbytes
    bs = match.identity.block_size
    starts = [start_tokens] * len(dests) if isinstance(start_tokens, int) else list(start_tokens)
    if len(starts) != len(dests):
        raise InvalidArgument(f"{len(starts)} start_tokens for {len(dests)} destinations")

    def check(n_layers: int, n_blocks: int) -> list[np.ndarray | seg.Sink]:
        if n_layers != len(dests):
            raise InvalidArgument(f"the snapshot has {n_layers} layers, out has {len(dests)}")
        end = n_blocks + min(starts) // bs
        for d, start in zip(dests, starts, strict=True):
            need = (end - start // bs) * page
            if d.size < need:
                raise InvalidArgument(
                    f"each destination needs at least {need} bytes ({need // page} pages of "
                    f"{page} bytes, from token {start}); got {d.size}")
        return dests

    return _read_chain(core, match, rank, n_tokens, check, skip_tokens=start_tokens,
                       on_layer=on_layer, threads=threads, cpus=cpus, hits=int(hit),
                       record_later=record_later)


def stored_tokens(core: Core, match: Match, rank: int, n_tokens: int) -> np.ndarray:
    """The snapshot's stored token ids ``[match.n_tokens, n_tokens)``, verified;
    fewer when the snapshot ends before ``n_tokens``.

    Reads ``rank``'s segments holding them (header, identity and chunk digests
    checked, as on a restore); no payload is read.  Raises NotFound when the
    snapshot is no longer restorable, and CorruptSnapshot (the link
    quarantined) when a segment fails its checks.
    """
    start = match.n_tokens
    if n_tokens <= start:
        raise InvalidArgument(f"n_tokens must be above the match's {start}, got {n_tokens}")
    _model_id, links = _chain_links(core, match, rank, n_tokens)
    parts: list[np.ndarray] = []
    for link in links:
        lo, hi = max(link.start, start), min(link.end, n_tokens)
        if lo >= hi:
            continue
        with _quarantine_on_failure(core, link), \
                _open_verified(core, link, match.identity, rank) as opened:
            stored = _verified_tokens(opened, (hi - link.start) * 4)
            parts.append(stored.view("<u4")[lo - link.start:].copy())  # before it closes
            del stored
    return np.concatenate(parts) if parts else np.empty(0, np.uint32)


def _chain_links(core: Core, match: Match, rank: int, n: int) -> tuple[int, list[_Link]]:
    """(the snapshot's model id, its chain's links holding tokens below ``n``).

    Trusts nothing it did not check: a snapshot of another model than the
    match's identity, or shorter than the match, is the caller's mistake
    (InvalidArgument: nothing is quarantined); links that do not follow each
    other without a gap are a corrupt chain (the link after the gap is
    quarantined, CorruptSnapshot); anything not ready on ``rank`` is NotFound.
    """
    gone = NotFound(f"snapshot {match.snapshot_id} is no longer restorable")
    links: list[_Link] = []
    with core.read() as conn:
        info = core.snapshot(conn, match.snapshot_id)
        model = None if info is None else core.model(conn, info.model_id)
        if info is None or model is None:
            raise gone
        if model.digest != match.identity.digest():
            raise InvalidArgument(
                f"snapshot {match.snapshot_id} belongs to model {model.name} ({model.digest}), "
                f"not to the match's identity ({match.identity.digest()}): pass the Match "
                "that lookup returned for this identity")
        if match.n_tokens > info.n_tokens:
            raise InvalidArgument(
                f"the match says {match.n_tokens} tokens but snapshot {info.id} holds "
                f"{info.n_tokens}: pass the Match that lookup returned")
        for link in core.chain(conn, match.snapshot_id):
            if link.start >= n:
                continue
            segment = core.segment(conn, link.id, rank)
            if link.state != "ready" or segment is None or segment.state != "ready":
                raise gone
            links.append(_Link(link.id, link.start, link.end, link.snap_key,
                               segment.object_key, str(segment.digest)))
    if not links:
        raise gone
    expected_start = 0
    for checked in links:
        if checked.start != expected_start or checked.end <= checked.start:
            with _quarantine_on_failure(core, checked):
                raise CorruptSnapshot(
                    f"chain of snapshot {match.snapshot_id} is broken: link {checked.id} holds "
                    f"tokens [{checked.start}, {checked.end}) where token {expected_start} "
                    "comes next", "chain")
        expected_start = checked.end
    return info.model_id, links


@dataclass(frozen=True)
class _Opened:
    """One link's segment, its header checked; ``read_at`` when the blob has it."""

    buf: memoryview
    header: seg.SegmentHeader
    read_at: seg.ReadAt | None


@dataclass(frozen=True)
class _Copy:
    """What one link contributes to each layer ``i``: its bytes ``[skip[i],
    nbytes[i])`` of the layer's tensor land at byte ``at[i]`` of the layer's
    destination (nothing when ``skip[i] >= nbytes[i]``)."""

    link: _Link
    opened: _Opened
    skip: tuple[int, ...]  # per layer
    nbytes: tuple[int, ...]
    at: tuple[int, ...]


def _read_range(match: Match, n_tokens: int | None,
                skip_tokens: int | Sequence[int]) -> tuple[int, list[int]]:
    """The tokens a read ends at and each layer's first token, checked
    (InvalidArgument: the caller's range is not one of whole blocks inside
    the match)."""
    bs = match.identity.block_size
    n = match.n_tokens if n_tokens is None else n_tokens
    if not 0 < n <= match.n_tokens or n % bs:
        raise InvalidArgument(
            f"n_tokens must be a positive multiple of {bs} up to {match.n_tokens}, got {n}"
        )
    skips = ([skip_tokens] * match.identity.num_layers if isinstance(skip_tokens, int)
             else list(skip_tokens))
    for skip in skips:
        if not 0 <= skip < n or skip % bs:
            raise InvalidArgument(
                f"start_tokens must be a multiple of the block size {bs} in [0, {n}) "
                f"(below n_tokens), got {skip}"
            )
    return n, skips


def _read_chain(
    core: Core, match: Match, rank: int, n_tokens: int | None,
    dest_for: Callable[[int, int], Sequence[np.ndarray | seg.Sink]], *, touch: bool = True,
    hits: int = 1, skip_tokens: int | Sequence[int] = 0, record_later: bool = False,
    on_layer: Callable[[int], None] | None = None, threads: int = 1, cpus: Sequence[int] = (),
) -> int:
    """Verify the chain's tokens ``[0, n)`` and copy the pages of ``[skip_tokens, n)``.

    ``dest_for(n_layers, n_blocks)`` returns one flat destination per layer for
    the ``n_blocks`` copied pages (page 0 = block ``skip_tokens // block_size``).
    Every link is opened and its header, identity and token ids checked before
    any payload is copied, so the whole prefix is proven; payload below
    ``skip_tokens`` is never read.  Then layer by layer (``on_layer`` after
    each), every link's part of that layer.  ``skip_tokens`` may be one start
    per layer (page 0 of layer ``i``'s destination is then block
    ``skip_tokens[i] // block_size``); a layer that keeps only a window of
    blocks (``identity.window_blocks``) and lacks one at or above its start is
    NotFound (a miss: that prefix's window was not stored).
    """
    identity = match.identity
    identity.check_rank(rank)
    bs = identity.block_size
    n, skips = _read_range(match, n_tokens, skip_tokens)
    low = min(skips)
    model_id, links = _chain_links(core, match, rank, n)
    skip_blocks = low // bs
    dests: Sequence[np.ndarray | seg.Sink] | None = None
    copies: list[_Copy] = []
    with ExitStack() as stack:
        try:
            for link in links:
                stop = min(link.end, n)
                with _quarantine_on_failure(core, link):
                    opened = stack.enter_context(_open_verified(core, link, identity, rank))
                    stored = _verified_tokens(opened, (stop - link.start) * 4)
                    if not np.array_equal(stored.view("<u4"), match.token_ids[link.start:stop]):
                        _other_tokens(match)
                    del stored
                    n_layers = opened.header.n_layers
                    if dests is None:
                        if n_layers != len(skips):
                            raise InvalidArgument(f"{len(skips)} start_tokens for "
                                                  f"{n_layers} layers")
                        dests = dest_for(n_layers, n // bs - skip_blocks)
                    elif n_layers != len(dests):
                        raise CorruptSnapshot("chain links disagree on the layer count",
                                              "shape")
                if stop > low:  # else wholly below the range: payload unread
                    copies.append(_link_copy(identity, link, opened, stop, skips))
                del opened
            assert dests is not None
            _copy_layers(core, copies, dests, on_layer, threads, cpus)
            copied = sum(max(0, b - a) for c in copies
                         for a, b in zip(c.skip, c.nbytes, strict=True))
        finally:
            copies.clear()  # drop the views before the mmaps close
    n_blocks = n // bs - skip_blocks
    if touch:
        _touch(core, model_id, links, n - low, copied, hits, later=record_later)
    return n_blocks


def _other_tokens(match: Match) -> None:
    """Raise for stored token ids (they passed their digests) unlike the match's.

    A match of the store's own lookup was found by prefix hashes of the
    prompt, so the snapshot's index rows and its file disagree: damage, and
    the link is quarantined (else it would be offered and fail forever).  A
    Match the caller made is the caller's mistake: nothing is quarantined.
    """
    if match.from_lookup:
        raise CorruptSnapshot(f"snapshot {match.snapshot_id} holds other token ids than its "
                              "index rows were made from", "tokens")
    raise InvalidArgument(f"snapshot {match.snapshot_id} holds other token ids than the "
                          "match: pass the Match that lookup returned for this prompt")


def _link_copy(identity: ModelIdentity, link: _Link, opened: _Opened, stop: int,
               skips: Sequence[int]) -> _Copy:
    """What ``link`` contributes to each layer: blocks from the layer's start (or
    the link's) below ``stop``, in the layer's stored range."""
    bs, page = identity.block_size, identity.page_nbytes
    begin, end, stop_block = link.start // bs, link.end // bs, stop // bs
    skip, nbytes, at = [], [], []
    for i, start in enumerate(skips):
        first = max(begin, start // bs)  # the first block copied from here
        if first >= stop_block:
            skip.append(0)
            nbytes.append(0)
            at.append(0)
            continue
        stored = identity.first_stored_block(i, begin, end)
        if first < stored:
            raise NotFound(f"layer {i} of snapshot link {link.id} keeps blocks from "
                           f"{stored}; block {first} (its window at this prefix) was not stored")
        skip.append((first - stored) * page)
        nbytes.append((stop_block - stored) * page)
        at.append((first - start // bs) * page)
    return _Copy(link, opened, tuple(skip), tuple(nbytes), tuple(at))


class _Layers:
    """The layers of one copy, handed out one at a time to the copying threads;
    each reported (``on_layer``) once it and every layer below it are complete.
    The first failure stops the handing out."""

    def __init__(self, n_layers: int, on_layer: Callable[[int], None] | None) -> None:
        self.n_layers = n_layers
        self.on_layer = on_layer
        self.lock = threading.Lock()
        self.done = [False] * n_layers
        self.reported = 0
        self.taken = 0
        self.failure: list[BaseException] = []

    def take(self) -> int | None:
        """The next layer no thread has taken, or None: all taken, or one failed."""
        with self.lock:
            if self.failure or self.taken == self.n_layers:
                return None
            self.taken += 1
            return self.taken - 1

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            self.failure.append(exc)

    def finish(self, i: int) -> None:
        with self.lock:
            self.done[i] = True
            while (self.reported < self.n_layers and self.done[self.reported]
                   and not self.failure):
                if self.on_layer is not None:
                    self.on_layer(self.reported)
                self.reported += 1


def _copy_layer(core: Core, copies: list[_Copy], dest: np.ndarray | seg.Sink, i: int,
                bounce: np.ndarray | None) -> None:
    """Verify and copy layer ``i`` of every link into ``dest``."""
    for c in copies:
        if c.skip[i] >= c.nbytes[i]:
            continue
        with _quarantine_on_failure(core, c.link):
            seg.copy_verified(c.opened.buf, c.opened.header, f"layer.{i}",
                              c.nbytes[i], dest, skip=c.skip[i], at=c.at[i],
                              read_at=c.opened.read_at, bounce=bounce)


def _copy_layers(core: Core, copies: list[_Copy],
                 dests: Sequence[np.ndarray | seg.Sink],
                 on_layer: Callable[[int], None] | None, threads: int,
                 cpus: Sequence[int] = ()) -> None:
    """Verify and copy every layer from every link; ``on_layer`` in layer order.

    With ``threads`` > 1 this thread and helpers take the next layer not yet
    taken (xxhash and numpy release the GIL: one thread alone does not saturate
    the memory bus), so a thread slowed by a busy core takes fewer layers; a
    layer is reported once it and every layer below it are complete.  The first
    failure stops the others and is raised.  With ``cpus``, thread ``k`` (0 is
    this one) runs on ``cpus[k % len(cpus)]`` alone until the copy ends
    (:func:`sparkcache.cpus.pinned_to`).
    """
    layers = _Layers(len(dests), on_layer)
    threads = max(1, min(threads, len(dests)))
    positional = any(c.opened.read_at is not None for c in copies)

    def run(k: int) -> None:
        # Positional reads land here, one chunk at a time, reused by this thread.
        bounce = aligned_empty(seg.CHUNK_BYTES) if positional else None
        with pinned_to(cpus[k % len(cpus)] if cpus else None):
            while (i := layers.take()) is not None:
                try:
                    _copy_layer(core, copies, dests[i], i, bounce)
                except BaseException as exc:  # handed to the caller's thread
                    layers.fail(exc)
                    return
                layers.finish(i)

    helpers = [threading.Thread(target=run, args=(k,), name=f"sparkcache-read-{k}", daemon=True)
               for k in range(1, threads)]
    for helper in helpers:
        helper.start()
    run(0)
    for helper in helpers:
        helper.join()
    if layers.failure:
        raise layers.failure[0]


def _verified_tokens(opened: _Opened, nbytes: int) -> np.ndarray:
    """The segment's first ``nbytes`` of token ids, verified (a copy when read
    positionally, else a view of the mapping)."""
    if opened.read_at is None:
        return seg.verified_view(opened.buf, opened.header, "tokens", nbytes)
    tokens = np.empty(nbytes, np.uint8)
    seg.copy_verified(opened.buf, opened.header, "tokens", nbytes, tokens,
                      read_at=opened.read_at)
    return tokens


@contextmanager
def _quarantine_on_failure(core: Core, link: _Link) -> Iterator[None]:
    try:
        yield
    except CorruptSnapshot as exc:
        quarantine(core, link.id, exc.reason)
        raise


@contextmanager
def _open_verified(
    core: Core, link: _Link, identity: ModelIdentity, rank: int
) -> Iterator[_Opened]:
    with seg.open_segment(core.backend, link.object_key) as blob:
        buf = blob.buffer
        try:
            header = seg.check_header(buf, link.digest, identity, rank, link.snap_key,
                                      link.start, link.end)
            yield _Opened(buf, header, getattr(blob, "read_at", None))
        finally:
            del buf


def _touch(core: Core, model_id: int, links: list[_Link], n: int, nbytes: int,
           hits: int = 1, *, later: bool = False) -> None:
    """Record the hit: every link read was used, and the restored amounts."""
    core.record_use([link.id for link in links], model_id,
                    {"hits": hits, "restored_tokens": n, "restored_bytes": nbytes}, later=later)


#: The most segment files one :func:`warm` considers (a bound on its query).
WARM_MAX_FILES = 100_000
#: The chunk :func:`warm` reads files through.
WARM_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Warmed:
    """What :func:`warm` read into the page cache."""

    #: The snapshots whose every segment file was read whole.
    snapshots: frozenset[int]
    files: int
    nbytes: int
    seconds: float


def warm(core: Core, identities: Sequence[ModelIdentity], max_bytes: int,
         stop: Callable[[], bool] | None = None) -> Warmed:
    """Read the segment files of ``identities``' most recently used ready
    snapshots, newest use first across them all (an engine's own sharding and
    the others of the same KV it restores from), into the OS page cache, up to
    ``max_bytes`` in all (a file that does not fit in what is left is skipped).

    Nothing is verified, kept or handed out: a restore still verifies every
    byte it copies.  Only a backend whose objects are local files (``warm``)
    has a page cache to fill; with another, nothing is read.  A file that
    is missing or cannot be read is skipped (a restore of it finds out).
    ``stop()`` true ends the read between chunks.
    """
    started = time.perf_counter()
    reader = getattr(core.backend, "warm", None)
    if max_bytes <= 0 or reader is None:
        return Warmed(frozenset(), 0, 0, 0.0)
    with core.read() as conn:
        found = {mid for ident in identities if (mid := core.model_id(conn, ident)) is not None}
        per_model = [[(float(used), int(sid), str(key), int(size)) for used, sid, key, size
                      in conn.execute(q.WARM_SEGMENTS, (mid, WARM_MAX_FILES))]
                     for mid in sorted(found)]
    # Each model's rows come newest use first; merged, the whole family's are.
    rows = list(heapq.merge(*per_model, key=lambda row: (-row[0], -row[1])))[:WARM_MAX_FILES]
    chunk = aligned_empty(WARM_CHUNK_BYTES)
    left, files, whole = max_bytes, 0, dict[int, bool]()
    for _used, sid, key, size in rows:
        if stop is not None and stop():
            break
        if size > left:
            whole[sid] = False
            continue
        try:
            done = reader(key, chunk, stop)
        except (SparkCacheError, OSError):
            done = -1
        whole[sid] = whole.get(sid, True) and done == size
        if done > 0:
            left -= done
            files += 1
    return Warmed(frozenset(sid for sid, ok in whole.items() if ok), files,
                  max_bytes - left, time.perf_counter() - started)
