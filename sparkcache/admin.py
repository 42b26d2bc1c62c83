"""The admin API: what the ``sparkcache`` command does, as Python functions.

Every function takes an open :class:`~sparkcache.store.SnapshotStore` (plus the
settings it needs) and returns plain dataclasses; :func:`to_dict` turns any of
them into JSON-serialisable dicts (bytes and unix seconds, never formatted
text).  This module decides *what* happens; :mod:`sparkcache.cli` only parses
arguments and prints, and imports nothing of the store but this module, which
re-exports the result types it prints.  Listing and naming models live in
:mod:`sparkcache.catalog`, the rules of deletion, eviction, checking and
verification in :mod:`sparkcache.maintenance` and :mod:`sparkcache.retention`,
export and import in :mod:`sparkcache.transfer`, the request log in
:mod:`sparkcache.requestlog`.

The deleting functions (:func:`clear_model`, :func:`delete_model`,
:func:`check` with ``fix``, :func:`sweep`) take ``dry_run=True``: the very same
operation then runs inside one write transaction of the index that is always
rolled back, on a backend that records deletions instead of making them, and
returns a :class:`DryRun` (what the real run would report, plus the files and
folders it would delete).  There is no second copy of the rules to drift.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Literal, overload

from sparkcache import transfer
from sparkcache.backends import known_schemes
from sparkcache.catalog import ModelRow, SnapshotDetail, SnapshotRow, mb
from sparkcache.core import INDEX_FILE
from sparkcache.errors import InvalidArgument, NotFound
from sparkcache.folder import resolve_folder
from sparkcache.indexfile import (
    DbRevision,
    db_current,
    db_downgrade,
    db_upgrade,
    index_path,
    read_revision,
)
from sparkcache.maintenance import CheckReport
from sparkcache.measures import CostRow
from sparkcache.rehearsal import DryRun
from sparkcache.requestlog import KeySummary, RequestRow, printable
from sparkcache.retention import Retention, RetentionSettings, SweepReport
from sparkcache.shared import (
    SharedTier,
    TierLimits,
    TierSweepReport,
    UploadReport,
    resolve_shared,
    sweep_tier,
)
from sparkcache.store import DEFAULT_ALIAS_STRIDE, SnapshotStore
from sparkcache.transfer import ExportReport, ImportReport
from sparkcache.verification import Problem, Progress, RequeueReport, VerifyReport
from sparkcache.version import VERSION

__all__ = [
    "VERSION",
    "CheckReport",
    "ClearReport",
    "CostRow",
    "DbRevision",
    "DeleteModelReport",
    "DryRun",
    "ExportReport",
    "ImportReport",
    "KeySummary",
    "ModelRow",
    "Problem",
    "Progress",
    "RequestRow",
    "RequestSummary",
    "SnapshotDetail",
    "SnapshotRow",
    "SnapshotStore",
    "Stats",
    "SweepReport",
    "TenantRow",
    "TierLimits",
    "TierSweepReport",
    "UploadReport",
    "VerifyReport",
    "check",
    "check_url",
    "clear_model",
    "db_current",
    "db_downgrade",
    "db_upgrade",
    "delete_model",
    "export_model",
    "import_model",
    "index_path",
    "list_models",
    "list_snapshots",
    "mb",
    "open_store",
    "pin",
    "printable",
    "request_log",
    "request_summary",
    "resolve_folder",
    "resolve_model",
    "resolve_shared",
    "retention_settings",
    "shared_sweep",
    "show",
    "stats",
    "sweep",
    "tenants",
    "to_dict",
    "unpin",
    "upload",
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
    #: The connector's measured rates (its model's and the host's; docs/index.md, "costs").
    costs: list[CostRow] = field(default_factory=list)


@dataclass(frozen=True)
class ClearReport:
    model: str
    model_id: int
    deleted: list[int]
    kept_leased: list[int]  # leased, or an ancestor of a leased snapshot
    kept_pinned: list[int]  # only with keep_pinned
    tenant: str | None = None  # only this tenant's snapshots were cleared
    nbytes: int = 0  # of the deleted snapshots


@dataclass(frozen=True)
class TenantRow:
    """One tenant of one model (:func:`tenants`)."""

    model: str
    model_id: int
    tenant: str  # as the client sent it: print it through printable()
    snapshots: int
    nbytes: int
    mb: float
    requests: int  # in the request log, which keeps the newest rows only
    prompt_tokens: int
    cached_tokens: int  # live + restored
    hit_rate: float  # cached / prompt tokens; 0.0 without requests


@dataclass(frozen=True)
class DeleteModelReport:
    model: str
    model_id: int
    complete: bool  # False: leased snapshots remain; the sweeper finishes later
    remaining: list[int]


@dataclass(frozen=True)
class RequestSummary:
    """The request log summed (:func:`request_summary`)."""

    model: str | None  # None: every model
    requests: int
    prompt_tokens: int
    live_tokens: int  # served by vLLM's own prefix cache
    restored_tokens: int  # restored from snapshots
    written_tokens: int
    cached_tokens: int  # live + restored
    hit_rate: float  # cached / prompt tokens; 0.0 for an empty log
    by_cache_key: list[KeySummary]  # most requests first


def to_dict(result: Any) -> Any:
    """A JSON-serialisable form of any result of this module (lists included).

    A :class:`DryRun` is its report's dict plus ``dry_run: true``, ``files`` and
    ``folders`` (and ``fixed: false``, where the report has ``fixed``), so a
    script reads a dry run's answer under the same keys as the real run's.
    """
    if isinstance(result, list):
        return [to_dict(r) for r in result]
    if isinstance(result, DryRun):
        out = {**to_dict(result.report), "dry_run": True, "files": result.files,
               "folders": result.folders}
        if "fixed" in out:
            out["fixed"] = False
        return out
    if isinstance(result, SweepReport):
        return {**asdict(result), "counts": result.counts(), "count": result.count}
    if is_dataclass(result) and not isinstance(result, type):
        out = asdict(result)
        for extra in ("clean", "up_to_date", "cached_tokens"):
            if hasattr(result, extra):
                out[extra] = getattr(result, extra)
        return out
    return result


# -- opening and naming ------------------------------------------------------------------


def open_store(folder: str | os.PathLike[str], *, storage: str | None = None,
               create: bool = False, upgrade: bool = True,
               relocate: bool = False, shared: str | None = None) -> SnapshotStore:
    """Open the store in ``folder``; refuse to create one unless ``create``.

    An admin command pointed at a mistyped folder should say so, not leave an
    empty store behind: without ``create`` a missing index raises NotFound, and
    an index file that is not a sparkcache index (empty, other tables, not
    SQLite) or was written by a newer sparkcache raises SchemaMismatch,
    untouched.  With ``upgrade=False`` (read-only commands, dry runs) the schema
    is never changed: an index behind this sparkcache raises SchemaMismatch
    naming ``sparkcache db upgrade``, before anything is written.  A ``storage``
    URL with an unknown scheme raises InvalidArgument (:func:`check_url`).  A
    ``storage`` other than the one the store recorded raises StorageMismatch
    unless ``relocate`` records it (after the payloads were moved there).
    ``shared`` opens the store with that shared tier (docs/shared.md), checked
    at once and recorded like the storage (its options come from the
    filesystem's environment: ``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ...).
    """
    root = Path(folder).expanduser()
    if not create:
        path = root / INDEX_FILE
        if not path.is_file():
            raise NotFound(
                f"no sparkcache store in {root} (no {INDEX_FILE}); pass --folder, or set "
                "SPARK_KV_CACHE_FOLDER (or SPARK_STORAGE) to the folder vLLM uses"
            )
        read_revision(path, behind_ok=upgrade)
    for url in (storage, shared):
        if url is not None:
            check_url(url)
    return SnapshotStore(root, storage=storage, upgrade=upgrade, relocate=relocate,
                         shared=shared)


_URL_SCHEME = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)(?P<sep>://|::)")


def check_url(url: str) -> None:
    """Refuse (InvalidArgument) a URL whose scheme no backend can open.

    ``nosuch://x`` is a typo, a usage error, where a storage failure is a
    BackendError.  Plain paths pass, and so do schemes that fsspec knows but
    needs a package for (opening them says which).
    """
    found = _URL_SCHEME.match(url)
    if found is None or (found["sep"] == "::" and "://" not in url):
        return  # a path (maybe with '::' in a file name), as open_backend reads it
    scheme = found["scheme"].lower()
    if scheme in known_schemes():
        return
    import fsspec  # only for a URL: the command line of a local store never needs it

    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError:
        return
    except ValueError:
        raise InvalidArgument(
            f"no storage backend for {scheme!r} URLs ({url!r}): known schemes are "
            f"{', '.join(known_schemes())} and every fsspec protocol (e.g. file, memory, s3); "
            "check the URL, or give a plain path for local disk"
        ) from None


def list_models(store: SnapshotStore) -> list[ModelRow]:
    """Every model row, deleted ones included (:func:`sparkcache.catalog.list_models`)."""
    return store.catalog.models()


def resolve_model(store: SnapshotStore, model: str | int) -> ModelRow:
    """The one model named by ``model`` (:func:`sparkcache.catalog.resolve_model`)."""
    return store.catalog.resolve_model(model)


def list_snapshots(store: SnapshotStore, model: str | int | None = None) -> list[SnapshotRow]:
    """Every snapshot (of one model, when given), oldest id first."""
    return store.catalog.snapshots(model)


def show(store: SnapshotStore, snapshot_id: int) -> SnapshotDetail:
    """One snapshot with its segments, its chain (root first), children and leases."""
    return store.catalog.show(snapshot_id)


def stats(store: SnapshotStore, model: str | int | None = None) -> Stats:
    """Counters (all models, or one) plus the snapshots quarantined now."""
    models = {m.id: m.name for m in list_models(store)}
    named = None if model is None else resolve_model(store, model)
    model_id = None if named is None else named.id
    totals = store.catalog.counters(model_id)
    quarantined = [row for row in store.catalog.snapshots(model_id)
                   if row.state == "quarantined"]

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
        costs=store.costs(None if named is None else named.digest),
    )


# -- the request log (sparkcache.requestlog) --------------------------------------------------


def request_log(store: SnapshotStore, *, model: str | int | None = None, limit: int = 50,
                after: int | None = None) -> list[RequestRow]:
    """The logged requests (of one model: an id, a name or a digest prefix, as
    :func:`resolve_model` reads it): the newest ``limit``, newest first; with
    ``after`` (a ``seq``), at most ``limit`` of those recorded after it, oldest
    first, to follow the log."""
    model_id = None if model is None else resolve_model(store, model).id
    return store.requests(model_id=model_id, limit=limit, after_seq=after)


def request_summary(store: SnapshotStore, *, model: str | int | None = None) -> RequestSummary:
    """The request log summed (of one model), and per ``prompt_cache_key``."""
    row = None if model is None else resolve_model(store, model)
    model_id = None if row is None else row.id
    total = store.request_summary(model_id=model_id)
    return RequestSummary(
        model=None if row is None else row.name, requests=total.requests,
        prompt_tokens=total.prompt_tokens, live_tokens=total.live_tokens,
        restored_tokens=total.restored_tokens, written_tokens=total.written_tokens,
        cached_tokens=total.cached_tokens, hit_rate=total.hit_rate,
        by_cache_key=store.requests_by_key(model_id=model_id),
    )


# -- verification --------------------------------------------------------------------------


def verify(store: SnapshotStore, progress: Progress | None = None) -> VerifyReport:
    """Re-hash every written segment (:func:`sparkcache.verification.verify`)."""
    return store.verify(progress)


def requeue(store: SnapshotStore) -> RequeueReport:
    """Give back quarantined snapshots whose files verify whole again
    (:func:`sparkcache.verification.requeue`)."""
    return store.requeue()


@overload
def check(store: SnapshotStore, *, fix: bool = False,
          dry_run: Literal[False] = False) -> CheckReport: ...
@overload
def check(store: SnapshotStore, *, fix: bool = False,
          dry_run: Literal[True]) -> DryRun[CheckReport]: ...
def check(store: SnapshotStore, *, fix: bool = False,
          dry_run: bool = False) -> CheckReport | DryRun[CheckReport]:
    """Compare the index with the files and the living processes (see maintenance.check).

    With ``fix`` and ``dry_run`` the repair is rehearsed (see :class:`DryRun`).
    """
    return store.check(fix=fix, dry_run=True) if dry_run else store.check(fix=fix)


# -- deleting and pinning -------------------------------------------------------------------


@overload
def clear_model(store: SnapshotStore, model: str | int, *, keep_pinned: bool = False,
                dry_run: Literal[False] = False, tenant: str | None = None) -> ClearReport: ...
@overload
def clear_model(store: SnapshotStore, model: str | int, *, keep_pinned: bool = False,
                dry_run: Literal[True], tenant: str | None = None) -> DryRun[ClearReport]: ...
def clear_model(store: SnapshotStore, model: str | int, *, keep_pinned: bool = False,
                dry_run: bool = False,
                tenant: str | None = None) -> ClearReport | DryRun[ClearReport]:
    """Delete every snapshot of a model (``tenant``: only that tenant's), in one
    transaction, deepest first.

    Leased snapshots stay, with their ancestors (they cannot be read without
    them), and are reported; so are pinned ones with ``keep_pinned``.  The model
    row and folder stay (use :func:`delete_model` to remove those too).  Files
    go after the commit.  ``dry_run``: see :class:`DryRun`.
    """
    row = resolve_model(store, model)
    sizes = {s.id: s.nbytes for s in store.catalog.snapshots(row.id)}

    def report(cleared: tuple[list[int], list[int], list[int]]) -> ClearReport:
        return ClearReport(row.name, row.id, *cleared, tenant=tenant,
                           nbytes=sum(sizes.get(i, 0) for i in cleared[0]))

    if dry_run:
        rehearsed = store.clear_model(row.id, keep_pinned=keep_pinned, dry_run=True,
                                      tenant=tenant)
        return DryRun(report(rehearsed.report), rehearsed.files, rehearsed.folders)
    return report(store.clear_model(row.id, keep_pinned=keep_pinned, tenant=tenant))


def tenants(store: SnapshotStore, model: str | int | None = None) -> list[TenantRow]:
    """Every tenant (of one model) with its snapshots and its requests in the
    log, by model, then most requests (:func:`sparkcache.tenants.tenant_usage`)."""
    model_id = None if model is None else resolve_model(store, model).id
    names = {m.id: m.name for m in store.catalog.models()}
    return [TenantRow(names.get(t.model_id, f"#{t.model_id}"), t.model_id, t.tenant,
                      t.snapshots, t.nbytes, mb(t.nbytes), t.requests, t.prompt_tokens,
                      t.cached_tokens, round(t.hit_rate, 4))
            for t in store.tenants(model_id=model_id)]


@overload
def delete_model(store: SnapshotStore, model: str | int, *,
                 dry_run: Literal[False] = False) -> DeleteModelReport: ...
@overload
def delete_model(store: SnapshotStore, model: str | int, *,
                 dry_run: Literal[True]) -> DryRun[DeleteModelReport]: ...
def delete_model(store: SnapshotStore, model: str | int, *,
                 dry_run: bool = False) -> DeleteModelReport | DryRun[DeleteModelReport]:
    """Delete a model: its snapshots, its row and its folder (maintenance.delete_model).

    Leased snapshots stay until their lease ends; the sweeper finishes the job.
    ``dry_run``: see :class:`DryRun`.
    """
    row = resolve_model(store, model)
    if dry_run:
        rehearsed = store.delete_model(row.id, dry_run=True)
        return DryRun(DeleteModelReport(row.name, row.id, *rehearsed.report), rehearsed.files,
                      rehearsed.folders)
    return DeleteModelReport(row.name, row.id, *store.delete_model(row.id))


def pin(store: SnapshotStore, snapshot_id: int, pinned: bool = True) -> SnapshotRow:
    """Never evict this snapshot (retention, the sweeper and ``evict`` skip it).

    A quarantined snapshot is refused (InvalidArgument): it is never offered
    again, so a pin would only keep its files forever.  Unpinning always works.
    """
    try:
        store.pin(snapshot_id, pinned)
    except NotFound:
        raise store.catalog.no_snapshot(snapshot_id) from None
    return show(store, snapshot_id).snapshot


def unpin(store: SnapshotStore, snapshot_id: int) -> SnapshotRow:
    """Let a pinned snapshot be evicted again."""
    return pin(store, snapshot_id, False)


def retention_settings(folder: str | os.PathLike[str] | None = None,
                       **overrides: Any) -> RetentionSettings:
    """Spark's limits from ``SPARK_KV_CACHE_*``, with ``overrides`` winning."""
    return RetentionSettings.from_env(folder=resolve_folder(folder), **overrides)


@overload
def sweep(store: SnapshotStore, retention: Retention | RetentionSettings, *,
          dry_run: Literal[False] = False) -> SweepReport: ...
@overload
def sweep(store: SnapshotStore, retention: Retention | RetentionSettings, *,
          dry_run: Literal[True]) -> DryRun[SweepReport]: ...
def sweep(store: SnapshotStore, retention: Retention | RetentionSettings, *,
          dry_run: bool = False) -> SweepReport | DryRun[SweepReport]:
    """One retention pass: deleted models' folders, age, disk margin, total.

    ``dry_run``: see :class:`DryRun`; the disk margin is measured as if the
    files the pass would delete so far were gone.
    """
    if isinstance(retention, RetentionSettings):
        retention = Retention(retention)
    return store.sweep(retention, dry_run=True) if dry_run else store.sweep(retention)


# -- the shared tier (sparkcache.shared) ---------------------------------------------------


def upload(store: SnapshotStore, *, limit: int | None = None) -> UploadReport:
    """Upload the ready snapshots not uploaded yet to the store's shared tier, parents
    first, now (:meth:`SnapshotStore.upload`); the store must be opened with ``shared``."""
    return store.upload(limit=limit)


def shared_sweep(url: str, limits: TierLimits, *, dry_run: bool = False,
                 options: dict[str, Any] | None = None) -> TierSweepReport:
    """One sweep of the shared tier at ``url`` (its per-model budget and age: see
    :func:`sparkcache.shared.sweep_tier`); needs no local store.  ``dry_run``
    lists what would go and changes nothing (not even a new tier's ``tier.json``
    is written).  Skipped (``swept`` False) while another host sweeps it."""
    tier = SharedTier(url, options, alias_stride=DEFAULT_ALIAS_STRIDE, create=not dry_run)
    try:
        return sweep_tier(tier, limits, dry_run=dry_run)
    finally:
        tier.close()


# -- export and import (sparkcache.transfer) --------------------------------------------


def export_model(store: SnapshotStore, model: str | int, dest: str,
                 progress: Progress | None = None) -> ExportReport:
    """Copy a model's ready snapshots, verified, into ``dest``: see :mod:`sparkcache.transfer`.

    A ``dest`` URL with an unknown scheme raises InvalidArgument (:func:`check_url`).
    """
    check_url(dest)
    return transfer.export_model(store, model, dest, progress)


def import_model(store: SnapshotStore, src: str,
                 progress: Progress | None = None) -> ImportReport:
    """Verify and re-publish an export: see :mod:`sparkcache.transfer`.

    A ``src`` URL with an unknown scheme raises InvalidArgument (:func:`check_url`).
    """
    check_url(src)
    return transfer.import_model(store, src, progress)


def import_into(folder: str | os.PathLike[str], src: str, *, storage: str | None = None,
                progress: Progress | None = None) -> ImportReport:
    """Import into the store in ``folder``, created if it has none and removed
    again if nothing was imported (:func:`sparkcache.transfer.import_into`).

    URLs with an unknown scheme raise InvalidArgument (:func:`check_url`).
    """
    for url in (src, storage):
        if url is not None:
            check_url(url)
    return transfer.import_into(folder, src, storage=storage, progress=progress)
