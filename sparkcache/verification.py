"""Verification of whole segment files, and the undo of a quarantine.

:func:`read_segment` is the one read of a whole segment file in memory,
every byte verified once (an import, the fetch of a link that compacts, an
upload, an export and ``verify`` all read through it); :func:`same_tokens` and
:func:`check_key` are the checks a snapshot's ranks and key must pass.
``verify`` re-hashes every written segment of every snapshot not quarantined
(a failure quarantines it, exactly as a failed read would); ``requeue`` checks
the quarantined ones again and gives back those whose files are whole.  Both
take the narrow :class:`~sparkcache.core.Core`, and both first look for the
objects the index expects (:func:`~sparkcache.maintenance.check_storage`): a
storage holding none of them changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from sparkcache import segment as seg
from sparkcache.core import Core, SegmentInfo, SnapshotInfo, ids, select_all
from sparkcache.errors import CorruptSnapshot
from sparkcache.hashing import prefix_hashes, prefix_seed
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.index import queries as q
from sparkcache.maintenance import check_storage, insert_boundaries, quarantine

__all__ = ["Problem", "Progress", "RequeueReport", "VerifiedSegment", "VerifyReport",
           "check_key", "read_segment", "requeue", "same_tokens", "verify"]

#: ``progress(done_bytes, total_bytes)``, called as work advances.
Progress = Callable[[int, int], None]


class _VerifyRow(NamedTuple):
    """A row of ``queries.ADMIN_VERIFY_SEGMENTS``: a segment and what its header must say."""

    segment: SegmentInfo
    snap_key: str
    identity_json: str

    @classmethod
    def of(cls, *columns: Any) -> _VerifyRow:
        *segment, snap_key, identity_json = columns
        return cls(SegmentInfo(*segment), snap_key, identity_json)


def _whole_file(core: Core, segment: SegmentInfo, identity: ModelIdentity, snap_key: str,
                tick: Callable[[int], None] = lambda n: None) -> VerifiedSegment:
    """One segment file checked completely (:func:`read_segment`): its header and token ids."""
    with seg.open_segment(core.backend, segment.object_key) as blob:
        return read_segment(blob.buffer, str(segment.digest), identity, segment.rank, snap_key,
                            segment.token_start, segment.token_end, nbytes=segment.nbytes,
                            layers=False, tick=tick)


# -- one segment ---------------------------------------------------------------------


@dataclass(frozen=True)
class VerifiedSegment:
    """A segment file read whole, every byte of it verified (:func:`read_segment`)."""

    header: seg.SegmentHeader
    #: The token ids (uint32), a copy: it outlives the buffer.
    tokens: np.ndarray
    #: Each layer's bytes (uint8), ``layer.0`` first: views of the buffer (drop
    #: them before it closes); empty when the caller did not ask for them.
    layers: tuple[np.ndarray, ...]


def read_segment(
    buf: memoryview, digest: str, identity: ModelIdentity, rank: int, snap_key: str,
    token_start: int, token_end: int, *, nbytes: int | None = None, layers: bool = True,
    tick: Callable[[int], None] = lambda n: None,
) -> VerifiedSegment:
    """Verify one whole segment file in ``buf`` and return its token ids and layers.

    Checks, in this order: its size against ``nbytes`` (what the index or a
    manifest records, when given), the header (:func:`sparkcache.segment.check_header`:
    digest, identity, rank, snapshot key, token range, shapes), then every
    chunk of every tensor, each hashed once.  ``layers=False`` verifies the
    layers all the same but keeps no view of them.  ``tick(n)`` is called as
    ``n`` more bytes are verified.

    Raises CorruptSnapshot with the reason a read would give (``truncated``
    for a size that differs).
    """
    if nbytes is not None and buf.nbytes != nbytes:
        raise CorruptSnapshot(f"the segment holds {buf.nbytes} bytes, {nbytes} are recorded",
                              "truncated")
    header = seg.check_header(buf, digest, identity, rank, snap_key, token_start, token_end)
    tick(header.data_start)
    views: list[np.ndarray] = []
    for i in range(header.n_layers):
        name = f"layer.{i}"
        size = header.tensors[name][1]
        view = seg.verified_view(buf, header, name, size)
        if layers:
            views.append(view)
        del view  # the buffer may be an mmap: keep no view the caller did not ask for
        tick(size)
    size = header.tensors["tokens"][1]
    stored = seg.verified_view(buf, header, "tokens", size)
    tokens = stored.view("<u4").astype(np.uint32)  # a copy
    del stored
    tick(size)
    return VerifiedSegment(header, tokens, tuple(views))


def same_tokens(first: np.ndarray | None, these: np.ndarray, snap_key: str) -> None:
    """A snapshot's ranks must hold the same token ids: ``these`` (a rank's)
    against ``first`` (the first rank's; None for the first rank itself).
    Raises CorruptSnapshot (reason ``tokens``)."""
    if first is not None and not np.array_equal(first, these):
        raise CorruptSnapshot(f"the ranks of {snap_key} disagree on the token ids", "tokens")


def check_key(identity: ModelIdentity, tokens: np.ndarray, snap_key: str, *,
              scope: RequestScope, parent_key: str | None, reason: str,
              message: str) -> list[bytes]:
    """The prefix hashes of a snapshot's own blocks (``tokens``, its token ids),
    whose last must be its key ``snap_key``; else CorruptSnapshot(``message``,
    ``reason``), each caller saying what a wrong key means to it.

    The hashes start from the seed of ``scope`` for a root and continue from
    its parent's key (``parent_key``) for a child.
    """
    seed = prefix_seed(identity, scope) if parent_key is None else bytes.fromhex(parent_key)
    hashes = prefix_hashes(seed, tokens, identity.block_size)
    if not hashes or hashes[-1].hex() != snap_key:
        raise CorruptSnapshot(message, reason)
    return hashes


# -- verify --------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One snapshot (and rank, where known) that failed, and why."""

    snapshot_id: int
    rank: int | None
    reason: str  # digest, tokens, identity, shape, missing, truncated, header, parent, scope
    message: str


@dataclass
class VerifyReport:
    segments: int = 0
    nbytes: int = 0
    corrupt: list[Problem] = field(default_factory=list)
    quarantined: list[int] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.corrupt


def verify(core: Core, progress: Progress | None = None) -> VerifyReport:
    """Re-hash every written segment of every snapshot not yet quarantined.

    A failure quarantines the snapshot (and its descendants) exactly as a failed
    read would, and is listed in the report.  ``progress(done, total)`` counts
    payload bytes.  Snapshots deleted meanwhile are skipped silently.
    """
    check_storage(core)
    report = VerifyReport()
    with core.read() as conn:
        rows = select_all(conn, q.ADMIN_VERIFY_SEGMENTS, into=_VerifyRow.of)
    total = sum(r.segment.nbytes for r in rows)
    identities: dict[str, ModelIdentity] = {}
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(min(done, total), total)

    tick(0)
    lost: set[int] = set()  # quarantined by this run, descendants included
    for segment, snap_key, identity_json in rows:
        sid, rank, nbytes = segment.snapshot_id, segment.rank, segment.nbytes
        expected_done = done + nbytes
        if sid not in lost:
            identity = identities.get(identity_json) or identities.setdefault(
                identity_json, ModelIdentity.from_dict(json.loads(identity_json)))
            try:
                _whole_file(core, segment, identity, snap_key, tick)
            except CorruptSnapshot as exc:
                with core.read() as conn:
                    subtree = ids(conn, q.SUBTREE, (sid,))
                if subtree:  # else it was deleted meanwhile: nothing to report
                    quarantine(core, sid, exc.reason)
                    lost.update(subtree)
                    report.quarantined.append(sid)
                    report.corrupt.append(Problem(sid, rank, exc.reason, str(exc)))
            report.segments += 1
            report.nbytes += nbytes
        done = expected_done - nbytes
        tick(nbytes)
    return report


@dataclass
class RequeueReport:
    """What ``requeue`` gave back, and what stays quarantined, with why."""

    requeued: list[int] = field(default_factory=list)
    still_quarantined: list[Problem] = field(default_factory=list)


def requeue(core: Core, alias_stride: int) -> RequeueReport:
    """Verify every quarantined snapshot again; those whose files are whole now
    (every rank's, every chunk, the key the hash of the chain's tokens in the
    snapshot's scope) become ready again with their boundary rows, parents first.

    The undo for a quarantine caused by a storage that was missing for a while
    (a disk not mounted, a wrong ``--storage``).  Breakpoint rows were kept by
    the quarantine; stride and end rows are computed again from the verified
    token ids.  A snapshot whose parent stays quarantined stays too.
    """
    report = RequeueReport()
    with core.read() as conn:
        waiting = select_all(conn, q.QUARANTINED_PARENTS_FIRST, into=SnapshotInfo)
    for info in waiting:
        problem = _requeue_one(core, info, alias_stride)
        if problem is None:
            report.requeued.append(info.id)
        else:
            report.still_quarantined.append(problem)
    return report


def _requeue_one(core: Core, info: SnapshotInfo, alias_stride: int) -> Problem | None:
    with core.read() as conn:
        chain = core.chain(conn, info.id)
        segments = {link.id: core.segments(conn, link.id) for link in chain}
        model = core.model(conn, info.model_id)
    if model is None:
        return Problem(info.id, None, "missing", "its model row is gone")
    if any(link.state != "ready" for link in chain[:-1]):
        return Problem(info.id, None, "parent", "a snapshot of its chain is still quarantined")
    identity = model.identity()
    tokens: list[np.ndarray] = []
    try:
        for link in chain:
            segs = segments[link.id]
            if [g.rank for g in segs] != list(range(identity.world_size)) or any(
                    g.state != "ready" or g.digest is None for g in segs):
                raise CorruptSnapshot("not every rank's segment is ready", "missing")
            for g in segs if link.id == info.id else segs[:1]:
                read = _whole_file(core, g, identity, link.snap_key)
                if g.rank == 0:
                    tokens.append(read.tokens)
        scope = (RequestScope() if info.scope_json is None
                 else RequestScope.from_canonical(info.scope_json))
        # the whole chain's tokens from the root's seed: every boundary's hash
        hashes = check_key(identity, np.concatenate(tokens), info.snap_key, scope=scope,
                           parent_key=None, reason="scope",
                           message="its key is not the hash of its tokens in its recorded "
                                   "scope (published with a scope before scopes were recorded)")
    except CorruptSnapshot as exc:
        return Problem(info.id, None, exc.reason, str(exc))
    with core.write() as conn:
        conn.execute(q.REQUEUE, (info.id,))
        if conn.changes() == 1:
            insert_boundaries(conn, info.id, info.model_id, hashes, identity.block_size,
                              alias_stride)
            conn.execute(q.BUMP_COUNTER, (info.model_id, "requeued", 1))
    return None
