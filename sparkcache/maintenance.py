"""Deleting, evicting and checking: the store's housekeeping.

Deletions follow one rule (STYLE habit 6): rows go in one write transaction,
and the files those rows named are deleted only after it commits.  A crash in
between leaves orphan files, never an index row naming a missing file.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparkcache.backends import is_temp_key
from sparkcache.backends.keys import temp_key_pid
from sparkcache.errors import LeaseError, NotFound
from sparkcache.holders import holder_alive, pid_alive
from sparkcache.identity import ModelIdentity
from sparkcache.index import queries as q

if TYPE_CHECKING:
    from sparkcache.store import SnapshotStore

__all__ = [
    "CheckReport", "check", "clear_model", "delete_model", "delete_snapshots", "evict_lru",
    "remove_deleted_models",
]

#: A pending snapshot with no live publisher is abandoned after this long.
PENDING_GRACE_SECONDS = 600.0
#: Eviction candidates read per query.
_EVICT_BATCH = 64


def _lease_blocks(holder: str) -> bool:
    """An unexpired lease blocks unless its holder is a dead process on this host."""
    return holder_alive(holder) is not False


def _delete_rows(conn: Any, store: SnapshotStore, snapshot_id: int, reason: str) -> list[str]:
    """Delete one snapshot's rows (cascading to segments, boundaries, leases)."""
    row = conn.execute(q.SNAPSHOT_BY_ID, (snapshot_id,)).fetchone()
    if row is None:
        return []
    keys = [k for (k,) in conn.execute(q.SEGMENT_KEYS, (snapshot_id,))]
    conn.execute(q.DELETE_SNAPSHOT, (snapshot_id,))
    conn.execute(q.BUMP_COUNTER, (row[1], f"evictions.{reason}", 1))
    return keys


def _delete_files_after_commit(store: SnapshotStore, keys: Iterable[str]) -> None:
    for key in keys:
        store.db.on_commit(functools.partial(store._delete_object, key))


def delete_snapshots(
    store: SnapshotStore, snapshot_ids: Iterable[int], *, force: bool = False,
    reason: str = "deleted",
) -> list[int]:
    """Delete snapshots with their descendants, deepest first.  See SnapshotStore.delete."""
    now = store._clock()
    deleted: list[int] = []
    with store._write() as conn:
        for snapshot_id in snapshot_ids:
            subtree = [i for (i,) in conn.execute(q.SUBTREE, (snapshot_id,)).fetchall()]
            if not subtree:
                raise NotFound(f"no snapshot {snapshot_id}")
            if not force:
                for sub in subtree:
                    for (holder,) in conn.execute(q.LIVE_LEASES_OF, (sub, now)).fetchall():
                        if _lease_blocks(holder):
                            raise LeaseError(
                                f"snapshot {sub} is leased by {holder}; wait for the lease to "
                                "expire or pass force=True"
                            )
            for sub in subtree:
                _delete_files_after_commit(store, _delete_rows(conn, store, sub, reason))
                deleted.append(sub)
    return deleted


def evict_lru(
    store: SnapshotStore, *, model: ModelIdentity | None = None, model_id: int | None = None,
    count: int | None = None, free_bytes: int | None = None, older_than: float | None = None,
    keep: Iterable[int] = (), reason: str = "lru",
) -> list[int]:
    """Delete snapshots, quarantined ones first, then least recently used, until
    ``count`` went or ``free_bytes`` were freed (whichever comes first; with
    neither, every candidate goes).  ``older_than`` keeps snapshots used since;
    ``keep`` protects ids (e.g. the snapshot being published).

    Only leaves go (a parent still needed by a child waits until the child has
    gone, which may happen in this same call), never pinned or leased ones.
    Candidates come in ``last_used`` order through an index, a batch at a time,
    so the cost follows what is deleted, not the size of the store.  One write
    transaction; the files go after it commits.  Each eviction is counted as
    ``evictions.<reason>``.
    """
    if count is not None and count <= 0:
        return []
    now = store._clock()
    evicted: list[int] = []
    freed = 0
    skipped = [int(i) for i in keep]

    def done() -> bool:
        return ((count is not None and len(evicted) >= count)
                or (free_bytes is not None and freed >= free_bytes))

    with store._write() as conn:
        filters: list[str] = []
        params: list[float] = []
        if model is not None:
            model_id = store._model_id(conn, model)
            if model_id is None:
                return []
        if model_id is not None:
            filters.append(q.EVICT_FILTER_MODEL)
            params.append(model_id)
        if older_than is not None:
            filters.append(q.EVICT_FILTER_OLDER)
            params.append(older_than)
        sql = q.EVICTABLE.format(filters=" ".join(filters))
        for state in ("quarantined", "ready"):
            while not done():
                batch = conn.execute(
                    sql, (state, *params, json.dumps(skipped), _EVICT_BATCH)
                ).fetchall()
                progressed = False
                for sid, nbytes in batch:
                    if _leased_by_live(conn, sid, now):
                        skipped.append(sid)
                        continue
                    _delete_files_after_commit(store, _delete_rows(conn, store, sid, reason))
                    evicted.append(sid)
                    freed += nbytes
                    progressed = True
                    if done():
                        break
                # A short batch means no candidate was left, unless deleting
                # children just turned their parents into leaves: query again.
                if not batch or (len(batch) < _EVICT_BATCH and not progressed):
                    break
    return evicted


