"""A tier that accepts connections and never answers costs one deadline per
operation, never botocore's attempts x s3fs's retries x the read timeout.

The silent endpoint is a TCP proxy on 127.0.0.1 (``DelayProxy``) in front of
moto's S3 server that holds what a client sends: first without delay (the
tier opens and works), then forever.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from sparkcache import SnapshotStore
from sparkcache.backends import deadline
from sparkcache.errors import BackendError
from sparkcache.shared import SharedTier, upload_pending
from sparkcache.shared.fetch import fetch_prefix

from ..s3server import DelayProxy, S3Server
from ..store.helpers import identity
from .test_upload import publish_chain

HostFactory = Callable[..., SnapshotStore]
IDENT = identity()
SILENT = 3600.0


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[DelayProxy]:
    p = DelayProxy(s3.port, 0.0)
    yield p
    p.stop()


def test_opening_a_silent_tier_takes_one_deadline(s3: S3Server, proxy: DelayProxy) -> None:
    bucket = s3.bucket()
    proxy.delay = SILENT
    started = time.monotonic()
    with pytest.raises(BackendError, match="check the endpoint"):
        SharedTier(f"s3://{bucket}/kv", {"endpoint_url": proxy.endpoint}, alias_stride=16,
                   open_seconds=2, request_seconds=1)
    assert time.monotonic() - started < 6


def test_each_request_to_a_silent_tier_ends_at_its_bound(
        s3: S3Server, proxy: DelayProxy, host: HostFactory) -> None:
    """Upload, fetch, listing and a request under a spent deadline: each ends
    within about one request's bound, a BackendError that says what to check."""
    url = f"s3://{s3.bucket()}/kv"
    a = host("a", None)
    publish_chain(a)
    direct = SharedTier(url, {"endpoint_url": s3.endpoint}, alias_stride=16)
    assert upload_pending(a._core, direct).error is None
    b = host("b", None)
    publish_chain(b, seed=2)
    tier = SharedTier(url, {"endpoint_url": proxy.endpoint}, alias_stride=16,
                      request_seconds=1)
    proxy.delay = SILENT
    started = time.monotonic()
    report = upload_pending(b._core, tier)
    assert report.error is not None and "no answer in time" in report.error
    assert report.pending == 2 and time.monotonic() - started < 8
    started = time.monotonic()
    with pytest.raises(BackendError, match="no answer in time"):
        fetch_prefix(b._core, tier, IDENT, a.snapshot(2).n_tokens * [0], scope=None,
                     alias_stride=16, max_chain=8, policy=None)
    assert time.monotonic() - started < 4
    started = time.monotonic()
    with pytest.raises(BackendError):
        tier.backend.stat_list()
    assert time.monotonic() - started < 4
    with deadline(0.0), pytest.raises(BackendError, match="deadline passed"):
        tier.exists("tier.json")
    proxy.delay = 0.0  # it answers again: so does the tier
    assert tier.exists("tier.json")
    assert upload_pending(b._core, tier).error is None
