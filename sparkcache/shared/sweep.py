"""The shared tier's sweep: per-model budget and age in the tier, run by one host at a time.

The tier's catalogue is its manifests (one listing of the tier and a GET of
each manifest not seen before: the sweep is periodic, never per request).  A
snapshot's *last use* is the newer of its manifest's last-modified time (its
upload) and its use record's (``used/<k>.json``, rewritten by :func:`mark_used`
whenever a host fetches the snapshot from the tier or finds it there when it
uploads it): the manifests themselves hold no time, so that every host writes
the same bytes.  Times are the object store's own clock.

One pass (:func:`sweep_tier`), per model, plans (:func:`plan_model`, pure) and
then deletes in the order that keeps every visible snapshot whole:

1. snapshots that are not whole go first: a manifest whose segments are
   missing (``broken``), one whose parent's manifest is gone (``orphan``,
   with every descendant), an object under a manifest key that does not
   parse (``invalid``; one larger than a manifest may be is not read);
   a manifest of a newer layout (``"version"`` above this sparkcache's) is
   kept unread, and so is what it may name (its model's age and budget wait
   for a sweep by a sparkcache that reads it);
2. ``age``: leaves (no child manifest) unused for ``max_age_hours``, least
   recently used first; a parent whose children all went is a leaf in the
   same pass, so a parent a kept child needs never goes;
3. ``budget``: leaves, least recently used first, until the model's
   manifests name at most ``mb`` megabytes.

Execution: the aliases that a deleted and a kept snapshot share are rewritten
to name the kept one (any snapshot that holds a prefix may be named); then
the manifests are deleted, children before parents (a crash leaves no child
whose parent is gone); then their segments, aliases and use records, and the
garbage no manifest names (segments of an upload that died, another host's
copy that lost the race, stale temp objects) once it is older than
``grace_seconds``, the longest an upload may take between its first segment
and its manifest.  A reader that loses the race with a deletion finds a
manifest gone or a segment missing: a clean miss.

Arbitration: a pass holds the tier's :class:`~sparkcache.shared.lease.SweepLease`
(S3 conditional writes, or a lock on a ``file://`` tier), so one host sweeps
at a time, and the lease records when the last sweep finished, so a fleet
whose every host runs the periodic :class:`SharedSweeper` sweeps about once
per period.

A host never uploads a snapshot again once it reached the tier
(``uploaded_at``), so what the sweep deletes stays deleted: sweeping and
uploading cannot chase each other in a loop.  Only a new publish brings a
deleted snapshot back: computed anew, or the parent of a new child (the
uploader sends a swept parent again before its child).
"""

from __future__ import annotations

import heapq
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sparkcache.backends import ObjectStat
from sparkcache.errors import InvalidArgument
from sparkcache.periodic import Periodic
from sparkcache.shared.catalogue import Catalogue, ManifestCache, read_catalogue
from sparkcache.shared.layout import (
    Alias,
    Manifest,
    alias_bytes,
    alias_key,
    used_bytes,
    used_key,
)
from sparkcache.shared.lease import SweepLease
from sparkcache.shared.tier import SharedTier, describe_error

__all__ = [
    "ModelPlan",
    "SharedSweeper",
    "TierLimits",
    "TierSweepReport",
    "mark_used",
    "plan_model",
    "read_catalogue",
    "sweep_tier",
]

log = logging.getLogger(__name__)

MB = 1_000_000
#: Environment variables of the tier's limits (docs/shared.md).
SHARED_MB_ENV = "SPARK_KV_CACHE_SHARED_MB"
SHARED_MAX_AGE_ENV = "SPARK_KV_CACHE_SHARED_MAX_AGE_HOURS"
LOCAL_MAX_AGE_ENV = "SPARK_KV_CACHE_MAX_AGE_HOURS"
SHARED_SWEEP_SECONDS_ENV = "SPARK_KV_CACHE_SHARED_SWEEP_SECONDS"
#: Manifests or objects deleted between two renewals of the lease.
DELETE_CHUNK = 500

# -- settings ------------------------------------------------------------------------------


def _env_number(env: Mapping[str, str], name: str, kind: type, minimum: float,
                hint: str) -> Any:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        value = kind(raw.strip())
    except ValueError:
        raise InvalidArgument(f"{name}={raw!r} is not valid: {hint}") from None
    if value < minimum:
        raise InvalidArgument(f"{name}={raw!r} is out of range: {hint}")
    return value


