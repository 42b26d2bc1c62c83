"""The connector's parts that need no engine: settings, lazy import, page copies, identity."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tiny_model import MISSING, SKIP_REASON

from sparkcache.connector.settings import ConnectorSettings
from sparkcache.errors import InvalidArgument

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(MISSING), reason=SKIP_REASON)]


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
    with pytest.raises(InvalidArgument, match="folder"):
        ConnectorSettings.from_extra_config({})


def test_package_imports_without_vllm() -> None:
    """vLLM resolves the class lazily; the package itself must not import vLLM or torch."""
    code = (
        "import sys, sparkcache.connector as c\n"
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
        "assert 'SparkCacheConnector' in dir(c)\n"
        "assert c.SparkCacheConnector.__name__ == 'SparkCacheConnector'\n"
        "assert 'vllm' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_identity_from_a_vllm_spec() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from sparkcache.connector.layout import page_shape_of

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    # The CPU backend's page: [kv_heads, block_size, 2 * head_size] (K and V interleaved).
    assert page_shape_of(spec) == (2, 32, 64)
