"""The shared tier's catalogue: what a sweep lists and reads of each model.

One listing of the tier (sizes and last-modified times), every object filed
by model and kind, and a GET of every manifest not read before (a manifest
is immutable: :data:`ManifestCache` keeps the parsed ones between passes).
An object under a manifest key larger than a manifest may be is not read; a
manifest of a newer layout is filed apart (:attr:`Catalogue.newer`), so that
the sweep keeps it and what it may name.  The plan and the deletions are
:mod:`sparkcache.shared.sweep`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sparkcache.backends import ObjectStat
from sparkcache.backends.keys import is_temp_key
from sparkcache.errors import InvalidArgument
from sparkcache.shared.layout import MAX_JSON_BYTES, Manifest, parse_manifest, written_by_newer
from sparkcache.shared.tier import SharedTier

__all__ = ["NEWER", "Catalogue", "ManifestCache", "read_catalogue"]

_MODEL = re.compile(r"m-([0-9a-f]{32})")
_KINDS = {
    "snap": re.compile(r"snap/[0-9a-f]{2}/(?P<k>[0-9a-f]{32})\.json"),
    "seg": re.compile(r"seg/[0-9a-f]{2}/(?P<k>[0-9a-f]{32})\.r\d+\.[0-9a-f]{32}\.safetensors"),
    "at": re.compile(r"at/[0-9a-f]{2}/(?P<k>[0-9a-f]{32})\.json"),
    "used": re.compile(r"used/[0-9a-f]{2}/(?P<k>[0-9a-f]{32})\.json"),
}


@dataclass
class Catalogue:
    """One model's objects in the tier, classified, and its parsed manifests."""

    model: str
    manifests: dict[str, Manifest] = field(default_factory=dict)
    manifest_objects: dict[str, ObjectStat] = field(default_factory=dict)  # by snap key
    invalid: list[ObjectStat] = field(default_factory=list)  # manifests that do not parse
    #: Manifests a newer sparkcache wrote (by snap key): kept, with what they may name.
    newer: dict[str, ObjectStat] = field(default_factory=dict)
    segments: dict[str, ObjectStat] = field(default_factory=dict)  # by object key
    aliases: dict[str, ObjectStat] = field(default_factory=dict)
    used: dict[str, ObjectStat] = field(default_factory=dict)  # by snap key
    temps: list[ObjectStat] = field(default_factory=list)

    def last_used(self, snap_key: str) -> float:
        times = [self.manifest_objects[snap_key].mtime]
        if snap_key in self.used:
            times.append(self.used[snap_key].mtime)
        return max(times)


#: Parsed manifests kept between sweeps, by (key, size, last-modified): a
#: manifest is immutable once written, so a periodic sweep GETs only new ones.
#: ``None``: it does not parse; :data:`NEWER`: a newer sparkcache wrote it.
ManifestCache = dict[tuple[str, int, float], Manifest | str | None]
#: The cache's mark of a manifest that a newer sparkcache wrote.
NEWER = "newer"


def _classify(cat: Catalogue, kind: str, key: str, obj: ObjectStat,
              manifest_stats: list[tuple[Catalogue, str, ObjectStat]]) -> None:
    """File one listed object of ``cat`` under its kind."""
    if kind == "snap":
        manifest_stats.append((cat, key, obj))
    elif kind == "seg":
        cat.segments[obj.key] = obj
    elif kind == "at":
        cat.aliases[obj.key] = obj
    else:
        cat.used[key] = obj


def _list_models(tier: SharedTier) -> tuple[dict[str, Catalogue],
                                            list[tuple[Catalogue, str, ObjectStat]]]:
    """One listing of the tier: every model's objects, and its manifests' stats."""
    models: dict[str, Catalogue] = {}
    manifest_stats: list[tuple[Catalogue, str, ObjectStat]] = []
    for obj in tier.backend.stat_list():
        head, _, rest = obj.key.partition("/")
        found = _MODEL.fullmatch(head)
        if found is None or not rest:
            continue
        cat = models.setdefault(found.group(1), Catalogue(found.group(1)))
        if is_temp_key(obj.key):
            cat.temps.append(obj)
            continue
        for kind, pattern in _KINDS.items():
            match = pattern.fullmatch(rest)
            if match is not None:
                _classify(cat, kind, match.group("k"), obj, manifest_stats)
                break
    return models, manifest_stats


def _parsed(raw: bytes, model: str, snap_key: str) -> Manifest | str | None:
    """A manifest's bytes parsed; :data:`NEWER` when a newer sparkcache wrote it
    (kept: this one cannot read it), None when it is not a manifest."""
    try:
        return parse_manifest(raw, model, snap_key)
    except InvalidArgument:
        return NEWER if written_by_newer(raw) else None


def read_catalogue(tier: SharedTier, cache: ManifestCache | None = None
                   ) -> dict[str, Catalogue]:
    """Every model's catalogue: one listing of the tier, then a GET of every
    manifest not in ``cache`` (concurrent where the filesystem can).  An object
    under a manifest key larger than a manifest may be is ``invalid`` unread."""
    models, manifest_stats = _list_models(tier)
    cache = {} if cache is None else cache
    wanted = [obj.key for _cat, _k, obj in manifest_stats
              if (obj.key, obj.size, obj.mtime) not in cache and obj.size <= MAX_JSON_BYTES]
    fetched = tier.backend.get_many(wanted)
    for cat, snap_key, obj in manifest_stats:
        tag = (obj.key, obj.size, obj.mtime)
        if tag not in cache:
            raw = fetched.get(obj.key)
            if obj.size > MAX_JSON_BYTES:
                cache[tag] = None  # never read: no manifest is this large
            elif raw is None:  # deleted since the listing
                continue
            else:
                cache[tag] = _parsed(raw, cat.model, snap_key)
        manifest = cache[tag]
        if manifest is None:
            cat.invalid.append(obj)
        elif isinstance(manifest, str):
            cat.newer[snap_key] = obj
        else:
            cat.manifests[snap_key] = manifest
            cat.manifest_objects[snap_key] = obj
    live_tags = {(obj.key, obj.size, obj.mtime) for _cat, _k, obj in manifest_stats}
    for tag in [t for t in cache if t not in live_tags]:
        del cache[tag]
    return models
