"""The store's upkeep: pins, leases, deletion, eviction, checks, sweeps,
verification, and reading the hottest snapshots into the page cache.

:class:`StoreUpkeep` is the base class of :class:`~sparkcache.store.SnapshotStore`
holding these verbs, so the facade stays one API in two readable halves: the
store opens the core and serves publish, lookup and read; this half keeps what
it holds in order.  Each verb calls one helper that takes the core
(:mod:`~sparkcache.maintenance`, :mod:`~sparkcache.retention`,
:mod:`~sparkcache.verification`); the deleting ones take ``dry_run``
(:mod:`~sparkcache.rehearsal`).  The rules are in docs/architecture.md
("Leases", "Segment format and verification") and docs/retention.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, overload

from sparkcache import maintenance, reader, rehearsal, verification
from sparkcache.catalog import list_snapshots
from sparkcache.core import Core, scalar
from sparkcache.errors import InvalidArgument, NotFound
from sparkcache.holders import this_holder
from sparkcache.identity import ModelIdentity
from sparkcache.index import queries as q
from sparkcache.maintenance import CheckReport
from sparkcache.reader import Warmed
from sparkcache.rehearsal import DryRun
from sparkcache.retention import Retention, Sweeper, SweepReport
from sparkcache.verification import Progress, RequeueReport, VerifyReport

__all__ = ["Cleared", "StoreUpkeep"]

#: What :meth:`StoreUpkeep.clear_model` did: (deleted, kept because leased, kept
#: because pinned) snapshot ids.
Cleared = tuple[list[int], list[int], list[int]]


class StoreUpkeep:
    """The upkeep verbs of :class:`~sparkcache.store.SnapshotStore` (its base class)."""

    _core: Core
    _sweeper: Sweeper | None
    retention: Retention | None
    alias_stride: int

    def warm(self, identity: ModelIdentity, max_bytes: int,
             stop: Callable[[], bool] | None = None, *,
             others: Sequence[ModelIdentity] = ()) -> Warmed:
        """Read the local files of ``identity``'s most recently used snapshots,
        newest use first, into the OS page cache (an engine's start: its first
        restores then read memory, not the disk; docs/connector.md, "Engine
        start").  Nothing is verified or kept: each restore still verifies
        what it copies.

        Args:
            identity: whose snapshots (this sharding's).
            max_bytes: the most bytes read in all (a file that does not fit
                in what is left is skipped).
            stop: called between chunks; True ends the read.
            others: more identities whose snapshots are read too, all in one
                order of last use (an engine's other shardings of the same KV,
                which it restores from: :meth:`siblings`).

        Returns:
            What was read (:class:`~sparkcache.reader.Warmed`); nothing where
            the store's payloads are not files on this host.
        """
        return reader.warm(self._core, [identity, *others], max_bytes, stop)

    def quarantine(self, snapshot_id: int, reason: str) -> None:
        """Never offer this snapshot (nor its descendants) again; count the reason.

        Args:
            snapshot_id: the snapshot.
            reason: counted as ``quarantined.<reason>``.
        """
        maintenance.quarantine(self._core, snapshot_id, reason)

    def pin(self, snapshot_id: int, pinned: bool = True) -> None:
        """Keep a snapshot from eviction, or with ``pinned=False`` let it go again.

        Args:
            snapshot_id: the snapshot.
            pinned: False unpins; unpinning always works.

        Raises:
            NotFound: no such snapshot.
            InvalidArgument: it is quarantined: never offered again, so a pin would
                only keep its files forever.
        """
        with self._core.write() as conn:
            info = self._core.snapshot(conn, snapshot_id)
            if pinned and info is not None and info.state == "quarantined":
                raise InvalidArgument(
                    f"snapshot {snapshot_id} is quarantined ({info.reason}): it will never be "
                    "restored again, so pinning it would only keep its files forever. Leave "
                    "it: eviction (`sparkcache sweep`) removes quarantined snapshots first"
                )
            conn.execute(q.SET_PINNED, (int(pinned), snapshot_id))
            if conn.changes() != 1:
                raise NotFound(f"no snapshot {snapshot_id}")

    def save_counts(self, *, wait: float = 0.0) -> None:
        """Write the hits and counts kept (``read_into(record_later=True)``).

        Args:
            wait: seconds to wait at most for the index's write lock (0: none);
                past them the write is left to a timer thread or the next write.
                Nothing once closed (closing saved what it could).
        """
        self._core.save_counts(wait=wait)

    def acquire_lease(
        self, snapshot_id: int, *, kind: str = "read", ttl: float = 60.0, holder: str | None = None
    ) -> int:
        """Protect a snapshot from eviction and deletion (docs/architecture.md, "Leases").

        Args:
            snapshot_id: the snapshot.
            kind: what the lease is for (shown by ``sparkcache show``).
            ttl: seconds until it expires; it ends earlier when its holder dies.
            holder: ``host/pid/start-time``; default this process.

        Returns:
            The lease id, for :meth:`release_lease`.

        Raises:
            InvalidArgument: ``ttl`` is not positive.
            NotFound: no such snapshot.
        """
        if not ttl > 0:
            raise InvalidArgument(f"ttl must be positive seconds, got {ttl!r}")
        now = self._core.clock()
        with self._core.write() as conn:
            if self._core.snapshot(conn, snapshot_id) is None:
                raise NotFound(f"no snapshot {snapshot_id}")
            return scalar(conn, q.INSERT_LEASE,
                          (snapshot_id, holder or this_holder(), kind, now, now + ttl))

    def release_lease(self, lease_id: int) -> bool:
        """Release a lease.

        Args:
            lease_id: what :meth:`acquire_lease` returned.

        Returns:
            False when it had already gone.
        """
        with self._core.write() as conn:
            conn.execute(q.DELETE_LEASE, (lease_id,))
            return bool(conn.changes())

    def delete(self, snapshot_id: int, *, force: bool = False) -> list[int]:
        """Delete a snapshot and its descendants (they cannot be restored without it);
        their files go after the commit.

        Args:
            snapshot_id: the snapshot.
            force: delete leased ones too.

        Returns:
            The deleted ids.

        Raises:
            LeaseError: one of them holds an unexpired lease (without ``force``).
        """
        return maintenance.delete_snapshots(self._core, [snapshot_id], force=force,
                                            reason="deleted")

    def evict(
        self, *, model: ModelIdentity | None = None, count: int | None = 1,
        free_bytes: int | None = None, older_than: float | None = None, reason: str = "lru",
    ) -> list[int]:
        """Delete evictable snapshots, quarantined ones first, then least recently
        used; never pinned or leased ones (:func:`sparkcache.maintenance.evict_lru`).

        Args:
            model: only this model's (default: every model's).
            count: stop after this many (None: no count).
            free_bytes: stop once this many bytes are freed.
            older_than: keep the snapshots used since this time.
            reason: counted as ``evictions.<reason>``.

        Returns:
            The deleted ids.
        """
        return maintenance.evict_lru(self._core, model=model, count=count, free_bytes=free_bytes,
                                     older_than=older_than, reason=reason)

    @overload
    def check(self, *, fix: bool = False, dry_run: Literal[False] = False) -> CheckReport: ...
    @overload
    def check(self, *, fix: bool = False, dry_run: Literal[True]) -> DryRun[CheckReport]: ...
    def check(self, *, fix: bool = False,
              dry_run: bool = False) -> CheckReport | DryRun[CheckReport]:
        """Compare the index with the files and the living processes
        (:func:`sparkcache.maintenance.check`).

        Args:
            fix: repair what was found.
            dry_run: rehearse the repair (:func:`sparkcache.rehearsal.run`).

        Returns:
            The report, or with ``dry_run`` the rehearsal's.
        """
        return rehearsal.run(self._core, dry_run, lambda core: maintenance.check(core, fix=fix))

    @overload
    def sweep(self, retention: Retention | None = None, *,
              dry_run: Literal[False] = False) -> SweepReport: ...
    @overload
    def sweep(self, retention: Retention | None = None, *,
              dry_run: Literal[True]) -> DryRun[SweepReport]: ...
    def sweep(self, retention: Retention | None = None, *,
              dry_run: bool = False) -> SweepReport | DryRun[SweepReport]:
        """One retention pass: deleted models, age, disk margin, total (docs/retention.md).

        Args:
            retention: the limits; default the store's own.
            dry_run: rehearse it (:func:`sparkcache.rehearsal.run`).

        Returns:
            The report, or with ``dry_run`` the rehearsal's.

        Raises:
            InvalidArgument: no ``retention`` and the store has none.
        """
        retention = retention or self.retention
        if retention is None:
            raise InvalidArgument("this store has no retention limits; pass retention=")
        return rehearsal.run(self._core, dry_run, retention.sweep)

    @overload
    def clear_model(self, model_id: int, *, keep_pinned: bool = False,
                    dry_run: Literal[False] = False, tenant: str | None = None) -> Cleared: ...
    @overload
    def clear_model(self, model_id: int, *, keep_pinned: bool = False,
                    dry_run: Literal[True], tenant: str | None = None) -> DryRun[Cleared]: ...
    def clear_model(self, model_id: int, *, keep_pinned: bool = False,
                    dry_run: bool = False,
                    tenant: str | None = None) -> Cleared | DryRun[Cleared]:
        """Delete every snapshot of a model but the leased ones and their ancestors
        (:func:`sparkcache.maintenance.clear_model`).

        Args:
            model_id: the model row.
            keep_pinned: keep pinned snapshots (and their ancestors) too.
            dry_run: rehearse it (:func:`sparkcache.rehearsal.run`).
            tenant: only this tenant's snapshots (docs/serve.md, "Tenants").

        Returns:
            (deleted, kept because leased, kept because pinned) ids, or with
            ``dry_run`` the rehearsal's.
        """
        return rehearsal.run(self._core, dry_run, lambda core: maintenance.clear_model(
            core, model_id, keep_pinned=keep_pinned, tenant=tenant))

    @overload
    def delete_model(self, model_id: int, *,
                     dry_run: Literal[False] = False) -> tuple[bool, list[int]]: ...
    @overload
    def delete_model(self, model_id: int, *,
                     dry_run: Literal[True]) -> DryRun[tuple[bool, list[int]]]: ...
    def delete_model(self, model_id: int, *, dry_run: bool = False
                     ) -> tuple[bool, list[int]] | DryRun[tuple[bool, list[int]]]:
        """Delete a model: its snapshots, its row and its folder; leased snapshots stay
        until their leases end, then the sweeper finishes
        (:func:`sparkcache.maintenance.delete_model`).

        Args:
            model_id: the model row.
            dry_run: rehearse it (:func:`sparkcache.rehearsal.run`).

        Returns:
            (whether the model is gone, the snapshot ids that remain), or with
            ``dry_run`` the rehearsal's.

        Raises:
            NotFound: no such model.
        """
        def delete(core: Core) -> tuple[bool, list[int]]:
            complete = maintenance.delete_model(core, model_id)
            remaining = [] if complete else [s.id for s in list_snapshots(core, model_id)]
            return complete, remaining

        return rehearsal.run(self._core, dry_run, delete)

    def verify(self, progress: Progress | None = None) -> VerifyReport:
        """Re-hash every written segment and quarantine the corrupt ones
        (:func:`sparkcache.verification.verify`).

        Args:
            progress: called with (bytes done, bytes in all).
        """
        return verification.verify(self._core, progress)

    def requeue(self) -> RequeueReport:
        """Give back the quarantined snapshots whose files verify whole again
        (:func:`sparkcache.verification.requeue`)."""
        return verification.requeue(self._core, self.alias_stride)

    def start_sweeper(self) -> Sweeper:
        """Run :meth:`sweep` with the store's retention every ``sweep_seconds`` in the
        background, once per host (the connector does, in its scheduler process);
        ``close`` stops it.

        Returns:
            The running :class:`~sparkcache.retention.Sweeper` (the same one on a
            second call).

        Raises:
            InvalidArgument: the store has no retention.
        """
        if self.retention is None:
            raise InvalidArgument("this store has no retention limits: open it with retention=")
        if self._sweeper is None:
            self._sweeper = Sweeper(self._core, self.retention).start()
        return self._sweeper
