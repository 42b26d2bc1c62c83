"""Retention: Spark's snapshot limits, trim on save, and the sweeper.

The settings and their defaults are Spark's (``SPARK_KV_CACHE_*``, tabled in
docs/retention.md); users who know them get exactly that behaviour:

* a publish trims its own model: the per-model budget (MB) and entry count,
  least recently used first; shorter contexts than MIN_TOKENS are not stored;
  below the free-disk margin nothing new is saved;
* the sweeper handles the rest, across models: folders of deleted models, age,
  the disk margin (least recently used of every model first) and the total;
* both apply the per-tenant limits (TENANT_ENTRIES, TENANT_MB) to each tenant
  of a model separately, within the model's (:mod:`sparkcache.tenants`).

Leased and pinned snapshots never go, and a copy-on-write parent goes only
after its children.  Free space is measured on the medium that holds the
payloads (the backend's ``disk_usage``), which is not the root's disk when the
store's ``storage`` points elsewhere; a backend that cannot say (object
stores) has no disk margin and an auto budget of a quarter of RAM.  The
clock, the disk-usage source and the RAM size are injectable so that every
limit is testable.  :class:`Retention` is the store's
:class:`~sparkcache.core.PublishPolicy`; every function here takes the narrow
:class:`~sparkcache.core.Core`.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sparkcache.backends import Backend, DiskUsage
from sparkcache.core import Core
from sparkcache.errors import InvalidArgument
from sparkcache.folder import resolve_folder
from sparkcache.maintenance import (
    budget_group,
    evict_lru,
    live_identities,
    reclaim_publishes,
    remove_deleted_models,
)
from sparkcache.periodic import Periodic
from sparkcache.tenants import TenantLimits, tenants_of, trim_tenant

__all__ = [
    "DiskUsage",
    "Retention",
    "RetentionSettings",
    "SweepReport",
    "Sweeper",
]

log = logging.getLogger(__name__)

MB = 1_000_000
GB = 1_000 * MB
PREFIX = "SPARK_KV_CACHE_"
#: The disk margin's auto value: 5% of the disk, clamped to [1 GB, 10 GB].
AUTO_MIN_FREE_FRACTION = 0.05
AUTO_MIN_FREE_CLAMP = (1 * GB, 10 * GB)


DiskProbe = Callable[[Backend], DiskUsage | None]


def _disk_usage(backend: Backend) -> DiskUsage | None:
    return backend.disk_usage()


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _parse(env: Mapping[str, str], name: str, kind: type, *, auto: bool = False,
           minimum: float | None = None, hint: str) -> Any:
    var = PREFIX + name
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return ...
    text = raw.strip().lower()
    if auto and text == "auto":
        return None
    try:
        value = kind(text)
    except ValueError:
        raise InvalidArgument(f"{var}={raw!r} is not valid: {hint}") from None
    if minimum is not None and value < minimum:
        raise InvalidArgument(f"{var}={raw!r} is out of range: {hint}")
    return value


@dataclass(frozen=True)
class RetentionSettings:
    """Spark's retention settings.  ``None`` means *auto* where a setting has one.

    ======================  ========  ==========================================
    field (env var suffix)  default   meaning
    ======================  ========  ==========================================
    folder (FOLDER)         $SPARK_STORAGE/kvcache; one folder per model inside
    mb (MB)                 auto      per model: RAM/4, at most half the free
                                      disk; -1 turns snapshots off
    entries (ENTRIES)       64        snapshots kept per model
    min_tokens (MIN_TOKENS) 64        shorter contexts are not stored
    min_free_mb             auto      5% of the disk, clamped to 1-10 GB
    max_age_hours           168       unused this long -> deleted; 0 keeps
    total_mb (TOTAL_MB)     0         all models together; 0 = disk margin only
    sweep_seconds           300       how often the sweeper runs
    tenant_mb (TENANT_MB)   0         per tenant of a model; 0 = no limit
    tenant_entries          0         snapshots kept per tenant of a model; 0 =
                                      no limit
    ======================  ========  ==========================================
    """

    folder: Path = field(default_factory=resolve_folder)
    mb: int | None = None
    entries: int = 64
    min_tokens: int = 64
    min_free_mb: int | None = None
    max_age_hours: float = 168.0
    total_mb: int = 0
    sweep_seconds: float = 300.0
    tenant_mb: int = 0
    tenant_entries: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "folder", Path(self.folder).expanduser())
        checks = [
            ("mb", self.mb is None or self.mb == -1 or self.mb >= 0,
             "a number of megabytes, 'auto', or -1 to turn snapshots off"),
            ("entries", self.entries >= 1, "at least 1"),
            ("min_tokens", self.min_tokens >= 0, "0 or more tokens"),
            ("min_free_mb", self.min_free_mb is None or self.min_free_mb >= 0,
             "megabytes >= 0 or 'auto'"),
            ("max_age_hours", self.max_age_hours >= 0, "hours >= 0 (0 keeps while there is room)"),
            ("total_mb", self.total_mb >= 0, "megabytes >= 0 (0 = no limit)"),
            ("sweep_seconds", self.sweep_seconds > 0, "seconds > 0"),
            ("tenant_mb", self.tenant_mb >= 0, "megabytes >= 0 (0 = no per-tenant limit)"),
            ("tenant_entries", self.tenant_entries >= 0,
             "snapshots >= 0 (0 = no per-tenant limit)"),
        ]
        for name, ok, hint in checks:
            if not ok:
                raise InvalidArgument(
                    f"{name}={getattr(self, name)!r} is out of range "
                    f"({PREFIX}{name.upper()}): {hint}"
                )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> RetentionSettings:
        """Read ``SPARK_KV_CACHE_*`` (and ``SPARK_STORAGE``); ``overrides`` win.

        Bad values raise :class:`InvalidArgument` naming the variable.
        """
        env = os.environ if env is None else env
        found: dict[str, Any] = {
            "mb": _parse(env, "MB", int, auto=True, minimum=-1,
                         hint="an integer number of megabytes, 'auto', or -1 (off)"),
            "entries": _parse(env, "ENTRIES", int, minimum=1, hint="an integer >= 1"),
            "min_tokens": _parse(env, "MIN_TOKENS", int, minimum=0, hint="an integer >= 0"),
            "min_free_mb": _parse(env, "MIN_FREE_MB", int, auto=True, minimum=0,
                                  hint="an integer number of megabytes or 'auto'"),
            "max_age_hours": _parse(env, "MAX_AGE_HOURS", float, minimum=0,
                                    hint="hours >= 0; 0 keeps snapshots while there is room"),
            "total_mb": _parse(env, "TOTAL_MB", int, minimum=0,
                               hint="an integer number of megabytes; 0 means no limit"),
            "sweep_seconds": _parse(env, "SWEEP_SECONDS", float, minimum=1e-3,
                                    hint="a number of seconds > 0"),
            "tenant_mb": _parse(env, "TENANT_MB", int, minimum=0,
                                hint="an integer number of megabytes; 0 means no limit"),
            "tenant_entries": _parse(env, "TENANT_ENTRIES", int, minimum=0,
                                     hint="an integer number of snapshots; 0 means no limit"),
        }
        kwargs = {k: v for k, v in found.items() if v is not ...}
        kwargs["folder"] = resolve_folder(env=env)
        kwargs.update(overrides)
        return cls(**kwargs)

    @property
    def enabled(self) -> bool:
        return self.mb != -1

    @property
    def tenant_limits(self) -> TenantLimits:
        return TenantLimits(entries=self.tenant_entries, nbytes=self.tenant_mb * MB)


@dataclass
class SweepReport:
    """What one sweep (or trim) deleted, by reason."""

    evicted: dict[str, list[int]] = field(default_factory=dict)
    models_removed: list[str] = field(default_factory=list)
    folders_removed: list[str] = field(default_factory=list)

    def add(self, reason: str, ids: list[int]) -> None:
        if ids:
            self.evicted.setdefault(reason, []).extend(ids)

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.evicted.values())

    def counts(self) -> dict[str, int]:
        return dict(Counter({k: len(v) for k, v in self.evicted.items()}))


class Retention:
    """The limits applied to one store, with injectable clock, disk and RAM probes."""

    def __init__(
        self,
        settings: RetentionSettings | None = None,
        *,
        disk_usage: DiskProbe = _disk_usage,
        ram_bytes: Callable[[], int] = _ram_bytes,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.settings = settings or RetentionSettings.from_env()
        self.disk_usage = disk_usage
        self.ram_bytes = ram_bytes
        self.clock = clock

    def with_settings(self, **changes: Any) -> Retention:
        return Retention(replace(self.settings, **changes), disk_usage=self.disk_usage,
                         ram_bytes=self.ram_bytes, clock=self.clock)

    # -- derived limits ----------------------------------------------------------------

    def min_free_bytes(self, disk: DiskUsage) -> int:
        if self.settings.min_free_mb is not None:
            return self.settings.min_free_mb * MB
        lo, hi = AUTO_MIN_FREE_CLAMP
        return int(min(max(disk.total * AUTO_MIN_FREE_FRACTION, lo), hi))

    def model_budget_bytes(self, disk: DiskUsage | None, model_bytes: int) -> int:
        """MB, or auto: a quarter of RAM, at most half the disk space the cache may
        use (what is free plus what this model's snapshots already take)."""
        if self.settings.mb is not None and self.settings.mb >= 0:
            return self.settings.mb * MB
        quarter_ram = self.ram_bytes() / 4
        if disk is None:
            return int(quarter_ram)
        return int(min(quarter_ram, (disk.free + model_bytes) / 2))

    def _disk(self, core: Core) -> DiskUsage | None:
        return self.disk_usage(core.backend)

    # -- on save (the store's PublishPolicy) -------------------------------------------

    def refuse(self, core: Core, n_tokens: int, nbytes: int) -> str | None:
        """Why a publish of ``n_tokens`` (``nbytes`` on this rank) must not be saved,
        or None.  The reason is a sentence for logs and the publish result."""
        s = self.settings
        if not s.enabled:
            return f"snapshots are off ({PREFIX}MB=-1)"
        if n_tokens < s.min_tokens:
            return f"{n_tokens} tokens is shorter than {PREFIX}MIN_TOKENS={s.min_tokens}"
        disk = self._disk(core)
        if disk is None:
            return None
        margin = self.min_free_bytes(disk)
        if disk.free - nbytes < margin:
            return (f"only {disk.free // MB} MB free on the cache disk, below the "
                    f"{margin // MB} MB margin ({PREFIX}MIN_FREE_MB); nothing new is saved")
        return None

    def after_publish(self, core: Core, model_id: int, snapshot_id: int) -> SweepReport:
        """After a save: the model's entry count and budget, least recently used
        first, never the snapshot just saved.  A model's snapshots of every TP
        size count together (:func:`~sparkcache.maintenance.budget_group`)."""
        report = SweepReport()
        with core.read() as conn:
            group = budget_group(core, conn, model_id)
        count, nbytes = _usage(core, group)
        keep = (snapshot_id,)
        extra = count - self.settings.entries
        if extra > 0:
            report.add("entries", evict_lru(core, model_ids=group, count=extra, keep=keep,
                                            reason="entries"))
            count, nbytes = _usage(core, group)
        budget = self.model_budget_bytes(self._disk(core), nbytes)
        if nbytes > budget:
            report.add("budget", evict_lru(core, model_ids=group, free_bytes=nbytes - budget,
                                           count=None, keep=keep, reason="budget"))
        limits = self.settings.tenant_limits
        if limits.any:
            with core.read() as conn:
                info = core.snapshot(conn, snapshot_id)
            if info is not None and info.tenant is not None:
                for reason, ids in trim_tenant(core, group, info.tenant, limits,
                                               keep=keep).items():
                    report.add(reason, ids)
        return report

    def _sweep_tenants(self, core: Core, report: SweepReport) -> None:
        """Every tenant of every live model (a budget group at a time) within
        the per-tenant limits."""
        limits = self.settings.tenant_limits
        if not limits.any:
            return
        seen: set[int] = set()
        with core.read() as conn:
            groups = []
            for model_id, _identity in live_identities(conn):
                if model_id not in seen:
                    group = budget_group(core, conn, model_id)
                    seen.update(group)
                    groups.append((group, tenants_of(conn, group)))
        for group, tenants in groups:
            for tenant, count, nbytes in tenants:
                if count > (limits.entries or count) or nbytes > (limits.nbytes or nbytes):
                    for reason, ids in trim_tenant(core, group, tenant, limits).items():
                        report.add(reason, ids)

    # -- the sweeper -------------------------------------------------------------------

    def sweep(self, core: Core) -> SweepReport:
        """One pass: stuck publishes (:func:`~sparkcache.maintenance.reclaim_publishes`),
        deleted models' folders, age, disk margin, total.  Idempotent."""
        report = SweepReport()
        s = self.settings
        now = (self.clock or core.clock)()
        report.add("abandoned", reclaim_publishes(core).stuck_pending)
        removed_models, removed_folders = remove_deleted_models(core)
        report.models_removed.extend(removed_models)
        report.folders_removed.extend(removed_folders)
        if s.max_age_hours > 0:
            cutoff = now - s.max_age_hours * 3600
            report.add("age", _in_chunks(core, "age", lambda: {"older_than": cutoff}))

        def disk_short() -> dict[str, Any] | None:
            disk = self._disk(core)  # read again after each chunk's files went
            if disk is None:
                return None
            short = self.min_free_bytes(disk) - disk.free
            return {"free_bytes": short} if short > 0 else None

        report.add("disk", _in_chunks(core, "disk", disk_short))
        if s.total_mb > 0:
            def over_total() -> dict[str, Any] | None:
                with core.read() as conn:
                    _count, total = core.usage(conn)
                over = total - s.total_mb * MB
                return {"free_bytes": over} if over > 0 else None

            report.add("total", _in_chunks(core, "total", over_total))
        self._sweep_tenants(core, report)
        if report.count or report.folders_removed:
            log.info("sparkcache sweep: %s, folders removed: %d", report.counts(),
                     len(report.folders_removed))
        return report


#: Snapshots one sweep transaction deletes at most: publishers (other processes)
#: and lookups (this one) wait for one chunk, not for the whole sweep.
SWEEP_CHUNK = 256


def _usage(core: Core, model_ids: list[int]) -> tuple[int, int]:
    """(snapshots, bytes) of these models together."""
    count = nbytes = 0
    with core.read() as conn:
        for model_id in model_ids:
            c, n = core.usage(conn, model_id)
            count, nbytes = count + c, nbytes + n
    return count, nbytes


def _in_chunks(core: Core, reason: str,
               limit: Callable[[], dict[str, Any] | None]) -> list[int]:
    """Evict for ``reason`` in transactions of at most SWEEP_CHUNK snapshots while
    ``limit()`` gives the evict_lru arguments still needed (None: done)."""
    out: list[int] = []
    while (kwargs := limit()) is not None:
        ids = evict_lru(core, count=SWEEP_CHUNK, reason=reason, **kwargs)
        out += ids
        if len(ids) < SWEEP_CHUNK:
            break
    return out


class Sweeper:
    """Runs :meth:`Retention.sweep` every ``sweep_seconds`` on a daemon thread
    (a :class:`~sparkcache.periodic.Periodic`), the first pass at once.

    The connector and the server start one in the scheduler process, through
    :meth:`SnapshotStore.start_sweeper <sparkcache.store.SnapshotStore.start_sweeper>`.
    Errors are logged, never raised into the serving process; ``stop`` returns
    once the thread has finished its current pass (or ``timeout`` ran out).
    """

    def __init__(self, core: Core, retention: Retention) -> None:
        self.core = core
        self.retention = retention
        self.last_report: SweepReport | None = None
        self._periodic = Periodic(self._pass, lambda: self.retention.settings.sweep_seconds,
                                  name="sparkcache-sweeper", on_error=self._failed)

    def _pass(self) -> None:
        self.last_report = self.retention.sweep(self.core)

    def _failed(self, exc: Exception) -> None:
        log.warning("sparkcache sweep failed: %s", exc)

    def start(self) -> Sweeper:
        self._periodic.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        self._periodic.stop(timeout)

    def wait(self, passes: int, timeout: float | None = None) -> bool:
        """Block until ``passes`` sweeps have finished (True) or ``timeout`` ran out."""
        return self._periodic.wait(passes, timeout)

    @property
    def passes(self) -> int:
        return self._periodic.passes

    @property
    def last_error(self) -> BaseException | None:
        return self._periodic.last_error

    @property
    def running(self) -> bool:
        return self._periodic.running

    def __enter__(self) -> Sweeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
