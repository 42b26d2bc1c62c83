"""The shared tier: snapshots replicated to object storage that several hosts share.

Each host keeps its own store (its SQLite index is the fast local path); a
shared tier (``s3://bucket/prefix``, ``gs://...``, ``file:///mnt/nfs/...``) is
a second level behind it.  :mod:`~sparkcache.shared.layout` names every object
(docs/shared.md), :mod:`~sparkcache.shared.tier` opens and checks a tier, and
:mod:`~sparkcache.shared.uploader` copies each locally ready snapshot there,
:mod:`~sparkcache.shared.probe` finds a prompt's prefix there and
:mod:`~sparkcache.shared.fetch` makes it local (:mod:`~sparkcache.shared.siblings`:
also one that an engine of another TP size stored), and :mod:`~sparkcache.shared.sweep`
applies the tier's own limits
(budget, age), one host at a time (:mod:`~sparkcache.shared.lease`).
"""

from __future__ import annotations

from sparkcache.shared.fetch import FetchResult, fetch_prefix
from sparkcache.shared.layout import Manifest, parse_manifest
from sparkcache.shared.lease import SweepLease
from sparkcache.shared.siblings import fetch_any_sharding, tier_siblings
from sparkcache.shared.sweep import (
    SharedSweeper,
    TierLimits,
    TierSweepReport,
    mark_used,
    sweep_tier,
)
from sparkcache.shared.tier import SHARED_ENV, SharedTier, check_options, resolve_shared, shared_url
from sparkcache.shared.uploader import (
    DEFAULT_POLL_SECONDS,
    Uploader,
    UploadReport,
    UploadResult,
    pending_uploads,
    upload_pending,
    upload_snapshot,
)

__all__ = [
    "DEFAULT_POLL_SECONDS",
    "SHARED_ENV",
    "FetchResult",
    "Manifest",
    "SharedSweeper",
    "SharedTier",
    "SweepLease",
    "TierLimits",
    "TierSweepReport",
    "UploadReport",
    "UploadResult",
    "Uploader",
    "check_options",
    "fetch_any_sharding",
    "fetch_prefix",
    "mark_used",
    "parse_manifest",
    "pending_uploads",
    "resolve_shared",
    "shared_url",
    "sweep_tier",
    "tier_siblings",
    "upload_pending",
    "upload_snapshot",
]
