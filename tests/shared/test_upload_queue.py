"""A snapshot whose upload keeps failing at the head of the queue does not hold
up the snapshots behind it, synchronously or in the Uploader thread.

The failing head is a real one: a snapshot of 4 MiB sent through a throttling
TCP proxy on 127.0.0.1 (``DelayProxy``: every piece held 50 ms), to a tier
whose requests end within 1 s; the small snapshots behind it go in time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from sparkcache import SnapshotStore
from sparkcache.shared import SharedTier, Uploader, pending_uploads, upload_pending

from ..s3server import DelayProxy, S3Server
from ..store.helpers import identity, pages_for, tokens

HostFactory = Callable[..., SnapshotStore]
BIG = identity(model="big")


@pytest.fixture
def throttled(s3: S3Server) -> Iterator[SharedTier]:
    url = f"s3://{s3.bucket()}/kv"
    proxy = DelayProxy(s3.port, 0.0)
    # The tier's open writes its layout, and its first request builds the
    # HTTP session (moto's first answers are slow too): done under the usual
    # deadline, which is then cut to 1 s, so that only the uploads meet it.
    tier = SharedTier(url, {"endpoint_url": proxy.endpoint}, alias_stride=16)
    tier.backend.request_seconds = 1
    proxy.delay = 0.05
    yield tier
    proxy.stop()


def with_a_big_head(store: SnapshotStore) -> tuple[int, list[int]]:
    """A snapshot of 4 MiB first in the queue, then three small ones."""
    n = (4 << 20) // (BIG.page_nbytes * BIG.num_layers) * BIG.block_size
    toks = tokens(n, seed=7)
    rng = np.random.default_rng(7)
    pages = [rng.integers(0, 256, (n // BIG.block_size, BIG.page_nbytes), np.uint8)
             for _ in range(BIG.num_layers)]
    big = store.publish(BIG, 0, toks, pages).snapshot_id
    small = []
    for seed in (1, 2, 3):
        toks = tokens(32, seed=seed)
        small.append(store.publish(identity(), 0, toks, pages_for(identity(), toks))
                     .snapshot_id)
    return big, small


def test_upload_pending_goes_past_a_head_that_fails(
        throttled: SharedTier, host: HostFactory) -> None:
    store = host("a", None)
    big, small = with_a_big_head(store)
    report = upload_pending(store._core, throttled)
    assert report.failed == [big] and report.error is not None
    assert "no answer in time" in report.error
    assert sorted(report.uploaded) == small and report.pending == 1
    assert store.stats()["upload_failures"] == 1


def test_the_uploader_goes_past_a_head_that_fails(
        throttled: SharedTier, host: HostFactory) -> None:
    store = host("a", None)
    big, small = with_a_big_head(store)
    uploader = Uploader(store._core, throttled, poll_seconds=0.05, backoff=(30.0, 60.0))
    uploader.start()
    try:
        deadline = time.monotonic() + 60
        while pending_uploads(store._core) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pending_uploads(store._core) == 1
        assert store.snapshot(big).uploaded_at is None
        assert all(store.snapshot(s).uploaded_at is not None for s in small)
        assert uploader.failures >= 1 and uploader.running
    finally:
        uploader.close()