def _leased_by_live(conn: Any, snapshot_id: int, now: float) -> bool:
    return any(
        _lease_blocks(h) for (h,) in conn.execute(q.LIVE_LEASES_OF, (snapshot_id, now)).fetchall()
    )


@dataclass
class CheckReport:
    """What ``check`` found (and, with ``fix``, repaired)."""

    expired_leases: list[int] = field(default_factory=list)
    dead_publishes: list[tuple[int, int]] = field(default_factory=list)  # (snapshot, rank)
    stuck_pending: list[int] = field(default_factory=list)
    missing_files: list[int] = field(default_factory=list)  # snapshots quarantined
    orphan_files: list[str] = field(default_factory=list)
    fixed: bool = False

    @property
    def clean(self) -> bool:
        return not (self.expired_leases or self.dead_publishes or self.stuck_pending
                    or self.missing_files or self.orphan_files)


def check(store: SnapshotStore, *, fix: bool = False) -> CheckReport:
    """Compare the index with the files and with the living processes.

    Finds expired or orphaned leases, publishes whose process died, snapshots
    stuck mid-publish, ready segments whose file is missing (their snapshot is
    quarantined) and files no row names (temp files of dead writers included).
    With ``fix`` every finding is repaired; without it nothing changes.
    """
    report = CheckReport(fixed=fix)
    # Files are listed *before* the rows are read: a publisher inserts its row
    # before it creates its file, so a live publish is never taken for an orphan.
    files = list(store.backend.list("objects"))
    now = store._clock()
    doomed: list[str] = []
    with store._write() as conn:
        for lease_id, _sid, holder, _kind, expires in conn.execute(q.ALL_LEASES).fetchall():
            if expires <= now or not _lease_blocks(holder):
                report.expired_leases.append(lease_id)
                if fix:
                    conn.execute(q.DELETE_LEASE, (lease_id,))
        live_publishers = {
            (sid, kind) for _id, sid, holder, kind, expires in conn.execute(q.ALL_LEASES)
            if expires > now and _lease_blocks(holder)
        }
        for sid, rank, key in conn.execute(q.WRITING_SEGMENTS).fetchall():
            if (sid, f"publish.r{rank}") not in live_publishers:
                report.dead_publishes.append((sid, rank))
                if fix:
                    conn.execute(q.DELETE_SEGMENT, (sid, rank))
                    doomed.append(key)
        busy = {sid for sid, kind in live_publishers if kind.startswith("publish.")}
        for sid, created in conn.execute(q.PENDING_SNAPSHOTS).fetchall():
            if sid in busy:
                continue
            remaining = conn.execute(q.COUNT_SEGMENTS, (sid,)).fetchone()[0]
            if not fix:  # with fix, the dead segments' rows are already gone
                remaining -= sum(1 for s, _r in report.dead_publishes if s == sid)
            if remaining == 0 or now - created > PENDING_GRACE_SECONDS:
                report.stuck_pending.append(sid)
                if fix:
                    doomed.extend(_delete_rows(conn, store, sid, "abandoned"))
        referenced = {k for (k,) in conn.execute(q.ALL_SEGMENT_KEYS)}
        for sid, _rank, key, _nbytes in conn.execute(q.READY_SEGMENTS).fetchall():
            if not store.backend.exists(key) and sid not in report.missing_files:
                report.missing_files.append(sid)
        if fix:
            _delete_files_after_commit(store, doomed)
    if fix:
        for sid in report.missing_files:
            store.quarantine(sid, "missing")
    for key in files:
        if is_temp_key(key):
            base = key.rsplit(".tmp.", 1)[0]
            pid = temp_key_pid(key)
            if base in referenced and pid is not None and pid_alive(pid):
                continue  # a live writer's temp file
        elif key in referenced:
            continue
        report.orphan_files.append(key)
    if fix:
        for key in report.orphan_files:
            store._delete_object(key)
    return report


