"""The shared tier's layout: every key, and the small JSON objects that name things.

Under the tier's URL (docs/shared.md)::

    tier.json                                          the tier: format, version, alias_stride
    m-<model>/model.json                               the model identity (canonical JSON)
    m-<model>/seg/<k[:2]>/<k>.r<rank>.<d>.safetensors  one rank's segment of snapshot k
    m-<model>/at/<h[:2]>/<h>.json                      an alias: prefix hash h
    m-<model>/snap/<k[:2]>/<k>.json                    snapshot k's manifest, written last
    m-<model>/used/<k[:2]>/<k>.json                    snapshot k's use record (its time)

``<model>`` is the model identity's digest, ``k`` a snapshot key (the prefix
hash at its end, which names the whole prefix: identity, request scope and
every token), ``d`` the segment digest (xxh3_128 of its header, which holds
the digest of every chunk) and ``h`` the prefix hash at a stride boundary or a
breakpoint.  Every key is made of digests and integers, so two hosts that
upload the same prefix write the same keys, and an object under a key has
only one possible content: a segment's key names its bytes, and a manifest
or alias holds nothing that differs between hosts (no time, no host name).
The one exception is an alias, which names *a* snapshot holding its prefix:
the first upload's (an uploader never replaces one), any of them being right.

Everything here is pure: keys, the objects' bytes, and their strict parsers
(a reader trusts nothing it fetched until it parsed and verified it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparkcache.backends.keys import validate_key
from sparkcache.errors import InvalidArgument
from sparkcache.identity import RequestScope, canonical_json

__all__ = [
    "ALIAS_FORMAT",
    "MANIFEST_FORMAT",
    "MAX_JSON_BYTES",
    "TIER_FILE",
    "TIER_FORMAT",
    "TIER_VERSION",
    "USED_FORMAT",
    "Alias",
    "Manifest",
    "SegmentEntry",
    "TierInfo",
    "alias_blocks",
    "alias_bytes",
    "alias_key",
    "manifest_bytes",
    "manifest_key",
    "model_key",
    "model_prefix",
    "parse_alias",
    "parse_manifest",
    "parse_tier",
    "segment_key",
    "tier_bytes",
    "used_bytes",
    "used_key",
    "written_by_newer",
]

TIER_FILE = "tier.json"
TIER_FORMAT = "sparkcache-shared"
#: The layout's version: a reader refuses a tier of a newer one.
TIER_VERSION = 1
MANIFEST_FORMAT = "sparkcache-shared-snapshot"
ALIAS_FORMAT = "sparkcache-shared-alias"
USED_FORMAT = "sparkcache-shared-used"
#: A tier.json, manifest or alias larger than this is refused before it is read.
MAX_JSON_BYTES = 4 << 20
_HEX32 = re.compile(r"[0-9a-f]{32}")


def _hex(name: str, value: str) -> str:
    if not isinstance(value, str) or not _HEX32.fullmatch(value):
        raise InvalidArgument(f"{name} must be 32 lower-case hex digits, got {value!r}")
    return value


# -- keys -------------------------------------------------------------------------------


def model_prefix(model: str) -> str:
    """The folder of one model's objects: ``m-<model digest>``."""
    return f"m-{_hex('model digest', model)}"


def model_key(model: str) -> str:
    return f"{model_prefix(model)}/model.json"


def segment_key(model: str, snap_key: str, rank: int, digest: str) -> str:
    """One rank's segment of snapshot ``snap_key``; ``digest`` (its segment
    digest) makes the key name the bytes: other bytes, another key."""
    _hex("snapshot key", snap_key)
    _hex("segment digest", digest)
    return validate_key(
        f"{model_prefix(model)}/seg/{snap_key[:2]}/{snap_key}.r{int(rank)}.{digest}.safetensors")


def manifest_key(model: str, snap_key: str) -> str:
    """Snapshot ``snap_key``'s manifest: the snapshot is in the tier iff it exists."""
    _hex("snapshot key", snap_key)
    return f"{model_prefix(model)}/snap/{snap_key[:2]}/{snap_key}.json"


def alias_key(model: str, prefix_hash: str) -> str:
    """The alias of prefix hash ``prefix_hash`` (hex)."""
    _hex("prefix hash", prefix_hash)
    return f"{model_prefix(model)}/at/{prefix_hash[:2]}/{prefix_hash}.json"


def used_key(model: str, snap_key: str) -> str:
    """Snapshot ``snap_key``'s use record: rewritten by whoever uses the snapshot
    in the tier, its last-modified time is the snapshot's last use there (the
    manifest holds no time, so that every host writes the same bytes)."""
    _hex("snapshot key", snap_key)
    return f"{model_prefix(model)}/used/{snap_key[:2]}/{snap_key}.json"


def used_bytes(snap_key: str) -> bytes:
    """A use record's bytes: the same every time (its time is the object's own)."""
    return canonical_json({"format": USED_FORMAT, "snapshot": _hex("snapshot key",
                                                                   snap_key)}).encode()


