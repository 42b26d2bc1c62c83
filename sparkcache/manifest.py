"""The ``manifest.json`` of an export: its format, its entries and its strict parser.

An export (:mod:`sparkcache.transfer`) is one file per segment plus this
manifest, written last.  :func:`read_manifest` is the only reader: JSON only,
every field checked, nothing unpickled; what it returns is safe to publish
from once each file has been verified against it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from sparkcache.backends import Backend, validate_key
from sparkcache.core import SegmentInfo, SnapshotInfo
from sparkcache.errors import InvalidArgument, NotFound
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.verification import Problem
from sparkcache.version import VERSION

__all__ = [
    "EXPORT_FORMAT", "EXPORT_VERSION", "MANIFEST", "MAX_MANIFEST_BYTES", "READABLE_VERSIONS",
    "manifest_bytes", "manifest_entry", "read_manifest", "scope_from_dict", "segment_key",
]

MANIFEST = "manifest.json"
EXPORT_FORMAT = "sparkcache-export"
#: Version 2 added each snapshot's ``breakpoints`` and ``scope``; version 1 exports
#: (no breakpoints, the default scope) still import.
EXPORT_VERSION = 2
READABLE_VERSIONS = (1, 2)
#: A manifest larger than this is refused before it is read.
MAX_MANIFEST_BYTES = 64 << 20
_HEX32 = re.compile(r"[0-9a-f]{32}")
#: The fields of a snapshot entry (version 1) and of one rank's segment.
_SNAP_FIELDS = frozenset({"id", "parent", "start_token", "n_tokens", "snap_key", "pinned",
                          "segments"})
_SNAP_FIELDS_V2 = _SNAP_FIELDS | {"breakpoints", "scope"}
_SEG_FIELDS = frozenset({"rank", "key", "token_start", "token_end", "nbytes", "digest"})


def segment_key(snap_key: str, rank: int) -> str:
    """The key of one rank's segment file inside an export."""
    return f"segments/{snap_key}.r{rank}.safetensors"


def manifest_entry(info: SnapshotInfo, segs: list[SegmentInfo], breakpoints: list[int],
                   scope: RequestScope) -> dict[str, Any]:
    """One snapshot's entry in the manifest (the newest version's form)."""
    return {
        "id": info.id, "parent": info.parent_id, "start_token": info.start_token,
        "n_tokens": info.n_tokens, "snap_key": info.snap_key, "pinned": info.pinned,
        "breakpoints": breakpoints, "scope": json.loads(scope.canonical()),
        "segments": [
            {"rank": g.rank, "key": segment_key(info.snap_key, g.rank),
             "token_start": g.token_start, "token_end": g.token_end, "nbytes": g.nbytes,
             "digest": g.digest}
            for g in segs
        ],
    }


def manifest_bytes(name: str, identity: ModelIdentity, entries: list[dict[str, Any]],
                   skipped: Sequence[Problem]) -> bytes:
    """The manifest of an export of ``identity`` (named ``name``): its snapshot
    ``entries`` (:func:`manifest_entry`) and the snapshots left out."""
    manifest = {
        "format": EXPORT_FORMAT, "version": EXPORT_VERSION, "sparkcache": VERSION,
        "created_at": time.time(),
        "model": {"digest": identity.digest(), "name": name, "identity": identity.to_dict()},
        "snapshots": entries,
        "skipped": [asdict(p) for p in skipped],
    }
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def scope_from_dict(doc: Any) -> RequestScope | None:
    """The RequestScope whose canonical JSON is ``doc`` (parsed), or None."""
    try:
        return RequestScope.from_dict(doc)
    except InvalidArgument:
        return None


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise InvalidArgument(f"the export manifest is invalid: {what}; export the model again")


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def read_manifest(src: Backend, where: str) -> tuple[ModelIdentity, list[dict[str, Any]]]:
    """Load and strictly validate ``manifest.json`` (JSON only, every field checked).

    The snapshot entries come back in the newest version's form, with ``scope``
    a RequestScope: a version 1 entry gets the fields it lacks with their old
    meaning (no breakpoints, the default scope).  Raises NotFound when ``src``
    holds no manifest and InvalidArgument for any field that is not right."""
    doc = _load(src, where)
    version = doc.get("version")
    _require(version in READABLE_VERSIONS and _is_int(version),
             f"version {version!r} is not one of {list(READABLE_VERSIONS)} (a newer "
             "sparkcache wrote it? upgrade sparkcache)")
    model, snaps = doc.get("model"), doc.get("snapshots")
    _require(isinstance(model, dict) and isinstance(model.get("identity"), dict),
             "model.identity is missing")
    _require(isinstance(snaps, list), "snapshots is not a list")
    try:
        identity = ModelIdentity.from_dict(model["identity"])
    except InvalidArgument as exc:
        raise InvalidArgument(f"the export manifest is invalid: model.identity: {exc}") from exc
    _require(identity.digest() == model.get("digest"),
             "model.digest does not match model.identity")
    ends: dict[int, int] = {}  # snapshot id -> its token count
    scopes: dict[int, str] = {}  # snapshot id -> its scope's canonical JSON
    entries = [_entry(snap, identity, version, ends, scopes) for snap in snaps]
    return identity, entries


