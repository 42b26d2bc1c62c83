"""The connector's parts that need no engine: settings, lazy import, page copies, identity."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
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


def test_pages_round_trip_on_a_strided_layer_view() -> None:
    """Layers are strided views into one allocation, as vLLM's allocate_kv_cache makes them."""
    import torch

    from sparkcache.connector.pages import LayerPages

    layers, blocks, page = 2, 6, (2, 32, 64)
    raw = torch.zeros(blocks, layers, *page, dtype=torch.bfloat16)  # block-outermost buffer
    caches = {f"model.layers.{i}.self_attn.attn": raw[:, i] for i in (1, 0)}
    pages = LayerPages(caches)
    assert pages.names == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert (pages.num_blocks, pages.page_nbytes) == (blocks, 2 * 32 * 64 * 2)
    src = [np.random.default_rng(i).integers(0, 255, (3, pages.page_nbytes), np.uint8)
           for i in range(layers)]
    pages.scatter([4, 0, 2], src)
    back = pages.gather([4, 0, 2])
    for a, b in zip(src, back, strict=True):
        np.testing.assert_array_equal(a, b)
    # The bytes landed in the tensor itself, in the right blocks and layers.
    got = raw[0, 1].contiguous().view(torch.uint8).numpy().reshape(-1)
    np.testing.assert_array_equal(got, src[1][1])
    assert not raw[1].any() and not raw[3].any() and not raw[5].any()
    with pytest.raises(InvalidArgument, match="out of range"):
        pages.gather([blocks])
    # Block-outermost: a layer's blocks are not one run of bytes (restores stage).
    assert pages.run_views(0, 2) is None
    # Layer-outermost (vLLM's CPU layout): runs of blocks are read into directly.
    dense = LayerPages({f"model.layers.{i}.self_attn.attn": t for i, t in
                        enumerate(torch.zeros(layers, blocks, *page, dtype=torch.bfloat16))})
    runs = dense.run_views(2, 3)
    assert runs is not None and runs[1].size == 3 * dense.page_nbytes
    runs[1][:] = 7
    assert dense.gather([2, 3, 4])[1].min() == 7 and not dense.gather([1, 5])[1].any()


def test_identity_from_a_vllm_spec() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from sparkcache.connector.layout import page_shape_of

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    # The CPU backend's page: [kv_heads, block_size, 2 * head_size] (K and V interleaved).
    assert page_shape_of(spec) == (2, 32, 64)