@dataclass(frozen=True)
class TierLimits:
    """The shared tier's limits, per model (docs/shared.md, "The sweep").

    ``mb``: the most a model's snapshots may take in the tier, in decimal
    megabytes (``SPARK_KV_CACHE_SHARED_MB``; 0, the default, is no budget: a
    tier is usually far larger than a host's disk, so its budget is the
    fleet's to choose).  ``max_age_hours``: a snapshot unused in the tier this
    long goes (``SPARK_KV_CACHE_SHARED_MAX_AGE_HOURS``, else the local
    ``SPARK_KV_CACHE_MAX_AGE_HOURS``, else 168; 0 keeps).  ``sweep_seconds``:
    how often the fleet sweeps (``SPARK_KV_CACHE_SHARED_SWEEP_SECONDS``,
    3600).  ``grace_seconds``: how old an object no manifest names must be
    before it is garbage (an upload in flight writes its segments before its
    manifest).  ``lease_seconds``: how long the sweep lease holds between
    renewals (a sweeping host that dies blocks others this long at most).
    """

    mb: float = 0.0
    max_age_hours: float = 168.0
    sweep_seconds: float = 3600.0
    grace_seconds: float = 7200.0
    lease_seconds: float = 600.0

    def __post_init__(self) -> None:
        for name, ok in (("mb", self.mb >= 0), ("max_age_hours", self.max_age_hours >= 0),
                         ("sweep_seconds", self.sweep_seconds > 0),
                         ("grace_seconds", self.grace_seconds >= 0),
                         ("lease_seconds", self.lease_seconds > 0)):
            if not ok:
                raise InvalidArgument(f"the shared tier's {name}={getattr(self, name)!r} is "
                                      "out of range (megabytes and hours >= 0, seconds > 0)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> TierLimits:
        """Read the ``SPARK_KV_CACHE_SHARED_*`` limits; ``overrides`` (not None) win."""
        env = os.environ if env is None else env
        found = {
            "mb": _env_number(env, SHARED_MB_ENV, float, 0,
                              "megabytes per model (decimal); 0 = no budget"),
            "max_age_hours": _env_number(env, SHARED_MAX_AGE_ENV, float, 0,
                                         "hours >= 0; 0 keeps snapshots"),
            "sweep_seconds": _env_number(env, SHARED_SWEEP_SECONDS_ENV, float, 1e-3,
                                         "a number of seconds > 0"),
        }
        if found["max_age_hours"] is None:
            found["max_age_hours"] = _env_number(env, LOCAL_MAX_AGE_ENV, float, 0,
                                                 "hours >= 0; 0 keeps snapshots")
        found.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**{k: v for k, v in found.items() if v is not None})


# -- the use record ------------------------------------------------------------------------


def mark_used(tier: SharedTier, model: str, snap_key: str) -> None:
    """Record that snapshot ``snap_key`` of ``model`` was used from the tier now
    (a fetch, or an upload that found it there): its age restarts.  One small
    PUT; a use record never makes anything visible, and one left without its
    manifest is garbage the sweep reclaims."""
    tier.put(used_key(model, snap_key), [used_bytes(snap_key)])


# -- the plan ------------------------------------------------------------------------------


@dataclass
class ModelPlan:
    """What one sweep does to one model's objects (see the module doc)."""

    model: str
    deleted: dict[str, str] = field(default_factory=dict)  # snap key -> reason
    generations: list[list[str]] = field(default_factory=list)  # manifest keys, leaves first
    rewrite: dict[str, Alias] = field(default_factory=dict)  # alias key -> new content
    garbage: list[str] = field(default_factory=list)  # deleted after the manifests
    kept: int = 0
    kept_bytes: int = 0
    freed_bytes: int = 0


def _children(m: Mapping[str, Manifest]) -> dict[str, list[str]]:
    """Each manifest's children by key (the manifests naming it as their parent)."""
    children: dict[str, list[str]] = defaultdict(list)
    for k, man in m.items():
        if man.parent is not None:
            children[man.parent].append(k)
    return children


