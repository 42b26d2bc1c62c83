"""The Uploader thread: woken by publishes, drained at shutdown within its bound,
failures counted and logged once per burst, never in a publish's way."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sparkcache import SnapshotStore
from sparkcache.shared import Uploader
from sparkcache.shared import uploader as uploader_module
from sparkcache.shared.layout import manifest_key

from ..s3server import S3Server
from ..store.helpers import identity, pages_for, tokens
from .conftest import Tier

HostFactory = Callable[..., SnapshotStore]
LOGGER = "sparkcache.shared.uploader"


def publish(store: SnapshotStore, seed: int) -> int:
    ident = identity()
    toks = tokens(32, seed=seed)
    return store.publish(ident, 0, toks, pages_for(ident, toks)).snapshot_id


def in_tier(store: SnapshotStore, snapshot_id: int) -> bool:
    assert store.shared is not None
    key = manifest_key(identity().digest(), store.snapshot(snapshot_id).snap_key)
    return store.shared.exists(key)


def test_a_publish_wakes_the_uploader(tier: Tier, host: HostFactory) -> None:
    store = host("a", tier)
    uploader = store.start_uploader(poll_seconds=60)  # only a wake makes it look
    assert store.start_uploader() is uploader
    assert uploader.drain(10)
    sid = publish(store, 1)
    assert uploader.drain(10)
    assert in_tier(store, sid) and store.snapshot(sid).uploaded_at is not None
    assert uploader.uploaded == 1 and uploader.failures == 0


def test_close_waits_for_what_was_published_just_before(tier: Tier, host: HostFactory,
                                                         tmp_path: Path) -> None:
    """A snapshot another process published just before a clean exit reaches the tier."""
    store = host("a", tier)
    store.start_uploader(wait_seconds=30, poll_seconds=60)
    with SnapshotStore(tmp_path / "a") as worker:  # a worker: no uploader, no wake
        sid = publish(worker, 2)
    started = time.monotonic()
    store.close()
    assert time.monotonic() - started < 20
    with SnapshotStore(tmp_path / "a", shared=tier.url, shared_options=tier.options) as again:
        assert again.snapshot(sid).uploaded_at is not None
        assert in_tier(again, sid)


def test_close_waits_no_longer_than_its_bound(tier: Tier, host: HostFactory,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    store = host("a", tier)
    assert store.shared is not None
    release = threading.Event()
    real_put = store.shared.put

    def slow_put(key: str, chunks):  # type: ignore[no-untyped-def]
        release.wait(30)
        return real_put(key, chunks)

    monkeypatch.setattr(store.shared, "put", slow_put)
    monkeypatch.setattr(uploader_module, "JOIN_GRACE_SECONDS", 0.2)
    uploader = store.start_uploader(wait_seconds=0.3, poll_seconds=60)
    sid = publish(store, 3)
    started = time.monotonic()
    assert uploader.close(0.3) is False  # the queue was not empty
    assert time.monotonic() - started < 5
    assert store.snapshot(sid).uploaded_at is None  # it goes at the next start
    release.set()


def test_failures_are_counted_logged_once_and_never_block_a_publish(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier that goes away: publishes go on at local speed, the uploader counts
    its failures, logs the first of the burst, backs off, and resumes when the
    tier is back."""
    # moto takes any credentials; these make the test not depend on another's
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    server = S3Server(set_env=False)
    bucket = server.bucket()
    options = {"endpoint_url": server.endpoint,
               "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    store = SnapshotStore(tmp_path / "a", alias_stride=16, shared=f"s3://{bucket}/kv",
                          shared_options=options)
    assert store.shared is not None
    uploader = Uploader(store._core, store.shared, poll_seconds=0.05, backoff=(0.05, 0.2))
    try:
        uploader.start()
        first = publish(store, 1)
        assert uploader.drain(10) and store.snapshot(first).uploaded_at is not None
        server.stop()
        with caplog.at_level(logging.INFO, logger=LOGGER):
            started = time.monotonic()
            second = publish(store, 2)
            uploader.wake()
            assert time.monotonic() - started < 1.0  # the publish never waits for the tier
            deadline = time.monotonic() + 30
            while uploader.failures < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert uploader.failures >= 3
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1 and "fail" in warnings[0].getMessage()
            assert store.stats()["upload_failures"] >= 1
            assert store.snapshot(second).uploaded_at is None
            server = S3Server(set_env=False, port=server.port)  # the tier is back
            server.buckets()  # (moto keeps nothing: the bucket is made again)
            import s3fs

            s3fs.S3FileSystem(endpoint_url=server.endpoint).mkdir(bucket)
            # (the uploader logs its recovery once the upload that marked the
            # snapshot uploaded has returned: wait for both)

            def recovered() -> bool:
                return any("work again" in r.getMessage() for r in caplog.records)

            deadline = time.monotonic() + 30
            while (store.snapshot(second).uploaded_at is None or not recovered()) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            assert store.snapshot(second).uploaded_at is not None
            assert recovered()
    finally:
        uploader.close()
        store.close()
        server.stop()


def test_a_refused_snapshot_does_not_keep_the_uploader_busy(
        tier: Tier, host: HostFactory) -> None:
    store = host("a", tier)
    sid = publish(store, 4)
    with store._core.read() as conn:
        (g,) = store._core.segments(conn, sid)
    path = store.root / g.object_key
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))
    uploader = store.start_uploader(poll_seconds=0.05)
    assert uploader.drain(10)
    assert store.snapshot(sid).state == "quarantined"
    passes = uploader.passes
    time.sleep(0.3)
    assert uploader.passes - passes < 20  # polling, not spinning
