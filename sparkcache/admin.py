"""The admin API: what the ``sparkcache`` command does, as Python functions.

Every function takes an open :class:`~sparkcache.store.SnapshotStore` (plus the
settings it needs) and returns plain dataclasses; :func:`to_dict` turns any of
them into JSON-serialisable dicts (bytes and unix seconds, never formatted
text).  This module decides *what* happens; :mod:`sparkcache.cli` only parses
arguments and prints, and imports nothing of the store but this module, which
re-exports the result types it prints.  Listing and naming models live in
:mod:`sparkcache.catalog`, the rules of deletion, eviction, checking and
verification in :mod:`sparkcache.maintenance` and :mod:`sparkcache.retention`,
export and import in :mod:`sparkcache.transfer`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

import apsw

from sparkcache import catalog, maintenance, transfer
from sparkcache.catalog import ModelRow, SnapshotDetail, SnapshotRow, mb
from sparkcache.core import INDEX_FILE, SnapshotInfo, fetch
from sparkcache.errors import NotFound
from sparkcache.folder import resolve_folder
from sparkcache.index import migrate
from sparkcache.index import queries as q
from sparkcache.maintenance import CheckReport, Problem, Progress, VerifyReport
from sparkcache.retention import Retention, RetentionSettings, SweepReport
from sparkcache.store import SnapshotStore
from sparkcache.transfer import ExportReport, ImportReport
from sparkcache.version import VERSION

__all__ = [
    "VERSION",
    "CheckReport",
    "ClearReport",
    "DbRevision",
    "DeleteModelReport",
    "ExportReport",
    "ImportReport",
    "ModelRow",
    "Problem",
    "Progress",
    "SnapshotDetail",
    "SnapshotRow",
    "SnapshotStore",
    "Stats",
    "SweepReport",
    "VerifyReport",
    "check",
    "clear_model",
    "db_current",
    "db_upgrade",
    "delete_model",
    "export_model",
    "import_model",
    "list_models",
    "list_snapshots",
    "mb",
    "open_store",
    "pin",
    "resolve_folder",
    "resolve_model",
    "retention_settings",
    "show",
    "stats",
    "sweep",
    "to_dict",
    "unpin",
    "verify",
]


# -- results -----------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    model: str | None  # None: every model
    hits: int
    misses: int
    hit_rate: float | None
    publishes: int
    skipped: int
    written_tokens: int
    written_bytes: int
    restored_tokens: int
    restored_bytes: int
    evictions: dict[str, int]  # by reason
    quarantined_counts: dict[str, int]  # quarantines counted, by reason
    quarantined: list[SnapshotRow]  # snapshots quarantined now
    counters: dict[str, int]  # every counter, raw


@dataclass(frozen=True)
class ClearReport:
    model: str
    model_id: int
    deleted: list[int]
    kept_leased: list[int]  # leased, or an ancestor of a leased snapshot
    kept_pinned: list[int]  # only with keep_pinned


@dataclass(frozen=True)
class DeleteModelReport:
    model: str
    model_id: int
    complete: bool  # False: leased snapshots remain; the sweeper finishes later
    remaining: list[int]


@dataclass(frozen=True)
class DbRevision:
    path: str
    current: str | None
    head: str
    applied: list[str]

    @property
    def up_to_date(self) -> bool:
        return self.current == self.head


def to_dict(result: Any) -> Any:
    """A JSON-serialisable form of any result of this module (lists included)."""
    if isinstance(result, list):
        return [to_dict(r) for r in result]
    if isinstance(result, SweepReport):
        return {**asdict(result), "counts": result.counts(), "count": result.count}
    if is_dataclass(result) and not isinstance(result, type):
        out = asdict(result)
        for extra in ("clean", "up_to_date"):
            if hasattr(result, extra):
                out[extra] = getattr(result, extra)
        return out
    return result


# -- opening and naming ------------------------------------------------------------------


def open_store(folder: str | os.PathLike[str], *, storage: str | None = None,
               create: bool = False) -> SnapshotStore:
    """Open the store in ``folder``; refuse to create one unless ``create``.

    An admin command pointed at a mistyped folder should say so, not leave an
    empty store behind.
    """
    root = Path(folder).expanduser()
    if not create and not (root / INDEX_FILE).is_file():
        raise NotFound(
            f"no sparkcache store in {root} (no {INDEX_FILE}); pass --folder, or set "
            "SPARK_KV_CACHE_FOLDER (or SPARK_STORAGE) to the folder vLLM uses"
        )
    return SnapshotStore(root, storage=storage)


def list_models(store: SnapshotStore) -> list[ModelRow]:
    """Every model row, deleted ones included (:func:`sparkcache.catalog.list_models`)."""
    return catalog.list_models(store.core)


def resolve_model(store: SnapshotStore, model: str | int) -> ModelRow:
    """The one model named by ``model`` (:func:`sparkcache.catalog.resolve_model`)."""
    return catalog.resolve_model(store.core, model)


def list_snapshots(store: SnapshotStore, model: str | int | None = None) -> list[SnapshotRow]:
    """Every snapshot (of one model, when given), oldest id first."""
    return catalog.list_snapshots(store.core, model)


def show(store: SnapshotStore, snapshot_id: int) -> SnapshotDetail:
    """One snapshot with its segments, its chain (root first), children and leases."""
    return catalog.show(store.core, snapshot_id)


def stats(store: SnapshotStore, model: str | int | None = None) -> Stats:
    """Counters (all models, or one) plus the snapshots quarantined now."""
    models = {m.id: m.name for m in list_models(store)}
    model_id = None if model is None else resolve_model(store, model).id
    totals = store.core.counter_totals(model_id)
    with store.core.read() as conn:
        quarantined = [
            catalog.snapshot_row(info, models)
            for info in fetch(conn, q.ADMIN_QUARANTINED, into=SnapshotInfo)
            if model_id is None or info.model_id == model_id
        ]

    def by_prefix(prefix: str) -> dict[str, int]:
        return {k[len(prefix):]: v for k, v in sorted(totals.items()) if k.startswith(prefix)}

    hits, misses = totals.get("hits", 0), totals.get("misses", 0)
    return Stats(
        model=None if model_id is None else models[model_id],
        hits=hits, misses=misses,
        hit_rate=round(hits / (hits + misses), 4) if hits + misses else None,
        publishes=totals.get("publishes", 0), skipped=totals.get("skipped", 0),
        written_tokens=totals.get("written_tokens", 0),
        written_bytes=totals.get("written_bytes", 0),
        restored_tokens=totals.get("restored_tokens", 0),
        restored_bytes=totals.get("restored_bytes", 0),
        evictions=by_prefix("evictions."), quarantined_counts=by_prefix("quarantined."),
        quarantined=quarantined, counters=dict(sorted(totals.items())),
    )


# -- verification --------------------------------------------------------------------------


def verify(store: SnapshotStore, progress: Progress | None = None) -> VerifyReport:
    """Re-hash every written segment (:func:`sparkcache.maintenance.verify`)."""
    return maintenance.verify(store.core, progress)


def check(store: SnapshotStore, *, fix: bool = False) -> CheckReport:
    """Compare the index with the files and the living processes (see maintenance.check)."""
    return store.check(fix=fix)


# -- deleting and pinning -------------------------------------------------------------------


def clear_model(store: SnapshotStore, model: str | int, *,
                keep_pinned: bool = False) -> ClearReport:
    """Delete every snapshot of a model, in one transaction, deepest first.

    Leased snapshots stay, with their ancestors (they cannot be read without
    them), and are reported; so are pinned ones with ``keep_pinned``.  The model
    row and folder stay (use :func:`delete_model` to remove those too).  Files
    go after the commit.
    """
    row = resolve_model(store, model)
    deleted, leased, pinned = maintenance.clear_model(store.core, row.id,
                                                      keep_pinned=keep_pinned)
    return ClearReport(row.name, row.id, deleted, leased, pinned)


def delete_model(store: SnapshotStore, model: str | int) -> DeleteModelReport:
    """Delete a model: its snapshots, its row and its folder (maintenance.delete_model).

    Leased snapshots stay until their lease ends; the sweeper finishes the job.
    """
    row = resolve_model(store, model)
    complete = maintenance.delete_model(store.core, row.id)
    remaining = [] if complete else [s.id for s in list_snapshots(store, row.id)]
    return DeleteModelReport(row.name, row.id, complete, remaining)


def pin(store: SnapshotStore, snapshot_id: int, pinned: bool = True) -> SnapshotRow:
    """Never evict this snapshot (retention, the sweeper and ``evict`` skip it)."""
    try:
        store.pin(snapshot_id, pinned)
    except NotFound:
        raise catalog.no_snapshot(store.core, snapshot_id) from None
    return show(store, snapshot_id).snapshot


def unpin(store: SnapshotStore, snapshot_id: int) -> SnapshotRow:
    """Let a pinned snapshot be evicted again."""
    return pin(store, snapshot_id, False)


def retention_settings(folder: str | os.PathLike[str] | None = None,
                       **overrides: Any) -> RetentionSettings:
    """Spark's limits from ``SPARK_KV_CACHE_*``, with ``overrides`` winning."""
    return RetentionSettings.from_env(folder=resolve_folder(folder), **overrides)


