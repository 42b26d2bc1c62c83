"""Export and import a model's snapshots to and from a folder or fsspec URL.

:mod:`sparkcache.admin` re-exports both verbs for the command line.  An export is
one file per segment and a ``manifest.json`` written last; an import verifies
every file (size, header digest, header fields, every chunk, the snapshot key
against its tokens) and then re-publishes through
:meth:`SnapshotStore.publish`, parents first, so an imported snapshot is exactly
as trusted as one the engine wrote.  Nothing read is ever unpickled.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sparkcache import segment as seg
from sparkcache.backends import Backend, Blob, known_schemes, open_backend
from sparkcache.backends.fsspec_backend import FSSPEC_PREFIX
from sparkcache.backends.local import root_from_url
from sparkcache.core import INDEX_FILE, SegmentInfo
from sparkcache.errors import CorruptSnapshot, InvalidArgument, NotFound, SparkCacheError
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.manifest import (
    MANIFEST,
    manifest_bytes,
    manifest_entry,
    read_manifest,
    scope_from_dict,
    segment_key,
)
from sparkcache.store import SnapshotInfo, SnapshotStore
from sparkcache.verification import Problem, Progress, check_key, read_segment, same_tokens

__all__ = [
    "MANIFEST", "ExportReport", "ImportReport", "Imported",
    "export_model", "import_into", "import_model",
]

#: How long an export protects the snapshots it copies from eviction.
EXPORT_LEASE_SECONDS = 3600.0


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


def _no_progress(done: int, total: int) -> None:
    """The default progress callback: nothing."""


# -- export ----------------------------------------------------------------------


def _not_empty(dest: str) -> InvalidArgument:
    return InvalidArgument(
        f"{dest} is not empty; export into a new or empty folder (an export never mixes "
        "its files with others)"
    )


def _check_local_destination(path: str, dest: str) -> None:
    """A local ``dest`` (absolute ``path``) is new, or an empty folder, in a folder
    that exists."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise NotFound(
            f"{dest}: the folder {parent} does not exist; create it first (an export "
            "creates only its own folder)"
        )
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise InvalidArgument(f"{dest} is not a folder; export into a new or empty folder")
    with os.scandir(path) as entries:
        names = {entry.name for entry in entries}
    if MANIFEST in names:
        raise _already_exported(dest)
    if names:
        raise _not_empty(dest)


def _already_exported(dest: str) -> InvalidArgument:
    return InvalidArgument(
        f"{dest} already holds an export ({MANIFEST}); export into an empty folder "
        "or remove the old export first"
    )


def _local_path(url: str) -> str | None:
    """The absolute path of a plain path or local-disk URL, None for any other URL."""
    text = url.removeprefix(FSSPEC_PREFIX)
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    return root_from_url(text) if scheme in ("", "local", "mmap", "file") else None


def _check_destination(dest: str) -> None:
    """Refuse ``dest`` before anything is written unless it is new or empty and the
    bucket holding it (on local disk: its parent folder) exists.

    An export never creates a bucket (a typo would otherwise become a new bucket,
    with its own owner and costs) and never mixes its files with others (an import
    reads only what the manifest names, so foreign files would pass unnoticed).
    A backend registered by a plugin is checked through its own listing only.
    """
    path = _local_path(dest)
    if path is not None:
        _check_local_destination(path, dest)
        return
    text = dest.removeprefix(FSSPEC_PREFIX)
    scheme = text.split("://", 1)[0].lower()
    if not dest.startswith(FSSPEC_PREFIX) and "::" not in scheme and scheme in known_schemes():
        return  # a plugin's backend: only its objects are visible (export_model lists them)
    import fsspec.core  # only here: fsspec is imported when a URL needs it

    try:
        fs, root = fsspec.core.url_to_fs(text)
    except (ImportError, ValueError, OSError) as exc:
        raise InvalidArgument(f"cannot open {dest!r} with fsspec: {exc}") from exc
    root = str(root).rstrip("/")
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" in protocols:
        _check_local_destination(os.path.abspath(root or "/"), dest)
        return
    bucket = root.lstrip("/").split("/", 1)[0]
    if bucket and not fs.exists(fs.root_marker + bucket):
        raise NotFound(
            f"{dest}: the bucket {bucket!r} does not exist; create it first (an export "
            "never creates a bucket)"
        )
    if fs.isfile(root):
        raise InvalidArgument(f"{dest} is not a folder; export into a new or empty folder")
    inside = [path for path in fs.find(root or fs.root_marker, withdirs=True)
              if str(path).rstrip("/") != root]
    if any(str(path).rstrip("/") == f"{root}/{MANIFEST}" for path in inside):
        raise _already_exported(dest)
    if inside:
        raise _not_empty(dest)


