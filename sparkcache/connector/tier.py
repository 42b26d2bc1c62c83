"""The scheduler process's services of a shared tier (docs/shared.md): the
uploader of this host's snapshots, the tier's sweeper and the fetches a
request may wait for, on a store of their own."""

from __future__ import annotations

import logging

from sparkcache.connector.fetcher import Fetcher
from sparkcache.connector.jobs import Counters
from sparkcache.connector.scheduler import SchedulerSide
from sparkcache.connector.settings import ConnectorSettings
from sparkcache.identity import ModelIdentity
from sparkcache.retention import Retention
from sparkcache.shared import SharedSweeper, TierLimits
from sparkcache.store import SnapshotStore

__all__ = ["TierServices"]

logger = logging.getLogger("vllm.sparkcache")


class TierServices:
    """Started on the scheduler side when a shared tier is set; :meth:`close`
    stops the sweeper and the fetches, then the uploader after up to
    ``upload_wait_seconds`` for its queue."""

    def __init__(self, settings: ConnectorSettings, shared: str, identity: ModelIdentity,
                 counters: Counters, retention: Retention, sched: SchedulerSide) -> None:
        # Its own store; opening it checks the tier (endpoint, credentials,
        # bucket): a mistake is an error now, not failed uploads later.
        self.store = SnapshotStore(settings.folder, shared=shared,
                                   shared_options=settings.shared_options, retention=retention)
        self.sweeper: SharedSweeper | None = None
        self.fetcher: Fetcher | None = None
        self.store.start_uploader(wait_seconds=settings.upload_wait_seconds)
        logger.info("sparkcache uploads this host's snapshots to the shared tier %s", shared)
        if settings.shared_sweep and self.store.shared is not None:
            # The limits are read now: a bad value stops the engine at start.
            self.sweeper = SharedSweeper(self.store.shared, TierLimits.from_env()).start()
        if settings.shared_fetch and settings.restore:
            # (A sliding-window model fetches only snapshots ending where the
            # request can restore one: shared.probe.probe_ends.)
            self.fetcher = Fetcher(self.store, identity, counters,
                                   deadline=settings.shared_deadline_seconds,
                                   min_tokens=sched.min_tokens,
                                   total_kv_heads=sched.restores.total_kv_heads)
            sched.use_tier(self.fetcher, shared, settings.shared_options.get("endpoint_url"))

    def close(self) -> None:
        """Stop the tier's sweeper and the fetches, then the uploader (its store)."""
        if self.sweeper is not None:
            self.sweeper.stop()
        if self.fetcher is not None:
            self.fetcher.close()
        self.store.close()
