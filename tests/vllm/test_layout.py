"""sparkcache.connector.layout against vLLM itself (no engine): the page shape of a vLLM spec.

The settings and the package's lazy import are tested in tests/connector."""

from __future__ import annotations

import pytest
from tiny_model import MISSING, SKIP_REASON

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(MISSING), reason=SKIP_REASON)]


def test_identity_from_a_vllm_spec() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from sparkcache.connector.layout import page_shape_of

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    # The CPU backend's page: [kv_heads, block_size, 2 * head_size] (K and V interleaved).
    assert page_shape_of(spec) == (2, 32, 64)