def _load(src: Backend, where: str) -> Any:
    """The manifest's JSON object, of a bounded size and of the export format."""
    try:
        size = src.size(MANIFEST)
    except NotFound:
        raise NotFound(f"{where} holds no {MANIFEST}: it is not a sparkcache export") from None
    _require(size <= MAX_MANIFEST_BYTES, f"{MANIFEST} is {size} bytes")
    with src.open(MANIFEST) as blob:
        raw = bytes(blob.buffer)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{where}/{MANIFEST} is not JSON ({exc}); export again") from exc
    except RecursionError as exc:  # nested deeper than any manifest ever is
        raise InvalidArgument(f"{where}/{MANIFEST} is nested too deeply to be a manifest; "
                              "export again") from exc
    _require(isinstance(doc, dict) and doc.get("format") == EXPORT_FORMAT,
             f"format is not {EXPORT_FORMAT!r}")
    return doc


def _entry(snap: Any, identity: ModelIdentity, version: int, ends: dict[int, int],
           scopes: dict[int, str]) -> dict[str, Any]:
    """One validated snapshot entry; ``ends`` and ``scopes`` hold those before it."""
    fields = _SNAP_FIELDS_V2 if version >= 2 else _SNAP_FIELDS
    _require(isinstance(snap, dict) and set(snap) == fields,
             f"a snapshot entry must have exactly the fields {sorted(fields)}")
    bs = identity.block_size
    sid, parent, start, end = (snap["id"], snap["parent"], snap["start_token"],
                               snap["n_tokens"])
    _require(_is_int(sid, 1) and sid not in ends, f"snapshot id {sid!r} is bad or repeated")
    _require(parent is None or (_is_int(parent, 1) and parent in ends),
             f"snapshot {sid}: parent {parent!r} does not come before it")
    _require(_is_int(start) and _is_int(end, 1) and start < end
             and start % bs == 0 and end % bs == 0
             and start == (0 if parent is None else ends[parent]),
             f"snapshot {sid}: token range [{start!r}, {end!r}) is inconsistent")
    _require(isinstance(snap["snap_key"], str) and bool(_HEX32.fullmatch(snap["snap_key"])),
             f"snapshot {sid}: snap_key is not 32 hex digits")
    _require(isinstance(snap["pinned"], bool), f"snapshot {sid}: pinned is not a boolean")
    marks = snap.get("breakpoints", [])
    _require(isinstance(marks, list)
             and all(_is_int(b, bs) and b % bs == 0 and b < end for b in marks)
             and marks == sorted(set(marks)),
             f"snapshot {sid}: breakpoints must be increasing multiples of the block size "
             "below its end")
    scope = scope_from_dict(snap["scope"]) if version >= 2 else RequestScope()
    _require(scope is not None,
             f"snapshot {sid}: scope must be an object with exactly the fields "
             "cache_salt, lora (strings or null) and mm (a list of strings)")
    assert scope is not None
    _require(parent is None or scopes[parent] == scope.canonical(),
             f"snapshot {sid}: its scope is not its parent's")
    _check_segments(snap, identity)
    ends[sid], scopes[sid] = end, scope.canonical()
    return {**snap, "breakpoints": marks, "scope": scope}


def _check_segments(snap: dict[str, Any], identity: ModelIdentity) -> None:
    """A snapshot entry lists one segment per rank, each with its expected key and
    the snapshot's token range."""
    sid, segs = snap["id"], snap["segments"]
    _require(isinstance(segs, list)
             and all(isinstance(g, dict) and set(g) == _SEG_FIELDS for g in segs)
             and [g["rank"] for g in segs] == list(range(identity.world_size)),
             f"snapshot {sid}: segments must list ranks 0..{identity.world_size - 1} "
             f"with the fields {sorted(_SEG_FIELDS)}")
    for g in segs:
        key = g["key"]
        _require(isinstance(key, str) and key == segment_key(snap["snap_key"], g["rank"]),
                 f"snapshot {sid}: segment key {key!r} is not the expected one")
        validate_key(key)
        _require((g["token_start"], g["token_end"]) == (snap["start_token"], snap["n_tokens"])
                 and _is_int(g["nbytes"], 1)
                 and isinstance(g["digest"], str) and bool(_HEX32.fullmatch(g["digest"])),
                 f"snapshot {sid} rank {g['rank']}: range, nbytes or digest is bad")