def export_model(store: SnapshotStore, model: str | int, dest: str,
                 progress: Progress | None = None) -> ExportReport:
    """Copy every ready snapshot of a model, verified, into ``dest`` (a folder or URL).

    ``dest`` receives ``segments/<snapshot key>.r<rank>.safetensors`` and, last,
    ``manifest.json``.  It must be new or empty, in a bucket (on local disk: a
    folder) that exists: anything else is refused before anything is written.
    Each file is fully verified while copied: a damaged one is quarantined, left
    out with its descendants, and listed in ``skipped``.  Each snapshot goes with
    its request scope (cache salt, LoRA, multimodal inputs) and its breakpoints;
    one published with a scope before the index recorded scopes (revision 0004)
    is left out (reason ``scope``): an import could not rebuild its keys.  The
    snapshots are leased while they are copied.
    """
    row = store.catalog.resolve_model(model)
    identity = store.catalog.model_identity(row.id)
    _check_destination(dest)
    out = open_backend(dest)
    try:
        if out.exists(MANIFEST):
            raise _already_exported(dest)
        if next(iter(out.list()), None) is not None:
            raise _not_empty(dest)
        report = ExportReport(row.name, dest)
        entries = _export_all(store, out, identity, report, progress or _no_progress)
        out.put(MANIFEST, [manifest_bytes(row.name, identity, entries, report.skipped)])
    finally:
        out.close()
    return report


def _export_all(store: SnapshotStore, out: Backend, identity: ModelIdentity,
                report: ExportReport, tick: Progress) -> list[dict[str, Any]]:
    """Copy the model's ready snapshots, parents first, into ``out`` and ``report``;
    their manifest entries.  Each is leased while the export runs."""
    infos = sorted((s for s in store.snapshots(identity) if s.state == "ready"),
                   key=lambda s: (s.depth, s.id))  # parents first
    segments = {s.id: store.catalog.segments(s.id) for s in infos}
    breakpoints = {s.id: store.catalog.breakpoints(s.id) for s in infos}
    total = sum(g.nbytes for segs in segments.values() for g in segs)
    done = 0
    tick(0, total)
    entries: list[dict[str, Any]] = []
    exported: dict[int, RequestScope] = {}  # snapshot id -> its scope
    leases: list[int] = []
    try:
        for info in infos:
            segs = segments[info.id]
            size = sum(g.nbytes for g in segs)
            done_or_problem = _export_one(store, out, identity, info, segs, exported, leases)
            if isinstance(done_or_problem, RequestScope):
                exported[info.id] = done_or_problem
                report.snapshots.append(info.id)
                report.segments += len(segs)
                report.nbytes += size
                entries.append(manifest_entry(info, segs, breakpoints[info.id],
                                              done_or_problem))
            else:
                report.skipped.append(done_or_problem)
            done += size
            tick(done, total)
    finally:
        for lease_id in leases:
            with contextlib.suppress(SparkCacheError):
                store.release_lease(lease_id)
    return entries


def _export_scope(info: SnapshotInfo, exported: dict[int, RequestScope]) -> RequestScope | None:
    """The scope a snapshot is exported with: its parent's for a child (its hashes
    continue the parent's), else its recorded one, the default scope where none
    was recorded (checked by the key); None when its recorded scope is unusable."""
    if info.parent_id is not None:
        inherited = exported[info.parent_id]
        return inherited if info.scope_json in (None, inherited.canonical()) else None
    if info.scope_json is None:
        return RequestScope()
    try:
        return scope_from_dict(json.loads(info.scope_json))
    except ValueError:
        return None