def _drop_not_whole(cat: Catalogue, children: Mapping[str, list[str]], plan: ModelPlan) -> None:
    """Plan away what is not whole, with every descendant: a manifest whose
    segments are missing or of another size (``broken``), one whose parent's
    manifest is gone (``orphan``; a parent a newer sparkcache wrote is there)."""
    def drop(key: str, why: str) -> None:
        stack = [(key, why)]
        while stack:
            k, w = stack.pop()
            if k not in plan.deleted:
                plan.deleted[k] = w
                stack.extend((c, "orphan") for c in children.get(k, ()))

    for k, man in cat.manifests.items():
        if any((obj := cat.segments.get(g.key)) is None or obj.size != g.nbytes
               for g in man.segments):
            drop(k, "broken")
        elif man.parent is not None and man.parent not in cat.manifests \
                and man.parent not in cat.newer:
            drop(k, "orphan")


def _evict_leaves(cat: Catalogue, children: Mapping[str, list[str]], limits: TierLimits,
                  now: float, plan: ModelPlan) -> set[str]:
    """Plan away ``age`` then ``budget`` leaves, least recently used first (a
    parent whose children all went is a leaf then); the snapshots kept.  None
    in a model holding a newer sparkcache's manifests: a snapshot that looks
    like a leaf here may be the parent of one of them."""
    m = cat.manifests
    live = set(m) - set(plan.deleted)
    live_children = {k: sum(c in live for c in children.get(k, ())) for k in live}
    last = {k: cat.last_used(k) for k in live}
    total = sum(m[k].nbytes for k in live)

    def evict(why: str, more: Callable[[float], bool]) -> None:
        nonlocal total
        heap = [(last[k], k) for k in live if live_children[k] == 0]
        heapq.heapify(heap)
        while heap and more(heap[0][0]):
            _t, k = heapq.heappop(heap)
            live.discard(k)
            plan.deleted[k] = why
            total -= m[k].nbytes
            parent = m[k].parent
            if parent in live:
                live_children[parent] -= 1
                if live_children[parent] == 0:
                    heapq.heappush(heap, (last[parent], parent))

    if limits.max_age_hours > 0 and not cat.newer:
        cutoff = now - limits.max_age_hours * 3600
        evict("age", lambda t: t < cutoff)
    if limits.mb > 0 and not cat.newer:
        evict("budget", lambda _t: total > limits.mb * MB)
    plan.kept, plan.kept_bytes = len(live), total
    return live


def _generations(cat: Catalogue, children: Mapping[str, list[str]], plan: ModelPlan) -> None:
    """The deleted manifests in batches, children before parents (generation =
    height among the deleted), the invalid objects with the leaves."""
    height: dict[str, int] = {}

    def height_of(k: str) -> int:
        if k not in height:
            below = [height_of(c) + 1 for c in children.get(k, ()) if c in plan.deleted]
            height[k] = max(below, default=0)
        return height[k]

    gens: dict[int, list[str]] = defaultdict(list)
    for k in sorted(plan.deleted):
        gens[height_of(k)].append(cat.manifest_objects[k].key)
        plan.freed_bytes += cat.manifest_objects[k].size
    if cat.invalid:
        gens[0].extend(obj.key for obj in cat.invalid)
        plan.freed_bytes += sum(obj.size for obj in cat.invalid)
    plan.generations = [gens[h] for h in sorted(gens)]


def _seg_owner(key: str) -> str:
    """The snapshot key in a segment's object key (``.../seg/<k[:2]>/<k>.r...``)."""
    return key.rsplit("/", 1)[-1].split(".", 1)[0]


def _plan_aliases(cat: Catalogue, live: set[str], old: float, plan: ModelPlan,
                  ) -> list[ObjectStat]:
    """Aliases a deleted and a kept snapshot both list: renamed to the kept one
    (the longest); the garbage ones: listed by deleted snapshots only, or by
    none and old (kept while a newer sparkcache's manifests may list them)."""
    m = cat.manifests
    listers: dict[str, list[str]] = defaultdict(list)
    for k, man in m.items():
        for _n, h in man.aliases:
            listers[alias_key(cat.model, h)].append(k)
    garbage = []
    for key, obj in cat.aliases.items():
        kept = [k for k in listers.get(key, ()) if k in live]
        gone = any(k in plan.deleted for k in listers.get(key, ()))
        if kept and gone:  # name a snapshot that stays
            best = max(kept, key=lambda k: (m[k].n_tokens, k))
            prefix = key.rsplit("/", 1)[-1].removesuffix(".json")
            n = next(n for n, h in m[best].aliases if h == prefix)
            plan.rewrite[key] = Alias(prefix, n, best, m[best].n_tokens)
        elif not kept and (gone or (obj.mtime < old and not cat.newer)):
            garbage.append(obj)
    return garbage