def sweep(store: SnapshotStore, retention: Retention | RetentionSettings) -> SweepReport:
    """One retention pass: deleted models' folders, age, disk margin, total."""
    if isinstance(retention, RetentionSettings):
        retention = Retention(retention)
    return store.sweep(retention)


# -- export and import (sparkcache.transfer) --------------------------------------------


def export_model(store: SnapshotStore, model: str | int, dest: str,
                 progress: Progress | None = None) -> ExportReport:
    """Copy a model's ready snapshots, verified, into ``dest``: see :mod:`sparkcache.transfer`."""
    return transfer.export_model(store, model, dest, progress)


def import_model(store: SnapshotStore, src: str,
                 progress: Progress | None = None) -> ImportReport:
    """Verify and re-publish an export: see :mod:`sparkcache.transfer`."""
    return transfer.import_model(store, src, progress)


# -- the index's schema ---------------------------------------------------------------------


def _index_path(root: str | os.PathLike[str]) -> Path:
    path = Path(root).expanduser() / INDEX_FILE
    if not path.is_file():
        raise NotFound(f"no sparkcache index at {path}; pass the store's folder (--folder)")
    return path


def db_current(root: str | os.PathLike[str]) -> DbRevision:
    """The index's schema revision and the newest this sparkcache knows (read-only)."""
    path = _index_path(root)
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        current = migrate.current_revision(conn)
    finally:
        conn.close()
    return DbRevision(str(path), current, migrate.head_revision(), [])


def db_upgrade(root: str | os.PathLike[str], *, busy_timeout_ms: int = 10_000) -> DbRevision:
    """Upgrade the index to the newest revision (a no-op at head).

    Raises SchemaMismatch for an index written by a newer sparkcache (left untouched).
    """
    path = _index_path(root)
    conn = apsw.Connection(str(path))
    try:
        conn.set_busy_timeout(busy_timeout_ms)
        applied = migrate.upgrade(conn, "head")
        current = migrate.current_revision(conn)
    finally:
        conn.close()
    return DbRevision(str(path), current, migrate.head_revision(), applied)
