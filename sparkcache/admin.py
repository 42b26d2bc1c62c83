"""The admin API: what the ``sparkcache`` command does, as Python functions.

Every function takes an open :class:`~sparkcache.store.SnapshotStore` (plus the
settings it needs) and returns plain dataclasses; :func:`to_dict` turns any of
them into JSON-serialisable dicts (bytes and unix seconds, never formatted
text).  This module decides *what* happens; :mod:`sparkcache.cli` only parses
arguments and prints.  The rules of deletion, eviction and checking stay in
:mod:`sparkcache.maintenance` and :mod:`sparkcache.retention`.

Models are named by their name, their id or a prefix (4+ hex characters) of
their digest, or else by a unique part of their name (:func:`resolve_model`);
a name shared by several identities is ambiguous and the error lists the
candidates.

Export writes a folder (any :func:`~sparkcache.backends.open_backend` URL) with
one file per segment and a ``manifest.json`` written last; import verifies
every file against the manifest and republishes it through
:meth:`SnapshotStore.publish`, so an imported snapshot is exactly as trusted
as one published locally.  Nothing is ever unpickled: the manifest is JSON and
strictly validated, the segments are raw bytes with verified digests.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import apsw

from sparkcache import maintenance
from sparkcache import segment as seg
from sparkcache.backends import Backend, Blob
from sparkcache.errors import CorruptSnapshot, InvalidArgument, NotFound
from sparkcache.identity import ModelIdentity
from sparkcache.index import migrate
from sparkcache.index import queries as q
from sparkcache.maintenance import CheckReport
from sparkcache.retention import Retention, SweepReport
from sparkcache.store import INDEX_FILE, SnapshotInfo, SnapshotStore

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "MANIFEST",
    "ClearReport",
    "DbRevision",
    "DeleteModelReport",
    "ExportReport",
    "ImportReport",
    "Imported",
    "ModelRow",
    "Problem",
    "SnapshotDetail",
    "SnapshotRow",
    "Stats",
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
    "open_store",
    "pin",
    "resolve_model",
    "show",
    "stats",
    "sweep",
    "to_dict",
    "unpin",
    "verify",
]

#: ``progress(done_bytes, total_bytes)``, called as work advances.
Progress = Callable[[int, int], None]

MB = 1_000_000
MANIFEST = "manifest.json"
EXPORT_FORMAT = "sparkcache-export"
EXPORT_VERSION = 1
#: A manifest larger than this is refused before it is read.
MAX_MANIFEST_BYTES = 64 << 20
#: How long an export protects the snapshots it copies from eviction.
EXPORT_LEASE_SECONDS = 3600.0
_HEX32 = re.compile(r"[0-9a-f]{32}")
_MIN_DIGEST_PREFIX = 4


def _mb(nbytes: int) -> float:
    return round(nbytes / MB, 1)


def _no_progress(done: int, total: int) -> None:
    """The default progress callback: nothing."""


# -- results -----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRow:
    id: int
    name: str
    digest: str
    folder: str
    snapshots: int  # rows in any state (from model_usage)
    nbytes: int
    mb: float
    created_at: float
    deleted_at: float | None  # set once deleted; rows stay while leased snapshots remain


@dataclass(frozen=True)
class SnapshotRow:
    id: int
    model_id: int
    model: str
    tokens: int
    start_token: int
    nbytes: int
    mb: float
    created_at: float
    last_used: float
    hits: int  # restores (use_count)
    parent: int | None
    depth: int
    world_size: int
    pinned: bool
    state: str
    reason: str | None


@dataclass(frozen=True)
class SegmentRow:
    rank: int
    object_key: str
    token_start: int
    token_end: int
    nbytes: int
    digest: str | None
    state: str
    created_at: float


@dataclass(frozen=True)
class LeaseRow:
    id: int
    holder: str
    kind: str
    created_at: float
    expires_at: float


@dataclass(frozen=True)
class ChainLink:
    id: int
    start_token: int
    n_tokens: int
    state: str


@dataclass(frozen=True)
class SnapshotDetail:
    snapshot: SnapshotRow
    model_digest: str
    segments: list[SegmentRow]
    chain: list[ChainLink]  # root first, ending with this snapshot
    children: list[int]
    leases: list[LeaseRow]


@dataclass(frozen=True)
class Problem:
    """One snapshot (and rank, where known) that failed, and why."""

    snapshot_id: int
    rank: int | None
    reason: str  # digest, tokens, identity, shape, missing, truncated, header, parent, scope
    message: str


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


@dataclass
class VerifyReport:
    segments: int = 0
    nbytes: int = 0
    corrupt: list[Problem] = field(default_factory=list)
    quarantined: list[int] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.corrupt


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


@dataclass
class ExportReport:
    model: str
    dest: str
    snapshots: list[int] = field(default_factory=list)
    segments: int = 0
    nbytes: int = 0
    skipped: list[Problem] = field(default_factory=list)


@dataclass(frozen=True)
class Imported:
    source_id: int  # the snapshot's id in the exporting store
    id: int  # its id here
    deduplicated: bool  # it was already here: nothing written


@dataclass
class ImportReport:
    model: str
    src: str
    model_id: int | None = None
    imported: list[Imported] = field(default_factory=list)
    nbytes: int = 0
    refused: list[Problem] = field(default_factory=list)


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
    """Every model row, deleted ones included, with counts from ``model_usage``."""
    with store._read() as conn:
        rows = conn.execute(q.ADMIN_MODELS).fetchall()
    return [ModelRow(id_, name, digest, folder, count, nbytes, _mb(nbytes), created, deleted)
            for id_, name, digest, folder, _ident, created, deleted, count, nbytes in rows]


def resolve_model(store: SnapshotStore, model: str | int) -> ModelRow:
    """The one model named by ``model``: an id, a name, or a digest prefix (4+ hex);
    failing those, a unique part of a name (case-insensitive).

    Raises NotFound (listing the known models) or InvalidArgument when several
    models match (listing them, so the caller can pass an id).
    """
    rows = list_models(store)
    if isinstance(model, int) and not isinstance(model, bool):
        found = [r for r in rows if r.id == model]
    else:
        text = str(model).strip()
        low = text.lower()
        found = [
            r for r in rows
            if r.name == text
            or (text.isdecimal() and r.id == int(text))
            or (len(low) >= _MIN_DIGEST_PREFIX and r.digest.startswith(low))
        ]
        if not found and text:  # a part of a name, when nothing matched exactly
            found = [r for r in rows if low in r.name.lower()]
    if not found:
        known = ", ".join(f"{r.id}:{r.name}" for r in rows) or "none"
        raise NotFound(
            f"no model {model!r} in {store.root} (known: {known}); name a model by its id, "
            f"its name or {_MIN_DIGEST_PREFIX}+ characters of its digest (see "
            "`sparkcache models`)"
        )
    if len(found) > 1:
        listed = "; ".join(
            f"id {r.id} {r.name} {r.digest[:12]}{' (deleted)' if r.deleted_at else ''}"
            for r in found
        )
        raise InvalidArgument(
            f"model {model!r} is ambiguous, it matches {len(found)} models: {listed}; "
            "pass the id or a longer digest prefix"
        )
    return found[0]


def _identity(identity_json: str) -> ModelIdentity:
    return ModelIdentity.from_dict(json.loads(identity_json))


def _model_identity(store: SnapshotStore, model_id: int) -> ModelIdentity:
    with store._read() as conn:
        for row in conn.execute(q.ADMIN_MODELS):
            if row[0] == model_id:
                return _identity(row[4])
    raise NotFound(f"no model {model_id}")


# -- listing -------------------------------------------------------------------------------


def _snapshot_row(info: SnapshotInfo, names: dict[int, str]) -> SnapshotRow:
    return SnapshotRow(
        info.id, info.model_id, names.get(info.model_id, "?"), info.n_tokens, info.start_token,
        info.nbytes, _mb(info.nbytes), info.created_at, info.last_used, info.use_count,
        info.parent_id, info.depth, info.world_size, info.pinned, info.state, info.reason,
    )


def list_snapshots(store: SnapshotStore, model: str | int | None = None) -> list[SnapshotRow]:
    """Every snapshot (of one model, when given), oldest id first."""
    names = {m.id: m.name for m in list_models(store)}
    with store._read() as conn:
        if model is None:
            rows = conn.execute(q.ADMIN_SNAPSHOTS).fetchall()
        else:
            rows = conn.execute(q.ADMIN_MODEL_SNAPSHOTS,
                                (resolve_model(store, model).id,)).fetchall()
    return [_snapshot_row(SnapshotInfo.from_row(r), names) for r in rows]


def _no_snapshot(store: SnapshotStore, snapshot_id: int) -> NotFound:
    return NotFound(f"no snapshot {snapshot_id} in {store.root}; `sparkcache ls` lists them")


def show(store: SnapshotStore, snapshot_id: int) -> SnapshotDetail:
    """One snapshot with its segments, its chain (root first), children and leases."""
    try:
        info = store.snapshot(snapshot_id)
    except NotFound:
        raise _no_snapshot(store, snapshot_id) from None
    models = {m.id: m for m in list_models(store)}
    with store._read() as conn:
        segments = [SegmentRow(*r) for r in conn.execute(q.ADMIN_SEGMENTS, (snapshot_id,))]
        chain = [ChainLink(i, start, end, state)
                 for i, start, end, _key, state in conn.execute(q.CHAIN, (snapshot_id,))]
        children = [i for (i,) in conn.execute(q.ADMIN_CHILDREN, (snapshot_id,))]
        leases = [LeaseRow(*r) for r in conn.execute(q.ADMIN_LEASES, (snapshot_id,))]
    model = models.get(info.model_id)
    return SnapshotDetail(
        _snapshot_row(info, {k: m.name for k, m in models.items()}),
        model.digest if model else "", segments, chain, children, leases,
    )


def stats(store: SnapshotStore, model: str | int | None = None) -> Stats:
    """Counters (all models, or one) plus the snapshots quarantined now."""
    models = {m.id: m.name for m in list_models(store)}
    model_id = None if model is None else resolve_model(store, model).id
    # A write first, as SnapshotStore.stats does: it saves this process's pending counters.
    with store._write() as conn:
        counter_rows = conn.execute(q.COUNTERS).fetchall()
        quarantined_rows = conn.execute(q.ADMIN_QUARANTINED).fetchall()
    totals: dict[str, int] = {}
    for mid, name, value in counter_rows:
        if model_id is None or mid == model_id:
            totals[name] = totals.get(name, 0) + int(value)
    quarantined = [
        _snapshot_row(info, models) for info in map(SnapshotInfo.from_row, quarantined_rows)
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


def _verify_file(
    buf: memoryview, digest: str, identity: ModelIdentity, rank: int, snap_key: str,
    token_start: int, token_end: int, tick: Callable[[int], None] = lambda n: None,
) -> seg.SegmentHeader:
    """Check one segment file completely: the header digest, what the header says
    (the same fields a read checks) and every chunk of every tensor, tokens included.

    Raises CorruptSnapshot with the reason a read would give.
    """
    header = seg.parse_header(buf, digest)
    expected = {
        "model": identity.digest(), "rank": rank, "snap_key": snap_key,
        "token_start": token_start, "token_end": token_end,
        "block_size": identity.block_size, "dtype": identity.kv_cache_dtype,
        "page_shape": list(identity.page_shape),
    }
    for key, value in expected.items():
        if header.meta.get(key) != value:
            raise CorruptSnapshot(
                f"segment {key} is {header.meta.get(key)!r}, expected {value!r}", "identity"
            )
    tick(header.data_start)
    for name, (_offset, nbytes) in header.tensors.items():
        view = seg.verified_view(buf, header, name, nbytes)
        del view  # the buffer may be an mmap: drop views before the blob closes
        tick(nbytes)
    return header


def verify(store: SnapshotStore, progress: Progress | None = None) -> VerifyReport:
    """Re-hash every written segment of every snapshot not yet quarantined.

    A failure quarantines the snapshot (and its descendants) exactly as a failed
    read would, and is listed in the report.  ``progress(done, total)`` counts
    payload bytes.  Snapshots deleted meanwhile are skipped silently.
    """
    tick_total = progress or _no_progress
    report = VerifyReport()
    with store._read() as conn:
        rows = conn.execute(q.ADMIN_VERIFY_SEGMENTS).fetchall()
    total = sum(int(r[5]) for r in rows)
    identities: dict[str, ModelIdentity] = {}
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        tick_total(min(done, total), total)

    tick_total(0, total)
    lost: set[int] = set()  # quarantined by this run, descendants included
    for sid, rank, key, start, end, nbytes, digest, snap_key, identity_json in rows:
        expected_done = done + int(nbytes)
        if sid in lost:
            tick(int(nbytes))
            continue
        identity = identities.get(identity_json) or identities.setdefault(
            identity_json, _identity(identity_json))
        try:
            with _opened(store.backend, key) as buf:
                if buf.nbytes != nbytes:
                    raise CorruptSnapshot(
                        f"segment file holds {buf.nbytes} bytes, the index says {nbytes}",
                        "truncated")
                _verify_file(buf, digest, identity, rank, snap_key, start, end, tick)
                del buf
        except CorruptSnapshot as exc:
            with store._read() as conn:
                subtree = [i for (i,) in conn.execute(q.SUBTREE, (sid,))]
            if subtree:  # else it was deleted meanwhile: nothing to report
                store.quarantine(sid, exc.reason)
                lost.update(subtree)
                report.quarantined.append(sid)
                report.corrupt.append(Problem(sid, rank, exc.reason, str(exc)))
        report.segments += 1
        report.nbytes += int(nbytes)
        done = expected_done
        tick_total(min(done, total), total)
    return report


@contextlib.contextmanager
def _opened(backend: Backend, key: str) -> Iterator[memoryview]:
    """The whole object as a buffer; a missing object is a corrupt (``missing``) one."""
    try:
        blob: Blob = backend.open(key)
    except NotFound as exc:
        raise CorruptSnapshot(f"segment file {key} is missing", "missing") from exc
    try:
        yield blob.buffer
    finally:
        blob.close()


def check(store: SnapshotStore, *, fix: bool = False) -> CheckReport:
    """Compare the index with the files and the living processes (see maintenance.check)."""
    report: CheckReport = store.check(fix=fix)
    return report


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
    deleted, leased, pinned = maintenance.clear_model(store, row.id, keep_pinned=keep_pinned)
    return ClearReport(row.name, row.id, deleted, leased, pinned)


def delete_model(store: SnapshotStore, model: str | int) -> DeleteModelReport:
    """Delete a model: its snapshots, its row and its folder (maintenance.delete_model).

    Leased snapshots stay until their lease ends; the sweeper finishes the job.
    """
    from sparkcache.maintenance import delete_model as _delete_model

    row = resolve_model(store, model)
    complete = _delete_model(store, row.id)
    remaining = [] if complete else [s.id for s in list_snapshots(store, row.id)]
    return DeleteModelReport(row.name, row.id, complete, remaining)


def pin(store: SnapshotStore, snapshot_id: int, pinned: bool = True) -> SnapshotRow:
    """Never evict this snapshot (retention, the sweeper and ``evict`` skip it)."""
    try:
        store.pin(snapshot_id, pinned)
    except NotFound:
        raise _no_snapshot(store, snapshot_id) from None
    return show(store, snapshot_id).snapshot


def unpin(store: SnapshotStore, snapshot_id: int) -> SnapshotRow:
    """Let a pinned snapshot be evicted again."""
    return pin(store, snapshot_id, False)


def sweep(store: SnapshotStore, retention: Retention) -> SweepReport:
    """One retention pass: deleted models' folders, age, disk margin, total."""
    return retention.sweep(store)


# -- export and import (sparkcache.transfer) --------------------------------------------


def export_model(store: SnapshotStore, model: str | int, dest: str,
                 progress: Progress | None = None) -> ExportReport:
    """Copy a model's ready snapshots, verified, into ``dest``: see :mod:`sparkcache.transfer`."""
    from sparkcache import transfer

    return transfer.export_model(store, model, dest, progress)


def import_model(store: SnapshotStore, src: str,
                 progress: Progress | None = None) -> ImportReport:
    """Verify and re-publish an export: see :mod:`sparkcache.transfer`."""
    from sparkcache import transfer

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