def _remove_folder(store: SnapshotStore, folder: str) -> None:
    """Delete every object under ``folder``, then its empty local directories."""
    from sparkcache.backends import LocalBackend

    for key in list(store.backend.list(folder)):
        store._delete_object(key)
    if isinstance(store.backend, LocalBackend):
        top = os.path.join(store.backend.root, *folder.split("/"))
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


def delete_model(store: SnapshotStore, model_id: int) -> bool:
    """Delete a model: its snapshots, its row and its folder.

    Marks the model deleted first, so lookups stop at once.  Leased snapshots
    stay until their lease ends; then the sweeper finishes the job.  Returns
    True when the model is completely gone.
    """
    now = store._clock()
    with store._write() as conn:
        row = conn.execute(q.MODEL_BY_ID, (model_id,)).fetchone()
        if row is None:
            raise NotFound(f"no model {model_id}")
        conn.execute(q.MARK_MODEL_DELETED, (now, model_id))
    return _finish_model_deletion(store, model_id)


def clear_model(
    store: SnapshotStore, model_id: int, *, keep_pinned: bool = False, reason: str = "cleared",
) -> tuple[list[int], list[int], list[int]]:
    """Delete every snapshot of a model in one transaction, deepest first.

    Leased snapshots stay with their ancestors (they cannot be read without
    them), and pinned ones too with ``keep_pinned``.  Files go after the commit.
    Returns (deleted, kept because leased, kept because pinned).
    """
    now = store._clock()
    deleted: list[int] = []
    with store._write() as conn:
        ids = [i for (i,) in conn.execute(q.MODEL_SNAPSHOTS_DEEPEST_FIRST, (model_id,))]

        def with_ancestors(chosen: set[int]) -> set[int]:
            return {i for sid in chosen for i, *_ in conn.execute(q.CHAIN, (sid,))}

        leased = with_ancestors({i for i in ids if _leased_by_live(conn, i, now)})
        pinned = with_ancestors({i for i in ids if keep_pinned and conn.execute(
            q.SNAPSHOT_BY_ID, (i,)).fetchone()[11]}) - leased
        for sid in ids:
            if sid not in leased | pinned:
                _delete_files_after_commit(store, _delete_rows(conn, store, sid, reason))
                deleted.append(sid)
    return sorted(deleted), sorted(leased), sorted(pinned)


def _finish_model_deletion(store: SnapshotStore, model_id: int) -> bool:
    with store._read() as conn:
        row = conn.execute(q.MODEL_BY_ID, (model_id,)).fetchone()
    if row is None:
        return True
    _deleted, leased, _pinned = clear_model(store, model_id, reason="model_deleted")
    if leased:
        return False
    with store._write() as conn:
        if conn.execute(q.COUNT_MODEL_SNAPSHOTS, (model_id,)).fetchone()[0]:
            return False  # published again meanwhile: the model is back in use
        conn.execute(q.DELETE_MODEL, (model_id,))
    _remove_folder(store, row[2])
    return True


def remove_deleted_models(store: SnapshotStore) -> tuple[list[str], list[str]]:
    """The sweeper's first step: finish deleting models marked deleted, and remove
    model folders that no model row names (left by a lost or replaced index).

    Returns (names of models removed, folders removed)."""
    from sparkcache.backends import LocalBackend

    models: list[str] = []
    folders: list[str] = []
    with store._read() as conn:
        marked = conn.execute(q.DELETED_MODELS).fetchall()
        known = {f for (f,) in conn.execute(q.MODEL_FOLDERS).fetchall()}
    for model_id, name, folder in marked:
        if _finish_model_deletion(store, model_id):
            models.append(name)
            folders.append(folder)
    if isinstance(store.backend, LocalBackend):
        objects = os.path.join(store.backend.root, "objects")
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(objects):
                folder = f"objects/{entry.name}"
                if (entry.is_dir(follow_symlinks=False) and entry.name.startswith("m-")
                        and folder not in known):
                    _remove_folder(store, folder)
                    folders.append(folder)
    return models, folders
