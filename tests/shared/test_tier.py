"""Opening a shared tier: checked at start, never a bucket or folder made, recorded
by the store, credentials never in the options or the index."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import apsw
import pytest

from sparkcache import SnapshotStore
from sparkcache.errors import BackendError, InvalidArgument, NotFound, StorageMismatch
from sparkcache.shared import SHARED_ENV, SharedTier, check_options, resolve_shared, shared_url
from sparkcache.shared.layout import TIER_FILE

from ..s3server import S3Server, free_port
from ..store.helpers import identity, pages_for, tokens
from .conftest import Tier

HostFactory = Callable[..., SnapshotStore]


def recorded(folder: Path) -> str | None:
    conn = apsw.Connection(str(folder / "index.sqlite"))
    try:
        rows = conn.execute("SELECT value FROM settings WHERE key = 'shared'").fetchall()
    finally:
        conn.close()
    return None if not rows else str(rows[0][0])


def test_resolve_shared_reads_the_environment() -> None:
    assert resolve_shared(None, {}) is None
    assert resolve_shared(None, {SHARED_ENV: " s3://b/kv "}) == "s3://b/kv"
    assert resolve_shared("file:///x", {SHARED_ENV: "s3://b/kv"}) == "file:///x"
    assert resolve_shared(None, {SHARED_ENV: ""}) is None


def test_shared_url_is_recorded_without_credentials() -> None:
    assert shared_url("s3://user:secret@bucket/kv/") == "s3://bucket/kv"
    assert shared_url("/mnt/../mnt/kv") == "file:///mnt/kv"
    with pytest.raises(InvalidArgument, match="empty"):
        shared_url(" ")


@pytest.mark.parametrize("options", [
    {"key": "AKIA"}, {"secret": "x"}, {"client_kwargs": {"aws_secret_access_key": "x"}},
    {"token": "t"},
])
def test_credentials_in_the_options_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument, match="AWS_ACCESS_KEY_ID"):
        check_options(options)
    assert check_options({"endpoint_url": "http://x", "profile": "p"}) == {
        "endpoint_url": "http://x", "profile": "p"}


def test_a_new_tier_records_the_stride_of_its_first_store(
        s3_tier: Tier, host: HostFactory) -> None:
    first = host("a", s3_tier, alias_stride=16)
    assert first.shared is not None and first.shared.alias_stride == 16
    second = host("b", s3_tier, alias_stride=32)  # the tier's own stride wins
    assert second.shared is not None and second.shared.alias_stride == 16
    assert second.shared.url == shared_url(s3_tier.url)


def test_a_missing_bucket_is_an_error_at_start_and_is_never_created(
        s3: S3Server, tmp_path: Path) -> None:
    missing = "sparkcache-no-such-bucket"
    with pytest.raises(NotFound, match="create the bucket first"):
        SnapshotStore(tmp_path / "a", shared=f"s3://{missing}/kv",
                      shared_options={"endpoint_url": s3.endpoint})
    assert missing not in s3.buckets()
    assert recorded(tmp_path / "a") is None  # nothing was recorded either


def test_an_unreachable_endpoint_is_an_error_at_start(tmp_path: Path) -> None:
    options = {"endpoint_url": f"http://127.0.0.1:{free_port()}",
               "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    started = time.monotonic()
    with pytest.raises(BackendError, match=r"cannot reach the shared tier.*endpoint"):
        SnapshotStore(tmp_path / "a", shared="s3://bucket/kv", shared_options=options)
    assert time.monotonic() - started < 30


def test_bad_credentials_are_an_error_at_start(tmp_path: Path, s3: S3Server) -> None:
    """A server that checks credentials (moto with authentication on) refuses ours."""
    server = S3Server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}, set_env=False)
    try:
        with pytest.raises(BackendError, match=r"denied.*credentials"):
            SnapshotStore(tmp_path / "a", shared="s3://bucket/kv",
                          shared_options={"endpoint_url": server.endpoint})
    finally:
        server.stop()


def test_a_missing_folder_is_an_error_and_is_never_created(tmp_path: Path) -> None:
    folder = tmp_path / "not-mounted" / "kv"
    with pytest.raises(NotFound, match="create it first"):
        SnapshotStore(tmp_path / "a", shared=f"file://{folder}")
    assert not folder.exists() and not folder.parent.exists()


def test_a_foreign_tier_file_is_refused(file_tier: Tier, tmp_path: Path) -> None:
    Path(file_tier.url.removeprefix("file://"), TIER_FILE).write_text('{"format": "mine"}')
    with pytest.raises(InvalidArgument, match="not a sparkcache shared tier"):
        SnapshotStore(tmp_path / "a", shared=file_tier.url)


def test_a_plain_path_is_a_file_tier(tmp_path: Path) -> None:
    (tmp_path / "tier").mkdir()
    tier = SharedTier(str(tmp_path / "tier"), alias_stride=16)
    try:
        assert tier.url == f"file://{tmp_path / 'tier'}"
        assert (tmp_path / "tier" / TIER_FILE).is_file()
    finally:
        tier.close()


def test_the_store_records_its_tier_and_refuses_another(
        s3: S3Server, tmp_path: Path) -> None:
    first = f"s3://{s3.bucket()}/kv"
    second = f"s3://{s3.bucket()}/kv"
    options = {"endpoint_url": s3.endpoint}
    ident = identity()
    toks = tokens(32, seed=3)
    with SnapshotStore(tmp_path / "a", alias_stride=16, shared=first,
                       shared_options=options) as store:
        store.publish(ident, 0, toks, pages_for(ident, toks))
        assert store.upload().uploaded == [1]
    assert recorded(tmp_path / "a") == first
    with pytest.raises(StorageMismatch, match=f"uploads to the shared tier {first}.*relocate"):
        SnapshotStore(tmp_path / "a", shared=second, shared_options=options)
    with SnapshotStore(tmp_path / "a") as store:  # without a tier: not contacted, not changed
        assert store.shared is None
        assert store.snapshot(1).uploaded_at is not None
        with pytest.raises(InvalidArgument, match="without a shared tier"):
            store.upload()
    assert recorded(tmp_path / "a") == first
    with SnapshotStore(tmp_path / "a", shared=f"{first}/", shared_options=options) as store:
        assert store.snapshot(1).uploaded_at is not None  # the same tier, spelled otherwise
    with SnapshotStore(tmp_path / "a", shared=second, shared_options=options,
                       relocate=True) as store:
        assert store.snapshot(1).uploaded_at is None  # to be uploaded to the new tier
        assert store.upload().uploaded == [1]
    assert recorded(tmp_path / "a") == second


def test_a_read_only_open_records_nothing(s3_tier: Tier, tmp_path: Path) -> None:
    SnapshotStore(tmp_path / "a").close()
    with SnapshotStore(tmp_path / "a", upgrade=False, shared=s3_tier.url,
                       shared_options=s3_tier.options) as store:
        assert store.shared is not None
    assert recorded(tmp_path / "a") is None


def test_a_failed_start_leaves_the_store_usable(tmp_path: Path, s3: S3Server) -> None:
    with pytest.raises(NotFound):
        SnapshotStore(tmp_path / "a", shared="s3://sparkcache-no-such-bucket/kv",
                      shared_options={"endpoint_url": s3.endpoint})
    with SnapshotStore(tmp_path / "a") as store:  # the index was closed, not locked
        assert store.snapshots() == []
