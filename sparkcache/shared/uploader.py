"""Replication: every locally ready snapshot is copied to the shared tier.

The queue is the index itself: the ready snapshots whose ``uploaded_at`` is
NULL, parents first (``queries.UPLOAD_QUEUE``, one range scan of a partial
index).  Nothing is queued in memory, so the queue is bounded by the store's
own retention, survives a restart (what a crash or an outage left behind goes
at the next start) and needs no message from the processes that publish: the
:class:`Uploader` thread polls it, and :meth:`Uploader.wake` polls at once.

:func:`upload_snapshot` sends one snapshot, all of its ranks, in the order
that keeps the tier consistent at every instant (docs/shared.md):

1. its parent must be uploaded already (a chain reaches the tier root first);
2. a manifest already in the tier means the snapshot is there (uploaded by
   this host before a crash, or by another host): only its use record is
   rewritten (:func:`~sparkcache.shared.sweep.mark_used`: its age restarts);
   otherwise a child's parent must still be in the tier: a parent the tier's
   sweep deleted is queued again (its ``uploaded_at`` cleared) and goes first;
3. under an ``upload`` lease (eviction waits), each rank's segment file is
   verified whole (header, every chunk, and the snapshot key against its
   token ids: a corrupt file is quarantined, never spread) and sent unless an
   object of its key and size is there;
4. the aliases of its stride boundaries and breakpoints, unless there
   (a child's breakpoint inside its parent's range too: the local index offers
   that prefix from the child, so the tier does; its hash is the index's row,
   the link's own token ids cannot give it);
5. last, its manifest: the snapshot becomes visible in the tier whole or not
   at all; then ``uploaded_at`` is set.

Every step is idempotent, so a retry after any failure sends only what is
missing.  Failures of the tier are counted (``upload_failures``), logged once
per burst and retried with exponential backoff; they never reach a publish, a
request or the engine, which never wait for the uploader.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field

from sparkcache import segment as seg
from sparkcache.core import Core, SegmentInfo, SnapshotInfo, ids, scalar
from sparkcache.errors import CorruptSnapshot, InvalidArgument, SparkCacheError, StoreClosed
from sparkcache.holders import this_holder
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.index import queries as q
from sparkcache.maintenance import quarantine
from sparkcache.periodic import Periodic
from sparkcache.shared.layout import (
    Alias,
    Manifest,
    SegmentEntry,
    alias_blocks,
    alias_bytes,
    alias_key,
    manifest_bytes,
    manifest_key,
    model_key,
    segment_key,
)
from sparkcache.shared.sweep import mark_used
from sparkcache.shared.tier import SharedTier, describe_error
from sparkcache.verification import check_key, read_segment

__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_POLL_SECONDS",
    "UPLOAD_LEASE",
    "UploadReport",
    "UploadResult",
    "Uploader",
    "pending_uploads",
    "upload_pending",
    "upload_snapshot",
]

log = logging.getLogger(__name__)

#: The lease an upload holds on its snapshot: eviction and deletion wait for it.
UPLOAD_LEASE = "upload"
UPLOAD_LEASE_SECONDS = 3600.0
#: How often the uploader looks for new ready snapshots when not woken.
DEFAULT_POLL_SECONDS = 1.0
#: Snapshots read from the queue at a time.
DEFAULT_BATCH = 32
#: Exponential backoff after a failure of the tier: first delay, longest delay.
BACKOFF_SECONDS = (1.0, 300.0)
#: How long ``Uploader.close`` waits, past its deadline, for an upload in flight.
JOIN_GRACE_SECONDS = 5.0
#: Failed snapshots in a row after which a pass stops (the tier itself fails);
#: fewer are passed over, so that one snapshot that fails cannot hold up the rest.
MAX_FAILURES_IN_A_ROW = 3


@dataclass(frozen=True)
class UploadResult:
    """What :func:`upload_snapshot` did with one snapshot.

    ``outcome``: ``uploaded`` (its manifest was written now), ``present`` (the
    tier had it already: nothing more was sent), ``waiting`` (its parent is not
    uploaded yet), ``requeued`` (its parent was swept from the tier: the
    parent is queued again, and this one follows it), ``gone`` (deleted or no
    longer ready meanwhile) or
    ``refused`` (it cannot be uploaded: a corrupt file, now quarantined, or a
    key that its recorded scope does not rebuild; ``reason`` says which).
    """

    snapshot_id: int
    outcome: str
    objects_put: int = 0
    objects_found: int = 0
    bytes_put: int = 0
    reason: str | None = None


@dataclass
class UploadReport:
    """What :func:`upload_pending` did, and what is left."""

    uploaded: list[int] = field(default_factory=list)
    present: list[int] = field(default_factory=list)
    refused: list[UploadResult] = field(default_factory=list)
    objects_put: int = 0
    objects_found: int = 0
    bytes_put: int = 0
    pending: int = 0  # ready snapshots still not uploaded
    error: str | None = None  # the first failure of the tier (the others went on)
    failed: list[int] = field(default_factory=list)  # snapshots whose upload failed

    def add(self, result: UploadResult) -> None:
        if result.outcome == "uploaded":
            self.uploaded.append(result.snapshot_id)
        elif result.outcome == "present":
            self.present.append(result.snapshot_id)
        elif result.outcome == "refused":
            self.refused.append(result)
        self.objects_put += result.objects_put
        self.objects_found += result.objects_found
        self.bytes_put += result.bytes_put


def pending_uploads(core: Core) -> int:
    """How many ready snapshots are not uploaded yet."""
    with core.read() as conn:
        return scalar(conn, q.UPLOAD_QUEUE_COUNT)


# -- one snapshot --------------------------------------------------------------------------


def upload_snapshot(core: Core, tier: SharedTier, snapshot_id: int) -> UploadResult:
    """Copy one ready snapshot (every rank) to ``tier``; see the module doc.

    Raises SparkCacheError when the tier (or the index) fails: nothing is then
    visible in the tier that was not whole, and a later call sends the rest.
    """
    with core.read() as conn:
        info = core.snapshot(conn, snapshot_id)
        if info is None or info.state != "ready":
            return UploadResult(snapshot_id, "gone")
        if info.uploaded_at is not None:
            return UploadResult(snapshot_id, "present")
        parent = None if info.parent_id is None else core.snapshot(conn, info.parent_id)
        model = core.model(conn, info.model_id)
        segments = core.segments(conn, snapshot_id)
        marks = ids(conn, q.BREAKPOINTS_OF, (snapshot_id,))
        below = [(int(n), bytes(h)) for n, h in
                 conn.execute(q.BREAKPOINTS_BELOW, (snapshot_id, info.start_token))]
    if model is None or (info.parent_id is not None and parent is None):
        return UploadResult(snapshot_id, "gone")
    if parent is not None and parent.uploaded_at is None:
        return UploadResult(snapshot_id, "waiting",
                            reason=f"its parent {parent.id} is not uploaded yet")
    identity = model.identity()
    if tier.exists(manifest_key(identity.digest(), info.snap_key)):
        # Another host's copy (or this host's before a crash): this host computed
        # the prefix again, so it is in use: its age in the tier restarts.
        mark_used(tier, identity.digest(), info.snap_key)
        _finish(core, info, None)
        core.count(info.model_id, "uploads.present")
        return UploadResult(snapshot_id, "present", objects_found=1)
    if parent is not None and not tier.exists(manifest_key(identity.digest(), parent.snap_key)):
        # The tier's sweep deleted the parent after it was uploaded; this new child
        # shows the chain is in use again, so the parent goes first (not a loop:
        # only a new local child sends a swept parent again).
        with core.write() as conn:
            conn.execute(q.FORGET_UPLOAD, (parent.id,))
        return UploadResult(snapshot_id, "requeued",
                            reason=f"its parent {parent.id} was swept from the tier: it is "
                                   "uploaded again first")
    lease = _lease(core, snapshot_id)
    if lease is None:
        return UploadResult(snapshot_id, "gone")
    try:
        result = _send(core, tier, identity, info, parent, segments, marks, below)
    except BaseException:
        _release(core, lease)
        raise
    if result.outcome != "uploaded":
        _release(core, lease)
        return result
    _finish(core, info, lease)
    for name, value in (("uploads", 1), ("upload_objects", result.objects_put),
                        ("upload_objects_found", result.objects_found),
                        ("upload_bytes", result.bytes_put)):
        core.count(info.model_id, name, value)
    return result


def _scope(info: SnapshotInfo) -> RequestScope | None:
    """The scope a snapshot was published in (the default one when the index did
    not record it: its key is checked against that); None when unreadable."""
    if info.scope_json is None:
        return RequestScope()
    try:
        return RequestScope.from_dict(json.loads(info.scope_json))
    except (ValueError, InvalidArgument):
        return None


#: Why a snapshot whose key is not the hash of its token ids is not uploaded.
_UNFINDABLE = ("its key is not the hash of its token ids in its recorded request scope (a "
               "snapshot published with a scope before the index recorded scopes): another "
               "host could not find it, so it is not uploaded")


def _send(core: Core, tier: SharedTier, identity: ModelIdentity, info: SnapshotInfo,
          parent: SnapshotInfo | None, segments: list[SegmentInfo],
          marks: list[int], below: list[tuple[int, bytes]]) -> UploadResult:
    """Steps 3 to 5 of the module doc, under the caller's lease.  ``below``: the
    (tokens, prefix hash) of its breakpoints inside its parent's range."""
    sid, model = info.id, identity.digest()
    scope = _scope(info)
    if scope is None:
        return UploadResult(sid, "refused", reason=f"its recorded scope {info.scope_json} is "
                                                   "not a request scope")
    if sorted(g.rank for g in segments) != list(range(identity.world_size)) or any(
            g.state != "ready" or g.digest is None for g in segments):
        return UploadResult(sid, "refused", reason="not every rank's segment is ready")
    tally = _Tally()
    tally.count(tier.put_once(model_key(model), identity.canonical().encode()))
    sent = _send_segments(core, tier, identity, info, parent, segments, scope, tally)
    if isinstance(sent, UploadResult):
        return sent
    entries, hashes = sent
    bs = identity.block_size
    start_blocks = info.start_token // bs
    aliases = [(n, h.hex()) for n, h in below]
    aliases += [((i + 1) * bs, hashes[i - start_blocks].hex())
                for i in alias_blocks(start_blocks, info.n_tokens // bs,
                                      tier.alias_stride // bs, [b // bs for b in marks])]
    for n, prefix in aliases:
        if tier.exists(alias_key(model, prefix)):  # the first upload's alias stays
            tally.count(False)
            continue
        tier.put(alias_key(model, prefix), [alias_bytes(Alias(prefix, n, info.snap_key,
                                                               info.n_tokens))])
        tally.count(True)
    manifest = Manifest(model, info.snap_key, info.n_tokens, info.start_token,
                        None if parent is None else parent.snap_key, scope, tuple(marks),
                        identity.world_size, tuple(entries), tuple(aliases))
    # False: another host finished it meanwhile
    tally.count(tier.put_once(manifest_key(model, info.snap_key), manifest_bytes(manifest)))
    return tally.result(sid, "uploaded")


@dataclass
class _Tally:
    """Objects sent and found already there by one upload, and the bytes sent."""

    put: int = 0
    found: int = 0
    sent: int = 0

    def count(self, wrote: bool, nbytes: int = 0) -> None:
        self.put += wrote
        self.found += not wrote
        self.sent += nbytes if wrote else 0

    def result(self, sid: int, outcome: str, reason: str | None = None) -> UploadResult:
        return UploadResult(sid, outcome, self.put, self.found, self.sent, reason=reason)


def _send_segments(core: Core, tier: SharedTier, identity: ModelIdentity, info: SnapshotInfo,
                   parent: SnapshotInfo | None, segments: list[SegmentInfo],
                   scope: RequestScope, tally: _Tally,
                   ) -> tuple[list[SegmentEntry], list[bytes]] | UploadResult:
    """Each rank's file verified whole and sent unless there (step 3): the
    manifest's segment entries and the prefix hashes of the snapshot's own
    blocks; or the refusal of a file that fails (quarantined, unless only its
    recorded scope is wrong)."""
    model = identity.digest()
    entries: list[SegmentEntry] = []
    hashes: list[bytes] = []
    for g in segments:
        digest = str(g.digest)
        key = segment_key(model, info.snap_key, g.rank, digest)
        try:
            with seg.open_segment(core.backend, g.object_key) as blob:
                buf = blob.buffer
                read = read_segment(buf, digest, identity, g.rank, info.snap_key,
                                    g.token_start, g.token_end, layers=False)
                if g.rank == 0:  # the prefix hashes of its own blocks, for its aliases
                    hashes = check_key(
                        identity, read.tokens, info.snap_key, scope=scope,
                        parent_key=None if parent is None else parent.snap_key,
                        reason="scope", message=_UNFINDABLE)
                wrote = tier.put_once(key, buf)
                del buf
        except CorruptSnapshot as exc:
            if exc.reason != "scope":
                quarantine(core, info.id, exc.reason)
            return tally.result(info.id, "refused", str(exc))
        tally.count(wrote, g.nbytes)
        entries.append(SegmentEntry(g.rank, key, g.nbytes, digest, g.token_start, g.token_end))
    return entries, hashes


def _lease(core: Core, snapshot_id: int) -> int | None:
    """Take the upload lease; None when the snapshot is gone."""
    now = core.clock()
    with core.write() as conn:
        if core.snapshot(conn, snapshot_id) is None:
            return None
        return scalar(conn, q.INSERT_LEASE, (snapshot_id, this_holder(), UPLOAD_LEASE, now,
                                             now + UPLOAD_LEASE_SECONDS))


def _release(core: Core, lease: int) -> None:
    with contextlib.suppress(SparkCacheError), core.write() as conn:
        conn.execute(q.DELETE_LEASE, (lease,))


def _finish(core: Core, info: SnapshotInfo, lease: int | None) -> None:
    """The snapshot is in the tier: ``uploaded_at``, and the lease goes, in one write."""
    with core.write() as conn:
        conn.execute(q.MARK_UPLOADED, (core.clock(), info.id))
        if lease is not None:
            conn.execute(q.DELETE_LEASE, (lease,))


# -- the queue -----------------------------------------------------------------------------


def upload_pending(core: Core, tier: SharedTier, *, limit: int | None = None) -> UploadReport:
    """Upload what the queue holds now, parents first, until it is empty or
    ``limit`` snapshots were looked at.  A snapshot whose upload fails is passed
    over (``failed``, the first ``error``; it stays queued) and the rest go on,
    until :data:`MAX_FAILURES_IN_A_ROW` fail in a row (the tier itself fails).
    Synchronous: the command line's and the tests' way in."""
    report = UploadReport()
    skip: set[int] = set()  # refused, failed, or waiting for a parent that was
    seen = in_a_row = 0
    while (limit is None or seen < limit) and in_a_row < MAX_FAILURES_IN_A_ROW:
        with core.read() as conn:
            queue = [s for s in ids(conn, q.UPLOAD_QUEUE, (DEFAULT_BATCH + len(skip),))
                     if s not in skip]
        progressed = False
        for sid in queue[:None if limit is None else limit - seen]:
            seen += 1
            try:
                result = upload_snapshot(core, tier, sid)
            except SparkCacheError as exc:
                report.error = report.error or describe_error(exc)
                report.failed.append(sid)
                skip.add(sid)
                core.count(0, "upload_failures")
                in_a_row += 1
                if in_a_row >= MAX_FAILURES_IN_A_ROW:
                    break
                continue
            in_a_row = 0
            report.add(result)
            if result.outcome in ("refused", "waiting"):
                skip.add(sid)
            progressed = progressed or result.outcome != "waiting"
        if not progressed:
            break
    core.try_save()
    report.pending = pending_uploads(core)
    return report


class _BackOff(SparkCacheError):
    """A pass of the uploader whose snapshots all failed (each counted): wait."""


class Uploader:
    """Uploads the queue (see the module doc) on a daemon thread (a
    :class:`~sparkcache.periodic.Periodic`).

    Started in the one process per host that runs it (the connector's
    scheduler), on its own store's core.  Polls every ``poll_seconds`` and
    at once after :meth:`wake`; after a failure of the tier it waits
    ``BACKOFF_SECONDS`` doubling up to their maximum, logs the first failure
    of a burst and the recovery, and counts every one (``upload_failures``,
    and :attr:`failures`).  :meth:`close` waits up to ``wait`` seconds for the
    queue to empty, so that a snapshot published just before a clean exit
    reaches the tier; what is left goes at the next start.
    """

    def __init__(self, core: Core, tier: SharedTier, *,
                 poll_seconds: float = DEFAULT_POLL_SECONDS, batch: int = DEFAULT_BATCH,
                 backoff: tuple[float, float] = BACKOFF_SECONDS) -> None:
        if not poll_seconds > 0 or batch < 1 or not 0 < backoff[0] <= backoff[1]:
            raise InvalidArgument("poll_seconds and the backoff must be positive, batch >= 1")
        self.core = core
        self.tier = tier
        self.poll_seconds = poll_seconds
        self.batch = batch
        self.backoff = backoff
        self._deadline: float | None = None
        self._passed = threading.Condition()
        self._skip: set[int] = set()
        #: Snapshots whose upload failed: when each may be tried again, its failures.
        self._held: dict[int, tuple[float, int]] = {}
        self._burst = 0  # failures since the tier last worked
        self._started = 0  # passes begun
        self._idle_through = 0  # the last pass that found the queue empty
        self._close_after = 0  # closing: a pass from this one on must find it empty
        self._quit = False  # closing: the store closed under a pass, end now
        self.passes = 0  # passes finished
        self.failures = 0
        self.uploaded = 0
        self.last_error: BaseException | None = None
        self._periodic = Periodic(self._tick, poll_seconds, name="sparkcache-uploader",
                                  on_error=self._on_error, until=self._drained)

    def start(self) -> Uploader:
        if not self._periodic.started:
            self._deadline = None
            self._quit = False
        self._periodic.start()
        return self

    def wake(self) -> None:
        """Look at the queue now (a snapshot was published)."""
        self._periodic.wake()

    @property
    def running(self) -> bool:
        return self._periodic.running

    @property
    def idle(self) -> bool:
        """The last finished pass found nothing to upload."""
        return self.passes > 0 and self._idle_through == self.passes

    def _drained(self) -> bool:
        """Once closed, whether to stop now: a pass begun after the close found
        the queue empty, or the deadline passed."""
        return (self._quit or self._idle_through >= self._close_after or self._deadline is None
                or time.monotonic() >= self._deadline)

    def _until_deadline(self, delay: float) -> float:
        """``delay``, cut to what is left of the closing deadline."""
        if self._deadline is None:
            return delay
        return min(delay, max(0.0, self._deadline - time.monotonic()))

    def _tick(self) -> float:
        """One pass, its bookkeeping, and the wait after it: none while busy."""
        with self._passed:
            self._started += 1
            number = self._started
        busy = empty = False
        try:
            busy, empty = self._pass()
        finally:
            with self._passed:
                self.passes = number
                if empty:
                    self._idle_through = number
                self._passed.notify_all()
        return self._until_deadline(0.0 if busy else self.poll_seconds)

    def _on_error(self, error: Exception) -> float:
        """The tier or the index failed: count, log once per burst, back off."""
        if self._periodic.stopping and (isinstance(error, StoreClosed) or self._drained()):
            self._quit = True  # closed under an upload that ran past the deadline: quietly
            return 0.0
        if not isinstance(error, _BackOff):  # (a _BackOff's failures are counted)
            self._failed(error)
        return self._until_deadline(
            min(self.backoff[1], self.backoff[0] * 2 ** (max(1, self._burst) - 1)))

    def _pass(self) -> tuple[bool, bool]:
        """Upload one batch of the queue: (whether to look again at once, whether
        the queue was empty).  A snapshot that fails is held back (its own
        backoff) and the others go on; when every one tried fails, or
        :data:`MAX_FAILURES_IN_A_ROW` in a row, the last failure is raised."""
        now = time.monotonic()
        with self.core.read() as conn:
            queue = [s for s in ids(conn, q.UPLOAD_QUEUE,
                                    (self.batch + len(self._skip) + len(self._held),))
                     if s not in self._skip and self._held.get(s, (0.0, 0))[0] <= now]
        progressed = False
        failed = in_a_row = 0
        for sid in queue[:self.batch]:
            if self._periodic.stopping and self._deadline is not None \
                    and time.monotonic() >= self._deadline:
                return False, False
            try:
                result = upload_snapshot(self.core, self.tier, sid)
            except SparkCacheError as exc:
                if isinstance(exc, StoreClosed) or self._periodic.stopping:
                    raise  # closing: _on_error decides
                self._hold(sid, exc)
                failed, in_a_row = failed + 1, in_a_row + 1
                if in_a_row >= MAX_FAILURES_IN_A_ROW:
                    raise _BackOff from exc
                continue
            in_a_row = 0
            self._worked(sid, result)
            progressed = progressed or result.outcome != "waiting"
        if failed and not progressed:
            raise _BackOff
        # Only children whose parents are not up yet: poll, do not spin.
        return progressed, not queue

    def _hold(self, sid: int, error: SparkCacheError) -> None:
        """A snapshot's upload failed: counted and logged (once per burst), and
        it is held back for its own backoff, doubling with its failures."""
        self._failed(error)
        failures = self._held.get(sid, (0.0, 0))[1] + 1
        delay = min(self.backoff[1], self.backoff[0] * 2 ** (failures - 1))
        self._held[sid] = (time.monotonic() + delay, failures)

    def _worked(self, sid: int, result: UploadResult) -> None:
        """Bookkeeping after an upload that did not fail."""
        self._held.pop(sid, None)
        if self._burst:
            log.info("sparkcache: uploads to the shared tier %s work again after %d "
                     "failed attempts", self.tier.url, self._burst)
            self._burst = 0
        if result.outcome == "refused":
            self._skip.add(sid)
            log.warning("sparkcache: snapshot %d is not uploaded to %s: %s", sid,
                        self.tier.url, result.reason)
        elif result.outcome == "waiting" and self._parent_skipped(sid):
            self._skip.add(sid)
        self.uploaded += result.outcome == "uploaded"

    def _parent_skipped(self, snapshot_id: int) -> bool:
        with self.core.read() as conn:
            info = self.core.snapshot(conn, snapshot_id)
        return info is not None and info.parent_id in self._skip

    def _failed(self, error: BaseException) -> None:
        self.failures += 1
        self.last_error = error
        self._burst += 1
        with contextlib.suppress(SparkCacheError):
            self.core.count(0, "upload_failures")
            self.core.try_save()
        if self._burst == 1:
            log.warning("sparkcache: uploads to the shared tier %s fail: %s; retrying with "
                        "backoff (failures are counted as upload_failures, not logged again "
                        "until uploads work)", self.tier.url, describe_error(error))

    def drain(self, timeout: float | None = None) -> bool:
        """Wake the thread and wait until a pass begun after this call finds the
        queue empty (True) or ``timeout`` runs out (False)."""
        with self._passed:
            target = self._started + 1
            self.wake()
            return self._passed.wait_for(lambda: self._idle_through >= target, timeout)

    def close(self, wait: float = 0.0) -> bool:
        """Stop, after uploading what is queued for up to ``wait`` seconds; True
        when the queue was empty at the end.  An upload in flight at the deadline
        gets ``JOIN_GRACE_SECONDS`` more; what is left goes at the next start."""
        if not self._periodic.started:
            return self.idle
        with self._passed:
            self._close_after = self._started + 1
            self._deadline = time.monotonic() + max(0.0, wait)
        if not self._periodic.stop(max(0.0, wait) + JOIN_GRACE_SECONDS):
            log.warning("sparkcache: an upload to %s was still running at shutdown; it is "
                        "retried at the next start", self.tier.url)
            return False
        if not self.idle:
            log.warning("sparkcache: snapshots were left to upload to %s at shutdown (after "
                        "%.0f s); they are uploaded at the next start", self.tier.url, wait)
        return self.idle

    def __enter__(self) -> Uploader:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