def alias_blocks(start_blocks: int, n_blocks: int, stride_blocks: int,
                 breakpoints: Sequence[int] = ()) -> list[int]:
    """The block indices ``i`` (boundary ``(i + 1) * block_size``) whose prefix
    hashes get an alias when a link holding blocks ``[start_blocks, n_blocks)``
    is uploaded: every stride boundary in that range, its end included when it
    falls on one (so a stride probe finds it), and the breakpoints (``(i + 1)``
    in ``breakpoints``, in blocks) in it.  The parent's upload marked the ones below."""
    stride = max(1, stride_blocks)
    found = {i for i in range(stride - 1, n_blocks, stride) if i >= start_blocks}
    found |= {b - 1 for b in breakpoints if start_blocks < b <= n_blocks}
    return sorted(found)


# -- tier.json --------------------------------------------------------------------------


@dataclass(frozen=True)
class TierInfo:
    """What ``tier.json`` says: every host uses the tier's own alias stride."""

    alias_stride: int
    version: int = TIER_VERSION


def tier_bytes(alias_stride: int) -> bytes:
    return canonical_json({"format": TIER_FORMAT, "version": TIER_VERSION,
                           "alias_stride": alias_stride}).encode()


def _load(raw: bytes, what: str) -> dict[str, Any]:
    if len(raw) > MAX_JSON_BYTES:
        raise InvalidArgument(f"{what} is {len(raw)} bytes, more than {MAX_JSON_BYTES}")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidArgument(f"{what} is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument(f"{what} is not a JSON object")
    return doc


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def parse_tier(raw: bytes, where: str) -> TierInfo:
    """``tier.json``, strictly; InvalidArgument naming ``where`` otherwise."""
    doc = _load(raw, f"{where}/{TIER_FILE}")
    if doc.get("format") != TIER_FORMAT:
        raise InvalidArgument(f"{where} holds a {TIER_FILE} that is not a sparkcache shared "
                              "tier's; give the tier a prefix of its own")
    version, stride = doc.get("version", 0), doc.get("alias_stride", 0)
    if not _is_int(version, 1) or version > TIER_VERSION:
        raise InvalidArgument(f"the shared tier {where} has layout version {version!r}; this "
                              f"sparkcache reads up to {TIER_VERSION}: upgrade sparkcache")
    if not _is_int(stride, 1):
        raise InvalidArgument(f"{where}/{TIER_FILE}: alias_stride {stride!r} is not a positive "
                              "integer; give the tier a new prefix")
    return TierInfo(alias_stride=stride, version=version)


# -- aliases ----------------------------------------------------------------------


@dataclass(frozen=True)
class Alias:
    """An alias: the prefix of ``n_tokens`` tokens hashing to ``prefix`` is held by
    the snapshot ``snapshot`` (a key) of ``snapshot_tokens`` tokens."""

    prefix: str
    n_tokens: int
    snapshot: str
    snapshot_tokens: int


def alias_bytes(alias: Alias) -> bytes:
    return canonical_json({"format": ALIAS_FORMAT, "prefix": alias.prefix,
                           "n_tokens": alias.n_tokens, "snapshot": alias.snapshot,
                           "snapshot_tokens": alias.snapshot_tokens}).encode()


def parse_alias(raw: bytes, prefix: str) -> Alias:
    """An alias fetched from ``alias_key(model, prefix)``, strictly."""
    doc = _load(raw, f"alias {prefix}")
    fields = {"format", "prefix", "n_tokens", "snapshot", "snapshot_tokens"}
    if set(doc) != fields or doc["format"] != ALIAS_FORMAT or doc["prefix"] != prefix:
        raise InvalidArgument(f"alias {prefix} is not a sparkcache alias of that prefix")
    n, snap, total = doc["n_tokens"], doc["snapshot"], doc["snapshot_tokens"]
    if not (_is_int(n, 1) and _is_int(total, 1) and n <= total):
        raise InvalidArgument(f"alias {prefix}: token counts {n!r} and {total!r} are bad")
    return Alias(prefix, n, _hex("alias snapshot", snap), total)


# -- manifests --------------------------------------------------------------------------


@dataclass(frozen=True)
class SegmentEntry:
    """One rank's segment as a manifest names it."""

    rank: int
    key: str
    nbytes: int
    digest: str
    token_start: int
    token_end: int


@dataclass(frozen=True)
class Manifest:
    """A snapshot in the tier: written after all of its segments and aliases.

    ``parent`` is the key of the snapshot holding tokens ``[0, start_token)``
    (None for a root, ``start_token`` 0): the chain is expressed in prefix
    hashes, so it dedups across hosts.  ``aliases`` are the ``(n_tokens,
    prefix hash)`` of the aliases its upload wrote or found (for the sweep).
    """

    model: str
    snap_key: str
    n_tokens: int
    start_token: int
    parent: str | None
    scope: RequestScope
    breakpoints: tuple[int, ...]
    world_size: int
    segments: tuple[SegmentEntry, ...]
    aliases: tuple[tuple[int, str], ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


def manifest_bytes(m: Manifest) -> bytes:
    """The manifest's canonical JSON: the same bytes on every host for the same
    snapshot and the same segment bytes."""
    return canonical_json({
        "format": MANIFEST_FORMAT, "version": TIER_VERSION, "model": m.model,
        "snap_key": m.snap_key, "n_tokens": m.n_tokens, "start_token": m.start_token,
        "parent": m.parent, "scope": json.loads(m.scope.canonical()),
        "breakpoints": list(m.breakpoints), "world_size": m.world_size,
        "segments": [{"rank": s.rank, "key": s.key, "nbytes": s.nbytes, "digest": s.digest,
                      "token_start": s.token_start, "token_end": s.token_end}
                     for s in m.segments],
        "aliases": [[n, h] for n, h in m.aliases],
    }).encode()


def written_by_newer(raw: bytes) -> bool:
    """Whether ``raw`` is a manifest of a layout newer than this sparkcache reads
    (its ``format`` ours, its ``version`` above :data:`TIER_VERSION`): one that
    :func:`parse_manifest` refuses, and that a sweep must keep, not delete."""
    try:
        doc = _load(raw, "manifest")
    except InvalidArgument:
        return False
    version = doc.get("version", 0)
    return doc.get("format") == MANIFEST_FORMAT and _is_int(version, TIER_VERSION + 1)


_MANIFEST_FIELDS = {"format", "version", "model", "snap_key", "n_tokens", "start_token",
                    "parent", "scope", "breakpoints", "world_size", "segments", "aliases"}
_SEGMENT_FIELDS = {"rank", "key", "nbytes", "digest", "token_start", "token_end"}


def parse_manifest(raw: bytes, model: str, snap_key: str) -> Manifest:
    """The manifest fetched from ``manifest_key(model, snap_key)``, every field
    checked (InvalidArgument otherwise): it must be that snapshot's, its ranks
    0..world_size-1 each with the segment key its digest names.  The segments'
    bytes are verified when they are read."""
    what = f"manifest {snap_key}"

    def need(ok: bool, why: str) -> None:
        if not ok:
            raise InvalidArgument(f"{what} is invalid: {why}")

    doc = _load(raw, what)
    need(set(doc) == _MANIFEST_FIELDS and doc["format"] == MANIFEST_FORMAT,
         f"it must be a {MANIFEST_FORMAT} with exactly the fields {sorted(_MANIFEST_FIELDS)}")
    need(_is_int(doc["version"], 1) and doc["version"] <= TIER_VERSION,
         f"version {doc['version']!r} (a newer sparkcache wrote it? upgrade sparkcache)")
    need(doc["model"] == model and doc["snap_key"] == snap_key, "it names another snapshot")
    n, start, world = doc["n_tokens"], doc["start_token"], doc["world_size"]
    need(_is_int(n, 1) and _is_int(start) and start < n and _is_int(world, 1),
         "token range or world size")
    parent = doc["parent"]
    need((parent is None) == (start == 0)
         and (parent is None or (isinstance(parent, str) and bool(_HEX32.fullmatch(parent)))),
         "a parent is named exactly when the snapshot starts after token 0")
    try:
        scope = RequestScope.from_dict(doc["scope"])
    except InvalidArgument as exc:
        raise InvalidArgument(f"{what} is invalid: scope: {exc}") from None
    marks = doc["breakpoints"]
    need(isinstance(marks, list) and all(_is_int(b, 1) and b < n for b in marks)
         and marks == sorted(set(marks)), "breakpoints")
    segs = doc["segments"]
    need(isinstance(segs, list) and len(segs) == world
         and all(isinstance(g, dict) and set(g) == _SEGMENT_FIELDS for g in segs),
         f"segments must list ranks 0..{world - 1} with the fields {sorted(_SEGMENT_FIELDS)}")
    entries = []
    for rank, g in enumerate(segs):
        need(g["rank"] == rank and (g["token_start"], g["token_end"]) == (start, n)
             and _is_int(g["nbytes"], 1) and isinstance(g["digest"], str)
             and bool(_HEX32.fullmatch(g["digest"]))
             and g["key"] == segment_key(model, snap_key, rank, g["digest"]),
             f"segment of rank {rank}")
        entries.append(SegmentEntry(rank, g["key"], g["nbytes"], g["digest"], start, n))
    aliases = doc["aliases"]
    need(isinstance(aliases, list) and all(
        isinstance(a, list) and len(a) == 2 and _is_int(a[0], 1) and a[0] <= n
        and isinstance(a[1], str) and bool(_HEX32.fullmatch(a[1])) for a in aliases),
        "aliases")
    return Manifest(model, snap_key, n, start, parent, scope, tuple(marks), world,
                    tuple(entries), tuple((a[0], a[1]) for a in aliases))