def _export_one(
    store: SnapshotStore, out: Backend, identity: ModelIdentity, info: SnapshotInfo,
    segs: list[SegmentInfo], exported: dict[int, RequestScope], leases: list[int],
) -> RequestScope | Problem:
    """Verify and copy one snapshot's files: the scope it was exported with, or a
    Problem when it must be left out."""
    if info.parent_id is not None and info.parent_id not in exported:
        return Problem(info.id, None, "parent", f"its parent {info.parent_id} was left out")
    scope = _export_scope(info, exported)
    if scope is None:
        return Problem(info.id, None, "scope",
                       f"its recorded request scope {info.scope_json} is not valid, or not "
                       "its parent's")
    try:
        leases.append(store.acquire_lease(info.id, kind="export", ttl=EXPORT_LEASE_SECONDS))
    except NotFound:
        return Problem(info.id, None, "missing", "deleted while the export ran")
    if sorted(g.rank for g in segs) != list(range(identity.world_size)) or any(
            g.state != "ready" or g.digest is None for g in segs):
        return Problem(info.id, None, "missing", "not every rank's segment is ready")
    written: list[str] = []
    for g in segs:
        try:
            with seg.open_segment(store.backend, g.object_key) as blob:
                buf = blob.buffer
                read = read_segment(buf, str(g.digest), identity, g.rank, info.snap_key,
                                    g.token_start, g.token_end, layers=False)
                if g.rank == 0:
                    _check_key(identity, store, info, scope, read.tokens)
                out.put(segment_key(info.snap_key, g.rank), [buf])
                written.append(segment_key(info.snap_key, g.rank))
                del buf
        except CorruptSnapshot as exc:
            if exc.reason != "scope":
                store.quarantine(info.id, exc.reason)
            for key in written:  # the other ranks' copies are of no use alone
                out.delete(key)
            return Problem(info.id, g.rank, exc.reason, str(exc))
    return scope


def _check_key(identity: ModelIdentity, store: SnapshotStore, info: SnapshotInfo,
               scope: RequestScope, tokens: np.ndarray) -> None:
    """Refuse a snapshot whose key is not the hash of its tokens in ``scope``."""
    if info.scope_json is None:
        wrong = ("published with a request scope (cache salt, LoRA or multimodal inputs) "
                 "before the store recorded scopes (index revision 0004): it cannot be "
                 "imported again")
    else:
        wrong = ("its key is not the hash of its tokens in its recorded request scope: it "
                 "cannot be imported again")
    parent_key = None if info.parent_id is None else store.snapshot(info.parent_id).snap_key
    check_key(identity, tokens, info.snap_key, scope=scope, parent_key=parent_key,
              reason="scope", message=wrong)


def _open_source(src: str) -> Backend:
    """The backend of an export, without creating a missing local folder."""
    path = _local_path(src)
    if path is not None and not os.path.isdir(path):
        raise NotFound(f"{src} is not a folder: it is not a sparkcache export")
    return open_backend(src)


def import_model(store: SnapshotStore, src: str,
                 progress: Progress | None = None) -> ImportReport:
    """Publish every snapshot of an export into ``store``, parents first.

    Each file is checked against the manifest (size, header digest, header
    fields, every chunk) before anything of its snapshot is published; a
    damaged or missing file refuses that snapshot and its descendants (listed in
    ``refused``).  Snapshots already in the store are deduplicated.
    """
    source = _open_source(src)
    try:
        identity, snaps = read_manifest(source, src)
        report = ImportReport(identity.model, src)
        _import_all(store, source, identity, snaps, report, progress)
    finally:
        source.close()
    return report


def import_into(folder: str | os.PathLike[str], src: str, *, storage: str | None = None,
                progress: Progress | None = None) -> ImportReport:
    """:func:`import_model` into the store in ``folder``, created if it has none.

    The manifest is read and validated before the store is opened.  A store
    that this call created is removed again, with the folders it made, when
    nothing was imported (the import failed, or refused every snapshot): a
    failed import leaves no empty store behind.  A store that was there is
    kept, whatever happens.
    """
    root = Path(folder).expanduser().absolute()
    source = _open_source(src)
    try:
        identity, snaps = read_manifest(source, src)
        report = ImportReport(identity.model, src)
        made = [p for p in (root, *root.parents) if not p.exists()]  # folders we would make
        new = not (root / INDEX_FILE).exists()
        before = set(os.listdir(root)) if root.is_dir() else set()
        try:
            with SnapshotStore(root, storage=storage) as store:
                _import_all(store, source, identity, snaps, report, progress)
        finally:
            if new and not report.imported:
                _remove_new_store(root, before, made)
    finally:
        source.close()
    return report


def _remove_new_store(root: Path, before: set[str], made: list[Path]) -> None:
    """Remove a closed store that holds nothing, created moments ago in ``root``
    (whose entries were ``before``): the files it made there (the index and its
    companions), its folders once empty, and the folders made for it.  A folder
    is removed only when empty, so no payload and nothing of anyone else goes."""
    if not root.is_dir():
        return
    for name in set(os.listdir(root)) - before:
        path = root / name
        if path.is_dir() and not path.is_symlink():
            for inside, _dirs, _files in sorted(os.walk(path), reverse=True):  # deepest first
                with contextlib.suppress(OSError):
                    os.rmdir(inside)
        elif name.startswith(f"{Path(INDEX_FILE).stem}."):  # index.sqlite(-wal, -shm), ...
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    for folder in made:  # root first, then the parents made for it
        with contextlib.suppress(OSError):
            folder.rmdir()


