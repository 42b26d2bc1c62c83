"""ConnectorSettings: vLLM's ``kv_connector_extra_config``, checked key by key."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkcache.connector.settings import ConnectorSettings
from sparkcache.errors import InvalidArgument
from sparkcache.folder import resolve_folder


def test_settings_from_extra_config(monkeypatch: pytest.MonkeyPatch) -> None:
    s = ConnectorSettings.from_extra_config(
        {"folder": "/x", "mode": "restore-only", "min_tokens": "32", "load_async": "false"}
    )
    assert (s.folder, s.publish, s.restore, s.min_tokens, s.load_async) == (
        "/x", False, True, 32, False)
    default = ConnectorSettings.from_extra_config({"folder": "/x"})
    assert (default.mode, default.publish, default.restore, default.load_async) == (
        "read-write", True, True, True)
    for value, expect in (("auto", None), ("AUTO", None), (True, True), ("on", True),
                          ("0", False)):
        got = ConnectorSettings.from_extra_config({"folder": "/x", "load_async": value})
        assert got.load_async is expect
    assert default.load_threads == 2
    assert ConnectorSettings.from_extra_config({"folder": "/x", "load_threads": "4"}
                                               ).load_threads == 4
    with pytest.raises(InvalidArgument, match="load_threads"):
        ConnectorSettings.from_extra_config({"folder": "/x", "load_threads": 0})
    assert default.staging_mb == 64
    assert ConnectorSettings.from_extra_config({"folder": "/x", "staging_mb": 8}).staging_mb == 8
    with pytest.raises(InvalidArgument, match="staging_mb"):
        ConnectorSettings.from_extra_config({"folder": "/x", "staging_mb": 0})
    with pytest.raises(InvalidArgument, match="true, false or 'auto'"):
        ConnectorSettings.from_extra_config({"folder": "/x", "load_async": "sometimes"})
    assert default.min_tokens is None  # SPARK_KV_CACHE_MIN_TOKENS decides
    for mode, expect in (("store-only", (False, True)), ("off", (False, False)),
                         ("read_write", (True, True))):
        got = ConnectorSettings.from_extra_config({"folder": "/x", "mode": mode})
        assert (got.restore, got.publish) == expect
    with pytest.raises(InvalidArgument, match="mode"):
        ConnectorSettings.from_extra_config({"folder": "/x", "mode": "write-only"})
    with pytest.raises(InvalidArgument, match="unknown sparkcache settings"):
        ConnectorSettings.from_extra_config({"folder": "/x", "publish": False})
    monkeypatch.delenv("SPARK_KV_CACHE_FOLDER", raising=False)
    monkeypatch.setenv("SPARK_STORAGE", "/data")
    assert ConnectorSettings.from_extra_config({}).folder == "/data/kvcache"
    with pytest.raises(InvalidArgument, match="unknown sparkcache settings"):
        ConnectorSettings.from_extra_config({"folder": "/x", "fodler": "/y"})
    with pytest.raises(InvalidArgument, match="min_tokens"):
        ConnectorSettings.from_extra_config({"folder": "/x", "min_tokens": 0})
    monkeypatch.delenv("SPARK_STORAGE")
    # Spark's default, as for retention and the CLI (one resolver: sparkcache.folder).
    assert ConnectorSettings.from_extra_config({}).folder == str(resolve_folder(env={}))
    assert resolve_folder(env={}) == Path.home() / ".local" / "share" / "spark" / "kvcache"
    with pytest.raises(InvalidArgument, match="folder"):
        ConnectorSettings.from_extra_config({"folder": 7})


def test_compute_tokens() -> None:
    """``compute_tokens``: auto (None: the connector decides from the backend)
    or at least one token; anything else is refused, naming the setting."""
    def get(value: object) -> int | None:
        return ConnectorSettings.from_extra_config({"folder": "/x", "compute_tokens": value}
                                                   ).compute_tokens
    assert ConnectorSettings.from_extra_config({"folder": "/x"}).compute_tokens is None
    assert (get("auto"), get("AUTO"), get(1), get("2")) == (None, None, 1, 2)
    for bad in (0, -1, "two", True, 1.5):
        with pytest.raises(InvalidArgument, match=r"compute_tokens.*'auto' or an integer"):
            get(bad)


def test_shared_tier_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPARK_KV_CACHE_SHARED", raising=False)
    default = ConnectorSettings.from_extra_config({"folder": "/x"})
    assert (default.shared, default.shared_options, default.upload_wait_seconds) == (
        None, {}, 30.0)
    s = ConnectorSettings.from_extra_config({
        "folder": "/x", "shared": "s3://kv/llama", "upload_wait_seconds": "5",
        "shared_options": {"endpoint_url": "http://minio:9000"}})
    assert (s.shared, s.shared_options, s.upload_wait_seconds) == (
        "s3://kv/llama", {"endpoint_url": "http://minio:9000"}, 5.0)
    monkeypatch.setenv("SPARK_KV_CACHE_SHARED", "file:///mnt/kv")
    assert ConnectorSettings.from_extra_config({"folder": "/x"}).shared == "file:///mnt/kv"
    assert ConnectorSettings.from_extra_config({"folder": "/x", "shared": "s3://b/p"}
                                               ).shared == "s3://b/p"
    with pytest.raises(InvalidArgument, match="AWS_ACCESS_KEY_ID"):
        ConnectorSettings.from_extra_config({"folder": "/x", "shared_options": {"secret": "s"}})
    with pytest.raises(InvalidArgument, match="shared"):
        ConnectorSettings.from_extra_config({"folder": "/x", "shared": 3})
    assert not s.shared_sweep
    assert ConnectorSettings.from_extra_config({"folder": "/x", "shared_sweep": "true"}
                                               ).shared_sweep
    monkeypatch.delenv("SPARK_KV_CACHE_SHARED")
    with pytest.raises(InvalidArgument, match="give 'shared'"):
        ConnectorSettings.from_extra_config({"folder": "/x", "shared_sweep": True})
    for bad in (-1, "soon", True):
        with pytest.raises(InvalidArgument, match="upload_wait_seconds"):
            ConnectorSettings.from_extra_config({"folder": "/x", "upload_wait_seconds": bad})


def test_cost_model_setting() -> None:
    assert ConnectorSettings.from_extra_config({"folder": "/x"}).cost_model is True
    off = ConnectorSettings.from_extra_config({"folder": "/x", "cost_model": "false"})
    assert off.cost_model is False
    with pytest.raises(InvalidArgument, match="cost_model"):
        ConnectorSettings.from_extra_config({"folder": "/x", "cost_model": "sometimes"})