def _plan_garbage(cat: Catalogue, live: set[str], limits: TierLimits, now: float,
                  plan: ModelPlan) -> None:
    """What goes after the manifests: what the deleted ones named, and what no
    manifest names once older than the grace (never what a newer sparkcache's
    manifest may name)."""
    m, old = cat.manifests, now - limits.grace_seconds
    garbage: list[ObjectStat] = []
    named = {g.key: k for k, man in m.items() for g in man.segments}
    for key, obj in cat.segments.items():
        owner = named.get(key)
        if owner is None:
            if obj.mtime < old and _seg_owner(key) not in cat.newer:
                garbage.append(obj)
        elif owner in plan.deleted:
            garbage.append(obj)
    garbage += _plan_aliases(cat, live, old, plan)
    for k, obj in cat.used.items():
        if k in plan.deleted or (k not in m and k not in cat.newer and obj.mtime < old):
            garbage.append(obj)
    garbage += [obj for obj in cat.temps if obj.mtime < old]
    plan.garbage = [obj.key for obj in garbage]
    plan.freed_bytes += sum(obj.size for obj in garbage)


def plan_model(cat: Catalogue, limits: TierLimits, now: float) -> ModelPlan:
    """Decide what goes (pure: reads ``cat`` only).  Every set of snapshots it
    deletes holds the descendants of each of them that ``cat`` lists; what a
    newer sparkcache wrote is never planned away."""
    plan = ModelPlan(cat.model)
    children = _children(cat.manifests)
    _drop_not_whole(cat, children, plan)
    live = _evict_leaves(cat, children, limits, now, plan)
    _generations(cat, children, plan)
    _plan_garbage(cat, live, limits, now, plan)
    return plan


# -- one pass ------------------------------------------------------------------------------


@dataclass
class TierSweepReport:
    """What one sweep of a tier did (or, ``dry_run``, would do)."""

    url: str
    dry_run: bool = False
    swept: bool = False  # False: skipped (``skipped`` says why)
    skipped: str | None = None
    manifests: int = 0  # in the catalogue
    deleted: dict[str, list[str]] = field(default_factory=dict)  # reason -> model/key
    objects_deleted: int = 0
    aliases_rewritten: int = 0
    bytes_freed: int = 0
    kept: int = 0
    kept_bytes: int = 0
    newer: int = 0  # manifests a newer sparkcache wrote: kept, unread
    seconds: float = 0.0

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.deleted.values())

    def counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in sorted(self.deleted.items())}


def sweep_tier(tier: SharedTier, limits: TierLimits | None = None, *, dry_run: bool = False,
               clock: Callable[[], float] = time.time, min_interval: float = 0.0,
               cache: ManifestCache | None = None) -> TierSweepReport:
    """One pass over the whole tier (see the module doc); ``dry_run`` plans and
    deletes nothing (and takes no lease).  A host holding the lease makes this
    a skip (``swept`` False, ``skipped`` why), as does ``min_interval`` after a
    recent sweep.  Raises SparkCacheError when the tier fails: what was deleted
    so far leaves every visible snapshot whole, and the next pass goes on."""
    limits = limits or TierLimits.from_env()
    report = TierSweepReport(tier.url, dry_run=dry_run)
    started = time.monotonic()
    lease = None
    if not dry_run:
        lease, why = SweepLease.take(tier, seconds=limits.lease_seconds, clock=clock,
                                     min_interval=min_interval)
        if lease is None:
            report.skipped = why
            return report
    finished = False
    try:
        catalogue = read_catalogue(tier, cache)
        now = clock()
        plans = [plan_model(catalogue[model], limits, now) for model in sorted(catalogue)]
        for model, plan in zip(sorted(catalogue), plans, strict=True):
            report.manifests += len(catalogue[model].manifests) + len(catalogue[model].invalid)
            report.kept += plan.kept
            report.kept_bytes += plan.kept_bytes
            report.newer += len(catalogue[model].newer)
            for k, why in sorted(plan.deleted.items()):
                report.deleted.setdefault(why, []).append(f"{model}/{k}")
            if catalogue[model].invalid:
                report.deleted.setdefault("invalid", []).extend(
                    obj.key for obj in catalogue[model].invalid)
            if not dry_run:
                assert lease is not None
                _apply(tier, plan, lease, report)
            report.bytes_freed += plan.freed_bytes
            if dry_run:
                report.aliases_rewritten += len(plan.rewrite)
                report.objects_deleted += sum(map(len, plan.generations)) + len(plan.garbage)
        finished = True
    finally:
        if lease is not None:
            lease.release(finished)
    report.swept = True
    report.seconds = time.monotonic() - started
    if report.count or report.objects_deleted:
        log.info("sparkcache: swept the shared tier %s: %s, %d objects, %.1f MB freed",
                 tier.url, report.counts(), report.objects_deleted, report.bytes_freed / MB)
    return report