def _import_all(store: SnapshotStore, source: Backend, identity: ModelIdentity,
                snaps: list[dict[str, Any]], report: ImportReport,
                progress: Progress | None) -> None:
    """Import the validated manifest entries ``snaps``, parents first, into ``report``."""
    tick = progress or _no_progress
    total = sum(g["nbytes"] for s in snaps for g in s["segments"])
    done = 0
    tick(0, total)
    new_ids: dict[int, int] = {}
    full_tokens: dict[int, np.ndarray] = {}
    keys: dict[int, str] = {}
    for snap in snaps:
        size = sum(g["nbytes"] for g in snap["segments"])
        problem = _import_one(store, source, identity, snap, new_ids, full_tokens, keys, report)
        if problem is not None:
            report.refused.append(problem)
        else:
            report.nbytes += size
        done += size
        tick(done, total)


def _import_one(
    store: SnapshotStore, source: Backend, identity: ModelIdentity, snap: dict[str, Any],
    new_ids: dict[int, int], full_tokens: dict[int, np.ndarray], keys: dict[int, str],
    report: ImportReport,
) -> Problem | None:
    """Verify every rank's file of one snapshot, then publish them; else a Problem."""
    sid, parent = snap["id"], snap["parent"]
    if parent is not None and parent not in new_ids:
        return Problem(sid, None, "parent", f"its parent {parent} was refused")
    blobs: list[Blob] = []
    pages: list[list[np.ndarray]] = []  # views of the blobs: cleared before they close
    try:
        tokens = _read_files(source, identity, snap, blobs, pages)
        if isinstance(tokens, Problem):
            return tokens
        try:
            check_key(identity, tokens, snap["snap_key"], scope=snap["scope"],
                      parent_key=None if parent is None else keys[parent], reason="scope",
                      message="its key is not the hash of its tokens in its scope (the "
                              "manifest was edited?)")
        except CorruptSnapshot as exc:
            return Problem(sid, None, exc.reason, str(exc))
        full = tokens if parent is None else np.concatenate([full_tokens[parent], tokens])
        new_parent = None if parent is None else new_ids[parent]
        try:
            results = [store.publish(identity, rank, full, layer_pages, parent=new_parent,
                                     scope=snap["scope"], breakpoints=snap["breakpoints"])
                       for rank, layer_pages in enumerate(pages)]
        except NotFound as exc:  # the parent was evicted meanwhile (retention, a sweep)
            return Problem(sid, None, "missing", str(exc))
        result = results[-1]
        if result.state == "skipped":  # the store's retention refused it
            return Problem(sid, None, "retention", str(result.skipped))
        if result.state != "ready":
            raise SparkCacheError(
                f"snapshot {sid} was published as {result.state!r}, not ready; run "
                "`sparkcache check --fix` and import again")
        new_ids[sid], full_tokens[sid], keys[sid] = result.snapshot_id, full, snap["snap_key"]
        if snap["pinned"]:
            store.pin(result.snapshot_id)
        report.model_id = store.snapshot(result.snapshot_id).model_id
        report.imported.append(
            Imported(sid, result.snapshot_id, all(r.deduplicated for r in results)))
        return None
    finally:
        pages.clear()
        for blob in blobs:
            blob.close()


def _read_files(source: Backend, identity: ModelIdentity, snap: dict[str, Any],
                blobs: list[Blob], pages: list[list[np.ndarray]]) -> np.ndarray | Problem:
    """Open (into ``blobs``, which the caller closes) and verify every rank's file of
    one snapshot: its token ids, each rank's layers appended to ``pages``, or the
    Problem found."""
    sid = snap["id"]
    tokens: np.ndarray | None = None
    for g in snap["segments"]:
        try:
            size = source.size(g["key"])
            if size != g["nbytes"]:
                return Problem(sid, g["rank"], "truncated",
                               f"{g['key']} is {size} bytes, the manifest says {g['nbytes']}")
            blobs.append(source.open(g["key"]))
        except NotFound:
            return Problem(sid, g["rank"], "missing", f"{g['key']} is missing")
        try:
            read = read_segment(blobs[-1].buffer, g["digest"], identity, g["rank"],
                                snap["snap_key"], g["token_start"], g["token_end"])
            same_tokens(tokens, read.tokens, snap["snap_key"])
        except CorruptSnapshot as exc:
            return Problem(sid, g["rank"], exc.reason, str(exc))
        tokens = tokens if tokens is not None else read.tokens
        pages.append(list(read.layers))
        del read
    assert tokens is not None
    return tokens
