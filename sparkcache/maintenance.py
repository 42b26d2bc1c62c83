"""The store's housekeeping: quarantine, delete, evict, check, remove models.

Every function takes the narrow :class:`~sparkcache.core.Core`.  Deletions
follow one rule (STYLE habit 6): rows go in one write transaction, and the
files those rows named are deleted only after it commits.  A crash in between
leaves orphan files, never an index row naming a missing file.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sparkcache.backends.keys import temp_key_writer
from sparkcache.core import (
    OBJECTS,
    Conn,
    Core,
    LeaseInfo,
    ModelInfo,
    SegmentInfo,
    SnapshotInfo,
    ids,
    scalar,
    select_all,
)
from sparkcache.errors import InvalidArgument, LeaseError, NotFound, StorageMismatch, UnsafeName
from sparkcache.holders import process_alive
from sparkcache.identity import ModelIdentity
from sparkcache.index import queries as q

__all__ = [
    "CheckReport",
    "budget_group",
    "check",
    "check_storage",
    "clear_model",
    "delete_model",
    "delete_snapshots",
    "drop_snapshot",
    "evict_lru",
    "insert_boundaries",
    "live_identities",
    "publish_abandoned",
    "quarantine",
    "reclaim_publishes",
    "remove_deleted_models",
]

#: A pending snapshot with no live publisher is abandoned after this long.
PENDING_GRACE_SECONDS = 600.0
#: Eviction candidates read per query.
EVICT_BATCH = 64


class _Candidate(NamedTuple):
    """A row of ``queries.EVICTABLE``."""

    id: int
    nbytes: int


def quarantine(core: Core, snapshot_id: int, reason: str) -> None:
    """Never offer this snapshot (nor its descendants) again; count the reason."""
    with core.write() as conn:
        info = core.snapshot(conn, snapshot_id)
        if info is None:
            return
        for sub_id in ids(conn, q.SUBTREE, (snapshot_id,)):
            why = reason if sub_id == snapshot_id else "parent"
            conn.execute(q.QUARANTINE, (why, sub_id))
            conn.execute(q.DELETE_LOOKUP_BOUNDARIES, (sub_id,))
        conn.execute(q.BUMP_COUNTER, (info.model_id, f"quarantined.{reason}", 1))


def insert_boundaries(conn: Conn, snapshot_id: int, model_id: int, hashes: Sequence[bytes],
                      block_size: int, alias_stride: int, marks: Iterable[int] = ()) -> None:
    """A ready snapshot's boundary rows: its end, every ``alias_stride`` tokens
    (rounded down to whole blocks), and its breakpoints ``marks`` (token counts
    on block boundaries).  ``hashes`` are the prefix hashes of its whole prompt."""
    n_blocks = len(hashes)
    stride = max(1, alias_stride // block_size)
    rows: dict[int, str] = {i: "stride" for i in range(stride - 1, n_blocks, stride)}
    for mark in marks:
        rows.setdefault(mark // block_size - 1, "breakpoint")
    rows[n_blocks - 1] = "end"
    conn.executemany(
        q.INSERT_BOUNDARY,
        [(hashes[i], snapshot_id, model_id, (i + 1) * block_size, kind)
         for i, kind in rows.items()],
    )


def drop_snapshot(core: Core, conn: Conn, snapshot_id: int, reason: str) -> None:
    """Delete one snapshot's rows inside a write (cascading to segments,
    boundaries, leases), counting ``evictions.<reason>``; its files go after
    the commit.  For a caller that decided it must go (its children first)."""
    info = core.snapshot(conn, snapshot_id)
    if info is None:
        return
    keys = [segment.object_key for segment in core.segments(conn, snapshot_id)]
    conn.execute(q.DELETE_SNAPSHOT, (snapshot_id,))
    conn.execute(q.BUMP_COUNTER, (info.model_id, f"evictions.{reason}", 1))
    core.delete_after_commit(keys)


def delete_snapshots(
    core: Core, snapshot_ids: Iterable[int], *, force: bool = False, reason: str = "deleted",
) -> list[int]:
    """Delete snapshots with their descendants (they cannot be restored without
    them), deepest first, in one transaction; files go after the commit.

    Refuses (LeaseError) while any of them holds a lease that still protects
    it, unless ``force``.  Returns the deleted ids.
    """
    chosen = list(snapshot_ids)
    return core.freeing(lambda: _delete(core, chosen, force, reason))


def _delete(core: Core, snapshot_ids: list[int], force: bool, reason: str) -> list[int]:
    now = core.clock()
    deleted: list[int] = []
    with core.write() as conn:
        for snapshot_id in snapshot_ids:
            subtree = ids(conn, q.SUBTREE, (snapshot_id,))
            if not subtree:
                raise NotFound(f"no snapshot {snapshot_id}")
            if not force:
                for sub in subtree:
                    for holder in core.leased(conn, sub, now, explicit=True):
                        raise LeaseError(
                            f"snapshot {sub} is leased by {holder}; wait for the lease to "
                            "expire or pass force=True"
                        )
            for sub in subtree:
                drop_snapshot(core, conn, sub, reason)
                deleted.append(sub)
    return deleted


def evict_lru(
    core: Core, *, model: ModelIdentity | None = None, model_id: int | None = None,
    count: int | None = None, free_bytes: int | None = None, older_than: float | None = None,
    keep: Iterable[int] = (), reason: str = "lru", model_ids: Sequence[int] | None = None,
    tenant: str | None = None,
) -> list[int]:
    """Delete snapshots, quarantined ones first, then least recently used, until
    ``count`` went or ``free_bytes`` were freed (whichever comes first; with
    neither, every candidate goes).  ``older_than`` keeps snapshots used since;
    ``keep`` protects ids (e.g. the snapshot being published); ``model_ids``
    takes candidates from those models together (a :func:`budget_group`);
    ``tenant`` only that tenant's snapshots.

    Only leaves go (a parent still needed by a child waits until the child has
    gone, which may happen in this same call), never pinned or leased ones.
    Candidates come in ``last_used`` order through an index, a batch at a time,
    so the cost follows what is deleted, not the size of the store.  One write
    transaction; the files go after it commits.  Each eviction is counted as
    ``evictions.<reason>``.
    """
    if count is not None and count <= 0:
        return []
    filters: list[tuple[str, Any]] = []
    if model_ids is not None:
        filters.append((q.EVICT_FILTER_MODELS, json.dumps([int(i) for i in model_ids])))
    if older_than is not None:
        filters.append((q.EVICT_FILTER_OLDER, older_than))
    if tenant is not None:
        filters.append((q.EVICT_FILTER_TENANT, tenant))
    return core.freeing(lambda: _evict(core, model, model_id, count, free_bytes, filters,
                                       keep, reason))


def live_identities(conn: Conn) -> list[tuple[int, ModelIdentity]]:
    """Every live model row's id and identity, oldest first; a row this version
    cannot read is left out (it keeps to itself)."""
    out: list[tuple[int, ModelIdentity]] = []
    for row in select_all(conn, q.LIVE_MODELS, into=ModelInfo):
        with contextlib.suppress(InvalidArgument):
            out.append((row.id, row.identity()))
    return out


def budget_group(core: Core, conn: Conn, model_id: int) -> list[int]:
    """The live models whose snapshots Spark's per-model limits count together
    with ``model_id``'s: its rows of every sharding of the same KV
    (:meth:`ModelIdentity.budget_digest`), ``model_id`` first."""
    own = core.model(conn, model_id)
    if own is None:
        return [model_id]
    key = own.identity().budget_digest()
    return [model_id] + [i for i, other in live_identities(conn)
                         if i != model_id and other.budget_digest() == key]


def _evict(core: Core, model: ModelIdentity | None, model_id: int | None, count: int | None,
           free_bytes: int | None, extra: list[tuple[str, Any]], keep: Iterable[int],
           reason: str) -> list[int]:
    now = core.clock()
    evicted: list[int] = []
    freed = 0
    skipped = [int(i) for i in keep]

    def done() -> bool:
        return ((count is not None and len(evicted) >= count)
                or (free_bytes is not None and freed >= free_bytes))

    with core.write() as conn:
        if model is not None:
            model_id = core.model_id(conn, model)
            if model_id is None:
                return []
        if model_id is not None:
            extra = [(q.EVICT_FILTER_MODEL, model_id), *extra]
        filters = [sql for sql, _param in extra]
        params = [param for _sql, param in extra]
        sql = q.EVICTABLE.format(filters=" ".join(filters))
        for state in ("quarantined", "ready"):
            while not done():
                batch = select_all(conn, sql, (state, *params, json.dumps(skipped), EVICT_BATCH),
                              into=_Candidate)
                progressed = False
                for sid, nbytes in batch:
                    if core.leased(conn, sid, now):
                        skipped.append(sid)
                        continue
                    drop_snapshot(core, conn, sid, reason)
                    evicted.append(sid)
                    freed += nbytes
                    progressed = True
                    if done():
                        break
                # A short batch means no candidate was left, unless deleting
                # children just turned their parents into leaves: query again.
                if not batch or (len(batch) < EVICT_BATCH and not progressed):
                    break
    return evicted


# -- check ---------------------------------------------------------------------------


@dataclass
class CheckReport:
    """What ``check`` found (and, with ``fix``, repaired)."""

    expired_leases: list[int] = field(default_factory=list)
    dead_publishes: list[tuple[int, int]] = field(default_factory=list)  # (snapshot, rank)
    stuck_pending: list[int] = field(default_factory=list)
    missing_files: list[int] = field(default_factory=list)  # snapshots quarantined
    bad_keys: list[int] = field(default_factory=list)  # object keys escaping the root
    orphan_snapshots: list[int] = field(default_factory=list)  # their parent row is gone
    orphan_files: list[str] = field(default_factory=list)
    fixed: bool = False

    @property
    def clean(self) -> bool:
        """Nothing to repair.  Leases that protect nothing any more (expired, or
        their holder dead: a SIGKILLed uploader's) block nothing, so they are
        listed, and removed with ``fix``, but do not make a store unclean."""
        return not (self.dead_publishes or self.stuck_pending
                    or self.missing_files or self.bad_keys or self.orphan_snapshots
                    or self.orphan_files)


def publish_abandoned(core: Core, conn: Conn, info: SnapshotInfo, now: float) -> bool:
    """Whether a ``pending`` snapshot's publish was abandoned: no live process
    holds a publish lease on it, and it is older than PENDING_GRACE_SECONDS (a
    rank that never published its segment will not any more)."""
    return (info.state == "pending" and now - info.created_at > PENDING_GRACE_SECONDS
            and not any(kind.startswith("publish.") for kind in
                        {lease.kind for lease in core.leases(conn, info.id)
                         if lease.blocks(now)}))


def _reclaim(core: Core, conn: Conn, now: float, report: CheckReport, *, fix: bool) -> None:
    """Leases that no longer protect anything, publishes whose process died and
    snapshots stuck ``pending`` (no live publisher, and no segment left or older
    than the grace period): found, and with ``fix`` removed with their files."""
    live_publishers: set[tuple[int, str]] = set()
    for lease in select_all(conn, q.ALL_LEASES, into=LeaseInfo):
        if lease.blocks(now):
            live_publishers.add((lease.snapshot_id, lease.kind))
            continue
        report.expired_leases.append(lease.id)
        if fix:
            conn.execute(q.DELETE_LEASE, (lease.id,))
    for segment in select_all(conn, q.WRITING_SEGMENTS, into=SegmentInfo):
        sid, rank = segment.snapshot_id, segment.rank
        if (sid, f"publish.r{rank}") not in live_publishers:
            report.dead_publishes.append((sid, rank))
            if fix:
                conn.execute(q.DELETE_SEGMENT, (sid, rank))
                core.delete_after_commit([segment.object_key])
    busy = {sid for sid, kind in live_publishers if kind.startswith("publish.")}
    for info in select_all(conn, q.PENDING_SNAPSHOTS, into=SnapshotInfo):
        if info.id in busy:
            continue
        remaining = scalar(conn, q.COUNT_SEGMENTS, (info.id,))
        if not fix:  # with fix, the dead segments' rows are already gone
            remaining -= sum(1 for s, _r in report.dead_publishes if s == info.id)
        if remaining == 0 or now - info.created_at > PENDING_GRACE_SECONDS:
            report.stuck_pending.append(info.id)
            if fix:
                drop_snapshot(core, conn, info.id, "abandoned")


def reclaim_publishes(core: Core) -> CheckReport:
    """The sweeper's step for stuck publishes: drop dead leases, the segments of
    publishes whose process died and abandoned ``pending`` snapshots (a
    copy-on-write child of one rank that the other ranks never finished), with
    their files.  A parent such a child held becomes evictable again."""
    report = CheckReport(fixed=True)
    with core.write() as conn:
        _reclaim(core, conn, core.clock(), report, fix=True)
    return report


#: How many of the expected payload objects check() and verify() look for first.
STORAGE_SAMPLE = 32


def check_storage(core: Core) -> None:
    """Refuse to go on when none of a sample of the payload objects the index
    expects is in the backend: the storage is wrong (a mistyped ``--storage``, a
    disk not mounted), and quarantining every snapshot would lose them all."""
    with core.read() as conn:
        sample = [str(k) for (k,) in conn.execute(q.SAMPLE_READY_KEYS, (STORAGE_SAMPLE,))]
    if not sample:
        return
    for key in sample:
        with contextlib.suppress(UnsafeName):
            if core.backend.exists(key):
                return
    raise StorageMismatch(
        f"none of {len(sample)} payload objects the index expects is in {core.backend.url}: "
        "the storage looks wrong (a mistyped --storage, a disk not mounted?), so nothing "
        "was checked or changed. Open the store with the storage it was created with; if "
        "the files really are gone, `sparkcache clear` the model"
    )


def check(core: Core, *, fix: bool = False) -> CheckReport:
    """Compare the index with the files and with the living processes.

    Finds expired or orphaned leases, publishes whose process died, snapshots
    stuck mid-publish, ready segments whose file is missing or whose object key
    is not a valid key inside the root (their snapshot is quarantined), snapshots
    whose parent row is gone (deleted with their files) and files no row names
    (temp files of dead writers included).  With ``fix`` every finding is
    repaired; without it nothing changes.
    """
    check_storage(core)
    report = CheckReport(fixed=fix)
    # Files are listed *before* the rows are read: a publisher inserts its row
    # before it creates its file, so a live publish is never taken for an orphan.
    files = list(core.backend.list(OBJECTS))
    now = core.clock()
    with core.write() as conn:
        _reclaim(core, conn, now, report, fix=fix)
        for sid in ids(conn, q.ORPHAN_SNAPSHOTS):
            report.orphan_snapshots.append(sid)
            if fix:
                for sub in ids(conn, q.SUBTREE, (sid,)):
                    drop_snapshot(core, conn, sub, "orphan")
        referenced = {str(k) for (k,) in conn.execute(q.ALL_SEGMENT_KEYS)}
        _check_segments(core, conn, report)
    if fix:
        for sid in report.missing_files:
            quarantine(core, sid, "missing")
        for sid in report.bad_keys:
            quarantine(core, sid, "key")
    report.orphan_files.extend(key for key in files if _orphan(key, referenced))
    if fix:
        for key in report.orphan_files:
            core.delete_object(key)
    return report


def _check_segments(core: Core, conn: Conn, report: CheckReport) -> None:
    """Note every ready segment whose file is missing, or whose key is unsafe."""
    for segment in select_all(conn, q.READY_SEGMENTS, into=SegmentInfo):
        sid = segment.snapshot_id
        if sid in report.missing_files or sid in report.bad_keys:
            continue
        try:
            if not core.backend.exists(segment.object_key):
                report.missing_files.append(sid)
        except UnsafeName:  # a tampered row: never follow it, never delete by it
            report.bad_keys.append(sid)


def _orphan(key: str, referenced: set[str]) -> bool:
    """Whether no row names file ``key`` (a live writer's temp file is named)."""
    writer = temp_key_writer(key)
    if writer is not None:
        base = key.rsplit(".tmp.", 1)[0]
        return not (base in referenced and process_alive(*writer))
    return key not in referenced


# -- models --------------------------------------------------------------------------


def delete_model(core: Core, model_id: int) -> bool:
    """Delete a model: its snapshots, its row and its folder.

    Marks the model deleted first, so lookups stop at once.  Leased snapshots
    stay until their lease ends; then the sweeper finishes the job.  Returns
    True when the model is completely gone.
    """
    with core.write() as conn:
        if core.model(conn, model_id) is None:
            raise NotFound(f"no model {model_id}")
        conn.execute(q.MARK_MODEL_DELETED, (core.clock(), model_id))
    return _finish_model_deletion(core, model_id)


def clear_model(
    core: Core, model_id: int, *, keep_pinned: bool = False, reason: str = "cleared",
    tenant: str | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """Delete every snapshot of a model (``tenant``: only that tenant's, whose
    chains are its own) in one transaction, deepest first.

    Leased snapshots stay with their ancestors (they cannot be read without
    them), and pinned ones too with ``keep_pinned``; a keep lease (an API
    breakpoint's ttl) does not stop an explicit clear.  Files go after the commit.
    Returns (deleted, kept because leased, kept because pinned).
    """
    return core.freeing(lambda: _clear(core, model_id, keep_pinned, reason, tenant))


def _clear(core: Core, model_id: int, keep_pinned: bool, reason: str,
           tenant: str | None) -> tuple[list[int], list[int], list[int]]:
    now = core.clock()
    deleted: list[int] = []
    with core.write() as conn:
        deepest_first = (ids(conn, q.MODEL_SNAPSHOTS_DEEPEST_FIRST, (model_id,)) if tenant is None
                         else ids(conn, q.TENANT_SNAPSHOTS_DEEPEST_FIRST, (model_id, tenant)))

        def with_ancestors(chosen: set[int]) -> set[int]:
            return {link.id for sid in chosen for link in core.chain(conn, sid)}

        leased = with_ancestors({i for i in deepest_first
                                 if core.leased(conn, i, now, explicit=True)})
        pinned = with_ancestors({i for i in deepest_first if keep_pinned and (
            (info := core.snapshot(conn, i)) is not None and info.pinned)}) - leased
        for sid in deepest_first:
            if sid not in leased | pinned:
                drop_snapshot(core, conn, sid, reason)
                deleted.append(sid)
    return sorted(deleted), sorted(leased), sorted(pinned)


def _finish_model_deletion(core: Core, model_id: int) -> bool:
    with core.read() as conn:
        model = core.model(conn, model_id)
    if model is None:
        return True
    _deleted, leased, _pinned = clear_model(core, model_id, reason="model_deleted")
    if leased:
        return False
    with core.write() as conn:
        if scalar(conn, q.COUNT_MODEL_SNAPSHOTS, (model_id,)):
            return False  # published again meanwhile: the model is back in use
        conn.execute(q.DELETE_MODEL, (model_id,))
    core.backend.remove_tree(model.folder)
    return True


def remove_deleted_models(core: Core) -> tuple[list[str], list[str]]:
    """The sweeper's first step: finish deleting models marked deleted, and remove
    model folders that no model row names (left by a lost or replaced index).

    Returns (names of models removed, folders removed)."""
    models: list[str] = []
    folders: list[str] = []
    with core.read() as conn:
        marked = select_all(conn, q.DELETED_MODELS, into=ModelInfo)
        known = {str(f) for (f,) in conn.execute(q.MODEL_FOLDERS)}
    for model in marked:
        if _finish_model_deletion(core, model.id):
            models.append(model.name)
            folders.append(model.folder)
    for folder in core.backend.folders(OBJECTS):
        if folder.startswith(f"{OBJECTS}/m-") and folder not in known:
            core.backend.remove_tree(folder)
            folders.append(folder)
    return models, folders
