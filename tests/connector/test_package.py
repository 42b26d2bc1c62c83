"""The package ``sparkcache.connector`` imports without vLLM or torch; vLLM's
base class is imported only when ``SparkCacheConnector`` is first accessed.

Each case runs in a fresh interpreter: what is in ``sys.modules`` is the point.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

WITHOUT_VLLM = (
    "import sys, sparkcache.connector as c\n"
    "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    "assert 'SparkCacheConnector' in dir(c)\n"
)
LAZY_CLASS = (
    "import sys, sparkcache.connector as c\n"
    "assert c.SparkCacheConnector.__name__ == 'SparkCacheConnector'\n"
    "assert 'vllm' in sys.modules\n"
)
NEEDS_VLLM = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM (bash scripts/install-vllm.sh)")]


@pytest.mark.parametrize("code", [
    pytest.param(WITHOUT_VLLM, id="without-vllm"),
    pytest.param(LAZY_CLASS, id="lazy-class", marks=NEEDS_VLLM),
])
def test_the_package_imports_vllm_only_for_the_connector_class(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