def _chunks(keys: list[str]) -> Iterable[list[str]]:
    for i in range(0, len(keys), DELETE_CHUNK):
        yield keys[i:i + DELETE_CHUNK]


def _apply(tier: SharedTier, plan: ModelPlan, lease: SweepLease,
           report: TierSweepReport) -> None:
    """Carry out one model's plan in the order of the module doc, renewing the
    lease before every batch."""
    if plan.rewrite:
        lease.renew()
        for key, alias in sorted(plan.rewrite.items()):
            tier.put(key, [alias_bytes(alias)])
            report.aliases_rewritten += 1
    for generation in plan.generations:
        for chunk in _chunks(generation):
            lease.renew()
            tier.backend.delete_many(chunk)
            report.objects_deleted += len(chunk)
    for chunk in _chunks(plan.garbage):
        lease.renew()
        tier.backend.delete_many(chunk)
        report.objects_deleted += len(chunk)


# -- the periodic sweeper ------------------------------------------------------------------


class SharedSweeper:
    """Sweeps the tier every ``limits.sweep_seconds`` on a daemon thread (a
    :class:`~sparkcache.periodic.Periodic`), the first pass at once.

    Every host of a fleet may run one (the connector's scheduler does with
    ``shared_sweep``): each pass takes the lease only when no host holds it and
    the last sweep finished at least ``sweep_seconds`` ago, so the fleet sweeps
    about once per period.  Parsed manifests are kept between passes.  Errors
    are logged once per burst and counted in :attr:`failures`, never raised
    into the serving process.
    """

    def __init__(self, tier: SharedTier, limits: TierLimits | None = None) -> None:
        self.tier = tier
        self.limits = limits or TierLimits.from_env()
        self._cache: ManifestCache = {}
        self._burst = 0  # failures since the last pass that worked
        self.last_report: TierSweepReport | None = None
        self._periodic = Periodic(self._pass, lambda: self.limits.sweep_seconds,
                                  name="sparkcache-shared-sweeper", on_error=self._failed)

    def start(self) -> SharedSweeper:
        self._periodic.start()
        return self

    def _pass(self) -> None:
        self.last_report = sweep_tier(self.tier, self.limits, cache=self._cache,
                                      min_interval=self.limits.sweep_seconds)
        if self._burst:
            log.info("sparkcache: sweeping the shared tier %s works again", self.tier.url)
        self._burst = 0

    def _failed(self, exc: Exception) -> None:
        self._burst += 1
        if self._burst == 1:
            log.warning("sparkcache: sweeping the shared tier %s failed: %s (retried "
                        "every %.0f s; not logged again until it works)",
                        self.tier.url, describe_error(exc), self.limits.sweep_seconds)

    def wait(self, passes: int, timeout: float | None = None) -> bool:
        """Block until ``passes`` passes have finished (True) or ``timeout`` ran out."""
        return self._periodic.wait(passes, timeout)

    def stop(self, timeout: float | None = 30.0) -> None:
        self._periodic.stop(timeout)

    @property
    def passes(self) -> int:
        return self._periodic.passes

    @property
    def failures(self) -> int:
        return self._periodic.failures

    @property
    def last_error(self) -> BaseException | None:
        return self._periodic.last_error

    @property
    def running(self) -> bool:
        return self._periodic.running
