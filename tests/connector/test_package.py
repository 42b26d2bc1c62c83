"""The package ``sparkcache.connector`` imports without vLLM or torch: vLLM
resolves ``SparkCacheConnector`` lazily (tests/vllm/test_connector_units.py)."""

from __future__ import annotations

import subprocess
import sys


def test_the_package_imports_without_vllm_or_torch() -> None:
    code = (
        "import sys, sparkcache.connector as c\n"
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
        "assert 'SparkCacheConnector' in dir(c)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
